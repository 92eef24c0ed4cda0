//! The process group: what users call.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use crate::call::Fingerprint;
use crate::config::Config;
use crate::dtype::{DType, Element};
use crate::env::JobEnv;
use crate::error::{Error, Result};
use crate::intranode::{self, Arena, ArenaConfig};
use crate::rendezvous::{PrefixStore, Store, TcpStore, TcpStoreServer};
use crate::transport::tcp::{Engine, EngineConfig, Envelope, Fast};
use crate::transport::{
    advertise_ip_or, connect_mesh, setup_shm, LinkKind, ShmConfig, TransportKind, DEFAULT_RING,
};
use crate::work::{BoxBuf, Driver, Status, Work};

/// Largest user tag. Tags above it are refused with [`Error::TagOutOfRange`].
pub const MAX_TAG: u32 = i32::MAX as u32;

/// When ranks outnumber cores, waiters spin this briefly, yielding the core on every turn, and
/// then sleep: a short yielding spin catches a reply from a rank that is running now without
/// keeping anyone from the core (see the README for the measurements behind it).
pub const OVERSUBSCRIBED_SPIN: Duration = Duration::from_micros(200);

/// Default deadline of blocking calls (override with `DISTCOMM_TIMEOUT` in seconds, or
/// [`GroupBuilder::timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Builds a [`ProcessGroup`] explicitly, or from the environment with [`GroupBuilder::from_env`].
///
/// ```no_run
/// use std::time::Duration;
/// # fn main() -> distcomm::Result<()> {
/// let group = distcomm::GroupBuilder::new(0, 2)
///     .store_addr("127.0.0.1:29500")
///     .timeout(Duration::from_secs(60))
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GroupBuilder {
    rank: usize,
    world: usize,
    local_world: Option<usize>,
    store_addr: String,
    host_store: Option<bool>,
    timeout: Option<Duration>,
    secret: Option<Vec<u8>>,
    transport: Option<TransportKind>,
    store_auth: Option<bool>,
    backend: Option<Backend>,
    store: Option<GivenStore>,
}

/// A store handed to [`GroupBuilder::store`] (printed without its contents).
#[derive(Clone)]
struct GivenStore(Arc<dyn Store>);

impl std::fmt::Debug for GivenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<store>")
    }
}

pub use crate::config::Backend;

impl GroupBuilder {
    /// A group where this process is `rank` of `world`. The store defaults to
    /// `127.0.0.1:29500`, hosted by rank 0.
    pub fn new(rank: usize, world: usize) -> Self {
        GroupBuilder {
            rank,
            world,
            local_world: None,
            store_addr: format!("127.0.0.1:{}", crate::env::DEFAULT_MASTER_PORT),
            host_store: None,
            timeout: None,
            secret: None,
            transport: None,
            store_auth: None,
            backend: None,
            store: None,
        }
    }

    /// Everything from the launcher's environment (see [`JobEnv::from_env`]).
    pub fn from_env() -> Result<Self> {
        let job = JobEnv::from_env()?;
        let mut b = GroupBuilder::new(job.rank, job.world)
            .store_addr(&format_host_port(&job.master_addr, job.master_port));
        b.local_world = Some(job.local_world);
        if job.agent_store {
            b = b.host_store(false);
        }
        Ok(b)
    }

    /// The rendezvous store's `host:port`.
    pub fn store_addr(mut self, addr: &str) -> Self {
        self.store_addr = addr.to_string();
        self
    }

    /// Whether this rank hosts the store (default: rank 0 does).
    pub fn host_store(mut self, host: bool) -> Self {
        self.host_store = Some(host);
        self
    }

