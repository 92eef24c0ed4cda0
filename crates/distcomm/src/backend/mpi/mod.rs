//! The MPI backend (feature `mpi`, over rsmpi's bindings to the system MPI): the same
//! [`ProcessGroup`](crate::ProcessGroup) API and [`Work`](crate::Work) contract, with MPI
//! underneath — for clusters whose MPI is tuned to their fabric.
//!
//! * **Selection**: `DISTCOMM_BACKEND=mpi` (or [`GroupBuilder::backend`](crate::GroupBuilder::backend))
//!   under `mpirun`/`srun`: rank and world come from MPI itself. Asking for it without the
//!   feature, or when MPI sees another world than the launcher's variables say, is a
//!   [`Error::Config`](crate::Error::Config) naming both.
//! * **Threads**: every MPI call distcomm makes holds one process-wide lock, so MPI only needs
//!   `MPI_THREAD_SERIALIZED` (which every MPI offers, unlike `MPI_THREAD_MULTIPLE`); a library
//!   that got less refuses to start. Where `MPI_THREAD_MULTIPLE` is granted (Open MPI grants
//!   it), blocking all_reduce calls MPI's blocking `MPI_Allreduce` outside the lock, because
//!   Open MPI's tuned blocking algorithms are much faster than its nonblocking ones; its
//!   deadline is then watched by the progress thread. No call that can block holds it: receives are matched
//!   with `MPI_Improbe` (so a receive buffer can take the size of the message, and a message
//!   larger than the buffer is a typed error with both sizes) and finished with `MPI_Imrecv`;
//!   collectives are the nonblocking `MPI_I*` ones, tested until done or the deadline.
//! * **Work handles** test their requests: `wait` drives and tests, `is_completed` never blocks,
//!   and a background thread tests pending requests so that they finish without anyone
//!   waiting. Outcomes are sticky as on the native backend.
//! * **Errors**: communicators return errors (`MPI_ERRORS_RETURN`, rsmpi's default is to
//!   abort), and every code maps to a typed [`Error`](crate::Error).
//! * **What MPI cannot do**: withdraw a collective. A collective still pending at its deadline
//!   may yet write into the caller's buffer, so returning would be unsound: the job is aborted
//!   (`MPI_Abort`) with a message naming the operation instead of hanging. Element types are not
//!   checked between sender and receiver (MPI does not carry them), and buffers of device
//!   memory are staged as on TCP (MPI here addresses host memory only).
//!
//! Files: `comm` (the communicators of a group: point-to-point, collectives, splits),
//! `progress` (the lock, the requests in flight, their progress thread, error codes), `types`
//! (element types, operators and buffers as MPI takes them).
//!
//! Owns: everything MPI. Must not know: the native engine, or the API beyond the [`Backend`]
//! trait it implements.

#[cfg(feature = "mpi")]
mod comm;
#[cfg(feature = "mpi")]
mod progress;
#[cfg(feature = "mpi")]
mod types;

#[cfg(feature = "mpi")]
pub(crate) use comm::*;
#[cfg(not(feature = "mpi"))]
pub(crate) use stub::*;

use std::sync::Arc;
use std::time::Duration;

use super::{typed, typed_mut, with_dtype, Backend, CollCall, Posted, Split};
use crate::call::Envelope;
use crate::device::Memory;
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Reducible};
use crate::work::BoxBuf;

/// One group on MPI: its communicators.
pub(crate) struct MpiBackend {
    comm: Comm,
}

impl MpiBackend {
    /// The world group (rank and world as the launcher says; MPI must agree).
    pub(crate) fn world(rank: usize, world: usize) -> Result<MpiBackend> {
        Ok(MpiBackend {
            comm: self::world(rank, world)?,
        })
    }

    /// The typed collective `c` on MPI, once every collective issued before it in this group
    /// has run (MPI needs every rank to start a communicator's collectives in one order).
    fn typed<T: Reducible>(&self, c: CollCall, coll: super::Coll<'_>) -> Result<()> {
        let op = c.call.kind.name();
        c.turn.wait(op, self.comm.world_rank(), c.timeout)?;
        let coll = match coll {
            super::Coll::AllReduce(b, o) => Coll::AllReduce(typed_mut::<T>(op, b)?, o),
            super::Coll::Broadcast(b, root) => Coll::Broadcast(typed_mut::<T>(op, b)?, root),
            super::Coll::Reduce(b, root, o) => Coll::Reduce(typed_mut::<T>(op, b)?, root, o),
            super::Coll::AllGather(i, o) => {
                Coll::AllGather(typed::<T>(op, i)?, typed_mut::<T>(op, o)?)
            }
            super::Coll::Gather(i, o, root) => {
                let o = o.map(|o| typed_mut::<T>(op, o)).transpose()?;
                Coll::Gather(typed::<T>(op, i)?, o, root)
            }
            super::Coll::Scatter(i, o, root) => {
                let i = i.map(|i| typed::<T>(op, i)).transpose()?;
                Coll::Scatter(i, typed_mut::<T>(op, o)?, root)
            }
            super::Coll::ReduceScatter(i, o, r) => {
                Coll::ReduceScatter(typed::<T>(op, i)?, typed_mut::<T>(op, o)?, r)
            }
            super::Coll::AllToAll((i, sc), (o, rc)) => {
                Coll::AllToAll((typed::<T>(op, i)?, sc), (typed_mut::<T>(op, o)?, rc))
            }
            super::Coll::Barrier => return self.comm.barrier(c.timeout),
        };
        // The turn passes when `c` drops, after the call: MPI's order is then the issue order.
        self.comm.collective(coll, c.timeout)
    }
}

