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
//! writes one *doorbell* byte to the socket. The side going to sleep fences between raising its
//! flag and its last look; on x86-64 the publishing side does not fence between publishing and
//! reading the flag (that fence cost every small message a cache-line transfer), so it may miss
//! a flag raised at that very instant: the sleeper looks once more a moment later, before it
//! sleeps (the engine's progress loop, `RECHECK`, which also bounds such a sleep soon after
//! traffic to 10 ms and logs a doorbell found missed at `DISTCOMM_DEBUG=DEBUG`).
//!
//! The producer also remembers the consumer's head from its last look and reads the shared one
//! only when the remembered free space is too small, so a small write does not wait for the
//! cache line the consumer last wrote.
//!
//! # The small-message lane
//! Beside each ring, a *lane* of [`LANE_SLOTS`] one-cache-line slots carries messages of up to
//! [`LANE_MAX`] bytes, one slot per message: the slot holds the message's header and, up to
//! [`FIRST`] bytes, its payload; a longer payload lies whole and contiguous (one copy in and
//! one out, no line split by a word) in the slot's own place in a *spread area* up to
//! [`SPREAD_MAX`] bytes, else in a *pool*, where the slot says: one after another, and from the
//! pool's start again whenever the consumer has taken every payload there, so that a ping-pong
//! goes through the same few lines (the constants say what was measured). The slot's word,
//! written last, publishes the message with its sequence number and length, so an 8-byte
//! message is one line and the receiver polls the very line it arrives in (a ring message
//! crosses as two lines, the tail and then the frame). Payloads live apart from the slots so
//! that no payload byte can ever be read as the word of a later message. A point-to-point
//! message is answered in an *answer word* (one line each, [`LANE_ACKS`] per direction)
//! instead of an Ack frame; a refusal sets the word's refused bit and also sends the usual Nack
//! frame, which says why. Order between lane and ring is kept by two rules: the producer writes
//! to the lane only when the consumer has read every ring byte, and to the ring only when the
//! consumer has taken every lane message; so at most one of them holds unread messages, and
//! the consumer takes the lane before the ring. The engine's blocking send and receive use the
//! lane without a handle or an allocation (`tcp::Engine::send_small`); a message for a posted
//! receive is copied from where its payload lies straight into the receive's buffer.
//!
//! # Pre-accepted messages
//! A blocking point-to-point receive that finds the lane empty *posts* what it accepts (key,
//! element type, capacity) in the slot its message will take: a key word the receiver alone
//! writes, and the slot's word, which then says "posted" instead of holding a message. The
//! sender, writing its message there, replaces the word in one compare-and-swap: when the post
//! accepts the message (same key, the type it expects, room for it), the new word also says
//! *pre-accepted*, and the sender is done, no answer to wait for; otherwise the message is
//! published as usual and answered. The receiver withdraws a post with a compare-and-swap of
//! its own (it stops spinning), and one that fails means a message it accepted took the slot:
//! that receive takes it, nobody else. So a refusal still fails both sides (a message its
//! receive would refuse is never pre-accepted), and a ping-pong's sender does not wait for the
//! line its answer comes in, which cost ~120 ns of an 8-byte half round trip with the vCPUs
//! apart. The sender reads the word in the line it writes anyway; the key word lives there
//! too, so the post costs no extra line transfer. One receive posts at a time (the post names
//! it); a message written after ring bytes is never pre-accepted (the receive may not know of
//! what came by the ring); a post also tells the sender that every earlier message was taken.
//! What is given up: a message pre-accepted by a receive that is then cancelled before it
//! takes it (its handle dropped by another thread, say) is kept like any unexpected message,
//! and a sender whose peer died with a post in place learns of the death at its next send.
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

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{compiler_fence, fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use memmap2::MmapRaw;

use crate::copy::copy_raw;
use crate::error::{Error, Result};
use crate::transport::frame::{LANE_ACKS, LANE_HEAD, LANE_MAX};
use crate::transport::{LaneKey, LaneMsg, LaneSent};
use crate::transport::{ShmConfig, TransportKind};

mod cma;
mod post;
mod segment;
mod setup;
#[cfg(test)]
mod tests;

pub(crate) use cma::{cma_read, cma_write};
use post::{posted_for, Post};
pub(crate) use segment::Region;
use segment::*;
pub(crate) use setup::setup;

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
/// The small-message lane (see the module documentation): the consumer's count of messages
/// taken, its answers (one word per outstanding answered message), the slots, the spread area
/// and the pool.
const OFF_LANE_HEAD: usize = 320;
const OFF_ACKS: usize = 512;
const OFF_SLOTS: usize = 2048;
/// Payloads longer than [`FIRST`] and up to [`SPREAD_MAX`] bytes lie in the *spread area*,
/// one place per slot, [`SPREAD_STRIDE`] bytes apart; longer ones in the *pool*.
const OFF_SPREAD: usize = 8192;
const OFF_POOL: usize = OFF_SPREAD + SPREAD_STRIDE * LANE_SLOTS as usize;
const OFF_DATA: usize = OFF_POOL + POOL;
/// Mid-size payloads go where their slot says, each message to fresh lines that neither side
/// touched for many messages; packed one after another instead (the next message's lines right
/// behind the last one's), a ping-pong is slower. Half round trip with the vCPUs near, one
/// binary, 5 alternating rounds: 128 B 0.21 µs at the slot's place, 0.23-0.24 packed within the
/// first 1-8 KiB; 256 B 0.23 against 0.24-0.25; 512 B 0.25 against 0.25-0.27, and 0.29 packed
/// throughout (places 512 bytes apart).
const SPREAD_MAX: usize = 512;
const SPREAD_STRIDE: usize = 1024;
/// The pool: longer payloads one after another, and from its start again whenever the
/// consumer has taken every payload in it. A ping-pong of 1 KiB so goes through the same 16
/// lines, which stay in both sides' first-level caches: 0.26 µs half round trip near and 0.64
/// apart, against 0.34 and 1.05 through a place per slot (64 KiB of lines); messages in flight
/// still have the whole pool.
const POOL: usize = 32 << 10;
/// Payloads in the pool start on cache lines.
const POOL_ALIGN: usize = 64;
/// Lane slots per direction.
const LANE_SLOTS: u64 = 64;
/// A slot (one cache line): its sequence word, then the message's header and, when it fits,
/// its payload, and last the key word of a posted receive (written by the consumer only). The
/// word, written last, is the message's sequence number with its length in the top bits, or
/// a posted receive (see [`POSTED`]).
const SLOT: usize = 64;
/// Payload bytes carried in the slot itself; a longer payload goes to the spread area or the
/// pool (then the slot carries its offset there instead).
const FIRST: usize = SLOT - 8 - LANE_HEAD - 8;
/// Offset of the key word in a slot.
const KEY_AT: usize = SLOT - 8;
/// The slot's word of a message: the low bits of its sequence number (compared as such: they
/// wrap after 2^48 messages), the message's length above them, and [`PRE_ACCEPTED`].
const LEN_SHIFT: u32 = 48;
const SEQ_MASK: u64 = (1 << LEN_SHIFT) - 1;
/// Length bits of a message's word (`LANE_MAX` fits), capacity bits of a posted one.
const LEN_MASK: u64 = (1 << 11) - 1;
/// A message's word: the posted receive it replaced accepts it; its sender does not wait for
/// an answer and gets none.
const PRE_ACCEPTED: u64 = 1 << 62;
/// The slot's word of a posted receive: this bit; the element type it expects (0 any) above
/// its capacity (at most `LANE_MAX`) in the length's place; a post count, so that a word
/// posted again after a withdrawal never equals the one a sender read before (16 bits); and
/// the low 32 bits of the sequence number of the message it waits for.
const POSTED: u64 = 1 << 63;
const DTYPE_SHIFT: u32 = 59;
const EPOCH_SHIFT: u32 = 32;
const POST_SEQ_MASK: u64 = (1 << EPOCH_SHIFT) - 1;
/// Answer word bit: the message was refused (a Nack frame on the ring says why).
const ACK_REFUSED: u64 = 1 << 63;
const MAGIC: u64 = 0x6469_7374_636f_6d36; // "distcom6"
/// Each answer word has a cache line of its own: the producer reads the word of an old message
/// (is it free?) while the consumer writes the newest one.
const ACK_STRIDE: usize = 64;
const _: () = assert!(OFF_ACKS + ACK_STRIDE * LANE_ACKS as usize <= OFF_SLOTS);
// The payload places start on pages, the ring's data too.
const _: () = assert!(OFF_SLOTS + SLOT * LANE_SLOTS as usize <= OFF_SPREAD);
const _: () = assert!(OFF_SPREAD % 4096 == 0 && OFF_POOL % 4096 == 0 && OFF_DATA % 4096 == 0);
const _: () = assert!(SPREAD_MAX <= SPREAD_STRIDE && LANE_MAX <= POOL && FIRST >= 4);
const _: () = assert!(LANE_MAX as u64 <= LEN_MASK && KEY_AT == 8 + LANE_HEAD + FIRST);

/// The slot of lane message `seq` (from 1).
const fn slot_index(seq: u64) -> usize {
    (seq.wrapping_sub(1) % LANE_SLOTS) as usize
}

/// Whether slot word `w` publishes message `seq` (and not a receive posted for it).
const fn publishes(w: u64, seq: u64) -> bool {
    w & POSTED == 0 && w & SEQ_MASK == seq & SEQ_MASK
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
            copy_raw(self.data().add(at), src.as_ptr(), first);
            copy_raw(self.data(), src[first..].as_ptr(), src.len() - first);
        }
    }

    /// The sequence word of lane slot `seq` (from 1).
    fn slot_seq(&self, seq: u64) -> &AtomicU64 {
        self.atomic64(Self::slot_off(seq))
    }

    fn slot_off(seq: u64) -> usize {
        OFF_SLOTS + slot_index(seq) * SLOT
    }

    /// The body of lane slot `seq`.
    fn slot_body(&self, seq: u64) -> *mut u8 {
        // SAFETY: the slot lies inside the header area of the mapping (const assertions).
        unsafe { self.map.as_mut_ptr().add(Self::slot_off(seq) + 8) }
    }

    /// Where the payload of lane message `seq` (`len` bytes) lies, and how many of its bytes
    /// may be read or written there: after the header in its slot, in its slot's place in the
    /// spread area, or in the pool where the slot's offset word says (cut at the pool's end).
    fn lane_payload(&self, seq: u64, len: usize) -> (*mut u8, usize) {
        if len <= FIRST {
            // SAFETY: LANE_HEAD + FIRST is the slot body's length.
            return (unsafe { self.slot_body(seq).add(LANE_HEAD) }, len);
        }
        if len <= SPREAD_MAX {
            // SAFETY: the slot's place lies inside the spread area (`slot_index < LANE_SLOTS`),
            // inside the mapping (at least OFF_DATA bytes long, checked when mapped).
            let p = unsafe {
                self.map
                    .as_mut_ptr()
                    .add(OFF_SPREAD + slot_index(seq) * SPREAD_STRIDE)
            };
            return (p, len);
        }
        let (p, room) = self.pool_at(self.slot_offset(seq).load(Ordering::Relaxed) as usize);
        (p, len.min(room))
    }

    /// Offset `at` of the pool, and the bytes from there to its end (`at` cut at the end).
    fn pool_at(&self, at: usize) -> (*mut u8, usize) {
        let at = at.min(POOL);
        // SAFETY: `at <= POOL`: the pointer lies inside the pool or just past it, inside the
        // mapping (at least OFF_DATA bytes long, checked when mapped).
        (
            unsafe { self.map.as_mut_ptr().add(OFF_POOL + at) },
            POOL - at,
        )
    }

    /// The offset word of a lane message whose payload lies in the pool, in the slot where a
    /// short payload would be.
    fn slot_offset(&self, seq: u64) -> &AtomicU32 {
        self.atomic32(Self::slot_off(seq) + 8 + LANE_HEAD)
    }

    /// The answer word of lane message `seq`.
    fn ack_word(&self, seq: u64) -> &AtomicU64 {
        self.atomic64(OFF_ACKS + ((seq % LANE_ACKS) as usize) * ACK_STRIDE)
    }

    /// The answer to lane message `seq` (of this ring's producer): `Some(true)` accepted,
    /// `Some(false)` refused, `None` not yet. A word that holds a later message's answer says
    /// "accepted": the producer gives a waited message's word to a later one only once its
    /// answer said so, and messages nobody waits for are never answered (so a watcher that
    /// looks late still reads the answer, for good).
    fn answer_of(&self, seq: u64) -> Option<bool> {
        let w = self.ack_word(seq).load(Ordering::Acquire);
        let of = w & !ACK_REFUSED;
        if of == seq {
            Some(w & ACK_REFUSED == 0)
        } else {
            (of > seq).then_some(true)
        }
    }

    /// Whether the ring holds bytes its consumer has not read (the head is the consumer's own
    /// word: a cache hit on its side while nothing moves).
    fn unread(&self) -> bool {
        let head = self.atomic64(OFF_HEAD).load(Ordering::Relaxed);
        self.atomic64(OFF_TAIL).load(Ordering::Acquire) != head
    }

    /// Whether the lane holds a message after the `taken` ones the consumer took.
    fn lane_ready(&self, taken: u64) -> bool {
        publishes(self.slot_seq(taken + 1).load(Ordering::Acquire), taken + 1)
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
            copy_raw(dst.as_mut_ptr(), self.data().add(at), first);
            copy_raw(dst[first..].as_mut_ptr(), self.data(), rest);
        }
    }
}

