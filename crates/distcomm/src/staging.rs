//! Operations on device buffers the transport cannot address, staged through host memory,
//! directionally (design contract 5):
//!
//! * a staged **isend** is input-only: one device → host copy when it is posted; the host copy
//!   lives with the operation until the transport is done with it; nothing is copied back (the
//!   device buffer comes back untouched);
//! * a staged **irecv** is output-only: the host target is allocated without reading the device
//!   buffer, and copied host → device exactly once, only after the transport confirmed success.
//!   A failed, timed-out or aborted receive publishes nothing — not even partially — and keeps
//!   its error for `wait()`;
//! * [`StagedWork::is_completed`] publishes a finished receive (exactly once) before it returns
//!   true, and never waits for in-flight work; repeated `wait()`/`is_completed()` are idempotent;
//! * a staged **all_reduce** copies in once and out once.
//!
//! Point-to-point buffers of a device whose memory the transports address
//! ([`Host`](crate::device::Host)) go straight through: no copy. Every copy is counted per operation ([`StagedWork::copies`]) and
//! per process ([`totals`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::collectives::Pool;
use crate::device::Device;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Reducible};
use crate::work::{Status, Work};
use crate::ProcessGroup;

/// Copies made by staging: how many, how many bytes, how long they took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    pub copies: u64,
    pub bytes: u64,
    pub time: Duration,
}

static COPIES: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);
static NANOS: AtomicU64 = AtomicU64::new(0);

/// Every staged copy this process made so far.
pub fn totals() -> CopyStats {
    CopyStats {
        copies: COPIES.load(Ordering::Relaxed),
        bytes: BYTES.load(Ordering::Relaxed),
        time: Duration::from_nanos(NANOS.load(Ordering::Relaxed)),
    }
}

impl CopyStats {
    /// Runs one copy of `bytes` bytes, counting it here and in the process totals.
    fn count<R>(&mut self, bytes: usize, copy: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let r = copy();
        let took = t.elapsed();
        self.copies += 1;
        self.bytes += bytes as u64;
        self.time += took;
        COPIES.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
        NANOS.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Send,
    Recv,
}

struct State<D: Device, E> {
    /// The transfer, until it is terminal and its outcome taken.
    work: Option<Work<Vec<E>>>,
    /// The device buffer: a send's source, a receive's target.
    device: Option<D::Buffer>,
    /// The terminal outcome, once taken (published, for a successful receive).
    outcome: Option<Result<Status>>,
    stats: CopyStats,
}

/// A staged (or direct) point-to-point operation on a device buffer. Like a [`Work`], with
/// the device buffer back from [`into_buffer`](StagedWork::into_buffer).
#[must_use = "a StagedWork should be waited; dropping it detaches the operation"]
///
/// `E` is the element type of the host copy: bytes for point-to-point, the reduced type for a
/// collective.
pub struct StagedWork<D: Device, E: Element = u8> {
    dev: Arc<D>,
    /// Where the host copy goes back once the transfer is done (the group's scratch pool, so
    /// that repeated staging does not fault in fresh pages every time).
    pool: Arc<Pool>,
    dir: Dir,
    /// Whether the transport works on the buffer itself (nothing staged).
    direct: bool,
    state: Mutex<State<D, E>>,
}

impl<D: Device, E: Element + Reducible> StagedWork<D, E> {
    fn lock(&self) -> std::sync::MutexGuard<'_, State<D, E>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True once the operation is terminal — and, for a successful staged receive, its data
    /// is on the device (published here, once). Never waits for the transfer.
    pub fn is_completed(&self) -> bool {
        let mut st = self.lock();
        if st.outcome.is_some() {
            return true;
        }
        if !st.work.as_ref().is_some_and(|w| w.is_completed()) {
            return false;
        }
        self.finish(&mut st);
        true
    }

    /// Waits up to the group's timeout (see [`wait_timeout`](Self::wait_timeout)).
    pub fn wait(&mut self) -> Result<Status> {
        let timeout = {
            let st = self.lock();
            st.work.as_ref().map(|w| w.default_timeout())
        };
        self.wait_timeout(timeout.unwrap_or(Duration::ZERO))
    }

