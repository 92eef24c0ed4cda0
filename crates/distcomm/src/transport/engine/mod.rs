//! The progress engine: a full mesh of connections, each a TCP socket or a shared-memory link
//! (`shm`: rings in shared memory, with the socket kept for doorbells and peer death), all
//! carrying the same frames and driven by one engine. The decisions (matching, which protocol,
//! refusals, reassembly, cancelled keys) are the sans-I/O core's (`transport::protocol`); this
//! module owns the state behind the lock (queues, pending sends, per-peer I/O state) and its
//! submodules carry the decisions out: `recv` (headers and posts), `wire` (reading and writing
//! frames), `lane`, `fetch` (cross-memory copies), `cancel`, `failure` (peer loss, abort,
//! reclaim), `ops` (the `Engine` API) and `progress` (threads, spinning, `poll(2)`).
//!
//! It must not know what the layers above use contexts, tags or check words for.
//!
//! # Protocol
//! Messages up to `eager_max` bytes travel inline (`Eager`); the receiver answers `Ack` once a
//! posted receive matched and took the data, or `Nack` when it refused it (too large, wrong
//! element type), so **both** sides learn about a refusal. Larger messages use a receiver-ready
//! handshake: `Rts` announces the size, the receiver answers `Cts` once a matching receive is
//! posted, and only then does the sender stream `Data` straight into the receive buffer. Memory
//! stays bounded whatever the posting order: an unmatched large message costs its 48-byte header,
//! an unmatched small one at most `eager_max` bytes.
//!
//! Towards a shared-memory peer a large message announces its buffer's address instead (`Rget`)
//! and the receiver copies it across processes (`process_vm_readv`) and answers Ack; from
//! `choice::SPLIT_MIN` bytes on it first asks the sender to write the head itself (`Rput`, answered by
//! `Put`) while it reads the tail, so both processes copy at once. A buffer whose address went
//! to a peer outlives everything here (abort, shutdown) until that peer answers or dies. Where
//! the kernel refuses, the receiver answers Cts and the message streams as above.
//!
//! Towards a shared-memory peer, messages of up to `LANE_MAX` bytes take its *lane* instead
//! when the ordering rules allow (see `shm`): slots polled on the line the message arrives in,
//! answered in an answer word rather than an Ack frame (a refusal also sends the Nack frame).
//! Blocking sends and receives use it without a handle (`Engine::send_small`,
//! `Engine::recv_small`).
//!
//! # Progress
//! All state lives behind one mutex. Three kinds of threads drive it:
//! * the caller posting an operation writes what it can at once;
//! * a waiter ([`crate::Work::wait`]) spins for a short budget, driving the sockets itself
//!   (a blocking wake-up costs ~100 µs on small VMs, a spin a few µs) and then sleeps;
//! * a background progress thread sleeps in `poll(2)` and moves everything else, so posted
//!   operations progress with nobody waiting on them.
//!
//! While a waiter spins, the progress thread leaves the sockets to it (two threads fighting
//! over the lock only cost time). When ranks outnumber cores the spin budget is zero.
//!
//! We use `poll(2)` through `libc` rather than mio: several threads drive the same sockets, and
//! level-triggered readiness is what makes that safe (with mio's edge-triggered events a waiter
//! that drained part of a socket would leave the progress thread asleep on unread data).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::call::Envelope;
use crate::completion::{block, BoxBuf, Deadline, Driver, OpCell, Status};
use crate::copy::copy_bytes;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transport::frame::{
    Fingerprint, Header, Kind, NackReason, EAGER_NO_ACK, HEADER_LEN, LANE, LANE_ACKS, LANE_HEAD,
    RGET_PAYLOAD,
};
use crate::transport::link::{Fill, Link};
use crate::transport::protocol::cancel::{CancelError, CancelNote, Cancelled, CancelledOp};
use crate::transport::protocol::choice::{self, Limits, Wire};
use crate::transport::protocol::matching::{self, Key, Matcher};
use crate::transport::protocol::reassembly::{Chunk, Reassembly};
use crate::transport::protocol::refusal::{self, Expect, Sent};
#[cfg(target_os = "linux")]
use crate::transport::shm;
use crate::transport::tcp::{same_host, set_buffers, LOCAL_SOCKBUF};
use crate::transport::{LaneMsg, LinkKind, ShmLink, ShmWatch};

mod cancel;
mod failure;
mod fetch;
mod lane;
mod ops;
mod progress;
mod recv;
mod wire;