/// What the producer knows of its pool (apart from the link's other fields: only payloads
/// longer than [`SPREAD_MAX`] need it).
struct Pool {
    /// Where the next payload goes.
    next: Cell<usize>,
    /// The messages with payloads there not known to be taken (sequence number, offset),
    /// oldest first.
    used: RefCell<VecDeque<(u64, usize)>>,
}

/// Both directions of a shared-memory link, plus what a transfer needs about the peer.
pub(crate) struct ShmLink {
    tx: Arc<Ring>,
    rx: Arc<Ring>,
    /// The consumer's head of `tx` as last read (it only ever grows): free space known without
    /// touching the consumer's cache line.
    tx_head: Cell<u64>,
    /// Lane messages written to `tx`, and the consumer's count of those taken as last read
    /// (or known from their answers).
    tx_lane: Cell<u64>,
    tx_lane_head: Cell<u64>,
    /// `tx`'s pool.
    pool: Box<Pool>,
    /// Whether we wrote to `tx`'s ring since our last lane message: the next one is then not
    /// pre-accepted (the receive posted for it may not know what came by the ring).
    tx_ring_since_lane: Cell<bool>,
    /// Lane messages taken from `rx`.
    rx_lane: Cell<u64>,
    /// The receive we posted in `rx`'s lane, if any, and how many we posted.
    rx_post: Cell<Option<Post>>,
    rx_posts: Cell<u16>,
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
            pool: Box::new(Pool {
                next: Cell::new(0),
                used: RefCell::new(VecDeque::with_capacity(LANE_SLOTS as usize)),
            }),
            tx_ring_since_lane: Cell::new(false),
            rx_lane: Cell::new(0),
            rx_post: Cell::new(None),
            rx_posts: Cell::new(0),
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
            // The answers may have told more than the count says yet.
            self.tx_lane_head.set(head.max(self.tx_lane_head.get()));
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

