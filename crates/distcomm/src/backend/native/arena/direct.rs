//! Direct steps: parts read straight from the other ranks' own buffers by cross-memory attach
//! (`process_vm_readv`), one copy instead of the slots' two (in, out) — Open MPI's single-copy
//! `vader` transfers, inside the arena's steps, issue order and checks.
//!
//! A direct step publishes, in the rank's control line of the step, where its part lies (address
//! and length in its own process) and raises its sequence word to `2·step + 1`; every rank reads
//! what it needs from the ranks it reads, checks their calls first (as any step does), and raises
//! its word to `2·step + 2`; a rank whose part others read returns only once they all have, so
//! its caller never changes memory another rank is still copying from, and then checks their
//! calls too (the root of a broadcast reads nobody, yet must not miss a root that differs).
//!
//! A rank that gives up (deadline, a lost peer, a desync) breaks the arena before its call
//! returns; a reader checks the flag after its copies, so data a returned caller may have
//! changed meanwhile is never taken for a result. Only reads cross processes: a late or failed
//! copy can never write into another rank's memory.
//!
//! Cross-memory attach must work between every pair of ranks (Yama's `ptrace_scope`,
//! containers and seccomp may forbid it): [`probe`] tries it between all of them at set-up, and
//! every rank takes direct steps only when all could (`DISTCOMM_SHM_CMA=0` turns them off).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Arena, Reads, Wait, LINE_DATA};
use crate::backend::native::Exchange;
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::transport::shm::cma_read;

/// Where another rank's part of a direct step lies, in its process.
pub(crate) struct Remote {
    pid: i32,
    /// As the other rank published it (a bad one is an error of the copy, never a crash).
    addr: u64,
    len: usize,
    /// The rank whose part it is and the rank that reads it (group ranks), for errors.
    owner: usize,
    reader: usize,
}

impl Remote {
    /// Copies the part's bytes `at..at + dst.len()` into `dst`. An error when they are not all
    /// in the part (what the other rank published disagrees with this call) or the copy fails.
    pub(crate) fn read(&self, op: &'static str, at: usize, dst: &mut [u8]) -> Result<()> {
        let fits = at.checked_add(dst.len()).is_some_and(|end| end <= self.len);
        if !fits {
            return Err(Error::Aborted {
                op,
                rank: self.reader,
                reason: format!(
                    "internal: bytes {at}..{} of rank {}'s {}-byte part read in a direct step",
                    at.saturating_add(dst.len()),
                    self.owner,
                    self.len
                ),
            });
        }
        if dst.is_empty() {
            return Ok(());
        }
        let addr = self.addr.wrapping_add(at as u64);
        cma_read(self.pid, addr, dst).map_err(|e| Error::Aborted {
            op,
            rank: self.reader,
            reason: format!(
                "cross-memory copy from rank {} (process {}) failed: {e}; \
                 DISTCOMM_SHM_CMA=0 turns such copies off",
                self.owner, self.pid
            ),
        })
    }
}

impl Arena {
    /// Whether this arena takes direct steps (every pair of ranks can copy across processes).
    pub(crate) fn direct(&self) -> bool {
        self.pids.is_some()
    }

    /// One direct step (see the module's doc): publishes `mine` (the part the ranks `read_by`
    /// read; any bytes, empty when nobody reads it), waits for the ranks `reads`, checks their
    /// calls, hands each of their parts to `get(r, part)` (in rank order, never this rank's
    /// own), then waits until the ranks `read_by` are done with `mine`.
    pub(crate) fn exchange_direct(
        &self,
        s: &Exchange<'_>,
        reads: (Reads, Reads),
        mine: &[u8],
        get: &mut dyn FnMut(usize, &Remote) -> Result<()>,
    ) -> Result<()> {
        let each = &mut |parts: &[Option<Remote>]| {
            for (r, part) in parts.iter().enumerate() {
                if let Some(part) = part {
                    get(r, part)?;
                }
            }
            Ok(())
        };
        self.exchange_direct_all(s, reads, Published::of(mine), each)
    }