use wire::data_chunk;

impl Envelope {
    /// The Eager header of message `msg_id` of `len` bytes.
    fn eager(&self, msg_id: u64, len: usize) -> Header {
        Header {
            kind: Kind::Eager,
            dtype: self.dtype,
            ctx: self.ctx,
            tag: self.tag,
            aux: 0,
            msg_id,
            len: len as u64,
            fp: self.fp,
        }
    }

    /// What a receive of `cap` bytes with this envelope expects.
    fn expect(&self, cap: u64) -> Expect {
        Expect {
            op: self.op,
            dtype: self.dtype,
            check: self.fp,
            cap,
        }
    }

    /// The pending send of `len` bytes to `dst` that completes `cell`.
    fn pending(&self, dst: usize, len: usize, cell: Arc<OpCell>) -> PendingSend {
        PendingSend {
            op: self.op,
            dtype: self.dtype,
            fp: self.fp,
            dst,
            ctx: self.ctx,
            tag: self.tag,
            len,
            cell,
            buf: None,
            lent: false,
        }
    }
}

/// Tuning of the engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Largest message sent inline without a receiver-ready handshake.
    pub eager_max: usize,
    /// The same towards shared-memory peers with cross-memory attach: larger messages are
    /// copied straight between the processes. Measured (ping-pong, 2 ranks): up to 16 KiB the
    /// ring wins (12 KiB 2.9 vs 3.6–4.2 µs), from 24–32 KiB the direct copy (32 KiB 4.8 vs
    /// 6.1 µs, 64 KiB 6.5–7.1 vs 10.4 µs).
    pub shm_eager_max: usize,
    /// How long a waiter spins (driving progress) before it sleeps.
    pub spin: Duration,
    /// Yield the core between spins (ranks outnumber cores: let the others run).
    pub yield_spin: bool,
    /// Socket send and receive buffer size in bytes; 0 leaves the kernel's autotuning on.
    /// `None`: [`LOCAL_SOCKBUF`] towards peers on this host, autotuning towards others.
    pub sockbuf: Option<usize>,
    /// The Data chunk size for large messages. `None`: [`DATA_CHUNK`] towards other hosts,
    /// whole messages ([`LOCAL_DATA_CHUNK`]) on this one.
    pub data_chunk: Option<usize>,
    /// The error of an operation whose key (context, tag) was cancelled, from the note of
    /// whoever cancelled it: the cancelling layer's, which alone knows what the note means.
    pub cancel_error: CancelError,
}

/// Towards a peer on another host, large messages travel in Data frames of at most this many
/// bytes, so that a reply (a clear-to-send, an acknowledgement) queued behind one waits for one
/// chunk rather than the whole message. Without it, two ranks exchanging large messages took
/// turns instead of using both directions of the link at once: 64 MiB all_to_all over a
/// 1 Gbit/s link between two network namespaces took 0.57 s, with it 0.36 s (line rate: 0.27).
pub const DATA_CHUNK: usize = 1 << 20;
/// Towards a peer on this host a message goes whole: a reply waits microseconds behind it
/// anyway, and chunks cost bandwidth there (each header read also buffers, so copies once more,
/// whatever follows it in the socket): 16 MiB chunks cost ~8% of loopback all_reduce busbw at
/// 64 MiB, 256 KiB ones 10–20%.
pub const LOCAL_DATA_CHUNK: usize = usize::MAX;

const RXBUF: usize = 256 * 1024;
/// Where in its page a peer's receive buffer starts (see [`rx_base`]).
const RX_PAGE_OFFSET: usize = 2048;
const PAGE: usize = 4096;
const READ_BUDGET: usize = 8 << 20;
const MAX_IOV: usize = 64;
/// Spin budget of a waiter whose large transfer is under way.
const ACTIVE_SPIN: Duration = Duration::from_millis(50);
/// `Shared::spinning` holds two counters: waiters spinning now (low 32 bits) and spins ended so
/// far (high 32 bits, wrapping), so that ending a spin is one atomic step and reads no clock.
const SPINNER: u64 = 1;
const SPINNERS: u64 = 0xffff_ffff;
const SPIN_ENDED: u64 = 1 << 32;
/// A blocking send or receive on the shared-memory lane watches its answer or message this
/// long before it hands over to the engine (and its general wait).
const FAST_SPIN: Duration = Duration::from_micros(20);
/// After a waiter stops spinning, the progress thread keeps off the sockets this long.
const SPIN_GRACE: Duration = Duration::from_millis(2);