    /// Default deadline of every blocking call and of `Work::wait`.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = Some(t);
        self
    }

    /// The job secret every transport connection must prove (default: `DISTCOMM_SECRET`, which
    /// `distcomm launch` generates). Every rank needs the same one.
    pub fn secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// How ranks on this host talk (default: `DISTCOMM_TRANSPORT`, else
    /// [`TransportKind::Auto`]: shared memory towards ranks on this host where the platform
    /// has it, TCP towards the others).
    pub fn transport(mut self, kind: TransportKind) -> Self {
        self.transport = Some(kind);
        self
    }

    /// Whether the rendezvous store runs in its authenticated mode (default:
    /// `DISTCOMM_STORE_AUTH=1`): every store connection proves the job secret first. Needs a
    /// secret, and a store that is distcomm's (hosted by rank 0 or by `distcomm launch`):
    /// PyTorch's store and clients cannot authenticate.
    pub fn store_auth(mut self, on: bool) -> Self {
        self.store_auth = Some(on);
        self
    }

    /// Rendezvous through `store` instead of a TCP store at [`store_addr`](Self::store_addr):
    /// the store a caller already has (torch hands its backends one: a `PrefixStore` over
    /// torchrun's TCPStore, a `FileStore`, a `HashStore`). No store is hosted and no store port
    /// is opened; every rank of the job must pass a store over the same data. The address this
    /// rank advertises to its peers is `DISTCOMM_HOST`, else the interface that routes to
    /// `MASTER_ADDR`, else loopback (right when every rank is on this host).
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use distcomm::rendezvous::TcpStore;
    /// let store = Arc::new(TcpStore::connect("127.0.0.1:29500", Duration::from_secs(30))?);
    /// let group = distcomm::GroupBuilder::new(1, 2).store(store).build()?;
    /// # Ok(()) }
    /// ```
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(GivenStore(store));
        self
    }

    /// Ranks on this host (decides whether waiters may spin). Defaults to the world size.
    pub fn local_world(mut self, n: usize) -> Self {
        self.local_world = Some(n);
        self
    }

    /// Rendezvous, connect the mesh, and return the group.
    /// The backend (default: `DISTCOMM_BACKEND`, else native). With [`Backend::Mpi`] the
    /// store, secret and transport settings do not apply: MPI connects the ranks, and `rank`
    /// and `world` must agree with MPI's own view (a [`Error::Config`] otherwise).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    pub fn build(self) -> Result<ProcessGroup> {
        crate::diag::install_default()?;
        self.build_with(Config::from_env()?)
    }

    /// [`build`](Self::build) with the environment's settings already read.
    fn build_with(self, env: Config) -> Result<ProcessGroup> {
        if self.world == 0 || self.rank >= self.world {
            return Err(Error::Config(format!(
                "rank {} is not inside a world of {}",
                self.rank, self.world
            )));
        }
        let timeout = match self.timeout {
            Some(t) => t,
            None => env.timeout.unwrap_or(DEFAULT_TIMEOUT),
        };
        let backend = self.backend.or(env.backend).unwrap_or(Backend::Native);
        if backend == Backend::Mpi {
            return mpi_world(self.rank, self.world, timeout, env);
        }
        let host = match &self.store {
            None => split_host_port(&self.store_addr)?.0,
            Some(_) => std::env::var("MASTER_ADDR")
                .ok()
                .filter(|h| !h.trim().is_empty())
                .unwrap_or_else(|| "127.0.0.1".into()),
        };
        let secret = match &self.secret {
            Some(s) => Some(s.clone()),
            None => env.secret.clone(),
        };
        let store_auth = self.store_auth.unwrap_or(env.store_auth);
        let store_secret = match (store_auth, &secret) {
            (false, _) => None,
            (true, Some(s)) => Some(s.as_slice()),
            (true, None) => {
                return Err(Error::Config(
                    "DISTCOMM_STORE_AUTH=1 needs a job secret (DISTCOMM_SECRET)".into(),
                ))
            }
        };
        let server = if self.store.is_some() {
            None
        } else if self.host_store.unwrap_or(self.rank == 0) {
            let ip = advertise_ip_or(&host, env.host)?;
            let bind_host = if ip.is_loopback() {
                "127.0.0.1"
            } else {
                "0.0.0.0"
            };
            let (_, port) = split_host_port(&self.store_addr)?;
            let bind = format!("{bind_host}:{port}");
            Some(match store_secret {
                Some(s) => TcpStoreServer::bind_authenticated(&bind, s)?,
                None => TcpStoreServer::bind(&bind)?,
            })
        } else {
            None
        };
        let client: Arc<dyn Store> = match &self.store {
            Some(given) => given.0.clone(),
            None => {
                let client: Arc<dyn Store> = Arc::new(match store_secret {
                    Some(s) => TcpStore::connect_authenticated(&self.store_addr, timeout, s)?,
                    None => TcpStore::connect(&self.store_addr, timeout)?,
                });
                // torch's worker count: lets a torch-style host see everyone join.
                client.add("init/", 1)?;
                client
            }
        };
        let store = PrefixStore::new("distcomm", client);
        let ip: IpAddr = advertise_ip_or(&host, env.host)?;
        let streams = connect_mesh(
            &store,
            self.rank,
            self.world,
            ip,
            timeout,
            secret.as_deref(),
        )?;
        let shm = ShmConfig {
            kind: self.transport.unwrap_or(env.transport),
            ring: env.shm_ring.unwrap_or(DEFAULT_RING),
            cma: env.shm_cma,
        };
        let deadline = std::time::Instant::now() + timeout;
        let links = setup_shm(&streams, self.rank, &shm, deadline)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let local = self.local_world.unwrap_or(self.world);
        let oversubscribed = local > cores;
        let spin = match env.spin {
            Some(spin) => spin,
            None if !oversubscribed => Duration::from_millis(2),
            None => OVERSUBSCRIBED_SPIN,
        };
        let cfg = EngineConfig {
            eager_max: env.eager_max.unwrap_or(64 * 1024),
            shm_eager_max: env.shm_eager_max.unwrap_or(16 * 1024),
            spin,
            yield_spin: oversubscribed,
            sockbuf: env.sockbuf,
            data_chunk: env.data_chunk.map(|b| b.max(1)),
            cancel_error: crate::collectives::cancelled_error,
        };
        let all_shm = links
            .iter()
            .enumerate()
            .all(|(p, l)| p == self.rank || l.is_some());
        let engine = Engine::start(self.rank, streams, links, cfg)?;
        let members: Arc<Vec<usize>> = Arc::new((0..self.world).collect());
        let arena_cfg = ArenaConfig {
            enabled: env.shm_allreduce,
            chunk: env
                .shm_arena_chunk
                .map_or(intranode::DEFAULT_CHUNK, |b| b.clamp(4096, 1 << 30))
                .next_multiple_of(64),
            oversubscribed,
            // Measured faster than the network algorithms at every size up to 64 MiB here
            // (see the README); `DISTCOMM_SHM_ALLREDUCE_MAX` caps it.
            max_bytes: env.shm_allreduce_max.unwrap_or(usize::MAX),
        };
        let arena = intranode::establish(&store, self.rank, members.clone(), all_shm, &arena_cfg)?;
        let ready = crate::diag::Ready {
            store: self.store_addr.clone(),
            hosts_store: server.is_some(),
            secret: secret.is_some(),
            store_auth,
            arena: crate::diag::Ready::arena_state(
                arena.is_some(),
                arena_cfg.enabled,
                all_shm,
                self.world,
            ),
            spin,
            oversubscribed,
        };
        let keep = Keep {
            store: Some(store),
            _server: server,
            subgroups: Default::default(),
        };
        let group = ProcessGroup {
            inner: Arc::new(Inner::world(
                engine, members, self.rank, timeout, keep, arena, None, env,
            )),
        };
        // Nobody leaves init (and a hosting rank cannot drop the store) before all are connected.
        group.barrier()?;
        ready.log(&group);
        Ok(group)
    }
}

