//! Work handles: the state of one posted operation, shared between the caller and the progress
//! engine.
//!
//! A [`Work`] is terminal once the engine has recorded an outcome. The outcome is sticky: every
//! `wait()` and `is_completed()` afterwards reports the same thing. The buffer of the operation is
//! owned by the engine while the operation is in flight and handed back only by
//! [`Work::into_buffer`] once the operation succeeded, so an in-flight buffer can never be read,
//! written or freed by the caller — `std::mem::forget` on a handle merely leaks the buffer.

use std::any::Any;
use std::future::Future;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

pub use crate::completion::Status;
pub(crate) use crate::completion::{boxed, BoxBuf, Deadline, Driver, OpCell, WireBuf};
use crate::completion::{unboxed, Ticket};
use crate::error::{Error, Result};

/// A receive buffer that takes the length of the message that matches it (a whole number of
/// elements, at most `max_bytes`), so the receiver need not know the size in advance. It comes
/// back from the handle as a plain `Vec<T>`.
pub(crate) struct Fitted<T> {
    pub(crate) vec: Vec<T>,
    pub(crate) max_bytes: usize,
}

impl<T: crate::Element> WireBuf for Fitted<T> {
    fn bytes(&self) -> &[u8] {
        self.vec.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.vec.bytes_mut()
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        Box::new(self.vec)
    }
    fn sized_by_message(&self) -> bool {
        true
    }
    fn fit(&mut self, len: usize) -> bool {
        let size = std::mem::size_of::<T>();
        if len > self.max_bytes || len % size != 0 {
            return false;
        }
        self.vec.clear();
        self.vec
            .resize(len / size, <T as bytemuck::Zeroable>::zeroed());
        true
    }
}

/// Memory owned by someone else — a tensor of another runtime — lent to one operation, with
/// whatever keeps it alive. The operation holds the `Lent` (and so its owner) until it is
/// terminal, whether or not its [`Work`] handle is still there; it comes back from
/// [`Work::into_buffer`]. Used by [`ProcessGroup::isend_lent`](crate::ProcessGroup::isend_lent)
/// and [`ProcessGroup::irecv_lent`](crate::ProcessGroup::irecv_lent); Rust code with its own
/// buffers passes a `Vec` instead, which needs no `unsafe`.
///
/// ```
/// let mut data = vec![7u8; 64];
/// let ptr = data.as_mut_ptr();
/// // SAFETY: `data` moves into the owner: it lives, unmoved on the heap, as long as the Lent,
/// // and nothing else touches it meanwhile.
/// let lent = unsafe { distcomm::Lent::new(ptr, 64, Box::new(data)) };
/// assert_eq!(lent.len(), 64);
/// ```
pub struct Lent {
    ptr: *mut u8,
    len: usize,
    _owner: Box<dyn Any + Send>,
}

// SAFETY: the creator of a Lent guarantees (see `Lent::new`) that the memory stays valid while
// the Lent lives and that no one else accesses it meanwhile; the engine touches it from one
// thread at a time, under its lock. Moving the pointer between threads is then sound.
unsafe impl Send for Lent {}

impl Lent {
    /// Lends `len` bytes at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes for as long as `owner` lives (the
    /// `Lent` drops it last), and nothing else may read it while a receive into it is in flight
    /// or write it while a send from it is. `ptr` may dangle only when `len` is 0.
    pub unsafe fn new(ptr: *mut u8, len: usize, owner: Box<dyn Any + Send>) -> Lent {
        Lent {
            ptr,
            len,
            _owner: owner,
        }
    }