struct Posted {
    id: u64,
    op: &'static str,
    src: Option<usize>,
    ctx: u32,
    tag: u32,
    dtype: DType,
    fp: Fingerprint,
    buf: BoxBuf,
    cell: Arc<OpCell>,
}

impl matching::Receive for Posted {
    #[inline]
    fn source(&self) -> Option<usize> {
        self.src
    }
    #[inline]
    fn key(&self) -> Key {
        (self.ctx, self.tag)
    }
}

impl matching::Message for Unexpected {
    #[inline]
    fn source(&self) -> usize {
        self.src
    }
    #[inline]
    fn key(&self) -> Key {
        (self.hdr.ctx, self.hdr.tag)
    }
}

impl Posted {
    fn refusal(&self, reason: NackReason) -> Refusal {
        Refusal {
            reason,
            cap: self.buf.bytes().len() as u64,
            dtype: self.dtype,
            fp: self.fp,
        }
    }
}

/// Why and by what a receiver refuses a message: what its Nack tells the sender.
struct Refusal {
    reason: NackReason,
    /// The receive's capacity in bytes.
    cap: u64,
    dtype: DType,
    fp: Fingerprint,
}

/// A lane message (point-to-point) whose sender waits for the receiver's answer word.
enum LaneWait {
    /// A send in `State::sends`, completed by the engine when the answer comes.
    Op { seq: u64, id: u64 },
    /// A blocking send whose caller watches the answer word itself; a refusal the engine reads
    /// first (the Nack frame) is kept for it. Once accepted the entry is free for reuse.
    Caller { seq: u64, nack: Option<Header> },
}

/// Who waits for the answer to a lane message.
#[derive(Clone, Copy)]
enum Owner {
    /// Nobody (scheduled messages: complete once written).
    Nobody,
    /// Send `id` in `State::sends`.
    Op(u64),
    /// The calling thread ([`LaneWait::Caller`]).
    Caller,
}

/// The outcome of an operation offered to the fast path.
pub(crate) enum Fast {
    /// Finished (successfully or not) on the fast path.
    Done(Result<Status>),
    /// Handed over to the engine: wait for it like any operation.
    Handed(u64, Arc<OpCell>),
    /// The fast path did not apply; nothing happened.
    Declined,
}

/// What a receive offered to the lane found.
enum LaneRecv {
    Got(Result<Status>),
    /// Nothing for it yet.
    Empty,
    /// It must take the general path.
    Declined,
}

struct Unexpected {
    src: usize,
    hdr: Header,
    /// The inline payload of an Eager message (for an Rget: the sender's buffer address);
    /// `None` for an Rts.
    data: Option<Vec<u8>>,
}

struct PendingSend {
    op: &'static str,
    dtype: DType,
    fp: Fingerprint,
    dst: usize,
    ctx: u32,
    tag: u32,
    len: usize,
    cell: Arc<OpCell>,
    /// The buffer while it is not queued for writing.
    buf: Option<BoxBuf>,
    /// Its address went to the receiver (Rget), which may be copying from it: the buffer must
    /// outlive the receiver's answer (or death), even if the operation fails here first.
    lent: bool,
}

impl PendingSend {
    /// Whether an eager send of it waits for the receiver's Ack: unscheduled sends do;
    /// scheduled ones (a check word: see `refusal`) are done once written ([`EAGER_NO_ACK`]).
    fn waits_for_ack(&self) -> bool {
        !refusal::scheduled(self.fp)
    }

    /// What it was, for the error of a refusal.
    fn sent(&self) -> Sent {
        Sent {
            op: self.op,
            dtype: self.dtype,
            check: self.fp,
            tag: self.tag,
            len: self.len,
        }
    }

    fn status(&self, peer: usize) -> Status {
        Status {
            peer,
            tag: self.tag,
            bytes: self.len,
        }
    }
}

struct Out {
    hdr: [u8; HEADER_LEN],
    kind: Kind,
    payload: Option<BoxBuf>,
    /// This frame carries `payload[base..base + plen]` (a Data frame is one chunk of its
    /// message; every other frame carries its payload whole, from 0).
    base: usize,
    plen: usize,
    send_id: Option<u64>,
}

enum Target {
    Recv(Posted),
    Temp(Vec<u8>),
    Discard,
}

