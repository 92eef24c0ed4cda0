//! Issue order: the one mechanism that keeps a group's collectives in the order the program
//! issued them, whatever thread runs them (blocking calls run in the caller's thread, async ones
//! on the group's collective thread, so a blocking call can overtake an async one in flight).
//!
//! Every collective takes a [`Turn`] when it is issued, numbered like its sequence number. A
//! backend for which order matters (MPI: every rank must start a communicator's collectives in
//! one order; the shared-memory arena: every rank must enter it in one order) waits for its turn
//! ([`Turn::wait`]: every earlier call has passed its own) and passes it once its call has
//! started where order matters; dropping a turn passes it. Backends that match messages by
//! sequence number never wait: their turns pass as they are dropped.
//!
//! Owns: the counter and the waiting. Must not know: what a collective does.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A group's issue order. The common case (turns passed in order, nobody waiting) takes no
/// lock: issuing, waiting for a turn already served and passing it are one atomic operation
/// each; turns passed early and sleeping waiters take the lock.
#[derive(Default)]
pub(crate) struct Order {
    /// Sequence number of the next turn to issue.
    issued: AtomicU32,
    /// Every turn below this one has passed. Advanced by the owner of the turn it names, or
    /// under the lock for a turn in `early`.
    serving: AtomicU32,
    /// Turns in `early` plus threads waiting: when 0, a pass needs neither lock nor wake-up.
    /// (Sequentially consistent with `serving`: a waiter counts itself before it looks at
    /// `serving`, a passer advances `serving` before it looks here, so one of them sees the
    /// other.)
    others: AtomicUsize,
    /// Turns passed before their predecessors.
    early: Mutex<BTreeSet<u32>>,
    cv: Condvar,
}

impl Order {
    /// The next turn, in program order; its number is the collective's sequence number.
    pub(crate) fn issue(self: &Arc<Self>) -> Turn {
        let no = self.issued.fetch_add(1, Ordering::Relaxed);
        Turn {
            order: Some(self.clone()),
            no,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        self.early.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pass(&self, no: u32) {
        let next = no.wrapping_add(1);
        let served = self
            .serving
            .compare_exchange(no, next, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        if served && self.others.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut early = self.lock();
        if !served {
            early.insert(no);
            self.others.fetch_add(1, Ordering::SeqCst);
        }
        // Serve the turns passed early that are due now (the lock makes this the only place
        // that advances a number in `early`: its owner passed it already).
        loop {
            let due = self.serving.load(Ordering::SeqCst);
            if !early.remove(&due) {
                break;
            }
            self.others.fetch_sub(1, Ordering::SeqCst);
            self.serving.store(due.wrapping_add(1), Ordering::SeqCst);
        }
        self.cv.notify_all();
    }
}

/// One collective's place in its group's [`Order`]. Dropping it passes it on.
#[must_use = "a turn passes when it is dropped"]
pub(crate) struct Turn {
    order: Option<Arc<Order>>,
    no: u32,
}

impl Turn {
    /// The collective's sequence number (its tag on the wire).
    pub(crate) fn no(&self) -> u32 {
        self.no
    }

    /// Waits until every collective issued before this one has passed its turn, up to
    /// `timeout`; `op` and `rank` name the call in the timeout error.
    pub(crate) fn wait(&self, op: &'static str, rank: usize, timeout: Duration) -> Result<()> {
        let Some(order) = &self.order else {
            return Ok(());
        };
        if order.serving.load(Ordering::SeqCst) == self.no {
            return Ok(());
        }
        let since = Instant::now();
        let mut early = order.lock();
        order.others.fetch_add(1, Ordering::SeqCst);
        let mut result = Ok(());
        while order.serving.load(Ordering::SeqCst) != self.no {
            let left = timeout.saturating_sub(since.elapsed());
            if left.is_zero() {
                result = Err(Error::Timeout {
                    op,
                    rank,
                    peer: None,
                    after: timeout,
                });
                break;
            }
            early = order
                .cv
                .wait_timeout(early, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        order.others.fetch_sub(1, Ordering::SeqCst);
        drop(early);
        result
    }

    fn release(&mut self) {
        if let Some(order) = self.order.take() {
            order.pass(self.no);
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_pass_in_issue_order_whatever_order_they_are_dropped() {
        let order = Arc::new(Order::default());
        let (a, b, c) = (order.issue(), order.issue(), order.issue());
        assert_eq!((a.no(), b.no(), c.no()), (0, 1, 2));
        let t = Duration::from_millis(20);
        assert!(a.wait("x", 0, t).is_ok());
        assert!(matches!(c.wait("x", 0, t), Err(Error::Timeout { .. })));
        drop(b); // passed early: c still waits for a
        assert!(c.wait("x", 0, t).is_err());
        let waiter = std::thread::spawn(move || c.wait("x", 0, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(10));
        drop(a);
        assert!(waiter.join().unwrap().is_ok());
    }

    #[test]
    fn turns_taken_by_racing_threads_are_served_in_issue_order() {
        // Turns handed to threads that wait and pass them in whatever order the scheduler
        // runs them: every one is served, each after all those issued before it.
        for _ in 0..20 {
            let order = Arc::new(Order::default());
            let served = Arc::new(Mutex::new(Vec::new()));
            let turns: Vec<Turn> = (0..16).map(|_| order.issue()).collect();
            let threads: Vec<_> = turns
                .into_iter()
                .rev()
                .map(|t| {
                    let served = served.clone();
                    std::thread::spawn(move || {
                        t.wait("x", 0, Duration::from_secs(10)).unwrap();
                        served.lock().unwrap().push(t.no());
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(*served.lock().unwrap(), (0..16).collect::<Vec<u32>>());
        }
    }
}
