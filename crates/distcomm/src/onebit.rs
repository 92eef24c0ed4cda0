//! 1-bit compressed all_reduce with error feedback (DeepSpeed's `compressed_allreduce`, the
//! communication of 1-bit Adam), built on the collectives.
//!
//! Every rank keeps a *worker error* (the size of the buffer, padded so that each rank's chunk
//! is a whole number of bytes of signs) and a *server error* (one chunk). A call:
//!
//! 1. adds the worker error to the (padded) buffer, compresses it to one sign bit per element
//!    (`x ≥ 0 → 1`, packed most-significant bit first) and one scale `‖x‖₂ / √n`, and keeps
//!    what the compression lost as the new worker error;
//! 2. phase 1: `all_to_all` of the signs (rank r receives everyone's chunk r), each block
//!    carrying its sender's scale;
//! 3. each rank, as the *server* of its chunk, averages the decompressed chunks, adds its server
//!    error, compresses the result again and keeps the new server error;
//! 4. phase 2: `all_gather` of the servers' signs and scales; every rank decompresses the whole
//!    buffer.
//!
//! On the wire each element costs two bits (one per phase) plus one f32 per block, against
//! 2·(n−1)/n·32 bits for an exact ring all_reduce. An empty buffer zeroes both error buffers.
//! Each phase is one pass over memory and one exchange (see `Inner::exchange`).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::commslog::sent_bytes;
use crate::error::Result;
use crate::group::{Inner, ProcessGroup, Turn};
use crate::work::Work;

/// The error-feedback state of one buffer (keep one per all-reduced buffer, on every rank).
///
/// Stored lazily: what is kept is the last *compensated* vector and the scale it was
/// compressed at; the error (`compensated − scale·sign(compensated)`) is applied on the fly by
/// the next call's single pass, which saves a whole read-modify-write pass over the buffer per
/// call. [`worker_error`](Self::worker_error) and [`server_error`](Self::server_error) give the
/// errors themselves.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OneBitState {
    /// This rank's last compensated contribution (padded length).
    worker: Vec<f32>,
    worker_scale: f32,
    /// This rank's last compensated server chunk (one chunk).
    server: Vec<f32>,
    server_scale: f32,
}

impl OneBitState {
    /// What compressing this rank's contribution lost (padded length; empty before the first
    /// call).
    pub fn worker_error(&self) -> Vec<f32> {
        errors(&self.worker, self.worker_scale)
    }

    /// What compressing this rank's server chunk lost (one chunk).
    pub fn server_error(&self) -> Vec<f32> {
        errors(&self.server, self.server_scale)
    }

    /// Zeroes both error buffers (what an empty call does, and what a failed call leaves).
    fn clear(&mut self) {
        self.worker.iter_mut().for_each(|v| *v = 0.0);
        self.server.iter_mut().for_each(|v| *v = 0.0);
        self.worker_scale = 0.0;
        self.server_scale = 0.0;
    }
}

/// `c − s·sign(c)`, element-wise.
fn errors(c: &[f32], s: f32) -> Vec<f32> {
    c.iter().map(|&v| v - s * unit(v >= 0.0)).collect()
}

/// The buffer length padded so that each of `world` chunks is a whole number of bytes of signs.
pub fn padded_len(len: usize, world: usize) -> usize {
    len.div_ceil(8 * world) * 8 * world
}

fn norm_scale(sum_sq: f64, len: usize) -> f32 {
    if len == 0 {
        return 0.0;
    }
    (sum_sq.sqrt() / (len as f64).sqrt()) as f32
}

/// Sums of squares in f32 lanes over short runs, the runs summed in f64: vectorises and stays
/// accurate over millions of elements.
struct SumSq {
    lanes: [f32; 8],
    blocks: u32,
    total: f64,
}

impl SumSq {
    const RUN: u32 = 128; // blocks of 8 per f32 run

    fn new() -> Self {
        SumSq {
            lanes: [0.0; 8],
            blocks: 0,
            total: 0.0,
        }
    }

    #[inline(always)]
    fn add(&mut self, v: &[f32; 8]) {
        for (l, x) in self.lanes.iter_mut().zip(v) {
            *l += x * x;
        }
        self.blocks += 1;
        if self.blocks == Self::RUN {
            self.flush();
        }
    }