fn format_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn split_host_port(addr: &str) -> Result<(String, u16)> {
    let (h, p) = addr
        .rsplit_once(':')
        .ok_or_else(|| Error::Config(format!("store address {addr:?} is not host:port")))?;
    let port = p
        .parse()
        .map_err(|_| Error::Config(format!("store address {addr:?} has a bad port")))?;
    Ok((
        h.trim_start_matches('[').trim_end_matches(']').to_string(),
        port,
    ))
}

/// Initialises the world group from the launcher's environment (torchrun, `distcomm launch`,
/// mpirun, srun).
///
/// ```no_run
/// # fn main() -> distcomm::Result<()> {
/// let group = distcomm::init()?;
/// println!("rank {} of {}", group.rank(), group.size());
/// # Ok(()) }
/// ```
pub fn init() -> Result<ProcessGroup> {
    crate::diag::install_default()?;
    let env = Config::from_env()?;
    if env.backend == Some(Backend::Mpi) {
        // MPI connects the ranks: no store address is needed, and the launcher's variables
        // only have to agree with MPI's view when they are there.
        let (rank, world) = match crate::env::JobEnv::from_env() {
            Ok(job) => (job.rank, job.world),
            Err(_) => crate::mpi::world_size()?,
        };
        let timeout = env.timeout.unwrap_or(DEFAULT_TIMEOUT);
        return mpi_world(rank, world, timeout, env);
    }
    GroupBuilder::from_env()?.build_with(env)
}

