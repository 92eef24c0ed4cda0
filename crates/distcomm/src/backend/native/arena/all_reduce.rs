//! all_reduce through the arena, chunk by chunk (the steps the module doc of `arena.rs`
//! lists): small chunks with one barrier, every rank reducing all of it; larger ones with two,
//! every rank reducing its share into the shared result. Large reduces and reduce_scatters
//! take this way too (`intranode.rs`).

use std::sync::atomic::Ordering;

use super::{Arena, Exchange, Reads, Wait, INLINE, LINE_DATA};
use crate::copy::{copy, copy_bytes_streaming, copy_bytes_streaming_if};
use crate::error::Result;
use crate::reduce::{ReduceOp, Reducible};

/// When ranks outnumber cores on worlds up to [`CROWDED_ONE_CHUNK_RANKS`], all_reduce moves
/// buffers up to this many bytes in one chunk instead of quarters of at least 64 KiB: the
/// chunks' copies cannot overlap when every core is busy anyway, and each chunk's two barriers
/// wait for every rank to be scheduled. Measured on 2 cores (`distcomm bench`, 6 alternating
/// pairs of 4 calls, median of per-pair ratios, one chunk / four): all_reduce world 4 256 KiB
/// 0.74x the time (0.61-0.88), 1 MiB 0.93x (0.81-0.97); world 3 256 KiB 0.89x, 1 MiB 0.88x;
/// reduce world 4 1 MiB 0.91x, reduce_scatter 1.02x (0.89-1.48). Not beyond: world 4 4 MiB
/// (two 2 MiB chunks against four of 1 MiB) 1.22x, world 8 1 MiB 1.27x.
const CROWDED_ONE_CHUNK_MAX: usize = 1 << 20;
/// See [`CROWDED_ONE_CHUNK_MAX`].
const CROWDED_ONE_CHUNK_RANKS: usize = 4;

/// Chunks up to this many bytes take one barrier: every rank reduces all of it (n reads of a
/// small chunk cost less than a second barrier).
const SMALL: usize = 16 << 10;

/// Where the arena streams ([`Arena::streams`]: ranks apart, or outnumbering the cores),
/// chunks larger than [`SMALL`] go into the slots, and their reductions into the result, with
/// non-temporal stores ([`copy_bytes_streaming`]); a reduction combines pieces of this many
/// bytes in this core's cache first. Every line of a slot or of the result was read last by
/// another rank; an ordinary store must take it back from that core's cache first, and where
/// the cores share no cache that costs more than the copy: world 2 apart, 16 MiB, 8 MiB
/// copied in took 2.5-3.0 ms and the reduction of 8 MiB 3.7-3.8 ms (copy out, 16 MiB read,
/// 0.8 ms). Measured in alternating runs (µs, streaming against ordinary stores), world 2
/// apart: 1 MiB 167 against 525, 4 MiB 600 against 2000, 16 MiB 2.8 ms against 8.1, 64 MiB
/// 15.2 ms against 34.7 (the slots near: 16 MiB 3.5-3.9 ms against 2.4-2.5, so not there).
/// On 2 cores, worlds 3 / 4 / 8, the vCPUs apart: 1 MiB 245 / 276 / 620 against 690-730 /
/// 825-850 / 1570-1640, 16 MiB 5.6 / 6.3 / 14.6 ms against 11.4-11.9 / 12.1-12.5 /
/// 18.4-20.3; near: world 3 256 KiB 64 against 57, 1 MiB 239 against 185, 4 MiB 1020
/// against 806, world 8 1 MiB 632 against 1552 (Open MPI: world 3 1 MiB 1.4 ms, world 8
/// 0.9 ms).
const STREAM_PIECE: usize = 16 << 10;

