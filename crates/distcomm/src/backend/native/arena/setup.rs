//! Setting up a group's arena through the rendezvous store (the world's at init, a subgroup's
//! at its first collective, in a store namespace of its own): rank 0 creates the region
//! when every rank's links are shared memory, every rank maps it, and cross-memory copies are
//! tried between every pair (direct steps, see `direct.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::direct;
use super::{
    arena_len, data_base, Arena, ArenaConfig, Caches, MAGIC, OFF_DONE, OFF_MAGIC, OFF_PING,
    OFF_PONG,
};
use crate::error::Result;
use crate::transport::shm::cma_read;
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
    // Where the ranks run only matters to the direct steps and to streaming (see
    // `Arena::streams`), and cannot be told when they outnumber the cores (a rank that waits
    // for the core is no measure); streaming is measured there too, when ranks 0 and 1 turn out
    // to run at once.
    let probe = Probe {
        region: &region,
        at: data_base(n),
        len: PROBE_BYTES.min(chunk),
        root_pid: pids.as_ref().and_then(|p| p.first().copied()).unwrap_or(0),
    };
    let measure_caches = pids.is_some() && !crowded;
    let (caches, streams) = placement(store, &probe, (me, n), measure_caches, cfg)?;
    let cfg = ArenaConfig {
        oversubscribed: crowded,
        ..cfg.clone()
    };
    let arena = Arena::new(region, (me, members), chunk, &cfg, (pids, caches, streams));
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
/// A round trip under [`SHARED_RTT`] does not settle it: these VMs also place their two vCPUs
/// where the round trip is 90-150 ns and yet the slots' two copies lose to the kernel's one
/// (world 2, `DISTCOMM_SHM_SHARED_CACHES=1` against `=0`, 3 alternating rounds gated on that
/// round trip, µs: broadcast 256 KiB 29.9 against 15.6, 1 MiB 98 against 61; all_gather 1 MiB
/// 78 against 45; gather 1 MiB 59 against 44; scatter 1 MiB 61 against 41; all_to_all 1 MiB 78
/// against 45), while an earlier placement with the same round trip had the slots ahead up to
/// megabytes (see `intranode::SHARED_CACHES_DIRECT_MIN`). There a first read of bytes the
/// other rank has just written runs at 1.4-2.5x the time of a second one: no tell either. So
/// after the round trip, rank 0 times the two ways themselves on [`PROBE_BYTES`]: its copy
/// into a slot plus the other rank's copy out of it, against the other rank's cross-memory
/// copy of rank 0's buffer (the median of [`COPY_ROUNDS`] after one to warm up). The slots'
/// way is kept only where it is the faster.
const PROBE_BYTES: usize = 256 << 10;
/// Rounds of the copy probe per rank (the first not counted).
const COPY_ROUNDS: u64 = 4;
/// Marks a ping that asks for the copy probe (round `k` of it in the low bits).
const COPY_PING: u64 = 1 << 31;
/// With [`COPY_PING`]: the copy out of the slot only, no cross-memory copy (the streaming
/// probe).
const COPY_OUT_ONLY: u64 = 1 << 30;
/// Rank 0's line: the address of its probe buffer, next to the ping.
const OFF_PROBE_ADDR: usize = OFF_PING + 8;
/// The other rank's line: its copy-out and cross-memory copy times (ns), next to the pong.
const OFF_PROBE_OUT: usize = OFF_PONG + 8;
const OFF_PROBE_CMA: usize = OFF_PONG + 16;

/// The copy probe's place: the start of the (still unused) slots, and rank 0's process id.
struct Probe<'a> {
    region: &'a Region,
    at: usize,
    len: usize,
    root_pid: i32,
}