    fn flush(&mut self) {
        self.total += f64::from(self.lanes.iter().sum::<f32>());
        self.lanes = [0.0; 8];
        self.blocks = 0;
    }

    fn finish(mut self) -> f64 {
        self.flush();
        self.total
    }
}

/// The sign byte of eight values (`v ≥ 0 → 1`, most-significant bit first).
#[inline(always)]
fn sign_byte(v: &[f32; 8]) -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_cmpge_ps, _mm_loadu_ps, _mm_movemask_ps, _mm_setzero_ps};
        // SAFETY: SSE is part of the x86_64 baseline; the two unaligned 16-byte loads read
        // elements 0..4 and 4..8 of the eight-element array behind `v`.
        let (lo, hi) = unsafe {
            let zero = _mm_setzero_ps();
            let p = v.as_ptr();
            (
                _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p), zero)),
                _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p.add(4)), zero)),
            )
        };
        // Lane j's bit is bit j here: reversed, lane 0 is the most significant.
        ((lo | hi << 4) as u8).reverse_bits()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut bits = [0u32; 8];
        for (j, (b, x)) in bits.iter_mut().zip(v).enumerate() {
            *b = u32::from(*x >= 0.0) << (7 - j);
        }
        bits.iter().fold(0, |acc, b| acc | b) as u8
    }
}

/// Eight elements of one pass: `c` (compensated last time, compressed at `s`) becomes
/// `add + (c − s·sign(c))`; returns the new sign byte and adds to the sum of squares.
#[inline(always)]
fn settle8(c: &mut [f32], add: &[f32; 8], s: f32, sq: &mut SumSq) -> u8 {
    let mut v = [0f32; 8];
    for ((o, e), a) in v.iter_mut().zip(c.iter()).zip(add) {
        let err = e - s * if *e >= 0.0 { 1.0 } else { -1.0 };
        *o = a + err;
    }
    c.copy_from_slice(&v);
    sq.add(&v);
    sign_byte(&v)
}

/// The worker's pass, one read and one write of its state per element: the new compensated
/// contribution `buf + error` (zero-padded `buf`), its packed signs, and its sum of squares.
fn worker_pass(c: &mut [f32], buf: &[f32], s: f32, signs: &mut [u8]) -> f64 {
    let mut sq = SumSq::new();
    let whole = buf.len() / 8;
    let (head, rest) = c.split_at_mut(whole * 8);
    let (head_signs, rest_signs) = signs.split_at_mut(whole);
    for ((c8, b8), byte) in head
        .chunks_exact_mut(8)
        .zip(buf.chunks_exact(8))
        .zip(head_signs.iter_mut())
    {
        let add: &[f32; 8] = b8.try_into().unwrap_or(&[0.0; 8]);
        *byte = settle8(c8, add, s, &mut sq);
    }
    let mut tail = buf[whole * 8..].iter();
    for (c8, byte) in rest.chunks_exact_mut(8).zip(rest_signs.iter_mut()) {
        let add: [f32; 8] = std::array::from_fn(|_| tail.next().copied().unwrap_or(0.0));
        *byte = settle8(c8, &add, s, &mut sq);
    }
    sq.finish()
}

/// The server's pass over its chunk, one read and one write per element: the chunk's error
/// plus every worker's decompressed contribution weighted by `weights` (`got[r]`: worker r's
/// sign bytes for the chunk), its packed signs and its sum of squares.
fn server_pass(c: &mut [f32], s: f32, got: &[&[u8]], weights: &[f32], signs: &mut [u8]) -> f64 {
    // In tiles of TILE sign bytes that stay in L1: the errors first, then each worker's
    // contribution in rank order (as a serial sum would add them), then store, square and pack.
    const TILE: usize = 64;
    let units = units();
    let mut sq = SumSq::new();
    let mut v = [[0f32; 8]; TILE];
    for (t, (ct, st)) in c
        .chunks_mut(8 * TILE)
        .zip(signs.chunks_mut(TILE))
        .enumerate()
    {
        let bytes = st.len();
        for (o, e8) in v.iter_mut().zip(ct.chunks_exact(8)) {
            for (o, e) in o.iter_mut().zip(e8) {
                *o = e - s * if *e >= 0.0 { 1.0 } else { -1.0 };
            }
        }
        for (packed, w) in got.iter().zip(weights) {
            let lo = (t * TILE).min(packed.len());
            let hi = (t * TILE + bytes).min(packed.len());
            for (o, &b) in v.iter_mut().zip(&packed[lo..hi]) {
                for (o, u) in o.iter_mut().zip(&units[usize::from(b)]) {
                    *o += w * u;
                }
            }
        }
        for ((o, c8), byte) in v.iter().zip(ct.chunks_exact_mut(8)).zip(st.iter_mut()) {
            c8.copy_from_slice(o);
            sq.add(o);
            *byte = sign_byte(o);
        }
    }
    sq.finish()
}

