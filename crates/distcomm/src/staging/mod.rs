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
//! * a staged **collective** copies in what it reads and out what it writes, nothing more:
//!   `all_reduce` in + out; `broadcast` in on the root, out elsewhere; `reduce` in everywhere,
//!   out on the root; `all_gather`, `reduce_scatter`, `all_to_all` the input in and the output
//!   out; `gather` in everywhere, out on the root; `scatter` in on the root, out everywhere.
//!   A failed collective publishes nothing. Async collectives (every one but gather) copy in
//!   at issue and out only inside completion (`wait`, `is_completed`, `into_buffer`).
//!
//! Which buffers are staged is a question of capabilities
//! ([`ProcessGroup::addresses`]): buffers in memory the group's transports address go
//! straight through, with no copy (blocking collectives and point-to-point; async collectives
//! always stage). Every copy is counted per operation ([`StagedWork::copies`], the
//! [`CopyStats`] a blocking collective returns) and per process ([`totals`]).

mod settle;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::Device;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::reduce::{ReduceOp, Reducible};
use crate::work::{Status, Work};
use crate::ProcessGroup;
use settle::Settle;

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

/// What a staged operation holds until it is settled.
struct State<D: Device> {
    /// The device buffer: a send's source, a receive's or collective's target.
    device: Option<D::Buffer>,
    stats: CopyStats,
}

/// A staged (or direct) operation on a device buffer: a point-to-point transfer or an async
/// collective. Like a [`Work`] — [`wait`](Self::wait), [`wait_timeout`](Self::wait_timeout),
/// [`is_completed`](Self::is_completed), sticky outcomes — with the device buffer back from
/// [`into_buffer`](Self::into_buffer). Waiting and polling take `&self`, so one thread may
/// wait while another polls (the data is still published exactly once).
///
/// `E` is the element type of the host copy: bytes for point-to-point, the reduced type for a
/// collective.
#[must_use = "a StagedWork should be waited; dropping it detaches the operation"]
pub struct StagedWork<D: Device, E: Element = u8> {
    dev: Arc<D>,
    /// Where the host copy goes back once the transfer is done (the group's scratch pool, so
    /// that repeated staging does not fault in fresh pages every time).
    pool: Arc<Pool>,
    /// Whether a successful transfer is copied to the device (receives, collective outputs).
    publish: bool,
    /// Whether the transport works on the buffer itself (nothing staged).
    direct: bool,
    work: Work<Vec<E>>,
    state: Settle<State<D>>,
}

impl<D: Device, E: Element + Reducible> StagedWork<D, E> {
    /// True once the operation is terminal — and, for a successful staged receive, its data
    /// is on the device (published here, once). Never waits: not for the transfer, nor for
    /// another thread that is publishing (then it says `false` until that is done); once true,
    /// always true.
    pub fn is_completed(&self) -> bool {
        let terminal = || self.work.is_completed();
        self.state.is_settled(terminal, |st| self.finish(st))
    }

    /// Waits up to the group's timeout (see [`wait_timeout`](Self::wait_timeout)).
    pub fn wait(&self) -> Result<Status> {
        self.wait_timeout(self.work.default_timeout())
    }

