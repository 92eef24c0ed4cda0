//! Collective operations: each blocking (on slices, run in the caller's thread) and async
//! (on owned buffers, run in issue order by the group's collective thread, returning a
//! [`Work`]). Schedules come from [`crate::algorithms`]; this module runs them over the
//! group's point-to-point layer.
//!
//! Every message of a collective carries the call's fingerprint (kind, operator, root, count,
//! element type) and its sequence number as tag, so ranks that call different collectives, or
//! the same one differently, both get [`Error::Desync`] naming both calls instead of wrong data.
//!
//! Semantics worth knowing:
//! * `f16`/`bf16` reductions are carried out in `f32` (the data travels as `f32`) and rounded
//!   once at the end;
//! * integer `Avg` is the wrapping sum divided by the group size, rounded toward zero;
//! * `reduce` leaves partial results in non-root buffers;
//! * dropping an async collective's handle lets it run to completion (withdrawing it would
//!   desynchronise the group).

use std::mem::{size_of, size_of_val};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::algorithms::{self as alg, Schedule, Space, Step};
use crate::call::Fingerprint;
use crate::completion::{block, Deadline, Driver, OpCell, RawView};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::{Inner, Job, ProcessGroup, CTX_COLL};
use crate::intranode::{Arena, Ticket};
use crate::mpi::{Coll, Comm as MpiComm};
use crate::reduce::{ReduceOp, Reducible};
use crate::transport::tcp::Envelope;
use crate::work::Work;

use crate::call::CallKind;

/// One collective call as every rank must see it.
#[derive(Debug, Clone, Copy)]
struct Call {
    kind: CallKind,
    op: Option<ReduceOp>,
    root: usize,
    count: usize,
    /// The call's size in the nccl-tests sense (for the comms log).
    bytes: usize,
    /// Part of a composite operation that logs itself (1-bit all_reduce): not logged alone.
    quiet: bool,
    /// The algorithm that runs it (`DISTCOMM_DEBUG=DEBUG`).
    algo: &'static str,
}

impl Call {
    fn new(kind: CallKind, count: usize) -> Call {
        Call {
            kind,
            op: None,
            root: 0,
            count,
            bytes: 0,
            quiet: false,
            algo: match kind {
                CallKind::AllReduce => "recursive doubling",
                CallKind::Broadcast | CallKind::Reduce => "binomial tree",
                CallKind::AllGather | CallKind::ReduceScatter => "ring",
                CallKind::Gather | CallKind::Scatter | CallKind::AllToAll => "direct",
                CallKind::Barrier => "dissemination",
                CallKind::PointToPoint => "direct",
            },
        }
    }
    fn algo(mut self, algo: &'static str) -> Call {
        self.algo = algo;
        self
    }
    fn quiet(mut self, quiet: bool) -> Call {
        self.quiet = quiet;
        self
    }
    fn bytes(mut self, bytes: usize) -> Call {
        self.bytes = bytes;
        self
    }
    fn op(mut self, op: ReduceOp) -> Call {
        self.op = Some(op);
        self
    }
    fn root(mut self, root: usize) -> Call {
        self.root = root;
        self
    }
    fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(self.kind, self.op, self.root, self.count)
    }
}

// Size thresholds (bytes) for choosing algorithms; see `distcomm bench` and the README for
// how they were measured. Overridable by environment variables (`crate::config`).

/// all_reduce switches from recursive doubling to the ring at this many bytes (twice this on
/// two ranks, where the ring's extra round costs more than its halved messages save). Measured
/// with `DISTCOMM_ALL_REDUCE_RING_MIN=1` vs `=1000000000 distcomm bench all_reduce` on this 2-core
/// VM: world 2 crosses between 256 KiB and 1 MiB, world 4 between 64 KiB and 256 KiB.
pub const ALL_REDUCE_RING_MIN: usize = 256 * 1024;
/// The ring all_reduce runs on segments of the buffer one after the other, so that each round
/// moves at most this many bytes per rank (received, then reduced while still in cache).
/// Measured with `DISTCOMM_RING_CHUNK_MAX` at 1, 2 and 4 MiB and unbounded, 64 MiB over TCP
/// (busbw, GB/s, two runs each): world 4 0.92 -> 1.16-1.20 at 1 MiB (1.11-1.18 at 2, 0.97-1.16
/// at 4); world 3 1.08-1.10 -> 1.25-1.26; world 2 1.66-1.72 -> 1.95-1.99. Over shared memory
/// it makes no difference either way.
pub const RING_CHUNK_MAX: usize = 1 << 20;
/// broadcast switches from the binomial tree to scatter + all-gather at this many bytes, on
/// five ranks or more. Measured like the all_reduce threshold: on 3 ranks the tree won at every
/// size up to 16 MiB; on 5 it lost from 4 MiB on (0.58 vs 0.56 GB/s at 4 MiB, 0.54 vs 0.48 at
/// 16 MiB).
pub const BROADCAST_SCATTER_MIN: usize = 4 << 20;

impl Inner {
    pub(crate) fn invalid(&self, op: &'static str, detail: String) -> Error {
        Error::InvalidArgument {
            op,
            rank: self.rank,
            detail,
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(Error::InvalidRank {
                op,
                rank: self.rank,
                peer: root,
                world: self.size(),
            });
        }
        Ok(())
    }

