//! The native backend's collectives: the schedules of [`crate::algorithms`] run over the
//! engine's point-to-point, the algorithm chosen per op, size and world, and all_reduce through
//! the shared-memory arena when the group has one.
//!
//! Every message of a collective carries the call's fingerprint and its sequence number as
//! tag (see [`crate::call`]); a failed call is cancelled on every member.
//!
//! `f16`/`bf16` reductions are carried out in `f32` and rounded once: large all_reduces,
//! reduce_scatters and reduces send the 16-bit values themselves, each chunk reduced by the
//! rank that owns it ([`HALF_DIRECT_MIN`]); the other schedules run on the buffer widened to
//! `f32`.
//!
//! Owns: which schedule runs a call, and running it. Must not know: the API's argument checks
//! (calls arrive checked, this rank's own block in place) or how messages travel.

use smallvec::SmallVec;
use std::mem::{size_of, size_of_val};
use std::ops::Deref;
use std::time::Duration;

use super::arena::Arena;
use super::NativeBackend;
use crate::algorithms::{self as alg, Schedule, Space, Step};
use crate::backend::{typed, typed_mut, with_dtype, Coll, CollCall, CTX_COLL};
use crate::call::Call;
use crate::call::Envelope;
use crate::commslog::count_sent;
use crate::completion::{boxed, Deadline, RawView};
use crate::copy::{copy, copy_bytes};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::order::Turn;
use crate::reduce::{ReduceOp, Reducible};
use crate::work::{wait_all, Pending, Work};

mod sixteen_bit;
pub use sixteen_bit::HALF_DIRECT_MIN;

// Size thresholds (bytes) for choosing algorithms; see `distcomm bench` and the README for
// how they were measured. Overridable by environment variables (`crate::config`).

/// all_reduce switches from recursive doubling to the ring at this many bytes on worlds that
/// are not powers of two ([`POW2_ALL_REDUCE_RING_MIN`] on the others). Measured with
/// `DISTCOMM_ALL_REDUCE_RING_MIN=1` vs `=1000000000 distcomm bench all_reduce` on this 2-core
/// VM: world 3 crosses between 64 KiB and 256 KiB.
pub const ALL_REDUCE_RING_MIN: usize = 256 * 1024;
/// [`ALL_REDUCE_RING_MIN`] on worlds that are powers of two, where recursive doubling (two
/// ranks) or [`HALVING_DOUBLING_MIN`]'s halving + doubling (more) send whole halves at once.
/// Measured over TCP, the two alternated, 2 runs each (µs): world 2, doubling against ring,
/// 256 KiB 110-119 against 177-180, 1 MiB 304-322 against 365-372, 2 MiB 606-626 against
/// 665-723, 4 MiB 1192-1302 against 1240-1351, 8 MiB 3095-3415 against 2795-2978; world 4,
/// halving + doubling against ring, 256 KiB 647-662 against 821-832, 1 MiB 1807-1914 against
/// 2228-2237, 4 MiB 5654-5804 against 5132-5393.
pub const POW2_ALL_REDUCE_RING_MIN: usize = 4 << 20;
/// The ring all_reduce runs on segments of the buffer one after the other, so that each round
/// moves at most this many bytes per rank (received, then reduced while still in cache).
/// Measured with `DISTCOMM_RING_CHUNK_MAX` at 1, 2 and 4 MiB and unbounded, 64 MiB over TCP
/// (busbw, GB/s, two runs each): world 4 0.92 -> 1.16-1.20 at 1 MiB (1.11-1.18 at 2, 0.97-1.16
/// at 4); world 3 1.08-1.10 -> 1.25-1.26; world 2 1.66-1.72 -> 1.95-1.99. Over shared memory
/// it makes no difference either way.
pub const RING_CHUNK_MAX: usize = 1 << 20;
/// On worlds that are powers of two above 2, all_reduce from this many bytes up to the ring's
/// threshold runs Rabenseifner's halving + doubling (2 log₂ n rounds of shrinking halves)
/// instead of recursive doubling's log₂ n rounds of the whole buffer. Measured over TCP,
/// world 4, `distcomm bench all_reduce` in alternating runs (µs): 16 KiB 62–74 doubling vs
/// 100–114; 32 KiB 119 vs 145–180 (ring); 64 KiB 148–183 vs 170–186 (doubling), 192–200 (ring);
/// 256 KiB 433–612 vs 685–886 (ring); 1 MiB 2040–3040 vs 2120–2400 (ring).
pub const HALVING_DOUBLING_MIN: usize = 32 << 10;
/// broadcast switches from the binomial tree to scatter + all-gather at this many bytes, on
/// five ranks or more. Measured like the all_reduce threshold: on 3 ranks the tree won at every
/// size up to 16 MiB; on 5 it lost from 4 MiB on (0.58 vs 0.56 GB/s at 4 MiB, 0.54 vs 0.48 at
/// 16 MiB).
pub const BROADCAST_SCATTER_MIN: usize = 4 << 20;
/// all_gather and reduce_scatter take log₂ n rounds (recursive doubling / halving) instead of
/// the ring's n − 1 up to these many bytes of the whole buffer, on worlds that are powers of
/// two. Above, the ring's smaller rounds overlap better (a halving round reduces only once all
/// of its half has arrived). Measured over TCP, world 4, `scripts/ab.py` ring against doubling
/// (3 alternating pairs, new / old time): all_gather 16 B 0.56, 64 KiB 0.76, 1 MiB 0.96, 16 MiB
/// 1.33; reduce_scatter 16 B 0.68, 64 KiB 0.78, 1 MiB 1.45.
pub const DOUBLING_ALL_GATHER_MAX: usize = 1 << 20;
/// See [`DOUBLING_ALL_GATHER_MAX`]. Measured again over TCP, world 4, halving against the ring
/// (3 alternating pairs, new / old time): 256 KiB 0.98, 512 KiB 0.90, 1 MiB 0.84, 4 MiB 1.21,
/// 16 MiB 1.11 (an earlier machine had the ring ahead at 1 MiB).
pub const HALVING_REDUCE_SCATTER_MAX: usize = 1 << 20;

