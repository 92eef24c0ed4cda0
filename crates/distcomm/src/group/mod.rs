//! The process group: what users call. Checks arguments, numbers collectives, keeps them in
//! issue order (`crate::order`), runs async ones on the group's collective thread, books the comms
//! log, and hands every operation to the group's backend (`crate::backend::Backend`).
//!
//! * `builder`: the world group from settings or the launcher's environment;
//! * `p2p`: point-to-point;
//! * `collectives`: the collectives;
//! * `streamed`: the streamed exchanges of composite collectives (1-bit all_reduce).
//!
//! Owns: the public API and its argument checks. Must not know: which backend runs a call, or
//! how (no transport, engine or MPI type appears here).

mod builder;
mod collectives;

mod p2p;
mod streamed;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// The former name of [`BackendKind`](crate::BackendKind).
#[allow(deprecated)]
pub use crate::config::Backend;
pub(crate) use crate::order::Turn;
pub use builder::{init, GroupBuilder};

use crate::backend::{Backend as Carrier, Split};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::rendezvous::TcpStoreServer;
use crate::rendezvous::{PrefixStore, Store};

/// Largest user tag. Tags above it are refused with [`Error::TagOutOfRange`].
pub const MAX_TAG: u32 = i32::MAX as u32;

pub use crate::config::OVERSUBSCRIBED_SPIN;

/// Default deadline of blocking calls (override with `DISTCOMM_TIMEOUT` in seconds, or
/// [`GroupBuilder::timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A group of ranks that can exchange messages: the world from [`init`], or a subgroup from
/// [`ProcessGroup::new_group`]. Ranks in its API are ranks *within the group*; errors name
/// global ranks.
///
/// Buffers are passed by ownership to the nonblocking calls and handed back by
/// [`Work::into_buffer`](crate::Work::into_buffer); the blocking calls borrow slices and copy.
pub struct ProcessGroup {
    pub(crate) inner: Arc<Inner>,
}

/// What keeps the rendezvous alive as long as any group of the job lives.
struct Keep {
    /// The world's store (namespaced): members-only subgroups agree on their contexts in it.
    store: Option<PrefixStore>,
    _server: Option<TcpStoreServer>,
    /// How many members-only subgroups this process made, per member list (global ranks).
    subgroups: Mutex<std::collections::HashMap<Vec<usize>, u64>>,
}

/// Members-only subgroups ([`ProcessGroup::subgroup`]) take their contexts from this group
/// number on, far above those [`ProcessGroup::new_group`] counts out, so the two never meet.
const SUBGROUP_BASE: u64 = 1 << 28;

pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// Everything a group handle refers to. Handles made by [`ProcessGroup::with_timeout`] share
/// all of it but the timeout.
#[derive(Clone)]
pub(crate) struct Inner {
    /// What carries the group's operations.
    pub(crate) backend: Arc<dyn Carrier>,
    /// Group rank -> global rank.
    pub(crate) members: Arc<Vec<usize>>,
    /// This process's rank in the group.
    pub(crate) rank: usize,
    /// Whether this is the world group (receives from any source are world-only).
    world: bool,
    pub(crate) timeout: Duration,
    /// The issue order of the group's collectives; a turn's number is the call's tag.
    pub(crate) order: Arc<crate::order::Order>,
    /// Job-wide count of subgroups created, to give each its own contexts.
    groups: Arc<AtomicU32>,
    /// Runs this group's asynchronous collectives in issue order.
    pub(crate) worker: Arc<Mutex<Option<mpsc::Sender<Job>>>>,
    /// Scratch buffers of collectives, reused so that large ones are not faulted in anew.
    pub(crate) pool: Arc<Pool>,
    /// Opt-in per-op statistics.
    pub(crate) log: Arc<crate::commslog::CommsLog>,
    /// The environment's settings, read when the world group was built (subgroups share them).
    pub(crate) config: Arc<Config>,
    keep: Arc<Keep>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("members", &self.inner.members)
            .field("transport", &self.transport())
            .finish()
    }
}

