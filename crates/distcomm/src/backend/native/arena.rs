//! Intra-node collectives through a shared arena (Linux, every rank of the group on one host):
//! all_reduce (and large reduces and reduce_scatters) chunk by chunk (`arena/all_reduce.rs`),
//! the other collectives as one [`Arena::exchange`] step per piece (`intranode.rs` says what
//! each op puts in and takes out), or as one *direct* step in which the ranks copy each other's
//! parts straight from their buffers (`arena/direct.rs`). This file: the layout, the steps'
//! control lines and waiting, desync checks, breaking. Set-up: `arena/setup.rs`.
//!
//! In the spirit of DeepSpeed's CPU shared-memory all-reduce, without its two gaps (it silently
//! returned unreduced data for types other than fp32/bf16/fp16, and knew only SUM): every
//! element type and every reduce operator go through here, using the same kernels as the
//! network algorithms.
//!
//! all_reduce moves the buffer in chunks. Per chunk, every rank
//! 1. copies its chunk into its own slot, but for its own share of it (step 3 takes that
//!    from the rank's buffer: nobody else reads it), and raises its sequence word;
//! 2. waits until every rank has (barrier 1);
//! 3. reduces its share of the chunk across all slots into the shared result (16-bit floats
//!    stay 16-bit in the slots and are combined in f32 and rounded once, in this one pass);
//! 4. raises its sequence word again and waits for everyone (barrier 2);
//! 5. copies the reduced chunk out (the part of it the call takes: all of it for all_reduce,
//!    none on a reduce's other ranks, the rank's block for a reduce_scatter).
//!
//! Every chunk or exchange is a *step*. Slots and results are double-buffered by step parity,
//! control lines kept per step modulo [`LINES`]; before a step a rank waits until it may write
//! them again ([`Arena::begin`]). An exchange step waits only for the ranks whose parts it
//! reads, so a rank that reads nobody (the root of a small broadcast) runs ahead. Each step
//! first publishes its call's fingerprint (collective, operator, element type, count, root,
//! sequence number) and the chain of the rank's calls before it; a rank compares them for
//! every rank it reads, so a rank that called something else is a typed desync error, never a
//! wrong result: at once on the ranks that read its part, and on every rank by the next step
//! that reads all (all_reduce, barrier, all_gather...).
//!
//! Ordering: ranks must enter the arena in the same order. Calls run in the group's issue order
//! (the caller waits for the call's turn, see `crate::order`), one at a time, whatever thread
//! runs them.
//!
//! Waiting spins briefly, then yields the core (at once when ranks outnumber cores), then
//! sleeps in short naps; it checks the deadline, the peers' connections (a dead peer is the
//! same peer-lost error as anywhere), what collective each missing rank announced (every
//! collective of the group announces itself, so a rank in another collective at the same point
//! is a desync at once, not at the deadline) and the arena's `broken` flag. Any failed call
//! breaks the arena for good (the ranks' chunk counters may no longer agree): the flag tells
//! every rank, and later calls take the network algorithms.

mod all_reduce;
mod direct;
mod setup;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::broken::Broken;
use super::callwords::{chain, describe, fp_words};
use crate::call::Fingerprint;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transport::shm::Region;
use crate::transport::tcp::Engine;

pub(crate) use self::direct::{Published, Remote};
pub(crate) use self::setup::establish;
pub(crate) use super::{ArenaConfig, Caches, Exchange, DEFAULT_CHUNK};

