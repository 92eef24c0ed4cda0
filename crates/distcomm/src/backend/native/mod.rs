//! The native backend: distcomm's own progress engine (TCP and shared-memory links, see
//! [`crate::transport`]), the schedules of [`crate::algorithms`] run over it
//! (`collectives`), and the shared-memory arena (`arena`) as the component all_reduce takes
//! when every member shares a host.
//!
//! A subgroup's backend shares the world's engine and connections; its messages travel in its
//! own contexts (group number × [`CTX_PER_GROUP`]). A subgroup whose members share a host gets
//! an arena of its own, set up at its first collective (`setup::subgroup_arena`).
//!
//! Owns: group ranks to global ranks, contexts, algorithm choice. Must not know: the API's
//! handles beyond [`Work`], or any other backend.

#[cfg(target_os = "linux")]
pub(crate) mod arena;
#[cfg(not(target_os = "linux"))]
#[path = "arena_stub.rs"]
pub(crate) mod arena;
#[cfg(target_os = "linux")]
mod broken;
#[cfg(target_os = "linux")]
mod callwords;
mod collectives;
mod intranode;
mod setup;

pub(crate) use setup::Native;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use self::arena::Arena;
use super::{Backend, Coll, CollCall, Posted, Small, Split, CTX_BARRIER, CTX_PER_GROUP};
use crate::call::Envelope;
use crate::call::{Call, Fingerprint};
use crate::config::Config;
use crate::device::Memory;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::transport::tcp::{Engine, Fast};
use crate::transport::{CancelNote, CancelledOp, LinkKind};
use crate::work::{BoxBuf, Driver, Status, Work};

/// Default chunk per slot. Measured on 2 ranks, 64 MiB all_reduce busbw: 1.97–2.03 GB/s in
/// 1 MiB chunks, 2.17–2.22 in 2 MiB, 2.21–2.30 in 4 MiB (the arena takes 2·(n+1) chunks).
pub(crate) const DEFAULT_CHUNK: usize = 2 << 20;

/// A call running through [`Arena::exchange`](arena::Arena::exchange).
pub(crate) struct Exchange<'a> {
    pub op: &'static str,
    pub fp: &'a Fingerprint,
    pub dtype: DType,
    pub tag: u32,
    pub timeout: Duration,
    pub engine: &'a Engine,
}

/// Where a group's ranks run relative to rank 0, as measured when its arena is set up (see
/// `arena/setup.rs`); it decides from which sizes collectives copy across processes instead of
/// through the slots (see `intranode::direct_min`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caches {
    /// On cores with caches of their own (a cache line's round trip of 0.25 µs or more).
    Apart,
    /// Sharing a core's caches: a short round trip, and the slots' two copies beat one
    /// cross-memory copy.
    Shared,
    /// A short round trip, yet one cross-memory copy beats the slots' two copies.
    Near,
}

/// Settings of the arena.
#[derive(Clone)]
pub(crate) struct ArenaConfig {
    pub enabled: bool,
    pub chunk: usize,
    pub oversubscribed: bool,
    pub max_bytes: usize,
    /// Whether the arena may copy across processes (direct steps), where every pair can.
    pub cma: bool,
    /// Whether the ranks share a core's caches; `None`: measured at set-up.
    pub shared_caches: Option<bool>,
    /// Whether large copies into the slots stream (`Arena::streams`); `None`: measured at
    /// set-up.
    pub stream: Option<bool>,
}

/// One group on the native engine.
pub(crate) struct NativeBackend {
    engine: Arc<Engine>,
    /// Group rank -> global rank.
    members: Arc<Vec<usize>>,
    rank: usize,
    /// Base of the group's contexts.
    ctx: u32,
    /// The shared-memory arena of the group's collectives (all members on one host). The
    /// world's is set up at init; a subgroup's at its first collective (see `recipe`).
    arena: OnceLock<Option<Arc<Arena>>>,
    /// What a subgroup's arena is set up with: the world's store and arena settings.
    recipe: Option<Arc<setup::ArenaRecipe>>,
    /// Serialises that set-up between collectives started on several threads.
    arena_init: Mutex<()>,
    /// Scratch buffers of the schedules, reused so that large ones are not faulted in anew.
    pool: Pool,
    config: Arc<Config>,
}

