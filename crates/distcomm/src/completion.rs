//! Completion: what the transports and backends fill in and the handles wait on — the
//! completion cell [`OpCell`] (outcome, buffer, waker, sleepers), the [`Status`] it reports,
//! the [`Deadline`] of a wait, the [`Driver`] that makes progress while a handle waits, and the
//! buffers an engine owns while an operation is in flight ([`WireBuf`], [`RawView`]).
//!
//! Owns: the terminal-state contract (first outcome wins, sticky, every waiter woken, a kick
//! wakes sleepers without completing). Must not know: who completes (TCP or shared-memory
//! engine, MPI requests, the collective thread) or the API's handle types ([`crate::Work`]).
//!
//! [`OpCell`] is model-checked with [loom](https://docs.rs/loom): `RUSTFLAGS="--cfg loom"
//! cargo test -p distcomm --lib --release completion::loom` runs every interleaving of
//! completing, kicking, blocking, polling and registering a waker.

use std::alloc::{dealloc, Layout};
use std::any::Any;
use std::cell::RefCell;
use std::ptr::NonNull;
use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

#[cfg(loom)]
use loom::sync::{
    atomic::{AtomicBool, Ordering},
    Condvar, Mutex, MutexGuard,
};
#[cfg(not(loom))]
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Condvar, Mutex, MutexGuard,
};

use crate::call::Envelope;
use crate::error::{Error, Result};

/// What a finished operation reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// The peer rank: the source for a receive, the destination for a send.
    pub peer: usize,
    /// The tag the message carried.
    pub tag: u32,
    /// Bytes transferred.
    pub bytes: usize,
}

/// A buffer the engine can move bytes in and out of while it owns it.
pub(crate) trait WireBuf: Send + 'static {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    /// Whether this is a view of memory the engine does not own ([`RawView`]).
    fn is_view(&self) -> bool {
        false
    }
    /// Resizes a buffer sized by what arrives to exactly `len` bytes; false for fixed buffers
    /// (and for lengths a sized buffer refuses), which then keep MPI's rules.
    fn fit(&mut self, _len: usize) -> bool {
        false
    }
    /// Whether [`fit`](WireBuf::fit) sizes this buffer by the message (so a receive into it
    /// must learn the size before receiving). Asked by the MPI backend.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn sized_by_message(&self) -> bool {
        false
    }
}

impl<T: crate::Element> WireBuf for Vec<T> {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice())
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self.as_mut_slice())
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

pub(crate) type BoxBuf = Box<dyn WireBuf>;

/// The layout of the boxes a thread keeps for [`boxed`]: a `Vec`'s, of any element type (and
/// of anything else with its size and alignment, such as a [`RawView`]).
const SPARE_BOX: Layout = Layout::new::<Vec<u8>>();

/// Most spare boxes a thread keeps: as many as handles a loop typically has in flight.
const SPARE_BOXES_MAX: usize = 16;

/// Allocations of [`SPARE_BOX`] layout that held a buffer once, freed when the thread ends.
struct SpareBoxes(Vec<NonNull<u8>>);

impl Drop for SpareBoxes {
    fn drop(&mut self) {
        for p in self.0.drain(..) {
            // SAFETY: every pointer here came from a `Box` of a type of layout `SPARE_BOX`
            // (see `unboxed`), allocated by the global allocator, and is here once.
            unsafe { dealloc(p.as_ptr(), SPARE_BOX) };
        }
    }
}

thread_local! {
    static SPARE_BOXES: RefCell<SpareBoxes> = const { RefCell::new(SpareBoxes(Vec::new())) };
}

/// `buf` boxed for the engine, in one of this thread's spare boxes when its layout is a
/// `Vec`'s and there is one ([`unboxed`] keeps them): a handle's buffer then costs no
/// allocation and no free, which an 8-byte ping-pong with handles paid twice per round trip
/// on each rank.
pub(crate) fn boxed<B: WireBuf>(buf: B) -> BoxBuf {
    if Layout::new::<B>() == SPARE_BOX {
        let spare = SPARE_BOXES.try_with(|s| s.borrow_mut().0.pop());
        if let Ok(Some(p)) = spare {
            let p = p.as_ptr().cast::<B>();
            // SAFETY: `p` was allocated by the global allocator with layout `SPARE_BOX`, which
            // is `B`'s (checked above), so it is valid and aligned for a `B`, and it is ours
            // alone (taken out of the list); writing `buf` initialises it, after which
            // `Box::from_raw` may own it: the memory was allocated the way `Box<B>` allocates.
            unsafe {
                p.write(buf);
                return Box::from_raw(p);
            }
        }
    }
    Box::new(buf)
}

