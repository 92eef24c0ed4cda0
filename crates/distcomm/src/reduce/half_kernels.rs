//! 16-bit float kernels: slice conversions to and from `f32`, and the many-source reduction that
//! reads 16-bit inputs, combines them in `f32` and rounds once.
//!
//! Every result is bit for bit what `half`'s scalar conversions give (`bf16::to_f32`,
//! `bf16::from_f32`, `f16::to_f32`, `f16::from_f32`: round to nearest, ties to even; subnormals
//! kept; NaN stays NaN), so reducing here is indistinguishable from widening every input to
//! `f32`, reducing and narrowing once.
//!
//! * bf16 ↔ f32 is bit arithmetic (a shift, and round-to-nearest-even by an add): written once
//!   as a branch-free loop that the compiler vectorises, and compiled twice — for the baseline
//!   target and, chosen at run time, for AVX2 — from the same source, so both give the same
//!   bits. (AVX512_BF16's `vcvtneps2bf16` is not used even where present: it treats f32
//!   subnormal inputs as zero, which `half` does not.)
//! * f16 ↔ f32 uses F16C's `vcvtph2ps` / `vcvtps2ph` (round to nearest even) where the CPU has
//!   it, `half`'s conversions otherwise and for the tails.
//!
//! The reduction works in blocks of [`BLOCK`] elements kept in L1: widen source 0 into an f32
//! accumulator, widen each further source into a scratch block and combine it (in rank order,
//! with `f32`'s own operators, as `f32::reduce_into` does), divide for `Avg`, round once into
//! the output. The inputs are read once, at 16 bits.

use half::{bf16, f16};

use super::ReduceOp;

/// Elements per block of the reduction (two f32 blocks: 2 KiB of L1).
const BLOCK: usize = 256;

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
}

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
fn has_f16c() -> bool {
    std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx")
}

// ---- bf16: the same source for every target ----

#[inline(always)]
fn bf16_bits_to_f32(h: u16) -> f32 {
    // As `half`: a NaN gets its quiet bit set, everything else is a shift.
    let h = u32::from(h);
    let nan = (h & 0x7fff) > 0x7f80;
    f32::from_bits((if nan { h | 0x40 } else { h }) << 16)
}

#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let x = x.to_bits();
    let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
    // Round to nearest, ties to even: add 0x7fff plus the bit that becomes the lowest kept
    // one, and truncate (finite values at the top round to infinity, as they should).
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let quiet = (x >> 16) | 0x40;
    (if nan { quiet } else { rounded }) as u16
}

#[inline(always)]
fn bf16_widen_body(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_bits_to_f32(s.to_bits());
    }
}

#[inline(always)]
fn bf16_narrow_body(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(f32_to_bf16_bits(*s));
    }
}

// ---- f16: F16C, or `half` ----

#[inline(always)]
fn f16_widen_portable(src: &[f16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

#[inline(always)]
fn f16_narrow_portable(src: &[f32], dst: &mut [f16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(*s);
    }
}

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
mod x86;

/// Converts `src` to `f32` into `dst` (the common prefix where lengths differ).
pub(crate) fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if has_avx2() {
        // SAFETY: AVX2 was detected.
        return unsafe { x86::bf16_widen(src, dst) };
    }
    bf16_widen_body(src, dst)
}

/// Rounds `src` to bf16 into `dst` (the common prefix where lengths differ).
pub(crate) fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if has_avx2() {
        // SAFETY: AVX2 was detected.
        return unsafe { x86::bf16_narrow(src, dst) };
    }
    bf16_narrow_body(src, dst)
}

/// Converts `src` to `f32` into `dst` (the common prefix where lengths differ).
pub(crate) fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if has_f16c() {
        // SAFETY: F16C and AVX were detected.
        return unsafe { x86::f16_widen(src, dst) };
    }
    f16_widen_portable(src, dst)
}

/// Rounds `src` to f16 into `dst` (the common prefix where lengths differ).
pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if has_f16c() {
        // SAFETY: F16C and AVX were detected.
        return unsafe { x86::f16_narrow(src, dst) };
    }
    f16_narrow_portable(src, dst)
}

/// `acc[i] = acc[i] op x[i]` with `f32`'s operators, exactly as `f32::reduce_into`.
#[inline(always)]
fn combine(acc: &mut [f32], x: &[f32], op: ReduceOp) {
    let it = acc.iter_mut().zip(x);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(d, s)| *d += *s),
        ReduceOp::Product => it.for_each(|(d, s)| *d *= *s),
        ReduceOp::Min => it.for_each(|(d, s)| *d = d.min(*s)),
        ReduceOp::Max => it.for_each(|(d, s)| *d = d.max(*s)),
        // Refused before any data moves.
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {}
    }
}