const MAGIC: u64 = 0x6463_6172_656e_6131; // "dcarena1"
const OFF_MAGIC: usize = 0;
const OFF_BROKEN: usize = 64;
/// Set-up's measurement of whether the ranks share a core's caches (`arena/setup.rs`): rank
/// 0's ping, the other rank's answer, rank 0's "done", each on a line of its own.
const OFF_PING: usize = 128;
const OFF_PONG: usize = 192;
const OFF_DONE: usize = 256;
/// Per rank: [`LINES`] cache lines, one per step modulo `LINES` (sequence word, the call's
/// fingerprint at +8, the chain of all its calls so far at +24 (see [`chain`]), and up to
/// [`INLINE`] bytes of data at +32, so a tiny call moves one line per peer), then a line with
/// the collective the rank announced.
const CTRL: usize = 4096;
/// Control lines per rank: twice how many steps ([`LEAD`]) a rank may run ahead of the
/// slowest when its steps move at most [`INLINE`] bytes and it waits for nobody (the root of a
/// small broadcast, the other ranks of a small reduce or gather). World 4 on 2 cores: a rank
/// that must wait for every other at every call pays a context switch per call; with room to
/// run ahead it makes many calls per time slice, and so do the ranks that read it. 128 lines
/// against 16 (`scripts/ab.py`, 3 alternating pairs, 8-32 B): broadcast, scatter, gather and
/// reduce 0.58-0.75x the time at world 3, 0.44-0.62x at world 4, 0.40-0.64x at world 8 (on 2
/// cores); at world 2 0.73-1.03x; 1 KiB (slots, not lines) unchanged.
const LINES: u64 = 128;
const CTRL_STRIDE: usize = 64 * (LINES as usize + 1);
const LINE_CHAIN: usize = 24;
const LINE_DATA: usize = 32;
/// Chunks this small travel inside the control line.
pub(crate) const INLINE: usize = 32;
/// A rank that finished step `s` takes its control line of step `s + AHEAD` for writing
/// ([`Arena::claim_ahead`]).
///
/// Every control line a rank writes was read by the others `LINES` steps before (or is being
/// watched by a rank waiting for it), so the store needs the line back from their caches.
/// The store itself does not wait, but the stores after it queue behind it, and a call's
/// worth of them (stack moves included) fills the store buffer: on cores with caches of their
/// own, the writer of a small broadcast or scatter stood on every call (`perf`: a quarter of
/// the root's time on one instruction of `exchange`) for a full cache-line trip (~190 ns
/// here, `limits shm-lat` 380 ns a round trip). Taken a few steps ahead, the line comes in
/// the background while the rank makes its next calls. A rank runs at most [`LEAD`] steps
/// ahead of the others, so the line it takes was last read `LINES - AHEAD` steps before,
/// by ranks now done with it.
///
/// Measured on world 2, 8 B (`distcomm bench OP --sizes 8,8,8,8,8`, median of the five;
/// rounds of alternating runs against the build before, kept only when `limits shm-lat` read
/// the same cache mode before and after; median of per-round ratios). Cores with caches of
/// their own (round trip 330-400 ns): broadcast 0.133 against 0.220 µs (0.61x, 8 rounds),
/// scatter 0.127 against 0.216 (0.61x), gather 0.147 against 0.229 (0.63x), reduce 0.169
/// against 0.235 (0.70x, 3 rounds each); Open MPI 0.152, 0.148, 0.151, 0.177 in the same
/// rounds. all_reduce and barrier (every rank waits for every other at every step, so
/// nobody runs ahead) 1.05x and 1.02x (1 round). With shared caches (the two vCPUs of one
/// core; the lines never leave it) 0.95-1.05x for all six (4 rounds). An earlier variant: the
/// claim without [`LEAD`] and [`SLACK`] 0.80x, 0.98x, 0.72x (scatter, gather, broadcast), those
/// two without the claim 0.93x, 1.02x, 0.98x; readers also prefetching the next line of the
/// ranks they read: better for gather, worse for scatter, not kept.
const AHEAD: u64 = 3;
/// How far (steps) a rank may run ahead of another in steps that write only control lines
/// (the root of a run of small broadcasts, the senders of small gathers). Half the lines:
/// see [`AHEAD`]. Ranks that outnumber the cores keep `LINES - 1` (and neither take lines
/// ahead nor wait with [`SLACK`]): there the scheduler, not the caches, sets the pace, and
/// the room to run ahead is what counts (see [`LINES`]); with all three, world 3 on 2 cores
/// took 1.09-1.19x the time at 8-12 B (4 alternating pairs).
const LEAD: u64 = LINES / 2;
/// A rank that ran [`LEAD`] steps ahead waits until the one behind has come this many steps
/// nearer, not one: every step of waiting watches the other's line of that step, and the
/// other's store to a watched line waits for it (see [`AHEAD`]).
const SLACK: u64 = LINES / 4;
/// Spins before yielding, when ranks do not outnumber cores.
const SPINS: u32 = 4000;
/// After this long waiting, nap between checks instead of yielding.
const NAP_AFTER: Duration = Duration::from_millis(5);
const NAP: Duration = Duration::from_micros(50);