enum Rx {
    Header,
    Payload {
        hdr: Header,
        target: Target,
        got: usize,
        /// For a chunk of Data: where it starts in the message, and the message's length.
        chunk: Option<(usize, u64)>,
    },
}

struct Peer {
    link: Link,
    out: VecDeque<Out>,
    out_off: usize,
    rx: Rx,
    /// Received bytes not yet handled are `rxbuf[rx_start..rx_end]`; reading starts again at
    /// `rx_base` (see [`rx_base`]) once it is empty.
    rxbuf: Box<[u8]>,
    rx_base: usize,
    /// How fast the kernel copies this socket's data out (see [`CopyRate`]).
    copy: CopyRate,
    rx_start: usize,
    rx_end: usize,
    dead: Option<String>,
    /// [`DATA_CHUNK`] or [`LOCAL_DATA_CHUNK`].
    chunk: usize,
    /// Shared-memory peers: our lane messages waiting for an answer, by sequence number modulo
    /// [`LANE_ACKS`] (empty for TCP peers), and how many of them are [`LaneWait::Op`].
    lane_waits: Vec<Option<LaneWait>>,
    lane_ops: usize,
}

/// A peer's receive buffer: [`RXBUF`] bytes from [`rx_base`].
fn rx_buffer() -> (Box<[u8]>, usize) {
    let buf = vec![0u8; RXBUF + PAGE].into_boxed_slice();
    let base = rx_base(buf.as_ptr() as usize);
    (buf, base)
}

/// The index in a buffer at address `addr` where reading from a socket starts: half a page
/// past a page boundary. The kernel copies socket data out with `rep movsb`, which on AMD Zen 3
/// runs at a fraction of its speed when the destination lies a few bytes past the source modulo
/// 4 KiB (see `shm::cma`), and over loopback the data of a message whose sender had nothing
/// else in flight starts at the beginning of a page. The allocator hands out a buffer this size
/// 16 bytes past a page boundary. Ping-pong over TCP, 64 KiB / 128 KiB / 256 KiB / 1 MiB:
/// reading from 16 bytes past a page, 42 / 62 / 53 / 158 µs; 64 past, 20 / 61 / 71 / 176;
/// 128, 512, 2048 or 4064 past, 20 / 40-41 / 53-54 / 158-160.
fn rx_base(addr: usize) -> usize {
    (RX_PAGE_OFFSET + PAGE - addr % PAGE) % PAGE
}

impl Peer {
    /// Reads into the receive buffer: from a socket as much as fits (one system call for many
    /// frames), from a shared-memory ring only the `want` bytes needed now (the rest is best
    /// copied straight to its destination).
    fn fill(&mut self, want: usize) -> std::result::Result<Fill, String> {
        if self.rx_start == self.rx_end {
            self.rx_start = self.rx_base;
            self.rx_end = self.rx_base;
        } else if self.rx_start > self.rx_base && self.rxbuf.len() - self.rx_end < HEADER_LEN {
            self.rxbuf
                .copy_within(self.rx_start..self.rx_end, self.rx_base);
            self.rx_end -= self.rx_start - self.rx_base;
            self.rx_start = self.rx_base;
        }
        let end = if self.link.shm.is_some() {
            (self.rx_end + want).min(self.rxbuf.len())
        } else {
            self.rxbuf.len()
        };
        let timed = self.link.shm.is_none() && want >= COPY_PROBE;
        let t = timed.then(Instant::now);
        let r = self.link.read(&mut self.rxbuf[self.rx_end..end])?;
        if let Fill::Got(n) = r {
            self.rx_end += n;
            if let Some(t) = t {
                self.copy.staged(n, t.elapsed());
            }
        }
        Ok(r)
    }

    /// Reads straight into `dst`, part of a payload's destination. From a socket the copy is
    /// timed, and one at under a third of the speed of reads into the receive buffer sends the
    /// rest of the payload through the buffer (see [`CopyRate`]).
    fn read_direct(&mut self, dst: &mut [u8]) -> std::result::Result<Fill, String> {
        if self.link.shm.is_some() {
            return self.link.read(dst);
        }
        let t = Instant::now();
        let r = self.link.read(dst)?;
        if let Fill::Got(n) = r {
            if self.copy.slow(n, t.elapsed()) {
                self.copy.bounce = true;
            }
        }
        Ok(r)
    }
}