/// The reduction of [`bf16_reduce_all`] / [`f16_reduce_all`], generic over the format and its
/// conversions; inlined into each target's copy. Small calls take small blocks (the
/// accumulators are zeroed on every call: 2 KiB of stores would cost a tiny all_reduce a
/// tenth of its time).
#[inline(always)]
fn reduce_all_body<'a, H: Copy + 'a>(
    out: &mut [H],
    n: usize,
    src: &dyn Fn(usize) -> &'a [H],
    op: ReduceOp,
    widen: impl Fn(&[H], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [H]),
) {
    if n == 0 {
        return;
    }
    let len = (0..n).map(|r| src(r).len()).fold(out.len(), usize::min);
    if len <= SMALL_BLOCK {
        reduce_blocks::<SMALL_BLOCK, H>(&mut out[..len], n, src, op, widen, narrow)
    } else {
        reduce_blocks::<BLOCK, H>(&mut out[..len], n, src, op, widen, narrow)
    }
}

/// Elements per block of the reduction for calls this small.
const SMALL_BLOCK: usize = 32;

#[inline(always)]
fn reduce_blocks<'a, const B: usize, H: Copy + 'a>(
    out: &mut [H],
    n: usize,
    src: &dyn Fn(usize) -> &'a [H],
    op: ReduceOp,
    widen: impl Fn(&[H], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [H]),
) {
    let mut acc = [0f32; B];
    let mut tmp = [0f32; B];
    let len = out.len();
    let avg = (op == ReduceOp::Avg).then_some(n as f32);
    let mut at = 0;
    while at < len {
        let m = B.min(len - at);
        let (acc, tmp) = (&mut acc[..m], &mut tmp[..m]);
        widen(&src(0)[at..at + m], acc);
        for r in 1..n {
            widen(&src(r)[at..at + m], tmp);
            combine(acc, tmp, op);
        }
        if let Some(k) = avg {
            acc.iter_mut().for_each(|x| *x /= k);
        }
        narrow(acc, &mut out[at..at + m]);
        at += m;
    }
}

/// bf16's reduction, fused: the conversions are bit arithmetic, so each pass converts and
/// combines element by element with no scratch block; two sources (the common world) take one
/// pass over the inputs and the output. The operations and their order are those of
/// [`reduce_all_body`], so the bits are too.
#[inline(always)]
fn bf16_fused<'a>(out: &mut [bf16], n: usize, src: &dyn Fn(usize) -> &'a [bf16], op: ReduceOp) {
    #[inline(always)]
    fn with<'a>(
        out: &mut [bf16],
        n: usize,
        src: &dyn Fn(usize) -> &'a [bf16],
        f: impl Fn(f32, f32) -> f32,
        div: Option<f32>,
    ) {
        // A bare shift: unlike `bf16_bits_to_f32` it leaves a signalling NaN signalling, which
        // changes nothing here but which NaN a NaN result is (every `f32` operator quietens
        // it, the narrowing quietens what reaches it: NaN stays NaN, as promised above), and
        // saves the NaN test on every input element. bf16 all_reduce through the arena,
        // alternating runs against the quietening widen (`distcomm bench`, median of per-pair
        // ratios of the time): world 2 64 KiB 0.77x, 1 MiB 0.80x (6 pairs), 32 MiB 0.89x;
        // world 4 1 MiB 0.76x (4 pairs).
        let w = |x: &bf16| f32::from_bits(u32::from(x.to_bits()) << 16);
        let nr = |x: f32| bf16::from_bits(f32_to_bf16_bits(x));
        let len = (0..n).map(|r| src(r).len()).fold(out.len(), usize::min);
        let out = &mut out[..len];
        if n == 2 {
            let (a, b) = (&src(0)[..len], &src(1)[..len]);
            let it = out.iter_mut().zip(a.iter().zip(b));
            match div {
                Some(k) => it.for_each(|(o, (a, b))| *o = nr(f(w(a), w(b)) / k)),
                None => it.for_each(|(o, (a, b))| *o = nr(f(w(a), w(b)))),
            }
            return;
        }
        let mut acc = [0f32; BLOCK];
        let mut at = 0;
        while at < len {
            let m = BLOCK.min(len - at);
            let acc = &mut acc[..m];
            acc.iter_mut()
                .zip(&src(0)[at..at + m])
                .for_each(|(d, s)| *d = w(s));
            for r in 1..n {
                acc.iter_mut()
                    .zip(&src(r)[at..at + m])
                    .for_each(|(d, s)| *d = f(*d, w(s)));
            }
            let o = out[at..at + m].iter_mut().zip(acc.iter());
            match div {
                Some(k) => o.for_each(|(o, x)| *o = nr(*x / k)),
                None => o.for_each(|(o, x)| *o = nr(*x)),
            }
            at += m;
        }
    }
    if n == 0 {
        return;
    }
    let div = (op == ReduceOp::Avg).then_some(n as f32);
    // `f32`'s operators, as `combine` (and `f32::reduce_into`) apply them.
    match op {
        ReduceOp::Sum | ReduceOp::Avg => with(out, n, src, |a, b| a + b, div),
        ReduceOp::Product => with(out, n, src, |a, b| a * b, div),
        ReduceOp::Min => with(out, n, src, f32::min, div),
        ReduceOp::Max => with(out, n, src, f32::max, div),
        // Refused before any data moves; as `combine`, source 0 alone.
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => with(out, n, src, |a, _| a, div),
    }
}