impl Arena {
    /// All-reduces `buf` in place through the arena. `fp`, `dtype` and `tag` describe the
    /// caller's call (for desync checks). 16-bit floats travel at 16 bits and are reduced in
    /// f32 and rounded once, `Avg` divided before rounding ([`Reducible::reduce_all`]); other
    /// types leave `Avg`'s division to the caller. Only the elements `take` of `buf` take the
    /// result (every rank still reduces its share), the others stay as they are: all of them
    /// for all_reduce, all or none for a reduce (the root's or another's), this rank's block
    /// for a reduce_scatter. `s` describes the call (desync checks, errors).
    pub(crate) fn all_reduce<T: Reducible>(
        &self,
        s: &Exchange<'_>,
        (buf, take): (&mut [T], std::ops::Range<usize>),
        op: ReduceOp,
    ) -> Result<()> {
        let first_step = self.step.load(Ordering::Acquire);
        let size = std::mem::size_of::<T>();
        // Four chunks at least (copies in, reductions and copies out of neighbouring chunks
        // overlap across ranks), each between 64 KiB and a slot. Measured on 2 ranks on an
        // earlier host: 1 MiB all_reduce 218 µs in 256 KiB chunks vs 250 µs in one; 64 MiB
        // 2.35 GB/s busbw in 2 MiB chunks vs 1.8 in 256 KiB ones.
        // (`max` then `min`: a slot smaller than 64 KiB, as DISTCOMM_SHM_ARENA_CHUNK may ask.)
        // Crowded small worlds take one chunk up to `CROWDED_ONE_CHUNK_MAX` (see there), and
        // so do two ranks on cores of their own up to a slot: measured on an AMD EPYC host,
        // one chunk against four (4 rounds each, gated on the placement, µs), ranks near:
        // 256 KiB 34 against 42, 512 KiB 50 against 83, 1 MiB 97 against 124, 1.5 MiB 143
        // against 154, 2 MiB 198 against 194; apart (non-temporal stores): 128 KiB 23 against
        // 25, 256 KiB 43 against 50, 1 MiB 152 against 168, 2 MiB 300 against 475. (Larger
        // worlds on cores of their own were not measured: the host has 2 cores.)
        let bytes = std::mem::size_of_val(buf);
        let crowded_whole = self.oversubscribed
            && self.n <= CROWDED_ONE_CHUNK_RANKS
            && bytes <= CROWDED_ONE_CHUNK_MAX;
        let chunk_bytes = if crowded_whole || (self.n == 2 && !self.oversubscribed) {
            bytes
        } else {
            (bytes / 4).max(64 << 10)
        }
        .min(self.chunk);
        let per_chunk = (chunk_bytes / size).max(1);
        let result = self.run((buf, take), op, per_chunk, first_step, Wait::new(s));
        match &result {
            Ok(chained) => {
                let ran = buf.len().div_ceil(per_chunk) as u64;
                self.chain.store(*chained, Ordering::Relaxed);
                self.step.store(first_step + ran, Ordering::Release);
                self.claim_ahead(first_step + ran);
            }
            // The ranks' chunk counters may no longer agree (a rank ran another collective, or
            // stopped mid-call): nobody uses the arena again.
            Err(e) => self.break_for(e),
        }
        result.map(|_| ())
    }