/// Reads of at least this many bytes time the kernel's copy.
const COPY_PROBE: usize = 32 << 10;
/// Payloads up to this size go through the receive buffer once a direct read was slow; larger
/// ones land in memory, not cache, where a direct copy is slower than the buffer's anyway
/// (and a second copy costs more): a 64 MiB broadcast over TCP took 1.11-1.36x the time when
/// they could.
const BOUNCE_MAX: usize = 4 << 20;

/// How fast the kernel copies a socket's data out, learned as reads go. A large payload is read
/// straight into its destination (no second copy), but the kernel's `rep movsb` runs at a
/// fraction of its speed when the destination lies a few bytes past the source's page offset
/// (see [`rx_base`]), and where the kernel's pages start depends on how the sender's writes
/// fell, so no placement of the destination is safe. The receive buffer's own copies give the
/// speed to expect; a direct read at under a third of it sends the rest of that payload, up to
/// [`BOUNCE_MAX`], through the buffer (the user-space copy on from there costs little).
/// Measured over TCP, a torch tensor of 1 MiB ping-ponged by `dist.send`/`recv`: 182-522 µs by
/// where it lay in its page when always read straight into it, 177-199 when read this way;
/// always through the buffer, large ones at a good place lost 5-15 % (4-64 MiB).
#[derive(Default)]
struct CopyRate {
    /// Bytes per nanosecond of reads into the receive buffer (moving average; 0: none yet).
    staged: f64,
    /// The payload being read goes through the receive buffer from now on.
    bounce: bool,
}

impl CopyRate {
    fn rate(n: usize, took: Duration) -> Option<f64> {
        let ns = took.as_nanos();
        (n >= COPY_PROBE && ns > 0).then(|| n as f64 / ns as f64)
    }

    /// Notes a read of `n` bytes into the receive buffer that took `took`.
    fn staged(&mut self, n: usize, took: Duration) {
        if let Some(r) = Self::rate(n, took) {
            self.staged = if self.staged == 0.0 {
                r
            } else {
                0.75 * self.staged + 0.25 * r
            };
        }
    }

    /// Whether a direct read of `n` bytes that took `took` was slow against the buffer's: under a
    /// third of its speed. Measured (GB/s): reads into the buffer 6-14; direct reads 5-16 where
    /// the pages lie well (less in memory than in cache), 1-2 where they do not.
    fn slow(&self, n: usize, took: Duration) -> bool {
        Self::rate(n, took).is_some_and(|r| self.staged > 0.0 && r < self.staged / 3.0)
    }
}

/// A large receive whose buffer address went to a shared-memory peer (Rput): the peer writes
/// into it until it answers Put, so the buffer must outlive that answer whatever happens here
/// (abort, shutdown): only the peer's Put or death releases it.
struct Lent {
    r: Posted,
    h: Header,
    /// The sender's buffer address (from its Rget).
    addr: u64,
    /// Bytes the sender writes (the head); we copied the tail.
    split: usize,
    /// Whether our copy of the tail failed (then the message is streamed after the Put).
    own_failed: bool,
}

struct State {
    rank: usize,
    /// Eager limits (towards any peer, towards shared-memory peers with direct copies).
    limits: Limits,
    peers: Vec<Option<Peer>>,
    /// Posted receives and unexpected messages.
    matcher: Matcher<Posted, Unexpected>,
    sends: HashMap<u64, PendingSend, BuildHasherDefault<IdHash>>,
    /// Receives cleared to send, waiting for their message's Data chunks.
    rdv: Reassembly<Posted>,
    /// Receives whose buffer a peer is writing into, by (source, msg_id).
    lent: HashMap<(usize, u64), Lent>,
    next_id: u64,
    closed: Option<String>,
    /// Keys (ctx, tag) cancelled (by a peer or here): who cancelled and their call, so every
    /// later operation of it fails with an error that describes its own call.
    cancelled: Cancelled<CancelNote>,
    /// The error of an operation of a cancelled key (the configuration's hook).
    cancel_error: CancelError,
}

/// Hasher of our own message ids (sequential integers, never chosen by a peer): one
/// multiplication spreads them over the table, where SipHash's resistance to chosen keys would
/// only cost time on every send.
#[derive(Default)]
struct IdHash(u64);

impl Hasher for IdHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A control frame's header (replies carry no context or tag: `msg_id` names the message).
fn control(kind: Kind, msg_id: u64, aux: u32, len: u64, dtype: DType, fp: Fingerprint) -> Header {
    Header {
        kind,
        dtype,
        ctx: 0,
        tag: 0,
        aux,
        msg_id,
        len,
        fp,
    }
}

