//! Connecting the world group's native backend: the mesh through the rendezvous store,
//! shared-memory links where the peer shares the host, the engine and the arena; and the arena
//! of a subgroup, set up at its first collective.
//!
//! Owns: the order of set-up and the engine's tuning. Must not know: the store's server or the
//! API.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::arena::{self, Arena, ArenaConfig};
use super::NativeBackend;
use crate::config::{Config, OVERSUBSCRIBED_SPIN};
use crate::error::{Error, Result};
use crate::rendezvous::{PrefixStore, Store};
use crate::transport::tcp::{Engine, EngineConfig};
use crate::transport::LinkKind;
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
            shm_eager_max: env.shm_eager_max.unwrap_or(32 * 1024),
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
            shared_caches: env.shm_shared_caches,
            stream: env.shm_stream,
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
        // Subgroups set up arenas of their own where their members share a host (in a job
        // over several hosts too): only where arenas exist and are not turned off.
        let recipe = (cfg!(target_os = "linux") && arena_cfg.enabled).then(|| {
            Arc::new(ArenaRecipe {
                store: store.clone(),
                cfg: arena_cfg,
            })
        });
        let backend = NativeBackend::world(engine, members, rank, (arena, recipe), config.clone());
        Ok((backend, state))
    }
}

/// What a subgroup's arena is set up with: the world's store and arena settings.
pub(crate) struct ArenaRecipe {
    store: PrefixStore,
    cfg: ArenaConfig,
}

/// Sets up the arena of subgroup `b` at its first collective `op`: every member says it is
/// there and waits for the others (naming a member that died or never came, within `timeout`),
/// then all agree through the store as the world did at init. `None` when some member has a
/// link to another that is not shared memory.
pub(super) fn subgroup_arena(
    b: &NativeBackend,
    recipe: &ArenaRecipe,
    op: &'static str,
    timeout: Duration,
) -> Result<Option<Arc<Arena>>> {
    let store = PrefixStore::new(&format!("group{}", b.ctx), Arc::new(recipe.store.clone()));
    await_members(b, &store, op, timeout)?;
    let me = b.members[b.rank];
    let all_shm = b
        .members
        .iter()
        .all(|&m| m == me || b.engine.link_kind(m) == LinkKind::Shm);
    let made = arena::establish(&store, b.rank, b.members.clone(), all_shm, &recipe.cfg)?;
    tracing::info!(
        target: "distcomm::init",
        rank = me,
        members = ?b.members,
        arena = made.is_some(),
        "subgroup set up {}",
        if made.is_some() { "its shared-memory arena" } else { "without an arena" }
    );
    Ok(made)
}

/// Marks this member present in `store` and waits until every member is, so that the set-up
/// that follows cannot wait on a member that is gone: a missing member found lost is named at
/// once (one that came and left since is not: what it left here still counts), one that never
/// comes when `timeout` has passed.
fn await_members(
    b: &NativeBackend,
    store: &PrefixStore,
    op: &'static str,
    timeout: Duration,
) -> Result<()> {
    let keys: Vec<String> = (0..b.size()).map(|r| format!("here/{r}")).collect();
    store.set(&keys[b.rank], b"1")?;
    let mut missing: Vec<usize> = (0..b.size()).filter(|&r| r != b.rank).collect();
    let start = Instant::now();
    let mut nap = Duration::from_micros(50);
    loop {
        let mut still = Vec::with_capacity(missing.len());
        for r in missing {
            if !store.check(&[&keys[r]])? {
                still.push(r);
            }
        }
        missing = still;
        let Some(&first) = missing.first() else {
            return Ok(());
        };
        for &r in &missing {
            if let Some(reason) = b.engine.peer_failure(b.members[r]) {
                // A member marks itself before it can leave, and its leaving comes before our
                // engine's notice of it: one that came (and left) since our look at the store
                // is present, not lost (the next pass drops it).
                if store.check(&[&keys[r]])? {
                    continue;
                }
                return Err(Error::PeerLost {
                    op,
                    rank: b.rank,
                    peer: r,
                    reason,
                });
            }
        }
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                op,
                rank: b.rank,
                peer: Some(first),
                after: timeout,
            });
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(5));
    }
}