/// ±1 for a sign bit.
fn unit(bit: bool) -> f32 {
    if bit {
        1.0
    } else {
        -1.0
    }
}

/// The eight ±1 values of each sign byte, most-significant bit first.
fn units() -> &'static [[f32; 8]; 256] {
    static UNITS: std::sync::OnceLock<[[f32; 8]; 256]> = std::sync::OnceLock::new();
    UNITS.get_or_init(|| {
        std::array::from_fn(|b| std::array::from_fn(|j| unit(b & (0x80 >> j) != 0)))
    })
}

/// Packs the signs of `x` (`x ≥ 0 → 1`) most-significant bit first; `x.len()` is a multiple of 8.
#[cfg(test)]
fn pack(x: &[f32], out: &mut [u8]) {
    for (byte, eight) in out.iter_mut().zip(x.chunks_exact(8)) {
        *byte = eight
            .iter()
            .fold(0u8, |acc, &v| (acc << 1) | u8::from(v >= 0.0));
    }
}

/// The sign bit `i` of a packed buffer.
#[cfg(test)]
fn bit(packed: &[u8], i: usize) -> bool {
    packed[i / 8] & (0x80 >> (i % 8)) != 0
}

/// `out[i] = s · unit(sign i)` for every element of `out` (any length ≤ 8 × `packed`).
fn decompress(out: &mut [f32], packed: &[u8], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if out.len() >= STREAM_MIN && out.as_ptr() as usize % 16 == 0 {
        let whole = (out.len() / 8).min(packed.len());
        stream_decompress(&mut out[..whole * 8], &packed[..whole], s);
        return decompress_cached(&mut out[whole * 8..], &packed[whole..], s);
    }
    decompress_cached(out, packed, s)
}

/// From this many elements on, [`decompress`] writes with streaming stores.
#[cfg(target_arch = "x86_64")]
const STREAM_MIN: usize = 1 << 16;

fn decompress_cached(out: &mut [f32], packed: &[u8], s: f32) {
    let units = units();
    for (part, &b) in out.chunks_mut(8).zip(packed) {
        for (v, u) in part.iter_mut().zip(&units[usize::from(b)]) {
            *v = s * u;
        }
    }
}

/// [`decompress`] of whole bytes into a 16-byte-aligned `out` (`8 × packed.len()` elements)
/// with streaming stores: a large output is written without first being read into the cache
/// (which a plain store does), a third of this pass's memory traffic. The same values as
/// [`decompress_cached`]: `s · ±1` is exact either way.
#[cfg(target_arch = "x86_64")]
fn stream_decompress(out: &mut [f32], packed: &[u8], s: f32) {
    use std::arch::x86_64::{_mm_loadu_ps, _mm_mul_ps, _mm_set1_ps, _mm_sfence, _mm_stream_ps};
    let units = units();
    let base = out.as_mut_ptr();
    if out.len() != packed.len() * 8 || base as usize % 16 != 0 {
        return decompress_cached(out, packed, s);
    }
    // SAFETY: SSE is part of the x86_64 baseline, so these intrinsics are always available.
    // Each byte k writes elements 8k..8k+8 of `out`, which exist (`out.len() == 8 ×
    // packed.len()`, checked above), through `base`, the start of the exclusively borrowed
    // `out`; the two 16-byte stores land at byte offsets 32k and 32k + 16 from a 16-byte
    // aligned base (checked above), as `_mm_stream_ps` requires. The reads are unaligned
    // loads from a table entry of eight f32. The fence orders the streaming stores before
    // anything this thread does next (they are weakly ordered), so whoever later reads `out`
    // through the usual synchronisation sees them.
    unsafe {
        let sv = _mm_set1_ps(s);
        for (k, &b) in packed.iter().enumerate() {
            let u = units[usize::from(b)].as_ptr();
            let dst = base.add(8 * k);
            _mm_stream_ps(dst, _mm_mul_ps(_mm_loadu_ps(u), sv));
            _mm_stream_ps(dst.add(4), _mm_mul_ps(_mm_loadu_ps(u.add(4)), sv));
        }
        _mm_sfence();
    }
}