/// Where the ranks run relative to rank 0 (when `measure_caches`: every pair can copy across
/// processes and ranks do not outnumber cores; else apart), and whether large copies into the
/// slots stream ([`streaming`]). Where: sharing its core's caches (the slots' two copies
/// pass through caches both ranks share, and beat one cross-memory copy by the kernel up to
/// megabytes: see `intranode::SHARED_CACHES_DIRECT_MIN`), near it (a short round trip, yet the
/// kernel's copy is the faster), or apart, measured by a cache line's round trip between rank 0
/// and each other rank in turn, then by timing the two ways of copying (see [`PROBE_BYTES`]).
/// The group is as far apart as its farthest rank. Rank 0 decides and announces both through
/// the store, so every rank agrees whatever it measured; a rank that did not answer in time
/// makes it [`Caches::Apart`] (the choice for ranks on cores of their own). Rank 0's settings
/// count, of `cfg.shared_caches` (`DISTCOMM_SHM_SHARED_CACHES`: shared or apart) and
/// `cfg.stream` (`DISTCOMM_SHM_STREAM`): it announces them instead of measuring.
fn placement(
    store: &dyn crate::rendezvous::Store,
    probe: &Probe<'_>,
    (me, n): (usize, usize),
    measure_caches: bool,
    cfg: &ArenaConfig,
) -> Result<(Caches, bool)> {
    let region = probe.region;
    let (ping, pong) = (region.word(OFF_PING), region.word(OFF_PONG));
    let done = region.word(OFF_DONE);
    if me == 0 {
        // Streaming first: rank 1 answers for a limited time, which the round trips with every
        // other rank could use up.
        let streamed = match cfg.stream {
            Some(_) => None,
            None => streaming(probe, (ping, pong)),
        };
        let measured = || {
            (1..n).fold(Caches::Shared, |group, r| {
                if group == Caches::Apart {
                    return group;
                }
                let rtt = round_trip(r as u64, ping, pong);
                let ways = match rtt {
                    Some(rtt) if rtt < SHARED_RTT => time_ways(probe, r as u64, ping, pong),
                    _ => None,
                };
                tracing::debug!(
                    rank = r,
                    ?rtt,
                    ?ways,
                    "arena: cache line round trip with rank 0; the slots' copies against a \
                     cross-memory copy (ns)"
                );
                match ways {
                    None => Caches::Apart,
                    Some((slots, cma)) if slots >= cma => Caches::Near,
                    Some(_) => group,
                }
            })
        };
        let caches = match (measure_caches, cfg.shared_caches) {
            (false, _) | (true, Some(false)) => Caches::Apart,
            (true, Some(true)) => Caches::Shared,
            (true, None) => measured(),
        };
        // Where the ranks share a core's caches or are near, never (measured there: see
        // `intranode::stream_part`); apart or crowded, as measured, and where that failed as
        // on the hosts where it was chosen (cores without a shared last-level cache).
        let streams = cfg
            .stream
            .unwrap_or(caches == Caches::Apart && streamed.unwrap_or(true));
        done.store(1, Ordering::Release);
        let word: &[u8] = match caches {
            Caches::Apart => b"apart",
            Caches::Near => b"near",
            Caches::Shared => b"shared",
        };
        store.set("arena/caches", word)?;
        store.set("arena/stream", if streams { b"1" } else { b"0" })?;
    } else if measure_caches || me == 1 {
        answer(me as u64, probe, done);
    }
    let caches = match store.get("arena/caches")?.as_slice() {
        b"shared" => Caches::Shared,
        b"near" => Caches::Near,
        _ => Caches::Apart,
    };
    Ok((caches, store.get("arena/stream")? == b"1"))
}

/// Rounds of the streaming probe per way (after [`STREAM_WARM`] of each not counted).
const STREAM_ROUNDS: u64 = 5;
const STREAM_WARM: u64 = 1;
/// The streaming probe counts only where ranks 0 and 1 run at the same time: a median round
/// trip under this (0.1-0.5 µs on two cores, against a time slice where they take turns).
const RUNNING_RTT: Duration = Duration::from_micros(20);