/// Runs collective `coll` of `c.dtype` elements on `b`, cancelling it on every member when it
/// fails.
pub(super) fn run(b: &NativeBackend, c: CollCall, coll: Coll<'_>) -> Result<()> {
    let CollCall {
        call,
        dtype,
        tag,
        turn,
        timeout,
    } = c;
    let r = Run { b, timeout };
    let op = call.kind.name();
    b.ensure_arena(op, timeout)?;
    with_dtype!(dtype, T => r.coll::<T>(&call, tag, turn, coll, op))
        .map_err(|e| failed(b, &call, dtype, tag, e))
}

/// The error `e` of a failed `call` of `dtype` elements with `tag`, once the call is cancelled
/// on every member. (Out of line: every call passes here, few fail.)
#[cold]
#[inline(never)]
fn failed(b: &NativeBackend, call: &Call, dtype: DType, tag: u32, e: Error) -> Error {
    // A call that fell back to the network (the arena stopped) and found a rank gone which had
    // stopped the arena itself says why that rank stopped.
    let e = match (&e, b.arena()) {
        (Error::PeerLost { peer, .. }, Some(arena)) => {
            arena.stopped_by(call.kind.name(), *peer).unwrap_or(e)
        }
        _ => e,
    };
    b.cancel(call, dtype, tag, &e);
    e
}

/// One collective call running on a group's native backend, with the call's deadline.
pub(super) struct Run<'a> {
    pub(super) b: &'a NativeBackend,
    pub(super) timeout: Duration,
}

impl Deref for Run<'_> {
    type Target = NativeBackend;
    fn deref(&self) -> &NativeBackend {
        self.b
    }
}

