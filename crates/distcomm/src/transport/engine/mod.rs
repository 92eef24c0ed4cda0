//! The progress engine: a full mesh of connections, each a TCP socket or a shared-memory link
//! (`shm`: rings in shared memory, with the socket kept for doorbells and peer death), all
//! carrying the same frames and driven by one engine. The decisions (matching, which protocol,
//! refusals, reassembly, cancelled keys) are the sans-I/O core's (`transport::protocol`); this
//! module owns the state behind the lock (queues, pending sends, per-peer I/O state) and its
//! submodules carry the decisions out: `recv` (headers and posts), `wire` (reading and writing
//! frames), `rxbuf` (a socket's receive buffer), `lane`, `fetch` (cross-memory copies),
//! `cancel`, `failure` (peer loss, abort, reclaim), `ops` (the `Engine` API) and `progress`
//! (threads, spinning, `poll(2)`).
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
use crate::completion::{block, BoxBuf, Deadline, Driver, OpCell, Status, Ticket};
use crate::copy::copy_bytes;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::pool::Pool;
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
use crate::transport::tcp::{same_host, set_buffers, CROWDED_LOCAL_SOCKBUF, LOCAL_SOCKBUF};
use crate::transport::{LaneKey, LaneMsg, LinkKind, ShmLink, ShmWatch};

mod cancel;
mod failure;
mod fetch;
mod lane;
mod ops;
mod progress;
mod recv;
mod rxbuf;
mod txcopy;
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
    /// copied straight between the processes. Measured (ping-pong and stream, 2 ranks, through
    /// the ring against the direct copy, new/old time, alternating runs gated on the cache-line
    /// round trip): with the two vCPUs sharing a core's caches the ring wins up to 64 KiB (20 KiB
    /// 0.38x, 32 KiB 0.50x, 64 KiB 0.65-0.72x), on separate caches (as distinct cores are) up
    /// to 24-32 KiB only (20-24 KiB 0.73-0.85x, 32 KiB 0.96x, 64 KiB 1.27-1.32x): 32 KiB by
    /// default. (An earlier build measured the ring slower from 24 KiB: 32 KiB 6.1 against
    /// 4.8 µs.)
    pub shm_eager_max: usize,
    /// How long a waiter spins (driving progress) before it sleeps.
    pub spin: Duration,
    /// Yield the core between spins (ranks outnumber cores: let the others run).
    pub yield_spin: bool,
    /// Socket send and receive buffer size in bytes; 0 leaves the kernel's autotuning on.
    /// `None`: [`LOCAL_SOCKBUF`] towards peers on this host ([`CROWDED_LOCAL_SOCKBUF`] with
    /// `yield_spin`), autotuning towards others.
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

/// What a message that arrived or was announced finds among the posted receives
/// ([`State::take_matching`]).
enum Matched {
    /// No receive is posted for it.
    Unposted,
    /// This receive takes it (checked).
    Recv(Posted),
    /// This receive refuses it, for this reason (not answered yet: [`State::refuse`]).
    Refused(Posted, (Error, NackReason)),
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
    /// A send in `State::sends`, completed by the engine when the answer comes (one its
    /// watcher handed over: `State::adopt_lane_send`).
    Op { seq: u64, id: u64 },
    /// A send whose watcher reads the answer word itself: a blocking caller, or a handle
    /// ([`Ticket`]). A refusal the engine reads first (the Nack frame) is kept for it. Once
    /// accepted the entry is free for reuse.
    Caller { seq: u64, nack: Option<Header> },
}

/// Who waits for the answer to a lane message.
#[derive(Clone, Copy)]
enum Owner {
    /// Nobody (scheduled messages: complete once written).
    Nobody,
    /// The calling thread or the send's handle ([`LaneWait::Caller`]).
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

/// What a receive that takes its message straight from a lane found: a blocking receive
/// ([`State::recv_from_lane`], `T` its outcome) or the waiter of a posted one ([`State::claim`],
/// `T` its status and buffer: the receive left the queue without completing its cell).
enum LaneTake<T> {
    Got(T),
    /// Nothing for it yet in its source's lane.
    Empty,
    /// It must take the general path (for a posted receive: gone from the queue, not the next
    /// to match, any source, the link not idle, or refused, and then its cell says why).
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
    /// `rx_base` (see [`rxbuf::rx_base`]) once it is empty.
    rxbuf: Box<[u8]>,
    rx_base: usize,
    /// How fast the kernel copies this socket's data out (see [`rxbuf::CopyRate`]).
    copy: rxbuf::CopyRate,
    /// Where a large payload slow to copy into the socket goes on from (see [`txcopy`]).
    tx: txcopy::TxBounce,
    rx_start: usize,
    rx_end: usize,
    dead: Option<String>,
    /// [`DATA_CHUNK`] or [`LOCAL_DATA_CHUNK`].
    chunk: usize,
    /// Shared-memory peers: our lane messages waiting for an answer, by sequence number modulo
    /// [`LANE_ACKS`] (empty for TCP peers), and how many of them are [`LaneWait::Op`].
    lane_waits: Vec<Option<LaneWait>>,
    lane_ops: usize,
    /// Whether the progress thread's latest poll set asks for this socket's writability (then
    /// a backlog queued here since needs no wake-up: see [`Engine::nudge`]).
    out_watched: bool,
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
    /// A spinning waiter's poll set (descriptors, their peers), kept from one wait to the
    /// next: a fresh one cost two allocations per wait.
    wait_set: (Vec<libc::pollfd>, Vec<usize>),
    /// How fast the kernel copies large writes into socket pages (see [`txcopy`]).
    tx_rate: txcopy::TxRate,
    /// Buffers of unexpected eager payloads, kept for the next ones ([`SPARE_TEMPS`]).
    spare_temps: Pool,
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

/// Buffers of unexpected eager payloads kept for reuse (each at most an eager message). A
/// fresh zeroed buffer each time faulted its pages in on every message once a receiver had
/// fallen behind, which kept it behind: world 2 broadcast of 64 KiB over TCP took 17 µs per
/// call in most runs and 47-53 µs in some, with page faults and page clearing in the profile
/// of those.
const SPARE_TEMPS: usize = 16;

/// The speed of a copy of `n` bytes that took `took`, in bytes per nanosecond, when it is one
/// to go by: at least `min` bytes, and measurable (the kernel's copies out of and into socket
/// pages: `rxbuf`, `txcopy`).
fn copy_rate(n: usize, took: Duration, min: usize) -> Option<f64> {
    let ns = took.as_nanos();
    (n >= min && ns > 0).then(|| n as f64 / ns as f64)
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