    fn check_op<T: Reducible>(&self, op_name: &'static str, op: ReduceOp) -> Result<()> {
        if op.is_bitwise() && !T::INTEGER {
            return Err(self.invalid(
                op_name,
                format!("bitwise {} is not defined for {}", op.name(), T::DTYPE),
            ));
        }
        Ok(())
    }

    /// Runs a collective on the MPI backend, booked in the comms log like the native ones
    /// (bytes sent: what MPI moved is not visible to us, so 0).
    fn on_mpi<T: Reducible>(&self, m: &MpiComm, call: &Call, coll: Coll<'_, T>) -> Result<()> {
        let started = Instant::now();
        // MPI needs every rank to start a communicator's collectives in one order: a blocking
        // call (in the caller's thread) waits for the async ones issued before it, which the
        // group's collective thread starts in issue order.
        if !ON_WORKER.with(|w| w.get()) {
            while self.queued.load(Ordering::Acquire) > 0 {
                if started.elapsed() >= self.timeout {
                    return Err(Error::Timeout {
                        op: call.kind.name(),
                        rank: self.rank,
                        peer: None,
                        after: self.timeout,
                    });
                }
                std::thread::yield_now();
            }
        }
        let r = m.collective(coll, self.timeout);
        if r.is_ok() && !call.quiet {
            let n = self.size();
            self.log
                .record(call.kind.name(), call.bytes, n, started.elapsed(), 0);
        }
        r
    }

    pub(crate) fn next_tag(&self) -> u32 {
        self.coll_seq.fetch_add(1, Ordering::AcqRel)
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
        let since = self.since();
        chose(call, T::DTYPE, self.rank, self.size(), sched.len());
        if let Some(arena) = &self.arena {
            arena.announce(&call.fingerprint(), T::DTYPE, tag);
        }
        let result = self.execute_rounds(call, tag, sched, out, inp);
        self.finished(call, tag, T::DTYPE, since, &result);
        result
    }

    /// When a collective starts (time, [`sent_bytes`]), for the comms log; `None` while the log
    /// is off (no clock read on the small-message path).
    fn since(&self) -> Option<(Instant, u64)> {
        self.log.is_on().then(|| (Instant::now(), sent_bytes()))
    }

    /// Books a finished collective that started at `since` (see [`since`](Self::since)): into
    /// the comms log when it succeeded; when it failed, lets every member know, so that none
    /// waits for us until its deadline.
    fn finished(
        &self,
        call: &Call,
        tag: u32,
        dtype: DType,
        since: Option<(Instant, u64)>,
        r: &Result<()>,
    ) {
        match r {
            Ok(()) if call.quiet => {}
            Ok(()) => {
                if let Some((started, sent)) = since {
                    let (took, sent) = (started.elapsed(), sent_bytes() - sent);
                    self.log
                        .record(call.kind.name(), call.bytes, self.size(), took, sent);
                }
            }
            Err(e) => {
                let desync = matches!(e, Error::Desync { .. });
                let env = Envelope {
                    op: call.kind.name(),
                    dtype,
                    ctx: self.ctx + CTX_COLL,
                    tag,
                    fp: call.fingerprint(),
                };
                let lost = match e {
                    Error::PeerLost { peer, .. } => Some(*peer),
                    _ => None,
                };
                self.engine
                    .cancel_collective(env, desync, lost, &self.members);
            }
        }
    }

    /// A place in the shared-memory arena's order for an all_reduce of `len` elements of `T`,
    /// when it will run there (taken at issue time: see `intranode`).
    fn arena_ticket<T: Reducible>(&self, len: usize) -> Option<Ticket> {
        self.arena.as_ref()?.ticket(len * std::mem::size_of::<T>())
    }

    /// All-reduce through the shared-memory arena (16-bit floats at their own width, reduced in
    /// f32 and rounded once; averages divided at the end, as on the network path).
    fn arena_all_reduce<T: Reducible>(
        &self,
        arena: &Arena,
        ticket: &Ticket,
        call: &Call,
        tag: u32,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let since = self.since();
        let n = self.size();
        chose(&call.algo("shared-memory arena"), T::DTYPE, self.rank, n, 1);
        let fp = call.fingerprint();
        let (timeout, engine) = (self.timeout, &*self.engine);
        // What this rank puts into the shared arena is what it "sends". 16-bit floats go in at
        // their own width; the arena reduces them in f32, divides averages and rounds once.
        let result = arena
            .all_reduce(ticket, buf, op, &fp, T::DTYPE, tag, timeout, engine)
            .map(|()| {
                count_sent(size_of_val(buf));
                if op == ReduceOp::Avg && !T::WIDENS {
                    T::finish_avg(buf, n);
                }
            });
        self.finished(call, tag, T::DTYPE, since, &result);
        result
    }