impl Inner {
    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    pub(crate) fn invalid(&self, op: &'static str, detail: String) -> Error {
        Error::InvalidArgument {
            op,
            rank: self.rank,
            detail,
        }
    }

    /// Checks that `peer` is a rank of the group.
    pub(crate) fn check_rank(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.members.len() {
            return Err(Error::InvalidRank {
                op,
                rank: self.rank,
                peer,
                world: self.members.len(),
            });
        }
        Ok(())
    }

    /// The issue-order turn of the next collective (its number is the call's tag).
    pub(crate) fn issue(&self) -> Turn<'_> {
        self.order.issue()
    }

    /// [`issue`](Self::issue) for a collective that runs on the group's collective thread.
    pub(crate) fn issue_shared(&self) -> Turn<'static> {
        self.order.issue_shared()
    }

    /// A group on `backend`: its own collective sequence, thread, pool and log.
    fn new(
        backend: Arc<dyn Carrier>,
        members: Arc<Vec<usize>>,
        rank: usize,
        parent: &Inner,
    ) -> Inner {
        Inner {
            backend,
            members,
            rank,
            world: false,
            timeout: parent.timeout,
            order: Default::default(),
            groups: parent.groups.clone(),
            worker: Default::default(),
            pool: Default::default(),
            log: Arc::new(crate::commslog::CommsLog::new(parent.config.comms_log)),
            config: parent.config.clone(),
            keep: parent.keep.clone(),
        }
    }
}

impl ProcessGroup {
    /// The world group on `backend`.
    fn world(
        backend: Arc<dyn Carrier>,
        members: Arc<Vec<usize>>,
        rank: usize,
        timeout: Duration,
        keep: Keep,
        config: Arc<Config>,
    ) -> ProcessGroup {
        ProcessGroup {
            inner: Arc::new(Inner {
                backend,
                members,
                rank,
                world: true,
                timeout,
                order: Default::default(),
                groups: Arc::new(AtomicU32::new(0)),
                worker: Default::default(),
                pool: Default::default(),
                log: Arc::new(crate::commslog::CommsLog::new(config.comms_log)),
                config,
                keep: Arc::new(keep),
            }),
        }
    }
    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Global (world) rank of group rank `r`.
    pub fn global_rank(&self, r: usize) -> Option<usize> {
        self.inner.members.get(r).copied()
    }