impl ProcessGroup {
    /// 1-bit compressed all_reduce (average) of `buf` with error feedback in `state` (see the
    /// module). Every rank must call it with the same length; `state` must be the same state
    /// object across calls for one buffer (it is sized on first use, and reset if the length
    /// changes).
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// let g = distcomm::init()?;
    /// let mut momentum = vec![0.5f32; 1000];
    /// let mut state = distcomm::OneBitState::default();
    /// g.onebit_all_reduce(&mut momentum, &mut state)?; // ≈ the average over ranks
    /// # Ok(()) }
    /// ```
    pub fn onebit_all_reduce(&self, buf: &mut [f32], state: &mut OneBitState) -> Result<()> {
        match self.onebit_tags(buf.len()) {
            Some(tags) => onebit_on(&self.inner, tags, buf, state),
            None => {
                state.clear();
                Ok(())
            }
        }
    }

    /// Async [`onebit_all_reduce`](Self::onebit_all_reduce): the result comes back from
    /// [`Work::into_buffer`](crate::Work::into_buffer); `state` is updated when the operation
    /// runs (runs are in issue order with the group's other async collectives).
    pub fn onebit_all_reduce_async(
        &self,
        mut buf: Vec<f32>,
        state: Arc<Mutex<OneBitState>>,
    ) -> Result<Work<Vec<f32>>> {
        let tags = self.onebit_tags(buf.len());
        self.spawn("onebit_all_reduce", move |g| {
            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
            match tags {
                Some(tags) => onebit_on(g, tags, &mut buf, &mut st)?,
                None => st.clear(),
            }
            Ok(buf)
        })
    }

    /// The sequence numbers of the two exchanges of a call (taken at issue time, in program
    /// order); none for an empty buffer, which communicates nothing.
    fn onebit_tags(&self, len: usize) -> Option<[Turn<'static>; 2]> {
        (len > 0).then(|| std::array::from_fn(|_| self.inner.issue_shared()))
    }
}

/// Runs one call and books it in the comms log as `onebit_all_reduce` (its two exchanges are
/// not logged alone), with the bytes it actually sent.
fn onebit_on(g: &Inner, tags: [Turn; 2], buf: &mut [f32], state: &mut OneBitState) -> Result<()> {
    let (started, sent) = (Instant::now(), sent_bytes());
    onebit_rounds(g, tags, buf, state)?;
    let took = started.elapsed();
    let bytes = std::mem::size_of_val(buf);
    g.log.record(
        "onebit_all_reduce",
        bytes,
        g.members.len(),
        took,
        sent_bytes() - sent,
    );
    Ok(())
}

fn onebit_rounds(
    g: &Inner,
    tags: [Turn; 2],
    buf: &mut [f32],
    state: &mut OneBitState,
) -> Result<()> {
    let r = onebit_passes(g, [tags[0].no(), tags[1].no()], buf, state);
    if r.is_err() {
        // The passes update the state in place: after a failure it is reset, as documented.
        state.clear();
    }
    r
}