    /// Waits up to `timeout`. On timeout nothing is published and the operation stays pending
    /// (wait again later); a failed operation publishes nothing and keeps its error.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Status> {
        let block = || match self.work.wait_timeout(timeout) {
            Err(e) if e.is_timeout() => Err(e),
            _ => Ok(()),
        };
        let terminal = || self.work.is_completed();
        self.state.wait(terminal, block, |st| self.finish(st))
    }

    /// Waits, then gives the device buffer back: a receive's with the data in it, a send's
    /// untouched. A failed operation returns its error (the buffer is dropped unpublished).
    pub fn into_buffer(self) -> Result<D::Buffer> {
        self.wait()?;
        self.state
            .with(|st| st.device.take())
            .ok_or_else(|| Error::Aborted {
                op: "staged",
                rank: 0,
                reason: "buffer already taken".into(),
            })
    }

    /// Gives up on the operation and returns the device buffer as it is now: published if the
    /// operation already succeeded, and otherwise — after a failure or a timeout — exactly as
    /// it was before the call. A pending receive that no message has matched is withdrawn; one
    /// in flight finishes into the host copy, which is discarded. `None` for a direct
    /// (unstaged) buffer the transport still holds, or whose operation failed.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// use std::{sync::Arc, time::Duration};
    /// use distcomm::device::{Device, Emulated};
    /// let g = distcomm::init()?;
    /// let dev = Arc::new(Emulated);
    /// let r = g.irecv_device(&dev, dev.alloc(64)?, 1, 0)?;
    /// if r.wait_timeout(Duration::from_millis(10)).is_err() {
    ///     let untouched = r.abandon();
    /// }
    /// # Ok(()) }
    /// ```
    pub fn abandon(self) -> Option<D::Buffer> {
        self.is_completed(); // settles (and publishes) what already finished
        self.state.with(|st| st.device.take())
    }

    /// The copies this operation made so far.
    pub fn copies(&self) -> CopyStats {
        self.state.with(|st| st.stats)
    }

    /// Settles a terminal transfer: its outcome, and for a successful staged receive the
    /// upload of the data (the only host → device copy it ever makes).
    fn finish(&self, st: &mut State<D>) -> Result<Status> {
        let status = self.work.wait_timeout(Duration::ZERO)?;
        let host = self.work.take_buffer()?;
        self.land(st, host, status.bytes).map(|()| status)
    }

    /// Where the host buffer of a finished transfer goes (`n`: the bytes it carried).
    fn land(&self, st: &mut State<D>, host: Vec<E>, n: usize) -> Result<()> {
        if self.direct {
            // The transport worked on the device buffer itself: it is the buffer (only byte
            // buffers are ever direct).
            let any: Box<dyn std::any::Any> = Box::new(host);
            let bytes = any.downcast::<Vec<u8>>().map(|b| *b).unwrap_or_default();
            st.device = self.dev.buffer_of_host(bytes);
            return Ok(());
        }
        let r = match (self.publish, st.device.as_mut()) {
            (true, Some(dev_buf)) => {
                // Of what arrived: a shorter message leaves the rest of the buffer as it was.
                let bytes: &[u8] = bytemuck::cast_slice(&host);
                let bytes = &bytes[..n.min(bytes.len())];
                st.stats
                    .count(bytes.len(), || self.dev.upload(bytes, dev_buf))
            }
            _ => Ok(()),
        };
        self.pool.give(host);
        r
    }
}

impl ProcessGroup {
    /// Starts sending a device buffer to `dst`: staged through one device → host copy made
    /// now (nothing is ever copied back), or sent directly when the group
    /// [`addresses`](Self::addresses) the device's memory. The device buffer comes back from
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
        let (work, device, direct) = match self.direct_bytes(dev.as_ref(), buf) {
            Ok(host) => (self.isend_bytes(host, dst, tag)?, None, true),
            Err(buf) => {
                let mut host = self.inner.pool.take_len(dev.len(&buf));
                let n = host.len();
                stats.count(n, || dev.download(&buf, &mut host))?;
                (self.isend_bytes(host, dst, tag)?, Some(buf), false)
            }
        };
        Ok(self.staged(dev, false, direct, work, device, stats))
    }

    /// Starts receiving into a device buffer from `src`: into a host buffer allocated without
    /// reading the device buffer, published with one host → device copy after the transfer
    /// succeeded (by `wait`, `into_buffer` or `is_completed`); or directly when the group
    /// [`addresses`](Self::addresses) the device's memory.
    pub fn irecv_device<D: Device>(
        &self,
        dev: &Arc<D>,
        buf: D::Buffer,
        src: usize,
        tag: u32,
    ) -> Result<StagedWork<D>> {
        let (work, device, direct) = match self.direct_bytes(dev.as_ref(), buf) {
            Ok(host) => (self.irecv_bytes(host, src, tag)?, None, true),
            Err(buf) => {
                // Not cleared: overwritten by the message, and only what arrived is uploaded.
                let host = self.inner.pool.take_len(dev.len(&buf));
                (self.irecv_bytes(host, src, tag)?, Some(buf), false)
            }
        };
        Ok(self.staged(dev, true, direct, work, device, CopyStats::default()))
    }

    /// The buffer as host memory when the group addresses the device's memory and the buffer
    /// is that; the buffer back otherwise.
    fn direct_bytes<D: Device>(
        &self,
        dev: &D,
        buf: D::Buffer,
    ) -> std::result::Result<Vec<u8>, D::Buffer> {
        if self.addresses(dev.memory()) {
            dev.host_memory(buf)
        } else {
            Err(buf)
        }
    }

    fn staged<D: Device, E: Element>(
        &self,
        dev: &Arc<D>,
        publish: bool,
        direct: bool,
        work: Work<Vec<E>>,
        device: Option<D::Buffer>,
        stats: CopyStats,
    ) -> StagedWork<D, E> {
        StagedWork {
            dev: dev.clone(),
            pool: self.inner.pool.clone(),
            publish,
            direct,
            work,
            state: Settle::new(State { device, stats }),
        }
    }
}