    /// [`Arena::exchange_direct`] with every part read at once: `get` gets them indexed by rank
    /// (`None` for this rank and the ranks not read), and `mine` is only an address and a
    /// length, so that the caller may change other bytes of the same buffer meanwhile (the
    /// readers of `mine` never read those).
    pub(crate) fn exchange_direct_all(
        &self,
        s: &Exchange<'_>,
        (reads, read_by): (Reads, Reads),
        mine: Published,
        get: &mut dyn FnMut(&[Option<Remote>]) -> Result<()>,
    ) -> Result<()> {
        let me = self.me;
        let (Some(pids), step) = (&self.pids, self.step.load(Ordering::Acquire)) else {
            return Err(Error::Aborted {
                op: s.op,
                rank: me,
                reason: "internal: a direct step in an arena without cross-memory copies".into(),
            });
        };
        let w = Wait::new(s);
        let data = |r: usize| self.line(r, step) + LINE_DATA;
        let mut chained = 0;
        let done = self.begin(step, false, &w).and_then(|()| {
            chained = self.publish(step, w.call);
            self.region
                .word(data(me))
                .store(mine.addr, Ordering::Relaxed);
            self.region
                .word(data(me) + 8)
                .store(mine.len as u64, Ordering::Relaxed);
            self.seq(me, step).store(2 * step + 1, Ordering::Release);
            self.wait_for(reads, step, 2 * step + 1, &w)?;
            self.check_calls(reads, s.op, step, w.call, chained)?;
            let parts: Vec<Option<Remote>> = (0..self.n)
                .map(|r| {
                    (r != me && reads.ranks(self.n).contains(&r)).then(|| Remote {
                        pid: pids[r],
                        addr: self.region.word(data(r)).load(Ordering::Relaxed),
                        len: usize::try_from(self.region.word(data(r) + 8).load(Ordering::Relaxed))
                            .unwrap_or(usize::MAX),
                        owner: r,
                        reader: me,
                    })
                })
                .collect();
            get(&parts).map_err(|e| self.copy_failed(e, reads, &w))?;
            // A rank that gave up broke the arena before its caller could touch its part again:
            // what we copied is only good if nobody has.
            if !self.usable() {
                return Err(self.broken_error(s.op));
            }
            self.seq(me, step).store(2 * step + 2, Ordering::Release);
            self.wait_for(read_by, step, 2 * step + 2, &w)?;
            // The ranks that read us check our call; we check theirs too (a rank that read
            // nobody, say the root of a broadcast, would not see a root that differs).
            self.check_calls(read_by, s.op, step, w.call, chained)
        });
        self.end_step(step, chained, done)
    }

    /// The error of a direct step whose copies failed with `e`: a read rank whose process went
    /// away during the copy fails it, and that is its loss (the peer-lost error naming it, once
    /// the engine learnt of it from its connection, moments later), else `e` as it is.
    fn copy_failed(&self, e: Error, reads: Reads, w: &Wait<'_>) -> Error {
        let until = Instant::now() + LOSS_NOTICE;
        loop {
            for r in reads.ranks(self.n).filter(|&r| r != self.me) {
                if let Some(reason) = w.engine.peer_failure(self.global(r)) {
                    return self.lost(w.op, r, reason);
                }
            }
            if Instant::now() >= until {
                return e;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// How long a failed copy waits for the engine to learn of a read rank's loss.
const LOSS_NOTICE: Duration = Duration::from_millis(200);

/// Where this rank's part of a direct step lies: published as a number, read by the other
/// ranks through the kernel, never dereferenced here.
#[derive(Clone, Copy)]
pub(crate) struct Published {
    addr: u64,
    len: usize,
}

impl Published {
    /// The part `bytes`.
    pub(crate) fn of(bytes: &[u8]) -> Published {
        Published {
            addr: bytes.as_ptr() as u64,
            len: bytes.len(),
        }
    }
}

/// What this rank publishes for the probe: its process id and the address of `word`.
pub(super) fn probe_offer(word: &u64) -> String {
    format!("{} {}", std::process::id(), word as *const u64 as u64)
}

/// Tries a cross-memory copy from every other rank's probe word (`offers[r]`, from
/// [`probe_offer`]; rank `r`'s word holds [`probe_value`]`(r)`): the process ids of all ranks
/// when every copy worked, else `None`.
pub(super) fn probe(offers: &[String], me: usize) -> Option<Vec<i32>> {
    let mut pids = Vec::with_capacity(offers.len());
    for (r, offer) in offers.iter().enumerate() {
        let (pid, addr) = offer.split_once(' ')?;
        let (pid, addr) = (pid.parse::<i32>().ok()?, addr.parse::<u64>().ok()?);
        if r != me {
            let mut got = [0u8; 8];
            cma_read(pid, addr, &mut got).ok()?;
            if u64::from_ne_bytes(got) != probe_value(r) {
                return None;
            }
        }
        pids.push(pid);
    }
    Some(pids)
}

/// The value rank `r`'s probe word holds.
pub(super) fn probe_value(r: usize) -> u64 {
    0x6463_6469_7265_6374 ^ r as u64 // "dcdirect"
}

/// Every rank's probe offer from the store (`arena/cma/{r}`).
pub(super) fn offers(store: &dyn Store, n: usize) -> Result<Vec<String>> {
    (0..n)
        .map(|r| {
            let v = store.get(&format!("arena/cma/{r}"))?;
            Ok(String::from_utf8_lossy(&v).into_owned())
        })
        .collect()
}