impl NativeBackend {
    /// The world group's backend over `engine`.
    pub(crate) fn world(
        engine: Arc<Engine>,
        members: Arc<Vec<usize>>,
        rank: usize,
        arena: (Option<Arc<Arena>>, Option<Arc<setup::ArenaRecipe>>),
        config: Arc<Config>,
    ) -> NativeBackend {
        NativeBackend {
            engine,
            members,
            rank,
            ctx: 0,
            arena: OnceLock::from(arena.0),
            recipe: arena.1,
            arena_init: Mutex::new(()),
            pool: Pool::default(),
            config,
        }
    }

    /// The group's arena, once set up and if there is one.
    fn arena(&self) -> Option<&Arc<Arena>> {
        self.arena.get().and_then(Option::as_ref)
    }

    /// Sets up a subgroup's arena before its first collective (every member does it there, so
    /// all agree on it); a no-op once done. A set-up that fails leaves the group without one
    /// (its collectives take the network schedules) and returns the error.
    #[inline]
    fn ensure_arena(&self, op: &'static str, timeout: Duration) -> Result<()> {
        match self.arena.get() {
            Some(_) => Ok(()),
            None => self.make_arena(op, timeout),
        }
    }

    /// [`ensure_arena`](Self::ensure_arena)'s first call (out of line: every collective asks).
    #[cold]
    #[inline(never)]
    fn make_arena(&self, op: &'static str, timeout: Duration) -> Result<()> {
        let _one = self.arena_init.lock().unwrap_or_else(|e| e.into_inner());
        if self.arena.get().is_some() {
            return Ok(());
        }
        let made = match &self.recipe {
            Some(recipe) => setup::subgroup_arena(self, recipe, op, timeout),
            None => Ok(None),
        };
        let (arena, result) = match made {
            Ok(arena) => (arena, Ok(())),
            Err(e) => (None, Err(e)),
        };
        let _ = self.arena.set(arena);
        result
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn global(&self, op: &'static str, peer: usize) -> Result<usize> {
        // (`ok_or_else`: an error built eagerly is dropped on every call, 1 % of a small
        // message's time.)
        self.members
            .get(peer)
            .copied()
            .ok_or_else(|| Error::InvalidRank {
                op,
                rank: self.rank,
                peer,
                world: self.members.len(),
            })
    }

    /// Group rank -> global rank for statuses, in subgroups (the world's ranks are global).
    fn map(&self) -> Option<Arc<Vec<usize>>> {
        (self.ctx != 0).then(|| self.members.clone())
    }

    /// `env` with its context made absolute (it is relative to the group's contexts).
    fn scoped(&self, env: Envelope) -> Envelope {
        Envelope {
            ctx: self.ctx + env.ctx,
            ..env
        }
    }

    fn driver(&self) -> Arc<dyn Driver> {
        self.engine.clone()
    }

    fn posted(&self, (id, cell): (u64, Arc<crate::work::OpCell>)) -> Posted {
        Posted {
            cell,
            driver: self.driver(),
            id,
            map: self.map(),
        }
    }

    /// A send to group rank `dst` as a typed handle (for the schedules).
    fn post_send<B: 'static>(
        &self,
        env: Envelope,
        buf: BoxBuf,
        dst: usize,
        timeout: Duration,
    ) -> Result<Work<B>> {
        Ok(self
            .isend(env, buf, dst, timeout)?
            .into_work(env.op, Some(dst), timeout)
            .detach_on_drop())
    }

    /// Sends a collective's small message to group rank `dst` at once, without a handle, when
    /// the engine can ([`Engine::send_scheduled`]); `false`: post it.
    fn send_scheduled(&self, env: Envelope, data: &[u8], dst: usize) -> bool {
        self.global(env.op, dst)
            .is_ok_and(|g| self.engine.send_scheduled(self.scoped(env), data, g))
    }

    /// Takes a collective's small message of `len` bytes from group rank `src` at once,
    /// without a handle, when it has come ([`Engine::recv_scheduled`]); `false`: post it.
    fn recv_scheduled(
        &self,
        env: Envelope,
        src: usize,
        len: usize,
        take: impl FnOnce(&[u8]),
    ) -> bool {
        self.global(env.op, src)
            .is_ok_and(|g| self.engine.recv_scheduled(self.scoped(env), g, len, take))
    }

