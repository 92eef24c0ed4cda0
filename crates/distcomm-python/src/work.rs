//! Handles of operations as Python sees them, and the issue-order queue of a group's
//! asynchronous collectives.
//!
//! A [`Work`] is a point-to-point operation in distcomm's engine or a collective on the
//! group's queue (a synchronous collective has no handle: it is done when its call returns). Its outcome is sticky; waits release the GIL; `is_completed` never
//! blocks. Dropping a Python handle never withdraws its operation: the operation owns the
//! tensors it touches (through [`distcomm::Lent`] or the job's closure) until it ends.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use distcomm::{Error, Lent, Result, Status};
use pyo3::prelude::*;

use crate::errors::to_py;

/// The outcome of a finished operation: the peer (source of a receive) and bytes moved.
type Outcome = Result<Status>;

/// A completion cell for operations run by the queue.
#[derive(Default)]
pub struct Done {
    slot: Mutex<Option<Outcome>>,
    cv: Condvar,
}

impl Done {
    fn set(&self, r: Outcome) {
        let mut s = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            *s = Some(r);
        }
        self.cv.notify_all();
    }

    fn get(&self) -> Option<Outcome> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn wait(&self, timeout: Duration) -> Option<Outcome> {
        let deadline = Instant::now() + timeout;
        let mut s = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = &*s {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = self
                .cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

pub type Job = Box<dyn FnOnce() -> Outcome + Send>;

/// A queued job and the cell its outcome goes to.
type Queued = (Job, Arc<Done>);

/// Runs a group's collectives in issue order: a synchronous call runs in its caller's thread
/// when nothing is queued before it, everything else on the group's own thread.
pub struct Queue {
    name: String,
    rank: usize,
    tx: Mutex<Option<mpsc::Sender<Queued>>>,
    /// Jobs queued or running.
    pending: Arc<AtomicUsize>,
}

impl Queue {
    pub fn new(name: String, rank: usize) -> Queue {
        Queue {
            name,
            rank,
            tx: Mutex::new(None),
            pending: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Runs `job`. A synchronous call runs at once in this thread when nothing is queued
    /// before it, else waits for its turn; either way it returns `None` once done (or raises
    /// its error), with the GIL released meanwhile. An asynchronous call is queued and returns
    /// its handle.
    pub fn submit(
        &self,
        py: Python<'_>,
        op: &'static str,
        sync: bool,
        timeout: Duration,
        job: Job,
    ) -> PyResult<Option<Work>> {
        if sync && self.pending.load(Ordering::Acquire) == 0 {
            return match py.detach(job) {
                Ok(_) => Ok(None),
                Err(e) => Err(to_py(py, &e)),
            };
        }
        let done = Arc::new(Done::default());
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (t, rx) = mpsc::channel::<Queued>();
            let pending = self.pending.clone();
            std::thread::Builder::new()
                .name(format!("distcomm-{}", self.name))
                .spawn(move || {
                    while let Ok((job, done)) = rx.recv() {
                        let r = job();
                        pending.fetch_sub(1, Ordering::AcqRel);
                        done.set(r);
                    }
                })
                .map_err(|e| to_py(py, &Error::io("spawn the collective thread", e)))?;
            *tx = Some(t);
        }
        self.pending.fetch_add(1, Ordering::AcqRel);
        let sent = tx
            .as_ref()
            .is_some_and(|t| t.send((job, done.clone())).is_ok());
        if !sent {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            let e = Error::Aborted {
                op,
                rank: self.rank,
                reason: "the group's collective thread is gone".into(),
            };
            return Err(to_py(py, &e));
        }
        let w = Work::new(op, self.rank, State::Queued(done), timeout);
        if sync {
            w.block(py, timeout).map_err(|e| to_py(py, &e))?;
            return Ok(None);
        }
        Ok(Some(w))
    }
}

pub enum State {
    P2p(distcomm::Work<Lent>),
    Queued(Arc<Done>),
}

/// A handle on one operation (torch's `Work` delegates to it).
#[pyclass(module = "distcomm._distcomm", frozen)]
pub struct Work {
    op: &'static str,
    rank: usize,
    state: State,
    timeout: Duration,
    /// The terminal outcome, once seen.
    outcome: Mutex<Option<Outcome>>,
}

impl Work {
    pub fn new(op: &'static str, rank: usize, state: State, timeout: Duration) -> Work {
        Work {
            op,
            rank,
            state,
            timeout,
            outcome: Mutex::new(None),
        }
    }

    /// The outcome if terminal, without blocking.
    fn poll(&self) -> Option<Outcome> {
        let mut o = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        if o.is_none() {
            *o = match &self.state {
                State::P2p(w) => w.is_completed().then(|| w.wait_timeout(Duration::ZERO)),
                State::Queued(d) => d.get(),
            };
        }
        o.clone()
    }

    /// Blocks (without the GIL) until terminal or `timeout`; a timeout leaves it pending.
    fn block(&self, py: Python<'_>, timeout: Duration) -> Outcome {
        if let Some(r) = self.poll() {
            return r;
        }
        let r = py.detach(|| match &self.state {
            State::P2p(w) => match w.wait_timeout(timeout) {
                Err(e) if e.is_timeout() && !w.is_completed() => None,
                r => Some(r),
            },
            State::Queued(d) => d.wait(timeout),
        });
        match r {
            Some(r) => {
                *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(r.clone());
                r
            }
            None => Err(Error::Timeout {
                op: self.op,
                rank: self.rank,
                peer: None,
                after: timeout,
            }),
        }
    }
}

#[pymethods]
impl Work {
    /// Waits until the operation ends (at most `timeout` seconds; default: the group's
    /// timeout). Raises its error; a timeout raises and leaves the operation pending, so a
    /// later wait can still succeed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let t = match timeout {
            Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s),
            _ => self.timeout,
        };
        self.block(py, t).map(|_| true).map_err(|e| to_py(py, &e))
    }

    /// Whether the operation has ended (successfully or not). Never blocks.
    fn is_completed(&self) -> bool {
        self.poll().is_some()
    }

    /// Whether it ended successfully (false while pending).
    fn is_success(&self) -> bool {
        matches!(self.poll(), Some(Ok(_)))
    }

    /// The error it ended with, as the exception `wait` raises; None while pending or after a
    /// success.
    fn exception(&self, py: Python<'_>) -> Option<PyErr> {
        match self.poll() {
            Some(Err(e)) => Some(to_py(py, &e)),
            _ => None,
        }
    }

    /// The peer of a finished point-to-point operation (the source of a receive from any
    /// source), as a rank of the group; None while pending or failed.
    fn source_rank(&self) -> Option<usize> {
        match self.poll() {
            Some(Ok(st)) => Some(st.peer),
            _ => None,
        }
    }

    /// Bytes the operation moved (a receive: the message's length); None while pending.
    fn nbytes(&self) -> Option<usize> {
        match self.poll() {
            Some(Ok(st)) => Some(st.bytes),
            _ => None,
        }
    }

    /// The name of the operation.
    #[getter]
    fn op(&self) -> &'static str {
        self.op
    }

    fn __repr__(&self) -> String {
        let state = match self.poll() {
            None => "pending".to_string(),
            Some(Ok(_)) => "completed".to_string(),
            Some(Err(e)) => format!("failed: {e}"),
        };
        format!("<distcomm Work {} on rank {}: {state}>", self.op, self.rank)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // A pending receive's distcomm handle withdraws it when dropped; a torch user who drops
        // the handle expects the receive to happen anyway, so it is detached instead.
        if let State::P2p(_) = self.state {
            if let State::P2p(w) = std::mem::replace(&mut self.state, State::Queued(Arc::default()))
            {
                if !w.is_completed() {
                    w.detach();
                }
            }
        }
    }
}