/// The TRACE event of a posted message (`DISTCOMM_DEBUG=TRACE`, subsystem `msg`). Compiled
/// in only with the `trace-messages` feature: the 8 B path carries no check at all by default.
#[cfg(feature = "trace-messages")]
#[inline(always)]
fn trace_post(what: &str, rank: usize, peer: Option<usize>, env: &Envelope, bytes: usize) {
    tracing::trace!(
        target: "distcomm::msg",
        rank,
        peer = ?peer,
        op = env.op,
        tag = env.tag,
        ctx = env.ctx,
        bytes,
        dtype = ?env.dtype,
        "{what}"
    );
}

fn peer_lost(op: &'static str, rank: usize, peer: usize, reason: &str) -> Error {
    Error::PeerLost {
        op,
        rank,
        peer,
        reason: reason.to_string(),
    }
}

impl State {
    fn alloc_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn dead_reason(&self, p: usize) -> Option<String> {
        match self.peers.get(p) {
            Some(Some(peer)) => peer.dead.clone(),
            _ => None,
        }
    }

    /// The Data chunk size towards `p`.
    fn chunk(&self, p: usize) -> usize {
        match self.peers.get(p) {
            Some(Some(peer)) => peer.chunk,
            _ => DATA_CHUNK,
        }
    }

    fn push_out(&mut self, p: usize, out: Out) {
        if let Some(Some(peer)) = self.peers.get_mut(p) {
            if peer.dead.is_none() {
                peer.out.push_back(out);
            }
        }
    }
}

/// The buffer address carried by an Rget or Rput payload.
fn address(payload: &[u8]) -> u64 {
    let mut raw = [0u8; RGET_PAYLOAD];
    let n = RGET_PAYLOAD.min(payload.len());
    raw[..n].copy_from_slice(&payload[..n]);
    u64::from_le_bytes(raw)
}

fn complete_recv(r: Posted, src: usize, h: &Header) {
    let status = Status {
        peer: src,
        tag: h.tag,
        bytes: h.len as usize,
    };
    r.cell.complete(Ok(status), Some(r.buf));
}

struct Shared {
    rank: usize,
    st: Mutex<State>,
    /// Per peer, what a waiter watches of its shared-memory link without the lock.
    watch: Vec<Option<ShmWatch>>,
    wake_tx: UnixStream,
    wake_rx: UnixStream,
    /// Waiters spinning now, and spins ended so far (see [`SPINNER`]).
    spinning: AtomicU64,
    /// The progress thread is (or is about to be) asleep in poll(2) on the sockets.
    watching: AtomicBool,
    /// A waiter stopped spinning to sleep: the progress thread must watch the sockets now.
    handoff: AtomicBool,
    stop: AtomicBool,
    spin: Duration,
    yield_spin: bool,
}

/// The TCP progress engine of one process.
pub(crate) struct Engine {
    sh: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_starts_half_a_page_in_with_a_whole_buffer_after_it() {
        for addr in [0usize, 16, 2047, 2048, 2049, 4095, 4096, 0x7f00_1234_5010] {
            let base = rx_base(addr);
            assert!(base < PAGE, "{addr:#x}");
            assert_eq!((addr + base) % PAGE, RX_PAGE_OFFSET, "{addr:#x}");
        }
        let (buf, base) = rx_buffer();
        assert_eq!((buf.as_ptr() as usize + base) % PAGE, RX_PAGE_OFFSET);
        assert!(buf.len() - base >= RXBUF);
    }

    #[test]
    fn a_direct_read_at_under_a_third_of_the_buffers_speed_is_slow() {
        let us = Duration::from_micros;
        let mut c = CopyRate::default();
        // Nothing to compare with yet, and reads too small to tell.
        assert!(!c.slow(64 << 10, us(1000)));
        c.staged(1000, us(1000));
        assert_eq!(c.staged, 0.0);
        // 64 KiB in 8 µs: 8.2 bytes/ns.
        c.staged(64 << 10, us(8));
        assert!(!c.slow(64 << 10, us(23)));
        assert!(c.slow(64 << 10, us(25)));
        assert!(!c.slow(1024, us(1000)));
        // The average moves a quarter of the way to a new reading.
        let before = c.staged;
        c.staged(64 << 10, us(16));
        assert!((c.staged - (0.75 * before + 0.25 * before / 2.0)).abs() < 1e-9);
    }
}
