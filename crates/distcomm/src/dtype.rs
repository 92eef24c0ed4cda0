//! Element types that travel over the wire.

use std::fmt;

/// The element type of a buffer, carried in every message header so that a receiver can refuse
/// data of the wrong type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// Untyped bytes: a raw receive accepts any sender type.
    Bytes = 0,
    U8 = 1,
    I8 = 2,
    I32 = 3,
    I64 = 4,
    F16 = 5,
    BF16 = 6,
    F32 = 7,
    F64 = 8,
    I16 = 9,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::Bytes | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Decodes the wire byte; `None` for unknown values.
    pub fn from_wire(b: u8) -> Option<DType> {
        Some(match b {
            0 => DType::Bytes,
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I32,
            4 => DType::I64,
            5 => DType::F16,
            6 => DType::BF16,
            7 => DType::F32,
            8 => DType::F64,
            9 => DType::I16,
            _ => return None,
        })
    }

    /// Name as users of torch would write it.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bytes => "bytes",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I16 => "i16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An element type distcomm can send: plain old data with a wire type.
///
/// Implemented for `u8`, `i8`, `i16`, `i32`, `i64`, `f32`, `f64`, [`half::f16`] and [`half::bf16`]
/// (the `half` crate is re-exported as [`distcomm::half`](crate::half), so 16-bit floats need no
/// dependency of their own). Sealed: the wire type must describe the memory exactly.
///
/// ```
/// use distcomm::half::{bf16, f16};
/// use distcomm::{DType, Element};
/// assert_eq!(<f16 as Element>::DTYPE, DType::F16);
/// assert_eq!(<bf16 as Element>::DTYPE.size(), 2);
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an element type distcomm can send",
    note = "element types: u8, i8, i16, i32, i64, f32, f64, distcomm::half::f16, distcomm::half::bf16 (a Vec or slice of one of them)"
)]
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed + 'static {
    /// The wire type of this element.
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $t {}
            impl Element for $t {
                const DTYPE: DType = DType::$d;
            }
        )*
    };
}

element!(
    u8 => U8,
    i8 => I8,
    i16 => I16,
    i32 => I32,
    i64 => I64,
    f32 => F32,
    f64 => F64,
    half::f16 => F16,
    half::bf16 => BF16,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_roundtrip_and_sizes() {
        for b in 0..=255u8 {
            if let Some(d) = DType::from_wire(b) {
                assert_eq!(d as u8, b);
            }
        }
        assert_eq!(<half::bf16 as Element>::DTYPE.size(), 2);
        assert_eq!(<f64 as Element>::DTYPE.size(), 8);
        assert!(DType::from_wire(10).is_none());
    }
}
