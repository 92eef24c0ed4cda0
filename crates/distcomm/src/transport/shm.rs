//! The shared-memory link between two ranks on one host.
//!
//! Each direction of a pair is a single-producer single-consumer byte ring in a segment of
//! `/dev/shm`, carrying exactly the frames the TCP transport would put on its socket, so the
//! whole protocol (matching, eager/rendezvous, desync checks, cancellation) is shared. The TCP
//! connection between the pair stays open beside the rings, for three things it does better
//! than any shared-memory scheme: it was authenticated by the handshake (a stranger cannot hand
//! us a segment), the kernel closes it when a process dies however it dies (peer death is
//! detected exactly as on TCP), and it is a file descriptor `poll(2)` can sleep on: a side that
//! goes to sleep raises a flag in the ring, and the other side, seeing it after publishing,
//! writes one *doorbell* byte to the socket.
//!
//! The producer also remembers the consumer's head from its last look and reads the shared one
//! only when the remembered free space is too small, so a small write does not wait for the
//! cache line the consumer last wrote.
//!
//! # The small-message lane
//! Beside each ring, a *lane* of [`LANE_SLOTS`] one-cache-line slots carries messages of up to
//! [`LANE_MAX`] bytes over consecutive slots: the first holds the message's header and the
//! payload's first bytes, the others the rest; the first slot's word, written last, publishes
//! the message with its sequence number and length, so an 8-byte message is one line and the
//! receiver polls the very line it arrives in (a ring message crosses as two lines, the tail
//! and then the frame). A point-to-point message is answered in an *answer word* (one line
//! each, [`LANE_ACKS`] per direction) instead of an Ack frame; a refusal sets the word's
//! refused bit and also sends the usual Nack frame, which says why. Order between lane and
//! ring is kept by two rules: the producer writes to the lane only when the consumer has read
//! every ring byte, and to the ring only when the consumer has taken every lane message; so at
//! most one of them holds unread messages, and the consumer takes the lane before the ring.
//! The engine's blocking send and receive use the lane without a handle or an allocation
//! (`tcp::Engine::send_small`).
//!
//! Large messages skip the ring: the sender announces the address of its buffer (`Rget`) and
//! the receiver copies it straight into the posted receive with `process_vm_readv(2)` (Linux
//! cross-memory attach, one copy). Where the kernel refuses (ptrace rules, `EPERM`) the receiver
//! answers clear-to-send instead and the message streams through the ring, pipelined (the
//! sender fills while the receiver drains).
//!
//! # Lifecycle
//! Segments are named `distcomm-<creator pid>-<nonce>-<src>to<dst>`. The producer creates its
//! segment during initialisation, the consumer maps it and unlinks the name at once, and the
//! producer unlinks it again once both sides reported (so a failed peer cannot leave it
//! behind). After initialisation nothing of the job is left in `/dev/shm`, whatever happens to
//! the processes later. Segments whose creator died during initialisation are swept by the next
//! job on the host.
//!
//! # Trust
//! The peer process could write anything into the shared pages. Indices are validated on every
//! access (a ring claiming more bytes than it holds is a protocol violation that fails the
//! link), and frames are decoded with the same bounds checks as from a socket.

use std::cell::Cell;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use memmap2::MmapRaw;

use super::frame::{LANE_ACKS, LANE_HEAD, LANE_MAX};
use super::{ShmConfig, TransportKind};
use crate::error::{Error, Result};

/// Where segments live.
const SHM_DIR: &str = "/dev/shm";
/// Name prefix of every segment.
const PREFIX: &str = "distcomm-";
/// Offsets inside a segment. Each index lives on its own cache line.
const OFF_TAIL: usize = 0;
const OFF_HEAD: usize = 64;
const OFF_CONSUMER_SLEEPING: usize = 128;
const OFF_PRODUCER_WAITING: usize = 192;
const OFF_MAGIC: usize = 256;
const OFF_CAP: usize = 264;
/// The small-message lane (see the module documentation): the consumer's count of slots
/// taken, its answers (one word per outstanding answered message), and the slots.
const OFF_LANE_HEAD: usize = 320;
const OFF_ACKS: usize = 512;
const OFF_SLOTS: usize = 2048;
const OFF_DATA: usize = 8192;
/// Lane slots per direction.
const LANE_SLOTS: u64 = 64;
/// A slot (one cache line): its sequence word, then the body. A message takes consecutive
/// slots: the first holds its header and the payload's first bytes, the others the rest. The
/// first slot's word, written last, is its sequence number with its length in the top bits;
/// the others' words are their own sequence numbers.
const SLOT: usize = 64;
const SLOT_BODY: usize = SLOT - 8;
/// Payload bytes in a message's first slot.
const FIRST: usize = SLOT_BODY - LANE_HEAD;
/// The first slot's word: the low bits of its sequence number (compared as such: they wrap
/// after 2^48 slots), the message's length above them.
const LEN_SHIFT: u32 = 48;
const SEQ_MASK: u64 = (1 << LEN_SHIFT) - 1;
/// Answer word bit: the message was refused (a Nack frame on the ring says why).
const ACK_REFUSED: u64 = 1 << 63;
const MAGIC: u64 = 0x6469_7374_636f_6d33; // "distcom3"
/// Each answer word has a cache line of its own: the producer reads the word of an old message
/// (is it free?) while the consumer writes the newest one.
const ACK_STRIDE: usize = 64;
const _: () = assert!(OFF_ACKS + ACK_STRIDE * LANE_ACKS as usize <= OFF_SLOTS);
const _: () = assert!(OFF_SLOTS + SLOT * LANE_SLOTS as usize <= OFF_DATA);
// The largest message fits the lane twice over.
const _: () = assert!(2 * slots_for(LANE_MAX) <= LANE_SLOTS && LANE_MAX < 1 << 16);

/// Slots a lane message of `len` bytes takes.
const fn slots_for(len: usize) -> u64 {
    1 + (len.saturating_sub(FIRST).div_ceil(SLOT_BODY)) as u64
}

/// A lane message found by [`ShmLink::lane_peek`]: its first slot's sequence number (its id
/// for the answer) and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneMsg {
    pub seq: u64,
    pub len: usize,
}

/// One mapped ring.
struct Ring {
    map: MmapRaw,
    cap: u64,
}