/// A collective's input on the host: the device buffer itself, or a staged copy of it.
enum In<'a, T> {
    Direct(&'a [T]),
    Staged(Vec<T>),
}

/// A collective's output (or in-place buffer) on the host: the device buffer itself, or a
/// host buffer to publish from.
enum Out<'a, D: Device, T> {
    Direct(&'a mut [T]),
    Staged(Vec<T>, &'a mut D::Buffer),
}

impl<T> In<'_, T> {
    fn slice(&self) -> &[T] {
        match self {
            In::Direct(s) => s,
            In::Staged(v) => v,
        }
    }
}

impl<D: Device, T> Out<'_, D, T> {
    fn slice(&mut self) -> &mut [T] {
        match self {
            Out::Direct(s) => s,
            Out::Staged(v, _) => v,
        }
    }
}

/// Stages the buffers of one blocking collective and counts its copies.
struct Stager<'a, D: Device> {
    g: &'a ProcessGroup,
    dev: &'a D,
    op: &'static str,
    /// Whether the group addresses the device's memory (buffers then go direct).
    direct: bool,
    stats: CopyStats,
}

impl<'a, D: Device> Stager<'a, D> {
    fn new(g: &'a ProcessGroup, dev: &'a D, op: &'static str) -> Self {
        let direct = g.addresses(dev.memory());
        Stager {
            g,
            dev,
            op,
            direct,
            stats: CopyStats::default(),
        }
    }

    /// The number of `T` in `buf`, or why it is not a whole number.
    fn elements<T: Reducible>(&self, buf: &D::Buffer) -> Result<usize> {
        let (n, size) = (self.dev.len(buf), std::mem::size_of::<T>());
        if n % size != 0 {
            return Err(self.g.inner.invalid(
                self.op,
                format!(
                    "a device buffer of {n} bytes is not a whole number of {}",
                    T::DTYPE
                ),
            ));
        }
        Ok(n / size)
    }

    /// Whether `buf` can be used in place as `[T]` (the group addresses it, and it is host
    /// memory aligned for `T`).
    fn in_place<T: Reducible>(&self, buf: &D::Buffer) -> bool {
        self.direct
            && self
                .dev
                .host_bytes(buf)
                .is_some_and(|b| bytemuck::try_cast_slice::<u8, T>(b).is_ok())
    }