fn data_base(n: usize) -> usize {
    (CTRL + n * CTRL_STRIDE).next_multiple_of(4096)
}

/// Size of the arena of `n` ranks with `chunk`-byte slots.
pub(crate) fn arena_len(n: usize, chunk: usize) -> usize {
    data_base(n) + 2 * (n + 1) * chunk
}

/// This rank's view of the group's arena.
pub(crate) struct Arena {
    region: Region,
    n: usize,
    me: usize,
    chunk: usize,
    /// Group rank → global rank (peer-failure checks, errors).
    members: Arc<Vec<usize>>,
    oversubscribed: bool,
    /// How far ahead (steps) this rank may run in line-only steps, and how much nearer a rank
    /// behind must come once it had to wait ([`LEAD`], [`SLACK`]; `LINES - 1` and 0 when
    /// ranks outnumber cores).
    lead: (u64, u64),
    /// Largest all_reduce (bytes) that goes through the arena.
    max_bytes: usize,
    /// Chunks this rank has run through the arena (its sequence words are 2·step, 2·step + 1).
    /// Calls run one at a time, in issue order (the group's turns, see `crate::order`).
    step: AtomicU64,
    /// The [`chain`] of every call this rank published so far.
    chain: AtomicU64,
    /// Per rank, 1 + the latest step this rank has seen it arrive at (0: none yet), so that
    /// `begin` need not read another rank's line at every step (a cache line from the other
    /// core each time: what a root running ahead of its readers paid per call).
    seen: Vec<AtomicU64>,
    /// Every rank's process id, when every pair of ranks can copy across processes (direct
    /// steps, see `direct.rs`).
    pids: Option<Vec<i32>>,
    /// Where the ranks run relative to rank 0, as measured at set-up (the same on every rank:
    /// see `setup.rs`).
    caches: Caches,
    /// Whether large copies into the slots bypass the caches (see [`Arena::streams`]), as rank
    /// 0 decided at set-up.
    streams: bool,
}

/// Whose parts a rank reads in one [`Arena::exchange`] step, and so waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reads {
    /// Every rank's.
    All,
    /// One rank's (the others of a broadcast or scatter read the root's).
    Rank(usize),
    /// Nobody's (the root of a broadcast or scatter, the others of a gather or reduce).
    Nobody,
}

impl Reads {
    fn ranks(self, n: usize) -> std::ops::Range<usize> {
        match self {
            Reads::All => 0..n,
            Reads::Rank(r) => r..r + 1,
            Reads::Nobody => 0..0,
        }
    }
}

/// What a waiting rank needs to decide when to stop waiting.
struct Wait<'a> {
    /// The call's name, for errors.
    op: &'static str,
    /// When waiting began (read lazily: the clock costs as much as a small call's transfer).
    since: std::cell::Cell<Option<Instant>>,
    timeout: Duration,
    engine: &'a Engine,
    /// This call's published words.
    call: (u64, u64),
}

