//! Setting up a group's arena through the rendezvous store (the world's at init, a subgroup's
//! at its first collective, in a store namespace of its own): rank 0 creates the region
//! when every rank's links are shared memory, every rank maps it, and cross-memory copies are
//! tried between every pair (direct steps, see `direct.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::direct;
use super::{arena_len, Arena, ArenaConfig, MAGIC, OFF_MAGIC};
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
        let go = format!("{} {}", yes(all), yes(direct));
        store.set("arena/go", go.as_bytes())?;
    }
    let go = store.get("arena/go")?;
    drop(probe_word);
    let pids = pids.filter(|_| go.ends_with(b" 1"));
    Ok(match (go.starts_with(b"1"), region) {
        (true, Some(region)) => Some(Arc::new(Arena::new(region, me, members, chunk, cfg, pids))),
        _ => None,
    })
}