    /// A buffer the collective reads: downloaded once (or used in place).
    fn input<'b, T: Reducible>(&mut self, buf: &'b D::Buffer) -> Result<In<'b, T>> {
        let n = self.elements::<T>(buf)?;
        if let Some(s) = self.dev.host_bytes(buf).filter(|_| self.direct) {
            if let Ok(s) = bytemuck::try_cast_slice::<u8, T>(s) {
                return Ok(In::Direct(s));
            }
        }
        self.download(buf, n).map(In::Staged)
    }

    /// `buf` (`n` elements of `T`) copied to a host buffer from the pool: one counted copy.
    fn download<T: Reducible>(&mut self, buf: &D::Buffer, n: usize) -> Result<Vec<T>> {
        let mut host: Vec<T> = self.g.inner.pool.take_len(n);
        let bytes = bytemuck::cast_slice_mut(&mut host);
        self.stats
            .count(bytes.len(), || self.dev.download(buf, bytes))?;
        Ok(host)
    }

    /// A buffer the collective writes: downloaded first if the collective also reads it
    /// (`read`), else a host buffer that never saw the device's contents.
    fn output<'b, T: Reducible>(
        &mut self,
        buf: &'b mut D::Buffer,
        read: bool,
    ) -> Result<Out<'b, D, T>> {
        let n = self.elements::<T>(buf)?;
        if self.in_place::<T>(buf) {
            // Checked just above: host bytes, aligned for `T`.
            let bytes = self.dev.host_bytes_mut(buf).unwrap_or_default();
            return Ok(Out::Direct(
                bytemuck::try_cast_slice_mut(bytes).unwrap_or_default(),
            ));
        }
        let host = match read {
            true => self.download(buf, n)?,
            false => self.g.inner.pool.take_len(n),
        };
        Ok(Out::Staged(host, buf))
    }

    /// Publishes a staged output after success (`ok`; once, one upload); a failed collective
    /// publishes nothing.
    fn publish<T: Reducible>(&mut self, out: Out<'_, D, T>, ok: bool) -> Result<()> {
        let Out::Staged(host, buf) = out else {
            return Ok(());
        };
        let r = if ok {
            let bytes: &[u8] = bytemuck::cast_slice(&host);
            self.stats
                .count(bytes.len(), || self.dev.upload(bytes, buf))
        } else {
            Ok(())
        };
        self.g.inner.pool.give(host);
        r
    }

    fn release<T: Reducible>(&self, input: In<'_, T>) {
        if let In::Staged(v) = input {
            self.g.inner.pool.give(v);
        }
    }

    /// A collective that reads all of `input` and writes all of `output` (all_gather,
    /// reduce_scatter, all_to_all): the input in, `run` on the host, the output out.
    fn in_out<T: Reducible>(
        mut self,
        input: &D::Buffer,
        output: &mut D::Buffer,
        run: impl FnOnce(&[T], &mut [T]) -> Result<()>,
    ) -> Result<CopyStats> {
        let inp = self.input::<T>(input)?;
        let mut out = self.output::<T>(output, false)?;
        let r = run(inp.slice(), out.slice());
        self.release(inp);
        self.finish(r, Some(out), true)
    }

    /// Finishes a collective whose result was `r` with its staged output `out`.
    fn finish<T: Reducible>(
        mut self,
        r: Result<()>,
        out: Option<Out<'_, D, T>>,
        publish: bool,
    ) -> Result<CopyStats> {
        if let Some(out) = out {
            self.publish(out, r.is_ok() && publish)?;
        }
        r.map(|()| self.stats)
    }
}