/// The buffer out of its box, the box kept for [`boxed`] when its layout is a `Vec`'s and the
/// thread has room for it.
pub(crate) fn unboxed<B>(b: Box<B>) -> B {
    if Layout::new::<B>() != SPARE_BOX {
        return *b;
    }
    let p = NonNull::from(Box::leak(b));
    // SAFETY: `p` points to the live, initialised `B` the box owned; it is read once, and the
    // memory is then either kept as a spare (holding no `B` any more) or freed, never read as
    // a `B` again.
    let buf = unsafe { p.as_ptr().read() };
    let p = p.cast::<u8>();
    let kept = SPARE_BOXES
        .try_with(|s| {
            let mut s = s.borrow_mut();
            let room = s.0.len() < SPARE_BOXES_MAX;
            if room {
                s.0.push(p);
            }
            room
        })
        .unwrap_or(false);
    if !kept {
        // SAFETY: `p` came from a `Box<B>` (global allocator, layout `Layout::new::<B>()`,
        // which is `SPARE_BOX`), its value was moved out above, and it is freed once.
        unsafe { dealloc(p.as_ptr(), SPARE_BOX) };
    }
    buf
}

/// A window onto memory the engine does not own: a range of a collective's own buffers, used
/// so that large collective transfers skip a copy into scratch memory.
///
/// Whoever creates one must keep the memory alive and untouched until the operation is
/// terminal, or call `Engine::reclaim` on it, which swaps every remaining view for owned memory
/// under the engine lock. The collective executor does exactly that with a drop guard around
/// each round (see `collectives.rs`).
pub(crate) struct RawView {
    ptr: *mut u8,
    len: usize,
    writable: bool,
}

// SAFETY: a RawView is only dereferenced under the engine lock, by one thread at a time, and
// its creator guarantees (see above) that the memory outlives every such access and that no
// one else touches the range meanwhile; moving the pointer between threads is then sound.
unsafe impl Send for RawView {}

impl RawView {
    /// A read-only view of `data` (for sends).
    ///
    /// # Safety
    /// `data` must stay alive and unmodified until the operation using the view is terminal or
    /// the view has been reclaimed.
    pub(crate) unsafe fn of(data: &[u8]) -> RawView {
        RawView {
            ptr: data.as_ptr().cast_mut(),
            len: data.len(),
            writable: false,
        }
    }

    /// A writable view of `data` (for receives).
    ///
    /// # Safety
    /// `data` must stay alive and otherwise untouched until the operation using the view is
    /// terminal or the view has been reclaimed.
    pub(crate) unsafe fn of_mut(data: &mut [u8]) -> RawView {
        RawView {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            writable: true,
        }
    }
}

impl WireBuf for RawView {
    fn bytes(&self) -> &[u8] {
        // SAFETY: ptr/len came from a live slice whose owner keeps it alive and unaliased while
        // the engine may use this view (see `RawView::of`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        if !self.writable {
            // The engine only writes into receive buffers; a send view never gets here.
            debug_assert!(false, "write through a read-only view");
            return &mut [];
        }
        // SAFETY: as in `bytes`, and the creator gave up all other access (`of_mut`).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        Box::new(())
    }
    fn is_view(&self) -> bool {
        true
    }
}

#[derive(Default)]
struct Slot {
    result: Option<Result<Status>>,
    buf: Option<BoxBuf>,
    waker: Option<Waker>,
    /// Bumped by [`OpCell::kick`]: the operation moved, a sleeping waiter should resume spinning.
    kicks: u64,
    /// Threads blocked on `cv` (so completions only pay for a wake-up when someone sleeps).
    sleepers: u32,
}

/// Most spare cells a thread keeps (see [`OpCell::recycle`]): as many as operations a
/// handle-driven loop typically has in flight.
const SPARE_CELLS_MAX: usize = 16;

