//! Reduction operators and their kernels.
//!
//! Each kernel matches on the operator once, outside the loop, and the loop body is a plain
//! element-wise expression over two slices, so the compiler vectorises it (no per-element
//! dynamic dispatch). Integer arithmetic wraps on overflow (as two's-complement hardware and
//! NCCL do) rather than panicking.
//!
//! * `f16`/`bf16`: collectives reduce them in `f32` and round once at the end. The
//!   shared-memory arena, and large all_reduces, reduce_scatters and reduces over the network,
//!   move them at 16 bits and reduce all ranks' inputs at once in `f32` registers
//!   ([`Reducible::reduce_all`]; the vectorised kernels are in `half_kernels`); the other
//!   network algorithms widen them and move `f32`. See [`ReduceOp`].
//! * `Avg` on integers: the wrapping sum divided by the number of ranks, rounded toward zero.

use crate::dtype::Element;

mod half_kernels;

/// How values are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Product,
    Min,
    Max,
    /// Sum divided by the number of contributing ranks (integers: rounded toward zero).
    Avg,
    /// Bitwise and (integer types only).
    BAnd,
    /// Bitwise or (integer types only).
    BOr,
    /// Bitwise xor (integer types only).
    BXor,
}

impl ReduceOp {
    /// Name as in torch (`SUM`, `AVG`, ...), lower case.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
        }
    }

    /// Whether this is a bitwise operator.
    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }
}

/// Element types that can be reduced: every [`Element`] (16-bit floats are reduced in f32).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an element type distcomm can reduce",
    note = "element types: u8, i8, i16, i32, i64, f32, f64, distcomm::half::f16, distcomm::half::bf16"
)]
pub trait Reducible: Element {
    /// Whether bitwise operators apply.
    const INTEGER: bool;
    /// `dst[i] = dst[i] op src[i]`. `Avg` combines like `Sum`; [`Reducible::finish_avg`] divides.
    fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp);
    /// Divides every element by `n` (the end of an average).
    fn finish_avg(buf: &mut [Self], n: usize);
    /// Whether collectives reduce this type in `f32` (16-bit floats: they round once, at the
    /// end).
    const WIDENS: bool = false;
    /// Converts `src` into `dst` (of the same length) as `f32` (16-bit floats only).
    fn widen_into(_src: &[Self], _dst: &mut [f32]) {}
    /// For 16-bit floats: the values widened to `f32` in a new vector. `None` for every other
    /// type.
    fn widen(buf: &[Self]) -> Option<Vec<f32>> {
        Self::WIDENS.then(|| {
            let mut wide = vec![0.0; buf.len()];
            Self::widen_into(buf, &mut wide);
            wide
        })
    }
    /// Rounds `src` back into `dst` (16-bit floats only).
    fn narrow(_dst: &mut [Self], _src: &[f32]) {}
    /// `out[i] = src(0)[i] op src(1)[i] op … op src(n - 1)[i]`, in rank order (the common
    /// prefix where lengths differ; `out` aliases no source). 16-bit floats combine in `f32`
    /// and round once, `Avg` dividing by `n` before the rounding, so the result is bit for bit
    /// what widening, [`Reducible::reduce_into`] in `f32`, [`Reducible::finish_avg`] and
    /// [`Reducible::narrow`] give. Other types combine `Avg` like `Sum` and leave the division
    /// to [`Reducible::finish_avg`].
    fn reduce_all<'a>(out: &mut [Self], n: usize, src: &dyn Fn(usize) -> &'a [Self], op: ReduceOp)
    where
        Self: 'a,
    {
        if n == 0 {
            return;
        }
        let first = src(0);
        let k = out.len().min(first.len());
        out[..k].copy_from_slice(&first[..k]);
        for r in 1..n {
            Self::reduce_into(&mut out[..k], src(r), op);
        }
    }
}

macro_rules! float_kernels {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            const INTEGER: bool = false;
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                let it = dst.iter_mut().zip(src);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(d, s)| *d += *s),
                    ReduceOp::Product => it.for_each(|(d, s)| *d *= *s),
                    ReduceOp::Min => it.for_each(|(d, s)| *d = d.min(*s)),
                    ReduceOp::Max => it.for_each(|(d, s)| *d = d.max(*s)),
                    // Refused before any data moves (see `check_op`).
                    ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {}
                }
            }
            fn finish_avg(buf: &mut [Self], n: usize) {
                let k = n as $t;
                buf.iter_mut().for_each(|x| *x /= k);
            }
        }
    )*};
}

macro_rules! int_kernels {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            const INTEGER: bool = true;
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                let it = dst.iter_mut().zip(src);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(d, s)| *d = d.wrapping_add(*s)),
                    ReduceOp::Product => it.for_each(|(d, s)| *d = d.wrapping_mul(*s)),
                    ReduceOp::Min => it.for_each(|(d, s)| *d = (*d).min(*s)),
                    ReduceOp::Max => it.for_each(|(d, s)| *d = (*d).max(*s)),
                    ReduceOp::BAnd => it.for_each(|(d, s)| *d &= *s),
                    ReduceOp::BOr => it.for_each(|(d, s)| *d |= *s),
                    ReduceOp::BXor => it.for_each(|(d, s)| *d ^= *s),
                }
            }
            fn finish_avg(buf: &mut [Self], n: usize) {
                // n is a world size, far inside every integer type's range except i8 for
                // worlds over 127, where the average of i8 values is then 0.
                let k = <$t>::try_from(n).unwrap_or(<$t>::MAX);
                buf.iter_mut().for_each(|x| *x = x.wrapping_div(k));
            }
        }
    )*};
}

