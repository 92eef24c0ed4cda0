//! The completion state machine of a staged operation, on its own so that it can be model
//! checked with [loom](https://docs.rs/loom) (`RUSTFLAGS="--cfg loom" cargo test -p distcomm
//! --lib --release settle`): every interleaving of `wait` and `is_completed` on two threads
//! with the transfer finishing on a third.
//!
//! The outcome is settled exactly once, under the lock, and only once the transfer is
//! terminal; settling is where a staged receive publishes (its one host → device copy), so a
//! caller that sees the outcome sees the data published, and nobody publishes twice. Polling
//! never waits, not even for another thread's publication.

use crate::completion::Status;
use crate::error::{Error, Result};

#[cfg(loom)]
use loom::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex, MutexGuard,
};
use std::sync::TryLockError;
#[cfg(not(loom))]
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex, MutexGuard,
};

/// The outcome of an operation once settled, and the state `S` settling works on.
pub(crate) struct Settle<S> {
    inner: Mutex<(Option<Result<Status>>, S)>,
    /// Set once the outcome is (after the publication it covers).
    settled: AtomicBool,
}

impl<S> Settle<S> {
    pub(crate) fn new(state: S) -> Self {
        Settle {
            inner: Mutex::new((None, state)),
            settled: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (Option<Result<Status>>, S)> {
        // A panic while settling leaves a plain Option and the state; both stay usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The outcome, settling it with `settle` first if the transfer is `terminal` and nobody
    /// has yet; `None` while the transfer is in flight. Never waits for the transfer (it may
    /// wait for another thread's settling to finish: see [`is_settled`](Self::is_settled)).
    pub(crate) fn poll(
        &self,
        terminal: impl FnOnce() -> bool,
        settle: impl FnOnce(&mut S) -> Result<Status>,
    ) -> Option<Result<Status>> {
        let mut g = self.lock();
        self.settle_locked(&mut g, terminal, settle);
        g.0.clone()
    }

    /// Whether the outcome is settled, settling it first if the transfer is `terminal` and
    /// nobody else is busy with the state. Never waits at all: while another thread holds the
    /// state (publishing a large receive, say) this says `false`, and once it said `true` it
    /// always does.
    pub(crate) fn is_settled(
        &self,
        terminal: impl FnOnce() -> bool,
        settle: impl FnOnce(&mut S) -> Result<Status>,
    ) -> bool {
        if self.settled.load(Ordering::Acquire) {
            return true;
        }
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        self.settle_locked(&mut g, terminal, settle)
    }

    /// Under the lock: settles once, if the transfer is `terminal`. Returns whether settled.
    fn settle_locked(
        &self,
        g: &mut (Option<Result<Status>>, S),
        terminal: impl FnOnce() -> bool,
        settle: impl FnOnce(&mut S) -> Result<Status>,
    ) -> bool {
        if g.0.is_none() {
            if !terminal() {
                return false;
            }
            g.0 = Some(settle(&mut g.1));
            self.settled.store(true, Ordering::Release);
        }
        true
    }

    /// Waits for the transfer with `block` (outside the lock, so that `poll` on another thread
    /// never waits behind it), then settles. An error from `block` (a timeout) settles nothing.
    pub(crate) fn wait(
        &self,
        terminal: impl FnOnce() -> bool,
        block: impl FnOnce() -> Result<()>,
        settle: impl FnOnce(&mut S) -> Result<Status>,
    ) -> Result<Status> {
        if !terminal() {
            block()?;
        }
        self.poll(|| true, settle).unwrap_or_else(|| {
            Err(Error::Aborted {
                op: "staged",
                rank: 0,
                reason: "internal: no outcome after a terminal transfer".into(),
            })
        })
    }

    /// Runs `f` on the state.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self.lock().1)
    }
}

#[cfg(all(test, loom))]
mod model {
    use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use loom::sync::Arc;
    use loom::thread;

    use super::Settle;
    use crate::completion::Status;

    fn status() -> Status {
        Status {
            peer: 1,
            tag: 0,
            bytes: 8,
        }
    }

    /// `wait` on one thread and `is_completed`-style polling on another race while the
    /// transfer finishes on a third: the data is published exactly once, and whoever sees the
    /// outcome sees it published.
    #[test]
    fn wait_and_poll_race_publish_once() {
        loom::model(|| {
            let done = Arc::new(AtomicBool::new(false));
            // Publishes so far, counted inside settling (the state is the device buffer's
            // stand-in: how many times it was written).
            let settle = Arc::new(Settle::new(0usize));
            let seen = Arc::new(AtomicUsize::new(0));

            let transfer = {
                let done = done.clone();
                thread::spawn(move || done.store(true, Ordering::Release))
            };
            let poller = {
                let (done, settle, seen) = (done.clone(), settle.clone(), seen.clone());
                thread::spawn(move || {
                    let publish = |n: &mut usize| {
                        *n += 1;
                        Ok(status())
                    };
                    if settle.is_settled(|| done.load(Ordering::Acquire), publish) {
                        assert_eq!(settle.with(|n| *n), 1, "completed but not published");
                        let r = settle.poll(|| true, |_| unreachable!());
                        assert_eq!(r.and_then(|r| r.ok()).map(|s| s.bytes), Some(8));
                        assert!(settle.is_settled(|| false, |_| unreachable!()), "sticky");
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                })
            };
            let block = || {
                while !done.load(Ordering::Acquire) {
                    thread::yield_now();
                }
                Ok(())
            };
            let publish = |n: &mut usize| {
                *n += 1;
                Ok(status())
            };
            let r = settle.wait(|| done.load(Ordering::Acquire), block, publish);
            assert_eq!(r.map(|s| s.bytes).ok(), Some(8));
            assert_eq!(settle.with(|n| *n), 1, "waited but not published");
            transfer.join().unwrap();
            poller.join().unwrap();
            // Repeated completion is idempotent.
            assert!(settle.poll(|| true, |_| unreachable!()).is_some());
            assert_eq!(settle.with(|n| *n), 1, "published twice");
        });
    }

    /// A timed-out wait settles nothing; a later poll settles once.
    #[test]
    fn a_timed_out_wait_publishes_nothing() {
        loom::model(|| {
            let settle = Settle::new(0usize);
            let timeout = || {
                Err(crate::Error::Aborted {
                    op: "model",
                    rank: 0,
                    reason: "timeout".into(),
                })
            };
            assert!(settle.wait(|| false, timeout, |_| unreachable!()).is_err());
            assert_eq!(settle.with(|n| *n), 0);
            assert!(settle.poll(|| false, |_| unreachable!()).is_none());
        });
    }
}