    fn run<T: Reducible>(
        &self,
        (buf, take): (&mut [T], std::ops::Range<usize>),
        op: ReduceOp,
        per_chunk: usize,
        first_step: u64,
        w: Wait<'_>,
    ) -> Result<u64> {
        let w = &w;
        let size = std::mem::size_of::<T>();
        let (w0, w1) = w.call;
        // Later chunks of the call need no wait of their own: every rank passed the last
        // barrier of the chunk before, a full one.
        let first_bytes = size * per_chunk.min(buf.len());
        self.begin(first_step, first_bytes > INLINE, w)?;
        let stream = self.streams();
        let mut scratch: Vec<T> = match stream && first_bytes > SMALL {
            true => vec![T::zeroed(); (STREAM_PIECE / size).max(1)],
            false => Vec::new(),
        };
        // In the first step's line: a rank that finished this call and started the next
        // cannot overwrite what a slower rank is about to check.
        let chained = self.publish(first_step, w.call);

        for (k, chunk) in buf.chunks_mut(per_chunk).enumerate() {
            let step = first_step + k as u64;
            let parity = step % 2;
            let m = chunk.len();
            // SAFETY (all views below): the slot of rank `me` at this parity is written only
            // by us, between barrier 1 of chunk `step - 1` (every rank finished reading it as
            // chunk `step - 2`) and barrier 1 of this chunk; the other slots are only read
            // between the two barriers of this chunk, when nobody writes them; our share of
            // the result is written only by us between the barriers, and the result is read
            // (what each rank takes of it) after barrier 2, before barrier 1 of chunk `step + 2` lets
            // anyone write it again ([`Arena::begin`] keeps both true after an exchange step
            // that waited for fewer ranks). Offsets are multiples of 64 plus element
            // multiples, so aligned for T.
            let bytes = std::mem::size_of_val(chunk);
            // The elements of this chunk that take the result.
            let start = k * per_chunk;
            let taken = take.start.clamp(start, start + m) - start
                ..take.end.clamp(start, start + m) - start;
            if bytes <= SMALL {
                // Small: one barrier, then every rank reduces the whole chunk itself, in rank
                // order (so every rank computes the same bits). Slots (or the data part of the
                // control line, for tiny chunks) are read only between this barrier and our
                // arrival at the next chunk's, as above.
                let at = |r: usize| {
                    if bytes <= INLINE {
                        self.line(r, step) + LINE_DATA
                    } else {
                        self.slot(parity, r)
                    }
                };
                // SAFETY: see above.
                copy(unsafe { self.region.view_mut::<T>(at(self.me), m) }, chunk);
                self.seq(self.me, step)
                    .store(2 * step + 2, Ordering::Release);
                self.barrier(step, 2 * step + 2, w)?;
                if k == 0 {
                    self.check_calls(Reads::All, w.op, first_step, (w0, w1), chained)?;
                }
                if !taken.is_empty() {
                    let (at_lo, len) = (taken.start * size, taken.len());
                    // SAFETY: see above.
                    let slot = |r: usize| unsafe { self.region.view::<T>(at(r) + at_lo, len) };
                    T::reduce_all(&mut chunk[taken], self.n, &slot, op);
                }
                continue;
            }
            // Our share of the chunk: we alone reduce it, and take our part of it from `chunk`
            // itself; the others read only their shares of our slot, so ours stays out of it
            // (a copy in of 1/n of the chunk less).
            let (lo, hi) = (m * self.me / self.n, m * (self.me + 1) / self.n);
            // SAFETY: see above.
            let mine = unsafe { self.region.view_mut::<T>(self.slot(parity, self.me), m) };
            put(stream, &mut mine[..lo], &chunk[..lo]);
            put(stream, &mut mine[hi..], &chunk[hi..]);
            self.seq(self.me, step)
                .store(2 * step + 1, Ordering::Release);
            self.barrier(step, 2 * step + 1, w)?;
            if k == 0 {
                self.check_calls(Reads::All, w.op, first_step, (w0, w1), chained)?;
            }
            if hi > lo {
                // SAFETY: see above.
                let out = unsafe {
                    self.region
                        .view_mut::<T>(self.result(parity) + lo * size, hi - lo)
                };
                let own = &chunk[lo..hi];
                // SAFETY: see above.
                let slot = |r: usize| match r == self.me {
                    true => own,
                    false => unsafe {
                        self.region
                            .view::<T>(self.slot(parity, r) + lo * size, hi - lo)
                    },
                };
                match stream {
                    true => reduce_streaming(out, (self.n, &slot, op), &mut scratch),
                    false => T::reduce_all(out, self.n, &slot, op),
                }
            }
            self.seq(self.me, step)
                .store(2 * step + 2, Ordering::Release);
            self.barrier(step, 2 * step + 2, w)?;
            if !taken.is_empty() {
                let from = self.result(parity) + taken.start * size;
                // SAFETY: see above.
                copy(&mut chunk[taken.clone()], unsafe {
                    self.region.view::<T>(from, taken.len())
                });
            }
        }
        Ok(chained)
    }
}

/// `dst.copy_from_slice(src)`, with non-temporal stores when `stream` (see [`STREAM_PIECE`]).
fn put<T: Reducible>(stream: bool, dst: &mut [T], src: &[T]) {
    let (dst, src) = (bytemuck::cast_slice_mut(dst), bytemuck::cast_slice(src));
    copy_bytes_streaming_if(stream, dst, src);
}

/// [`Reducible::reduce_all`] of the `n` sources `src` into `out`, piece by piece into
/// `scratch` (in this core's cache) and from there into `out` with non-temporal stores (see
/// [`STREAM_PIECE`]). The same operations on every element: the same bits.
fn reduce_streaming<'a, T: Reducible + 'a>(
    out: &mut [T],
    (n, src, op): (usize, &dyn Fn(usize) -> &'a [T], ReduceOp),
    scratch: &mut [T],
) {
    if scratch.is_empty() {
        return T::reduce_all(out, n, src, op);
    }
    let piece = scratch.len();
    for (k, out) in out.chunks_mut(piece).enumerate() {
        let at = k * piece..k * piece + out.len();
        let part = |r: usize| &src(r)[at.clone()];
        let tmp = &mut scratch[..out.len()];
        T::reduce_all(tmp, n, &part, op);
        copy_bytes_streaming(bytemuck::cast_slice_mut(out), bytemuck::cast_slice(tmp));
    }
}