impl Run<'_> {
    pub(super) fn invalid(&self, op: &'static str, detail: String) -> Error {
        Error::InvalidArgument {
            op,
            rank: self.rank,
            detail,
        }
    }

    /// The call on typed buffers.
    fn coll<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        turn: Turn,
        coll: Coll<'_>,
        op: &'static str,
    ) -> Result<()> {
        if let Coll::AllReduce(buf, rop) = coll {
            return self.all_reduce_on(call, tag, typed_mut::<T>(op, buf)?, rop, turn);
        }
        if let (Coll::Barrier, Some(arena)) = (&coll, self.arena()) {
            if arena.usable() {
                turn.wait(op, self.rank, self.timeout)?;
                if arena.usable() {
                    return self.through_arena::<T>(arena, call, tag, (coll, false));
                }
            }
        }
        if let Some(arena) = self.arena() {
            if let Some(bytes) = super::intranode::part_bytes::<T>(&coll, call, self.size()) {
                let way = super::intranode::arena_way(&coll, bytes, arena, self.size());
                if let Some(direct) = way.filter(|_| arena.usable()) {
                    // Every rank enters the arena in issue order: wait until every earlier
                    // collective of the group has started, and hold the turn until this one
                    // ends.
                    turn.wait(op, self.rank, self.timeout)?;
                    if arena.usable() {
                        return self.through_arena::<T>(arena, call, tag, (coll, direct));
                    }
                }
            }
        }
        // Only the arena's order matters to the native schedules: their messages match by
        // sequence number.
        drop(turn);
        match coll {
            Coll::AllReduce(..) => Ok(()),
            Coll::Barrier => self.b.barrier(self.timeout),
            Coll::Broadcast(buf, root) => {
                self.broadcast_on(call, tag, typed_mut::<T>(op, buf)?, root)
            }
            Coll::Reduce(buf, root, rop) => {
                self.reduce_on(call, tag, typed_mut::<T>(op, buf)?, root, rop)
            }
            Coll::AllGather(_, out) => self.all_gather_on(call, tag, typed_mut::<T>(op, out)?),
            Coll::Gather(input, out, root) => {
                let out = out.map(|o| typed_mut::<T>(op, o)).transpose()?;
                self.gather_on(call, tag, typed::<T>(op, input)?, out, root)
            }
            Coll::Scatter(input, out, _) => {
                let input = input.map(|i| typed::<T>(op, i)).transpose()?;
                self.scatter_on(call, tag, input, typed_mut::<T>(op, out)?)
            }
            Coll::ReduceScatter(input, out, rop) => {
                let (input, out) = (typed::<T>(op, input)?, typed_mut::<T>(op, out)?);
                self.reduce_scatter_on(call, tag, input, out, rop)
            }
            Coll::AllToAll((input, sc), (out, rc)) => {
                let (input, out) = (typed::<T>(op, input)?, typed_mut::<T>(op, out)?);
                self.all_to_all_on(call, tag, (input, sc), (out, rc))
            }
        }
    }

    /// Runs `sched` for this rank: per round, post every receive and send, wait for all, then
    /// combine what arrived.
    fn execute<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        sched: &Schedule,
        out: &mut [T],
        inp: &[T],
    ) -> Result<()> {
        chose(call, T::DTYPE, self.rank, self.size(), sched.len());
        if let Some(arena) = self.arena() {
            arena.announce(&call.fingerprint(), T::DTYPE, tag);
        }
        self.execute_rounds(call, tag, sched, out, inp)
    }

    /// All-reduce through the shared-memory arena (16-bit floats at their own width, reduced in
    /// f32 and rounded once; averages divided at the end, as on the network path), in the
    /// call's turn.
    fn arena_all_reduce<T: Reducible>(
        &self,
        arena: &Arena,
        call: &Call,
        tag: u32,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size();
        let fp = call.fingerprint();
        let s = self.exchange::<T>(call, &fp, tag);
        // What this rank puts into the shared arena is what it "sends". 16-bit floats go in at
        // their own width; the arena reduces them in f32, divides averages and rounds once.
        let done = if super::intranode::direct_all_reduce_worth_it::<T>(arena, size_of_val(buf)) {
            let algo = "shared-memory arena, direct copies";
            chose(&call.algo(algo), T::DTYPE, self.rank, n, 2);
            self.direct_all_reduce(arena, &s, buf, op)
        } else {
            chose(&call.algo("shared-memory arena"), T::DTYPE, self.rank, n, 1);
            let whole = 0..buf.len();
            arena.all_reduce(&s, (&mut *buf, whole), op)
        };
        done.map(|()| {
            count_sent(size_of_val(buf));
            if op == ReduceOp::Avg && !T::WIDENS {
                T::finish_avg(buf, n);
            }
        })
    }

    fn execute_rounds<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        sched: &Schedule,
        out: &mut [T],
        inp: &[T],
    ) -> Result<()> {
        // Fixed once the first round that waits has posted its messages: off the path to the
        // first send.
        let mut deadline = Deadline::after(self.timeout);
        let fp = call.fingerprint();
        let name = call.kind.name();
        let op = call.op.unwrap_or(ReduceOp::Sum);
        let eager_max = self.engine.eager_max();
        let env = Envelope {
            op: name,
            dtype: T::DTYPE,
            ctx: CTX_COLL,
            tag,
            fp,
        };
        for round in sched {
            let mut recvs: SmallVec<[_; 4]> = SmallVec::new();
            let mut sends: SmallVec<[_; 4]> = SmallVec::new();
            // Large transfers of rounds whose ranges do not overlap read and write the caller's
            // buffers in place (no copy); the guard makes the engine let go of them, whatever
            // way this round ends, before the buffers are touched again.
            let in_place = alg::disjoint_in_place(round);
            let mut direct = ViewGuard {
                engine: &self.engine,
                ids: Vec::new(),
                works: Vec::new(),
            };
            // Receives first, so that what the peers send finds its buffer posted; except in
            // a round that only receives eager messages over sockets: those are taken as they
            // come, without a handle where they already have (`recv_scheduled`), after the
            // sends have read the ranges they may reduce into.
            let is_recv = |s: &&Step| matches!(s, Step::Recv { .. });
            let take_as_come = round.iter().all(|s| match s {
                Step::Recv { peer, range, .. } => {
                    range.len() * size_of::<T>() <= eager_max && self.b.by_socket(*peer)
                }
                Step::Send { .. } => true,
            });
            let ordered = (round.iter().filter(|s| is_recv(s) != take_as_come))
                .chain(round.iter().filter(|s| is_recv(s) == take_as_come));
            for step in ordered {
                match step {
                    Step::Recv {
                        peer,
                        range,
                        reduce: false,
                    } if in_place && range.len() * size_of::<T>() > eager_max => {
                        let dst = out
                            .get_mut(range.clone())
                            .ok_or_else(|| self.invalid(name, "schedule out of bounds".into()))?;
                        // SAFETY: `out` outlives this round; nothing else touches this range
                        // until the round ends (ranges are disjoint: `in_place`), and the guard
                        // reclaims the view before the round returns, on every path.
                        let view = unsafe { RawView::of_mut(bytemuck::cast_slice_mut(dst)) };
                        let w: Work<()> =
                            self.b.post_recv(env, Box::new(view), *peer, self.timeout)?;
                        direct.ids.push(w.id());
                        direct.works.push(w);
                    }
                    Step::Recv {
                        peer,
                        range,
                        reduce,
                    } if take_as_come => {
                        let dst = out
                            .get_mut(range.clone())
                            .ok_or_else(|| self.invalid(name, "schedule out of bounds".into()))?;
                        let len = size_of_val(dst);
                        let took = self.b.recv_scheduled(env, *peer, len, |data| {
                            if *reduce {
                                reduce_bytes_into(dst, data, op);
                            } else {
                                copy_bytes(bytemuck::cast_slice_mut(dst), data);
                            }
                        });
                        if !took {
                            let buf: Vec<T> = self.pool.take_len(range.len());
                            let w: Work<Vec<T>> =
                                self.b.post_recv(env, boxed(buf), *peer, self.timeout)?;
                            recvs.push((w, range.clone(), *reduce));
                        }
                    }
                    Step::Recv {
                        peer,
                        range,
                        reduce,
                    } => {
                        // Overwritten whole by the message (a collective's must fit exactly),
                        // so whatever the pooled buffer held need not be cleared first.
                        let buf: Vec<T> = self.pool.take_len(range.len());
                        let w: Work<Vec<T>> =
                            self.b.post_recv(env, boxed(buf), *peer, self.timeout)?;
                        recvs.push((w, range.clone(), *reduce));
                    }
                    Step::Send { peer, space, range } => {
                        let src = match space {
                            Space::Out => out.get(range.clone()),
                            Space::In => inp.get(range.clone()),
                        }
                        .ok_or_else(|| self.invalid(name, "schedule out of bounds".into()))?;
                        count_sent(size_of_val(src));
                        if in_place && size_of_val(src) > eager_max {
                            // SAFETY: as for receives above; sends only read the range.
                            let view = unsafe { RawView::of(bytemuck::cast_slice(src)) };
                            let w: Work<()> =
                                self.b.post_send(env, Box::new(view), *peer, self.timeout)?;
                            direct.ids.push(w.id());
                            direct.works.push(w);
                            continue;
                        }
                        let small = size_of_val(src) <= eager_max;
                        if small && self.b.send_scheduled(env, bytemuck::cast_slice(src), *peer) {
                            continue;
                        }
                        let buf: Vec<T> = self.pool.copy_of(src);
                        let w: Work<Vec<T>> =
                            self.b.post_send(env, boxed(buf), *peer, self.timeout)?;
                        // A small send of a collective completes once written (no
                        // acknowledgement: a receiver that refuses it cancels the collective on
                        // every rank); nothing to wait for. Written at once (the usual case),
                        // its buffer goes back to the pool.
                        if !small {
                            sends.push(w);
                        } else if w.is_completed() {
                            if let Ok(buf) = w.take_buffer() {
                                self.pool.give(buf);
                            }
                        }
                    }
                }
            }
            if !(recvs.is_empty() && sends.is_empty() && direct.works.is_empty()) {
                let mut all: SmallVec<[&mut dyn Pending; 8]> = SmallVec::new();
                all.extend(recvs.iter_mut().map(|(w, _, _)| w as &mut dyn Pending));
                all.extend(sends.iter_mut().map(|w| w as &mut dyn Pending));
                all.extend(direct.works.iter_mut().map(|w| w as &mut dyn Pending));
                wait_all(&mut all, deadline.get(), self.timeout)?;
            }
            for (w, range, reduce) in recvs {
                let data = w.into_buffer()?;
                let dst = &mut out[range];
                if reduce {
                    T::reduce_into(dst, &data, op);
                } else {
                    copy(dst, &data);
                }
                self.pool.give(data);
            }
            for w in sends {
                if let Ok(buf) = w.into_buffer() {
                    self.pool.give(buf);
                }
            }
        }
        Ok(())
    }

    /// `buf` as `f32` in a pooled buffer, for the types collectives reduce in `f32` (16-bit
    /// floats; `None` for others). A fresh buffer would cost page faults on every large call
    /// (bf16 all_reduce of 64 MiB over TCP, world 2: 218 ms with them; f32 takes 37). Give it
    /// back to the pool when done.
    fn widened<T: Reducible>(&self, buf: &[T]) -> Option<Vec<f32>> {
        T::WIDENS.then(|| {
            let mut wide = self.pool.take_len(buf.len());
            T::widen_into(buf, &mut wide);
            wide
        })
    }

    /// A reducing collective on 16-bit floats, run whole in `f32` and, where `divide` (the end
    /// of an average), divided before it is rounded back. `None` for other types.
    fn in_f32<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        sched: &Schedule,
        buf: &mut [T],
        divide: bool,
    ) -> Option<Result<()>> {
        let mut wide = self.widened(buf)?;
        let done = self.execute::<f32>(call, tag, sched, &mut wide, &[]);
        if done.is_ok() {
            if divide {
                f32::finish_avg(&mut wide, self.size());
            }
            T::narrow(buf, &wide);
        }
        self.pool.give(wide);
        Some(done)
    }

    /// Runs a reducing collective, widening 16-bit floats to f32 around it.
    fn reducing<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        sched: &Schedule,
        buf: &mut [T],
    ) -> Result<()> {
        self.in_f32(call, tag, sched, buf, false)
            .unwrap_or_else(|| self.execute(call, tag, sched, buf, &[]))
    }

    fn all_reduce_on<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        buf: &mut [T],
        op: ReduceOp,
        turn: Turn,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let bytes = size_of_val(buf);
        if let Some(arena) = self.arena() {
            if bytes > 0 && bytes <= arena.max_bytes() {
                // Every rank enters the arena in issue order: wait until every earlier
                // collective of the group has started, and hold the turn until this one ends.
                turn.wait(call.kind.name(), r, self.timeout)?;
                if arena.usable() {
                    return self.arena_all_reduce(arena, call, tag, buf, op);
                }
            }
        }
        drop(turn);
        if T::WIDENS && bytes >= HALF_DIRECT_MIN && buf.len() >= n {
            return self.half_all_reduce(call, tag, buf, op);
        }
        let ring_min = if n.is_power_of_two() {
            POW2_ALL_REDUCE_RING_MIN
        } else {
            ALL_REDUCE_RING_MIN
        };
        let (call, sched) =
            if bytes >= self.config.all_reduce_ring_min.unwrap_or(ring_min) && buf.len() >= n {
                let chunk = self.config.ring_chunk_max.unwrap_or(RING_CHUNK_MAX) / size_of::<T>();
                let seg = chunk.max(1).saturating_mul(n);
                let sched = alg::segmented(buf.len(), seg, |len| alg::ring_all_reduce(n, r, len));
                (call.algo("ring"), sched)
            } else if n > 2 && n.is_power_of_two() && bytes >= HALVING_DOUBLING_MIN {
                let sched = alg::halving_doubling_all_reduce(n, r, buf.len());
                (call.algo("recursive halving + doubling"), sched)
            } else {
                (*call, alg::recursive_doubling_all_reduce(n, r, buf.len()))
            };
        // Averages of 16-bit floats divide in f32 too: widen around the whole thing.
        if op == ReduceOp::Avg {
            if let Some(done) = self.in_f32(&call, tag, &sched, buf, true) {
                return done;
            }
        }
        self.reducing(&call, tag, &sched, buf)?;
        if op == ReduceOp::Avg {
            T::finish_avg(buf, n);
        }
        Ok(())
    }

    fn broadcast_on<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        buf: &mut [T],
        root: usize,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let bytes = size_of_val(buf);
        let scatter_min = if n >= 5 {
            BROADCAST_SCATTER_MIN
        } else {
            usize::MAX
        };
        let (call, sched) = if bytes >= self.config.broadcast_scatter_min.unwrap_or(scatter_min)
            && buf.len() >= n
        {
            let sched = alg::scatter_all_gather_broadcast(n, r, root, buf.len());
            (call.algo("scatter + ring all_gather"), sched)
        } else {
            (*call, alg::binomial_broadcast(n, r, root, buf.len()))
        };
        self.execute(&call, tag, &sched, buf, &[])
    }

    fn reduce_on<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        buf: &mut [T],
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        if T::WIDENS && size_of_val(buf) >= HALF_DIRECT_MIN && buf.len() >= n {
            let call = call.algo("direct reduce-scatter + gather, 16-bit");
            return self.half_reduce_to(&call, tag, buf, op, Some(root));
        }
        let (call, sched) = if n <= 4 && size_of_val(buf) <= DIRECT_REDUCE_MAX {
            (
                call.algo("direct"),
                alg::direct_reduce(n, r, root, buf.len()),
            )
        } else {
            (*call, alg::binomial_reduce(n, r, root, buf.len()))
        };
        let call = &call;
        if op == ReduceOp::Avg {
            if let Some(done) = self.in_f32(call, tag, &sched, buf, r == root) {
                return done;
            }
        }
        self.reducing(call, tag, &sched, buf)?;
        if op == ReduceOp::Avg && r == root {
            T::finish_avg(buf, n);
        }
        Ok(())
    }

    /// This rank's block is already in place in `output`.
    fn all_gather_on<T: Reducible>(&self, call: &Call, tag: u32, output: &mut [T]) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let (call, sched) = if n.is_power_of_two() && size_of_val(output) <= DOUBLING_ALL_GATHER_MAX
        {
            (
                call.algo("recursive doubling"),
                alg::doubling_all_gather(n, r, output.len()),
            )
        } else {
            (*call, alg::ring_all_gather(n, r, output.len()))
        };
        self.execute(&call, tag, &sched, output, &[])
    }

    /// The root's own block is already in place in `output`.
    fn gather_on<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, input.len());
        let sched = alg::direct_gather(n, r, root, k);
        match output {
            Some(out) => {
                copy(&mut out[r * k..(r + 1) * k], input);
                self.execute(call, tag, &sched, out, input)
            }
            None => self.execute(call, tag, &sched, &mut [], input),
        }
    }

    /// The root places its own block first (see [`Coll`]).
    fn scatter_on<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        input: Option<&[T]>,
        output: &mut [T],
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, output.len());
        let root = call.root;
        if let Some(input) = input.filter(|_| r == root) {
            copy(output, &input[r * k..(r + 1) * k]);
        }
        if n >= 4 && size_of_val(output) * n <= BINOMIAL_SCATTER_MAX {
            // The root lays the blocks out in virtual order; each rank receives its subtree's
            // (its own first) and passes on the rest (the root's own block is in place).
            let v = (r + n - root) % n;
            let mut sub: Vec<T> = self.pool.take_len(alg::subtree(n, v) * k);
            if let Some(input) = input.filter(|_| r == root) {
                for v in 1..n {
                    let q = (v + root) % n;
                    copy(&mut sub[v * k..(v + 1) * k], &input[q * k..(q + 1) * k]);
                }
            }
            let sched = alg::binomial_scatter(n, r, root, k);
            let done = self.execute(&call.algo("binomial tree"), tag, &sched, &mut sub, &[]);
            if done.is_ok() && r != root {
                copy(output, &sub[..k]);
            }
            self.pool.give(sub);
            return done;
        }
        let sched = alg::direct_scatter(n, r, root, k);
        self.execute(call, tag, &sched, output, input.unwrap_or(&[]))
    }

    fn reduce_scatter_on<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, output.len());
        if T::WIDENS && size_of_val(input) >= HALF_DIRECT_MIN {
            let call = call.algo("direct, 16-bit");
            return self.half_reduce_scatter(&call, tag, input, output, op);
        }
        let (call, sched) =
            if n.is_power_of_two() && size_of_val(input) <= HALVING_REDUCE_SCATTER_MAX {
                let sched = alg::halving_reduce_scatter(n, r, n * k);
                (call.algo("recursive halving"), sched)
            } else {
                (*call, alg::ring_reduce_scatter(n, r, n * k))
            };
        let mine = r * k..(r + 1) * k;
        match self.widened(input) {
            Some(mut wide) => {
                let done = self.execute::<f32>(&call, tag, &sched, &mut wide, &[]);
                if done.is_ok() {
                    if op == ReduceOp::Avg {
                        f32::finish_avg(&mut wide[mine.clone()], n);
                    }
                    T::narrow(output, &wide[mine]);
                }
                self.pool.give(wide);
                done?;
            }
            None => {
                // A pooled working copy: a fresh one of a large input is page faults every call.
                let mut work = self.pool.copy_of(input);
                let done = self.execute(&call, tag, &sched, &mut work, &[]);
                if done.is_ok() {
                    copy(output, &work[mine]);
                }
                self.pool.give(work);
                done?;
                if op == ReduceOp::Avg {
                    T::finish_avg(output, n);
                }
            }
        }
        Ok(())
    }

    /// `send`/`recv`: the buffer and the element count per peer (checked); this rank's own
    /// block is already in place.
    fn all_to_all_on<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        send: (&[T], &[usize]),
        recv: (&mut [T], &[usize]),
    ) -> Result<()> {
        let ((input, send_counts), (output, recv_counts)) = (send, recv);
        let (n, r) = (self.size(), self.rank);
        let ranges = |counts: &[usize]| -> Vec<std::ops::Range<usize>> {
            let mut start = 0;
            counts
                .iter()
                .map(|&c| {
                    start += c;
                    start - c..start
                })
                .collect()
        };
        let (sr, rr) = (ranges(send_counts), ranges(recv_counts));
        let sched = alg::direct_all_to_all(n, r, &sr, &rr);
        self.execute(call, tag, &sched, output, input)
    }
}

