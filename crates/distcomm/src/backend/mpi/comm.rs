//! The MPI backend's communicators: point-to-point, collectives and splits of one group.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::ffi;

use super::progress::*;
use super::types::*;
use super::Coll;
use crate::backend::Posted;
use crate::backend::{CTX_PER_GROUP, CTX_PIPE, CTX_USER};
use crate::call::Envelope;
use crate::completion::{BoxBuf, Driver, OpCell};
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Reducible};

/// The communicators of one group: one per message context, so that user messages,
/// pipeline traffic and collectives never match each other.
pub(crate) struct Comm {
    user: Handle<ffi::MPI_Comm>,
    pipe: Handle<ffi::MPI_Comm>,
    coll: Handle<ffi::MPI_Comm>,
    rank: usize,
    size: usize,
    /// Global (world) rank, for error messages.
    world_rank: usize,
    /// The world group this one descends from (for `abort`).
    family: u64,
    /// Unique in the process.
    id: u64,
}

/// This process's rank and the world size, as MPI sees them.
pub(crate) fn world_size() -> Result<(usize, usize)> {
    Ok(global()?.world)
}

/// The world group's communicators; `rank`/`world` are what the launcher's variables say,
/// checked against MPI's own view.
pub(crate) fn world(rank: usize, world: usize) -> Result<Comm> {
    let g = global()?;
    if g.world != (rank, world) {
        return Err(Error::Config(format!(
            "DISTCOMM_BACKEND=mpi: the launcher says rank {rank} of {world}, MPI says rank {} of {} \
             (start the job with mpirun or srun, or use the native backend)",
            g.world.0, g.world.1
        )));
    }
    let t = mpi_lock(g);
    let family = g.next_id.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the world communicator is valid after init; under the lock.
    let c = unsafe { Comm::dup_all(ffi::RSMPI_COMM_WORLD, rank, family) };
    drop(t);
    c
}

