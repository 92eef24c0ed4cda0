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
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A group's issue order.
#[derive(Default)]
pub(crate) struct Order {
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    /// Sequence number of the next turn to issue.
    issued: u32,
    /// Every turn below this one has passed.
    serving: u32,
    /// Turns passed before their predecessors.
    early: BTreeSet<u32>,
    waiters: usize,
}

impl Order {
    /// The next turn, in program order; its number is the collective's sequence number.
    pub(crate) fn issue(self: &Arc<Self>) -> Turn {
        let mut s = self.lock();
        let no = s.issued;
        s.issued = s.issued.wrapping_add(1);
        Turn {
            order: Some(self.clone()),
            no,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pass(&self, no: u32) {
        let mut s = self.lock();
        if s.serving != no {
            s.early.insert(no);
            return;
        }
        s.serving = no.wrapping_add(1);
        loop {
            let next = s.serving;
            if !s.early.remove(&next) {
                break;
            }
            s.serving = next.wrapping_add(1);
        }
        if s.waiters > 0 {
            self.cv.notify_all();
        }
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
        let mut s = order.lock();
        if s.serving == self.no {
            return Ok(());
        }
        let since = Instant::now();
        while s.serving != self.no {
            let left = timeout.saturating_sub(since.elapsed());
            if left.is_zero() {
                return Err(Error::Timeout {
                    op,
                    rank,
                    peer: None,
                    after: timeout,
                });
            }
            s.waiters += 1;
            s = order
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            s.waiters -= 1;
        }
        Ok(())
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
}
