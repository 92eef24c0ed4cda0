//! Copies of the data path (a leaf: no other module of the crate below it).
//!
//! glibc's `memcpy` moves copies of 2 KiB – 512 KiB with `rep movsb`. On the AMD EPYC machines
//! this library is measured on, `rep movsb` runs at a quarter of the speed of a plain vector
//! loop when its source was just written by another core — which is what every shared-memory
//! copy-out is: world 2 all_reduce of 1 MiB through the shared arena took 560–965 µs with
//! glibc's copy and 150 µs with `GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=0xfffffffffff`
//! (vector loop); 256 KiB 158–178 µs against 40. [`copy`] is that vector loop (AVX2 when the
//! CPU has it, detected at run time) in the range where glibc would take `rep movsb`, and
//! glibc's copy outside it (small copies, and large ones, which glibc already moves with
//! vectors or non-temporal stores).
//!
//! ```
//! let src = vec![1.5f32; 100_000];
//! let mut dst = vec![0f32; 100_000];
//! distcomm::copy::copy(&mut dst, &src);
//! assert_eq!(dst, src);
//! ```

/// Bytes in a page, as the kernel's `rep movsb` counts a copy's skew (see `transport::shm::cma`).
pub(crate) const PAGE: usize = 4096;

/// The index in a buffer starting at address `base` whose address lies at `offset` within its
/// page (modulo [`PAGE`]): where a copy placed in it lies in its page as the other side does.
pub(crate) fn index_at_page_offset(base: usize, offset: usize) -> usize {
    offset.wrapping_sub(base) % PAGE
}

/// Copies below this many bytes go to glibc (it copies them with vector moves, not `rep movsb`).
const LOOP_MIN: usize = 2 << 10;
/// Copies from this many bytes go to glibc (its own vector loop and non-temporal stores).
const LOOP_MAX: usize = 512 << 10;

/// `dst.copy_from_slice(src)` for plain data, fast where glibc's `memcpy` is not (see the
/// module doc). Panics like `copy_from_slice` when the lengths differ (a caller's bug, never
/// data-dependent).
#[inline]
pub fn copy<T: bytemuck::Pod>(dst: &mut [T], src: &[T]) {
    copy_bytes(bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
}

/// [`copy`] on bytes.
#[inline]
pub fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of different lengths"
    );
    // SAFETY: both slices hold `src.len()` bytes and cannot overlap (one is borrowed mutably).
    unsafe { copy_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// [`copy`] between raw pointers (shared-memory rings).
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable for `n` bytes, the
/// two ranges disjoint.
#[inline]
pub(crate) unsafe fn copy_raw(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if (LOOP_MIN..LOOP_MAX).contains(&n) && std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above); the ranges as the caller promises.
        unsafe { avx2::copy(dst, src, n) };
        return;
    }
    // SAFETY: as the caller promises.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

/// [`copy_bytes`] with non-temporal stores where the CPU has them (AVX2): the copy's lines go
/// to memory without first being fetched into this core's cache, and every copy of them in
/// other cores' caches is dropped. For copies into shared memory that another core read last
/// and reads next, where the two cores share no cache: an ordinary store must first take each
/// line back from the other core, one by one. Ends with a store fence, so that a release store
/// after it publishes the data (non-temporal stores are not ordered by one).
pub(crate) fn copy_bytes_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above); both slices hold `src.len()` bytes and
        // cannot overlap (one is borrowed mutably).
        unsafe { avx2::stream(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
        return;
    }
    copy_bytes(dst, src);
}