/// Blocking collectives on device buffers of `T` elements. Each stages exactly what it reads
/// and what it writes (see the [module](self) docs), publishes nothing when it fails, and
/// returns the copies it made.
impl ProcessGroup {
    /// [`all_reduce`](Self::all_reduce) of a device buffer in place: one copy in, one out.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// use distcomm::device::{Device, Emulated};
    /// let g = distcomm::init()?;
    /// let dev = Emulated;
    /// let mut grads = dev.alloc(4 * 1024)?;
    /// let copies = g.all_reduce_device::<_, f32>(&dev, &mut grads, distcomm::ReduceOp::Avg)?;
    /// assert_eq!(copies.copies, 2);
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        buf: &mut D::Buffer,
        op: ReduceOp,
    ) -> Result<CopyStats> {
        let mut s = Stager::new(self, dev, "all_reduce");
        let mut out = s.output::<T>(buf, true)?;
        let r = self.all_reduce(out.slice(), op);
        s.finish(r, Some(out), true)
    }

    /// [`broadcast`](Self::broadcast) of a device buffer: copied in on the root only (its
    /// buffer does not change), out on the others only (theirs is only written).
    pub fn broadcast_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        buf: &mut D::Buffer,
        root: usize,
    ) -> Result<CopyStats> {
        let mut s = Stager::new(self, dev, "broadcast");
        let is_root = self.rank() == root;
        let mut out = s.output::<T>(buf, is_root)?;
        let r = self.broadcast(out.slice(), root);
        s.finish(r, Some(out), !is_root)
    }

    /// [`reduce`](Self::reduce) of a device buffer: copied in everywhere, out on the root only
    /// (the other ranks' device buffers are left as they were).
    pub fn reduce_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        buf: &mut D::Buffer,
        root: usize,
        op: ReduceOp,
    ) -> Result<CopyStats> {
        let mut s = Stager::new(self, dev, "reduce");
        let mut out = s.output::<T>(buf, true)?;
        let r = self.reduce(out.slice(), root, op);
        s.finish(r, Some(out), self.rank() == root)
    }

    /// [`all_gather`](Self::all_gather) between device buffers: the input in, the output out.
    pub fn all_gather_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        input: &D::Buffer,
        output: &mut D::Buffer,
    ) -> Result<CopyStats> {
        Stager::new(self, dev, "all_gather")
            .in_out::<T>(input, output, |i, o| self.all_gather(i, o))
    }

    /// [`gather`](Self::gather) of device buffers: the input in everywhere, the output (the
    /// root's only) out.
    pub fn gather_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        input: &D::Buffer,
        output: Option<&mut D::Buffer>,
        root: usize,
    ) -> Result<CopyStats> {
        let mut s = Stager::new(self, dev, "gather");
        let inp = s.input::<T>(input)?;
        let mut out = match output {
            Some(b) => Some(s.output::<T>(b, false)?),
            None => None,
        };
        let r = self.gather(inp.slice(), out.as_mut().map(|o| o.slice()), root);
        s.release(inp);
        s.finish(r, out, true)
    }

    /// [`scatter`](Self::scatter) of the root's device buffer: its input in (root only), every
    /// rank's output out.
    pub fn scatter_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        input: Option<&D::Buffer>,
        output: &mut D::Buffer,
        root: usize,
    ) -> Result<CopyStats> {
        let mut s = Stager::new(self, dev, "scatter");
        let inp = match input {
            Some(b) => Some(s.input::<T>(b)?),
            None => None,
        };
        let mut out = s.output::<T>(output, false)?;
        let r = self.scatter(inp.as_ref().map(|i| i.slice()), out.slice(), root);
        if let Some(i) = inp {
            s.release(i);
        }
        s.finish(r, Some(out), true)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) between device buffers: the input in, this
    /// rank's block out.
    pub fn reduce_scatter_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        input: &D::Buffer,
        output: &mut D::Buffer,
        op: ReduceOp,
    ) -> Result<CopyStats> {
        Stager::new(self, dev, "reduce_scatter")
            .in_out::<T>(input, output, |i, o| self.reduce_scatter(i, o, op))
    }

    /// Equal [`all_to_all`](Self::all_to_all) between device buffers: the input in, the
    /// output out.
    pub fn all_to_all_device<D: Device, T: Reducible>(
        &self,
        dev: &D,
        input: &D::Buffer,
        output: &mut D::Buffer,
    ) -> Result<CopyStats> {
        Stager::new(self, dev, "all_to_all")
            .in_out::<T>(input, output, |i, o| self.all_to_all(i, o))
    }
}