    /// Waits up to `timeout`. On timeout nothing is published and the operation stays pending
    /// (wait again later); a failed operation publishes nothing and keeps its error.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Status> {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if st.outcome.is_none() {
            if let Some(w) = st.work.as_mut() {
                match w.wait_timeout(timeout) {
                    Err(e) if e.is_timeout() => return Err(e),
                    _ => {}
                }
            }
        }
        let mut st = self.lock();
        if st.outcome.is_none() {
            self.finish(&mut st);
        }
        st.outcome.clone().unwrap_or_else(|| {
            Err(Error::Aborted {
                op: "staged",
                rank: 0,
                reason: "no outcome".into(),
            })
        })
    }

    /// Waits, then gives the device buffer back: a receive's with the data in it, a send's
    /// untouched. A failed operation returns its error (the buffer is dropped unpublished).
    pub fn into_buffer(mut self) -> Result<D::Buffer> {
        self.wait()?;
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        st.device.take().ok_or_else(|| Error::Aborted {
            op: "staged",
            rank: 0,
            reason: "buffer already taken".into(),
        })
    }

    /// The copies this operation made so far.
    pub fn copies(&self) -> CopyStats {
        self.lock().stats
    }

    /// Takes the terminal outcome of the transfer; for a successful staged receive, uploads
    /// the data (the only host → device copy it ever makes).
    fn finish(&self, st: &mut State<D, E>) {
        let Some(mut w) = st.work.take() else { return };
        let outcome = match w.wait_timeout(Duration::ZERO) {
            Err(e) => Err(e),
            Ok(status) => match w.into_buffer() {
                Err(e) => Err(e),
                Ok(host) => self.land(st, host, status.bytes).map(|()| status),
            },
        };
        st.outcome = Some(outcome);
    }

    /// Where the host buffer of a finished transfer goes (`n`: the bytes it carried).
    fn land(&self, st: &mut State<D, E>, host: Vec<E>, n: usize) -> Result<()> {
        if self.direct {
            // The transport worked on the device buffer itself: it is the buffer (only byte
            // buffers are ever direct).
            let any: Box<dyn std::any::Any> = Box::new(host);
            let bytes = any.downcast::<Vec<u8>>().map(|b| *b).unwrap_or_default();
            st.device = self.dev.buffer_of_host(bytes);
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(&host);
        let r = self.publish(st, &bytes[..n.min(bytes.len())]);
        self.pool.give(host);
        r
    }

    /// A successful staged receive's data to the device: its one host → device copy (of what
    /// arrived: a shorter message leaves the rest of the device buffer as it was).
    fn publish(&self, st: &mut State<D, E>, host: &[u8]) -> Result<()> {
        if self.dir == Dir::Send {
            return Ok(());
        }
        let State { device, stats, .. } = st;
        let Some(dev_buf) = device.as_mut() else {
            return Ok(());
        };
        stats.count(host.len(), || self.dev.upload(host, dev_buf))
    }
}

impl ProcessGroup {
    /// Starts sending a device buffer to `dst`: staged through one device → host copy made
    /// now (nothing is ever copied back), or sent directly when the transport addresses the
    /// device's memory. The device buffer comes back from
    /// [`StagedWork::into_buffer`], untouched.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// use std::sync::Arc;
    /// use distcomm::device::{Device, Emulated};
    /// let g = distcomm::init()?;
    /// let dev = Arc::new(Emulated);
    /// let buf = dev.alloc(1024)?;
    /// let w = g.isend_device(&dev, buf, 1, 0)?;
    /// assert_eq!(w.copies().copies, 1); // device -> host, once
    /// let _buf = w.into_buffer()?;
    /// # Ok(()) }
    /// ```
    pub fn isend_device<D: Device>(
        &self,
        dev: &Arc<D>,
        buf: D::Buffer,
        dst: usize,
        tag: u32,
    ) -> Result<StagedWork<D>> {
        let mut stats = CopyStats::default();
        let (work, device, direct) = match dev.host_memory(buf) {
            Ok(host) => (self.isend_bytes(host, dst, tag)?, None, true),
            Err(buf) => {
                let mut host = self.staging_buffer(dev.len(&buf));
                let n = host.len();
                stats.count(n, || dev.download(&buf, &mut host))?;
                (self.isend_bytes(host, dst, tag)?, Some(buf), false)
            }
        };
        Ok(self.staged(dev, Dir::Send, direct, work, device, stats))
    }

