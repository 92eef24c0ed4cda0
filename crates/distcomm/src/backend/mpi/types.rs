//! Element types, operators and buffers as MPI takes them.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use mpi::ffi;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Reducible};

/// Sums and products of 8-bit integers go to MPI as i32 (`None` for every other type and
/// operator): Open MPI's 8-bit sums saturate, where distcomm's wrap, so they are computed
/// wide and wrapped on the way back ([`i32_to_bytes`]).
pub(super) fn bytes_as_i32<T: Reducible>(x: &[T], op: ReduceOp) -> Option<Vec<i32>> {
    if !matches!(op, ReduceOp::Sum | ReduceOp::Product | ReduceOp::Avg) {
        return None;
    }
    match T::DTYPE {
        DType::I8 => Some(
            bytemuck::cast_slice::<T, i8>(x)
                .iter()
                .map(|&v| i32::from(v))
                .collect(),
        ),
        DType::U8 => Some(
            bytemuck::cast_slice::<T, u8>(x)
                .iter()
                .map(|&v| i32::from(v))
                .collect(),
        ),
        _ => None,
    }
}

/// Wraps i32 results back into 8-bit elements.
pub(super) fn i32_to_bytes<T: Reducible>(dst: &mut [T], src: &[i32]) {
    for (d, s) in bytemuck::cast_slice_mut::<T, u8>(dst).iter_mut().zip(src) {
        *d = *s as u8;
    }
}

/// Integer averages are wrapped sums divided at the end.
pub(super) fn sum_for_avg(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
}

/// The library's `MPI_IN_PLACE` marker, which rsmpi does not export: `(void *) 1` in
/// Open MPI, `(void *) -1` in MPICH and its derivatives (Intel MPI, MVAPICH, MS-MPI), read
/// from `MPI_Get_library_version`. Unknown libraries get `None`: reductions then send a
/// copy of the input instead.
pub(super) fn in_place() -> Option<*mut c_void> {
    static MARKER: OnceLock<Option<usize>> = OnceLock::new();
    let m = MARKER.get_or_init(|| {
        let mut buf = vec![0u8; 8192];
        let mut len: c_int = 0;
        // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING in every
        // implementation (Open MPI: 256, MPICH: 8192).
        unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
        let v = String::from_utf8_lossy(&buf[..len.clamp(0, 8192) as usize]).into_owned();
        if v.contains("Open MPI") {
            Some(1)
        } else if ["MPICH", "Intel(R) MPI", "MVAPICH", "Microsoft MPI"]
            .iter()
            .any(|k| v.contains(k))
        {
            Some(usize::MAX)
        } else {
            None
        }
    });
    m.map(|v| v as *mut c_void)
}

pub(super) fn too_big(op: &'static str, rank: usize, n: usize) -> Error {
    Error::InvalidArgument {
        op,
        rank,
        detail: format!(
            "{n} elements: the MPI backend sends at most {} per message",
            c_int::MAX
        ),
    }
}

pub(super) fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading rsmpi's exported handles to MPI's predefined datatypes.
    unsafe {
        match d {
            DType::Bytes | DType::U8 => ffi::RSMPI_UINT8_T,
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::I16 => ffi::RSMPI_INT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

pub(super) fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading rsmpi's exported handles to MPI's predefined operations.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
            ReduceOp::Product => ffi::RSMPI_PROD,
            ReduceOp::Min => ffi::RSMPI_MIN,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::BAnd => ffi::RSMPI_BAND,
            ReduceOp::BOr => ffi::RSMPI_BOR,
            ReduceOp::BXor => ffi::RSMPI_BXOR,
        }
    }
}

/// Where an empty buffer points: Rust's dangling pointer of an empty slice can be exactly
/// a library's `MPI_IN_PLACE` (`(void *) 1` in Open MPI), so empty buffers point here
/// instead (MPI reads and writes nothing through it: the count is 0).
pub(super) static EMPTY: [u64; 1] = [0];

/// A byte buffer's address for MPI (see [`EMPTY`]).
pub(super) fn bytes_ptr(x: &[u8]) -> *const c_void {
    if x.is_empty() {
        EMPTY.as_ptr().cast()
    } else {
        x.as_ptr().cast()
    }
}

pub(super) fn raw<T: Reducible>(x: &[T]) -> Result<(*const c_void, c_int, ffi::MPI_Datatype)> {
    let n = c_int::try_from(x.len()).map_err(|_| too_big("collective", 0, x.len()))?;
    let p = if x.is_empty() {
        EMPTY.as_ptr().cast()
    } else {
        x.as_ptr().cast()
    };
    Ok((p, n, datatype(T::DTYPE)))
}

pub(super) fn raw_mut<T: Reducible>(
    x: &mut [T],
) -> Result<(*mut c_void, c_int, ffi::MPI_Datatype)> {
    let n = c_int::try_from(x.len()).map_err(|_| too_big("collective", 0, x.len()))?;
    let p = if x.is_empty() {
        EMPTY.as_ptr().cast_mut().cast()
    } else {
        x.as_mut_ptr().cast()
    };
    Ok((p, n, datatype(T::DTYPE)))
}