/// The world group on the MPI backend.
fn mpi_world(rank: usize, world: usize, timeout: Duration, env: Config) -> Result<ProcessGroup> {
    let comm = crate::mpi::world(rank, world)?;
    // An engine without peers: the MPI backend's handles have their own driver, but a group
    // always has an engine to abort and to ask about links.
    let streams = (0..world).map(|_| None).collect();
    let links = (0..world).map(|_| None).collect();
    let cfg = EngineConfig {
        eager_max: 0,
        shm_eager_max: 0,
        spin: Duration::ZERO,
        yield_spin: true,
        sockbuf: None,
        data_chunk: None,
        cancel_error: crate::collectives::cancelled_error,
    };
    let engine = Engine::start(rank, streams, links, cfg)?;
    let members = Arc::new((0..world).collect());
    let keep = Keep {
        store: None,
        _server: None,
        subgroups: Default::default(),
    };
    let mpi = Some(Arc::new(comm));
    tracing::info!(target: "distcomm::init", rank, world, host = %crate::diag::host_name(),
        pid = std::process::id(), backend = "mpi", "rank {rank} of {world} ready");
    Ok(ProcessGroup {
        inner: Arc::new(Inner::world(
            engine, members, rank, timeout, keep, None, mpi, env,
        )),
    })
}

/// A group of ranks that can exchange messages: the world from [`init`], or a subgroup from
/// [`ProcessGroup::new_group`]. Ranks in its API are ranks *within the group*; errors name
/// global ranks.
///
/// Buffers are passed by ownership to the nonblocking calls and handed back by
/// [`Work::into_buffer`]; the blocking calls borrow slices and copy.
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
    pub(crate) engine: Arc<Engine>,
    /// Group rank -> global rank.
    pub(crate) members: Arc<Vec<usize>>,
    /// This process's rank in the group.
    pub(crate) rank: usize,
    /// Base of the group's four communication contexts (user p2p, barrier, collectives).
    pub(crate) ctx: u32,
    pub(crate) timeout: Duration,
    /// Sequence number of the next collective: its tag.
    pub(crate) coll_seq: Arc<AtomicU32>,
    /// The shared-memory arena of intra-node all_reduce (world group, all ranks on one host).
    pub(crate) arena: Option<Arc<Arena>>,
    /// Job-wide count of subgroups created, to give each its own contexts.
    groups: Arc<AtomicU32>,
    /// Runs this group's asynchronous collectives in issue order.
    pub(crate) worker: Arc<Mutex<Option<mpsc::Sender<Job>>>>,
    /// Async collectives queued or running on `worker` (the MPI backend starts a blocking
    /// collective only once they have all run, to keep MPI's order the issue order).
    pub(crate) queued: Arc<std::sync::atomic::AtomicUsize>,
    /// Scratch buffers of collectives, reused so that large ones are not faulted in anew.
    pub(crate) pool: Arc<crate::collectives::Pool>,
    /// Opt-in per-op statistics.
    pub(crate) log: Arc<crate::commslog::CommsLog>,
    /// The environment's settings, read when the world group was built (subgroups share them).
    pub(crate) config: Arc<Config>,
    keep: Arc<Keep>,
    /// The group's MPI communicators when it runs on the MPI backend (then `engine` has no
    /// peers and carries nothing).
    pub(crate) mpi: Option<Arc<crate::mpi::Comm>>,
}

