//! Backends: what carries one group's operations. The API layer ([`crate::group`]) checks
//! arguments, numbers collectives and keeps them in issue order; a [`Backend`] moves the bytes.
//!
//! * `native`: distcomm's own engine (TCP and shared-memory links), the schedules of
//!   [`crate::algorithms`] run over it, and the shared-memory arena as one of its components;
//! * `mpi` (feature `mpi`): the system MPI.
//!
//! A new backend (NCCL, say) is a third implementation of [`Backend`]: the API layer has no
//! branch on which backend runs. In the spirit of c10d's `Backend` and Open MPI's `coll`/`pml`
//! frameworks, a backend is per group (a subgroup is a backend made by [`Backend::split`]) and
//! says what it can do ([`Backend::addresses`], [`Backend::eager_max`]).
//!
//! Owns: the trait and its type-erased call vocabulary ([`Coll`], [`Posted`]). Must not know:
//! which backends exist beyond constructing them, or anything of the API's handles but
//! [`Work`]'s completion cell.

pub mod mpi;
pub(crate) mod native;

use std::sync::Arc;
use std::time::Duration;

use crate::call::Call;
use crate::call::Envelope;
use crate::device::Memory;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::work::{BoxBuf, Driver, OpCell, Status, Work};

/// A point-to-point operation a backend has posted: its completion cell and the driver that
/// progresses it. The API layer turns it into a typed [`Work`].
pub(crate) struct Posted {
    pub cell: Arc<OpCell>,
    pub driver: Arc<dyn Driver>,
    /// The backend's id of the operation (what [`Driver::cancel`] takes).
    pub id: u64,
    /// Group rank -> global rank, when the statuses the backend reports name global ranks.
    pub map: Option<Arc<Vec<usize>>>,
}

impl Posted {
    /// The typed handle of a posted operation on `peer` (`None`: any source), waited up to
    /// `timeout` by default.
    pub(crate) fn into_work<B: 'static>(
        self,
        op: &'static str,
        peer: Option<usize>,
        timeout: Duration,
    ) -> Work<B> {
        Work::new(self.cell, self.driver, self.id, op, peer, timeout).with_map(self.map)
    }
}

/// What a blocking small-message fast path did ([`Backend::send_small`]).
pub(crate) enum Small<T> {
    /// Not taken: nothing was sent or received; post the operation instead.
    Declined,
    /// Done, with this outcome.
    Done(Result<T>),
    /// Handed to the backend's progress: wait for it.
    Posted(Posted),
}