impl<'a> Wait<'a> {
    /// Waiting in a step of the call `s`.
    fn new(s: &Exchange<'a>) -> Wait<'a> {
        Wait {
            op: s.op,
            since: std::cell::Cell::new(None),
            timeout: s.timeout,
            engine: s.engine,
            call: fp_words(s.fp, s.dtype, s.tag),
        }
    }

    fn waited(&self) -> Duration {
        match self.since.get() {
            Some(t) => t.elapsed(),
            None => {
                self.since.set(Some(Instant::now()));
                Duration::ZERO
            }
        }
    }
}

impl Arena {
    /// Wraps a mapped region of [`arena_len`]`(n, chunk)` bytes (initialised by its creator), for
    /// rank `me` of `members`, with the process ids of direct steps (`pids`), where the ranks
    /// run and whether large copies stream, as every rank agreed at set-up.
    fn new(
        region: Region,
        (me, members): (usize, Arc<Vec<usize>>),
        chunk: usize,
        cfg: &ArenaConfig,
        (pids, caches, streams): (Option<Vec<i32>>, Caches, bool),
    ) -> Arena {
        let seen = (0..members.len()).map(|_| AtomicU64::new(0)).collect();
        Arena {
            max_bytes: cfg.max_bytes,
            region,
            n: members.len(),
            me,
            chunk,
            members,
            oversubscribed: cfg.oversubscribed,
            lead: match cfg.oversubscribed {
                false => (LEAD, SLACK),
                true => (LINES - 1, 0),
            },
            step: AtomicU64::new(0),
            chain: AtomicU64::new(0),
            seen,
            pids,
            caches,
            streams,
        }
    }

    /// Whether the arena still works (no rank broke it).
    pub(crate) fn usable(&self) -> bool {
        self.region.word(OFF_BROKEN).load(Ordering::Acquire) == 0
            && self.region.word(OFF_MAGIC).load(Ordering::Acquire) == MAGIC
    }

    /// Largest all_reduce (bytes) that goes through the arena.
    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Where rank `r` publishes the call that starts at `step` (its chain 16 bytes on).
    fn fp_at(&self, r: usize, step: u64) -> usize {
        self.line(r, step) + 8
    }

    /// Rank `r`'s control line for `step`.
    fn line(&self, r: usize, step: u64) -> usize {
        CTRL + r * CTRL_STRIDE + 64 * (step % LINES) as usize
    }

    /// Rank `r`'s sequence word for `step`: `2·step + 1` once it put its data of the step,
    /// `2·step + 2` once it is done with the step's shared part (see [`Arena::run`]).
    fn seq(&self, r: usize, step: u64) -> &AtomicU64 {
        self.region.word(self.line(r, step))
    }

    /// Publishes this rank's call starting at `step` (and its announcement), chained to its
    /// calls before; returns the chain, to keep once the call succeeded.
    fn publish(&self, step: u64, (w0, w1): (u64, u64)) -> u64 {
        let chained = chain(self.chain.load(Ordering::Relaxed), w0, w1);
        let at = self.fp_at(self.me, step);
        self.region
            .word(self.line(self.me, step) + LINE_CHAIN)
            .store(chained, Ordering::Relaxed);
        for at in [at, self.current_at(self.me)] {
            self.region.word(at + 8).store(w1, Ordering::Relaxed);
            self.region.word(at).store(w0, Ordering::Release);
        }
        // Done with every step before this one (see `begin`).
        self.position(self.me).store(step, Ordering::Release);
        chained
    }

    fn slot(&self, parity: u64, r: usize) -> usize {
        data_base(self.n) + (parity as usize * (self.n + 1) + r) * self.chunk
    }

    fn result(&self, parity: u64) -> usize {
        self.slot(parity, self.n)
    }

    fn lost(&self, op: &'static str, r: usize, reason: String) -> Error {
        Error::PeerLost {
            op,
            rank: self.me,
            peer: r,
            reason,
        }
    }

    /// Waits until every rank's sequence word of `step` reaches `target`.
    fn barrier(&self, step: u64, target: u64, w: &Wait<'_>) -> Result<()> {
        self.wait_for(Reads::All, step, target, w)
    }

