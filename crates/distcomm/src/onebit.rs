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

/// `‖x‖₂ / √len` (0 for an empty slice), accumulated in f64.
fn scale(x: &[f32]) -> f32 {
    if x.is_empty() {
        return 0.0;
    }
    let sq: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    (sq.sqrt() / (x.len() as f64).sqrt()) as f32
}

/// ±1 for a sign bit.
fn unit(bit: bool) -> f32 {
    if bit {
        1.0
    } else {
        -1.0
    }
}

/// Packs the signs of `x` (`x ≥ 0 → 1`) most-significant bit first; `x.len()` is a multiple of 8.
fn pack(x: &[f32], out: &mut [u8]) {
    for (byte, eight) in out.iter_mut().zip(x.chunks_exact(8)) {
        *byte = eight
            .iter()
            .fold(0u8, |acc, &v| (acc << 1) | u8::from(v >= 0.0));
    }
}

/// The sign bit `i` of a packed buffer.
fn bit(packed: &[u8], i: usize) -> bool {
    packed[i / 8] & (0x80 >> (i % 8)) != 0
}

/// Compresses `x`: returns its scale, writes its packed signs, and turns `x` into what the
/// compression lost (`x − scale·sign(x)`).
fn compress(x: &mut [f32], signs: &mut [u8]) -> f32 {
    let s = scale(x);
    pack(x, signs);
    for v in x.iter_mut() {
        *v -= s * unit(*v >= 0.0);
    }
    s
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
    // 1. Compensate and compress this rank's contribution.
    let mut x = vec![0f32; padded];
    x[..buf.len()].copy_from_slice(buf);
    for (v, e) in x.iter_mut().zip(&state.worker_error) {
        *v += e;
    }
    let mut signs = vec![0u8; padded / 8];
    let my_scale = compress(&mut x, &mut signs);
    let worker_error = x;
    // 2. Phase 1: chunk r of every rank's signs to rank r; every rank's scale to all.
    let per = chunk / 8;
    let mut got_signs = vec![0u8; padded / 8];
    let counts = vec![per; n];
    g.all_to_all_on(
        tags[0],
        (&signs, &counts),
        (&mut got_signs, &counts),
        false,
        true,
    )?;
    let mut scales = vec![0f32; n];
    g.all_gather_on(tags[1], &[my_scale], &mut scales, true)?;
    // 3. Serve our chunk: average, compensate, compress again.
    let mut server = state.server_error.clone();
    for (packed, s) in got_signs.chunks_exact(per).zip(&scales) {
        let w = s / n as f32;
        for (i, v) in server.iter_mut().enumerate() {
            *v += w * unit(bit(packed, i));
        }
    }
    let mut server_signs = vec![0u8; per];
    let server_scale = compress(&mut server, &mut server_signs);
    // 4. Phase 2: every server's chunk to everyone.
    let mut all_signs = vec![0u8; padded / 8];
    g.all_gather_on(tags[2], &server_signs, &mut all_signs, true)?;
    let mut server_scales = vec![0f32; n];
    g.all_gather_on(tags[3], &[server_scale], &mut server_scales, true)?;
    for (i, v) in buf.iter_mut().enumerate() {
        *v = server_scales[i / chunk] * unit(bit(&all_signs, i));
    }
    state.worker_error = worker_error;
    state.server_error = server;
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
        let s = compress(&mut x, &mut signs);
        let norm: f32 = orig.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((s - norm / 8f32.sqrt()).abs() < 1e-6);
        for (i, (e, o)) in x.iter().zip(&orig).enumerate() {
            let decompressed = s * unit(bit(&signs, i));
            assert!((e + decompressed - o).abs() < 1e-6);
        }
    }
}
