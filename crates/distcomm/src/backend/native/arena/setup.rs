//! Setting up a group's arena through the rendezvous store (the world's at init, a subgroup's
//! at its first collective, in a store namespace of its own): rank 0 creates the region
//! when every rank's links are shared memory, every rank maps it, and cross-memory copies are
//! tried between every pair (direct steps, see `direct.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::direct;
use super::{arena_len, Arena, ArenaConfig, MAGIC, OFF_DONE, OFF_MAGIC, OFF_PING, OFF_PONG};
use crate::error::Result;
use crate::transport::shm::Region;

/// Sets up a group's arena through the store, if every member says all its links to the others
/// are shared memory. All ranks agree on the outcome (rank 0 decides and announces it).
pub(crate) fn establish(
    store: &dyn crate::rendezvous::Store,
    me: usize,
    members: Arc<Vec<usize>>,
    all_shm: bool,
    cfg: &ArenaConfig,
) -> Result<Option<Arc<Arena>>> {
    let n = members.len();
    if n < 2 {
        return Ok(None);
    }
    let yes = |b: bool| if b { "1" } else { "0" };
    store.set(
        &format!("arena/ok/{me}"),
        yes(all_shm && cfg.enabled).as_bytes(),
    )?;
    // Cross-memory copies are tried from every rank's probe word, which lives until every
    // rank has answered (the go below).
    let probe_word = Box::new(direct::probe_value(me));
    let offer = match all_shm && cfg.enabled && cfg.cma {
        true => direct::probe_offer(&probe_word),
        false => "-".into(),
    };
    store.set(&format!("arena/cma/{me}"), offer.as_bytes())?;
    let mut mine = None;
    if me == 0 {
        let mut all = true;
        for r in 0..n {
            all &= store.get(&format!("arena/ok/{r}"))? == b"1";
        }
        let created = if all {
            Region::create(arena_len(n, cfg.chunk)).ok()
        } else {
            None
        };
        if let Some((region, _)) = &created {
            region.word(OFF_MAGIC).store(MAGIC, Ordering::Release);
        }
        let announce = match &created {
            Some((_, name)) => format!("{name} {}", cfg.chunk),
            None => "-".into(),
        };
        store.set("arena/name", announce.as_bytes())?;
        mine = created;
    }
    let announced = String::from_utf8_lossy(&store.get("arena/name")?).to_string();
    let (name, chunk) = match announced.split_once(' ') {
        Some((name, chunk)) => match chunk.parse::<usize>() {
            Ok(c) if c > 0 && c <= 1 << 30 => (name.to_string(), c),
            _ => return Ok(None),
        },
        None => return Ok(None),
    };
    let region = match mine {
        Some((region, _)) => Some(region),
        None => Region::open(&name, arena_len(n, chunk)).ok(),
    };
    let pids = direct::probe(&direct::offers(store, n)?, me);
    let answer = format!("{} {}", yes(region.is_some()), yes(pids.is_some()));
    store.set(&format!("arena/mapped/{me}"), answer.as_bytes())?;
    if me == 0 {
        let (mut all, mut direct) = (true, true);
        for r in 0..n {
            let a = store.get(&format!("arena/mapped/{r}"))?;
            all &= a.starts_with(b"1");
            direct &= a.ends_with(b" 1");
        }
        Region::unlink(&name);
        // Whether ranks outnumber cores is rank 0's word for every rank (each rank's own count
        // of its cores may differ, with pinning), as the choice of steps depends on it.
        let go = format!("{} {} {}", yes(all), yes(direct), yes(cfg.oversubscribed));
        store.set("arena/go", go.as_bytes())?;
    }
    let go = String::from_utf8_lossy(&store.get("arena/go")?).into_owned();
    drop(probe_word);
    let said: Vec<&str> = go.split(' ').collect();
    let flag = |i: usize| said.get(i) == Some(&"1");
    let (all, crowded) = (flag(0), flag(2));
    let pids = pids.filter(|_| flag(1));
    let (true, Some(region)) = (all, region) else {
        return Ok(None);
    };
    // Whether the ranks share a core's caches only matters to the direct steps, and cannot be
    // told when they outnumber the cores (a rank that waits for the core is no measure).
    let shared = if pids.is_some() && !crowded {
        shares_caches(store, &region, (me, n), cfg.shared_caches)?
    } else {
        false
    };
    let cfg = ArenaConfig {
        oversubscribed: crowded,
        ..cfg.clone()
    };
    let arena = Arena::new(region, (me, members), chunk, &cfg, (pids, shared));
    Ok(Some(Arc::new(arena)))
}