/// Rank 0's side of the streaming probe with rank 1: whether [`PROBE_BYTES`] go from rank 0
/// to rank 1 through a slot faster with non-temporal stores than with ordinary ones, rank 0's
/// copy into the slot plus rank 1's copy out of it (the slot's lines last read by rank 1, as
/// an exchange step finds them), the medians over alternating rounds. `None` when rank 1 did
/// not answer in time or the two do not run at once. Cores with caches of their own and no
/// last-level cache in common (AMD EPYC VMs with their vCPUs apart) stream faster from 32 KiB
/// on; cores that share one (Intel Xeon 5th gen VMs) do not: there an ordinary store takes the
/// line from the shared cache, a streamed one sends it to memory, and the reader fetches it
/// from there (all_reduce 64 KiB world 2 0.53x the streamed time, reduce world 4 0.43x, see
/// `intranode::stream_part`).
fn streaming(probe: &Probe<'_>, (ping, pong): (&AtomicU64, &AtomicU64)) -> Option<bool> {
    let rtt = round_trip(1, ping, pong).filter(|&rtt| rtt < RUNNING_RTT)?;
    let until = Instant::now() + PAIR_LIMIT;
    let src = vec![1u8; probe.len];
    let mut times = [Vec::new(), Vec::new()];
    for k in 0..2 * (STREAM_WARM + STREAM_ROUNDS) {
        let stream = k % 2 == 1;
        let word = COPY_PING | COPY_OUT_ONLY | k;
        let way = slot_round(probe, &src, (1, word, stream), (ping, pong), until)?;
        if k >= 2 * STREAM_WARM {
            times[usize::from(stream)].push(way);
        }
    }
    let [mut plain, mut streamed] = times;
    let (plain, streamed) = (median(&mut plain)?, median(&mut streamed)?);
    tracing::debug!(
        ?rtt,
        plain,
        streamed,
        "arena: slots' copies with ordinary stores against non-temporal ones (ns)"
    );
    Some(streamed < plain)
}

/// Rank 0's side: the median of [`ROUNDS`] round trips with rank `r`, `None` when it did not
/// answer within [`PAIR_LIMIT`].
fn round_trip(r: u64, ping: &AtomicU64, pong: &AtomicU64) -> Option<Duration> {
    let until = Instant::now() + PAIR_LIMIT;
    let mut times = Vec::with_capacity(ROUNDS as usize);
    for i in 1..=ROUNDS {
        let t = Instant::now();
        ping_pong(r << 32 | i, (ping, pong), until)?;
        times.push(t.elapsed());
    }
    times.sort_unstable();
    times.get(times.len() / 2).copied()
}

/// Pings with `word` and waits for its echo; `None` when none came before `until`.
fn ping_pong(word: u64, (ping, pong): (&AtomicU64, &AtomicU64), until: Instant) -> Option<()> {
    ping.store(word, Ordering::Release);
    let mut turns = 0u32;
    while pong.load(Ordering::Acquire) != word {
        turns = turns.wrapping_add(1);
        if turns % 256 == 0 && Instant::now() >= until {
            return None;
        }
        std::hint::spin_loop();
    }
    Some(())
}

/// Rank 0's side of the copy probe with rank `r`: the medians over [`COPY_ROUNDS`] (the first
/// not counted) of the slots' way (rank 0's copy of its buffer into a slot plus `r`'s copy out
/// of it) and of `r`'s cross-memory copy of rank 0's buffer, in ns; `None` when `r` did not
/// answer within [`PAIR_LIMIT`].
fn time_ways(probe: &Probe<'_>, r: u64, ping: &AtomicU64, pong: &AtomicU64) -> Option<(u64, u64)> {
    let until = Instant::now() + PAIR_LIMIT;
    // The same buffer every round, as a benchmark's (or a training step's reused tensor).
    let src = vec![1u8; probe.len];
    let (mut slots, mut cma) = (Vec::new(), Vec::new());
    for k in 0..COPY_ROUNDS {
        let way = slot_round(probe, &src, (r, COPY_PING | k, false), (ping, pong), until)?;
        if k > 0 {
            slots.push(way);
            cma.push(probe.region.word(OFF_PROBE_CMA).load(Ordering::Relaxed));
        }
    }
    Some((median(&mut slots)?, median(&mut cma)?))
}