    /// Bytes lent.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes are lent.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl WireBuf for Lent {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: valid for `len` bytes while the Lent lives, and not written by anyone else
        // meanwhile (`Lent::new`'s contract).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `bytes`, and no one else accesses it meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

/// A handle to a nonblocking operation whose buffer is a `B` (for example `Vec<f32>`).
///
/// * [`wait`](Work::wait) blocks until the operation is terminal (bounded by the group's default
///   timeout) and returns its [`Status`] or error;
/// * [`wait_timeout`](Work::wait_timeout) bounds the wait; on timeout it returns
///   [`Error::Timeout`], publishes nothing and leaves the operation pending, so it can be waited
///   again;
/// * [`is_completed`](Work::is_completed) never blocks;
/// * the outcome is sticky; repeated calls return the same result;
/// * `Work` is a [`Future`] whose output is the same result;
/// * [`into_buffer`](Work::into_buffer) waits and gives the buffer back.
///
/// **Drop:** dropping a pending send lets it finish in the background (like `MPI_Request_free`);
/// dropping a pending receive withdraws it if no message has matched it yet, otherwise the data
/// is received into the (engine-owned) buffer and discarded. Either way the engine owns the
/// memory, so nothing is ever written into freed memory.
///
/// ```no_run
/// # fn main() -> distcomm::Result<()> {
/// let group = distcomm::init()?;
/// let peer = (group.rank() + 1) % group.size();
/// let from = (group.rank() + group.size() - 1) % group.size();
/// let recv = group.irecv(vec![0f32; 4], from, 7)?;
/// let send = group.isend(vec![1f32; 4], peer, 7)?;
/// let status = recv.wait()?;
/// assert_eq!(status.bytes, 16);
/// let data: Vec<f32> = recv.into_buffer()?;
/// send.into_buffer()?;
/// # Ok(()) }
/// ```
#[must_use = "a Work handle should be waited; dropping it detaches the operation"]
pub struct Work<B> {
    /// Handed back to [`OpCell::recycle`] when the handle drops.
    cell: ManuallyDrop<Arc<OpCell>>,
    driver: Arc<dyn Driver>,
    op_id: u64,
    op: &'static str,
    peer: Option<usize>,
    default_timeout: Duration,
    /// Translates a global peer rank in the status into a group rank.
    map: Option<Arc<Vec<usize>>>,
    /// Whether dropping it pending should withdraw it (receives); sends just detach.
    withdraw_on_drop: bool,
    _buf: PhantomData<fn() -> B>,
}

impl<B: 'static> Work<B> {
    pub(crate) fn new(
        cell: Arc<OpCell>,
        driver: Arc<dyn Driver>,
        op_id: u64,
        op: &'static str,
        peer: Option<usize>,
        default_timeout: Duration,
    ) -> Self {
        Work {
            cell: ManuallyDrop::new(cell),
            driver,
            op_id,
            op,
            peer,
            default_timeout,
            map: None,
            withdraw_on_drop: true,
            _buf: PhantomData,
        }
    }

    /// Whether watched send `t` was accepted, spinning up to `limit` for the answer; false
    /// when it was refused or the answer is slow (then the caller hands it over).
    fn accepted(&self, t: &Ticket, limit: Duration) -> bool {
        self.driver.answer(t) == Some(true)
            || (!limit.is_zero()
                && self.driver.await_answer(t, limit)
                && self.driver.answer(t) == Some(true))
    }

    /// A watched send's status once its answer says "accepted" (waiting up to `limit` for
    /// it); otherwise (refused, slow, or no watched send) `None`, and the driver has the send
    /// from now on: it completes the cell, also when the peer is lost.
    // Inlined into its four callers: as a call it cost the small-message handle ping-pong
    // 1.09x its time (8 alternating pairs).
    #[inline(always)]
    fn settled(&self, limit: Duration) -> Option<Status> {
        let t = self.cell.ticket()?;
        if self.accepted(t, limit) {
            return Some(t.status());
        }
        self.hand_over();
        None
    }

    /// Hands a watched send over to the driver (once, whoever asks first).
    fn hand_over(&self) {
        if let Some(t) = self.cell.take_ticket() {
            self.driver.adopt(self.op_id, t, &self.cell);
        }
    }

    /// The deadline `wait` uses.
    pub(crate) fn default_timeout(&self) -> Duration {
        self.default_timeout
    }