    fn execute_rounds<T: Reducible>(
        &self,
        call: &Call,
        tag: u32,
        sched: &Schedule,
        out: &mut [T],
        inp: &[T],
    ) -> Result<()> {
        // Fixed once the first round's messages are posted: off the path to the first send.
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
            let mut recvs = Vec::new();
            let mut sends = Vec::new();
            // Large transfers of rounds whose ranges do not overlap read and write the caller's
            // buffers in place (no copy); the guard makes the engine let go of them, whatever
            // way this round ends, before the buffers are touched again.
            let in_place = alg::disjoint_in_place(round);
            let mut direct = ViewGuard {
                engine: &self.engine,
                ids: Vec::new(),
                works: Vec::new(),
            };
            // Receives first, so that what the peers send finds its buffer posted.
            let recv_first = round
                .iter()
                .filter(|s| matches!(s, Step::Recv { .. }))
                .chain(round.iter().filter(|s| matches!(s, Step::Send { .. })));
            for step in recv_first {
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
                        let w: Work<()> = self.post_recv(env, Box::new(view), Some(*peer))?;
                        direct.ids.push(w.id());
                        direct.works.push(w);
                    }
                    Step::Recv {
                        peer,
                        range,
                        reduce,
                    } => {
                        // Overwritten whole by the message (a collective's must fit exactly),
                        // so whatever the pooled buffer held need not be cleared first.
                        let buf: Vec<T> = self.pool.take_len(range.len());
                        let w: Work<Vec<T>> = self.post_recv(env, Box::new(buf), Some(*peer))?;
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
                            let w: Work<()> = self.post_send(env, Box::new(view), *peer)?;
                            direct.ids.push(w.id());
                            direct.works.push(w);
                            continue;
                        }
                        let mut buf: Vec<T> = self.pool.take();
                        buf.extend_from_slice(src);
                        let w: Work<Vec<T>> = self.post_send(env, Box::new(buf), *peer)?;
                        // A small send of a collective completes once written (no
                        // acknowledgement: a receiver that refuses it cancels the collective on
                        // every rank); nothing to wait for.
                        if std::mem::size_of_val(src) > eager_max {
                            sends.push(w);
                        }
                    }
                }
            }
            {
                let mut all: Vec<&mut dyn Pending> = Vec::with_capacity(recvs.len() + sends.len());
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
                    dst.copy_from_slice(&data);
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

    /// An equal all_to_all of byte blocks produced one at a time: `produce(d, block)` writes the
    /// block for rank `d`, peers' blocks first, in ring order from the next rank, each sent as
    /// soon as it is written, this rank's own last. `output` receives rank `q`'s block for us
    /// at `q · per`. See [`exchange`](Self::exchange) for how blocks travel. Part of a
    /// composite operation: not logged alone.
    pub(crate) fn all_to_all_streamed(
        &self,
        tag: u32,
        per: usize,
        output: &mut [u8],
        produce: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<()> {
        let n = self.size();
        if output.len() != n * per {
            let detail = format!("output holds {} bytes, needs {n} x {per}", output.len());
            return Err(self.invalid("all_to_all", detail));
        }
        let call = Call::new(CallKind::AllToAll, n * per)
            .bytes(n * per)
            .quiet(true);
        let blocks = self.exchange(&call, tag, per, produce, &mut || {})?;
        for (q, b) in blocks.into_iter().enumerate() {
            output[q * per..(q + 1) * per].copy_from_slice(&b);
            self.pool.give(b);
        }
        Ok(())
    }

    /// An all_gather of one byte block per rank, consumed rank by rank: `consume(q, block)`
    /// gets this rank's own block first, while the others are on their way, then the peers'.
    /// Part of a composite operation: not logged alone.
    pub(crate) fn all_gather_streamed(
        &self,
        tag: u32,
        block: &[u8],
        consume: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let (n, me, per) = (self.size(), self.rank, block.len());
        let call = Call::new(CallKind::AllGather, per)
            .bytes(n * per)
            .quiet(true);
        let mut fill = |_: usize, out: &mut [u8]| out.copy_from_slice(block);
        let blocks = self.exchange(&call, tag, per, &mut fill, &mut || consume(me, block))?;
        for (q, b) in blocks.into_iter().enumerate() {
            if q != me {
                consume(q, &b);
            }
            self.pool.give(b);
        }
        Ok(())
    }

    /// One round with every peer, for the streamed collectives: receives from every peer posted
    /// first; then `fill(d, block)` for every rank `d` in ring order from the next one, each
    /// peer's block sent as soon as it is filled and this rank's own filled last; then
    /// `overlap()` while the transfers run. Returns every rank's block for us, by rank (pool
    /// buffers). Books the call, or cancels it everywhere when it fails.
    ///
    /// On the native transports a block travels as eager messages of at most the eager size:
    /// every receive is posted before anything is sent, so none needs the clear-to-send
    /// round trip of a large message, which on a slow link waits behind the peer's own data
    /// (a 1 MiB exchange over 1 Gbit/s: 8.4 ms on the wire, up to twice that with the
    /// handshake).
    fn exchange(
        &self,
        call: &Call,
        tag: u32,
        per: usize,
        fill: &mut dyn FnMut(usize, &mut [u8]),
        overlap: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<u8>>> {
        let since = self.since();
        let r = self.exchange_rounds(call, tag, per, fill, overlap);
        let status = r.as_ref().map(|_| ()).map_err(Clone::clone);
        self.finished(call, tag, DType::U8, since, &status);
        r
    }

    fn exchange_rounds(
        &self,
        call: &Call,
        tag: u32,
        per: usize,
        fill: &mut dyn FnMut(usize, &mut [u8]),
        overlap: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<u8>>> {
        let (n, me) = (self.size(), self.rank);
        let deadline = Instant::now() + self.timeout;
        let env = Envelope {
            op: call.kind.name(),
            dtype: DType::U8,
            ctx: CTX_COLL,
            tag,
            fp: call.fingerprint(),
        };
        let piece = match self.mpi {
            Some(_) => per.max(1),
            None => self.engine.eager_max().max(1),
        };
        let pieces = |len: usize| {
            (0..len.div_ceil(piece)).map(move |i| i * piece..((i + 1) * piece).min(len))
        };
        let mut recvs: Vec<(usize, std::ops::Range<usize>, Work<Vec<u8>>)> = Vec::new();
        let mut blocks: Vec<Vec<u8>> = (0..n).map(|_| self.pool.take_len(per)).collect();
        for i in 1..n {
            let q = (me + n - i) % n;
            for range in pieces(per) {
                let buf: Vec<u8> = self.pool.take_len(range.len());
                recvs.push((q, range, self.post_recv(env, Box::new(buf), Some(q))?));
            }
        }
        let mut sends: Vec<Work<Vec<u8>>> = Vec::new();
        for i in 1..=n {
            let d = (me + i) % n;
            // Peer d's slot holds what we send it until its block to us arrives below.
            fill(d, &mut blocks[d]);
            if d == me {
                continue;
            }
            count_sent(per);
            for range in pieces(per) {
                let mut part: Vec<u8> = self.pool.take();
                part.extend_from_slice(&blocks[d][range]);
                let w = self.post_send(env, Box::new(part), d)?;
                // As in `execute_rounds`: a small send finishes in the background.
                if piece > self.engine.eager_max() {
                    sends.push(w);
                }
            }
        }
        overlap();
        {
            let mut all: Vec<&mut dyn Pending> = Vec::with_capacity(recvs.len() + sends.len());
            all.extend(recvs.iter_mut().map(|(_, _, w)| w as &mut dyn Pending));
            all.extend(sends.iter_mut().map(|w| w as &mut dyn Pending));
            wait_all(&mut all, deadline, self.timeout)?;
        }
        for (q, range, w) in recvs {
            let data = w.into_buffer()?;
            blocks[q][range].copy_from_slice(&data);
            self.pool.give(data);
        }
        for w in sends {
            if let Ok(b) = w.into_buffer() {
                self.pool.give(b);
            }
        }
        Ok(blocks)
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
        tag: u32,
        buf: &mut [T],
        op: ReduceOp,
        ticket: Option<Ticket>,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let call = Call::new(CallKind::AllReduce, buf.len())
            .op(op)
            .bytes(size_of_val(buf));
        if let Some(m) = &self.mpi {
            return self.on_mpi(m, &call, Coll::AllReduce(buf, op));
        }
        if let (Some(t), Some(arena)) = (&ticket, &self.arena) {
            if arena.usable() {
                return self.arena_all_reduce(arena, t, &call, tag, buf, op);
            }
        }
        drop(ticket);
        let bytes = std::mem::size_of_val(buf);
        let ring_min = if n == 2 {
            2 * ALL_REDUCE_RING_MIN
        } else {
            ALL_REDUCE_RING_MIN
        };
        let (call, sched) =
            if bytes >= self.config.all_reduce_ring_min.unwrap_or(ring_min) && buf.len() >= n {
                let chunk = self.config.ring_chunk_max.unwrap_or(RING_CHUNK_MAX) / size_of::<T>();
                let seg = chunk.max(1).saturating_mul(n);
                let sched = alg::segmented(buf.len(), seg, |len| alg::ring_all_reduce(n, r, len));
                (call.algo("ring"), sched)
            } else {
                (call, alg::recursive_doubling_all_reduce(n, r, buf.len()))
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

    fn broadcast_on<T: Reducible>(&self, tag: u32, buf: &mut [T], root: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let call = Call::new(CallKind::Broadcast, buf.len())
            .root(root)
            .bytes(size_of_val(buf));
        if let Some(m) = &self.mpi {
            return self.on_mpi(m, &call, Coll::Broadcast(buf, root));
        }
        let bytes = std::mem::size_of_val(buf);
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
            (call, alg::binomial_broadcast(n, r, root, buf.len()))
        };
        self.execute(&call, tag, &sched, buf, &[])
    }

    fn reduce_on<T: Reducible>(
        &self,
        tag: u32,
        buf: &mut [T],
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let call = Call::new(CallKind::Reduce, buf.len())
            .op(op)
            .root(root)
            .bytes(size_of_val(buf));
        if let Some(m) = &self.mpi {
            return self.on_mpi(m, &call, Coll::Reduce(buf, root, op));
        }
        let sched = alg::binomial_reduce(n, r, root, buf.len());
        if op == ReduceOp::Avg {
            if let Some(done) = self.in_f32(&call, tag, &sched, buf, r == root) {
                return done;
            }
        }
        self.reducing(&call, tag, &sched, buf)?;
        if op == ReduceOp::Avg && r == root {
            T::finish_avg(buf, n);
        }
        Ok(())
    }

    pub(crate) fn all_gather_on<T: Reducible>(
        &self,
        tag: u32,
        input: &[T],
        output: &mut [T],
        quiet: bool,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, input.len());
        if output.len() != n * k {
            return Err(self.invalid(
                "all_gather",
                format!("output holds {} elements, needs {n} x {k}", output.len()),
            ));
        }
        output[r * k..(r + 1) * k].copy_from_slice(input);
        let call = Call::new(CallKind::AllGather, k)
            .bytes(size_of_val(output))
            .quiet(quiet);
        if let Some(m) = &self.mpi {
            return self.on_mpi(m, &call, Coll::AllGather(input, output));
        }
        self.execute(&call, tag, &alg::ring_all_gather(n, r, n * k), output, &[])
    }

    fn gather_on<T: Reducible>(
        &self,
        tag: u32,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, input.len());
        let call = Call::new(CallKind::Gather, k)
            .root(root)
            .bytes(n * size_of_val(input));
        let sched = alg::direct_gather(n, r, root, k);
        match output {
            Some(out) if r == root => {
                if out.len() != n * k {
                    return Err(self.invalid(
                        "gather",
                        format!("output holds {} elements, needs {n} x {k}", out.len()),
                    ));
                }
                out[r * k..(r + 1) * k].copy_from_slice(input);
                match &self.mpi {
                    Some(m) => self.on_mpi(m, &call, Coll::Gather(input, Some(out), root)),
                    None => self.execute(&call, tag, &sched, out, input),
                }
            }
            None if r == root => Err(self.invalid("gather", "the root needs an output".into())),
            _ => match &self.mpi {
                Some(m) => self.on_mpi(m, &call, Coll::Gather(input, None, root)),
                None => self.execute(&call, tag, &sched, &mut [], input),
            },
        }
    }

    fn scatter_on<T: Reducible>(
        &self,
        tag: u32,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, output.len());
        let call = Call::new(CallKind::Scatter, k)
            .root(root)
            .bytes(n * size_of_val(output));
        let sched = alg::direct_scatter(n, r, root, k);
        if r != root {
            return match &self.mpi {
                Some(m) => self.on_mpi(m, &call, Coll::Scatter(None, output, root)),
                None => self.execute(&call, tag, &sched, output, &[]),
            };
        }
        let input =
            input.ok_or_else(|| self.invalid("scatter", "the root needs an input".into()))?;
        if input.len() != n * k {
            return Err(self.invalid(
                "scatter",
                format!("input holds {} elements, needs {n} x {k}", input.len()),
            ));
        }
        output.copy_from_slice(&input[r * k..(r + 1) * k]);
        match &self.mpi {
            Some(m) => self.on_mpi(m, &call, Coll::Scatter(Some(input), output, root)),
            None => self.execute(&call, tag, &sched, output, input),
        }
    }

    fn reduce_scatter_on<T: Reducible>(
        &self,
        tag: u32,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, output.len());
        if input.len() != n * k {
            return Err(self.invalid(
                "reduce_scatter",
                format!("input holds {} elements, needs {n} x {k}", input.len()),
            ));
        }
        let call = Call::new(CallKind::ReduceScatter, k)
            .op(op)
            .bytes(size_of_val(input));
        if let Some(m) = &self.mpi {
            return self.on_mpi(m, &call, Coll::ReduceScatter(input, output, op));
        }
        let sched = alg::ring_reduce_scatter(n, r, n * k);
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
                let mut work = self.pool.take();
                work.extend_from_slice(input);
                let done = self.execute(&call, tag, &sched, &mut work, &[]);
                if done.is_ok() {
                    output.copy_from_slice(&work[mine]);
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

    /// `send`/`recv`: the buffer and the element count per peer; `uneven` for the `_v` form,
    /// `quiet` inside a composite operation (not logged alone).
    pub(crate) fn all_to_all_on<T: Reducible>(
        &self,
        tag: u32,
        send: (&[T], &[usize]),
        recv: (&mut [T], &[usize]),
        uneven: bool,
        quiet: bool,
    ) -> Result<()> {
        let ((input, send_counts), (output, recv_counts)) = (send, recv);
        let (n, r) = (self.size(), self.rank);
        let ranges =
            |counts: &[usize], total: usize, what: &str| -> Result<Vec<std::ops::Range<usize>>> {
                if counts.len() != n || counts.iter().sum::<usize>() != total {
                    return Err(self.invalid(
                        "all_to_all",
                        format!("{what} counts {counts:?} must be {n} numbers summing to {total}"),
                    ));
                }
                let mut start = 0;
                Ok(counts
                    .iter()
                    .map(|&c| {
                        start += c;
                        start - c..start
                    })
                    .collect())
            };
        let sr = ranges(send_counts, input.len(), "send")?;
        let rr = ranges(recv_counts, output.len(), "receive")?;
        if sr[r].len() != rr[r].len() {
            return Err(self.invalid(
                "all_to_all",
                "this rank's own send and receive counts differ".into(),
            ));
        }
        output[rr[r].clone()].copy_from_slice(&input[sr[r].clone()]);
        // Uneven splits differ per rank, so only the equal form fingerprints its count.
        let call = Call::new(CallKind::AllToAll, if uneven { 0 } else { input.len() })
            .bytes(size_of_val(input))
            .quiet(quiet);
        if let Some(m) = &self.mpi {
            let coll = Coll::AllToAll((input, send_counts), (output, recv_counts));
            return self.on_mpi(m, &call, coll);
        }
        self.execute(
            &call,
            tag,
            &alg::direct_all_to_all(n, r, &sr, &rr),
            output,
            input,
        )
    }
}

thread_local! {
    /// True in a group's collective thread (see `ProcessGroup::spawn`).
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Bytes this thread's collectives handed to the transport (or put into the shared arena).
    static SENT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Bytes sent so far by collectives run on this thread: a collective runs wholly on one thread,
/// so the difference across a call is what that call sent.
/// The DEBUG event of a collective's algorithm (subsystem `coll`).
fn chose(call: &Call, dtype: DType, rank: usize, n: usize, rounds: usize) {
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

pub(crate) fn sent_bytes() -> u64 {
    SENT.with(|s| s.get())
}

fn count_sent(n: usize) {
    SENT.with(|s| s.set(s.get() + n as u64));
}

/// Scratch buffers for collectives, by element type, so that large transfers reuse memory
/// instead of faulting in fresh pages every time (receive buffers, 16-bit floats widened to
/// `f32`, reduce_scatter's working copy). Holds a few buffers per type, each as large as the
/// largest use it served: memory a large collective needed once stays reserved for the next.
#[derive(Default)]
pub(crate) struct Pool {
    free: std::sync::Mutex<
        std::collections::HashMap<std::any::TypeId, Vec<Box<dyn std::any::Any + Send>>>,
    >,
}

impl Pool {
    const PER_TYPE: usize = 4;

    /// An empty buffer, with capacity left over from earlier use when there is one.
    pub(crate) fn take<T: Reducible>(&self) -> Vec<T> {
        let mut v = self.pop();
        v.clear();
        v
    }

    /// A buffer of exactly `len` elements whose contents are whatever they were (zeros where it
    /// had to grow): for targets that are overwritten anyway, without paying to clear them.
    pub(crate) fn take_len<T: Reducible>(&self, len: usize) -> Vec<T> {
        let mut v = self.pop();
        v.resize(len, T::zeroed());
        v
    }

    /// A kept buffer of `T` as it was given back, or a new empty one.
    fn pop<T: Reducible>(&self) -> Vec<T> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.get_mut(&std::any::TypeId::of::<T>())
            .and_then(|v| v.pop())
            .and_then(|b| b.downcast::<Vec<T>>().ok())
            .map(|b| *b)
            .unwrap_or_default()
    }

    /// Returns a buffer for reuse.
    pub(crate) fn give<T: Reducible>(&self, buf: Vec<T>) {
        if buf.capacity() == 0 {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let list = free.entry(std::any::TypeId::of::<T>()).or_default();
        if list.len() < Self::PER_TYPE {
            list.push(Box::new(buf));
        }
    }
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

/// A handle `wait_all` can poll and wait on, whatever its buffer type.
trait Pending {
    fn failed(&mut self) -> Option<Error>;
    fn done(&self) -> bool;
    fn wait_for(&mut self, d: Duration) -> Result<()>;
}

impl<B: 'static> Pending for Work<B> {
    fn failed(&mut self) -> Option<Error> {
        if !self.is_completed() {
            return None;
        }
        self.wait_timeout(Duration::ZERO).err()
    }
    fn done(&self) -> bool {
        self.is_completed()
    }
    fn wait_for(&mut self, d: Duration) -> Result<()> {
        self.wait_timeout(d).map(|_| ())
    }
}

/// Waits until every operation succeeded, returning the first failure as soon as it is seen
/// (within a few milliseconds) rather than after waiting for operations that precede it: a peer
/// that refuses our message must not leave us waiting for its reply until the deadline.
fn wait_all(ops: &mut [&mut dyn Pending], deadline: Instant, timeout: Duration) -> Result<()> {
    const SLICE: Duration = Duration::from_millis(2);
    loop {
        for op in ops.iter_mut() {
            if let Some(e) = op.failed() {
                return Err(e);
            }
        }
        let Some(first) = ops.iter_mut().find(|o| !o.done()) else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match first.wait_for(left.min(SLICE)) {
            Ok(()) => {}
            Err(e) if e.is_timeout() && !left.is_zero() => {}
            // The deadline of the whole call passed: say how long it was, not the last slice.
            Err(Error::Timeout { op, rank, peer, .. }) => {
                return Err(Error::Timeout {
                    op,
                    rank,
                    peer,
                    after: timeout,
                })
            }
            Err(e) => return Err(e),
        }
    }
}

/// Driver of async collective handles: the collective thread makes the progress; waiting
/// only sleeps.
struct Waiter {
    rank: usize,
}

impl Driver for Waiter {
    fn drive_until(&self, cell: &OpCell, deadline: &mut Deadline) -> bool {
        let deadline = deadline.get();
        loop {
            if block(cell, deadline) {
                return true;
            }
            if Instant::now() >= deadline {
                return cell.is_done();
            }
        }
    }
    fn cancel(&self, _op_id: u64) {}
    fn rank(&self) -> usize {
        self.rank
    }
}

impl ProcessGroup {
    /// Queues `f` on the group's collective thread and returns its handle.
    pub(crate) fn spawn<T: Reducible>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Inner) -> Result<Vec<T>> + Send + 'static,
    ) -> Result<Work<Vec<T>>> {
        let cell = Arc::new(OpCell::default());
        let inner = self.inner.clone();
        let done = cell.clone();
        let queued = self.inner.queued.clone();
        queued.fetch_add(1, Ordering::AcqRel);
        let job: Job = Box::new(move || {
            let rank = inner.rank;
            let result = f(&inner);
            inner.queued.fetch_sub(1, Ordering::AcqRel);
            // Release the group before anyone can see the result: the caller may then drop
            // its group and expect the engine to shut down (flushing replies) in its thread.
            drop(inner);
            match result {
                Ok(v) => done.complete(
                    Ok(crate::Status {
                        peer: rank,
                        tag: 0,
                        bytes: std::mem::size_of_val(v.as_slice()),
                    }),
                    Some(Box::new(v)),
                ),
                Err(e) => done.complete(Err(e), None),
            }
        });
        let mut slot = self.inner.worker.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("distcomm-coll-{}", self.rank()))
                .spawn(move || {
                    ON_WORKER.with(|w| w.set(true));
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .map_err(|e| Error::io("spawn collective thread", e))?;
            *slot = Some(tx);
        }
        let sent = slot
            .as_ref()
            .map(|tx| tx.send(job).is_ok())
            .unwrap_or(false);
        if !sent {
            queued.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Aborted {
                op,
                rank: self.rank(),
                reason: "collective thread is gone".into(),
            });
        }
        let driver: Arc<dyn Driver> = Arc::new(Waiter { rank: self.rank() });
        Ok(Work::new(cell, driver, 0, op, None, self.inner.timeout))
    }

    /// Reduces `buf` across the group in place; every rank ends with the result.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// # let group = distcomm::init()?;
    /// let mut grads = vec![1.0f32; 1024];
    /// group.all_reduce(&mut grads, distcomm::ReduceOp::Avg)?;
    /// # Ok(()) }
    /// ```
    pub fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.inner.check_op::<T>("all_reduce", op)?;
        let tag = self.inner.next_tag();
        let ticket = self.inner.arena_ticket::<T>(buf.len());
        self.inner.all_reduce_on(tag, buf, op, ticket)
    }

    /// Async [`all_reduce`](Self::all_reduce): the reduced buffer comes back from
    /// [`Work::into_buffer`].
    pub fn all_reduce_async<T: Reducible>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_op::<T>("all_reduce", op)?;
        let tag = self.inner.next_tag();
        let ticket = self.inner.arena_ticket::<T>(buf.len());
        self.spawn("all_reduce", move |g| {
            g.all_reduce_on(tag, &mut buf, op, ticket)?;
            Ok(buf)
        })
    }

    /// Copies `buf` of rank `root` into `buf` of every rank.
    pub fn broadcast<T: Reducible>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.inner.check_root("broadcast", root)?;
        let tag = self.inner.next_tag();
        self.inner.broadcast_on(tag, buf, root)
    }

    /// Async [`broadcast`](Self::broadcast).
    pub fn broadcast_async<T: Reducible>(
        &self,
        mut buf: Vec<T>,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_root("broadcast", root)?;
        let tag = self.inner.next_tag();
        self.spawn("broadcast", move |g| {
            g.broadcast_on(tag, &mut buf, root)?;
            Ok(buf)
        })
    }

    /// Reduces `buf` of every rank into `buf` of `root` (other ranks' buffers are left holding
    /// partial results).
    pub fn reduce<T: Reducible>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.inner.check_root("reduce", root)?;
        self.inner.check_op::<T>("reduce", op)?;
        let tag = self.inner.next_tag();
        self.inner.reduce_on(tag, buf, root, op)
    }

    /// Async [`reduce`](Self::reduce).
    pub fn reduce_async<T: Reducible>(
        &self,
        mut buf: Vec<T>,
        root: usize,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_root("reduce", root)?;
        self.inner.check_op::<T>("reduce", op)?;
        let tag = self.inner.next_tag();
        self.spawn("reduce", move |g| {
            g.reduce_on(tag, &mut buf, root, op)?;
            Ok(buf)
        })
    }

    /// Gathers every rank's `input` into `output` (rank `i`'s block at `i * input.len()`).
    pub fn all_gather<T: Reducible>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let tag = self.inner.next_tag();
        self.inner.all_gather_on(tag, input, output, false)
    }

    /// [`all_gather`](Self::all_gather) into one buffer per rank.
    pub fn all_gather_list<T: Reducible>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let mut out = vec![T::zeroed(); input.len() * self.size()];
        self.all_gather(input, &mut out)?;
        Ok(split(&out, input.len(), self.size()))
    }

    /// Async [`all_gather`](Self::all_gather); the handle's buffer is the `n × len` output.
    pub fn all_gather_async<T: Reducible>(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        let tag = self.inner.next_tag();
        self.spawn("all_gather", move |g| {
            let mut out = vec![T::zeroed(); input.len() * g.size()];
            g.all_gather_on(tag, &input, &mut out, false)?;
            Ok(out)
        })
    }

    /// Gathers every rank's `input` into `output` of `root` (`None` elsewhere).
    pub fn gather<T: Reducible>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.inner.check_root("gather", root)?;
        let tag = self.inner.next_tag();
        self.inner.gather_on(tag, input, output, root)
    }

    /// Async [`gather`](Self::gather); the root's handle gives the `n × len` output, the
    /// others' an empty buffer.
    pub fn gather_async<T: Reducible>(&self, input: Vec<T>, root: usize) -> Result<Work<Vec<T>>> {
        self.inner.check_root("gather", root)?;
        let tag = self.inner.next_tag();
        self.spawn("gather", move |g| {
            if g.rank == root {
                let mut out = vec![T::zeroed(); input.len() * g.size()];
                g.gather_on(tag, &input, Some(&mut out), root)?;
                Ok(out)
            } else {
                g.gather_on(tag, &input, None, root)?;
                Ok(Vec::new())
            }
        })
    }

    /// Scatters block `i` of the root's `input` (`None` elsewhere) into `output` of rank `i`.
    pub fn scatter<T: Reducible>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.inner.check_root("scatter", root)?;
        let tag = self.inner.next_tag();
        self.inner.scatter_on(tag, input, output, root)
    }

    /// Async [`scatter`](Self::scatter) of blocks of `block` elements (non-roots pass an empty
    /// input); the handle's buffer is this rank's block.
    pub fn scatter_async<T: Reducible>(
        &self,
        input: Vec<T>,
        block: usize,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_root("scatter", root)?;
        let tag = self.inner.next_tag();
        self.spawn("scatter", move |g| {
            let mut out = vec![T::zeroed(); block];
            let inp = (g.rank == root).then_some(input.as_slice());
            g.scatter_on(tag, inp, &mut out, root)?;
            Ok(out)
        })
    }

    /// Reduces `input` (`n` blocks of `output.len()`) across ranks; rank `i` gets block `i`.
    pub fn reduce_scatter<T: Reducible>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.inner.check_op::<T>("reduce_scatter", op)?;
        let tag = self.inner.next_tag();
        self.inner.reduce_scatter_on(tag, input, output, op)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with one input buffer per destination rank.
    pub fn reduce_scatter_list<T: Reducible>(
        &self,
        inputs: &[Vec<T>],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if inputs.len() != self.size() || inputs.iter().any(|b| b.len() != output.len()) {
            return Err(self.inner.invalid(
                "reduce_scatter",
                format!("needs {} inputs of {} elements", self.size(), output.len()),
            ));
        }
        self.reduce_scatter(&inputs.concat(), output, op)
    }

    /// Async [`reduce_scatter`](Self::reduce_scatter); the handle's buffer is this rank's block.
    pub fn reduce_scatter_async<T: Reducible>(
        &self,
        input: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_op::<T>("reduce_scatter", op)?;
        let n = self.size();
        if input.len() % n != 0 {
            return Err(self.inner.invalid(
                "reduce_scatter",
                format!(
                    "input of {} elements does not split into {n} blocks",
                    input.len()
                ),
            ));
        }
        let tag = self.inner.next_tag();
        self.spawn("reduce_scatter", move |g| {
            let mut out = vec![T::zeroed(); input.len() / n];
            g.reduce_scatter_on(tag, &input, &mut out, op)?;
            Ok(out)
        })
    }

    /// Equal all-to-all: block `j` of `input` goes to rank `j`, arriving as block `i` (from rank
    /// `i`) of its `output`.
    pub fn all_to_all<T: Reducible>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let counts = self.equal_counts("all_to_all", input.len(), output.len())?;
        let tag = self.inner.next_tag();
        self.inner
            .all_to_all_on(tag, (input, &counts), (output, &counts), false, false)
    }

    /// All-to-all with uneven splits: `send_counts[j]` elements go to rank `j`,
    /// `recv_counts[i]` arrive from rank `i`.
    pub fn all_to_all_v<T: Reducible>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let tag = self.inner.next_tag();
        self.inner.all_to_all_on(
            tag,
            (input, send_counts),
            (output, recv_counts),
            true,
            false,
        )
    }

    /// Async equal [`all_to_all`](Self::all_to_all); the handle's buffer is the output.
    pub fn all_to_all_async<T: Reducible>(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        let counts = self.equal_counts("all_to_all", input.len(), input.len())?;
        let tag = self.inner.next_tag();
        self.spawn("all_to_all", move |g| {
            let mut out = vec![T::zeroed(); input.len()];
            g.all_to_all_on(tag, (&input, &counts), (&mut out, &counts), false, false)?;
            Ok(out)
        })
    }

    fn equal_counts(&self, op: &'static str, inp: usize, out: usize) -> Result<Vec<usize>> {
        let n = self.size();
        if inp % n != 0 || inp != out {
            return Err(self.inner.invalid(
                op,
                format!("input {inp} and output {out} must be equal multiples of {n}"),
            ));
        }
        Ok(vec![inp / n; n])
    }
}

fn split<T: Clone>(v: &[T], k: usize, n: usize) -> Vec<Vec<T>> {
    (0..n).map(|i| v[i * k..(i + 1) * k].to_vec()).collect()
}
