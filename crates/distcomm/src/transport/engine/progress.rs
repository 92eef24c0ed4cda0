//! The progress loop: the background thread asleep in `poll(2)` on every socket (and the
//! shared-memory doorbells), the spin-then-sleep of waiters driving the links themselves, and
//! the hand-over between the two (see the engine's module doc).
//!
//! Owns threads, clocks and `poll(2)`; makes no protocol decision.

use super::*;

impl State {
    /// One sweep over every live peer. Returns whether anything moved.
    ///
    /// With `flush_replies` false, control frames produced while reading (Ack, Cts) stay queued
    /// until the next sweep or the next send to that peer, whichever comes first; a waiter uses
    /// this so that a reply and the message the user sends next leave in one write.
    pub(super) fn progress(&mut self, flush_replies: bool) -> bool {
        let mut any = false;
        for p in 0..self.peers.len() {
            let live = matches!(self.peers.get(p), Some(Some(peer)) if peer.dead.is_none());
            if live {
                any |= self.pump(p, true, true, flush_replies);
            }
        }
        any
    }

    /// Fills `fds`/`owners` with every live peer's socket: readable always, writable when
    /// frames are queued. Shared-memory peers' sockets only carry doorbells: they are included
    /// with `doorbells` (the progress thread's set, to sleep on), left out otherwise (their
    /// rings are checked directly). The progress thread's set is noted per peer (`out_watched`).
    pub(super) fn poll_set(
        &mut self,
        fds: &mut Vec<libc::pollfd>,
        owners: &mut Vec<usize>,
        doorbells: bool,
    ) {
        for (p, peer) in self.peers.iter_mut().enumerate() {
            if let Some(peer) = peer.as_mut().filter(|x| x.dead.is_none()) {
                let shm = peer.link.shm.is_some();
                if shm && !doorbells {
                    continue;
                }
                let mut events = libc::POLLIN;
                let out = !shm && !peer.out.is_empty();
                if out {
                    events |= libc::POLLOUT;
                }
                if doorbells {
                    peer.out_watched = out;
                }
                fds.push(libc::pollfd {
                    fd: peer.link.stream.as_raw_fd(),
                    events,
                    revents: 0,
                });
                owners.push(p);
            }
        }
    }

    /// Whether frames wait to be written to `peer` (`None`: any peer) that the progress
    /// thread's latest poll set does not watch for: only then must a poster wake it. (A set
    /// that asked for writability when it was built still does, whatever was queued since;
    /// the thread builds it again under this lock after every wake-up.)
    pub(super) fn unwatched_backlog(&self, peer: Option<usize>) -> bool {
        let unwatched = |p: &Peer| !p.out.is_empty() && !p.out_watched;
        match peer {
            Some(p) => matches!(self.peers.get(p), Some(Some(x)) if unwatched(x)),
            None => self.peers.iter().flatten().any(unwatched),
        }
    }

    /// Moves only the sockets poll(2) reported ready. The progress thread always works this
    /// way; a spinning waiter does when it has several peers (one poll instead of a read on
    /// each), and reads directly when it has one (on arrival one system call instead of two:
    /// measured as the difference between 1.05x and 0.96x Open MPI's 8 B latency).
    pub(super) fn progress_ready(
        &mut self,
        fds: &[libc::pollfd],
        owners: &[usize],
        flush_replies: bool,
    ) -> bool {
        let mut any = false;
        for (fd, &p) in fds.iter().zip(owners) {
            let r = fd.revents;
            if r == 0 {
                continue;
            }
            let readable = r & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
            let writable = r & (libc::POLLOUT | libc::POLLERR) != 0;
            if self.is_shm(p) {
                any |= readable && self.ring_answered(p);
                continue;
            }
            any |= self.pump(p, readable, writable, flush_replies);
        }
        any | self.pump_shm(flush_replies)
    }

    pub(super) fn is_shm(&self, p: usize) -> bool {
        self.shm_link(p).is_some()
    }

    /// The doorbell socket of shared-memory peer `p` is readable: drain it. If it closed, the
    /// peer is gone (`mark_dead` takes what it wrote to the ring before closing first).
    /// Returns whether the peer was found dead.
    pub(super) fn ring_answered(&mut self, p: usize) -> bool {
        #[cfg(target_os = "linux")]
        if let Some(Some(peer)) = self.peers.get(p) {
            if let Err(reason) = shm::drain_doorbell(&peer.link.stream) {
                self.mark_dead(p, reason);
                return true;
            }
        }
        let _ = p;
        false
    }