impl Backend for MpiBackend {
    fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize, _timeout: Duration) -> Result<Posted> {
        self.comm.isend(env, buf, dst)
    }

    fn irecv(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
        _timeout: Duration,
    ) -> Result<Posted> {
        self.comm.irecv(env, buf, src)
    }

    fn collective(&self, c: CollCall<'_>, coll: super::Coll<'_>) -> Result<()> {
        with_dtype!(c.dtype, T => self.typed::<T>(c, coll))
    }

    fn split(&self, how: &Split) -> Result<Option<Arc<dyn Backend>>> {
        if !how.collective {
            return Err(Error::InvalidArgument {
                op: "subgroup",
                rank: self.comm.world_rank(),
                detail: "MPI splits a communicator with every rank of it: use new_group".into(),
            });
        }
        let comm = self.comm.split(how.me)?;
        Ok(comm.map(|comm| Arc::new(MpiBackend { comm }) as Arc<dyn Backend>))
    }

    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    /// Host memory only (a CUDA-aware MPI could take device pointers, but the buffers distcomm
    /// hands MPI are host memory).
    fn addresses(&self, mem: Memory) -> bool {
        mem == Memory::Host
    }

    fn transport(&self) -> &'static str {
        "mpi"
    }

    fn transport_to(&self, _peer: usize) -> &'static str {
        "mpi"
    }

    fn peer_failure(&self, _peer: usize) -> Option<String> {
        None
    }

    fn eager_max(&self) -> Option<usize> {
        None
    }
}

/// One collective call, as the MPI backend receives it (arguments already checked).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) enum Coll<'a, T> {
    AllReduce(&'a mut [T], ReduceOp),
    Broadcast(&'a mut [T], usize),
    Reduce(&'a mut [T], usize, ReduceOp),
    AllGather(&'a [T], &'a mut [T]),
    /// Input, output (root only), root.
    Gather(&'a [T], Option<&'a mut [T]>, usize),
    /// Input (root only), output, root.
    Scatter(Option<&'a [T]>, &'a mut [T], usize),
    ReduceScatter(&'a [T], &'a mut [T], ReduceOp),
    /// Input and counts per peer, output and counts per peer.
    AllToAll((&'a [T], &'a [usize]), (&'a mut [T], &'a [usize])),
}

#[cfg(not(feature = "mpi"))]
mod stub {
    //! Without the feature there is no communicator: `Inner::mpi` is always `None`, and these
    //! methods cannot be called (the type has no values).
    use std::time::Duration;

    use super::Coll;
    use crate::backend::Posted;
    use crate::call::Envelope;
    use crate::error::Result;
    use crate::reduce::Reducible;
    use crate::work::BoxBuf;

    pub(crate) enum Comm {}

    impl Comm {
        pub(crate) fn isend(&self, _: Envelope, _: BoxBuf, _: usize) -> Result<Posted> {
            match *self {}
        }
        pub(crate) fn irecv(&self, _: Envelope, _: BoxBuf, _: Option<usize>) -> Result<Posted> {
            match *self {}
        }
        pub(crate) fn collective<T: Reducible>(&self, _: Coll<'_, T>, _: Duration) -> Result<()> {
            match *self {}
        }
        pub(crate) fn barrier(&self, _: Duration) -> Result<()> {
            match *self {}
        }
        pub(crate) fn split(&self, _: Option<usize>) -> Result<Option<Comm>> {
            match *self {}
        }
        pub(crate) fn abort(&self, _: &str) {
            match *self {}
        }
        pub(crate) fn world_rank(&self) -> usize {
            match *self {}
        }
    }

    fn unavailable() -> crate::Error {
        crate::Error::Config(
            "DISTCOMM_BACKEND=mpi, but distcomm was built without the `mpi` feature".into(),
        )
    }

    pub(crate) fn world(_: usize, _: usize) -> Result<Comm> {
        Err(unavailable())
    }

    pub(crate) fn world_size() -> Result<(usize, usize)> {
        Err(unavailable())
    }
}
