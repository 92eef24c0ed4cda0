//! 1-bit compressed all_reduce with error feedback (DeepSpeed's `compressed_allreduce`, the
//! communication of 1-bit Adam), built on the collectives.
//!
//! Every rank keeps a *worker error* (the size of the buffer, padded so that each rank's chunk
//! is a whole number of bytes of signs) and a *server error* (one chunk). A call:
//!
//! 1. adds the worker error to the (padded) buffer, compresses it to one sign bit per element
//!    (`x ≥ 0 → 1`, packed most-significant bit first) and one scale `‖x‖₂ / √n`, and keeps
//!    what the compression lost as the new worker error;
//! 2. phase 1: `all_to_all` of the signs (rank r receives everyone's chunk r) and `all_gather`
//!    of the scales;
//! 3. each rank, as the *server* of its chunk, averages the decompressed chunks, adds its server
//!    error, compresses the result again and keeps the new server error;
//! 4. phase 2: `all_gather` of the servers' signs and scales; every rank decompresses the whole
//!    buffer.
//!
//! On the wire each element costs two bits (one per phase) plus two f32 per rank and phase,
//! against 2·(n−1)/n·32 bits for an exact ring all_reduce. An empty buffer zeroes both error
//! buffers.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::collectives::sent_bytes;
use crate::error::Result;
use crate::group::{Inner, ProcessGroup};
use crate::work::Work;

/// The error-feedback state of one buffer (keep one per all-reduced buffer, on every rank).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OneBitState {
    /// What compressing this rank's contribution lost (padded length).
    pub worker_error: Vec<f32>,
    /// What compressing this rank's server chunk lost (one chunk).
    pub server_error: Vec<f32>,
}

/// The buffer length padded so that each of `world` chunks is a whole number of bytes of signs.
pub fn padded_len(len: usize, world: usize) -> usize {
    len.div_ceil(8 * world) * 8 * world
}

/// `‖x‖₂ / √len` (0 for an empty slice).
fn scale(x: &[f32]) -> f32 {
    norm_scale(sum_sq(x), x.len())
}

fn norm_scale(sum_sq: f64, len: usize) -> f32 {
    if len == 0 {
        return 0.0;
    }
    (sum_sq.sqrt() / (len as f64).sqrt()) as f32
}