    /// Waits until the sequence word of `step` of the ranks `who` reaches `target`.
    fn wait_for(&self, who: Reads, step: u64, target: u64, w: &Wait<'_>) -> Result<()> {
        for r in who.ranks(self.n) {
            let seq = self.seq(r, step);
            let mut turns = 0u32;
            while seq.load(Ordering::Acquire) < target {
                turns = turns.wrapping_add(1);
                if turns % 128 == 0 {
                    if let Some(e) = self.trouble(r, w) {
                        // A rank may do its part and exit between our look at its word and
                        // the check: what it left in the arena still counts.
                        if seq.load(Ordering::Acquire) >= target {
                            break;
                        }
                        return Err(e);
                    }
                    if w.waited() >= NAP_AFTER {
                        std::thread::sleep(NAP);
                        continue;
                    }
                }
                if turns < SPINS && !self.oversubscribed {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        Ok(())
    }

    /// Why waiting for rank `r` is pointless, if it is: the deadline passed, the arena broke,
    /// `r` is gone, or `r` runs another collective as this call (a desync). (Out of line: a
    /// waiter looks only every 128 turns.)
    #[inline(never)]
    fn trouble(&self, r: usize, w: &Wait<'_>) -> Option<Error> {
        let op = w.op;
        if w.waited() >= w.timeout {
            return Some(Error::Timeout {
                op,
                rank: self.me,
                peer: Some(r),
                after: w.timeout,
            });
        }
        // The broken flag first: a rank that broke the arena (and may have left since) said
        // why, which the loss of its connection would hide.
        if !self.usable() {
            return Some(self.broken_error(op));
        }
        // A rank in another collective at this point (its announcement, still readable after
        // it left: a rank that found the desync on its side may fail and exit before it ever
        // comes here), then one that is gone.
        let at = self.current_at(r);
        let c0 = self.region.word(at).load(Ordering::Acquire);
        let c1 = self.region.word(at + 8).load(Ordering::Relaxed);
        let (w0, w1) = w.call;
        let announced = c0 & 1 << 24 != 0;
        if announced && c0 >> 32 == w0 >> 32 && (c0, c1) != (w0, w1) {
            return Some(Error::Desync {
                op,
                rank: self.me,
                peer: r,
                ours: describe(w0, w1),
                theirs: describe(c0, c1),
            });
        }
        let reason = w.engine.peer_failure(self.global(r))?;
        // It may have broken the arena just before it left, after our look at the flag above
        // (a rank descheduled between the two looks): its reason names the cause, the lost
        // connection only the effect.
        if !self.usable() {
            return Some(self.broken_error(op));
        }
        Some(self.lost(op, r, reason))
    }

    /// Where rank `r` announces the collective it is in ([`Arena::announce`]).
    fn current_at(&self, r: usize) -> usize {
        CTRL + r * CTRL_STRIDE + 64 * LINES as usize
    }

    /// The step rank `r` last started a call at ([`Arena::publish`]): it is done with every
    /// step before it. (In its announcement line, which it writes at that moment anyway.)
    fn position(&self, r: usize) -> &AtomicU64 {
        self.region.word(self.current_at(r) + 16)
    }

    /// Waits, before this rank starts `step`, until it may write what the step writes: its
    /// control line of the step (used again `LINES` steps later: every rank must have arrived
    /// at the step after the one that last used it, and so be done reading it; we ask more,
    /// arrival at `step - LEAD`, see [`AHEAD`]) and, when `slots` (its data slot or the shared
    /// result of the step's parity), those too (every rank arrived at `step - 1`, so all are
    /// done with `step - 2`, the last one that used them). A step that waited for every rank
    /// leaves both true for the next.
    fn begin(&self, step: u64, slots: bool, w: &Wait<'_>) -> Result<()> {
        let (lead, slack) = self.lead;
        let back = if slots { 1 } else { lead };
        let Some(before) = step.checked_sub(back) else {
            return Ok(());
        };
        for (r, seen) in self.seen.iter().enumerate() {
            if r == self.me || seen.load(Ordering::Relaxed) > before {
                continue;
            }
            // Steps that write only lines (reused `LINES` steps on) may run far ahead of a
            // rank. Arrivals come in order: one that started a call at `before` or later is
            // done with `before - 1`, and the steps up to where it is need not look again.
            // One look at a word it writes once per call; looking at its line of `step - 1`
            // first cost a root running ahead in its broadcasts two misses on every step
            // (world 2, 8 B, 6 alternating pairs: broadcast 0.93x, scatter 0.91x, reduce
            // 0.96x the time with this). Steps with slots wait for `step - 1`, whose line
            // is in our cache when we read the rank's part of it: that look stays.
            if !slots {
                let at = self.position(r).load(Ordering::Acquire);
                if at >= before {
                    seen.store(at + 1, Ordering::Relaxed);
                    continue;
                }
            }
            // Far ahead on lines: wait until `r` is `slack` steps further (it needs nothing
            // of ours beyond `step - 1`, all published).
            let until = if slots {
                before
            } else {
                (before + slack).min(step - 1)
            };
            self.wait_for(Reads::Rank(r), until, 2 * until + 1, w)?;
            seen.store(until + 1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Tells the other ranks which collective this rank is in (every collective of the group
    /// calls this, arena or not), so that a rank waiting in the arena for one that runs another
    /// collective at the same point finds the desync at once instead of at its deadline.
    pub(crate) fn announce(&self, fp: &Fingerprint, dtype: DType, tag: u32) {
        let (w0, w1) = fp_words(fp, dtype, tag);
        let at = self.current_at(self.me);
        self.region.word(at + 8).store(w1, Ordering::Relaxed);
        self.region.word(at).store(w0, Ordering::Release);
    }

    /// Before this rank goes on to step `next`: takes its control line of step
    /// `next + AHEAD - 1` for writing, in the background (see [`AHEAD`]).
    fn claim_ahead(&self, next: u64) {
        if self.oversubscribed {
            return;
        }
        self.region
            .prefetch_write(self.line(self.me, next + AHEAD - 1));
    }

    /// Breaks the arena for good after this rank's call failed with `e`, leaving in the flag
    /// word why (see [`Broken`]), so that the ranks still waiting there can name the cause.
    fn break_for(&self, e: &Error) {
        let me = self.global(self.me);
        let word = match e {
            Error::PeerLost { peer, .. } => Broken::PeerLost {
                by: me,
                peer: self.global(*peer),
            },
            Error::Timeout {
                peer: Some(peer), ..
            } => Broken::Timeout {
                by: me,
                peer: self.global(*peer),
            },
            Error::Desync { peer, .. } => Broken::Desync {
                by: me,
                peer: self.global(*peer),
            },
            _ => Broken::Other { by: me },
        }
        .encode();
        let _ = self.region.word(OFF_BROKEN).compare_exchange(
            0,
            word,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// The global rank of group rank `r`.
    fn global(&self, r: usize) -> usize {
        self.members.get(r).copied().unwrap_or(r)
    }

    /// When a collective that fell back to the network found group rank `peer` gone, and
    /// `peer` is the rank that stopped the arena (it failed a collective there: a desync, a
    /// timeout, and may have left since): the arena's reason, which names the cause where the
    /// lost connection is only its effect. `None` otherwise.
    pub(crate) fn stopped_by(&self, op: &'static str, peer: usize) -> Option<Error> {
        if self.usable() {
            return None;
        }
        let word = self.region.word(OFF_BROKEN).load(Ordering::Acquire);
        (Broken::decode(word)?.by() == self.global(peer)).then(|| self.broken_error(op))
    }

    /// The error of a rank that finds the arena broken by another: names the rank that broke it
    /// and, when there was one, the peer that caused it (a dead peer is a peer-lost error here
    /// too, as on the rank that saw it die).
    fn broken_error(&self, op: &'static str) -> Error {
        let word = self.region.word(OFF_BROKEN).load(Ordering::Acquire);
        let rank = self.me;
        let aborted = |reason: String| Error::Aborted { op, rank, reason };
        // The flag holds global ranks; errors name group ranks, as everywhere in a group.
        let local = |g: usize| self.members.iter().position(|&m| m == g).unwrap_or(g);
        let decoded = Broken::decode(word).map(|b| b.ranks(local));
        match decoded {
            Some(Broken::PeerLost { by, peer }) if peer != rank => Error::PeerLost {
                op,
                rank,
                peer,
                reason: format!(
                    "rank {by} lost its connection to rank {peer} during a collective in the \
                     shared-memory arena and stopped it"
                ),
            },
            Some(Broken::Timeout { by, peer }) => aborted(format!(
                "rank {by} timed out waiting for rank {peer} in the shared-memory arena and \
                 stopped it"
            )),
            Some(Broken::Desync { by, peer }) => aborted(format!(
                "rank {by} found that rank {peer} called another collective in the shared-memory \
                 arena and stopped it"
            )),
            Some(Broken::PeerLost { by, .. } | Broken::Other { by }) => aborted(format!(
                "rank {by} failed a collective in the shared-memory arena and stopped it"
            )),
            None => aborted("another rank gave up on the shared-memory arena".into()),
        }
    }

    /// Once the ranks `who` published `step`: they must have published the same call, after
    /// the same calls before it (`chained`: ours).
    fn check_calls(
        &self,
        who: Reads,
        op: &'static str,
        step: u64,
        (w0, w1): (u64, u64),
        chained: u64,
    ) -> Result<()> {
        for r in who.ranks(self.n).filter(|&r| r != self.me) {
            let ctrl = self.fp_at(r, step);
            let t0 = self.region.word(ctrl).load(Ordering::Acquire);
            let t1 = self.region.word(ctrl + 8).load(Ordering::Relaxed);
            let theirs = self
                .region
                .word(self.line(r, step) + LINE_CHAIN)
                .load(Ordering::Relaxed);
            if (t0, t1) != (w0, w1) || theirs != chained {
                return Err(self.desync(op, r, (w0, w1), (t0, t1), (t0, t1) == (w0, w1)));
            }
        }
        Ok(())
    }

    /// The error of a desync [`Arena::check_calls`] found with rank `r`: it published `theirs`
    /// where we published `ours`, or (`same_call`) the same call after different calls before.
    /// (Out of line: the check runs at every step, this almost never.)
    #[cold]
    #[inline(never)]
    fn desync(
        &self,
        op: &'static str,
        r: usize,
        (w0, w1): (u64, u64),
        (t0, t1): (u64, u64),
        same_call: bool,
    ) -> Error {
        let (ours, theirs) = (describe(w0, w1), describe(t0, t1));
        let earlier = ", after an earlier collective that differs between the two ranks";
        let (ours, theirs) = if same_call {
            (ours + earlier, theirs + earlier)
        } else {
            (ours, theirs)
        };
        Error::Desync {
            op,
            rank: self.me,
            peer: r,
            ours,
            theirs,
        }
    }

    /// Where the ranks run relative to rank 0, as every rank agreed at set-up.
    pub(crate) fn caches(&self) -> Caches {
        self.caches
    }

    /// The group's ranks.
    pub(crate) fn ranks(&self) -> usize {
        self.n
    }

    /// Whether ranks outnumber cores.
    pub(crate) fn oversubscribed(&self) -> bool {
        self.oversubscribed
    }

    /// Whether large copies into the slots, and reductions into the result, bypass the caches
    /// (non-temporal stores, `copy::copy_bytes_streaming`). Each line there was read last by
    /// other ranks; where they run on another core and an ordinary store must take the line
    /// back from a cache of theirs that shares nothing with ours, that costs more than the
    /// copy; where the cores share a last-level cache, the line comes from there and streaming
    /// to memory costs more instead. Set-up decides by measuring both (`setup::streaming`),
    /// where the ranks are apart or outnumber the cores; where they share a core's caches or
    /// are near, never. See `all_reduce::STREAM_PIECE` and `intranode::stream_part`.
    pub(crate) fn streams(&self) -> bool {
        self.streams
    }

    /// Bytes a rank can put into the arena in one [`exchange`](Self::exchange).
    pub(crate) fn slot_bytes(&self) -> usize {
        self.chunk
    }

    /// One step of a collective that moves data through the arena (broadcast, reduce, gather,
    /// scatter, all_gather, reduce_scatter, all_to_all, barrier): every rank writes its part,
    /// `put` filling `sizes(me)` bytes of its own slot; then it waits for the ranks `reads`
    /// and `get(r, part)` reads their parts (`sizes(r)` bytes, in rank order). Parts of at
    /// most [`slot_bytes`](Self::slot_bytes). `s` describes the call (desync checks, errors).
    ///
    /// A rank waits only for the ranks it reads: the root of a broadcast returns once its part
    /// is in, the others of a reduce once theirs are. [`Arena::begin`] keeps the shared memory
    /// consistent: a rank writes its slot of this parity again two steps later, once every
    /// rank has arrived at the step between (and so is done reading this one), and its control
    /// line `LINES` steps later. A rank checks the call (and the [`chain`] of calls before it)
    /// of every rank it reads; the ranks that read its part check it, so no rank takes data
    /// from a rank whose calls differ from its own.
    ///
    /// Generic in its closures (not `dyn`) so that a small call's `put`, `get` and `sizes`
    /// inline: 5-16 % fewer instructions per 8-byte call (callgrind, world 2: broadcast 1,010
    /// -> 887 on the root, barrier 973 -> 820), 0.93x the time of broadcast and barrier where
    /// the two ranks share a core's caches, no change where they do not (the line's trip
    /// between the cores sets the pace there).
    #[inline]
    pub(crate) fn exchange(
        &self,
        s: &Exchange<'_>,
        reads: Reads,
        sizes: &impl Fn(usize) -> usize,
        put: &mut impl FnMut(&mut [u8]),
        get: &mut impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let step = self.step.load(Ordering::Acquire);
        let parity = step % 2;
        let w = Wait::new(s);
        let mine = sizes(self.me);
        if mine > self.chunk {
            return Err(Error::Aborted {
                op: s.op,
                rank: self.me,
                reason: format!("internal: {mine} bytes do not fit the arena's slot"),
            });
        }
        // Parts of at most INLINE bytes travel in the control line (one line per peer).
        let at = |r: usize, len: usize| {
            if len <= INLINE {
                self.line(r, step) + LINE_DATA
            } else {
                self.slot(parity, r)
            }
        };
        let mut chained = 0;
        let done = self.begin(step, mine > INLINE, &w).and_then(|()| {
            chained = self.publish(step, w.call);
            // SAFETY: our slot (or line data) of this step is written only by us, after
            // `begin` (see above); it holds `chunk` bytes (line data INLINE), offsets are
            // multiples of 8.
            put(unsafe { self.region.view_mut::<u8>(at(self.me, mine), mine) });
            self.seq(self.me, step)
                .store(2 * step + 2, Ordering::Release);
            self.wait_for(reads, step, 2 * step + 2, &w)?;
            self.check_calls(reads, s.op, step, w.call, chained)?;
            reads.ranks(self.n).try_for_each(|r| {
                let len = sizes(r);
                // SAFETY: the other ranks' parts of this step are only read between their
                // publishing it and our arrival at the next step, before which nobody
                // writes them again (`begin`).
                get(r, unsafe {
                    self.region.view::<u8>(at(r, len), len.min(self.chunk))
                })
            })
        });
        self.end_step(step, chained, done)
    }

    /// After one step that published call chain `chained`: on to the next step, or the arena
    /// broken for good when the step failed.
    fn end_step(&self, step: u64, chained: u64, done: Result<()>) -> Result<()> {
        match &done {
            Ok(()) => {
                self.chain.store(chained, Ordering::Relaxed);
                self.step.store(step + 1, Ordering::Release);
                self.claim_ahead(step + 1);
            }
            Err(e) => self.break_for(e),
        }
        done
    }
}