    /// A handle on the same group (same members, same sequence of collectives: it is the
    /// group, not a copy) whose blocking calls and `Work::wait` use `timeout` instead of the
    /// group's default: the per-call deadline of collectives.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// use std::time::Duration;
    /// let g = distcomm::init()?;
    /// let mut grads = vec![1.0f32; 1 << 20];
    /// // This one call may take at most 5 seconds; a hung peer is then a Timeout naming it.
    /// g.with_timeout(Duration::from_secs(5))
    ///     .all_reduce(&mut grads, distcomm::ReduceOp::Sum)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_timeout(&self, timeout: Duration) -> ProcessGroup {
        ProcessGroup {
            inner: Arc::new(Inner {
                timeout,
                ..(*self.inner).clone()
            }),
        }
    }

    /// Group rank of global rank `g`, if it is a member.
    pub fn group_rank(&self, g: usize) -> Option<usize> {
        self.inner.members.iter().position(|&m| m == g)
    }

    /// Name of the transport that carries this group's messages: `"shm"` or `"tcp"` when
    /// every link to the other members is of that kind, `"shm+tcp"` when both are in use, and
    /// `"self"` in a group of one.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// let g = distcomm::init()?;
    /// println!("rank {} talks over {}", g.rank(), g.transport());
    /// # Ok(())
    /// # }
    /// ```
    pub fn transport(&self) -> &'static str {
        self.inner.backend.transport()
    }

    /// Whether every link of this group (or its backend) moves bytes of `mem` itself. Device
    /// operations ([`isend_device`](Self::isend_device) and friends) on memory it does not
    /// address are staged through host memory.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// use distcomm::device::Memory;
    /// let g = distcomm::init()?;
    /// assert!(g.addresses(Memory::Host));
    /// println!("CUDA buffers go direct: {}", g.addresses(Memory::Cuda));
    /// # Ok(()) }
    /// ```
    pub fn addresses(&self, mem: crate::device::Memory) -> bool {
        self.inner.backend.addresses(mem)
    }

    /// Whether `all_reduce` on this group runs through the shared-memory arena (every rank of
    /// the world group on one host, over shared memory; see `DISTCOMM_SHM_ALLREDUCE`). A failed
    /// arena call turns it off for the rest of the group's life.
    pub fn intranode_all_reduce(&self) -> bool {
        self.inner.backend.intranode_all_reduce()
    }

    /// The transport towards group rank `peer` (`"shm"`, `"tcp"` or `"self"`), or `None` if
    /// there is no such rank.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        (peer < self.size()).then(|| self.inner.backend.transport_to(peer))
    }

    /// When ranks outnumber cores, waiters spin this briefly, yielding the core on every turn, and
    /// then sleep: a short yielding spin catches a reply from a rank that is running now without
    /// keeping anyone from the core (see the README for the measurements behind it).
    pub const OVERSUBSCRIBED_SPIN: Duration = crate::config::OVERSUBSCRIBED_SPIN;

    /// Default deadline of blocking calls.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Creates a subgroup of the group ranks `ranks` (in that order: `ranks[i]` becomes rank
    /// `i` of the subgroup), with its own message contexts and collective sequence.
    ///
    /// As in torch, **every** rank of this group must call `new_group`, with the same `ranks`,
    /// in the same order relative to other `new_group` calls; ranks outside the subgroup get
    /// `Ok(None)` and no handle, so they can never hang in it.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// let world = distcomm::init()?;
    /// if let Some(evens) = world.new_group(&[0, 2])? {
    ///     let mut x = [world.rank() as f32];
    ///     evens.all_reduce(&mut x, distcomm::ReduceOp::Sum)?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let id = self.inner.groups.fetch_add(1, Ordering::AcqRel) + 1;
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() || std::mem::replace(&mut seen[r], true) {
                return Err(Error::InvalidArgument {
                    op: "new_group",
                    rank: self.rank(),
                    detail: format!(
                        "ranks {ranks:?} must be distinct ranks below {}",
                        self.size()
                    ),
                });
            }
        }
        if ranks.is_empty() {
            return Err(Error::InvalidArgument {
                op: "new_group",
                rank: self.rank(),
                detail: "a group needs at least one rank".into(),
            });
        }
        let me = ranks.iter().position(|&r| r == self.rank());
        let members: Vec<usize> = ranks.iter().map(|&r| self.inner.members[r]).collect();
        // Every rank of this group takes part: on MPI the split is collective.
        self.child(members, me, u64::from(id), true)
    }

    /// Creates a subgroup of the group ranks `ranks` (in that order), called **only by its
    /// members** — the way torch constructs a backend for `new_group`: non-members never take
    /// part. It runs over this group's connections (no new mesh), with its own message contexts
    /// and collective sequence; the members agree on the contexts through the job's rendezvous
    /// store (`ranks[0]` draws a number, the others read it). Members must create subgroups of
    /// the same ranks in the same order; subgroups of other ranks may be made in any order.
    ///
    /// Fails with [`Error::InvalidArgument`] when this rank is not in `ranks`, and on a group
    /// without a rendezvous store (the MPI backend: use [`new_group`](Self::new_group)).
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// let world = distcomm::init()?;
    /// if world.rank() < 2 {
    ///     // Ranks 2.. never call it.
    ///     let pair = world.subgroup(&[0, 1])?;
    ///     pair.barrier()?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn subgroup(&self, ranks: &[usize]) -> Result<ProcessGroup> {
        let invalid = |detail: String| Error::InvalidArgument {
            op: "subgroup",
            rank: self.rank(),
            detail,
        };
        let mut seen = vec![false; self.size()];
        if ranks.is_empty()
            || ranks
                .iter()
                .any(|&r| r >= self.size() || std::mem::replace(&mut seen[r], true))
        {
            return Err(invalid(format!(
                "ranks {ranks:?} must be distinct ranks below {}, at least one",
                self.size()
            )));
        }
        let me = ranks
            .iter()
            .position(|&r| r == self.rank())
            .ok_or_else(|| {
                invalid(format!(
                    "rank {} is not in {ranks:?}: only members create the subgroup",
                    self.rank()
                ))
            })?;
        let keep = &self.inner.keep;
        let store = keep.store.as_ref().ok_or_else(|| {
            invalid("this group has no rendezvous store (MPI backend): use new_group".into())
        })?;
        let members: Vec<usize> = ranks.iter().map(|&r| self.inner.members[r]).collect();
        let nth = {
            let mut made = keep.subgroups.lock().unwrap_or_else(|e| e.into_inner());
            let n = made.entry(members.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let list: Vec<String> = members.iter().map(|m| m.to_string()).collect();
        let key = format!("subgroup/{}/{nth}", list.join(","));
        let id = if me == 0 {
            let id = store.add("subgroup/next", 1)?;
            store.set(&key, id.to_string().as_bytes())?;
            id
        } else {
            let v = store.get(&key)?;
            std::str::from_utf8(&v)
                .ok()
                .and_then(|t| t.parse::<i64>().ok())
                .ok_or_else(|| {
                    Error::StoreProtocol(format!("key {key} holds {v:?}, not a group number"))
                })?
        };
        let id = u64::try_from(id).map_err(|_| invalid(format!("group number {id}")))?;
        let group = self.child(members, Some(me), SUBGROUP_BASE + id, false)?;
        group.ok_or_else(|| invalid("the backend made no group of its members".into()))
    }

    /// A group of `members` (global ranks) on a backend split from this group's, numbered `id`
    /// among the job's groups (its contexts start at `id × 4`); `None` for a non-member.
    fn child(
        &self,
        members: Vec<usize>,
        me: Option<usize>,
        id: u64,
        collective: bool,
    ) -> Result<Option<ProcessGroup>> {
        let members = Arc::new(members);
        let how = Split {
            members: members.clone(),
            me,
            id,
            collective,
        };
        let (Some(backend), Some(me)) = (self.inner.backend.split(&how)?, me) else {
            return Ok(None);
        };
        Ok(Some(ProcessGroup {
            inner: Arc::new(Inner::new(backend, members, me, &self.inner)),
        }))
    }

    pub(crate) fn check_tag(&self, op: &'static str, tag: u32) -> Result<()> {
        if tag > MAX_TAG {
            return Err(Error::TagOutOfRange {
                op,
                rank: self.rank(),
                tag,
                max: MAX_TAG,
            });
        }
        Ok(())
    }

    /// Turns the comms log on or off (it starts on when `DISTCOMM_COMMS_LOG=1`).
    pub fn set_comms_log(&self, on: bool) {
        self.inner.log.set_on(on);
    }

    /// Statistics so far, by op and size.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// let group = distcomm::init()?;
    /// group.set_comms_log(true);
    /// let mut x = vec![1f32; 1024];
    /// group.all_reduce(&mut x, distcomm::ReduceOp::Sum)?;
    /// let stats = group.comms_log();
    /// assert_eq!(stats[0].op, "all_reduce");
    /// print!("{}", group.comms_log_summary());
    /// # Ok(()) }
    /// ```
    pub fn comms_log(&self) -> Vec<crate::commslog::CommsStat> {
        self.inner.log.stats()
    }

    /// The statistics as a table, one line per (op, size).
    pub fn comms_log_summary(&self) -> String {
        self.inner.log.summary()
    }

    /// Fails every pending operation of this process (all groups) promptly with
    /// [`Error::Aborted`]; later operations fail at once.
    pub fn abort(&self) {
        self.inner.backend.abort("aborted by the user");
    }

    /// Why the connection to group rank `peer` failed, if it has.
    pub fn peer_failure(&self, peer: usize) -> Option<String> {
        (peer < self.size()).then(|| self.inner.backend.peer_failure(peer))?
    }
}