    /// The engine's id of the operation.
    pub(crate) fn id(&self) -> u64 {
        self.op_id
    }

    /// Marks a send: dropping it pending lets it finish in the background.
    pub(crate) fn detach_on_drop(mut self) -> Self {
        self.withdraw_on_drop = false;
        self
    }

    pub(crate) fn with_map(mut self, map: Option<Arc<Vec<usize>>>) -> Self {
        self.map = map;
        self
    }

    fn translate(&self, r: Result<Status>) -> Result<Status> {
        match (&self.map, r) {
            (Some(m), Ok(mut st)) => {
                if let Some(p) = m.iter().position(|&g| g == st.peer) {
                    st.peer = p;
                }
                Ok(st)
            }
            (_, r) => r,
        }
    }

    /// True once the operation is terminal (succeeded or failed). Never blocks.
    pub fn is_completed(&self) -> bool {
        self.settled(Duration::ZERO).is_some() || self.cell.is_done()
    }

    /// Waits up to the group's default timeout.
    ///
    /// It takes `&self`: waiting changes nothing the caller can see (the outcome is sticky and
    /// the buffer stays with the handle until [`into_buffer`](Self::into_buffer)), so
    /// `let send = group.isend(..)?; send.wait()?;` works, and several threads may wait on one
    /// handle.
    pub fn wait(&self) -> Result<Status> {
        self.wait_timeout(self.default_timeout)
    }

    /// Waits up to `timeout`. On timeout the operation stays pending and can be waited again.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Status> {
        if let Some(status) = self.settled(timeout) {
            return self.translate(Ok(status));
        }
        if !self.cell.is_done() && !self.drive(timeout) {
            return Err(self.timed_out(timeout));
        }
        match self.cell.result() {
            Some(r) => self.translate(r),
            None => Err(self.timed_out(timeout)),
        }
    }

    /// Drives the operation until it is done or `timeout` passes.
    fn drive(&self, timeout: Duration) -> bool {
        self.driver
            .drive_until(&self.cell, &mut Deadline::after(timeout))
    }

    /// Gives up the handle and lets the operation run to its end on its own: unlike dropping a
    /// pending receive's handle, which withdraws it, a detached receive still takes its message.
    /// The buffer is dropped once the operation is terminal (for a [`Lent`], that releases its
    /// owner); its outcome is not reported anywhere.
    pub fn detach(mut self) {
        self.withdraw_on_drop = false;
    }

    /// Waits (group default timeout) and returns the buffer. A failed operation returns its error
    /// and drops the buffer without publishing anything from it.
    pub fn into_buffer(mut self) -> Result<B> {
        let timeout = self.default_timeout;
        // A pending receive first tries to take its message itself (a small one over shared
        // memory, from the lane): then the handle, consumed here, never needs its cell.
        if let Some(src) = self
            .peer
            .filter(|_| self.withdraw_on_drop && !self.cell.is_done())
        {
            let src = self.map.as_ref().map_or(Some(src), |m| m.get(src).copied());
            let claimed = src.and_then(|src| self.driver.claim(self.op_id, src, timeout));
            if let Some((_, buf)) = claimed {
                // Gone from the driver: nothing to withdraw when the handle drops.
                self.withdraw_on_drop = false;
                return self.unbox(Some(buf));
            }
        }
        if self.settled(timeout).is_some() {
            return self.unbox(self.cell.take_buf());
        }
        // One look at the cell for the outcome and the buffer together (the small-message
        // path pays for every lock).
        if !self.cell.is_done() && !self.drive(timeout) {
            return Err(self.timed_out(timeout));
        }
        match self.cell.take_outcome() {
            Some(Ok(buf)) => self.unbox(buf),
            Some(Err(e)) => Err(e),
            None => Err(self.timed_out(timeout)),
        }
    }

    fn timed_out(&self, after: Duration) -> Error {
        Error::Timeout {
            op: self.op,
            rank: self.driver.rank(),
            peer: self.peer,
            after,
        }
    }

    /// The buffer of a finished, successful operation (once).
    pub(crate) fn take_buffer(&self) -> Result<B> {
        self.unbox(self.cell.take_buf())
    }

    /// The buffer as the caller's type; `None`: taken already.
    fn unbox(&self, buf: Option<BoxBuf>) -> Result<B> {
        let any = match buf {
            Some(b) => b.into_any(),
            None => {
                return Err(Error::Aborted {
                    op: self.op,
                    rank: self.driver.rank(),
                    reason: "buffer already taken".into(),
                })
            }
        };
        match any.downcast::<B>() {
            Ok(b) => Ok(unboxed(b)),
            Err(_) => Err(Error::Aborted {
                op: self.op,
                rank: self.driver.rank(),
                reason: "internal: buffer type changed".into(),
            }),
        }
    }
}