pub(crate) const CTX_USER: u32 = 0;
pub(crate) const CTX_BARRIER: u32 = 1;
pub(crate) const CTX_COLL: u32 = 2;
pub(crate) const CTX_PIPE: u32 = 3;
/// Contexts each group owns (user, barrier, collectives, pipeline): a group's contexts start at its
/// number times this.
pub(crate) const CTX_PER_GROUP: u32 = 4;

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
    /// A world group's state: contexts from 0, and its own collective sequence, thread, pool,
    /// log and count of subgroups.
    // One parameter per part of a world group (the backend step folds engine, arena and mpi
    // into one).
    #[allow(clippy::too_many_arguments)]
    fn world(
        engine: Arc<Engine>,
        members: Arc<Vec<usize>>,
        rank: usize,
        timeout: Duration,
        keep: Keep,
        arena: Option<Arc<Arena>>,
        mpi: Option<Arc<crate::mpi::Comm>>,
        config: Config,
    ) -> Inner {
        Inner {
            engine,
            members,
            rank,
            ctx: 0,
            timeout,
            coll_seq: Default::default(),
            arena,
            groups: Arc::new(AtomicU32::new(0)),
            worker: Default::default(),
            queued: Default::default(),
            pool: Default::default(),
            log: Arc::new(crate::commslog::CommsLog::new(config.comms_log)),
            config: Arc::new(config),
            keep: Arc::new(keep),
            mpi,
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    pub(crate) fn global(&self, op: &'static str, peer: usize) -> Result<usize> {
        self.members.get(peer).copied().ok_or(Error::InvalidRank {
            op,
            rank: self.rank,
            peer,
            world: self.members.len(),
        })
    }

    fn map(&self) -> Option<Arc<Vec<usize>>> {
        (self.ctx != 0).then(|| self.members.clone())
    }

    pub(crate) fn driver(&self) -> Arc<dyn Driver> {
        self.engine.clone()
    }

    /// `env` with its context made absolute (it is relative to the group's contexts).
    fn scoped(&self, env: Envelope) -> Envelope {
        Envelope {
            ctx: self.ctx + env.ctx,
            ..env
        }
    }

    /// Posts a send to group rank `dst`; `env.ctx` is relative to the group's contexts.
    pub(crate) fn post_send<B: 'static>(
        &self,
        env: Envelope,
        buf: BoxBuf,
        dst: usize,
    ) -> Result<Work<B>> {
        let g = self.global(env.op, dst)?;
        if let Some(m) = &self.mpi {
            return m.isend(env, buf, dst, self.timeout);
        }
        let env = self.scoped(env);
        let (id, cell) = self.engine.isend(env, buf, g);
        Ok(
            Work::new(cell, self.driver(), id, env.op, Some(dst), self.timeout)
                .with_map(self.map())
                .detach_on_drop(),
        )
    }

    /// A blocking send to group rank `dst` on the shared-memory lane's fast path
    /// ([`Engine::send_small`]); `None` when it does not apply (then nothing was sent).
    pub(crate) fn send_small(
        &self,
        env: Envelope,
        data: &[u8],
        dst: usize,
        timeout: Duration,
    ) -> Option<Result<()>> {
        if self.mpi.is_some() {
            return None;
        }
        let g = self.global(env.op, dst).ok()?;
        let env = self.scoped(env);
        match self.engine.send_small(env, data, g) {
            Fast::Declined => None,
            Fast::Done(r) => Some(r.map(|_| ())),
            Fast::Handed(id, cell) => {
                let w: Work<()> =
                    Work::new(cell, self.driver(), id, env.op, Some(dst), self.timeout)
                        .detach_on_drop();
                Some(w.wait_timeout(timeout).map(|_| ()))
            }
        }
    }

    /// A blocking receive from group rank `src` on the shared-memory lane's fast path
    /// ([`Engine::recv_small`]); `None` when it does not apply (then nothing was received).
    pub(crate) fn recv_small(
        &self,
        env: Envelope,
        out: &mut [u8],
        src: usize,
    ) -> Option<Result<Status>> {
        if self.mpi.is_some() {
            return None;
        }
        let g = self.global(env.op, src).ok()?;
        let r = self.engine.recv_small(self.scoped(env), out, g)?;
        Some(r.map(|st| Status { peer: src, ..st }))
    }

    /// Posts a receive from group rank `src` (`None`: any source, world group only).
    pub(crate) fn post_recv<B: 'static>(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
    ) -> Result<Work<B>> {
        let op = env.op;
        let g = match src {
            Some(s) => Some(self.global(op, s)?),
            None if self.ctx == 0 => None,
            None => {
                return Err(Error::InvalidArgument {
                    op,
                    rank: self.rank,
                    detail: "receive from any source is only supported on the world group".into(),
                })
            }
        };
        if let Some(m) = &self.mpi {
            return m.irecv(env, buf, src, self.timeout);
        }
        let env = self.scoped(env);
        let (id, cell) = self.engine.irecv(env, buf, g);
        Ok(Work::new(cell, self.driver(), id, op, src, self.timeout).with_map(self.map()))
    }
}