    /// Moves every live shared-memory peer (a check of its rings costs no system call).
    pub(super) fn pump_shm(&mut self, flush_replies: bool) -> bool {
        let mut any = false;
        for p in 0..self.peers.len() {
            if self.is_shm(p) {
                any |= self.pump(p, true, true, flush_replies);
            }
        }
        any
    }

    /// Whether frames wait in any peer's queue (to be written by a sweep).
    pub(super) fn backlog(&self) -> bool {
        self.peers.iter().flatten().any(|p| !p.out.is_empty())
    }

    /// Before the progress thread sleeps: raises the sleep flags of every shared-memory link
    /// (so the peer rings the doorbell). Returns whether something is already waiting, in
    /// which case it must not sleep.
    pub(super) fn prepare_sleep(&self) -> bool {
        let mut busy = false;
        #[cfg(target_os = "linux")]
        for peer in self.peers.iter().flatten().filter(|p| p.dead.is_none()) {
            if let Some(l) = &peer.link.shm {
                busy |= l.prepare_sleep(!peer.out.is_empty());
                // An answer to a lane send came (the peer rings only after the flag is up).
                busy |=
                    peer.lane_waits.iter().flatten().any(
                        |w| matches!(w, LaneWait::Op { seq, .. } if l.answered(*seq).is_some()),
                    );
            }
        }
        busy
    }

    /// After the progress thread woke: lowers the sleep flags.
    pub(super) fn woke(&self) {
        #[cfg(target_os = "linux")]
        for peer in self.peers.iter().flatten() {
            if let Some(l) = &peer.link.shm {
                l.woke();
            }
        }
    }
}

impl Engine {
    /// Spins until `ready()` (yielding the core on every turn when ranks outnumber cores), at
    /// most `limit` and the configured spin; returns whether it became ready. Counts as a
    /// spinning waiter, so the progress thread keeps off the links meanwhile.
    pub(super) fn fast_wait(&self, limit: Duration, ready: impl Fn() -> bool) -> bool {
        if ready() {
            return true;
        }
        if self.sh.spin.is_zero() {
            return false;
        }
        self.spin_begin();
        let budget = self.sh.spin.min(limit);
        let mut start = None;
        let mut turns = 0u32;
        let ok = loop {
            if ready() {
                break true;
            }
            turns = turns.wrapping_add(1);
            if turns % 64 == 0 {
                let now = Instant::now();
                if now.duration_since(*start.get_or_insert(now)) >= budget {
                    break false;
                }
            }
            // Ranks with cores of their own poll without PAUSE: it takes tens of cycles on
            // recent cores, which the arrival of a small message would wait out (8 B half round
            // trip 0.259 -> 0.25 µs without it).
            if self.sh.yield_spin {
                std::thread::yield_now();
            }
        };
        // Not ready: the callers go on to the general wait (which spins again) or are done at
        // once (a send handed to the engine with its outcome known, a refused receive); either
        // way no hand-over to the progress thread (a wake-up for nothing) here.
        self.spin_end(true);
        ok
    }

    /// A waiter starts spinning: the progress thread keeps off the links until it ends.
    pub(super) fn spin_begin(&self) {
        self.sh.spinning.fetch_add(SPINNER, Ordering::AcqRel);
        self.sh.handoff.store(false, Ordering::Release);
        if self.sh.watching.load(Ordering::Acquire) {
            // Get the progress thread off the sockets.
            self.sh.poke();
        }
    }

    /// A waiter stops spinning, `done` or about to sleep (then the progress thread must watch
    /// the links at once).
    pub(super) fn spin_end(&self, done: bool) {
        if !done {
            self.sh.handoff.store(true, Ordering::Release);
        }
        // One step: one spinner fewer, one spin ended (for the progress thread's grace).
        let before = self
            .sh
            .spinning
            .fetch_add(SPIN_ENDED.wrapping_sub(SPINNER), Ordering::AcqRel);
        if before & SPINNERS == SPINNER && !done {
            self.sh.poke();
        }
    }
}