/// Async collectives on device buffers: the input is copied in when the operation is issued,
/// the result out only inside completion ([`StagedWork::wait`], [`StagedWork::is_completed`],
/// [`StagedWork::into_buffer`]) after success; a failed collective leaves the device buffer as
/// it was. These always stage (their host forms move owned `Vec`s).
impl ProcessGroup {
    /// Async [`all_reduce_device`](Self::all_reduce_device).
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// use std::sync::Arc;
    /// use distcomm::device::{Device, Emulated};
    /// let g = distcomm::init()?;
    /// let dev = Arc::new(Emulated);
    /// let grads = dev.alloc(4 * 1024)?;
    /// let w = g.all_reduce_device_async::<_, f32>(&dev, grads, distcomm::ReduceOp::Sum)?;
    /// // ... compute overlaps the reduction ...
    /// let grads = w.into_buffer()?; // copied back here, once
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        buf: D::Buffer,
        op: ReduceOp,
    ) -> Result<StagedWork<D, T>> {
        let (host, stats) = self.stage_in::<D, T>(dev, &buf, "all_reduce")?;
        let work = self.all_reduce_async(host, op)?;
        Ok(self.staged(dev, true, false, work, Some(buf), stats))
    }

    /// Async [`broadcast_device`](Self::broadcast_device) (the root's buffer is not copied
    /// back: it does not change).
    pub fn broadcast_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        buf: D::Buffer,
        root: usize,
    ) -> Result<StagedWork<D, T>> {
        let is_root = self.rank() == root;
        let (host, stats) = if is_root {
            self.stage_in::<D, T>(dev, &buf, "broadcast")?
        } else {
            let n = Stager::new(self, dev.as_ref(), "broadcast").elements::<T>(&buf)?;
            (self.inner.pool.take_len(n), CopyStats::default())
        };
        let work = self.broadcast_async(host, root)?;
        Ok(self.staged(dev, !is_root, false, work, Some(buf), stats))
    }

    /// Async [`reduce_device`](Self::reduce_device) (copied back on the root only; the other
    /// ranks' device buffers are left as they were).
    pub fn reduce_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        buf: D::Buffer,
        root: usize,
        op: ReduceOp,
    ) -> Result<StagedWork<D, T>> {
        let (host, stats) = self.stage_in::<D, T>(dev, &buf, "reduce")?;
        let work = self.reduce_async(host, root, op)?;
        Ok(self.staged(dev, self.rank() == root, false, work, Some(buf), stats))
    }

    /// Async [`scatter_device`](Self::scatter_device): the root's `input` is copied in now
    /// (`None` elsewhere); the handle gives back `output`, this rank's block, written on
    /// completion.
    pub fn scatter_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        input: Option<&D::Buffer>,
        output: D::Buffer,
        root: usize,
    ) -> Result<StagedWork<D, T>> {
        let block = Stager::new(self, dev.as_ref(), "scatter").elements::<T>(&output)?;
        let (host, stats) = match input {
            Some(b) => self.stage_in::<D, T>(dev, b, "scatter")?,
            None => (Vec::new(), CopyStats::default()),
        };
        let work = self.scatter_async(host, block, root)?;
        Ok(self.staged(dev, true, false, work, Some(output), stats))
    }

    /// Async [`all_gather_device`](Self::all_gather_device): `input` is copied in now; the
    /// handle gives back `output`, written on completion.
    pub fn all_gather_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        input: &D::Buffer,
        output: D::Buffer,
    ) -> Result<StagedWork<D, T>> {
        let (host, stats) = self.stage_in::<D, T>(dev, input, "all_gather")?;
        let want = host.len() * self.size() * std::mem::size_of::<T>();
        self.check_output(dev.as_ref(), &output, want, "all_gather")?;
        let work = self.all_gather_async(host)?;
        Ok(self.staged(dev, true, false, work, Some(output), stats))
    }

    /// Async [`reduce_scatter_device`](Self::reduce_scatter_device): `input` is copied in now;
    /// the handle gives back `output` (this rank's block), written on completion.
    pub fn reduce_scatter_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        input: &D::Buffer,
        output: D::Buffer,
        op: ReduceOp,
    ) -> Result<StagedWork<D, T>> {
        let (host, stats) = self.stage_in::<D, T>(dev, input, "reduce_scatter")?;
        let want = host.len() / self.size().max(1) * std::mem::size_of::<T>();
        self.check_output(dev.as_ref(), &output, want, "reduce_scatter")?;
        let work = self.reduce_scatter_async(host, op)?;
        Ok(self.staged(dev, true, false, work, Some(output), stats))
    }

    /// Async equal [`all_to_all_device`](Self::all_to_all_device): `input` is copied in now;
    /// the handle gives back `output`, written on completion.
    pub fn all_to_all_device_async<D: Device, T: Reducible>(
        &self,
        dev: &Arc<D>,
        input: &D::Buffer,
        output: D::Buffer,
    ) -> Result<StagedWork<D, T>> {
        let (host, stats) = self.stage_in::<D, T>(dev, input, "all_to_all")?;
        let want = host.len() * std::mem::size_of::<T>();
        self.check_output(dev.as_ref(), &output, want, "all_to_all")?;
        let work = self.all_to_all_async(host)?;
        Ok(self.staged(dev, true, false, work, Some(output), stats))
    }

    /// `buf` copied to a host buffer of `T` (one counted copy).
    fn stage_in<D: Device, T: Reducible>(
        &self,
        dev: &D,
        buf: &D::Buffer,
        op: &'static str,
    ) -> Result<(Vec<T>, CopyStats)> {
        let mut s = Stager {
            g: self,
            dev,
            op,
            direct: false,
            stats: CopyStats::default(),
        };
        let n = s.elements::<T>(buf)?;
        Ok((s.download(buf, n)?, s.stats))
    }

    /// That an async collective's output buffer holds exactly `want` bytes (checked before
    /// anything is issued: a wrong size must fail on the spot, not at publication).
    fn check_output<D: Device>(
        &self,
        dev: &D,
        output: &D::Buffer,
        want: usize,
        op: &'static str,
    ) -> Result<()> {
        let got = dev.len(output);
        if got != want {
            return Err(self.inner.invalid(
                op,
                format!("the output device buffer holds {got} bytes, the result {want}"),
            ));
        }
        Ok(())
    }
}
