//! bf16 and f16 reductions over the network at their own width: every rank sends each chunk
//! of its buffer straight to the rank that owns it, which reduces the n copies in f32 in rank
//! order and rounds once; all_reduce then shares the rounded chunks, reduce gathers them at
//! the root. The choice of when is [`HALF_DIRECT_MIN`]'s; smaller calls run the schedules of
//! the parent module on the buffer widened to f32.
//!
//! Owns: the 16-bit way of all_reduce, reduce_scatter and reduce. Must not know: how messages
//! travel (it runs schedules through the parent's executor).

use std::mem::size_of;

use super::{Run, RING_CHUNK_MAX};
use crate::algorithms as alg;
use crate::call::Call;
use crate::copy::copy;
use crate::error::Result;
use crate::reduce::{ReduceOp, Reducible};

/// From this many bytes of 16-bit floats (bf16, f16), all_reduce, reduce_scatter and reduce
/// over the network move them at their own width ([`Run::half_all_reduce`],
/// [`Run::half_reduce_scatter`], [`Run::half_reduce_to`]): every rank sends each
/// chunk straight to the rank that owns it, which reduces the n copies in f32 in rank order
/// and rounds once. Below, the schedules run on the buffer widened to f32 (fewer rounds, twice
/// the bytes). Measured over TCP, `distcomm bench <op> --dtype bf16`, 16-bit way against f32
/// way, 3 alternating runs (time ratio, < 1 faster): all_reduce world 2 32 KiB 0.95, 128 KiB
/// 0.74, 2-32 MiB 0.30-0.38 (8 KiB 1.44); world 3 64 KiB 0.67, 2-8 MiB 0.37-0.40 (32 KiB
/// 1.33); world 4 64 KiB 0.79, 2-32 MiB 0.40-0.44 (32 KiB 1.05); world 8 64 KiB 1.05, 512 KiB
/// 0.60, 4 MiB 0.36 (2 runs). reduce_scatter world 2 64 KiB 0.58, 4-32 MiB 0.21-0.29; world 3
/// 64 KiB 0.61, 32 MiB 0.36; world 4 64 KiB 0.90, 4-32 MiB 0.32-0.35 (8 KiB 1.14: log₂ n
/// rounds of halving win there); world 8 64 KiB 0.95, 4 MiB 0.45. reduce (against the binomial
/// tree in f32) world 2 64 KiB-16 MiB 0.30-0.51; world 3 64 KiB 0.79, 256 KiB 0.92, 1-16 MiB
/// 0.42-0.50; world 4 64 KiB 0.75, 1-16 MiB 0.35-0.40.
pub const HALF_DIRECT_MIN: usize = 64 << 10;

impl Run<'_> {
    /// Reduce-scatter of 16-bit floats at their own width (`count = input.len()` elements in
    /// the balanced chunks of [`alg::chunks`]): every rank sends every other rank the chunk
    /// that rank owns, in one message per peer, and reduces the n copies of its own chunk into
    /// `out` in f32, in rank order, rounding once (averages divided first:
    /// [`Reducible::reduce_all`]). Bytes sent per rank: (n − 1)/n of the input at 16 bits,
    /// where the schedules in f32 send as much at twice the width.
    pub(super) fn half_reduce_scatter<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        input: &[T],
        out: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let parts = alg::chunks(input.len(), n);
        let k = parts[r].len();
        let slots: Vec<_> = (0..n).map(|q| q * k..(q + 1) * k).collect();
        let sched = alg::direct_all_to_all(n, r, &parts, &slots);
        let mut got: Vec<T> = self.pool.take_len(n * k);
        let done = self.execute(call, tag, &sched, &mut got, input);
        if done.is_ok() {
            let own = &input[parts[r].clone()];
            let copy_of = |q: usize| if q == r { own } else { &got[slots[q].clone()] };
            T::reduce_all(out, n, &copy_of, op);
        }
        self.pool.give(got);
        done
    }

    /// all_reduce of 16-bit floats at their own width, in segments of at most
    /// [`RING_CHUNK_MAX`] bytes per rank (`DISTCOMM_RING_CHUNK_MAX`), each through
    /// [`Run::half_reduce_to`] with every rank as destination. Each element is reduced in f32
    /// and rounded once, by its owner, so every rank ends with the same bits, and sends
    /// 2(n − 1)/n of the buffer at 16 bits: half of what the way in f32 sends.
    pub(super) fn half_all_reduce<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let call = call.algo("direct reduce-scatter + all_gather, 16-bit");
        let chunk = self.config.ring_chunk_max.unwrap_or(RING_CHUNK_MAX);
        let per_seg = (chunk / size_of::<T>()).max(1).saturating_mul(self.size());
        for part in alg::chunks(buf.len(), buf.len().div_ceil(per_seg).max(1)) {
            self.half_reduce_to(&call, tag, &mut buf[part], op, None)?;
        }
        Ok(())
    }

    /// [`Run::half_reduce_scatter`] of `buf`, then the owners' rounded chunks go at 16 bits to
    /// `root` (a reduce: the root receives 2(n − 1)/n of the buffer at 16 bits, where the
    /// binomial tree in f32 brings it ⌈log₂ n⌉ whole buffers at twice the width), or to every
    /// rank when `root` is `None` (all_gather). Other ranks' buffers of a reduce stay as they
    /// were.
    pub(super) fn half_reduce_to<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        buf: &mut [T],
        op: ReduceOp,
        root: Option<usize>,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let mine = alg::chunks(buf.len(), n)[r].clone();
        let mut own: Vec<T> = self.pool.take_len(mine.len());
        let mut done = self.half_reduce_scatter(call, tag, buf, &mut own, op);
        if done.is_ok() {
            done = match root {
                None => {
                    copy(&mut buf[mine], &own);
                    self.all_gather_on(call, tag, buf)
                }
                Some(root) => {
                    let sched = alg::gather_chunks(n, r, root, buf.len());
                    let got = if r == root {
                        self.execute(call, tag, &sched, buf, &[])
                    } else {
                        self.execute(call, tag, &sched, &mut [], &own)
                    };
                    if got.is_ok() && r == root {
                        copy(&mut buf[mine], &own);
                    }
                    got
                }
            };
        }
        self.pool.give(own);
        done
    }
}