impl Engine {
    /// Spins (driving progress) while things move, then sleeps until the operation completes,
    /// is kicked, or the deadline passes. Returns whether it is done.
    pub(super) fn spin_then_sleep(&self, cell: &OpCell, deadline: &mut Deadline) -> bool {
        if !self.sh.spin.is_zero() {
            self.spin_begin();
            // Spin while things move; sleep after `spin` without any progress.
            // Reading the clock costs as much as a turn of the loop: read it every few turns,
            // and note only whether anything moved in between. A wait that ends within the
            // first few turns never reads it.
            const CLOCK_EVERY: u32 = 32;
            let mut idle_since: Option<Instant> = None;
            let mut moved_since_clock = false;
            let mut turns = 0u32;
            loop {
                if cell.is_done() {
                    break;
                }
                if let Ok(mut st) = self.sh.st.try_lock() {
                    // One peer: read it directly (one system call when data arrives). Several:
                    // one poll(2) over all of them beats a read on each.
                    let (mut fds, mut owners) = std::mem::take(&mut st.wait_set);
                    fds.clear();
                    owners.clear();
                    st.poll_set(&mut fds, &mut owners, false);
                    let moved = if fds.len() <= 1 {
                        st.progress(false)
                    } else if poll_now(&mut fds) > 0 {
                        st.progress_ready(&fds, &owners, false)
                    } else {
                        st.pump_shm(false)
                    };
                    st.wait_set = (fds, owners);
                    moved_since_clock |= moved;
                }
                if cell.is_done() {
                    break;
                }
                turns = turns.wrapping_add(1);
                if !self.sh.yield_spin && turns % CLOCK_EVERY != 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let now = Instant::now();
                let deadline = deadline.from(now);
                if std::mem::take(&mut moved_since_clock) || idle_since.is_none() {
                    idle_since = Some(now);
                }
                let idle = idle_since.map_or(Duration::ZERO, |t| now.duration_since(t));
                // Once both sides are engaged in a large transfer, a pause is the TCP window
                // refilling, not an absent peer: sleeping there would halve the bandwidth.
                let budget = if cell.is_active() {
                    self.sh.spin.max(ACTIVE_SPIN)
                } else {
                    self.sh.spin
                };
                if now >= deadline || idle >= budget {
                    break;
                }
                if self.sh.yield_spin {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            self.spin_end(cell.is_done());
            if cell.is_done() {
                return true;
            }
        }
        block(cell, deadline.get())
    }
}

impl Driver for Engine {
    fn drive_until(&self, cell: &OpCell, deadline: &mut Deadline) -> bool {
        loop {
            if self.spin_then_sleep(cell, deadline) {
                return true;
            }
            if Instant::now() >= deadline.get() {
                return cell.is_done();
            }
        }
    }

    fn cancel(&self, op_id: u64) {
        let mut st = self.sh.lock();
        st.matcher.withdraw_posted(|r| r.id == op_id);
    }

    fn rank(&self) -> usize {
        self.sh.rank
    }

    fn claim(&self, op_id: u64, src: usize, limit: Duration) -> Option<(Status, BoxBuf)> {
        Engine::claim(self, op_id, src, limit)
    }

    fn answer(&self, t: &Ticket) -> Option<bool> {
        self.sh.watch.get(t.peer)?.as_ref()?.answered(t.seq)
    }

    fn await_answer(&self, t: &Ticket, limit: Duration) -> bool {
        let Some(Some(watch)) = self.sh.watch.get(t.peer) else {
            return false;
        };
        // Frames queued behind lane messages go out only with a sweep: leave such waits to
        // the general path, which sweeps.
        if self.sh.lock().backlog() {
            return false;
        }
        self.fast_wait(limit.min(FAST_SPIN), || watch.answered(t.seq).is_some())
    }

    fn adopt(&self, op_id: u64, t: &Ticket, cell: &Arc<OpCell>) {
        let buf = cell.take_buf();
        self.sh.lock().adopt_lane_send(t, cell, buf, Some(op_id));
    }
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn poke(&self) {
        let _ = (&self.wake_tx).write(&[1]);
    }

    pub(super) fn run_progress_thread(&self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut owners: Vec<usize> = Vec::new();
        let mut ends_seen = 0;
        let mut last_end = Instant::now();
        // Whether the last sleep ran out with nothing to do (then the next may be long).
        let mut idle = false;
        // Whether there are shared-memory sleep flags to raise (links are made before this
        // thread starts).
        let shm = self.watch.iter().any(Option::is_some);
        while !self.stop.load(Ordering::Acquire) {
            fds.clear();
            owners.clear();
            fds.push(libc::pollfd {
                fd: self.wake_rx.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            // Leave the sockets to waiters while they spin, and for a grace period after, so
            // that back-to-back waits do not have two threads fighting over each socket. The
            // grace counts from when this thread noticed that a spin ended (at most one poll
            // timeout late), so that waiters need not read the clock.
            let word = self.spinning.load(Ordering::Acquire);
            let now = Instant::now();
            if word / SPIN_ENDED != ends_seen {
                ends_seen = word / SPIN_ENDED;
                last_end = now;
            }
            let spinning = word & SPINNERS != 0
                || (!self.handoff.load(Ordering::Acquire)
                    && now.duration_since(last_end) < SPIN_GRACE);
            self.watching.store(!spinning, Ordering::Release);
            let mut busy = false;
            if !spinning {
                let mut st = self.lock();
                st.poll_set(&mut fds, &mut owners, true);
                busy = st.prepare_sleep();
                if !busy && shm {
                    drop(st);
                    busy = self.recheck();
                }
            }
            let timeout_ms = match (busy, spinning) {
                (true, _) => 0,
                (false, true) => 1,
                // Soon after traffic, sleep at most 10 ms: a doorbell missed against the
                // argument of `RECHECK` costs no more than that.
                (false, false) if idle => 100,
                (false, false) => 10,
            };
            // SAFETY: `fds` is a live, exclusively borrowed Vec of initialised pollfd structs and
            // its length is passed alongside; poll(2) only writes the `revents` fields.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if n > 0 && fds[0].revents != 0 {
                let mut sink = [0u8; 64];
                while matches!((&self.wake_rx).read(&mut sink), Ok(k) if k > 0) {}
            }
            if !spinning {
                let mut st = self.lock();
                st.woke();
                let moved = st.progress_ready(&fds[1..], &owners, true);
                if n == 0 && timeout_ms > 0 && moved && shm {
                    tracing::debug!(
                        target: "distcomm::shm",
                        rank = self.rank,
                        "a doorbell was missed: work was waiting after a sleep of {timeout_ms} ms"
                    );
                }
                idle = n == 0 && !moved;
            }
        }
    }

    /// After raising the sleep flags and finding nothing to do: waits [`RECHECK`] and looks
    /// once more (see there). Returns whether something came meanwhile.
    fn recheck(&self) -> bool {
        let start = Instant::now();
        while start.elapsed() < RECHECK {
            if self.yield_spin {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        self.lock().prepare_sleep()
    }
}

/// How long after raising its shared-memory sleep flags (and finding nothing to do) the
/// progress thread looks once more before it sleeps. A peer publishing (a message, an answer,
/// room in a ring) reads our flags right after, without a fence between (one would put a
/// cache-line transfer on the way of every small message: 6-14 % of a shared-memory ping-pong
/// of 8-128 B): it may read them an instant before they went up, while what it published has
/// not left its core yet, and not ring. A store leaves its core within the time the core takes
/// to own the line (a fraction of a microsecond; at once when it is preempted), so this second
/// look sees what such a peer published. From then on the flags are up, and a peer publishing
/// later sees them and rings. (A sleep instead of this wait cost the ranks a wake-up whenever
/// it ran out: +25 % on a ping-pong driven by doorbells alone, `DISTCOMM_SPIN_US=0`.) Neither
/// the processor's manual nor the language bounds how long a store takes to leave its core:
/// should one take longer, the sleep soon after traffic lasts at most 10 ms, and the loop logs
/// the miss (target `distcomm::shm`, debug level).
const RECHECK: Duration = Duration::from_micros(2);

/// poll(2) without waiting; returns the number of ready descriptors (0 on error).
pub(super) fn poll_now(fds: &mut [libc::pollfd]) -> i32 {
    // SAFETY: `fds` is an exclusively borrowed slice of initialised pollfd structs whose length is
    // passed alongside; poll(2) only writes their `revents` fields.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) }
}