impl Comm {
    /// Three duplicates of `parent` (collective over it). Call with the lock held.
    unsafe fn dup_all(parent: ffi::MPI_Comm, world_rank: usize, family: u64) -> Result<Comm> {
        let mut out = Vec::with_capacity(3);
        for _ in 0..3 {
            let mut d = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
            // SAFETY (caller): `parent` is a valid communicator and the lock is held.
            let rc = unsafe { ffi::MPI_Comm_dup(parent, d.as_mut_ptr()) };
            check(rc, "init", world_rank, None)?;
            // SAFETY: MPI_Comm_dup succeeded and wrote the handle.
            let c = unsafe { d.assume_init() };
            // SAFETY: a communicator we just made.
            unsafe { ffi::MPI_Comm_set_errhandler(c, ffi::RSMPI_ERRORS_RETURN) };
            out.push(c);
        }
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: valid communicator, pointers to locals.
        unsafe {
            ffi::MPI_Comm_rank(out[0], &mut rank);
            ffi::MPI_Comm_size(out[0], &mut size);
        }
        Ok(Comm {
            user: Handle(out[0]),
            pipe: Handle(out[1]),
            coll: Handle(out[2]),
            rank: rank as usize,
            size: size as usize,
            world_rank,
            family,
            id: global()?.next_id.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// This process's world rank (errors name it).
    pub(crate) fn world_rank(&self) -> usize {
        self.world_rank
    }

    fn comm_for(&self, env: &Envelope) -> Handle<ffi::MPI_Comm> {
        match env.ctx {
            CTX_USER => self.user,
            CTX_PIPE => self.pipe,
            _ => self.coll,
        }
    }

    fn posted(&self, cell: Arc<OpCell>, id: u64) -> Posted {
        let driver: Arc<dyn Driver> = Arc::new(MpiDriver { rank: self.rank });
        Posted {
            cell,
            driver,
            id,
            map: None,
        }
    }

    /// After [`abort`](Self::abort): a handle that has already failed.
    fn refused(&self, t: &Table, op: &'static str) -> Option<Posted> {
        let reason = t.aborted.get(&self.family)?.clone();
        let cell = OpCell::fresh();
        cell.complete(
            Err(Error::Aborted {
                op,
                rank: self.world_rank,
                reason,
            }),
            None,
        );
        Some(self.posted(cell, 0))
    }

    /// Posts a send of `buf` to group rank `dst`.
    pub(crate) fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize) -> Result<Posted> {
        let g = global()?;
        let len = buf.bytes().len();
        let count = c_int::try_from(len).map_err(|_| too_big(env.op, self.rank, len))?;
        let comm = self.comm_for(&env);
        let mut t = mpi_lock(g);
        if let Some(w) = self.refused(&t, env.op) {
            return Ok(w);
        }
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        // SAFETY: `buf` is heap memory owned by the pending entry pushed below until MPI
        // reports the request complete; the communicator is valid; under the lock.
        let rc = unsafe {
            ffi::MPI_Isend(
                bytes_ptr(buf.bytes()),
                count,
                ffi::RSMPI_UINT8_T,
                dst as c_int,
                env.tag as c_int,
                comm.0,
                req.as_mut_ptr(),
            )
        };
        check(rc, env.op, self.world_rank, Some(dst))?;
        // SAFETY: MPI_Isend succeeded and wrote the request.
        let req = unsafe { req.assume_init() };
        let id = g.next_id.fetch_add(1, Ordering::Relaxed);
        let cell = OpCell::fresh();
        t.pending.push(Pending {
            id,
            kind: Kind::Send(Handle(req)),
            cell: cell.clone(),
            buf: Some(buf),
            op: env.op,
            peer: dst,
            tag: env.tag,
            bytes: len,
            rank: self.world_rank,
            family: self.family,
        });
        g.work.notify_one();
        drop(t);
        Ok(self.posted(cell, id))
    }

    /// Posts a receive into `buf` from group rank `src` (`None`: any).
    pub(crate) fn irecv(&self, env: Envelope, buf: BoxBuf, src: Option<usize>) -> Result<Posted> {
        let g = global()?;
        let comm = self.comm_for(&env);
        let id = g.next_id.fetch_add(1, Ordering::Relaxed);
        let cell = OpCell::fresh();
        let mut t = mpi_lock(g);
        if let Some(w) = self.refused(&t, env.op) {
            return Ok(w);
        }
        let chan = self.id * u64::from(CTX_PER_GROUP) + u64::from(env.ctx);
        // SAFETY: reading rsmpi's exported constant.
        let mpi_src = src.map_or(unsafe { ffi::RSMPI_ANY_SOURCE }, |s| s as c_int);
        // Posted directly only when no earlier receive on this channel and tag is still
        // probing: MPI would hand the next message to the posted one first.
        let mut buf = buf;
        let probing_before = t.pending.iter().any(|p| {
            p.tag == env.tag
                && matches!(p.kind, Kind::Recv { chan: c, state: RecvState::Probing, .. } if c == chan)
        });
        let len = buf.bytes().len();
        let state = match c_int::try_from(len) {
            Ok(count) if len >= DIRECT_MIN && !buf.sized_by_message() && !probing_before => {
                let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                // SAFETY: the buffer is owned by the pending entry pushed below until MPI
                // reports the request complete; valid communicator; under the lock.
                let rc = unsafe {
                    ffi::MPI_Irecv(
                        bytes_ptr(buf.bytes_mut()).cast_mut(),
                        count,
                        ffi::RSMPI_UINT8_T,
                        mpi_src,
                        env.tag as c_int,
                        comm.0,
                        req.as_mut_ptr(),
                    )
                };
                check(rc, env.op, self.world_rank, src)?;
                // SAFETY: MPI_Irecv succeeded and wrote the request.
                RecvState::Posted(Handle(unsafe { req.assume_init() }))
            }
            _ => RecvState::Probing,
        };
        t.pending.push(Pending {
            id,
            kind: Kind::Recv {
                comm,
                chan,
                src: mpi_src,
                state,
            },
            cell: cell.clone(),
            buf: Some(buf),
            op: env.op,
            peer: src.unwrap_or(0),
            tag: env.tag,
            bytes: 0,
            rank: self.world_rank,
            family: self.family,
        });
        // One look now: a message already here completes a small receive at once.
        progress(&mut t);
        g.work.notify_one();
        drop(t);
        Ok(self.posted(cell, id))
    }

    /// Waits for a collective's request; at the deadline, aborts the job (see the module).
    fn wait(&self, mut req: ffi::MPI_Request, op: &'static str, timeout: Duration) -> Result<()> {
        let g = global()?;
        let deadline = Instant::now() + timeout;
        let mut turns = 0u32;
        loop {
            let mut t = mpi_lock(g);
            let mut flag: c_int = 0;
            // SAFETY: our live request, under the lock.
            let rc = unsafe { ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            progress(&mut t);
            drop(t);
            check(rc, op, self.world_rank, None)?;
            if flag != 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let msg = format!(
                    "distcomm (MPI backend): {op} on rank {} did not complete within {timeout:?}; \
                     MPI cannot withdraw a collective that may still write into its buffers, \
                     so the job is aborted",
                    self.world_rank
                );
                crate::diag::always!(ERROR, target: "distcomm::mpi", "{msg}");
                // SAFETY: aborting the job is always allowed.
                unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
                return Err(Error::Aborted {
                    op,
                    rank: self.world_rank,
                    reason: msg,
                });
            }
            turns = turns.wrapping_add(1);
            if turns > 1000 {
                std::thread::yield_now();
            }
        }
    }

    /// Starts a nonblocking collective with `start` (under the lock) and waits for it.
    fn run(
        &self,
        op: &'static str,
        timeout: Duration,
        start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
    ) -> Result<()> {
        let g = global()?;
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        let t = mpi_lock(g);
        if let Some(reason) = t.aborted.get(&self.family).cloned() {
            return Err(Error::Aborted {
                op,
                rank: self.world_rank,
                reason,
            });
        }
        let rc = start(req.as_mut_ptr());
        drop(t);
        check(rc, op, self.world_rank, None)?;
        // SAFETY: the start call succeeded and wrote the request.
        self.wait(unsafe { req.assume_init() }, op, timeout)
    }

    /// On the user communicator: data collectives on `coll` may be in flight from the
    /// group's async thread, and MPI wants collectives of one communicator started in the
    /// same order everywhere.
    pub(crate) fn barrier(&self, timeout: Duration) -> Result<()> {
        let comm = self.user.0;
        // SAFETY: valid communicator; called under the lock by `run`.
        self.run("barrier", timeout, |req| unsafe {
            ffi::MPI_Ibarrier(comm, req)
        })
    }

    /// Runs a collective. 16-bit floats are reduced in f32 (widened here, rounded once),
    /// averages are sums divided at the end, as on the native backend.
    pub(crate) fn collective<T: Reducible>(&self, c: Coll<'_, T>, timeout: Duration) -> Result<()> {
        let n = self.size;
        match c {
            Coll::AllReduce(buf, op) => self.reducing(buf, op, None, timeout),
            Coll::Reduce(buf, root, op) => self.reducing(buf, op, Some(root), timeout),
            Coll::ReduceScatter(input, output, op) if bytes_as_i32(&[] as &[T], op).is_some() => {
                let wide = bytes_as_i32(input, op).unwrap_or_default();
                let mut out = vec![0i32; output.len()];
                self.reduce_scatter(&wide, &mut out, sum_for_avg(op), timeout)?;
                i32_to_bytes(output, &out);
                if op == ReduceOp::Avg {
                    T::finish_avg(output, n);
                }
                Ok(())
            }
            Coll::ReduceScatter(input, output, op) => match (T::widen(input), op) {
                (Some(wide), _) => {
                    let mut out = vec![0f32; output.len()];
                    self.reduce_scatter(&wide, &mut out, op, timeout)?;
                    if op == ReduceOp::Avg {
                        f32::finish_avg(&mut out, n);
                    }
                    T::narrow(output, &out);
                    Ok(())
                }
                (None, _) => {
                    self.reduce_scatter(input, output, op, timeout)?;
                    if op == ReduceOp::Avg {
                        T::finish_avg(output, n);
                    }
                    Ok(())
                }
            },
            Coll::Broadcast(buf, root) => {
                let (ptr, count, ty) = raw_mut(buf)?;
                let comm = self.coll.0;
                // SAFETY: `buf` is borrowed for this whole call, which returns only once
                // the request completed (or after aborting the job).
                self.run("broadcast", timeout, |req| unsafe {
                    ffi::MPI_Ibcast(ptr, count, ty, root as c_int, comm, req)
                })
            }
            Coll::AllGather(input, output) => {
                let (sp, sc, ty) = raw(input)?;
                let (rp, _, _) = raw_mut(output)?;
                let comm = self.coll.0;
                // SAFETY: as for broadcast; output holds n × input elements (checked by the
                // caller).
                self.run("all_gather", timeout, |req| unsafe {
                    ffi::MPI_Iallgather(sp, sc, ty, rp, sc, ty, comm, req)
                })
            }
            Coll::Gather(input, output, root) => {
                let (sp, sc, ty) = raw(input)?;
                let rp = match output {
                    Some(o) => raw_mut(o)?.0,
                    None => std::ptr::null_mut(),
                };
                let comm = self.coll.0;
                // SAFETY: as for broadcast; the receive buffer matters at the root only.
                self.run("gather", timeout, |req| unsafe {
                    ffi::MPI_Igather(sp, sc, ty, rp, sc, ty, root as c_int, comm, req)
                })
            }
            Coll::Scatter(input, output, root) => {
                let (rp, rc, ty) = raw_mut(output)?;
                let sp = match input {
                    Some(i) => raw(i)?.0,
                    None => std::ptr::null(),
                };
                let comm = self.coll.0;
                // SAFETY: as for gather.
                self.run("scatter", timeout, |req| unsafe {
                    ffi::MPI_Iscatter(sp, rc, ty, rp, rc, ty, root as c_int, comm, req)
                })
            }
            Coll::AllToAll((input, sc), (output, rcounts)) => {
                let (sp, _, ty) = raw(input)?;
                let (rp, _, _) = raw_mut(output)?;
                let ints = |v: &[usize]| -> Result<(Vec<c_int>, Vec<c_int>)> {
                    let counts = v
                        .iter()
                        .map(|&x| {
                            c_int::try_from(x).map_err(|_| too_big("all_to_all", self.rank, x))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let mut displs = Vec::with_capacity(v.len());
                    let mut at = 0usize;
                    for &x in v {
                        displs.push(
                            c_int::try_from(at)
                                .map_err(|_| too_big("all_to_all", self.rank, at))?,
                        );
                        at += x;
                    }
                    Ok((counts, displs))
                };
                let (scnt, sdis) = ints(sc)?;
                let (rcnt, rdis) = ints(rcounts)?;
                let comm = self.coll.0;
                // SAFETY: as for broadcast; counts and displacements live until `run`
                // returns, i.e. until the request completed.
                self.run("all_to_all", timeout, |req| unsafe {
                    ffi::MPI_Ialltoallv(
                        sp,
                        scnt.as_ptr(),
                        sdis.as_ptr(),
                        ty,
                        rp,
                        rcnt.as_ptr(),
                        rdis.as_ptr(),
                        ty,
                        comm,
                        req,
                    )
                })
            }
        }
    }

    /// All-reduce (`root` None) or reduce of `buf` in place: 16-bit floats widened to f32
    /// and rounded once, averages summed and divided at the end (at the root for reduce).
    fn reducing<T: Reducible>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: Option<usize>,
        timeout: Duration,
    ) -> Result<()> {
        let n = self.size;
        let finish = op == ReduceOp::Avg && root.is_none_or(|r| r == self.rank);
        if let Some(mut wide) = bytes_as_i32(buf, op) {
            self.reduce_raw(&mut wide, sum_for_avg(op), root, timeout)?;
            i32_to_bytes(buf, &wide);
            if finish {
                T::finish_avg(buf, n);
            }
            return Ok(());
        }
        match T::widen(buf) {
            Some(mut wide) => {
                self.reduce_raw(&mut wide, op, root, timeout)?;
                if finish {
                    f32::finish_avg(&mut wide, n);
                }
                T::narrow(buf, &wide);
            }
            None => {
                self.reduce_raw(buf, op, root, timeout)?;
                if finish {
                    T::finish_avg(buf, n);
                }
            }
        }
        Ok(())
    }

    /// MPI_Iallreduce / MPI_Ireduce of `x` in place (through a copy of the input when the
    /// library's `MPI_IN_PLACE` is not known: see [`in_place`]).
    fn reduce_raw<U: Reducible>(
        &self,
        x: &mut [U],
        op: ReduceOp,
        root: Option<usize>,
        timeout: Duration,
    ) -> Result<()> {
        let copy;
        let send = match in_place() {
            Some(p) if root.is_none_or(|r| r == self.rank) => p.cast_const(),
            _ => {
                copy = x.to_vec();
                raw(&copy)?.0
            }
        };
        let (ptr, count, ty) = raw_mut(x)?;
        let (mop, comm) = (mpi_op(op), self.coll.0);
        let g = global()?;
        if root.is_none() && g.multiple {
            // Open MPI's blocking MPI_Allreduce (coll/tuned) is much faster than its
            // nonblocking one (libnbc): 64 MiB on 2 ranks 1.9 vs 1.1 GB/s. With
            // MPI_THREAD_MULTIPLE it runs outside the lock, its deadline watched by the
            // progress thread.
            let id = g.next_id.fetch_add(1, Ordering::Relaxed);
            let deadline = Instant::now() + timeout;
            let msg = overdue("all_reduce", self.world_rank, timeout);
            let mut w = g.watch.lock().unwrap_or_else(|e| e.into_inner());
            w.push((id, deadline, msg));
            drop(w);
            if let Some(reason) = mpi_lock(g).aborted.get(&self.family).cloned() {
                g.watch
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|e| e.0 != id);
                return Err(Error::Aborted {
                    op: "all_reduce",
                    rank: self.world_rank,
                    reason,
                });
            }
            // SAFETY: `x` (and `copy`) are borrowed for the whole blocking call; MPI was
            // initialised with MPI_THREAD_MULTIPLE, so calling outside the lock is allowed.
            let rc = unsafe { ffi::MPI_Allreduce(send, ptr, count, ty, mop, comm) };
            g.watch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|e| e.0 != id);
            return check(rc, "all_reduce", self.world_rank, None);
        }
        match root {
            // SAFETY: `x` (and `copy`) outlive the request: `run` returns only once it
            // completed (or after aborting the job).
            None => self.run("all_reduce", timeout, |req| unsafe {
                ffi::MPI_Iallreduce(send, ptr, count, ty, mop, comm, req)
            }),
            // SAFETY: as above.
            Some(root) => self.run("reduce", timeout, |req| unsafe {
                ffi::MPI_Ireduce(send, ptr, count, ty, mop, root as c_int, comm, req)
            }),
        }
    }

    fn reduce_scatter<T: Reducible>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let (sp, _, ty) = raw(input)?;
        let (rp, rc, _) = raw_mut(output)?;
        let (mop, comm) = (mpi_op(op), self.coll.0);
        // SAFETY: as for broadcast.
        self.run("reduce_scatter", timeout, |req| unsafe {
            ffi::MPI_Ireduce_scatter_block(sp, rp, rc, ty, mop, comm, req)
        })
    }