    /// Where a payload of `len` (> [`SPREAD_MAX`]) bytes can go in the pool now: at its start
    /// when every pool payload was taken (as the count or the last answer says), else after
    /// the last one (or at the start, when it does not fit before the end) if that does not
    /// reach the oldest untaken one. Reads the consumer's count again once before saying there
    /// is no room.
    fn pool_room(&self, len: usize) -> io::Result<Option<usize>> {
        let need = len.next_multiple_of(POOL_ALIGN);
        // The last message's answer, when it has one (a waiting sender read it already), tells
        // that everything was taken: an answer, whatever it says, is written once its message
        // was taken.
        let last = self.tx_lane.get();
        if last > self.tx_lane_head.get() && self.tx.answer_of(last).is_some() {
            self.tx_lane_head.set(last);
        }
        let next = self.pool.next.get();
        for reload in [false, true] {
            self.lane_filled(reload)?;
            let taken = self.tx_lane_head.get();
            let mut used = self.pool.used.borrow_mut();
            while used.front().is_some_and(|&(seq, _)| seq <= taken) {
                used.pop_front();
            }
            let Some(&(_, from)) = used.front() else {
                return Ok(Some(0));
            };
            // The untaken payloads lie from `from` to `next`, or, wrapped, from `from` to the
            // end and from the start to `next`.
            let at = if next > from {
                if next + need <= POOL {
                    Some(next)
                } else {
                    (need <= from).then_some(0)
                }
            } else {
                (next + need <= from).then_some(next)
            };
            if at.is_some() {
                return Ok(at);
            }
        }
        Ok(None)
    }