impl<B> Drop for Work<B> {
    fn drop(&mut self) {
        if let Some(t) = self.cell.take_ticket() {
            // A watched send not yet accepted goes on in the driver's hands.
            if self.driver.answer(t) != Some(true) {
                self.driver.adopt(self.op_id, t, &self.cell);
            }
        } else if self.withdraw_on_drop && !self.cell.is_done() {
            self.driver.cancel(self.op_id);
        }
        // SAFETY: `cell` is not used again: this is the handle's last use of its fields.
        let cell = unsafe { ManuallyDrop::take(&mut self.cell) };
        OpCell::recycle(cell);
    }
}

impl<B: 'static> Future for Work<B> {
    type Output = Result<Status>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Unless accepted already, the driver completes the cell, and wakes the task, from now
        // on.
        if let Some(status) = self.settled(Duration::ZERO) {
            return Poll::Ready(self.translate(Ok(status)));
        }
        match self.cell.poll_result(cx.waker()) {
            Some(r) => Poll::Ready(self.translate(r)),
            None => Poll::Pending,
        }
    }
}

impl<B> std::fmt::Debug for Work<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("peer", &self.peer)
            .field(
                "completed",
                &(self.cell.is_done()
                    || self
                        .cell
                        .ticket()
                        .is_some_and(|t| self.driver.answer(t) == Some(true))),
            )
            .finish()
    }
}

/// A handle `wait_all` can poll and wait on, whatever its buffer type.
pub(crate) trait Pending {
    fn failed(&mut self) -> Option<Error>;
    fn done(&self) -> bool;
    fn wait_for(&mut self, d: Duration) -> Result<()>;
}

impl<B: 'static> Pending for Work<B> {
    fn failed(&mut self) -> Option<Error> {
        if !self.is_completed() {
            return None;
        }
        self.wait_timeout(Duration::ZERO).err()
    }
    fn done(&self) -> bool {
        self.is_completed()
    }
    fn wait_for(&mut self, d: Duration) -> Result<()> {
        self.wait_timeout(d).map(|_| ())
    }
}

/// Waits until every operation succeeded, returning the first failure as soon as it is seen
/// (within a few milliseconds) rather than after waiting for operations that precede it: a peer
/// that refuses our message must not leave us waiting for its reply until the deadline.
pub(crate) fn wait_all(
    ops: &mut [&mut dyn Pending],
    deadline: Instant,
    timeout: Duration,
) -> Result<()> {
    const SLICE: Duration = Duration::from_millis(2);
    loop {
        for op in ops.iter_mut() {
            if let Some(e) = op.failed() {
                return Err(e);
            }
        }
        let Some(first) = ops.iter_mut().find(|o| !o.done()) else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        match first.wait_for(left.min(SLICE)) {
            Ok(()) => {}
            Err(e) if e.is_timeout() && !left.is_zero() => {}
            // The deadline of the whole call passed: say how long it was, not the last slice.
            Err(Error::Timeout { op, rank, peer, .. }) => {
                return Err(Error::Timeout {
                    op,
                    rank,
                    peer,
                    after: timeout,
                })
            }
            Err(e) => return Err(e),
        }
    }
}