/// Scatter takes the binomial tree instead of the root sending to every rank directly on
/// worlds of four and more up to this many bytes of the whole input: the root, which
/// back-to-back calls wait on, then sends ⌈log₂ n⌉ messages per call instead of n − 1 (each a
/// system call through the loopback stack, 76-83% of the root's time by `perf`). Measured over
/// TCP (`distcomm bench scatter`, 3 alternating runs, µs, tree against direct): world 4 16 B
/// 11.5 against 13.2, 1 KiB 10.7 against 13.1; world 8 32 B 24.9 against 34.5, 1 KiB 29.4
/// against 32.8; at 64 KiB the tree's second copy loses (60-63 against 41-50; world 8 90-103
/// against 51-64). Gather lost with the tree at every size (world 4 16 B 6.6-8.9 against
/// 3.7-7.5, world 8 18-23 against 13-18): it keeps the direct schedule.
pub const BINOMIAL_SCATTER_MAX: usize = 8 << 10;

/// Reduce on up to four ranks sends every buffer straight to the root up to this many bytes,
/// instead of up the binomial tree: no rank waits for another's partial sum before it sends,
/// which on crowded cores means one rank fewer to be scheduled in turn. Measured over TCP
/// (`distcomm bench reduce`, 3 alternating runs, µs, direct against tree): world 4 8 B
/// 6.8-7.3 against 9.4-10.7, 1 KiB 9.9-10.7 against 11.0-12.3; world 3 8 B 3.5-3.9 against
/// 4.0-8.4; from 4 KiB on and at world 8 even or behind (world 4 64 KiB 127-190 against
/// 110-134).
pub const DIRECT_REDUCE_MAX: usize = 1 << 10;