impl Ring {
    fn atomic64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is one of the 64-byte aligned header offsets, inside the mapping (which
        // is page aligned and at least OFF_DATA bytes long, checked when mapped); AtomicU64 has
        // the size and alignment of u64; the mapping lives as long as `self`, and every access
        // to these words, from either process, is atomic.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    fn atomic32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in `atomic64`, for a 4-byte word at an aligned header offset.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: OFF_DATA + cap is the mapping's length (checked when mapped).
        unsafe { self.map.as_mut_ptr().add(OFF_DATA) }
    }

    /// Bytes published and not yet consumed, validated against the capacity.
    fn filled(&self, head: u64, tail: u64) -> io::Result<u64> {
        let n = tail.wrapping_sub(head);
        if n > self.cap {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "shared-memory ring corrupt: {n} bytes in a ring of {}",
                    self.cap
                ),
            ));
        }
        Ok(n)
    }

    /// Hints the CPU to fetch the cache line of logical position `pos` (no effect elsewhere).
    fn prefetch(&self, pos: u64) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `pos % cap < cap`, so the address lies inside the data area; a prefetch
        // neither reads into the program nor faults.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(self.data().add((pos % self.cap) as usize).cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = pos;
    }

    /// Copies `src` into the ring at logical position `pos` (wrapping).
    fn put(&self, pos: u64, src: &[u8]) {
        let cap = self.cap as usize;
        let at = (pos % self.cap) as usize;
        let first = src.len().min(cap - at);
        // SAFETY: `at + first <= cap` and `src.len() - first <= cap - first`, so both copies stay
        // inside the data area; the range lies between the consumer's head and our new tail,
        // which the consumer does not read until we publish the tail.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(at), first);
            std::ptr::copy_nonoverlapping(src[first..].as_ptr(), self.data(), src.len() - first);
        }
    }

    /// The sequence word of lane slot `seq` (from 1).
    fn slot_seq(&self, seq: u64) -> &AtomicU64 {
        self.atomic64(Self::slot_off(seq))
    }

    fn slot_off(seq: u64) -> usize {
        OFF_SLOTS + ((seq.wrapping_sub(1) % LANE_SLOTS) as usize) * SLOT
    }

    /// The body of lane slot `seq`.
    fn slot_body(&self, seq: u64) -> *mut u8 {
        // SAFETY: the slot lies inside the header area of the mapping (const assertions).
        unsafe { self.map.as_mut_ptr().add(Self::slot_off(seq) + 8) }
    }

    /// The answer word of lane message `seq`.
    fn ack_word(&self, seq: u64) -> &AtomicU64 {
        self.atomic64(OFF_ACKS + ((seq % LANE_ACKS) as usize) * ACK_STRIDE)
    }

    /// The answer to lane message `seq` (of this ring's producer): `Some(true)` accepted,
    /// `Some(false)` refused, `None` not yet.
    fn answer_of(&self, seq: u64) -> Option<bool> {
        let w = self.ack_word(seq).load(Ordering::Acquire);
        (w & !ACK_REFUSED == seq).then_some(w & ACK_REFUSED == 0)
    }

    /// Whether the ring holds bytes its consumer has not read (the head is the consumer's own
    /// word: a cache hit on its side while nothing moves).
    fn unread(&self) -> bool {
        let head = self.atomic64(OFF_HEAD).load(Ordering::Relaxed);
        self.atomic64(OFF_TAIL).load(Ordering::Acquire) != head
    }

    /// Whether the lane holds a message after the `taken` slots the consumer took.
    fn lane_ready(&self, taken: u64) -> bool {
        self.slot_seq(taken + 1).load(Ordering::Acquire) & SEQ_MASK == (taken + 1) & SEQ_MASK
    }

    /// Copies from the ring at logical position `pos` into `dst` (wrapping).
    fn get(&self, pos: u64, dst: &mut [u8]) {
        let cap = self.cap as usize;
        let at = (pos % self.cap) as usize;
        let first = dst.len().min(cap - at);
        let rest = dst.len() - first;
        // SAFETY: as in `put`; the range lies between our head and the producer's published
        // tail, which the producer does not overwrite until we publish a new head.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(at), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data(), dst[first..].as_mut_ptr(), rest);
        }
    }
}

/// Both directions of a shared-memory link, plus what a transfer needs about the peer.
pub(crate) struct ShmLink {
    tx: Arc<Ring>,
    rx: Arc<Ring>,
    /// The consumer's head of `tx` as last read (it only ever grows): free space known without
    /// touching the consumer's cache line.
    tx_head: Cell<u64>,
    /// Lane messages written to `tx`, and the consumer's count of those taken as last read.
    tx_lane: Cell<u64>,
    tx_lane_head: Cell<u64>,
    /// Lane messages taken from `rx`.
    rx_lane: Cell<u64>,
    /// The peer's process id (cross-memory attach, messages).
    pub pid: i32,
    /// Large messages may go by cross-memory attach (both sides allowed it, the kernel has not
    /// refused it yet).
    pub cma: bool,
}

impl ShmLink {
    fn new(tx: Ring, rx: Ring, pid: i32, cma: bool) -> ShmLink {
        ShmLink {
            tx: Arc::new(tx),
            rx: Arc::new(rx),
            tx_head: Cell::new(0),
            tx_lane: Cell::new(0),
            tx_lane_head: Cell::new(0),
            rx_lane: Cell::new(0),
            pid,
            cma,
        }
    }

    /// What another thread may watch without the link: answers to our lane messages, and
    /// whether anything arrived.
    pub fn watch(&self) -> ShmWatch {
        ShmWatch {
            tx: self.tx.clone(),
            rx: self.rx.clone(),
        }
    }

    /// Whether the consumer has read everything we wrote to the ring (a lane message may not
    /// overtake anything there).
    fn ring_drained(&self) -> io::Result<bool> {
        let r = &self.tx;
        let tail = r.atomic64(OFF_TAIL).load(Ordering::Relaxed);
        if self.tx_head.get() != tail {
            let head = r.atomic64(OFF_HEAD).load(Ordering::Acquire);
            r.filled(head, tail)?;
            self.tx_head.set(head);
        }
        Ok(self.tx_head.get() == tail)
    }