/// `out[i] = src(0)[i] op src(1)[i] op … op src(n - 1)[i]` for bf16: combined in `f32` in rank
/// order, divided by `n` for `Avg`, rounded once (the common prefix where lengths differ).
pub(crate) fn bf16_reduce_all<'a>(
    out: &mut [bf16],
    n: usize,
    src: &dyn Fn(usize) -> &'a [bf16],
    op: ReduceOp,
) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if has_avx2() {
        /// # Safety
        /// The CPU must have AVX2.
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<'a>(
            out: &mut [bf16],
            n: usize,
            src: &dyn Fn(usize) -> &'a [bf16],
            op: ReduceOp,
        ) {
            bf16_fused(out, n, src, op)
        }
        // SAFETY: AVX2 was detected.
        return unsafe { avx2(out, n, src, op) };
    }
    bf16_fused(out, n, src, op)
}

/// As [`bf16_reduce_all`], for f16.
pub(crate) fn f16_reduce_all<'a>(
    out: &mut [f16],
    n: usize,
    src: &dyn Fn(usize) -> &'a [f16],
    op: ReduceOp,
) {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    if has_avx2() && has_f16c() {
        /// # Safety
        /// The CPU must have AVX2, AVX and F16C.
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn avx2_f16c<'a>(
            out: &mut [f16],
            n: usize,
            src: &dyn Fn(usize) -> &'a [f16],
            op: ReduceOp,
        ) {
            reduce_all_body(
                out,
                n,
                src,
                op,
                // SAFETY: the caller guarantees F16C and AVX.
                |s, d| unsafe { x86::f16_widen(s, d) },
                // SAFETY: as above.
                |s, d| unsafe { x86::f16_narrow(s, d) },
            )
        }
        let fused = match op {
            ReduceOp::Sum | ReduceOp::Avg => Some(false),
            ReduceOp::Product => Some(true),
            // Min and max: `f32::min`/`max` treat a NaN unlike the vector instructions.
            _ => None,
        };
        if let Some(product) = fused {
            let div = (op == ReduceOp::Avg).then_some(n as f32);
            // SAFETY: AVX and F16C were detected.
            return unsafe { x86::f16_fused(out, n, src, product, div) };
        }
        // SAFETY: AVX2, AVX and F16C were detected.
        return unsafe { avx2_f16c(out, n, src, op) };
    }
    reduce_all_body(out, n, src, op, f16_widen_portable, f16_narrow_portable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn same32(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn same16(a: u16, b: u16, nan: impl Fn(u16) -> bool) -> bool {
        a == b || (nan(a) && nan(b))
    }

    /// f32 values where rounding to 16 bits is delicate, for both formats.
    fn edge_f32() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::EPSILON,
            1.0,
            -1.0,
            65504.0,      // f16 max
            65519.99,     // rounds to f16 max
            65520.0,      // tie: rounds to f16 infinity
            6.0e-8,       // near the smallest f16 subnormal
            2.98e-8,      // below half of it: rounds to zero
            6.1035156e-5, // f16 min normal
        ];
        let bits = [
            0x0000_0001u32, // smallest f32 subnormal
            0x8000_0001,
            0x007f_ffff, // largest f32 subnormal
            0x7f80_0001, // signaling NaN, low payload only
            0xff80_0001,
            0x7fa0_0000, // signaling NaN with a high payload
            0x7fc0_0000, // quiet NaN
            0x7fff_ffff,
            0x7f7f_ffff, // f32 max: rounds to bf16 infinity
            0x7f7f_7fff, // just below the bf16 overflow tie
            0x7f7f_8000, // the tie at the top: to infinity (even)
        ];
        v.extend(bits.iter().map(|&b| f32::from_bits(b)));
        // bf16 ties (low 16 bits 0x8000) with an even and an odd kept part, and neighbours.
        for hi in [0x3f80u32, 0x3f81, 0x0001, 0x0080, 0x4780, 0xc780] {
            for lo in [0x7fffu32, 0x8000, 0x8001, 0xffff] {
                v.push(f32::from_bits(hi << 16 | lo));
            }
        }
        // f16 ties: bit 12 is the first dropped bit of a normal f16's mantissa.
        for base in [1.0f32, 1.5, 1024.0, -3.0, 6.1035156e-5] {
            let b = base.to_bits();
            for d in [0x0fffu32, 0x1000, 0x1001, 0x3000] {
                v.push(f32::from_bits(b + d));
            }
        }
        // f16 subnormal ties: the result's last bit has weight 2^-24.
        for k in 1..8 {
            v.push((k as f32 + 0.5) * 2f32.powi(-24));
            v.push(-(k as f32 + 0.5) * 2f32.powi(-24));
        }
        v
    }

    fn check_narrow(f: &[f32]) {
        // Several lengths, so the vector loops and their tails both run.
        for len in [f.len(), f.len().saturating_sub(3), 7, 8, 9, 17] {
            let f = &f[..len.min(f.len())];
            let mut b = vec![bf16::ZERO; f.len()];
            let mut b_portable = b.clone();
            f32_to_bf16(f, &mut b);
            bf16_narrow_body(f, &mut b_portable);
            let mut h = vec![f16::ZERO; f.len()];
            let mut h_portable = h.clone();
            f32_to_f16(f, &mut h);
            f16_narrow_portable(f, &mut h_portable);
            for i in 0..f.len() {
                let want = bf16::from_f32(f[i]).to_bits();
                let bnan = |x: u16| bf16::from_bits(x).is_nan();
                assert!(
                    same16(b[i].to_bits(), want, bnan),
                    "bf16 of {:#x}: {:#x} want {want:#x}",
                    f[i].to_bits(),
                    b[i].to_bits()
                );
                assert_eq!(
                    b[i].to_bits(),
                    b_portable[i].to_bits(),
                    "bf16 of {:#x}: vector vs portable",
                    f[i].to_bits()
                );
                let want = f16::from_f32(f[i]).to_bits();
                let hnan = |x: u16| f16::from_bits(x).is_nan();
                assert!(
                    same16(h[i].to_bits(), want, hnan),
                    "f16 of {:#x}: {:#x} want {want:#x}",
                    f[i].to_bits(),
                    h[i].to_bits()
                );
                assert!(same16(h[i].to_bits(), h_portable[i].to_bits(), hnan));
                // `half`'s scalar conversion may itself use F16C: its software one too.
                let soft = f16::from_f32_const(f[i]).to_bits();
                assert!(
                    same16(h[i].to_bits(), soft, hnan),
                    "f16 of {:#x}: {:#x} want {soft:#x}",
                    f[i].to_bits(),
                    h[i].to_bits()
                );
                // NaN keeps its sign in both formats.
                if f[i].is_nan() {
                    assert_eq!(u32::from(b[i].to_bits() >> 15), f[i].to_bits() >> 31);
                    assert_eq!(u32::from(h[i].to_bits() >> 15), f[i].to_bits() >> 31);
                }
            }
        }
    }

    #[test]
    fn narrowing_edge_values_matches_half() {
        let v = edge_f32();
        check_narrow(&v);
        // Again at every offset, so each value meets every vector lane and the tail.
        for skip in 1..8 {
            check_narrow(&v[skip..]);
        }
    }

    #[test]
    fn widening_every_16_bit_value_matches_half() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let b: Vec<bf16> = all.iter().map(|&x| bf16::from_bits(x)).collect();
        let h: Vec<f16> = all.iter().map(|&x| f16::from_bits(x)).collect();
        // An odd length and an odd start: the tails run too.
        for range in [0..all.len(), 3..all.len() - 2] {
            let n = range.len();
            let mut w = vec![0f32; n];
            let mut w_portable = vec![0f32; n];
            bf16_to_f32(&b[range.clone()], &mut w);
            bf16_widen_body(&b[range.clone()], &mut w_portable);
            for (i, x) in b[range.clone()].iter().enumerate() {
                // bf16 widening is exact and keeps NaN payloads (quieted): bit for bit.
                assert_eq!(
                    w[i].to_bits(),
                    x.to_f32().to_bits(),
                    "bf16 {:#x}",
                    x.to_bits()
                );
                assert_eq!(w[i].to_bits(), w_portable[i].to_bits());
            }
            f16_to_f32(&h[range.clone()], &mut w);
            f16_widen_portable(&h[range.clone()], &mut w_portable);
            for (i, x) in h[range.clone()].iter().enumerate() {
                assert!(same32(w[i], x.to_f32()), "f16 {:#x}", x.to_bits());
                assert!(same32(w[i], w_portable[i]));
                assert!(
                    same32(w[i], x.to_f32_const()),
                    "f16 {:#x} (software)",
                    x.to_bits()
                );
                if !x.is_nan() {
                    assert_eq!(w[i].to_bits(), x.to_f32().to_bits());
                    assert_eq!(w[i].to_bits(), x.to_f32_const().to_bits());
                }
            }
        }
        // Round trips: every non-NaN 16-bit value survives widening and narrowing.
        let mut w = vec![0f32; all.len()];
        bf16_to_f32(&b, &mut w);
        let mut back = vec![bf16::ZERO; all.len()];
        f32_to_bf16(&w, &mut back);
        assert!(b
            .iter()
            .zip(&back)
            .all(|(x, y)| x.is_nan() && y.is_nan() || x.to_bits() == y.to_bits()));
        f16_to_f32(&h, &mut w);
        let mut back = vec![f16::ZERO; all.len()];
        f32_to_f16(&w, &mut back);
        assert!(h
            .iter()
            .zip(&back)
            .all(|(x, y)| x.is_nan() && y.is_nan() || x.to_bits() == y.to_bits()));
    }

    proptest! {
        #[test]
        fn narrowing_any_f32_matches_half(bits in proptest::collection::vec(any::<u32>(), 0..300)) {
            let f: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            check_narrow(&f);
        }
    }

    /// What widening gives: every source widened, combined in f32 in rank order, averaged,
    /// rounded once.
    fn widened_reference<H: Copy>(
        srcs: &[Vec<H>],
        op: ReduceOp,
        to: impl Fn(H) -> f32,
        from: impl Fn(f32) -> H,
    ) -> Vec<H> {
        use crate::reduce::Reducible;
        let mut acc: Vec<f32> = srcs[0].iter().map(|&x| to(x)).collect();
        for s in &srcs[1..] {
            let w: Vec<f32> = s.iter().map(|&x| to(x)).collect();
            f32::reduce_into(&mut acc, &w, op);
        }
        if op == ReduceOp::Avg {
            f32::finish_avg(&mut acc, srcs.len());
        }
        acc.into_iter().map(from).collect()
    }

    const OPS: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
    ];

    proptest! {
        // Inputs of any bits (NaN, infinities, subnormals included), 1–5 sources, lengths
        // across block boundaries: the one-pass reduction equals widen-reduce-round.
        #[test]
        fn reduce_all_equals_widening(
            n in 1usize..6,
            len in 0usize..700,
            seed in any::<u64>(),
            special in any::<bool>(),
        ) {
            let mut x = seed | 1;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            // Either any bits, or ordinary values whose sums round (the interesting case).
            let mut gen = move || {
                let r = next();
                if special { r as u16 } else { bf16::from_f32(((r % 20001) as f32 - 10000.0) * 0.0137).to_bits() }
            };
            let raw: Vec<Vec<u16>> = (0..n).map(|_| (0..len).map(|_| gen()).collect()).collect();
            let b: Vec<Vec<bf16>> = raw.iter().map(|s| s.iter().map(|&x| bf16::from_bits(x)).collect()).collect();
            let h: Vec<Vec<f16>> = raw
                .iter()
                .map(|s| s.iter().map(|&x| if special { f16::from_bits(x) } else { f16::from_f32(bf16::from_bits(x).to_f32()) }).collect())
                .collect();
            for op in OPS {
                let want = widened_reference(&b, op, bf16::to_f32, bf16::from_f32);
                let mut got = vec![bf16::ZERO; len];
                bf16_reduce_all(&mut got, n, &|r| &b[r], op);
                let mut portable = vec![bf16::ZERO; len];
                reduce_all_body(&mut portable, n, &|r: usize| &b[r][..], op, bf16_widen_body, bf16_narrow_body);
                for i in 0..len {
                    prop_assert!(same16(got[i].to_bits(), want[i].to_bits(), |x| bf16::from_bits(x).is_nan()), "bf16 {op:?} n {n} [{i}]");
                    // NaN for NaN: which operand's payload survives an f32 operation is not
                    // fixed (the compiler may swap the operands of an add).
                    prop_assert!(same16(got[i].to_bits(), portable[i].to_bits(), |x| bf16::from_bits(x).is_nan()));
                }
                let want = widened_reference(&h, op, f16::to_f32, f16::from_f32);
                let mut got = vec![f16::ZERO; len];
                f16_reduce_all(&mut got, n, &|r| &h[r], op);
                let mut portable = vec![f16::ZERO; len];
                reduce_all_body(&mut portable, n, &|r: usize| &h[r][..], op, f16_widen_portable, f16_narrow_portable);
                for i in 0..len {
                    let nan = |x: u16| f16::from_bits(x).is_nan();
                    prop_assert!(same16(got[i].to_bits(), want[i].to_bits(), nan), "f16 {op:?} n {n} [{i}]");
                    prop_assert!(same16(got[i].to_bits(), portable[i].to_bits(), nan));
                }
            }
        }
    }

    #[test]
    fn sources_of_different_lengths_reduce_their_common_prefix() {
        // Every path (two sources, more, every operator) against the generic one, with the
        // output and the sources of different lengths, tails not multiples of 8.
        let src: Vec<Vec<f16>> = [37usize, 29, 41, 33]
            .iter()
            .enumerate()
            .map(|(r, &len)| {
                (0..len)
                    .map(|i| f16::from_f32((i * 7 + r) as f32 * 0.37 - 5.0))
                    .collect()
            })
            .collect();
        for n in 1..=4 {
            for op in OPS {
                for out_len in [23usize, 31, 45] {
                    let mut got = vec![f16::ONE; out_len];
                    f16_reduce_all(&mut got, n, &|r| &src[r], op);
                    let mut want = vec![f16::ONE; out_len];
                    reduce_all_body(
                        &mut want,
                        n,
                        &|r: usize| &src[r][..],
                        op,
                        f16_widen_portable,
                        f16_narrow_portable,
                    );
                    assert_eq!(got, want, "n {n} {op:?} out {out_len}");
                }
            }
        }
    }

    #[test]
    fn reduce_all_rounds_once() {
        // 1 + 2^-8 + 2^-8 in bf16 (8 significant bits): rounding after each step loses both
        // small terms (ties to even); rounding once keeps them.
        let one = bf16::from_f32(1.0);
        let tiny = bf16::from_f32(2f32.powi(-8));
        let srcs = [vec![one], vec![tiny], vec![tiny]];
        let mut out = [bf16::ZERO];
        bf16_reduce_all(&mut out, 3, &|r| &srcs[r], ReduceOp::Sum);
        assert_eq!(out[0].to_f32(), 1.0 + 2f32.powi(-7));
        let mut stepwise = srcs[0].clone();
        for s in &srcs[1..] {
            crate::reduce::Reducible::reduce_into(&mut stepwise, s, ReduceOp::Sum);
        }
        assert_eq!(stepwise[0].to_f32(), 1.0);
        // The average divides before rounding: (1 + 1 + 2^-7) / 3 rounds from f32.
        let srcs = [vec![one], vec![one], vec![bf16::from_f32(2f32.powi(-7))]];
        bf16_reduce_all(&mut out, 3, &|r| &srcs[r], ReduceOp::Avg);
        assert_eq!(out[0], bf16::from_f32((2.0 + 2f32.powi(-7)) / 3.0));
        // Sources of different lengths: the common prefix.
        let srcs = [vec![one; 5], vec![one; 3]];
        let mut out = [bf16::ZERO; 4];
        bf16_reduce_all(&mut out, 2, &|r| &srcs[r], ReduceOp::Sum);
        assert_eq!(out.map(|x| x.to_f32()), [2.0, 2.0, 2.0, 0.0]);
    }
}