/// [`copy_bytes_streaming`] when `stream`, else [`copy_bytes`].
pub(crate) fn copy_bytes_streaming_if(stream: bool, dst: &mut [u8], src: &[u8]) {
    match stream {
        true => copy_bytes_streaming(dst, src),
        false => copy_bytes(dst, src),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_storeu_si256, _mm256_stream_si256, _mm_sfence,
    };
    use std::ops::Range;

    /// `n` bytes from `s` to `d`: up to `d`'s first 32-byte boundary by glibc, then 128 bytes
    /// per round with non-temporal stores, the rest by glibc; then a store fence.
    ///
    /// # Safety
    /// The CPU has AVX2; `src` readable and `dst` writable for `n` bytes, disjoint.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream(d: *mut u8, s: *const u8, n: usize) {
        let head = d.align_offset(32).min(n);
        let whole = head + (n - head) / 128 * 128;
        // SAFETY: the first `head <= n` bytes of both ranges (caller).
        unsafe { std::ptr::copy_nonoverlapping(s, d, head) };
        // SAFETY: `head..whole` lies in both ranges (caller) and `d + head` is 32-byte aligned.
        unsafe { rounds::<true>(d, s, head..whole) };
        // SAFETY: the last `n - whole` bytes of both ranges (caller).
        unsafe { std::ptr::copy_nonoverlapping(s.add(whole), d.add(whole), n - whole) };
        _mm_sfence();
    }

    /// 128 bytes per round in four unaligned 32-byte moves, the rest by glibc.
    ///
    /// # Safety
    /// The CPU has AVX2; `src` readable and `dst` writable for `n` bytes, disjoint.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy(d: *mut u8, s: *const u8, n: usize) {
        let whole = n - n % 128;
        // SAFETY: `0..whole` lies in both ranges (caller); ordinary stores need no alignment.
        unsafe { rounds::<false>(d, s, 0..whole) };
        // SAFETY: the last `n - whole` bytes of both ranges (caller).
        unsafe { std::ptr::copy_nonoverlapping(s.add(whole), d.add(whole), n - whole) }
    }

    /// Bytes `at` (a multiple of 128 long) from `s` to `d`, 128 per round in four unaligned
    /// 32-byte loads and four stores: non-temporal ones with `STREAM`.
    ///
    /// # Safety
    /// The CPU has AVX2; `at` lies in both ranges, which are disjoint; with `STREAM`,
    /// `d + at.start` is 32-byte aligned (as non-temporal stores need).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn rounds<const STREAM: bool>(d: *mut u8, s: *const u8, at: Range<usize>) {
        let mut i = at.start;
        while i + 128 <= at.end {
            // SAFETY: `i + 128 <= at.end`, inside both ranges (caller); unaligned loads have no
            // alignment requirement, nor have ordinary stores; `d + i + k` is 32-byte aligned
            // for streaming (the caller aligned `at.start`, rounds add multiples of 32). The
            // four loads come before the four stores.
            unsafe {
                let v = [
                    _mm256_loadu_si256(s.add(i).cast::<__m256i>()),
                    _mm256_loadu_si256(s.add(i + 32).cast::<__m256i>()),
                    _mm256_loadu_si256(s.add(i + 64).cast::<__m256i>()),
                    _mm256_loadu_si256(s.add(i + 96).cast::<__m256i>()),
                ];
                for (k, v) in [0, 32, 64, 96].into_iter().zip(v) {
                    let to = d.add(i + k).cast::<__m256i>();
                    match STREAM {
                        true => _mm256_stream_si256(to, v),
                        false => _mm256_storeu_si256(to, v),
                    }
                }
            }
            i += 128;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_and_offset_exactly() {
        let src: Vec<u8> = (0..LOOP_MAX + 300).map(|i| (i * 7 + 3) as u8).collect();
        let lens = [
            0,
            1,
            127,
            128,
            129,
            LOOP_MIN - 1,
            LOOP_MIN,
            LOOP_MIN + 77,
            65_536 + 5,
        ];
        for len in lens
            .into_iter()
            .chain([LOOP_MAX - 1, LOOP_MAX, LOOP_MAX + 200])
        {
            for off in [0, 1, 31, 33] {
                let mut dst = vec![0xAAu8; len + 2];
                copy_bytes(&mut dst[1..len + 1], &src[off..off + len]);
                assert_eq!(
                    &dst[1..len + 1],
                    &src[off..off + len],
                    "len {len} off {off}"
                );
                assert_eq!(
                    (dst[0], dst[len + 1]),
                    (0xAA, 0xAA),
                    "len {len}: wrote outside"
                );
            }
        }
    }

    /// The streaming copy at every alignment of its destination (its head up to a 32-byte
    /// boundary, its rounds of 128, its tail).
    #[test]
    fn streaming_copy_copies_every_length_and_offset_exactly() {
        let src: Vec<u8> = (0..70_000).map(|i| (i * 13 + 5) as u8).collect();
        for len in [0, 1, 31, 32, 33, 127, 128, 129, 200, 4095, 65_536 + 77] {
            for (off, at) in [(0, 1), (3, 32), (31, 33), (64, 7)] {
                let mut dst = vec![0x55u8; len + 72];
                copy_bytes_streaming(&mut dst[at..at + len], &src[off..off + len]);
                assert_eq!(
                    &dst[at..at + len],
                    &src[off..off + len],
                    "len {len} at {at}"
                );
                let outside = dst[..at].iter().chain(&dst[at + len..]);
                assert!(
                    outside.into_iter().all(|&b| b == 0x55),
                    "len {len}: wrote outside"
                );
            }
        }
    }

    #[test]
    fn typed_copy_keeps_the_bits() {
        let src: Vec<f32> = (0..70_000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .collect();
        let mut dst = vec![0f32; src.len()];
        copy(&mut dst, &src);
        assert!(dst
            .iter()
            .zip(&src)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