    /// Lane messages written and not yet taken by the consumer (validated).
    fn lane_filled(&self, reload: bool) -> io::Result<u64> {
        if reload {
            let head = self.tx.atomic64(OFF_LANE_HEAD).load(Ordering::Acquire);
            if self.tx_lane.get().wrapping_sub(head) > LANE_SLOTS {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "shared-memory lane corrupt: {head} of {} messages taken",
                        self.tx_lane.get()
                    ),
                ));
            }
            self.tx_lane_head.set(head);
        }
        Ok(self.tx_lane.get() - self.tx_lane_head.get())
    }

    /// Whether the consumer has taken every lane message (nothing on the ring may overtake
    /// one).
    fn lane_drained(&self) -> io::Result<bool> {
        Ok(self.lane_filled(false)? == 0 || self.lane_filled(true)? == 0)
    }

    /// The answer to our lane message `seq` (see [`ShmWatch::answered`]).
    pub fn answered(&self, seq: u64) -> Option<bool> {
        self.tx.answer_of(seq)
    }

    /// The sequence number the next lane message will get.
    pub fn next_lane_seq(&self) -> u64 {
        self.tx_lane.get() + 1
    }

    /// Writes a small message (`head`, then at most [`LANE_MAX`] bytes of `payload`) to the
    /// lane, if nothing written to the ring is still unread and its slots are free. Returns its
    /// sequence number and whether the consumer is asleep and needs a doorbell; `None` when the
    /// lane cannot take it.
    pub fn lane_send(
        &self,
        head: &[u8; LANE_HEAD],
        payload: &[u8],
    ) -> io::Result<Option<(u64, bool)>> {
        let len = payload.len();
        let k = slots_for(len);
        if len > LANE_MAX
            || !self.ring_drained()?
            || (self.lane_filled(false)? + k > LANE_SLOTS
                && self.lane_filled(true)? + k > LANE_SLOTS)
        {
            return Ok(None);
        }
        let seq = self.tx_lane.get() + 1;
        let r = &self.tx;
        let first = len.min(FIRST);
        // The continuation slots first, then the first slot, whose word publishes them all.
        for (i, chunk) in (1..).zip(payload[first..].chunks(SLOT_BODY)) {
            // SAFETY: `slot_body` is inside the mapping and has SLOT_BODY >= chunk.len() bytes;
            // the consumer took the slot's previous message (room was checked) and reads it
            // again only after the first slot's word below says message `seq` is there.
            unsafe {
                std::ptr::copy_nonoverlapping(chunk.as_ptr(), r.slot_body(seq + i), chunk.len())
            };
            r.slot_seq(seq + i).store(seq + i, Ordering::Release);
        }
        // SAFETY: as above, for the first slot: LANE_HEAD + first <= SLOT_BODY.
        unsafe {
            let at = r.slot_body(seq);
            std::ptr::copy_nonoverlapping(head.as_ptr(), at, LANE_HEAD);
            std::ptr::copy_nonoverlapping(payload.as_ptr(), at.add(LANE_HEAD), first);
        }
        r.slot_seq(seq).store(
            seq & SEQ_MASK | (len as u64) << LEN_SHIFT,
            Ordering::Release,
        );
        self.tx_lane.set(seq + k - 1);
        Ok(Some((seq, self.consumer_asleep())))
    }

    /// After publishing to the peer (ring bytes, a lane message, an answer): whether it sleeps
    /// and must be rung (once per sleep).
    fn consumer_asleep(&self) -> bool {
        // Pairs with the fence in `prepare_sleep`: either the peer sees what we published, or
        // we see its flag.
        fence(Ordering::SeqCst);
        lower(self.tx.atomic32(OFF_CONSUMER_SLEEPING))
    }

    /// After taking from the inbound ring or lane: whether the producer waits for room and
    /// must be rung (once per wait).
    fn producer_waiting(&self) -> bool {
        fence(Ordering::SeqCst);
        lower(self.rx.atomic32(OFF_PRODUCER_WAITING))
    }

    /// The next lane message, if one is there: its header is copied into `head`; nothing is
    /// taken until [`lane_release`](Self::lane_release). A length or a continuation slot that
    /// breaks the layout is an error (the peer wrote garbage).
    pub fn lane_peek(&self, head: &mut [u8; LANE_HEAD]) -> io::Result<Option<LaneMsg>> {
        let r = &self.rx;
        let seq = self.rx_lane.get() + 1;
        let word = r.slot_seq(seq).load(Ordering::Acquire);
        if word & SEQ_MASK != seq & SEQ_MASK {
            return Ok(None);
        }
        let len = (word >> LEN_SHIFT) as usize;
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        if len > LANE_MAX {
            return Err(bad(format!("shared-memory lane message of {len} bytes")));
        }
        for i in 1..slots_for(len) {
            if r.slot_seq(seq + i).load(Ordering::Relaxed) != seq + i {
                return Err(bad(format!(
                    "shared-memory lane message {seq} is incomplete"
                )));
            }
        }
        // SAFETY: the first slot's body has LANE_HEAD bytes; the producer wrote them before
        // publishing `seq` (acquired above) and keeps off until we release the message.
        unsafe { std::ptr::copy_nonoverlapping(r.slot_body(seq), head.as_mut_ptr(), LANE_HEAD) };
        Ok(Some(LaneMsg { seq, len }))
    }

    /// Copies the payload of message `m` (from [`lane_peek`](Self::lane_peek), not yet
    /// released) into `dst` (up to its length).
    pub fn lane_copy(&self, m: LaneMsg, dst: &mut [u8]) {
        let r = &self.rx;
        let len = m.len.min(dst.len());
        let first = len.min(FIRST);
        // SAFETY: the slots of `m` lie inside the mapping, hold what the producer wrote before
        // publishing `m` (checked by `lane_peek`), and stay untouched until we release them;
        // each copy stays within one slot's body and within `dst`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                r.slot_body(m.seq).add(LANE_HEAD),
                dst.as_mut_ptr(),
                first,
            );
        }
        for (i, chunk) in (1..).zip(dst[first..len].chunks_mut(SLOT_BODY)) {
            // SAFETY: as above.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    r.slot_body(m.seq + i),
                    chunk.as_mut_ptr(),
                    chunk.len(),
                )
            };
        }
    }

    /// Releases the slots of message `m`, first writing its answer (`Some(refused)`) when it
    /// has one already. Returns whether the peer sleeps (or waits for room) and needs a
    /// doorbell.
    pub fn lane_release(&self, m: LaneMsg, answer: Option<bool>) -> bool {
        if let Some(refused) = answer {
            self.answer_word(m.seq, refused);
        }
        let taken = m.seq + slots_for(m.len) - 1;
        self.rx_lane.set(taken);
        self.rx
            .atomic64(OFF_LANE_HEAD)
            .store(taken, Ordering::Release);
        // One fence for both flags (see `consumer_asleep` and `producer_waiting`).
        fence(Ordering::SeqCst);
        let waiting = lower(self.rx.atomic32(OFF_PRODUCER_WAITING));
        let asleep = answer.is_some() && lower(self.tx.atomic32(OFF_CONSUMER_SLEEPING));
        waiting || asleep
    }

    fn answer_word(&self, seq: u64, refused: bool) {
        let word = seq | if refused { ACK_REFUSED } else { 0 };
        self.rx.ack_word(seq).store(word, Ordering::Release);
    }

    /// Answers lane message `seq` taken earlier: accepted or refused. Returns whether the peer
    /// sleeps and needs a doorbell.
    pub fn lane_answer(&self, seq: u64, refused: bool) -> bool {
        self.answer_word(seq, refused);
        self.consumer_asleep()
    }

    /// Writes as much of `iov` as fits into the outbound ring. Returns the bytes written and
    /// whether the consumer is asleep and needs a doorbell. Nothing is written while a lane
    /// message is still untaken (it must not be overtaken).
    pub fn write(&self, iov: &[IoSlice<'_>]) -> io::Result<(usize, bool)> {
        if !self.lane_drained()? {
            return Ok((0, false));
        }
        let r = &self.tx;
        let tail = r.atomic64(OFF_TAIL).load(Ordering::Relaxed);
        let want: usize = iov.iter().map(|s| s.len()).sum();
        let mut free = (r.cap - r.filled(self.tx_head.get(), tail)?) as usize;
        if free < want {
            let head = r.atomic64(OFF_HEAD).load(Ordering::Acquire);
            free = (r.cap - r.filled(head, tail)?) as usize;
            self.tx_head.set(head);
        }
        let mut pos = tail;
        for s in iov {
            if free == 0 {
                break;
            }
            let n = s.len().min(free);
            r.put(pos, &s[..n]);
            pos += n as u64;
            free -= n;
        }
        let written = (pos - tail) as usize;
        if written == 0 {
            return Ok((0, false));
        }
        r.atomic64(OFF_TAIL).store(pos, Ordering::Release);
        Ok((written, self.consumer_asleep()))
    }

    /// Reads up to `dst.len()` bytes from the inbound ring. Returns the bytes read and whether
    /// the producer waits for room and needs a doorbell.
    pub fn read(&self, dst: &mut [u8]) -> io::Result<(usize, bool)> {
        let r = &self.rx;
        let head = r.atomic64(OFF_HEAD).load(Ordering::Relaxed);
        let tail = r.atomic64(OFF_TAIL).load(Ordering::Acquire);
        let n = (r.filled(head, tail)? as usize).min(dst.len());
        if n == 0 {
            // Ask for the line the next frame will start in, so that its transfer overlaps
            // the one of the tail when the producer publishes.
            r.prefetch(head);
            return Ok((0, false));
        }
        r.get(head, &mut dst[..n]);
        r.atomic64(OFF_HEAD)
            .store(head + n as u64, Ordering::Release);
        Ok((n, self.producer_waiting()))
    }

    /// Before sleeping on the doorbell: raises our flags (consumer asleep; producer waiting for
    /// room if `want_room`) and returns whether there is already something to do, in which case
    /// the caller must not sleep.
    pub fn prepare_sleep(&self, want_room: bool) -> bool {
        self.rx
            .atomic32(OFF_CONSUMER_SLEEPING)
            .store(1, Ordering::Relaxed);
        if want_room {
            self.tx
                .atomic32(OFF_PRODUCER_WAITING)
                .store(1, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        let tx_tail = self.tx.atomic64(OFF_TAIL).load(Ordering::Relaxed);
        let tx_head = self.tx.atomic64(OFF_HEAD).load(Ordering::Acquire);
        let writable = tx_tail.wrapping_sub(tx_head) < self.tx.cap
            && self.tx.atomic64(OFF_LANE_HEAD).load(Ordering::Acquire) == self.tx_lane.get();
        self.rx.unread() || self.rx.lane_ready(self.rx_lane.get()) || (want_room && writable)
    }

    /// After waking: lowers our flags so the peer stops ringing.
    pub fn woke(&self) {
        self.rx
            .atomic32(OFF_CONSUMER_SLEEPING)
            .store(0, Ordering::Relaxed);
        self.tx
            .atomic32(OFF_PRODUCER_WAITING)
            .store(0, Ordering::Relaxed);
    }
}

/// Clears a raised sleep flag; returns whether it was raised (then the caller rings).
fn lower(flag: &AtomicU32) -> bool {
    flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0
}

/// The parts of a link a waiting thread watches without holding the link: every access is an
/// atomic load.
pub(crate) struct ShmWatch {
    tx: Arc<Ring>,
    rx: Arc<Ring>,
}

impl ShmWatch {
    /// The answer to our lane message `seq`: `Some(true)` accepted, `Some(false)` refused,
    /// `None` not yet.
    pub fn answered(&self, seq: u64) -> Option<bool> {
        self.tx.answer_of(seq)
    }

    /// Whether the peer wrote something we have not taken: a lane message, or ring bytes.
    pub fn incoming(&self) -> bool {
        // Our own published count: a cache hit while nothing moves.
        let taken = self.rx.atomic64(OFF_LANE_HEAD).load(Ordering::Relaxed);
        self.rx.lane_ready(taken) || self.rx.unread()
    }

    /// Whether the peer wrote ring bytes we have not read.
    pub fn ring_incoming(&self) -> bool {
        self.rx.unread()
    }
}

/// Rings the doorbell: one byte on the link's socket. A full socket buffer means unread
/// doorbells are already there, which wake the peer just as well.
pub(crate) fn ring_doorbell(stream: &TcpStream) {
    let _ = (&*stream).write(&[0u8]);
}

/// Reads and discards doorbell bytes; `Err` when the socket closed (the peer is gone).
pub(crate) fn drain_doorbell(stream: &TcpStream) -> std::result::Result<(), String> {
    let mut sink = [0u8; 256];
    loop {
        match (&*stream).read(&mut sink) {
            Ok(0) => return Err("connection closed by peer".into()),
            Ok(n) if n < sink.len() => return Ok(()),
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst` (cross-memory attach).
pub(crate) fn cma_read(pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let len = dst.len();
    let base = dst.as_mut_ptr();
    cma_all(len, "read", |done| {
        let (local, remote) = iovecs(base.wrapping_add(done), len - done, addr, done);
        // SAFETY: `local` describes the writable remainder of `dst`, which we borrow exclusively
        // for this call; `remote` is only interpreted by the kernel in the other process's
        // address space, where a bad address is an EFAULT, never an access to our memory.
        unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) }
    })
}

/// Copies `src` to `addr` in process `pid` (cross-memory attach).
pub(crate) fn cma_write(pid: i32, addr: u64, src: &[u8]) -> io::Result<()> {
    let len = src.len();
    let base = src.as_ptr().cast_mut();
    cma_all(len, "write", |done| {
        let (local, remote) = iovecs(base.wrapping_add(done), len - done, addr, done);
        // SAFETY: `local` describes the remainder of `src`, which the kernel only reads;
        // `remote` is interpreted in the other process, where a bad address is an EFAULT.
        unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) }
    })
}

/// The local and remote iovecs of the part of a cross-memory copy still to do.
fn iovecs(local: *mut u8, left: usize, addr: u64, done: usize) -> (libc::iovec, libc::iovec) {
    (
        libc::iovec {
            iov_base: local.cast(),
            iov_len: left,
        },
        libc::iovec {
            iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: left,
        },
    )
}

/// Repeats a partial cross-memory copy (`step(done)` returns what the system call returned)
/// until `len` bytes moved, retrying interrupted calls.
fn cma_all(len: usize, what: &str, mut step: impl FnMut(usize) -> isize) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let n = step(done);
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("cross-memory {what} made no progress"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Identifies the shared-memory domain of this process: the running kernel (boot id) and the
/// `/dev/shm` file system. Two processes with equal identities can map each other's segments.
fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let meta = std::fs::metadata(SHM_DIR).ok()?;
    Some(format!("{}:{}:{}", boot.trim(), meta.dev(), meta.ino()))
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Unlinks segments left by processes that died during initialisation.
fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<i32>().ok());
        if pid.is_some_and(|p| p > 0 && !pid_alive(p)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn segment_len(cap: usize) -> usize {
    OFF_DATA + cap
}

/// Creates segment `name` of `len` bytes (only for us: mode 0600) and maps it.
fn map_new(name: &str, len: usize) -> io::Result<MmapRaw> {
    let path = format!("{SHM_DIR}/{name}");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    // Reserve the pages now: on a full /dev/shm (containers often have 64 MiB) a sparse file
    // maps fine and then kills the process with SIGBUS on first touch; this way it is an error
    // here, and `auto` falls back to TCP.
    let made = file
        .set_len(len as u64)
        .and_then(|()| reserve(&file, len))
        .and_then(|()| MmapRaw::map_raw(&file));
    if made.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    made
}

/// Allocates the backing pages of `file` (`posix_fallocate`).
fn reserve(file: &File, len: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
    // SAFETY: posix_fallocate on a descriptor we own, with an in-range offset and length; it
    // touches no memory of ours.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Maps the existing segment `name` (and with `unlink`, removes its name); returns the mapping
/// and its length.
fn map_existing(name: &str, unlink: bool) -> io::Result<(MmapRaw, usize)> {
    if !name.starts_with(PREFIX) || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a distcomm segment"),
        ));
    }
    let path = format!("{SHM_DIR}/{name}");
    let file: File = OpenOptions::new().read(true).write(true).open(&path)?;
    if unlink {
        let _ = std::fs::remove_file(&path);
    }
    let len = file.metadata()?.len() as usize;
    Ok((MmapRaw::map_raw(&file)?, len))
}

/// Creates and maps our outbound ring for `peer`.
fn create(name: &str, cap: usize) -> io::Result<Ring> {
    let ring = Ring {
        map: map_new(name, segment_len(cap))?,
        cap: cap as u64,
    };
    ring.atomic64(OFF_CAP).store(cap as u64, Ordering::Relaxed);
    ring.atomic64(OFF_MAGIC).store(MAGIC, Ordering::Release);
    Ok(ring)
}

/// Maps the peer's ring `name`, checks its header, and unlinks the name.
fn open(name: &str) -> io::Result<Ring> {
    let (map, len) = map_existing(name, true)?;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    if len < OFF_DATA {
        return Err(bad(format!("segment {name} is only {len} bytes")));
    }
    let ring = Ring { map, cap: 0 };
    let magic = ring.atomic64(OFF_MAGIC).load(Ordering::Acquire);
    let cap = ring.atomic64(OFF_CAP).load(Ordering::Relaxed);
    if magic != MAGIC || cap == 0 || segment_len(cap as usize) != len {
        return Err(bad(format!(
            "segment {name} has a foreign header (magic {magic:#x}, capacity {cap}, {len} bytes)"
        )));
    }
    Ok(Ring { cap, ..ring })
}

/// A shared memory region every rank of a group maps (the arena of intra-node collectives):
/// atomic words for synchronisation and byte ranges for data. What may be accessed when is
/// the user's protocol; this type only keeps every access inside the mapping.
pub(crate) struct Region {
    map: MmapRaw,
    len: usize,
}

impl Region {
    /// Creates segment `name` of `len` bytes for the group (named per job: see the module).
    pub fn create(len: usize) -> io::Result<(Region, String)> {
        let mut nonce = [0u8; 4];
        getrandom::getrandom(&mut nonce).map_err(|e| io::Error::other(e.to_string()))?;
        let name = format!(
            "{PREFIX}{}-{:08x}-arena",
            std::process::id(),
            u32::from_le_bytes(nonce)
        );
        Ok((
            Region {
                map: map_new(&name, len)?,
                len,
            },
            name,
        ))
    }

    /// Maps the group's segment `name`; it must be `len` bytes. Its creator unlinks it once
    /// every rank has mapped it.
    pub fn open(name: &str, len: usize) -> io::Result<Region> {
        let (map, got) = map_existing(name, false)?;
        if got != len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("segment {name} is {got} bytes, expected {len}"),
            ));
        }
        Ok(Region { map, len })
    }

    /// Removes the name of segment `name` (every rank has mapped it).
    pub fn unlink(name: &str) {
        if name.starts_with(PREFIX) && !name.contains('/') {
            let _ = std::fs::remove_file(format!("{SHM_DIR}/{name}"));
        }
    }

    /// The 8-byte word at `off` (rounded down to a multiple of 8, clamped into the region).
    pub fn word(&self, off: usize) -> &AtomicU64 {
        let off = (off & !7).min(self.len.saturating_sub(8));
        // SAFETY: `off` is 8-aligned (the mapping is page aligned) and `off + 8 <= len`; the
        // mapping lives as long as `self`; every process accesses these words atomically only.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    /// Bytes `off..off + n` as a slice of `T` (clamped into the region).
    ///
    /// # Safety
    /// No process may write the range while the slice lives (the caller's protocol ensures it),
    /// and `off` must be aligned for `T`.
    pub unsafe fn view<T: bytemuck::Pod>(&self, off: usize, n: usize) -> &[T] {
        let off = off.min(self.len);
        let n = n.min((self.len - off) / std::mem::size_of::<T>().max(1));
        std::slice::from_raw_parts(self.map.as_mut_ptr().add(off).cast::<T>(), n)
    }

    /// Bytes `off..off + n` as a mutable slice of `T` (clamped into the region).
    ///
    /// # Safety
    /// No other access to the range, from any process, while the slice lives (the caller's
    /// protocol ensures it), and `off` must be aligned for `T`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn view_mut<T: bytemuck::Pod>(&self, off: usize, n: usize) -> &mut [T] {
        let off = off.min(self.len);
        let n = n.min((self.len - off) / std::mem::size_of::<T>().max(1));
        std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off).cast::<T>(), n)
    }
}

/// What a rank tells each peer before deciding on the link.
struct Hello {
    host: String,
    pid: i32,
    /// What the peer asked for (unknown words, from a newer peer, read as `auto`).
    kind: TransportKind,
    cma: bool,
    seg: String,
}

impl Hello {
    fn encode(&self) -> String {
        format!(
            "host={} pid={} kind={} cma={} seg={}\n",
            self.host,
            self.pid,
            self.kind.word(),
            u8::from(self.cma),
            self.seg
        )
    }

    fn decode(line: &str) -> Option<Hello> {
        let mut h = Hello {
            host: String::new(),
            pid: 0,
            kind: TransportKind::Auto,
            cma: false,
            seg: String::new(),
        };
        for field in line.split_whitespace() {
            let (k, v) = field.split_once('=')?;
            match k {
                "host" => h.host = v.to_string(),
                "pid" => h.pid = v.parse().ok()?,
                "kind" => h.kind = TransportKind::parse(v).unwrap_or_default(),
                "cma" => h.cma = v == "1",
                "seg" => h.seg = v.to_string(),
                _ => {}
            }
        }
        Some(h)
    }
}

/// Reads one `\n`-terminated line of at most 1 KiB from a blocking stream.
fn read_line(stream: &TcpStream, deadline: Instant) -> io::Result<String> {
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(std::time::Duration::from_millis(1))))?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < 1024 {
        if (&*stream).read(&mut b)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if b[0] == b'\n' {
            stream.set_read_timeout(None)?;
            return String::from_utf8(line)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8"));
        }
        line.push(b[0]);
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"))
}

/// Decides, with every peer, which links use shared memory, and sets those up. Runs on the
/// freshly authenticated, still blocking streams. Returns one entry per rank (`None`: TCP).
pub(crate) fn setup(
    streams: &[Option<TcpStream>],
    rank: usize,
    cfg: &ShmConfig,
    deadline: Instant,
) -> Result<Vec<Option<ShmLink>>> {
    let world = streams.len();
    let mut links: Vec<Option<ShmLink>> = (0..world).map(|_| None).collect();
    if world <= 1 {
        return Ok(links);
    }
    let proto = |peer: usize, detail: String| Error::Protocol { rank, peer, detail };
    // Even a rank that wants TCP says so, so that a peer insisting on shared memory can fail
    // with a clear error instead of confusing these lines with frames.
    let host = if cfg.kind == TransportKind::Tcp {
        None
    } else {
        host_identity()
    };
    if cfg.kind == TransportKind::Shm && host.is_none() {
        return Err(Error::Config(format!(
            "DISTCOMM_TRANSPORT=shm, but {SHM_DIR} or /proc is unavailable here"
        )));
    }
    if host.is_some() {
        sweep_stale();
    }
    let pid = std::process::id() as i32;
    let mut nonce = [0u8; 4];
    getrandom::getrandom(&mut nonce).map_err(|e| Error::Config(format!("randomness: {e}")))?;
    let nonce = u32::from_le_bytes(nonce);
    let cap = cfg.ring.max(4096).next_power_of_two();

    // Phase 1: create our outbound rings and tell every peer about them.
    let mut tx: Vec<Option<(String, Ring)>> = (0..world).map(|_| None).collect();
    let cleanup = |tx: &[Option<(String, Ring)>]| {
        for (name, _) in tx.iter().flatten() {
            let _ = std::fs::remove_file(format!("{SHM_DIR}/{name}"));
        }
    };
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let mut seg = String::from("-");
        if host.is_some() {
            let name = format!("{PREFIX}{pid}-{nonce:08x}-{rank}to{peer}");
            match create(&name, cap) {
                Ok(ring) => {
                    seg = name.clone();
                    tx[peer] = Some((name, ring));
                }
                Err(e) if cfg.kind == TransportKind::Shm => {
                    cleanup(&tx);
                    return Err(Error::io(format!("create {SHM_DIR}/{name}"), e));
                }
                Err(_) => {}
            }
        }
        let hello = Hello {
            host: host.clone().unwrap_or_else(|| "-".into()),
            pid,
            kind: cfg.kind,
            cma: cfg.cma,
            seg,
        };
        if let Err(e) = (&*s).write_all(hello.encode().as_bytes()) {
            cleanup(&tx);
            return Err(Error::PeerLost {
                op: "shared-memory setup",
                rank,
                peer,
                reason: e.to_string(),
            });
        }
    }

    // Phase 2: read every peer's hello, map the rings of those on this host.
    let mut rx: Vec<Option<(Hello, Ring)>> = (0..world).map(|_| None).collect();
    let mut verdict: Vec<std::result::Result<(), String>> = vec![Ok(()); world];
    // Links where either side insists on shared memory.
    let mut forced = vec![cfg.kind == TransportKind::Shm; world];
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let line = read_line(s, deadline).map_err(|e| {
            cleanup(&tx);
            Error::PeerLost {
                op: "shared-memory setup",
                rank,
                peer,
                reason: e.to_string(),
            }
        })?;
        let Some(h) = Hello::decode(&line) else {
            cleanup(&tx);
            return Err(proto(peer, format!("bad shared-memory hello {line:?}")));
        };
        forced[peer] |= h.kind == TransportKind::Shm;
        let why_not = if cfg.kind == TransportKind::Tcp || h.kind == TransportKind::Tcp {
            Some("one side chose tcp")
        } else if host.as_deref().is_none_or(|me| me != h.host) {
            Some("another host, or no shared memory there")
        } else {
            None
        };
        if let Some(why) = why_not {
            if forced[peer] {
                cleanup(&tx);
                return Err(Error::Config(format!(
                    "DISTCOMM_TRANSPORT=shm, but ranks {rank} and {peer} cannot share memory \
                     ({why}; rank {peer} asked for {})",
                    h.kind.word()
                )));
            }
            verdict[peer] = Err(why.into());
            continue;
        }
        if tx[peer].is_none() || !h.seg.starts_with(PREFIX) || h.seg.contains('/') {
            verdict[peer] = Err("no segment".into());
            continue;
        }
        match open(&h.seg) {
            Ok(ring) => rx[peer] = Some((h, ring)),
            Err(e) => verdict[peer] = Err(format!("map {}: {e}", h.seg)),
        }
    }

    // Phase 3: tell every peer whether we mapped its ring; phase 4: learn whether it mapped
    // ours. A link uses shared memory only if both sides succeeded.
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let word = if verdict[peer].is_ok() {
            "ok\n"
        } else {
            "no\n"
        };
        if let Err(e) = (&*s).write_all(word.as_bytes()) {
            cleanup(&tx);
            return Err(Error::PeerLost {
                op: "shared-memory setup",
                rank,
                peer,
                reason: e.to_string(),
            });
        }
    }
    // What each link chose and why (the init summary).
    let mut chose: Vec<String> = vec![String::new(); world];
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let theirs = read_line(s, deadline);
        let _ = std::fs::remove_file(format!(
            "{SHM_DIR}/{}",
            tx[peer].as_ref().map_or("", |t| t.0.as_str())
        ));
        let theirs = match theirs {
            Ok(w) => w,
            Err(e) => {
                cleanup(&tx);
                return Err(Error::PeerLost {
                    op: "shared-memory setup",
                    rank,
                    peer,
                    reason: e.to_string(),
                });
            }
        };
        let ours = std::mem::replace(&mut verdict[peer], Ok(()));
        chose[peer] = match (&ours, theirs == "ok") {
            (Ok(()), true) => "shm".into(),
            (Err(why), _) => format!("tcp ({why})"),
            (Ok(()), false) => "tcp (the peer could not map our ring)".into(),
        };
        match (ours, theirs == "ok", tx[peer].take(), rx[peer].take()) {
            (Ok(()), true, Some((_, t)), Some((h, r))) => {
                let cma = cfg.cma && h.cma;
                if !cma {
                    chose[peer] = "shm (no cross-memory attach)".into();
                }
                links[peer] = Some(ShmLink::new(t, r, h.pid, cma))
            }
            (ours, _, _, _) if forced[peer] => {
                cleanup(&tx);
                let why = ours
                    .err()
                    .unwrap_or_else(|| "the peer could not map ours".into());
                return Err(Error::Config(format!(
                    "DISTCOMM_TRANSPORT=shm, but the shared-memory link between ranks {rank} \
                     and {peer} failed: {why}"
                )));
            }
            _ => {}
        }
    }
    if tracing::enabled!(target: "distcomm::init", tracing::Level::INFO) {
        let chose: Vec<String> = (0..world)
            .filter(|&p| p != rank)
            .map(|p| format!("{p}:{}", chose[p]))
            .collect();
        tracing::info!(
            target: "distcomm::init",
            rank,
            asked = cfg.kind.word(),
            ring = cap,
            "links of rank {rank}: {}",
            chose.join(", ")
        );
    }
    Ok(links)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cap: usize) -> ShmLink {
        // Tests run in parallel threads of one process: one name each.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}{}-test-{k}", std::process::id());
        let a = create(&name, cap).unwrap();
        let b = open(&name).unwrap();
        assert!(!std::path::Path::new(&format!("{SHM_DIR}/{name}")).exists());
        // A link whose rx is the same segment as its tx: a loop back to ourselves.
        ShmLink::new(a, b, 0, false)
    }

    #[test]
    fn ring_wraps_and_stops_when_full() {
        let link = pair(4096);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut got = Vec::new();
        let mut sent = 0;
        let mut buf = vec![0u8; 1000];
        while got.len() < data.len() {
            let (n, _) = link.write(&[IoSlice::new(&data[sent..])]).unwrap();
            assert!(n <= 4096);
            sent += n;
            let (m, _) = link.read(&mut buf).unwrap();
            got.extend_from_slice(&buf[..m]);
        }
        assert_eq!(got, data);
    }

    #[test]
    fn sleeping_consumer_asks_for_a_doorbell() {
        let link = pair(4096);
        assert!(!link.prepare_sleep(false));
        let (_, ring) = link.write(&[IoSlice::new(b"x")]).unwrap();
        assert!(ring, "a sleeping consumer must be rung");
        let (_, ring) = link.write(&[IoSlice::new(b"y")]).unwrap();
        assert!(!ring, "one doorbell per sleep");
        assert!(link.prepare_sleep(false), "data is waiting: do not sleep");
    }

    #[test]
    fn corrupt_indices_are_an_error() {
        let link = pair(4096);
        link.tx.atomic64(OFF_TAIL).store(1 << 40, Ordering::Relaxed);
        assert!(link.read(&mut [0u8; 16]).is_err());
        assert!(link.write(&[IoSlice::new(b"z")]).is_err());
    }

    fn head(k: u8) -> [u8; LANE_HEAD] {
        std::array::from_fn(|i| k.wrapping_add(i as u8))
    }

    fn payload(k: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| k.wrapping_mul(31).wrapping_add(i as u8))
            .collect()
    }

    /// Takes the next lane message whole: header, payload.
    fn take(link: &ShmLink) -> Option<(LaneMsg, [u8; LANE_HEAD], Vec<u8>)> {
        let mut h = [0u8; LANE_HEAD];
        let m = link.lane_peek(&mut h).unwrap()?;
        let mut data = vec![0u8; m.len];
        link.lane_copy(m, &mut data);
        link.lane_release(m, None);
        Some((m, h, data))
    }

    #[test]
    fn lane_keeps_order_and_sizes_and_refuses_when_full() {
        let link = pair(4096);
        // Sizes around the slot boundaries; sent and taken in waves that wrap the slots.
        let lens = [
            0,
            1,
            8,
            FIRST,
            FIRST + 1,
            FIRST + SLOT_BODY,
            200,
            1000,
            LANE_MAX,
        ];
        let mut sent = std::collections::VecDeque::new();
        for wave in 0..20u8 {
            for (k, &len) in lens.iter().enumerate() {
                let tag = wave.wrapping_mul(16).wrapping_add(k as u8);
                match link.lane_send(&head(tag), &payload(tag, len)).unwrap() {
                    Some((seq, _)) => sent.push_back((seq, tag, len)),
                    None => {
                        // Full: the lane holds at most LANE_SLOTS slots of messages.
                        let used: u64 = sent.iter().map(|&(_, _, l)| slots_for(l)).sum();
                        assert!(used + slots_for(len) > LANE_SLOTS, "refused with room");
                        break;
                    }
                }
            }
            while sent.len() > 2 {
                let (seq, tag, len) = sent.pop_front().unwrap();
                let (m, h, data) = take(&link).unwrap();
                assert_eq!((m.seq, m.len), (seq, len));
                assert_eq!((h, data), (head(tag), payload(tag, len)));
            }
        }
        while let Some((seq, tag, len)) = sent.pop_front() {
            let (m, h, data) = take(&link).unwrap();
            assert_eq!((m.seq, h, data), (seq, head(tag), payload(tag, len)));
        }
        assert!(take(&link).is_none());
    }

    #[test]
    fn sequence_numbers_wrap_past_their_48_bits() {
        let link = pair(4096);
        let start = SEQ_MASK - 3;
        link.tx_lane.set(start);
        link.tx_lane_head.set(start);
        link.tx
            .atomic64(OFF_LANE_HEAD)
            .store(start, Ordering::Relaxed);
        link.rx_lane.set(start);
        for k in 0..8u8 {
            link.lane_send(&head(k), &payload(k, 100)).unwrap().unwrap();
            let (_, h, data) = take(&link).unwrap();
            assert_eq!((h, data), (head(k), payload(k, 100)));
        }
    }

    #[test]
    fn a_peeked_message_is_not_taken() {
        let link = pair(4096);
        let (seq, _) = link.lane_send(&head(1), &payload(1, 100)).unwrap().unwrap();
        let mut h = [0u8; LANE_HEAD];
        let m = link.lane_peek(&mut h).unwrap().unwrap();
        assert_eq!(link.lane_peek(&mut h).unwrap(), Some(m));
        assert_eq!(m.seq, seq);
        link.lane_release(m, None);
        assert_eq!(link.lane_peek(&mut h).unwrap(), None);
    }

    #[test]
    fn lane_and_ring_never_overtake_each_other() {
        let link = pair(4096);
        let (n, _) = link.write(&[IoSlice::new(b"ring")]).unwrap();
        assert_eq!(n, 4);
        assert!(
            link.lane_send(&head(1), b"x").unwrap().is_none(),
            "unread ring bytes come first"
        );
        link.read(&mut [0u8; 4]).unwrap();
        assert!(link.lane_send(&head(1), b"x").unwrap().is_some());
        assert_eq!(
            link.write(&[IoSlice::new(b"x")]).unwrap().0,
            0,
            "an untaken lane message comes first"
        );
        let mut h = [0u8; LANE_HEAD];
        let m = link.lane_peek(&mut h).unwrap().unwrap();
        assert_eq!(
            link.write(&[IoSlice::new(b"x")]).unwrap().0,
            0,
            "not yet released"
        );
        link.lane_release(m, None);
        assert_eq!(link.write(&[IoSlice::new(b"x")]).unwrap().0, 1);
    }

    #[test]
    fn answers_reach_the_producer() {
        let link = pair(4096);
        let watch = link.watch();
        let (a, _) = link.lane_send(&head(1), &payload(1, 300)).unwrap().unwrap();
        let (b, _) = link.lane_send(&head(2), b"").unwrap().unwrap();
        assert_eq!((watch.answered(a), link.answered(b)), (None, None));
        assert!(watch.incoming() && !watch.ring_incoming());
        let mut h = [0u8; LANE_HEAD];
        let m = link.lane_peek(&mut h).unwrap().unwrap();
        link.lane_release(m, Some(false));
        let m = link.lane_peek(&mut h).unwrap().unwrap();
        link.lane_release(m, None);
        assert!(!watch.incoming());
        link.lane_answer(b, true);
        assert_eq!(
            (watch.answered(a), link.answered(b)),
            (Some(true), Some(false))
        );
    }

    #[test]
    fn sleeping_consumer_is_rung_for_a_lane_message() {
        let link = pair(4096);
        assert!(!link.prepare_sleep(false));
        let (_, ring) = link.lane_send(&head(1), b"x").unwrap().unwrap();
        assert!(ring, "a sleeping consumer must be rung");
        assert!(
            link.prepare_sleep(false),
            "a lane message is waiting: do not sleep"
        );
    }

    #[test]
    fn corrupt_lane_is_an_error() {
        let link = pair(4096);
        link.lane_send(&head(1), b"x").unwrap().unwrap();
        link.tx
            .atomic64(OFF_LANE_HEAD)
            .store(1 << 40, Ordering::Relaxed);
        assert!(link.write(&[IoSlice::new(b"z")]).is_err(), "a bad count");
        let link = pair(4096);
        link.lane_send(&head(1), &payload(1, 500)).unwrap().unwrap();
        link.tx.slot_seq(3).store(77, Ordering::Relaxed);
        assert!(
            link.lane_peek(&mut [0u8; LANE_HEAD]).is_err(),
            "a missing slot"
        );
        let link = pair(4096);
        link.tx
            .slot_seq(1)
            .store(1 | 5000 << LEN_SHIFT, Ordering::Relaxed);
        assert!(
            link.lane_peek(&mut [0u8; LANE_HEAD]).is_err(),
            "an oversized message"
        );
    }

    #[test]
    fn cma_reads_our_own_memory() {
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        cma_read(std::process::id() as i32, src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(src, dst);
    }

    #[test]
    fn cma_writes_our_own_memory() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 3) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        cma_write(std::process::id() as i32, dst.as_mut_ptr() as u64, &src).unwrap();
        assert_eq!(src, dst);
    }

    #[test]
    fn foreign_segments_are_refused() {
        let name = format!("{PREFIX}{}-foreign", std::process::id());
        std::fs::write(format!("{SHM_DIR}/{name}"), vec![0u8; 8192]).unwrap();
        assert!(open(&name).is_err());
    }
}