/// One round of a copy probe with rank `r` (`(r, word, stream)`): rank 0 copies `src` into the
/// slot (with non-temporal stores when `stream`), publishes `src`'s address, pings with `word`
/// and waits for `r`'s answer. Its own copy's time plus `r`'s copy out of the slot, in ns;
/// `None` when `r` did not answer before `until`.
fn slot_round(
    probe: &Probe<'_>,
    src: &[u8],
    (r, word, stream): (u64, u64, bool),
    (ping, pong): (&AtomicU64, &AtomicU64),
    until: Instant,
) -> Option<u64> {
    let region = probe.region;
    let t = Instant::now();
    {
        // SAFETY: the slots are unused until set-up ends, and no other rank reads these
        // bytes before the ping below (rank `r` reads them between it and its pong; every
        // other rank only answers pings meant for it).
        let slot = unsafe { region.view_mut::<u8>(probe.at, probe.len) };
        crate::copy::copy_bytes_streaming_if(stream, slot, src);
    }
    let copy_in = nanos(t.elapsed());
    region
        .word(OFF_PROBE_ADDR)
        .store(src.as_ptr() as u64, Ordering::Relaxed);
    ping_pong(r << 32 | word, (ping, pong), until)?;
    let out = region.word(OFF_PROBE_OUT).load(Ordering::Relaxed);
    Some(copy_in.saturating_add(out))
}

fn median(v: &mut [u64]) -> Option<u64> {
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The other rank's side of one round of the copy probe: copies rank 0's bytes out of the slot,
/// then straight from rank 0's buffer by cross-memory copy, and publishes both times (a failed
/// cross-memory copy counts as never done: the slots' way then wins).
fn time_copies_out(probe: &Probe<'_>, dst: &mut [u8], cross: bool) {
    let region = probe.region;
    let t = Instant::now();
    {
        // SAFETY: rank 0 wrote the bytes before its ping (acquired by the caller) and leaves
        // them alone until our pong.
        let slot = unsafe { region.view::<u8>(probe.at, probe.len) };
        crate::copy::copy_bytes(&mut dst[..slot.len()], slot);
    }
    let out = nanos(t.elapsed());
    let addr = region.word(OFF_PROBE_ADDR).load(Ordering::Relaxed);
    region.word(OFF_PROBE_OUT).store(out, Ordering::Relaxed);
    if !cross {
        return;
    }
    let t = Instant::now();
    let cma = match cma_read(probe.root_pid, addr, &mut dst[..probe.len]) {
        Ok(()) => nanos(t.elapsed()),
        Err(_) => u64::MAX,
    };
    region.word(OFF_PROBE_CMA).store(cma, Ordering::Relaxed);
}

/// Another rank's side: echoes rank 0's pings to it (reading the copy probe's bytes first when
/// the ping asks for it) until rank 0 is done with every rank, or for `me + 2` times
/// [`PAIR_LIMIT`] from its arrival at most (rank 0 tries the streaming probe with rank 1 and
/// the ranks before it for at most twice [`PAIR_LIMIT`] each; when it comes later, it decides
/// without this rank: apart).
fn answer(me: u64, probe: &Probe<'_>, done: &AtomicU64) {
    let (ping, pong) = (probe.region.word(OFF_PING), probe.region.word(OFF_PONG));
    let mut dst = vec![0u8; probe.len];
    let until = Instant::now() + 2 * PAIR_LIMIT * u32::try_from(me + 2).unwrap_or(u32::MAX);
    let mut turns = 0u32;
    while done.load(Ordering::Acquire) == 0 {
        let word = ping.load(Ordering::Acquire);
        if word >> 32 == me && pong.load(Ordering::Relaxed) != word {
            if word & COPY_PING != 0 {
                time_copies_out(probe, &mut dst, word & COPY_OUT_ONLY == 0);
            }
            pong.store(word, Ordering::Release);
        }
        turns = turns.wrapping_add(1);
        if turns % 256 == 0 && Instant::now() >= until {
            return;
        }
        std::hint::spin_loop();
    }
}