    /// The subgroup of this group whose members call with `Some(position)` (collective
    /// over this group; ranks passing `None` get `None`).
    pub(crate) fn split(&self, key: Option<usize>) -> Result<Option<Comm>> {
        let g = global()?;
        let t = mpi_lock(g);
        // SAFETY: reading rsmpi's exported constant.
        let color = if key.is_some() {
            0
        } else {
            unsafe { ffi::RSMPI_UNDEFINED }
        };
        let mut c = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: valid communicator, pointer to a local; under the lock.
        let rc = unsafe {
            ffi::MPI_Comm_split(
                self.coll.0,
                color,
                key.unwrap_or(0) as c_int,
                c.as_mut_ptr(),
            )
        };
        check(rc, "new_group", self.world_rank, None)?;
        // SAFETY: MPI_Comm_split succeeded.
        let c = unsafe { c.assume_init() };
        if key.is_none() {
            return Ok(None);
        }
        // SAFETY: a valid communicator, under the lock.
        let out = unsafe { Comm::dup_all(c, self.world_rank, self.family) };
        // SAFETY: `c` is ours and no longer needed (its duplicates are independent).
        unsafe { ffi::MPI_Comm_free(&mut { c }) };
        drop(t);
        out.map(Some)
    }

    /// Fails every pending point-to-point operation of this group's family (the world group
    /// it came from and its subgroups) with `Aborted`, and every later one; MPI keeps the
    /// buffers of started transfers until they finish.
    pub(crate) fn abort(&self, reason: &str) {
        let Ok(g) = global() else { return };
        let mut t = mpi_lock(g);
        t.aborted.insert(self.family, reason.to_string());
        for p in t.pending.iter_mut().filter(|p| p.family == self.family) {
            p.cell.complete(
                Err(Error::Aborted {
                    op: p.op,
                    rank: p.rank,
                    reason: reason.to_string(),
                }),
                None,
            );
        }
        // Receives still probing hold no MPI resources: drop them now.
        let family = self.family;
        t.pending.retain(|p| {
            p.family != family
                || !matches!(
                    p.kind,
                    Kind::Recv {
                        state: RecvState::Probing,
                        ..
                    }
                )
        });
    }
}