/// Reduces `data`, the bytes of `dst.len()` elements, into `dst` (through an aligned copy
/// where `data` is not aligned for `T`).
fn reduce_bytes_into<T: Reducible>(dst: &mut [T], data: &[u8], op: ReduceOp) {
    match bytemuck::try_cast_slice::<u8, T>(data) {
        Ok(src) => T::reduce_into(dst, src, op),
        Err(_) => T::reduce_into(dst, &bytemuck::pod_collect_to_vec::<u8, T>(data), op),
    }
}

/// The DEBUG event of a collective's algorithm (subsystem `coll`).
pub(super) fn chose(call: &Call, dtype: DType, rank: usize, n: usize, rounds: usize) {
    tracing::debug!(
        target: "distcomm::coll",
        rank,
        ranks = n,
        count = call.count,
        bytes = call.bytes,
        dtype = ?dtype,
        op = ?call.op,
        root = call.root,
        rounds,
        "{} by {}",
        call.kind.name(),
        call.algo
    );
}

/// Makes the engine let go of a round's in-place views when the round ends, however it ends
/// (success, error or panic), before the caller's buffers can be touched or freed.
struct ViewGuard<'a> {
    engine: &'a crate::transport::tcp::Engine,
    ids: Vec<u64>,
    works: Vec<Work<()>>,
}

impl Drop for ViewGuard<'_> {
    fn drop(&mut self) {
        self.engine.reclaim(&self.ids);
    }
}