impl ProcessGroup {
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
        if self.inner.mpi.is_some() {
            return "mpi";
        }
        let me = self.inner.rank;
        let kinds = self
            .inner
            .members
            .iter()
            .filter(|&&m| m != me)
            .map(|&m| self.inner.engine.link_kind(m));
        let (mut shm, mut tcp) = (false, false);
        for k in kinds {
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
        if self.inner.mpi.is_some() {
            return crate::mpi::addresses(mem);
        }
        let me = self.inner.rank;
        let engine = &self.inner.engine;
        let mut links = self.inner.members.iter().filter(|&&m| m != me);
        LinkKind::Loopback.addresses(mem) && links.all(|&m| engine.link_kind(m).addresses(mem))
    }

    /// Whether `all_reduce` on this group runs through the shared-memory arena (every rank of
    /// the world group on one host, over shared memory; see `DISTCOMM_SHM_ALLREDUCE`). A failed
    /// arena call turns it off for the rest of the group's life.
    pub fn intranode_all_reduce(&self) -> bool {
        self.inner.arena.as_ref().is_some_and(|a| a.usable())
    }

    /// The transport towards group rank `peer` (`"shm"`, `"tcp"` or `"self"`), or `None` if
    /// there is no such rank.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        let g = *self.inner.members.get(peer)?;
        if self.inner.mpi.is_some() {
            return Some("mpi");
        }
        Some(self.inner.engine.link_kind(g).name())
    }

    /// When ranks outnumber cores, waiters spin this briefly, yielding the core on every turn, and
    /// then sleep: a short yielding spin catches a reply from a rank that is running now without
    /// keeping anyone from the core (see the README for the measurements behind it).
    pub const OVERSUBSCRIBED_SPIN: Duration = Duration::from_micros(200);

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
        // On MPI, the split is collective over this group: members and others take part.
        let mpi = match &self.inner.mpi {
            Some(m) => m.split(me)?.map(Arc::new),
            None => None,
        };
        let Some(me) = me else {
            return Ok(None);
        };
        let members: Vec<usize> = ranks.iter().map(|&r| self.inner.members[r]).collect();
        self.child("new_group", members, me, u64::from(id), mpi)
            .map(Some)
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
        self.child("subgroup", members, me, SUBGROUP_BASE + id, None)
    }

    /// A group of `members` (global ranks) over this group's engine, numbered `id` among the
    /// job's groups (its contexts start at `id × 4`).
    fn child(
        &self,
        op: &'static str,
        members: Vec<usize>,
        me: usize,
        id: u64,
        mpi: Option<Arc<crate::mpi::Comm>>,
    ) -> Result<ProcessGroup> {
        let ctx = id
            .checked_mul(u64::from(CTX_PER_GROUP))
            .and_then(|c| u32::try_from(c).ok())
            .ok_or_else(|| Error::InvalidArgument {
                op,
                rank: self.rank(),
                detail: "too many groups".into(),
            })?;
        Ok(ProcessGroup {
            inner: Arc::new(Inner {
                engine: self.inner.engine.clone(),
                members: Arc::new(members),
                rank: me,
                ctx,
                timeout: self.inner.timeout,
                coll_seq: Default::default(),
                arena: None,
                groups: self.inner.groups.clone(),
                worker: Default::default(),
                queued: Default::default(),
                pool: Default::default(),
                log: Arc::new(crate::commslog::CommsLog::new(self.inner.config.comms_log)),
                config: self.inner.config.clone(),
                keep: self.inner.keep.clone(),
                mpi,
            }),
        })
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

    /// A user point-to-point send: checks the tag, no fingerprint.
    fn user_send<B: 'static>(
        &self,
        op: &'static str,
        buf: BoxBuf,
        dtype: DType,
        dst: usize,
        tag: u32,
    ) -> Result<Work<B>> {
        self.check_tag(op, tag)?;
        self.inner.post_send(user(op, dtype, tag), buf, dst)
    }

    /// A user point-to-point receive (`src` `None`: any source).
    fn user_recv<B: 'static>(
        &self,
        op: &'static str,
        buf: BoxBuf,
        dtype: DType,
        src: Option<usize>,
        tag: u32,
    ) -> Result<Work<B>> {
        self.check_tag(op, tag)?;
        self.inner.post_recv(user(op, dtype, tag), buf, src)
    }

    /// Starts sending `buf` to `dst`; returns at once. The buffer comes back from
    /// [`Work::into_buffer`] when the receiver has taken the message.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// # let group = distcomm::init()?;
    /// let work = group.isend(vec![1.0f32, 2.0], 1, 0)?;
    /// let buf: Vec<f32> = work.into_buffer()?;
    /// # Ok(()) }
    /// ```
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.user_send("isend", Box::new(buf), T::DTYPE, dst, tag)
    }

    /// Starts receiving into `buf` from `src`; returns at once. A message longer than `buf` fails
    /// both sides with [`Error::MessageTooLarge`]; a shorter one fills a prefix (the status says
    /// how many bytes).
    pub fn irecv<T: Element>(&self, buf: Vec<T>, src: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.user_recv("irecv", Box::new(buf), T::DTYPE, Some(src), tag)
    }

    /// Like [`irecv`](Self::irecv) from whichever rank sends first with `tag`; the status names
    /// the source. World group only.
    pub fn irecv_any<T: Element>(&self, buf: Vec<T>, tag: u32) -> Result<Work<Vec<T>>> {
        self.user_recv("irecv", Box::new(buf), T::DTYPE, None, tag)
    }

    /// Starts sending memory lent by another runtime (a torch tensor, say) as elements of
    /// `dtype`; the operation holds `buf` until it is terminal. See [`isend`](Self::isend).
    pub fn isend_lent(
        &self,
        buf: crate::Lent,
        dtype: DType,
        dst: usize,
        tag: u32,
    ) -> Result<Work<crate::Lent>> {
        self.check_lent("isend", &buf, dtype)?;
        self.user_send("isend", Box::new(buf), dtype, dst, tag)
    }

    /// Starts receiving into lent memory from `src` (`None`: any source, world group only);
    /// [`DType::Bytes`] accepts a message of any element type. See [`irecv`](Self::irecv).
    pub fn irecv_lent(
        &self,
        buf: crate::Lent,
        dtype: DType,
        src: Option<usize>,
        tag: u32,
    ) -> Result<Work<crate::Lent>> {
        self.check_lent("irecv", &buf, dtype)?;
        self.user_recv("irecv", Box::new(buf), dtype, src, tag)
    }

    fn check_lent(&self, op: &'static str, buf: &crate::Lent, dtype: DType) -> Result<()> {
        if buf.len() % dtype.size() != 0 {
            return Err(Error::InvalidArgument {
                op,
                rank: self.rank(),
                detail: format!(
                    "{} bytes are not a whole number of {dtype} elements",
                    buf.len()
                ),
            });
        }
        Ok(())
    }

    /// Sends raw bytes (element type `bytes`).
    pub fn isend_bytes(&self, buf: Vec<u8>, dst: usize, tag: u32) -> Result<Work<Vec<u8>>> {
        self.user_send("isend", Box::new(buf), DType::Bytes, dst, tag)
    }

    /// Receives raw bytes; accepts a message of any element type.
    pub fn irecv_bytes(&self, buf: Vec<u8>, src: usize, tag: u32) -> Result<Work<Vec<u8>>> {
        self.user_recv("irecv", Box::new(buf), DType::Bytes, Some(src), tag)
    }

    /// Blocking send of a slice (copied once into an owned buffer; use [`isend`](Self::isend)
    /// to avoid the copy). Bounded by the group's timeout.
    pub fn send<T: Element>(&self, data: &[T], dst: usize, tag: u32) -> Result<()> {
        self.send_timeout(data, dst, tag, self.timeout())
    }

    /// [`send`](Self::send) with its own deadline. On timeout the message is not withdrawn: it
    /// is delivered if the receiver still takes it.
    pub fn send_timeout<T: Element>(
        &self,
        data: &[T],
        dst: usize,
        tag: u32,
        timeout: Duration,
    ) -> Result<()> {
        self.check_tag("send", tag)?;
        let env = user("send", T::DTYPE, tag);
        if let Some(r) = self
            .inner
            .send_small(env, bytemuck::cast_slice(data), dst, timeout)
        {
            return r;
        }
        let w: Work<Vec<T>> = self.inner.post_send(env, Box::new(data.to_vec()), dst)?;
        w.wait_timeout(timeout).map(|_| ())
    }

    /// Blocking receive into a slice; returns the source and byte count. Bounded by the group's
    /// timeout.
    pub fn recv<T: Element>(&self, out: &mut [T], src: usize, tag: u32) -> Result<Status> {
        self.recv_timeout(out, src, tag, self.timeout())
    }

    /// [`recv`](Self::recv) with its own deadline. On timeout the receive is withdrawn (a
    /// message that had already begun to arrive is taken and discarded) and `out` is untouched.
    pub fn recv_timeout<T: Element>(
        &self,
        out: &mut [T],
        src: usize,
        tag: u32,
        timeout: Duration,
    ) -> Result<Status> {
        self.check_tag("recv", tag)?;
        let env = user("recv", T::DTYPE, tag);
        if let Some(r) = self
            .inner
            .recv_small(env, bytemuck::cast_slice_mut(out), src)
        {
            return r;
        }
        let buf = vec![T::zeroed(); out.len()];
        let w = self.inner.post_recv(env, Box::new(buf), Some(src))?;
        finish_recv(w, out, timeout)
    }

    /// Blocking receive from any source (world group only).
    pub fn recv_any<T: Element>(&self, out: &mut [T], tag: u32) -> Result<Status> {
        let buf = vec![T::zeroed(); out.len()];
        let w = self.user_recv("recv", Box::new(buf), T::DTYPE, None, tag)?;
        finish_recv(w, out, self.timeout())
    }

    /// Blocks until every rank of the group has entered the barrier (dissemination algorithm,
    /// ⌈log₂ n⌉ rounds of zero-byte messages).
    pub fn barrier(&self) -> Result<()> {
        if let Some(m) = &self.inner.mpi {
            return m.barrier(self.timeout());
        }
        let n = self.size();
        let me = self.rank();
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
                self.inner
                    .post_recv(env, Box::new(Vec::<u8>::new()), Some(from))?;
            let s: Work<Vec<u8>> = self.inner.post_send(env, Box::new(Vec::<u8>::new()), to)?;
            r.wait()?;
            s.wait()?;
            dist *= 2;
            round += 1;
        }
        Ok(())
    }

    /// Fails every pending operation of this process (all groups) promptly with
    /// [`Error::Aborted`]; later operations fail at once.
    pub fn abort(&self) {
        if let Some(m) = &self.inner.mpi {
            m.abort("aborted by the user");
        }
        self.inner.engine.abort("aborted by the user");
    }

    /// Why the connection to group rank `peer` failed, if it has.
    pub fn peer_failure(&self, peer: usize) -> Option<String> {
        let g = self.global_rank(peer)?;
        self.inner.engine.peer_failure(g)
    }
}

/// The envelope of a user point-to-point message.
fn user(op: &'static str, dtype: DType, tag: u32) -> Envelope {
    Envelope {
        op,
        dtype,
        ctx: CTX_USER,
        tag,
        fp: Fingerprint::NONE,
    }
}

fn finish_recv<T: Element>(w: Work<Vec<T>>, out: &mut [T], timeout: Duration) -> Result<Status> {
    let status = w.wait_timeout(timeout)?;
    let buf = w.into_buffer()?;
    let n = status.bytes / std::mem::size_of::<T>().max(1);
    out[..n].copy_from_slice(&buf[..n]);
    Ok(status)
}