/// The sum of squares: f32 lanes over short blocks, blocks summed in f64, so that it vectorises
/// and stays accurate over millions of elements.
fn sum_sq(x: &[f32]) -> f64 {
    let mut total = 0f64;
    for block in x.chunks(1024) {
        let mut lanes = [0f32; 8];
        let mut eights = block.chunks_exact(8);
        for e in &mut eights {
            for (l, v) in lanes.iter_mut().zip(e) {
                *l += v * v;
            }
        }
        let tail: f32 = eights.remainder().iter().map(|v| v * v).sum();
        total += f64::from(lanes.iter().sum::<f32>() + tail);
    }
    total
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

/// `x = buf + error` (zero-padded `buf`, `x` as long as `error`), returning its scale: one pass.
fn compensate(x: &mut Vec<f32>, buf: &[f32], error: &[f32]) -> f32 {
    x.clear();
    x.resize(error.len(), 0.0);
    let mut total = 0f64;
    let (head, tail) = x.split_at_mut(buf.len());
    for ((xs, bs), es) in head
        .chunks_mut(1024)
        .zip(buf.chunks(1024))
        .zip(error.chunks(1024))
    {
        for ((x, b), e) in xs.iter_mut().zip(bs).zip(es) {
            *x = b + e;
        }
        total += sum_sq(xs);
    }
    tail.copy_from_slice(&error[buf.len()..]);
    total += sum_sq(tail);
    norm_scale(total, error.len())
}

/// Compresses `x` (a multiple of 8 long) at scale `s`: writes its packed signs and turns `x`
/// into what the compression lost (`x − s·sign(x)`).
fn compress_with(x: &mut [f32], signs: &mut [u8], s: f32) {
    let units = units();
    for (byte, eight) in signs.iter_mut().zip(x.chunks_exact_mut(8)) {
        // Written as lane-wise steps so that the compiler vectorises them.
        let mut bits = [0u32; 8];
        for (j, (b, v)) in bits.iter_mut().zip(eight.iter()).enumerate() {
            *b = u32::from(*v >= 0.0) << (7 - j);
        }
        let b = bits.iter().fold(0, |acc, b| acc | b) as u8;
        for (v, u) in eight.iter_mut().zip(&units[usize::from(b)]) {
            *v -= s * u;
        }
        *byte = b;
    }
}

/// `out[i] += w · unit(sign i)` for every element (`out` a multiple of 8 long).
fn accumulate(out: &mut [f32], packed: &[u8], w: f32) {
    let units = units();
    for (eight, &b) in out.chunks_exact_mut(8).zip(packed) {
        for (v, u) in eight.iter_mut().zip(&units[usize::from(b)]) {
            *v += w * u;
        }
    }
}

/// `out[i] = s · unit(sign i)` for every element of `out` (any length ≤ 8 × `packed`).
fn decompress(out: &mut [f32], packed: &[u8], s: f32) {
    let units = units();
    for (part, &b) in out.chunks_mut(8).zip(packed) {
        for (v, u) in part.iter_mut().zip(&units[usize::from(b)]) {
            *v = s * u;
        }
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

    /// The sequence numbers of the four collectives of a call (taken at issue time, in program
    /// order); none for an empty buffer, which communicates nothing.
    fn onebit_tags(&self, len: usize) -> Option<[u32; 4]> {
        (len > 0).then(|| std::array::from_fn(|_| self.inner.next_tag()))
    }
}

impl OneBitState {
    /// Zeroes both error buffers (what an empty call does).
    fn clear(&mut self) {
        self.worker_error.iter_mut().for_each(|v| *v = 0.0);
        self.server_error.iter_mut().for_each(|v| *v = 0.0);
    }
}

/// Runs one call and books it in the comms log as `onebit_all_reduce` (its four collectives
/// are not logged alone), with the bytes it actually sent.
fn onebit_on(g: &Inner, tags: [u32; 4], buf: &mut [f32], state: &mut OneBitState) -> Result<()> {
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
    tags: [u32; 4],
    buf: &mut [f32],
    state: &mut OneBitState,
) -> Result<()> {
    let n = g.members.len();
    let padded = padded_len(buf.len(), n);
    let chunk = padded / n;
    if state.worker_error.len() != padded || state.server_error.len() != chunk {
        state.worker_error = vec![0.0; padded];
        state.server_error = vec![0.0; chunk];
    }
    // 1. Compensate and compress this rank's contribution. All scratch comes from the group's
    // pool (no page faults on every call), and the state is replaced only once the call
    // succeeded.
    let pool = &g.pool;
    let zeroed = |len: usize| {
        let mut v: Vec<u8> = pool.take();
        v.resize(len, 0);
        v
    };
    let mut x: Vec<f32> = pool.take();
    let my_scale = compensate(&mut x, buf, &state.worker_error);
    let mut signs = zeroed(padded / 8);
    compress_with(&mut x, &mut signs, my_scale);
    // 2. Phase 1: chunk r of every rank's signs to rank r; every rank's scale to all.
    let per = chunk / 8;
    let mut got_signs = zeroed(padded / 8);
    let counts = vec![per; n];
    let mut scales = vec![0f32; n];
    let phase1 = g
        .all_to_all_on(
            tags[0],
            (&signs, &counts),
            (&mut got_signs, &counts),
            false,
            true,
        )
        .and_then(|()| g.all_gather_on(tags[1], &[my_scale], &mut scales, true));
    // 3. Serve our chunk: average, compensate, compress again.
    let mut server: Vec<f32> = pool.take();
    server.extend_from_slice(&state.server_error);
    for (packed, s) in got_signs.chunks_exact(per).zip(&scales) {
        accumulate(&mut server, packed, s / n as f32);
    }
    let server_scale = scale(&server);
    let server_signs = &mut signs[..per];
    compress_with(&mut server, server_signs, server_scale);
    // 4. Phase 2: every server's chunk to everyone.
    let mut server_scales = vec![0f32; n];
    let phase2 = phase1
        .and_then(|()| g.all_gather_on(tags[2], server_signs, &mut got_signs, true))
        .and_then(|()| g.all_gather_on(tags[3], &[server_scale], &mut server_scales, true));
    pool.give(signs);
    if let Err(e) = phase2 {
        pool.give(got_signs);
        pool.give(x);
        pool.give(server);
        return Err(e);
    }
    for (i, part) in buf.chunks_mut(chunk).enumerate() {
        decompress(part, &got_signs[i * per..(i + 1) * per], server_scales[i]);
    }
    pool.give(got_signs);
    // Last in, first out: the next call takes the larger buffer first, for `x`.
    pool.give(std::mem::replace(&mut state.server_error, server));
    pool.give(std::mem::replace(&mut state.worker_error, x));
    Ok(())
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

    #[test]
    fn compression_keeps_what_it_lost() {
        let mut x = vec![3.0f32, -1.0, 0.5, -0.5, 2.0, 0.0, -4.0, 1.0];
        let orig = x.clone();
        let mut signs = [0u8; 1];
        let s = scale(&x);
        compress_with(&mut x, &mut signs, s);
        let norm: f32 = orig.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((s - norm / 8f32.sqrt()).abs() < 1e-6);
        for (i, (e, o)) in x.iter().zip(&orig).enumerate() {
            let decompressed = s * unit(bit(&signs, i));
            assert!((e + decompressed - o).abs() < 1e-6);
        }
    }
}
