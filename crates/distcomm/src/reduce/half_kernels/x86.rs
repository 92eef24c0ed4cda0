//! The f16 and bf16 kernels with x86 vector instructions (F16C, AVX, AVX2), chosen at run time
//! by `half_kernels`' dispatchers; each gives the bits of the portable code beside them.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

/// # Safety
/// The CPU must have F16C and AVX.
#[target_feature(enable = "avx,f16c")]
#[inline]
pub(super) unsafe fn f16_widen(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n, so 8 elements of both slices are in bounds; the loads and
        // stores are unaligned ones; the caller guarantees F16C and AVX.
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8(src, i)) };
        i += 8;
    }
    super::f16_widen_portable(&src[i..n], &mut dst[i..n]);
}

/// # Safety
/// The CPU must have F16C and AVX.
#[target_feature(enable = "avx,f16c")]
#[inline]
pub(super) unsafe fn f16_narrow(src: &[f32], dst: &mut [f16]) {
    // SAFETY: F16C and AVX, as the caller guarantees.
    unsafe { narrow_div(src, dst, None) }
}

/// `src`, each divided by `div` when given, rounded to f16 into `dst` (the common prefix):
/// [`store8`] over whole groups of eight, [`finish1`] over the tail.
///
/// # Safety
/// The CPU must have F16C and AVX.
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn narrow_div(src: &[f32], dst: &mut [f16], div: Option<f32>) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: as in `f16_widen`.
        unsafe { store8(dst, i, _mm256_loadu_ps(src.as_ptr().add(i)), div) };
        i += 8;
    }
    for j in i..n {
        dst[j] = finish1(src[j], div);
    }
}

/// `a + b`, or `a * b` for a product: what `f32`'s operators give, lane by lane.
///
/// # Safety
/// The CPU must have AVX.
#[target_feature(enable = "avx")]
#[inline]
unsafe fn combine8(a: __m256, b: __m256, product: bool) -> __m256 {
    if product {
        _mm256_mul_ps(a, b)
    } else {
        _mm256_add_ps(a, b)
    }
}

/// Elements `i..i + 8` of `s`, widened.
///
/// # Safety
/// `i + 8 <= s.len()`; the CPU must have F16C and AVX.
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn load8(s: &[f16], i: usize) -> __m256 {
    // SAFETY: in bounds as the caller promises; an unaligned load.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(s.as_ptr().add(i).cast()) })
}

/// `x`, divided by `div` when given, rounded to f16 into elements `i..i + 8` of `o`.
///
/// # Safety
/// `i + 8 <= o.len()`; the CPU must have F16C and AVX.
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn store8(o: &mut [f16], i: usize, x: __m256, div: Option<f32>) {
    let x = match div {
        Some(k) => _mm256_div_ps(x, _mm256_set1_ps(k)),
        None => x,
    };
    let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
    // SAFETY: in bounds as the caller promises; an unaligned store.
    unsafe { _mm_storeu_si128(o.as_mut_ptr().add(i).cast(), h) };
}

/// `a + b`, or `a * b` for a product: [`combine8`] for one element (the tails).
#[inline(always)]
fn combine1(a: f32, b: f32, product: bool) -> f32 {
    if product {
        a * b
    } else {
        a + b
    }
}

/// `x`, divided by `div` when given, rounded to f16: [`store8`] for one element.
#[inline(always)]
fn finish1(x: f32, div: Option<f32>) -> f16 {
    f16::from_f32(div.map_or(x, |k| x / k))
}

/// The f16 sum (or product, `product`) of the `n` sources of `src`, divided by `div` when
/// given, rounded once into `out` (the common prefix where lengths differ): element by
/// element the operations of `super::reduce_all_body`, in the same order, so the same
/// bits; eight elements at a time in registers instead of its passes over scratch
/// blocks. Two sources take one pass; one or more than two go in blocks
/// ([`f16_fused_blocks`]).
///
/// # Safety
/// The CPU must have F16C and AVX.
#[target_feature(enable = "avx,f16c")]
pub(super) unsafe fn f16_fused<'a>(
    out: &mut [f16],
    n: usize,
    src: &dyn Fn(usize) -> &'a [f16],
    product: bool,
    div: Option<f32>,
) {
    if n == 0 {
        return;
    }
    let len = (0..n).map(|r| src(r).len()).fold(out.len(), usize::min);
    // SAFETY (every `load8` and `store8` below): `i + 8` is at most the length of the
    // slices they take (`len` or `m` elements); the caller guarantees F16C and AVX.
    if n == 2 {
        let (a, b) = (&src(0)[..len], &src(1)[..len]);
        let mut i = 0;
        while i + 8 <= len {
            // SAFETY: as above.
            unsafe { store8(out, i, combine8(load8(a, i), load8(b, i), product), div) };
            i += 8;
        }
        for j in i..len {
            out[j] = finish1(combine1(a[j].to_f32(), b[j].to_f32(), product), div);
        }
        return;
    }
    // Small calls take a small scratch block (zeroing 1 KiB would cost a tiny call a tenth
    // of its time, as in `super::reduce_all_body`).
    // SAFETY: F16C and AVX, as the caller guarantees.
    unsafe {
        if len <= super::SMALL_BLOCK {
            f16_fused_blocks::<{ super::SMALL_BLOCK }>(&mut out[..len], n, src, product, div)
        } else {
            f16_fused_blocks::<{ super::BLOCK }>(&mut out[..len], n, src, product, div)
        }
    }
}

/// [`f16_fused`] for other than two sources: in blocks of `B` elements, the sum in a
/// scratch block. `out` no longer than any source.
///
/// # Safety
/// The CPU must have F16C and AVX.
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn f16_fused_blocks<'a, const B: usize>(
    out: &mut [f16],
    n: usize,
    src: &dyn Fn(usize) -> &'a [f16],
    product: bool,
    div: Option<f32>,
) {
    let len = out.len();
    let mut acc = [0f32; B];
    let mut at = 0;
    while at < len {
        let m = B.min(len - at);
        let acc = &mut acc[..m];
        // SAFETY: F16C and AVX, as the caller guarantees.
        unsafe { f16_widen(&src(0)[at..at + m], acc) };
        for r in 1..n {
            let s = &src(r)[at..at + m];
            let mut i = 0;
            while i + 8 <= m {
                // SAFETY: as above, `acc` holding `m` elements too.
                unsafe {
                    let x = _mm256_loadu_ps(acc.as_ptr().add(i));
                    _mm256_storeu_ps(acc.as_mut_ptr().add(i), combine8(x, load8(s, i), product));
                }
                i += 8;
            }
            for j in i..m {
                acc[j] = combine1(acc[j], s[j].to_f32(), product);
            }
        }
        // SAFETY: F16C and AVX, as the caller guarantees.
        unsafe { narrow_div(acc, &mut out[at..at + m], div) };
        at += m;
    }
}

/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn bf16_widen(src: &[half::bf16], dst: &mut [f32]) {
    super::bf16_widen_body(src, dst)
}

/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn bf16_narrow(src: &[f32], dst: &mut [half::bf16]) {
    super::bf16_narrow_body(src, dst)
}