    /// Whether group rank `p` is reached through a TCP socket ([`Engine::by_socket`]).
    fn by_socket(&self, p: usize) -> bool {
        self.members
            .get(p)
            .is_some_and(|&g| self.engine.by_socket(g))
    }

    /// A receive from group rank `src` as a typed handle (for the schedules).
    fn post_recv<B: 'static>(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: usize,
        timeout: Duration,
    ) -> Result<Work<B>> {
        Ok(self
            .irecv(env, buf, Some(src), timeout)?
            .into_work(env.op, Some(src), timeout))
    }

    /// Lets every member know that this rank's collective `call` (sequence number `tag`)
    /// failed with `e`, so that none waits for us until its deadline.
    fn cancel(&self, call: &Call, dtype: DType, tag: u32, e: &Error) {
        let desync = matches!(e, Error::Desync { .. });
        let env = Envelope {
            op: call.kind.name(),
            dtype,
            ctx: self.ctx + super::CTX_COLL,
            tag,
            fp: call.fingerprint(),
        };
        let lost = match e {
            Error::PeerLost { peer, .. } => Some(*peer),
            _ => None,
        };
        self.engine
            .cancel_key(env, cancel_why(desync, lost), &self.members);
    }

    /// Dissemination: ⌈log₂ n⌉ rounds of zero-byte messages.
    fn barrier(&self, timeout: Duration) -> Result<()> {
        let n = self.size();
        let me = self.rank;
        let mut dist = 1;
        let mut round = 0u32;
        while dist < n {
            let to = (me + dist) % n;
            let from = (me + n - dist) % n;
            let env = Envelope {
                op: "barrier",
                dtype: DType::U8,
                ctx: CTX_BARRIER,
                tag: round,
                // A collective's fingerprint: the send completes once written, with no
                // acknowledgement to wait for (half the time of a round).
                fp: Fingerprint::BARRIER,
            };
            let r: Work<Vec<u8>> =
                self.post_recv(env, Box::new(Vec::<u8>::new()), from, timeout)?;
            let s: Work<Vec<u8>> = self.post_send(env, Box::new(Vec::<u8>::new()), to, timeout)?;
            r.wait()?;
            s.wait()?;
            dist *= 2;
            round += 1;
        }
        Ok(())
    }
}