#[cfg(not(loom))]
thread_local! {
    static SPARE_CELLS: std::cell::RefCell<Vec<Arc<OpCell>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// The completion cell shared by a handle and the engine.
pub(crate) struct OpCell {
    done: AtomicBool,
    /// Set by [`OpCell::kick`]: a transfer is under way with the peer engaged.
    active: AtomicBool,
    slot: Mutex<Slot>,
    cv: Condvar,
    /// A send its handle watches itself ([`Ticket`]): its outcome is the answer word until
    /// `adopted`, then this cell, which the driver completes from then on.
    ticket: Option<Ticket>,
    adopted: AtomicBool,
}

impl Default for OpCell {
    fn default() -> Self {
        OpCell {
            done: AtomicBool::new(false),
            active: AtomicBool::new(false),
            slot: Mutex::new(Slot::default()),
            cv: Condvar::new(),
            ticket: None,
            adopted: AtomicBool::new(false),
        }
    }
}

impl OpCell {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        // A poisoned slot only means another thread panicked while holding it; the data is a
        // plain Option and stays consistent.
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the terminal outcome. The first call wins; later calls are ignored.
    pub(crate) fn complete(&self, result: Result<Status>, buf: Option<BoxBuf>) {
        let waker = {
            let mut slot = self.lock();
            if slot.result.is_some() {
                return;
            }
            slot.result = Some(result);
            slot.buf = buf;
            self.done.store(true, Ordering::Release);
            if slot.sleepers > 0 {
                self.cv.notify_all();
            }
            slot.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Whether a transfer is under way (see [`OpCell::kick`]).
    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// The outcome, once there is one.
    pub(crate) fn result(&self) -> Option<Result<Status>> {
        self.lock().result.clone()
    }

    /// The outcome, or `None` after registering `waker` to be woken by [`complete`]
    /// (a `Future`'s poll).
    ///
    /// [`complete`]: OpCell::complete
    pub(crate) fn poll_result(&self, waker: &Waker) -> Option<Result<Status>> {
        let mut slot = self.lock();
        if slot.result.is_none() {
            slot.waker = Some(waker.clone());
        }
        slot.result.clone()
    }

    /// The buffer of a finished operation, once.
    pub(crate) fn take_buf(&self) -> Option<BoxBuf> {
        self.lock().buf.take()
    }

    /// The cell of watched send `ticket`, holding its buffer: it comes back from here once
    /// accepted, or goes to the driver that adopts the send ([`Driver::adopt`]).
    pub(crate) fn watched(ticket: Ticket, buf: BoxBuf) -> Arc<OpCell> {
        let mut cell = OpCell::fresh();
        match Arc::get_mut(&mut cell) {
            Some(c) => c.ticket = Some(ticket),
            // Not reached: a fresh cell has no other owner.
            None => {
                cell = Arc::new(OpCell {
                    ticket: Some(ticket),
                    ..OpCell::default()
                })
            }
        }
        cell.lock().buf = Some(buf);
        cell
    }

    /// A new, pending cell: one of this thread's spares when it has one (see
    /// [`recycle`](Self::recycle)), else a new allocation.
    pub(crate) fn fresh() -> Arc<OpCell> {
        #[cfg(not(loom))]
        if let Some(cell) = SPARE_CELLS
            .try_with(|s| s.borrow_mut().pop())
            .ok()
            .flatten()
        {
            return cell;
        }
        Arc::default()
    }

    /// The end of a handle's cell: when nobody else holds it, it is reset and kept as one of
    /// this thread's spares (at most [`SPARE_CELLS_MAX`]) for [`fresh`](Self::fresh); an
    /// allocation and a free less per operation, which a ping-pong of small messages with
    /// handles pays on its way (the free after a receive, before the reply's send).
    pub(crate) fn recycle(mut cell: Arc<OpCell>) {
        let Some(c) = Arc::get_mut(&mut cell) else {
            return;
        };
        // Drops what the cell still holds (a buffer nobody took, a waker) as dropping the
        // cell would.
        *c = OpCell::default();
        #[cfg(not(loom))]
        let _ = SPARE_CELLS.try_with(|s| {
            let mut spares = s.borrow_mut();
            if spares.len() < SPARE_CELLS_MAX {
                spares.push(cell);
            }
        });
    }

    /// The ticket of a watched send the driver has not adopted.
    pub(crate) fn ticket(&self) -> Option<&Ticket> {
        self.ticket
            .as_ref()
            .filter(|_| !self.adopted.load(Ordering::Acquire))
    }

    /// The ticket of a watched send, once (to whoever hands it to the driver first).
    pub(crate) fn take_ticket(&self) -> Option<&Ticket> {
        self.ticket
            .as_ref()
            .filter(|_| !self.adopted.swap(true, Ordering::AcqRel))
    }

    /// The outcome and, when it succeeded, the buffer (once), under one lock: `None` while
    /// pending; `Some(Ok(None))` when the buffer was taken already.
    pub(crate) fn take_outcome(&self) -> Option<Result<Option<BoxBuf>>> {
        let mut slot = self.lock();
        match &slot.result {
            None => None,
            Some(Ok(_)) => Some(Ok(slot.buf.take())),
            Some(Err(e)) => Some(Err(e.clone())),
        }
    }

    /// Wakes a sleeping waiter without completing: the operation has started moving (for
    /// example a large transfer was cleared to send), so spinning pays again.
    pub(crate) fn kick(&self) {
        self.active.store(true, Ordering::Release);
        let mut slot = self.lock();
        slot.kicks += 1;
        if slot.sleepers > 0 {
            self.cv.notify_all();
        }
    }

    /// Blocks until done, kicked, or `deadline`. Returns whether the operation is done.
    pub(crate) fn block_until(&self, deadline: Instant) -> bool {
        let mut slot = self.lock();
        let kicks = slot.kicks;
        while slot.result.is_none() && slot.kicks == kicks {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            slot.sleepers += 1;
            slot = match self.cv.wait_timeout(slot, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
            slot.sleepers -= 1;
        }
        slot.result.is_some()
    }
}

/// A deadline `timeout` from the first time anyone asks for it. A wait that ends before it
/// looks at the clock never reads it: on a small message's path a clock read costs as much
/// as the rest of the wait (measured: three of them were 0.07 µs of a 0.94 µs half round trip
/// over shared memory).
pub(crate) struct Deadline {
    timeout: Duration,
    at: Option<Instant>,
}

impl Deadline {
    pub(crate) fn after(timeout: Duration) -> Self {
        Deadline { timeout, at: None }
    }

    /// The deadline, fixing it at `now` + timeout if nobody asked before.
    pub(crate) fn from(&mut self, now: Instant) -> Instant {
        let timeout = self.timeout;
        *self.at.get_or_insert_with(|| {
            now.checked_add(timeout)
                .unwrap_or_else(|| now + Duration::from_secs(86400 * 365))
        })
    }

    /// The deadline, reading the clock if it is not fixed yet.
    pub(crate) fn get(&mut self) -> Instant {
        match self.at {
            Some(at) => at,
            None => self.from(Instant::now()),
        }
    }
}

/// A small send whose handle watches the answer itself: it went straight into a
/// shared-memory lane, and its answer is one word the handle can read without the driver's
/// lock, the way a blocking send watches it. What the driver needs to read that word, or to
/// take the send over ([`Driver::adopt`]) when the answer is slow or a refusal.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket {
    /// The destination, in the driver's numbering of ranks.
    pub peer: usize,
    /// The message's sequence number on that lane.
    pub seq: u64,
    pub env: Envelope,
    /// Bytes sent.
    pub len: usize,
}

impl Ticket {
    /// The status of the send once accepted.
    pub(crate) fn status(&self) -> Status {
        Status {
            peer: self.peer,
            tag: self.env.tag,
            bytes: self.len,
        }
    }
}

/// What a handle needs from whoever drives progress.
pub(crate) trait Driver: Send + Sync {
    /// Waits until `cell` is done or `deadline` passes, driving progress meanwhile.
    fn drive_until(&self, cell: &OpCell, deadline: &mut Deadline) -> bool;
    /// Called when a pending handle is dropped: withdraw the operation if it has not started.
    fn cancel(&self, op_id: u64);
    /// Rank of this process, for error messages.
    fn rank(&self) -> usize;
    /// The waiter of pending receive `op_id` from `src` (the driver's numbering), about to take
    /// its buffer, takes its message itself if it is there or comes within `limit` (at most a
    /// short while) and taking it cannot reorder anything: the outcome and the buffer, the
    /// operation gone from the driver and its cell left as it was. `None`: nothing happened.
    fn claim(&self, _op_id: u64, _src: usize, _limit: Duration) -> Option<(Status, BoxBuf)> {
        None
    }
    /// The answer to watched send `t`, read without waiting: `Some(true)` accepted (for good),
    /// `Some(false)` refused, `None` not yet.
    fn answer(&self, _t: &Ticket) -> Option<bool> {
        None
    }
    /// Spins up to `limit` (and at most a short while) for the answer to watched send `t`;
    /// returns whether one came.
    fn await_answer(&self, _t: &Ticket, _limit: Duration) -> bool {
        false
    }
    /// Takes over watched send `t` (operation `op_id`, the driver's numbering), whose buffer
    /// `cell` holds: from now on the driver completes `cell` (the buffer back in it on
    /// success), as for any operation it posted.
    fn adopt(&self, _op_id: u64, t: &Ticket, cell: &Arc<OpCell>) {
        cell.complete(
            Err(Error::Aborted {
                op: t.env.op,
                rank: self.rank(),
                reason: "internal: this backend watches no sends".into(),
            }),
            None,
        );
    }
}

pub(crate) fn block(cell: &OpCell, deadline: Instant) -> bool {
    cell.block_until(deadline)
}

#[cfg(all(test, not(loom)))]
mod spare_tests {
    use std::sync::Arc;

    use super::{
        boxed, unboxed, BoxBuf, OpCell, Status, Ticket, WireBuf, SPARE_BOXES, SPARE_BOXES_MAX,
    };
    use crate::call::{Envelope, Fingerprint};
    use crate::dtype::DType;

    fn ticket() -> Ticket {
        let env = Envelope {
            op: "isend",
            dtype: DType::Bytes,
            ctx: 0,
            tag: 3,
            fp: Fingerprint::NONE,
        };
        Ticket {
            peer: 1,
            seq: 9,
            env,
            len: 4,
        }
    }

    #[test]
    fn a_recycled_cell_comes_back_pending_and_empty() {
        let cell = OpCell::watched(ticket(), Box::new(vec![1u8; 4]));
        cell.complete(
            Ok(Status {
                peer: 1,
                tag: 3,
                bytes: 4,
            }),
            None,
        );
        let at = Arc::as_ptr(&cell);
        OpCell::recycle(cell);
        let again = OpCell::fresh();
        assert_eq!(Arc::as_ptr(&again), at, "the spare was not reused");
        assert!(!again.is_done());
        assert!(again.result().is_none());
        assert!(again.take_buf().is_none());
        assert!(again.ticket().is_none());
        OpCell::recycle(again);
    }

    #[test]
    fn a_cell_someone_else_holds_is_not_recycled() {
        let cell = OpCell::fresh();
        let other = cell.clone();
        OpCell::recycle(cell);
        let next = OpCell::fresh();
        assert!(
            !Arc::ptr_eq(&next, &other),
            "a cell still in use was handed out"
        );
        other.complete(
            Ok(Status {
                peer: 0,
                tag: 0,
                bytes: 0,
            }),
            None,
        );
        assert!(!next.is_done());
    }

    /// The address of the buffer a boxed `B` lies in.
    fn address(b: &BoxBuf) -> *const u8 {
        (&**b as *const dyn WireBuf).cast()
    }

    #[test]
    fn a_buffer_taken_out_of_its_box_leaves_the_box_for_the_next() {
        let first = boxed(vec![7i32; 3]);
        let at = address(&first);
        let any = first.into_any().downcast::<Vec<i32>>().ok();
        let back = any.map(unboxed);
        assert_eq!(back, Some(vec![7i32; 3]), "the buffer changed on its way");
        // An allocation of the same size in between would take a freed box (the allocator
        // hands out the chunk it got back last), not a kept one.
        let decoy = Box::new([0u64; 3]);
        // Another element type: a `Vec` all the same.
        let next = boxed(vec![1u8, 2]);
        assert_ne!(decoy.as_ptr().cast(), at);
        assert_eq!(address(&next), at, "the spare box was not reused");
        assert_eq!(next.bytes(), &[1, 2]);
        drop(next);
        // A buffer of another layout is boxed and unboxed as usual.
        let wide = boxed(Wide([3; 40]));
        assert_ne!(address(&wide), at, "a box of another layout was reused");
        assert_eq!(wide.bytes(), &[3; 40]);
    }

    /// A buffer whose layout is not a `Vec`'s.
    struct Wide([u8; 40]);

    impl WireBuf for Wide {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.0
        }
        fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
            self
        }
    }

    #[test]
    fn spare_boxes_are_bounded() {
        let boxes: Vec<_> = (0..2 * SPARE_BOXES_MAX)
            .map(|i| boxed(vec![i as i64]))
            .collect();
        for b in boxes {
            if let Ok(v) = b.into_any().downcast::<Vec<i64>>() {
                unboxed(v);
            }
        }
        let kept = SPARE_BOXES.with(|s| s.borrow().0.len());
        assert_eq!(kept, SPARE_BOXES_MAX);
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! Every interleaving of the cell's users (`RUSTFLAGS="--cfg loom" cargo test -p distcomm
    //! --lib --release completion::loom`).
    use std::sync::atomic::AtomicUsize as StdCounter;
    use std::task::{Wake, Waker};
    use std::time::{Duration, Instant};

    use loom::sync::Arc;
    use loom::thread;

    use super::{OpCell, Status};
    use crate::error::Error;

    fn ok(bytes: usize) -> crate::error::Result<Status> {
        Ok(Status {
            peer: 1,
            tag: 0,
            bytes,
        })
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// A waker that counts its wake-ups (std atomics: a `Waker` needs a std `Arc`; the count
    /// is only read after every thread has been joined).
    #[derive(Default)]
    struct Count(StdCounter);

    impl Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn a_blocked_waiter_and_a_poller_see_the_one_outcome() {
        loom::model(|| {
            let cell = Arc::new(OpCell::default());
            let c = cell.clone();
            let completer = thread::spawn(move || c.complete(ok(8), None));
            let c = cell.clone();
            let waiter = thread::spawn(move || {
                assert!(c.block_until(far()), "woken without the outcome");
                c.result()
            });
            // Done implies the outcome is there (Release/Acquire on `done`).
            if cell.is_done() {
                assert!(cell.result().is_some());
            }
            completer.join().unwrap();
            let seen = waiter.join().unwrap();
            assert_eq!(seen.unwrap().unwrap().bytes, 8);
            assert!(cell.is_done());
        });
    }

    #[test]
    fn the_first_outcome_wins_and_stays() {
        loom::model(|| {
            let cell = Arc::new(OpCell::default());
            let c = cell.clone();
            let a = thread::spawn(move || c.complete(ok(1), None));
            let c = cell.clone();
            let b = thread::spawn(move || {
                c.complete(
                    Err(Error::Aborted {
                        op: "test",
                        rank: 0,
                        reason: "second".into(),
                    }),
                    None,
                )
            });
            let early = cell.result();
            a.join().unwrap();
            b.join().unwrap();
            let last = cell.result().expect("completed");
            // Whatever came first is what everyone sees, before and after.
            if let Some(early) = early {
                assert_eq!(early.is_ok(), last.is_ok());
            }
            assert_eq!(cell.result().unwrap().is_ok(), last.is_ok());
        });
    }

    #[test]
    fn a_kick_or_the_outcome_always_ends_a_sleep() {
        loom::model(|| {
            let cell = Arc::new(OpCell::default());
            let c = cell.clone();
            let mover = thread::spawn(move || {
                c.kick();
                c.complete(ok(2), None);
            });
            // A waiter that goes back to sleep after each kick ends once the outcome is in:
            // no wake-up is lost (loom reports a deadlock otherwise).
            while !cell.block_until(far()) {
                assert!(cell.is_active(), "woken by neither a kick nor the outcome");
            }
            mover.join().unwrap();
            assert_eq!(cell.result().unwrap().unwrap().bytes, 2);
        });
    }

    #[test]
    fn the_buffer_is_taken_once_with_its_outcome() {
        loom::model(|| {
            let cell = Arc::new(OpCell::default());
            let c = cell.clone();
            let completer = thread::spawn(move || {
                let buf: super::BoxBuf = Box::new(vec![5u8; 4]);
                c.complete(ok(4), Some(buf));
            });
            let c = cell.clone();
            let taker = thread::spawn(move || c.take_outcome());
            let mine = cell.take_outcome();
            completer.join().unwrap();
            let theirs = taker.join().unwrap();
            let last = cell.take_outcome();
            // Pending (None) or succeeded; the buffer comes out exactly once in all.
            let got = [mine, theirs, last]
                .into_iter()
                .flatten()
                .map(|r| r.expect("succeeded"))
                .filter(|b| b.as_ref().is_some_and(|b| b.bytes() == [5u8; 4]))
                .count();
            assert_eq!(got, 1);
        });
    }

    #[test]
    fn a_registered_waker_is_woken_by_the_outcome() {
        loom::model(|| {
            let cell = Arc::new(OpCell::default());
            let count = std::sync::Arc::new(Count::default());
            let waker = Waker::from(count.clone());
            let c = cell.clone();
            let completer = thread::spawn(move || c.complete(ok(3), None));
            let polled = cell.poll_result(&waker);
            completer.join().unwrap();
            let woken = count.0.load(std::sync::atomic::Ordering::SeqCst);
            match polled {
                // Pending at poll time: the completion must have woken the task once.
                None => assert_eq!(woken, 1),
                Some(r) => assert_eq!((r.unwrap().bytes, woken), (3, 0)),
            }
        });
    }
}