/// One collective call on type-erased buffers (element type in [`CollCall::dtype`]; counts in
/// elements), its arguments already checked by the API layer. This rank's own block of an
/// all_gather or all_to_all is already in place in the output; the root of a gather or scatter
/// has the backend copy its own, so that it may while, or after, the others copy theirs.
pub(crate) enum Coll<'a> {
    AllReduce(&'a mut [u8], ReduceOp),
    Broadcast(&'a mut [u8], usize),
    Reduce(&'a mut [u8], usize, ReduceOp),
    AllGather(&'a [u8], &'a mut [u8]),
    /// Input, output (root only), root.
    Gather(&'a [u8], Option<&'a mut [u8]>, usize),
    /// Input (root only), output, root.
    Scatter(Option<&'a [u8]>, &'a mut [u8], usize),
    ReduceScatter(&'a [u8], &'a mut [u8], ReduceOp),
    /// Input and element counts per peer, output and counts per peer.
    AllToAll((&'a [u8], &'a [usize]), (&'a mut [u8], &'a [usize])),
    /// Every member has entered it.
    Barrier,
}

/// A collective as the API issued it: what was called, its sequence number and its place in
/// the group's issue order.
pub(crate) struct CollCall<'a> {
    pub call: Call,
    pub dtype: DType,
    /// The call's sequence number in the group: every rank gives the same call the same one.
    pub tag: u32,
    /// Its place in the group's order: a backend whose calls must start in issue order on every
    /// rank waits for it ([`Turn::wait`]) and passes it on once started.
    pub turn: crate::order::Turn<'a>,
    pub timeout: Duration,
}

/// How a subgroup is made ([`Backend::split`]).
pub(crate) struct Split {
    /// Its members, as global ranks, in group-rank order.
    pub members: Arc<Vec<usize>>,
    /// This process's rank in it; `None` when it is not a member (only with `collective`).
    pub me: Option<usize>,
    /// The job-wide group number (its message contexts derive from it).
    pub id: u64,
    /// Whether every rank of the parent takes part (`new_group`) or only the members
    /// (`subgroup`).
    pub collective: bool,
}

/// Contexts each group owns (user p2p, barrier, collectives, pipeline): a group's contexts start
/// at its number times this.
pub(crate) const CTX_PER_GROUP: u32 = 4;
pub(crate) const CTX_USER: u32 = 0;
pub(crate) const CTX_BARRIER: u32 = 1;
pub(crate) const CTX_COLL: u32 = 2;
pub(crate) const CTX_PIPE: u32 = 3;

/// What carries one group's operations. Object-safe: a group holds an `Arc<dyn Backend>`.
///
/// Ranks in arguments are group ranks; `env.ctx` is relative to the group's contexts
/// ([`CTX_USER`] and friends).
pub(crate) trait Backend: Send + Sync {
    /// Posts a send of `buf` to `dst`. The handle detaches on drop (the message is delivered).
    fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize, timeout: Duration) -> Result<Posted>;

    /// Posts a receive into `buf` from `src` (`None`: any source).
    fn irecv(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
        timeout: Duration,
    ) -> Result<Posted>;

    /// A blocking send of a small message without a handle, where the backend has such a
    /// path.
    fn send_small(&self, _env: Envelope, _data: &[u8], _dst: usize) -> Small<()> {
        Small::Declined
    }

    /// A blocking receive of a small message without a handle, where the backend has such a
    /// path.
    fn recv_small(&self, _env: Envelope, _out: &mut [u8], _src: usize) -> Small<Status> {
        Small::Declined
    }

    /// Runs one collective to its end.
    fn collective(&self, c: CollCall<'_>, coll: Coll<'_>) -> Result<()>;

    /// The backend of a subgroup; `Ok(None)` on a non-member of a collective split.
    fn split(&self, how: &Split) -> Result<Option<Arc<dyn Backend>>>;

    /// Tells the other members that this rank's collective `call` (sequence number `tag`) failed
    /// with `e`, so that none waits for it until its deadline (backends that cannot withdraw a
    /// collective do nothing). [`collective`](Self::collective) does it itself; this is for
    /// composite collectives built on point-to-point.
    fn collective_failed(&self, _call: &Call, _dtype: DType, _tag: u32, _e: &Error) {}

    /// Fails every pending operation of this process promptly; later ones fail at once.
    fn abort(&self, reason: &str);

    /// Whether it moves bytes of `mem` itself (else device buffers are staged through host
    /// memory).
    fn addresses(&self, mem: Memory) -> bool;

    /// The name of what carries messages to the other members (see
    /// [`ProcessGroup::transport`](crate::ProcessGroup::transport)).
    fn transport(&self) -> &'static str;

    /// The name of what carries messages to group rank `peer`.
    fn transport_to(&self, peer: usize) -> &'static str;

    /// Why the connection to group rank `peer` failed, if it has.
    fn peer_failure(&self, peer: usize) -> Option<String>;

    /// The largest message sent without waiting for the receiver; `None` when the backend does
    /// not say (streamed exchanges then send each block whole).
    fn eager_max(&self) -> Option<usize>;

    /// Whether all_reduce runs through a shared-memory arena.
    fn intranode_all_reduce(&self) -> bool {
        false
    }
}

/// Runs `$body` with `$T` the Rust element type of `$dt` ([`DType::Bytes`] as `u8`).
macro_rules! with_dtype {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            $crate::dtype::DType::Bytes | $crate::dtype::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::dtype::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::dtype::DType::I16 => {
                type $T = i16;
                $body
            }
            $crate::dtype::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::dtype::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::dtype::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

/// `bytes` as elements of `T`; an error naming `op` when they are not a whole, aligned number
/// of them (buffers the API erased always are).
pub(crate) fn typed<'a, T: bytemuck::Pod>(op: &'static str, bytes: &'a [u8]) -> Result<&'a [T]> {
    bytemuck::try_cast_slice(bytes).map_err(|e| misfit::<T>(op, bytes.len(), e))
}

/// [`typed`] for a mutable buffer.
pub(crate) fn typed_mut<'a, T: bytemuck::Pod>(
    op: &'static str,
    bytes: &'a mut [u8],
) -> Result<&'a mut [T]> {
    let len = bytes.len();
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| misfit::<T>(op, len, e))
}

fn misfit<T>(op: &'static str, len: usize, e: bytemuck::PodCastError) -> Error {
    Error::Aborted {
        op,
        rank: 0,
        reason: format!(
            "internal: {len} bytes are not a buffer of {} ({e:?})",
            std::any::type_name::<T>()
        ),
    }
}