    /// The sequence number the next lane message will get.
    pub fn next_lane_seq(&self) -> u64 {
        self.tx_lane.get() + 1
    }

    /// Writes a small message (`head`, then at most [`LANE_MAX`] bytes of `payload`) to the
    /// lane, if nothing written to the ring is still unread and a slot is free (and room in
    /// the pool, for a payload longer than [`SPREAD_MAX`]). A point-to-point message gives its
    /// key (`offer`): a receive posted in its slot that accepts it takes it at once (see the
    /// module documentation). `None` when the lane cannot take it.
    pub fn lane_send(
        &self,
        head: &[u8; LANE_HEAD],
        payload: &[u8],
        offer: Option<LaneKey>,
    ) -> io::Result<Option<LaneSent>> {
        let len = payload.len();
        let seq = self.tx_lane.get() + 1;
        let r = &self.tx;
        let slot = r.slot_seq(seq);
        // A receive posted for this message says that the consumer took every earlier one (so
        // a ping-pong's payloads keep to the pool's first lines without an answer).
        let mut now = 0;
        if offer.is_some() {
            now = slot.load(Ordering::Acquire);
            if posted_for(now, seq) {
                self.tx_lane_head.set(self.tx_lane_head.get().max(seq - 1));
            }
        }
        if len > LANE_MAX
            || !self.ring_drained()?
            || (self.lane_filled(false)? >= LANE_SLOTS && self.lane_filled(true)? >= LANE_SLOTS)
        {
            return Ok(None);
        }
        let dst = if len > SPREAD_MAX {
            let Some(at) = self.pool_room(len)? else {
                return Ok(None);
            };
            // `at < POOL < 2^32`.
            r.slot_offset(seq).store(at as u32, Ordering::Relaxed);
            self.pool.next.set(at + len.next_multiple_of(POOL_ALIGN));
            self.pool.used.borrow_mut().push_back((seq, at));
            r.pool_at(at).0
        } else {
            r.lane_payload(seq, len).0
        };
        // SAFETY: the slot's body has LANE_HEAD bytes for the header, and the payload's place
        // room for `len` bytes (`lane_payload`; `pool_room` found as much in the pool), both
        // inside the mapping; the consumer took the slot's previous message and the payloads
        // that lay where this one goes (room was checked) and reads them again only after the
        // word below says message `seq` is there.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), r.slot_body(seq), LANE_HEAD);
            copy_raw(dst, payload.as_ptr(), len);
        }
        let word = seq & SEQ_MASK | (len as u64) << LEN_SHIFT;
        // After ring bytes, the receive posted here may not know of all that came before.
        let may = !self.tx_ring_since_lane.replace(false);
        let pre = match offer {
            None => {
                // A receive posted here is replaced all the same: its receiver, withdrawing,
                // finds the message.
                slot.store(word, Ordering::Release);
                false
            }
            Some(k) => loop {
                let pre = may && r.accepts(now, seq, k, len);
                let new = word | if pre { PRE_ACCEPTED } else { 0 };
                match slot.compare_exchange_weak(now, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break pre,
                    Err(w) => now = w,
                }
            },
        };
        self.tx_lane.set(seq);
        Ok(Some(LaneSent {
            seq,
            ring: self.consumer_asleep(),
            pre,
        }))
    }

    /// After publishing to the peer (ring bytes, a lane message, an answer): whether it sleeps
    /// and must be rung (once per sleep).
    fn consumer_asleep(&self) -> bool {
        publish_then_look();
        lower(self.tx.atomic32(OFF_CONSUMER_SLEEPING))
    }

    /// After taking from the inbound ring or lane: whether the producer waits for room and
    /// must be rung (once per wait).
    fn producer_waiting(&self) -> bool {
        publish_then_look();
        lower(self.rx.atomic32(OFF_PRODUCER_WAITING))
    }

    /// The next lane message, if one is there: its header is copied into `head`; nothing is
    /// taken until [`lane_release`](Self::lane_release). A length above [`LANE_MAX`] is an error
    /// (the peer wrote garbage).
    pub fn lane_peek(&self, head: &mut [u8; LANE_HEAD]) -> io::Result<Option<LaneMsg>> {
        let r = &self.rx;
        let seq = self.rx_lane.get() + 1;
        let word = r.slot_seq(seq).load(Ordering::Acquire);
        if !publishes(word, seq) {
            return Ok(None);
        }
        if word & !(SEQ_MASK | LEN_MASK << LEN_SHIFT | PRE_ACCEPTED) != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("shared-memory lane word {word:#x}: the peer's shared memory is corrupt"),
            ));
        }
        let len = ((word >> LEN_SHIFT) & LEN_MASK) as usize;
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        if len > LANE_MAX {
            return Err(bad(format!("shared-memory lane message of {len} bytes")));
        }
        if len > SPREAD_MAX {
            let at = r.slot_offset(seq).load(Ordering::Relaxed) as usize;
            if at % POOL_ALIGN != 0 || at + len > POOL {
                return Err(misplaced(len, at));
            }
        }
        // SAFETY: the slot's body has LANE_HEAD bytes; the producer wrote them before
        // publishing `seq` (acquired above) and keeps off until we release the message.
        unsafe { std::ptr::copy_nonoverlapping(r.slot_body(seq), head.as_mut_ptr(), LANE_HEAD) };
        Ok(Some(LaneMsg {
            seq,
            len: len as u32,
            pre: word & PRE_ACCEPTED != 0,
        }))
    }

    /// Copies the payload of message `m` (from [`lane_peek`](Self::lane_peek), not yet
    /// released) into `dst` (up to its length).
    pub fn lane_copy(&self, m: LaneMsg, dst: &mut [u8]) {
        // `lane_peek` bounds the message already; bounded again (`lane_payload` cuts it at
        // the end of the area) so that no `LaneMsg` can make this copy leave its place.
        let (src, room) = self.rx.lane_payload(m.seq, m.len as usize);
        let len = (m.len as usize).min(dst.len()).min(room);
        // SAFETY: the payload's place has room for `len` bytes, which the producer wrote
        // before publishing `m` (checked by `lane_peek`) and leaves untouched until we release
        // it; `dst` has `len` bytes.
        unsafe { copy_raw(dst.as_mut_ptr(), src, len) };
    }

    /// Releases the slot of message `m`, first writing its answer (`Some(refused)`) when it
    /// has one already. Returns whether the peer sleeps (or waits for room) and needs a
    /// doorbell.
    pub fn lane_release(&self, m: LaneMsg, answer: Option<bool>) -> bool {
        if let Some(refused) = answer {
            self.answer_word(m.seq, refused);
        }
        if self.rx_post.get().is_some_and(|p| p.seq == m.seq) {
            self.rx_post.set(None);
        }
        self.rx_lane.set(m.seq);
        self.rx
            .atomic64(OFF_LANE_HEAD)
            .store(m.seq, Ordering::Release);
        publish_then_look();
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
        self.tx_ring_since_lane.set(true);
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

/// The error of a lane payload the peer placed out of bounds.
#[cold]
fn misplaced(len: usize, at: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "shared-memory lane payload of {len} bytes said to lie at offset {at}, off a cache \
             line or past the {POOL}-byte pool: the peer's shared memory is corrupt"
        ),
    )
}

/// Between publishing to the peer and reading its sleep flag. On x86-64 no fence (see the
/// module doc): a flag raised as we publish may be missed, and the sleeper looks once more
/// before it sleeps; the compiler keeps the order as written. Elsewhere a full fence, as the
/// measurements behind that choice were taken on x86-64 only.
#[inline(always)]
fn publish_then_look() {
    #[cfg(target_arch = "x86_64")]
    compiler_fence(Ordering::SeqCst);
    #[cfg(not(target_arch = "x86_64"))]
    fence(Ordering::SeqCst);
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