fn onebit_passes(
    g: &Inner,
    tags: [u32; 2],
    buf: &mut [f32],
    state: &mut OneBitState,
) -> Result<()> {
    let n = g.members.len();
    let padded = padded_len(buf.len(), n);
    let chunk = padded / n;
    if state.worker.len() != padded || state.server.len() != chunk {
        *state = OneBitState {
            worker: vec![0.0; padded],
            server: vec![0.0; chunk],
            ..OneBitState::default()
        };
    }
    // 1. Compensate and compress this rank's contribution: one pass.
    let per = chunk / 8;
    let mut signs: Vec<u8> = g.pool.take_len(padded / 8);
    let sq = worker_pass(&mut state.worker, buf, state.worker_scale, &mut signs);
    state.worker_scale = norm_scale(sq, padded);
    // 2. Phase 1: chunk r of every rank's signs to rank r, each block carrying the sender's
    // scale in front (a separate round for the scales would wait behind the signs on a slow
    // link).
    let mut got: Vec<u8> = g.pool.take_len(n * (4 + per));
    let scale = state.worker_scale.to_le_bytes();
    let mut fill = |d: usize, block: &mut [u8]| {
        block[..4].copy_from_slice(&scale);
        block[4..].copy_from_slice(&signs[d * per..(d + 1) * per]);
    };
    let phase1 = g.all_to_all_streamed(tags[0], 4 + per, &mut got, &mut fill);
    g.pool.give(signs);
    // 3. Serve our chunk: average, compensate, compress again: one pass.
    // 4. Phase 2: every server's signs and scale to everyone, decompressed as they come (our
    // own chunk while the others are on their way).
    let phase2 = phase1.and_then(|()| {
        let blocks: Vec<&[u8]> = got.chunks_exact(4 + per).map(|b| &b[4..]).collect();
        let weights: Vec<f32> = got
            .chunks_exact(4 + per)
            .map(|b| f32::from_le_bytes(head4(b)) / n as f32)
            .collect();
        let mut block: Vec<u8> = g.pool.take_len(4 + per);
        let sq = server_pass(
            &mut state.server,
            state.server_scale,
            &blocks,
            &weights,
            &mut block[4..],
        );
        state.server_scale = norm_scale(sq, chunk);
        block[..4].copy_from_slice(&state.server_scale.to_le_bytes());
        let len = buf.len();
        let mut consume = |q: usize, b: &[u8]| {
            let scale = f32::from_le_bytes(head4(b));
            let part = &mut buf[(q * chunk).min(len)..((q + 1) * chunk).min(len)];
            decompress(part, &b[4..], scale);
        };
        let r = g.all_gather_streamed(tags[1], &block, &mut consume);
        g.pool.give(block);
        r
    });
    g.pool.give(got);
    phase2
}

/// The first four bytes of a block (its scale).
fn head4(b: &[u8]) -> [u8; 4] {
    std::array::from_fn(|i| b.get(i).copied().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_pack_most_significant_bit_first_and_zero_is_positive() {
        let x = [
            0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, 7.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0,
            -0.5,
        ];
        let mut out = [0u8; 2];
        pack(&x, &mut out);
        assert_eq!(out, [0b1000_0001, 0b0100_0000]);
        assert!(bit(&out, 0) && !bit(&out, 1) && bit(&out, 7) && bit(&out, 9));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn streaming_decompression_writes_what_the_cached_one_does() {
        let packed: Vec<u8> = (0..STREAM_MIN / 4).map(|i| (i * 37 % 256) as u8).collect();
        for len in [STREAM_MIN * 2 - 3, STREAM_MIN * 2, 8, 13] {
            let (mut a, mut b) = (vec![0f32; len], vec![0f32; len]);
            decompress(&mut a, &packed, 0.75);
            decompress_cached(&mut b, &packed, 0.75);
            assert_eq!(a, b, "{len}");
        }
    }

    #[test]
    fn one_pass_keeps_what_compression_lost() {
        let orig = [3.0f32, -1.0, 0.5, -0.5, 2.0, 0.0, -4.0, 1.0];
        // From a zero state the compensated vector is the input itself.
        let mut c = vec![0f32; 8];
        let mut signs = [0u8; 1];
        let sq = worker_pass(&mut c, &orig, 0.0, &mut signs);
        let s = norm_scale(sq, 8);
        let norm: f32 = orig.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((s - norm / 8f32.sqrt()).abs() < 1e-6);
        let mut packed = [0u8; 1];
        pack(&orig, &mut packed);
        assert_eq!(signs, packed);
        for (i, (e, o)) in errors(&c, s).iter().zip(&orig).enumerate() {
            assert!((e + s * unit(bit(&signs, i)) - o).abs() < 1e-6);
        }
        // The next pass adds that error to the next input; padding past a short input is 0.
        let sq2 = worker_pass(&mut c, &[1.0; 3], s, &mut signs);
        let err = errors(&[3.0f32, -1.0, 0.5, -0.5, 2.0, 0.0, -4.0, 1.0], s);
        let want: Vec<f32> = (0..8)
            .map(|i| if i < 3 { 1.0 + err[i] } else { err[i] })
            .collect();
        assert_eq!(c, want);
        let want_sq: f64 = want.iter().map(|v| f64::from(v * v)).sum();
        assert!((sq2 - want_sq).abs() < 1e-5);
    }
}
