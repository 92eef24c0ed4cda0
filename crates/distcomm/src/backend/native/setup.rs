//! Connecting the world group's native backend: the mesh through the rendezvous store,
//! shared-memory links where the peer shares the host, the engine and the arena.
//!
//! Owns: the order of set-up and the engine's tuning. Must not know: the store's server or the
//! API.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use super::arena::{self, ArenaConfig};
use super::NativeBackend;
use crate::config::{Config, OVERSUBSCRIBED_SPIN};
use crate::error::Result;
use crate::rendezvous::PrefixStore;
use crate::transport::tcp::{Engine, EngineConfig};
use crate::transport::{connect_mesh, setup_shm, ShmConfig, TransportKind, DEFAULT_RING};

/// What the world's native backend is connected with.
pub(crate) struct Native<'a> {
    pub rank: usize,
    pub world: usize,
    /// Ranks on this host (more than cores: waiters back off from spinning).
    pub local_world: usize,
    /// The address this rank advertises.
    pub ip: IpAddr,
    pub timeout: Duration,
    pub secret: Option<&'a [u8]>,
    pub transport: TransportKind,
}

/// How the backend came up, for the INFO line of `crate::diag`.
pub(crate) struct State {
    pub arena: std::result::Result<(), &'static str>,
    pub spin: Duration,
    pub oversubscribed: bool,
}

impl Native<'_> {
    /// Connects every rank through `store` (every rank of the world calls it).
    pub(crate) fn connect(
        &self,
        store: &PrefixStore,
        config: Arc<Config>,
    ) -> Result<(NativeBackend, State)> {
        let env = &*config;
        let (rank, world, timeout) = (self.rank, self.world, self.timeout);
        let streams = connect_mesh(store, rank, world, self.ip, timeout, self.secret)?;
        let shm = ShmConfig {
            kind: self.transport,
            ring: env.shm_ring.unwrap_or(DEFAULT_RING),
            cma: env.shm_cma,
        };
        let deadline = std::time::Instant::now() + timeout;
        let links = setup_shm(&streams, rank, &shm, deadline)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let oversubscribed = self.local_world > cores;
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
            cancel_error: super::cancelled_error,
        };
        let all_shm = links
            .iter()
            .enumerate()
            .all(|(p, l)| p == rank || l.is_some());
        let engine = Engine::start(rank, streams, links, cfg)?;
        let members: Arc<Vec<usize>> = Arc::new((0..world).collect());
        let arena_cfg = ArenaConfig {
            enabled: env.shm_allreduce,
            chunk: env
                .shm_arena_chunk
                .map_or(arena::DEFAULT_CHUNK, |b| b.clamp(4096, 1 << 30))
                .next_multiple_of(64),
            oversubscribed,
            // Measured faster than the network algorithms at every size up to 64 MiB here
            // (see the README); `DISTCOMM_SHM_ALLREDUCE_MAX` caps it.
            max_bytes: env.shm_allreduce_max.unwrap_or(usize::MAX),
            cma: env.shm_cma,
        };
        let arena = arena::establish(store, rank, members.clone(), all_shm, &arena_cfg)?;
        let state = State {
            arena: crate::diag::Ready::arena_state(
                arena.is_some(),
                arena_cfg.enabled,
                all_shm,
                world,
            ),
            spin,
            oversubscribed,
        };
        let backend = NativeBackend::world(engine, members, rank, arena, config.clone());
        Ok((backend, state))
    }
}