impl Backend for NativeBackend {
    fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize, _timeout: Duration) -> Result<Posted> {
        let g = self.global(env.op, dst)?;
        Ok(self.posted(self.engine.isend(self.scoped(env), buf, g)))
    }

    fn irecv(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
        _timeout: Duration,
    ) -> Result<Posted> {
        let g = match src {
            Some(s) => Some(self.global(env.op, s)?),
            None => None,
        };
        Ok(self.posted(self.engine.irecv(self.scoped(env), buf, g)))
    }

    fn send_small(&self, env: Envelope, data: &[u8], dst: usize) -> Small<()> {
        let Ok(g) = self.global(env.op, dst) else {
            return Small::Declined;
        };
        match self.engine.send_small(self.scoped(env), data, g) {
            Fast::Declined => Small::Declined,
            Fast::Done(r) => Small::Done(r.map(|_| ())),
            Fast::Handed(id, cell) => Small::Posted(Posted {
                cell,
                driver: self.driver(),
                id,
                map: None,
            }),
        }
    }

    fn recv_small(&self, env: Envelope, out: &mut [u8], src: usize) -> Small<Status> {
        let Ok(g) = self.global(env.op, src) else {
            return Small::Declined;
        };
        match self.engine.recv_small(self.scoped(env), out, g) {
            None => Small::Declined,
            Some(r) => Small::Done(r),
        }
    }

    fn collective(&self, c: CollCall<'_>, coll: Coll<'_>) -> Result<()> {
        collectives::run(self, c, coll)
    }
    fn split(&self, how: &Split) -> Result<Option<Arc<dyn Backend>>> {
        let ctx = how
            .id
            .checked_mul(u64::from(CTX_PER_GROUP))
            .and_then(|c| u32::try_from(c).ok())
            .ok_or_else(|| Error::InvalidArgument {
                op: if how.collective {
                    "new_group"
                } else {
                    "subgroup"
                },
                rank: self.rank,
                detail: format!("too many groups (group number {})", how.id),
            })?;
        let Some(me) = how.me else {
            return Ok(None);
        };
        // A subgroup of one, or one without a recipe (no arena anywhere), has no arena to set
        // up; the others set theirs up at their first collective.
        let arena = OnceLock::new();
        if how.members.len() < 2 || self.recipe.is_none() {
            let _ = arena.set(None);
        }
        Ok(Some(Arc::new(NativeBackend {
            engine: self.engine.clone(),
            members: how.members.clone(),
            rank: me,
            ctx,
            arena,
            recipe: self.recipe.clone(),
            arena_init: Mutex::new(()),
            pool: Pool::default(),
            config: self.config.clone(),
        })))
    }

    fn collective_failed(&self, call: &Call, dtype: DType, tag: u32, e: &Error) {
        self.cancel(call, dtype, tag, e);
    }

    fn abort(&self, reason: &str) {
        self.engine.abort(reason);
    }

    fn addresses(&self, mem: Memory) -> bool {
        let me = self.members[self.rank];
        let mut links = self.members.iter().filter(|&&m| m != me);
        LinkKind::Loopback.addresses(mem) && links.all(|&m| self.engine.link_kind(m).addresses(mem))
    }

    fn transport(&self) -> &'static str {
        let me = self.members[self.rank];
        let (mut shm, mut tcp) = (false, false);
        for &m in self.members.iter().filter(|&&m| m != me) {
            let k = self.engine.link_kind(m);
            shm |= k == LinkKind::Shm;
            tcp |= k == LinkKind::Tcp;
        }
        match (shm, tcp) {
            (true, true) => "shm+tcp",
            (true, false) => "shm",
            (false, true) => "tcp",
            (false, false) => "self",
        }
    }

    fn transport_to(&self, peer: usize) -> &'static str {
        match self.members.get(peer) {
            Some(&g) => self.engine.link_kind(g).name(),
            None => "none",
        }
    }

    fn peer_failure(&self, peer: usize) -> Option<String> {
        self.engine.peer_failure(*self.members.get(peer)?)
    }

    fn eager_max(&self) -> Option<usize> {
        Some(self.engine.eager_max())
    }

    fn intranode_all_reduce(&self) -> bool {
        self.arena().is_some_and(|a| a.usable())
    }
}

/// The reason word of a collective's cancellation (the transport carries it opaquely): bit 0
/// a desync, bits 8.. the lost peer + 1 (0: none).
fn cancel_why(desync: bool, lost: Option<usize>) -> u32 {
    u32::from(desync) | lost.map_or(0, |p| (p as u32).saturating_add(1) << 8)
}

/// The error an operation of a cancelled collective gets (the engine's `cancel_error`): it
/// names the lost peer when a peer's loss was the cause, the desync when one was found.
pub(crate) fn cancelled_error(note: &CancelNote, op: &CancelledOp) -> Error {
    let CancelledOp {
        rank,
        world,
        op,
        check,
        dtype,
    } = *op;
    let desync = note.why & 1 == 1;
    let lost = (note.why >> 8)
        .checked_sub(1)
        .map(|l| l as usize)
        .filter(|&l| l < world);
    let theirs = note.check.describe(note.dtype);
    match (desync, note.by == rank) {
        (false, false) if lost.is_some_and(|p| p != rank) => Error::PeerLost {
            op,
            rank,
            peer: lost.unwrap_or(note.by),
            reason: format!(
                "rank {} lost its connection to it during collective {theirs} and cancelled \
                 the collective",
                note.by
            ),
        },
        (true, false) => Error::Desync {
            op,
            rank,
            peer: note.by,
            ours: check.describe(dtype),
            theirs: format!("{theirs}, which found a mismatch and cancelled"),
        },
        _ => Error::Aborted {
            op,
            rank,
            reason: format!(
                "rank {} failed collective {theirs} and cancelled it",
                note.by
            ),
        },
    }
}