/// Round trips rank 0 makes with each other rank.
const ROUNDS: u64 = 200;
/// A cache line's round trip between two ranks takes less than this when they share a core's
/// caches (two hardware threads of one core): 100-170 ns measured here then, against 0.4-0.7 µs
/// across cores. (Two cores of a bare-metal machine that share a last-level cache may come in
/// under it too, and are then treated alike; the thresholds that follow from it were measured
/// on hardware threads of one core only. The guest's own topology is no help here: these VMs
/// show no two vCPUs as siblings whichever host threads they run on.)
const SHARED_RTT: Duration = Duration::from_nanos(250);
/// How long rank 0 tries each pair, and how long a rank answers, at most.
const PAIR_LIMIT: Duration = Duration::from_millis(5);

/// Whether every rank shares a core's caches with rank 0 (so the slots' two copies pass
/// through caches both ranks share, and beat one cross-memory copy by the kernel up to
/// megabytes: see `intranode::SHARED_CACHES_DIRECT_MIN`), measured by a cache line's round trip
/// between rank 0 and each other rank in turn. Rank 0 decides and announces it through the
/// store, so every rank agrees whatever it measured; a rank that did not answer in time makes it
/// `false` (the choice for ranks on cores of their own). `told`: the setting
/// (`DISTCOMM_SHM_SHARED_CACHES`), of which only rank 0's counts: it announces it instead of
/// measuring.
fn shares_caches(
    store: &dyn crate::rendezvous::Store,
    region: &Region,
    (me, n): (usize, usize),
    told: Option<bool>,
) -> Result<bool> {
    let (ping, pong) = (region.word(OFF_PING), region.word(OFF_PONG));
    let done = region.word(OFF_DONE);
    if me == 0 {
        let shared = told.unwrap_or_else(|| {
            (1..n).all(|r| {
                let rtt = round_trip(r as u64, ping, pong);
                tracing::debug!(rank = r, ?rtt, "arena: cache line round trip with rank 0");
                rtt.is_some_and(|rtt| rtt < SHARED_RTT)
            })
        });
        done.store(1, Ordering::Release);
        store.set("arena/caches", if shared { b"1" } else { b"0" })?;
    } else {
        answer(me as u64, ping, pong, done);
    }
    Ok(store.get("arena/caches")? == b"1")
}

/// Rank 0's side: the median of [`ROUNDS`] round trips with rank `r`, `None` when it did not
/// answer within [`PAIR_LIMIT`].
fn round_trip(r: u64, ping: &AtomicU64, pong: &AtomicU64) -> Option<Duration> {
    let until = Instant::now() + PAIR_LIMIT;
    let mut times = Vec::with_capacity(ROUNDS as usize);
    for i in 1..=ROUNDS {
        let word = r << 32 | i;
        let t = Instant::now();
        ping.store(word, Ordering::Release);
        let mut turns = 0u32;
        while pong.load(Ordering::Acquire) != word {
            turns = turns.wrapping_add(1);
            if turns % 256 == 0 && Instant::now() >= until {
                return None;
            }
            std::hint::spin_loop();
        }
        times.push(t.elapsed());
    }
    times.sort_unstable();
    times.get(times.len() / 2).copied()
}

/// Another rank's side: echoes rank 0's pings to it until rank 0 is done with every rank, or
/// for `me + 1` times [`PAIR_LIMIT`] from its arrival at most (rank 0 tries the ranks before it
/// for at most [`PAIR_LIMIT`] each; when it comes later, it decides without this rank: `false`).
fn answer(me: u64, ping: &AtomicU64, pong: &AtomicU64, done: &AtomicU64) {
    let until = Instant::now() + PAIR_LIMIT * u32::try_from(me + 1).unwrap_or(u32::MAX);
    let mut turns = 0u32;
    while done.load(Ordering::Acquire) == 0 {
        let word = ping.load(Ordering::Acquire);
        if word >> 32 == me && pong.load(Ordering::Relaxed) != word {
            pong.store(word, Ordering::Release);
        }
        turns = turns.wrapping_add(1);
        if turns % 256 == 0 && Instant::now() >= until {
            return;
        }
        std::hint::spin_loop();
    }
}