float_kernels!(f32, f64);
int_kernels!(u8, i8, i16, i32, i64);

macro_rules! half_kernels {
    ($($t:ty: $widen:ident, $narrow:ident, $reduce_all:ident);*) => {$(
        /// `reduce_into` is a two-operand combine (rounding each time); collectives reduce in
        /// f32 and round once ([`Reducible::reduce_all`], or widened).
        impl Reducible for $t {
            const INTEGER: bool = false;
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                for (d, s) in dst.iter_mut().zip(src) {
                    let mut a = [d.to_f32()];
                    f32::reduce_into(&mut a, &[s.to_f32()], op);
                    *d = <$t>::from_f32(a[0]);
                }
            }
            fn finish_avg(buf: &mut [Self], n: usize) {
                buf.iter_mut().for_each(|x| *x = <$t>::from_f32(x.to_f32() / n as f32));
            }
            const WIDENS: bool = true;
            // Vectorised (see `half_kernels`), bit for bit `half`'s scalar conversions. (They
            // convert the common prefix where lengths differ; callers pass equal ones.)
            fn widen_into(src: &[Self], dst: &mut [f32]) {
                half_kernels::$widen(src, dst);
            }
            fn narrow(dst: &mut [Self], src: &[f32]) {
                half_kernels::$narrow(src, dst);
            }
            fn reduce_all<'a>(
                out: &mut [Self],
                n: usize,
                src: &dyn Fn(usize) -> &'a [Self],
                op: ReduceOp,
            ) where
                Self: 'a,
            {
                half_kernels::$reduce_all(out, n, src, op);
            }
        }
    )*};
}

half_kernels!(
    half::f16: f16_to_f32, f32_to_f16, f16_reduce_all;
    half::bf16: bf16_to_f32, f32_to_bf16, bf16_reduce_all
);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn int_ops_match_scalar(a in proptest::collection::vec(any::<i32>(), 0..300), seed: i32) {
            let b: Vec<i32> = a.iter().map(|x| x.wrapping_mul(31).wrapping_add(seed)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
                let mut d = a.clone();
                i32::reduce_into(&mut d, &b, op);
                for i in 0..a.len() {
                    let want = match op {
                        ReduceOp::Sum => a[i].wrapping_add(b[i]),
                        ReduceOp::Product => a[i].wrapping_mul(b[i]),
                        ReduceOp::Min => a[i].min(b[i]),
                        ReduceOp::Max => a[i].max(b[i]),
                        ReduceOp::BAnd => a[i] & b[i],
                        ReduceOp::BOr => a[i] | b[i],
                        _ => a[i] ^ b[i],
                    };
                    prop_assert_eq!(d[i], want);
                }
            }
        }
    }

    proptest! {
        // The slice conversions (hardware where there is some) agree with the scalar ones on
        // every value: bit for bit, NaN for NaN.
        #[test]
        fn half_widen_and_narrow_match_scalar(bits in proptest::collection::vec(any::<u32>(), 0..300)) {
            let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            let h: Vec<half::f16> = bits.iter().map(|&b| half::f16::from_bits(b as u16)).collect();
            let g: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b as u16)).collect();
            let mut wide = vec![0f32; bits.len()];
            half::f16::widen_into(&h, &mut wide);
            for (w, x) in wide.iter().zip(&h) { prop_assert!(same(*w, x.to_f32())); }
            half::bf16::widen_into(&g, &mut wide);
            for (w, x) in wide.iter().zip(&g) { prop_assert!(same(*w, x.to_f32())); }
            let f: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let mut h2 = vec![half::f16::ZERO; f.len()];
            half::f16::narrow(&mut h2, &f);
            for (n, x) in h2.iter().zip(&f) {
                let want = half::f16::from_f32(*x);
                prop_assert!(n.to_bits() == want.to_bits() || (n.is_nan() && want.is_nan()));
            }
            let mut g2 = vec![half::bf16::ZERO; f.len()];
            half::bf16::narrow(&mut g2, &f);
            for (n, x) in g2.iter().zip(&f) {
                let want = half::bf16::from_f32(*x);
                prop_assert!(n.to_bits() == want.to_bits() || (n.is_nan() && want.is_nan()));
            }
        }
    }

    #[test]
    fn averages() {
        let mut v = vec![7i32, -7, 9];
        i32::finish_avg(&mut v, 2);
        assert_eq!(v, vec![3, -3, 4]);
        let mut f = vec![3.0f64];
        f64::finish_avg(&mut f, 2);
        assert_eq!(f, vec![1.5]);
    }
}