    /// Starts receiving into a device buffer from `src`: into a host buffer allocated without
    /// reading the device buffer, published with one host → device copy after the transfer
    /// succeeded (by `wait`, `into_buffer` or `is_completed`); or directly when the transport
    /// addresses the device's memory.
    pub fn irecv_device<D: Device>(
        &self,
        dev: &Arc<D>,
        buf: D::Buffer,
        src: usize,
        tag: u32,
    ) -> Result<StagedWork<D>> {
        let (work, device, direct) = match dev.host_memory(buf) {
            Ok(host) => (self.irecv_bytes(host, src, tag)?, None, true),
            Err(buf) => {
                let host = self.staging_buffer(dev.len(&buf));
                (self.irecv_bytes(host, src, tag)?, Some(buf), false)
            }
        };
        let stats = CopyStats::default();
        Ok(self.staged(dev, Dir::Recv, direct, work, device, stats))
    }

    /// All-reduces a device buffer of `T` elements in place, staged with one copy in and one
    /// copy out. On failure the device buffer is untouched. Returns the copies made.
    pub fn all_reduce_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        buf: &mut D::Buffer,
        op: ReduceOp,
    ) -> Result<CopyStats> {
        let mut stats = CopyStats::default();
        let n = dev.len(buf);
        let mut host: Vec<T> = self.whole_elements("all_reduce", n)?;
        stats.count(n, || dev.download(buf, bytemuck::cast_slice_mut(&mut host)))?;
        let r = self.all_reduce(&mut host, op);
        if r.is_ok() {
            stats.count(n, || dev.upload(bytemuck::cast_slice(&host), buf))?;
        }
        self.inner.pool.give(host);
        r.map(|()| stats)
    }
}

impl ProcessGroup {
    /// Async [`all_reduce_device`](Self::all_reduce_device): one device → host copy now, the
    /// reduction on the group's collective thread, and the host → device copy only inside
    /// completion (`wait`, `is_completed`, `into_buffer`), after success; a failed reduction
    /// leaves the device buffer as it was.
    pub fn all_reduce_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        buf: D::Buffer,
        op: ReduceOp,
    ) -> Result<StagedWork<D, T>> {
        let mut stats = CopyStats::default();
        let n = dev.len(&buf);
        let mut host: Vec<T> = self.whole_elements("all_reduce", n)?;
        stats.count(n, || {
            dev.download(&buf, bytemuck::cast_slice_mut(&mut host))
        })?;
        let work = self.all_reduce_async(host, op)?;
        Ok(self.staged(dev, Dir::Recv, false, work, Some(buf), stats))
    }

    /// A host buffer for `n` bytes of `T`, or why there is none.
    fn whole_elements<T: Reducible>(&self, op: &'static str, n: usize) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        if n % size != 0 {
            return Err(Error::InvalidArgument {
                op,
                rank: self.rank(),
                detail: format!(
                    "a device buffer of {n} bytes is not a whole number of {}",
                    T::DTYPE
                ),
            });
        }
        Ok(self.inner.pool.take_len(n / size))
    }

    /// A host buffer of `len` bytes from the group's pool, not cleared (a receive's target is
    /// overwritten by the message and only what arrived is uploaded; a send's by its download;
    /// clearing 64 MiB cost a quarter of a staged receive) and never read from the device.
    fn staging_buffer(&self, len: usize) -> Vec<u8> {
        self.inner.pool.take_len(len)
    }

    fn staged<D: Device, E: Element>(
        &self,
        dev: &Arc<D>,
        dir: Dir,
        direct: bool,
        work: Work<Vec<E>>,
        device: Option<D::Buffer>,
        stats: CopyStats,
    ) -> StagedWork<D, E> {
        StagedWork {
            dev: dev.clone(),
            pool: self.inner.pool.clone(),
            dir,
            direct,
            state: Mutex::new(State {
                work: Some(work),
                device,
                outcome: None,
                stats,
            }),
        }
    }
}
