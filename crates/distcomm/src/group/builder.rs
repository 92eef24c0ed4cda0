//! Building the world group: from explicit settings ([`GroupBuilder`]) or the launcher's
//! environment ([`init`]), through the rendezvous store to a backend.
//!
//! Owns: the rendezvous store (hosted or handed over) and the choice of backend. Must not know:
//! how a backend connects or runs operations.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use super::{Keep, ProcessGroup, DEFAULT_TIMEOUT};
use crate::backend::native::Native;
use crate::config::{BackendKind, Config};
use crate::env::JobEnv;
use crate::error::{Error, Result};
use crate::rendezvous::{PrefixStore, Store, TcpStore, TcpStoreServer};
use crate::transport::{advertise_ip_or, TransportKind};

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
    backend: Option<BackendKind>,
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
    /// The backend (default: `DISTCOMM_BACKEND`, else native). With [`BackendKind::Mpi`] the
    /// store, secret and transport settings do not apply: MPI connects the ranks, and `rank`
    /// and `world` must agree with MPI's own view (a [`Error::Config`] otherwise).
    pub fn backend(mut self, backend: BackendKind) -> Self {
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
        let backend = self.backend.or(env.backend).unwrap_or(BackendKind::Native);
        if backend == BackendKind::Mpi {
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
        let native = Native {
            rank: self.rank,
            world: self.world,
            local_world: self.local_world.unwrap_or(self.world),
            ip,
            timeout,
            secret: secret.as_deref(),
            transport: self.transport.unwrap_or(env.transport),
        };
        let config = Arc::new(env);
        let (backend, state) = native.connect(&store, config.clone())?;
        let members: Arc<Vec<usize>> = Arc::new((0..self.world).collect());
        let ready = crate::diag::Ready {
            store: self.store_addr.clone(),
            hosts_store: server.is_some(),
            secret: secret.is_some(),
            store_auth,
            arena: state.arena,
            spin: state.spin,
            oversubscribed: state.oversubscribed,
        };
        let keep = Keep {
            store: Some(store),
            _server: server,
            subgroups: Default::default(),
        };
        let group =
            ProcessGroup::world(Arc::new(backend), members, self.rank, timeout, keep, config);
        // Nobody leaves init (and a hosting rank cannot drop the store) before all are connected.
        group.barrier()?;
        if tracing::enabled!(target: "distcomm::init", tracing::Level::INFO) {
            let links: Vec<&str> = (0..group.size())
                .map(|p| group.transport_to(p).unwrap_or("?"))
                .collect();
            ready.log(group.rank(), &links, group.transport(), group.timeout());
        }
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
    if env.backend == Some(BackendKind::Mpi) {
        // MPI connects the ranks: no store address is needed, and the launcher's variables
        // only have to agree with MPI's view when they are there.
        let (rank, world) = match crate::env::JobEnv::from_env() {
            Ok(job) => (job.rank, job.world),
            Err(_) => crate::backend::mpi::world_size()?,
        };
        let timeout = env.timeout.unwrap_or(DEFAULT_TIMEOUT);
        return mpi_world(rank, world, timeout, env);
    }
    GroupBuilder::from_env()?.build_with(env)
}

/// The world group on the MPI backend.
fn mpi_world(rank: usize, world: usize, timeout: Duration, env: Config) -> Result<ProcessGroup> {
    let backend = crate::backend::mpi::MpiBackend::world(rank, world)?;
    let members = Arc::new((0..world).collect());
    let keep = Keep {
        store: None,
        _server: None,
        subgroups: Default::default(),
    };
    tracing::info!(target: "distcomm::init", rank, world, host = %crate::diag::host_name(),
        pid = std::process::id(), backend = "mpi", "rank {rank} of {world} ready");
    let config = Arc::new(env);
    Ok(ProcessGroup::world(
        Arc::new(backend),
        members,
        rank,
        timeout,
        keep,
        config,
    ))
}
