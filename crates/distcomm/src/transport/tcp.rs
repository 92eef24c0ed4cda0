//! The progress engine: a full mesh of connections, each a TCP socket or a shared-memory link
//! (`shm.rs`: rings in shared memory, with the socket kept for doorbells and peer death), all
//! carrying the same frames and driven by one engine.
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
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::frame::{
    Fingerprint, Header, Kind, NackReason, EAGER_NO_ACK, HEADER_LEN, LANE, LANE_ACKS, LANE_HEAD,
    RGET_PAYLOAD,
};
use super::protocol::cancel::Cancelled;
use super::protocol::choice::{self, Limits, Wire};
use super::protocol::matching::{self, Key, Matcher};
use super::protocol::reassembly::{Chunk, Reassembly};
use super::protocol::refusal::{self, Expect, Sent};
#[cfg(target_os = "linux")]
use super::shm;
use super::{LaneMsg, LinkKind, ShmLink, ShmWatch};
use crate::completion::{block, BoxBuf, Deadline, Driver, OpCell, Status};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Everything about a posted operation except its buffer and its peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Envelope {
    /// The API operation, for errors.
    pub op: &'static str,
    pub dtype: DType,
    /// Communication context (group and kind of traffic).
    pub ctx: u32,
    pub tag: u32,
    /// Collective fingerprint ([`Fingerprint::NONE`] for point-to-point).
    pub fp: Fingerprint,
}

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

/// The frame that carries `buf[base..]` of message `msg_id` (`len` bytes in all), up to one
/// `chunk`.
fn data_chunk(
    msg_id: u64,
    dtype: DType,
    buf: BoxBuf,
    (base, len): (usize, usize),
    chunk: usize,
) -> Out {
    let plen = (len - base).min(chunk);
    let hdr = Header {
        kind: Kind::Data,
        dtype,
        ctx: 0,
        tag: 0,
        aux: 0,
        msg_id,
        len: plen as u64,
        fp: Fingerprint::NONE,
    };
    Out {
        hdr: hdr.encode(),
        kind: Kind::Data,
        payload: Some(buf),
        base,
        plen,
        send_id: Some(msg_id),
    }
}

/// Socket buffers towards a peer on the same host. Loopback TCP is bound by memory copies, and
/// buffers this small keep the data in cache between the sender's copy in and the receiver's copy
/// out: measured here, 64 MiB ping-pong went from ~2.9 GB/s (autotuned, several MiB) to ~4 GB/s.
/// Across a real network the bandwidth-delay product needs autotuning, so remote peers keep it.
pub const LOCAL_SOCKBUF: usize = 128 * 1024;

fn same_host(stream: &TcpStream) -> bool {
    match (stream.peer_addr(), stream.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}

fn set_buffers(stream: &TcpStream, bytes: usize) -> Result<()> {
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt on a socket we own, with a pointer to a live c_int and its size.
        let rc = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(Error::io(
                "set socket buffer size",
                io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

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
    /// Nobody (collective messages: complete once written).
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

/// The byte stream to a peer: its socket, or a shared-memory link beside it (then the socket
/// only carries doorbells and reports the peer's death).
struct Link {
    stream: TcpStream,
    shm: Option<ShmLink>,
}

impl Link {
    /// Reads into `dst`; `Err` means the link is gone.
    fn read(&mut self, dst: &mut [u8]) -> std::result::Result<Fill, String> {
        #[cfg(target_os = "linux")]
        if let Some(l) = &self.shm {
            let (n, ring) = l.read(dst).map_err(|e| e.to_string())?;
            if ring {
                shm::ring_doorbell(&self.stream);
            }
            return Ok(if n == 0 { Fill::Empty } else { Fill::Got(n) });
        }
        loop {
            match self.stream.read(dst) {
                Ok(0) => return Err("connection closed by peer".into()),
                Ok(n) => return Ok(Fill::Got(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Fill::Empty),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Writes what fits of `iov`; `Ok(0)` when nothing fits now.
    fn write(&mut self, iov: &[IoSlice<'_>]) -> std::result::Result<usize, String> {
        #[cfg(target_os = "linux")]
        if let Some(l) = &self.shm {
            let (n, ring) = l.write(iov).map_err(|e| e.to_string())?;
            if ring {
                shm::ring_doorbell(&self.stream);
            }
            return Ok(n);
        }
        loop {
            match self.stream.write_vectored(iov) {
                Ok(0) => return Err("connection closed while writing".into()),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Rings the shared-memory peer's doorbell (it sleeps and we published something).
    fn ring(&self) {
        #[cfg(target_os = "linux")]
        shm::ring_doorbell(&self.stream);
    }

    /// The peer's process id where a direct (cross-memory) copy from it is allowed.
    fn cma_pid(&self) -> Option<i32> {
        #[cfg(target_os = "linux")]
        if let Some(l) = self.shm.as_ref().filter(|l| l.cma) {
            return Some(l.pid);
        }
        None
    }

    fn no_more_cma(&mut self) {
        #[cfg(target_os = "linux")]
        if let Some(l) = &mut self.shm {
            l.cma = false;
        }
    }
}

struct Peer {
    link: Link,
    out: VecDeque<Out>,
    out_off: usize,
    rx: Rx,
    rxbuf: Box<[u8]>,
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

enum Fill {
    Got(usize),
    Empty,
}

impl Peer {
    /// Reads into the receive buffer: from a socket as much as fits (one system call for many
    /// frames), from a shared-memory ring only the `want` bytes needed now (the rest is best
    /// copied straight to its destination).
    fn fill(&mut self, want: usize) -> std::result::Result<Fill, String> {
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        } else if self.rx_start > 0 && self.rxbuf.len() - self.rx_end < HEADER_LEN {
            self.rxbuf.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        let end = if self.link.shm.is_some() {
            (self.rx_end + want).min(self.rxbuf.len())
        } else {
            self.rxbuf.len()
        };
        let r = self.link.read(&mut self.rxbuf[self.rx_end..end])?;
        if let Fill::Got(n) = r {
            self.rx_end += n;
        }
        Ok(r)
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

/// Why a collective was cancelled.
#[derive(Clone, Copy)]
struct Cancel {
    /// The rank that cancelled it.
    by: usize,
    /// Its call.
    fp: Fingerprint,
    dtype: DType,
    /// Whether it found a desync (otherwise another error).
    desync: bool,
    /// The peer whose loss made it fail, when that was the cause.
    lost: Option<usize>,
}

/// The `aux` word of a Cancel frame: bit 0 desync, bits 8.. the lost peer + 1 (0: none).
fn cancel_aux(desync: bool, lost: Option<usize>) -> u32 {
    u32::from(desync) | lost.map_or(0, |p| (p as u32).saturating_add(1) << 8)
}

impl Cancel {
    /// The error an operation (`op`, our call `fp`/`dtype`) of the cancelled collective gets.
    fn error(&self, rank: usize, op: &'static str, fp: Fingerprint, dtype: DType) -> Error {
        let theirs = self.fp.describe(self.dtype);
        match (self.desync, self.by == rank) {
            (false, false) if self.lost.is_some_and(|p| p != rank) => Error::PeerLost {
                op,
                rank,
                peer: self.lost.unwrap_or(self.by),
                reason: format!(
                    "rank {} lost its connection to it during collective {theirs} and cancelled \
                     the collective",
                    self.by
                ),
            },
            (true, false) => Error::Desync {
                op,
                rank,
                peer: self.by,
                ours: fp.describe(dtype),
                theirs: format!("{theirs}, which found a mismatch and cancelled"),
            },
            _ => Error::Aborted {
                op,
                rank,
                reason: format!(
                    "rank {} failed collective {theirs} and cancelled it",
                    self.by
                ),
            },
        }
    }
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
    cancelled: Cancelled<Cancel>,
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

    /// Sends the control frame `hdr` (a reply: Ack, Nack, Cts) to `p`; a reply to ourselves
    /// (a self-send) is handled in place. A self-send never uses Rts, so such a reply is Ack or
    /// Nack and cannot fail.
    fn reply(&mut self, p: usize, hdr: Header) {
        if p == self.rank {
            let _ = self.on_header(p, hdr);
            return;
        }
        self.push_out(
            p,
            Out {
                hdr: hdr.encode(),
                kind: hdr.kind,
                payload: None,
                base: 0,
                plen: 0,
                send_id: None,
            },
        );
    }

    /// Checks a matched receive against a message header.
    fn check(
        &self,
        r: &mut Posted,
        src: usize,
        h: &Header,
    ) -> std::result::Result<(), (Error, NackReason)> {
        let cap = r.buf.bytes().len() as u64;
        // A buffer sized by what arrives (pipeline tensors, byte objects) takes its length now.
        let fitted = !refusal::scheduled(r.fp)
            && h.len != cap
            && r.fp == h.fp
            && (r.dtype == DType::Bytes || r.dtype == h.dtype)
            && usize::try_from(h.len).is_ok_and(|n| r.buf.fit(n));
        let cap = if fitted { h.len } else { cap };
        let want = Expect {
            op: r.op,
            dtype: r.dtype,
            check: r.fp,
            cap,
        };
        refusal::check(self.rank, want, src, h)
    }

    /// Answers the sender of an eager message or Rts: Ack/Cts on success, Nack on refusal.
    /// Self-sends are answered in place. A lane message is answered in its answer word (when
    /// its sender waits for one), a refusal also with a Nack frame that says why.
    fn answer(&mut self, src: usize, h: &Header, refusal: Option<Refusal>) {
        if h.aux & LANE != 0 {
            if h.aux & EAGER_NO_ACK == 0 {
                self.lane_answer(src, h.msg_id, refusal.is_some());
            }
            if refusal.is_none() {
                return;
            }
        }
        let (kind, aux, len, dtype, fp) = match refusal {
            None if h.kind == Kind::Eager && h.aux & EAGER_NO_ACK != 0 => return,
            None if h.kind == Kind::Rts => (Kind::Cts, 0, 0, h.dtype, Fingerprint::NONE),
            None => (Kind::Ack, 0, 0, h.dtype, Fingerprint::NONE),
            Some(r) => (
                Kind::Nack,
                r.reason as u32 | (h.aux & LANE),
                r.cap,
                r.dtype,
                r.fp,
            ),
        };
        self.reply(src, control(kind, h.msg_id, aux, len, dtype, fp));
    }

    /// The link to `p` when it is a shared-memory one (its socket carries the doorbell), with
    /// its shared-memory side.
    fn shm_link(&self, p: usize) -> Option<(&Link, &ShmLink)> {
        let link = &self.peers.get(p)?.as_ref()?.link;
        Some((link, link.shm.as_ref()?))
    }

    /// Writes the answer word of lane message `seq` from `p`, ringing `p` if it sleeps.
    fn lane_answer(&mut self, p: usize, seq: u64, refused: bool) {
        if let Some((link, shm)) = self.shm_link(p) {
            if shm.lane_answer(seq, refused) {
                link.ring();
            }
        }
    }

    /// Matches a message that arrived whole (an eager payload, or an Rget's buffer address)
    /// with a posted receive and checks it. Unmatched, it is queued as unexpected; refused, the
    /// sender is answered and the receive failed. Returns the receive and the data otherwise.
    fn match_arrived(
        &mut self,
        src: usize,
        h: &Header,
        data: Vec<u8>,
    ) -> Option<(Posted, Vec<u8>)> {
        let Some(mut r) = self.matcher.take_posted(src, (h.ctx, h.tag)) else {
            self.matcher.push_unexpected(Unexpected {
                src,
                hdr: *h,
                data: Some(data),
            });
            return None;
        };
        match self.check(&mut r, src, h) {
            Ok(()) => Some((r, data)),
            Err((e, reason)) => {
                self.answer(src, h, Some(r.refusal(reason)));
                r.cell.complete(Err(e), None);
                None
            }
        }
    }

    /// Delivers a fully received eager payload: into a matching posted receive, or into the
    /// unexpected queue.
    fn deliver_eager(&mut self, src: usize, h: Header, data: Vec<u8>) {
        if let Some((mut r, data)) = self.match_arrived(src, &h, data) {
            r.buf.bytes_mut()[..data.len()].copy_from_slice(&data);
            self.answer(src, &h, None);
            complete_recv(r, src, &h);
        }
    }

    /// A peer asks us to fetch a large message (`addr`: its buffer address, 8 bytes).
    fn on_rget(&mut self, src: usize, h: Header, addr: Vec<u8>) {
        if let Some((r, addr)) = self.match_arrived(src, &h, addr) {
            self.fetch(src, h, r, &addr);
        }
    }

    /// Copies a matched Rget message straight from the sender's memory and acknowledges it;
    /// a message of at least `choice::SPLIT_MIN` bytes into memory we own is copied by both sides at
    /// once (we ask the sender to write the head with an Rput while we read the tail). Where
    /// the kernel refuses, has it streamed instead (Cts), and stops trying on that link.
    fn fetch(&mut self, src: usize, h: Header, mut r: Posted, addr: &[u8]) {
        let addr = address(addr);
        let pid = match self.peers.get(src) {
            Some(Some(peer)) => peer.link.cma_pid(),
            _ => None,
        };
        #[cfg(target_os = "linux")]
        if let Some(pid) = pid {
            let n = h.len as usize;
            let split = choice::split(n, !r.buf.is_view());
            if split > 0 {
                let ours = r.buf.bytes().as_ptr() as u64;
                self.push_out(
                    src,
                    Out {
                        hdr: control(Kind::Rput, h.msg_id, 0, split as u64, h.dtype, h.fp).encode(),
                        kind: Kind::Rput,
                        payload: Some(Box::new(ours.to_le_bytes().to_vec())),
                        base: 0,
                        plen: RGET_PAYLOAD,
                        send_id: None,
                    },
                );
                if let Err(reason) = self.pump_tx(src) {
                    self.mark_dead(src, reason);
                }
            }
            let tail = &mut r.buf.bytes_mut()[split..n];
            let copied = shm::cma_read(pid, addr + split as u64, tail);
            if split > 0 {
                r.cell.kick();
                let own_failed = copied.is_err();
                let lent = Lent {
                    r,
                    h,
                    addr,
                    split,
                    own_failed,
                };
                self.lent.insert((src, h.msg_id), lent);
                return;
            }
            if copied.is_ok() {
                self.reply(
                    src,
                    control(Kind::Ack, h.msg_id, 0, 0, h.dtype, Fingerprint::NONE),
                );
                complete_recv(r, src, &h);
                return;
            }
            if let Some(Some(peer)) = self.peers.get_mut(src) {
                peer.link.no_more_cma();
            }
        }
        let _ = (pid, addr);
        self.stream_instead(src, h, r);
    }

    /// Has a large message streamed (Cts, then Data) instead of copied directly.
    fn stream_instead(&mut self, src: usize, h: Header, r: Posted) {
        let cts = control(Kind::Cts, h.msg_id, 0, 0, h.dtype, Fingerprint::NONE);
        self.reply(src, cts);
        r.cell.kick();
        self.rdv.expect(src, h.msg_id, r, h.len);
    }

    /// Sender side of an Rput: write the head of message `h.msg_id` into the receiver's buffer
    /// at `addr`, and say whether that worked (Put).
    fn on_rput(&mut self, p: usize, h: Header, addr: Vec<u8>) -> std::result::Result<(), String> {
        let addr = address(&addr);
        let pid = match self.peers.get(p) {
            Some(Some(peer)) => peer.link.cma_pid(),
            _ => None,
        };
        let Some(s) = self.sends.get(&h.msg_id).filter(|s| s.dst == p) else {
            return Err(format!(
                "protocol violation: put request for unknown message {}",
                h.msg_id
            ));
        };
        let n = (h.len as usize).min(s.len);
        let written = match (&s.buf, pid) {
            #[cfg(target_os = "linux")]
            (Some(buf), Some(pid)) => shm::cma_write(pid, addr, &buf.bytes()[..n]).is_ok(),
            _ => false,
        };
        s.cell.kick();
        let put = control(
            Kind::Put,
            h.msg_id,
            u32::from(!written),
            0,
            h.dtype,
            Fingerprint::NONE,
        );
        self.reply(p, put);
        Ok(())
    }

    /// Receiver side of Put: the sender wrote the head (or could not). Finish the message.
    fn on_put(&mut self, p: usize, h: Header) -> std::result::Result<(), String> {
        let Some(l) = self.lent.remove(&(p, h.msg_id)) else {
            return Err(format!(
                "protocol violation: put for unknown message {}",
                h.msg_id
            ));
        };
        let Lent {
            mut r,
            h: rh,
            addr,
            split,
            own_failed,
        } = l;
        let mut ok = !own_failed;
        if ok && h.aux != 0 {
            // The sender could not write the head: read it ourselves, or have it all streamed.
            let pid = self.peers.get(p).and_then(|x| x.as_ref()?.link.cma_pid());
            ok = match pid {
                #[cfg(target_os = "linux")]
                Some(pid) => shm::cma_read(pid, addr, &mut r.buf.bytes_mut()[..split]).is_ok(),
                _ => false,
            };
            let _ = (addr, split);
        }
        if ok {
            self.reply(
                p,
                control(Kind::Ack, rh.msg_id, 0, 0, rh.dtype, Fingerprint::NONE),
            );
            complete_recv(r, p, &rh);
        } else {
            if let Some(Some(peer)) = self.peers.get_mut(p) {
                peer.link.no_more_cma();
            }
            self.stream_instead(p, rh, r);
        }
        Ok(())
    }

    /// Matches a newly posted receive against the unexpected queue, or queues it.
    fn post_recv(&mut self, mut r: Posted) {
        let Some(u) = self.matcher.take_unexpected(r.src, (r.ctx, r.tag)) else {
            if let Some(c) = self.cancelled.get((r.ctx, r.tag)) {
                let e = c.error(self.rank, r.op, r.fp, r.dtype);
                r.cell.complete(Err(e), None);
                return;
            }
            if let Some(src) = r.src {
                if let Some(reason) = self.dead_reason(src) {
                    r.cell
                        .complete(Err(peer_lost(r.op, self.rank, src, &reason)), None);
                    return;
                }
            }
            if let Some(reason) = &self.closed {
                let e = Error::Aborted {
                    op: r.op,
                    rank: self.rank,
                    reason: reason.clone(),
                };
                r.cell.complete(Err(e), None);
                return;
            }
            self.matcher.push_posted(r);
            return;
        };
        if let Err((e, reason)) = self.check(&mut r, u.src, &u.hdr) {
            self.answer(u.src, &u.hdr, Some(r.refusal(reason)));
            r.cell.complete(Err(e), None);
            return;
        }
        match u.data {
            Some(addr) if u.hdr.kind == Kind::Rget => self.fetch(u.src, u.hdr, r, &addr),
            Some(data) => {
                r.buf.bytes_mut()[..data.len()].copy_from_slice(&data);
                self.answer(u.src, &u.hdr, None);
                complete_recv(r, u.src, &u.hdr);
            }
            None => {
                self.answer(u.src, &u.hdr, None);
                self.rdv.expect(u.src, u.hdr.msg_id, r, u.hdr.len);
            }
        }
    }

    fn protocol(&self, detail: String) -> std::result::Result<Rx, String> {
        Err(format!("protocol violation: {detail}"))
    }

    /// Handles a decoded header from peer `p` (or a local reply for self-sends) and returns the
    /// receive state that follows it.
    fn on_header(&mut self, p: usize, h: Header) -> std::result::Result<Rx, String> {
        if matches!(h.kind, Kind::Eager | Kind::Rts | Kind::Rget)
            && self.cancelled.contains((h.ctx, h.tag))
        {
            self.refuse_cancelled(p, &h);
            return Ok(match h.kind {
                Kind::Eager | Kind::Rget => Rx::Payload {
                    hdr: h,
                    target: Target::Discard,
                    got: 0,
                    chunk: None,
                },
                _ => Rx::Header,
            });
        }
        match h.kind {
            Kind::Eager => {
                let target = match self.matcher.take_posted(p, (h.ctx, h.tag)) {
                    None => Target::Temp(vec![0u8; h.len as usize]),
                    Some(mut r) => match self.check(&mut r, p, &h) {
                        Ok(()) => Target::Recv(r),
                        Err((e, reason)) => {
                            self.answer(p, &h, Some(r.refusal(reason)));
                            r.cell.complete(Err(e), None);
                            Target::Discard
                        }
                    },
                };
                Ok(Rx::Payload {
                    hdr: h,
                    target,
                    got: 0,
                    chunk: None,
                })
            }
            Kind::Rts => {
                match self.matcher.take_posted(p, (h.ctx, h.tag)) {
                    None => self.matcher.push_unexpected(Unexpected {
                        src: p,
                        hdr: h,
                        data: None,
                    }),
                    Some(mut r) => match self.check(&mut r, p, &h) {
                        Ok(()) => {
                            self.answer(p, &h, None);
                            r.cell.kick();
                            self.rdv.expect(p, h.msg_id, r, h.len);
                        }
                        Err((e, reason)) => {
                            self.answer(p, &h, Some(r.refusal(reason)));
                            r.cell.complete(Err(e), None);
                        }
                    },
                }
                Ok(Rx::Header)
            }
            Kind::Rget | Kind::Rput => Ok(Rx::Payload {
                hdr: h,
                target: Target::Temp(vec![0u8; RGET_PAYLOAD]),
                got: 0,
                chunk: None,
            }),
            Kind::Put => {
                self.on_put(p, h)?;
                Ok(Rx::Header)
            }
            Kind::Data => match self.rdv.chunk(p, h.msg_id, h.len) {
                Chunk::Into { r, base, whole } => Ok(Rx::Payload {
                    hdr: Header { tag: r.tag, ..h },
                    target: Target::Recv(r),
                    got: 0,
                    chunk: Some((base, whole)),
                }),
                Chunk::Overflow { r, detail } => {
                    r.cell.complete(
                        Err(Error::Protocol {
                            rank: self.rank,
                            peer: p,
                            detail: detail.clone(),
                        }),
                        None,
                    );
                    self.protocol(detail)
                }
                Chunk::Unknown => self.protocol(format!("data for unknown message {}", h.msg_id)),
            },
            Kind::Cts => {
                let Some(s) = self.sends.get_mut(&h.msg_id).filter(|s| s.dst == p) else {
                    return self
                        .protocol(format!("clear-to-send for unknown message {}", h.msg_id));
                };
                let Some(buf) = s.buf.take() else {
                    return self.protocol(format!("second clear-to-send for message {}", h.msg_id));
                };
                s.cell.kick();
                let first = data_chunk(h.msg_id, h.dtype, buf, (0, s.len), self.chunk(p));
                self.push_out(p, first);
                Ok(Rx::Header)
            }
            Kind::Cancel => {
                self.cancel_collective_from(p, &h);
                Ok(Rx::Header)
            }
            Kind::Nack if h.aux & LANE != 0 => self.lane_refused(p, h),
            // The refusal of a message sent without waiting for an answer (EAGER_NO_ACK):
            // its collective is cancelled on every rank anyway.
            Kind::Nack if !self.sends.contains_key(&h.msg_id) => Ok(Rx::Header),
            Kind::Ack | Kind::Nack => {
                if self.sends.get(&h.msg_id).is_none_or(|s| s.dst != p) {
                    return self.protocol(format!("reply for unknown message {}", h.msg_id));
                }
                let Some(s) = self.sends.remove(&h.msg_id) else {
                    return self.protocol(format!("reply for unknown message {}", h.msg_id));
                };
                let result = if h.kind == Kind::Ack {
                    Ok(s.status(p))
                } else {
                    Err(refusal::refused(self.rank, s.sent(), p, &h))
                };
                let buf = if result.is_ok() { s.buf } else { None };
                s.cell.complete(result, buf);
                Ok(Rx::Header)
            }
        }
    }

    /// Sends a small message through the lane of shared-memory peer `p` if the ordering rules
    /// allow it now: nothing queued for the ring (the lane itself refuses while ring bytes are
    /// unread), a free slot, and a free answer word when `owner` waits for the answer. Returns
    /// its sequence number; `None` leaves the message to the ring.
    fn lane_send(&mut self, p: usize, h: &Header, data: &[u8], owner: Owner) -> Option<u64> {
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return None;
        };
        let link = peer.link.shm.as_ref()?;
        if peer.dead.is_some() || !peer.out.is_empty() || !choice::lane_fits(data.len()) {
            return None;
        }
        // The answer word this message would use is free, or not needed.
        let at = (link.next_lane_seq() % LANE_ACKS) as usize;
        let free = matches!(owner, Owner::Nobody)
            || match peer.lane_waits.get(at)? {
                None => true,
                Some(LaneWait::Caller { seq, .. }) => link.answered(*seq) == Some(true),
                Some(LaneWait::Op { .. }) => false,
            };
        if !free {
            return None;
        }
        let (seq, ring) = match link.lane_send(&h.encode_lane(), data) {
            Ok(sent) => sent?,
            Err(e) => {
                self.mark_dead(p, e.to_string());
                return None;
            }
        };
        if ring {
            peer.link.ring();
        }
        match owner {
            Owner::Nobody => {}
            Owner::Op(id) => {
                peer.lane_waits[at] = Some(LaneWait::Op { seq, id });
                peer.lane_ops += 1;
            }
            Owner::Caller => peer.lane_waits[at] = Some(LaneWait::Caller { seq, nack: None }),
        }
        Some(seq)
    }

    /// The next message of `p`'s lane, if one is there, with its decoded header; nothing is
    /// taken until [`State::lane_release`].
    fn lane_peek(&self, p: usize) -> std::result::Result<Option<(Header, LaneMsg)>, String> {
        let Some((_, link)) = self.shm_link(p) else {
            return Ok(None);
        };
        let mut head = [0u8; LANE_HEAD];
        let Some(m) = link.lane_peek(&mut head).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let h = Header::decode_lane(&head, m.seq, m.len)
            .map_err(|e| format!("protocol violation: {}", e.0))?;
        Ok(Some((h, m)))
    }

    /// Copies the payload of lane message `m` from `p` into `dst`.
    fn lane_copy(&self, p: usize, m: LaneMsg, dst: &mut [u8]) {
        if let Some((_, link)) = self.shm_link(p) {
            link.lane_copy(m, dst);
        }
    }

    /// Releases lane message `m` from `p`; with `accept`, also writes its answer word
    /// "accepted" (one fence for both).
    fn lane_release(&mut self, p: usize, m: LaneMsg, accept: bool) {
        if let Some((link, shm)) = self.shm_link(p) {
            if shm.lane_release(m, accept.then_some(false)) {
                link.ring();
            }
        }
    }

    /// Takes every message waiting in shared-memory peer `p`'s lane, in order. Called before
    /// reading its ring: a lane message is never behind unread ring bytes (see `shm`).
    fn pump_lane(&mut self, p: usize) -> std::result::Result<bool, String> {
        let mut any = false;
        while let Some((h, m)) = self.lane_peek(p)? {
            any = true;
            self.lane_deliver(p, h, m);
        }
        Ok(any)
    }

    /// Takes lane message `m` from `p` and delivers it like an eager frame's payload.
    fn lane_deliver(&mut self, p: usize, h: Header, m: LaneMsg) {
        let mut data = vec![0u8; m.len];
        self.lane_copy(p, m, &mut data);
        self.lane_release(p, m, false);
        if self.cancelled.contains((h.ctx, h.tag)) {
            self.refuse_cancelled(p, &h);
        } else {
            self.deliver_eager(p, h, data);
        }
    }

    /// Completes our lane sends to `p` whose answer word says accepted.
    fn poll_lane_acks(&mut self, p: usize) {
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return;
        };
        let Some(link) = peer.link.shm.as_ref().filter(|_| peer.lane_ops > 0) else {
            return;
        };
        let mut done = Vec::new();
        for w in peer.lane_waits.iter_mut() {
            if let Some(LaneWait::Op { seq, id }) = *w {
                if link.answered(seq) == Some(true) {
                    *w = None;
                    done.push(id);
                }
            }
        }
        peer.lane_ops -= done.len();
        for id in done {
            if let Some(s) = self.sends.remove(&id) {
                s.cell.complete(Ok(s.status(p)), s.buf);
            }
        }
    }

    /// `p` refused our lane message `h.msg_id` (a sequence number): fail the send waiting for
    /// it, or keep the refusal for the blocking caller that watches it.
    fn lane_refused(&mut self, p: usize, h: Header) -> std::result::Result<Rx, String> {
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return Ok(Rx::Header);
        };
        let h = Header {
            aux: h.aux & !LANE,
            ..h
        };
        let Some(w) = peer.lane_waits.get_mut((h.msg_id % LANE_ACKS) as usize) else {
            return Ok(Rx::Header);
        };
        match w {
            Some(LaneWait::Op { seq, id }) if *seq == h.msg_id => {
                let id = *id;
                *w = None;
                peer.lane_ops -= 1;
                self.on_header(p, Header { msg_id: id, ..h })
            }
            Some(LaneWait::Caller { seq, nack }) if *seq == h.msg_id => {
                *nack = Some(h);
                Ok(Rx::Header)
            }
            // A message nobody waits an answer for (a collective's).
            _ => Ok(Rx::Header),
        }
    }

    /// A blocking receive (`env`, into `out`) from shared-memory peer `p`, taken straight from
    /// its lane if nothing can come before it: no earlier receive of this (source, tag) is
    /// posted, none of its messages is queued, `p`'s ring holds no half-read frame. Messages of
    /// other tags that come first are delivered as usual.
    fn recv_from_lane(&mut self, p: usize, env: &Envelope, out: &mut [u8]) -> LaneRecv {
        let idle = matches!(self.peers.get(p), Some(Some(peer)) if peer.dead.is_none()
            && peer.link.shm.is_some()
            && matches!(peer.rx, Rx::Header)
            && peer.rx_start == peer.rx_end);
        let (ctx, tag) = (env.ctx, env.tag);
        if !idle
            || self.closed.is_some()
            || self.matcher.posted_could_take(p, (ctx, tag))
            || self.matcher.unexpected_from(p, (ctx, tag))
        {
            return LaneRecv::Declined;
        }
        loop {
            let (h, m) = match self.lane_peek(p) {
                Ok(Some(msg)) => msg,
                Ok(None) => return LaneRecv::Empty,
                Err(reason) => {
                    self.mark_dead(p, reason);
                    return LaneRecv::Declined;
                }
            };
            if (h.ctx, h.tag) != (ctx, tag) {
                self.lane_deliver(p, h, m);
                continue;
            }
            let cap = out.len() as u64;
            return LaneRecv::Got(match refusal::check(self.rank, env.expect(cap), p, &h) {
                Ok(()) => {
                    self.lane_copy(p, m, &mut out[..m.len]);
                    // Accepted: the answer word goes with the slots' release.
                    self.lane_release(p, m, h.aux & EAGER_NO_ACK == 0);
                    Ok(Status {
                        peer: p,
                        tag,
                        bytes: m.len,
                    })
                }
                Err((e, reason)) => {
                    self.lane_release(p, m, false);
                    let refusal = Refusal {
                        reason,
                        cap,
                        dtype: env.dtype,
                        fp: env.fp,
                    };
                    self.answer(p, &h, Some(refusal));
                    Err(e)
                }
            });
        }
    }

    /// The caller of a blocking lane send (`seq` to `p`) stops watching its answer word: the
    /// outcome if it is known, otherwise a send the engine completes when the answer comes.
    fn adopt_lane_send(&mut self, p: usize, seq: u64, env: &Envelope, len: usize) -> Fast {
        let rank = self.rank;
        let status = Status {
            peer: p,
            tag: env.tag,
            bytes: len,
        };
        let at = (seq % LANE_ACKS) as usize;
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return Fast::Done(Ok(status));
        };
        let nack = match peer.lane_waits.get(at) {
            Some(Some(LaneWait::Caller { seq: s, nack })) if *s == seq => *nack,
            // Its word was reused: that needs the answer "accepted".
            _ => return Fast::Done(Ok(status)),
        };
        let accepted = peer.link.shm.as_ref().and_then(|l| l.answered(seq)) == Some(true);
        if accepted || nack.is_some() {
            peer.lane_waits[at] = None;
        }
        if accepted {
            return Fast::Done(Ok(status));
        }
        let id = self.alloc_id();
        let cell = Arc::new(OpCell::default());
        let pending = env.pending(p, len, cell.clone());
        if let Some(h) = nack {
            self.sends.insert(id, pending);
            let _ = self.on_header(p, Header { msg_id: id, ..h });
            return Fast::Handed(id, cell);
        }
        if let Some(reason) = self.dead_reason(p) {
            return Fast::Done(Err(peer_lost(env.op, rank, p, &reason)));
        }
        if let Some(reason) = self.closed.clone() {
            let op = env.op;
            return Fast::Done(Err(Error::Aborted { op, rank, reason }));
        }
        if let Some(Some(peer)) = self.peers.get_mut(p) {
            peer.lane_waits[at] = Some(LaneWait::Op { seq, id });
            peer.lane_ops += 1;
        }
        self.sends.insert(id, pending);
        Fast::Handed(id, cell)
    }

    /// Refuses a message of a cancelled collective, so that its sender's operation ends.
    fn refuse_cancelled(&mut self, src: usize, h: &Header) {
        let refusal = Refusal {
            reason: NackReason::Cancelled,
            cap: 0,
            dtype: h.dtype,
            fp: Fingerprint::NONE,
        };
        self.answer(src, h, Some(refusal));
    }

    /// A peer reports that collective (`h.ctx`, `h.tag`) failed there: fail our operations of it
    /// and refuse its later messages.
    fn cancel_collective_from(&mut self, p: usize, h: &Header) {
        let key = (h.ctx, h.tag);
        let rank = self.rank;
        let lost = (h.aux >> 8)
            .checked_sub(1)
            .map(|l| l as usize)
            .filter(|&l| l < self.peers.len());
        let cancel = Cancel {
            by: p,
            fp: h.fp,
            dtype: h.dtype,
            desync: h.aux & 1 == 1,
            lost,
        };
        for r in self.matcher.withdraw_posted(|r| (r.ctx, r.tag) == key) {
            r.cell
                .complete(Err(cancel.error(rank, r.op, r.fp, r.dtype)), None);
        }
        // Our sends of it fail now; their entries stay until the peer's reply (which may still
        // come) so that the reply is not mistaken for a protocol violation.
        for s in self.sends.values().filter(|s| (s.ctx, s.tag) == key) {
            s.cell
                .complete(Err(cancel.error(rank, s.op, s.fp, s.dtype)), None);
        }
        // Messages of it already here will never be received: refuse them.
        let dropped = self
            .matcher
            .withdraw_unexpected(|u| (u.hdr.ctx, u.hdr.tag) == key);
        for u in dropped {
            self.refuse_cancelled(u.src, &u.hdr);
        }
        self.cancelled.cancel(key, cancel);
    }

    /// A chunk of a cleared message arrived: wait for the next, or complete the receive.
    fn on_chunk_done(&mut self, p: usize, h: Header, target: Target, (base, whole): (usize, u64)) {
        let Target::Recv(r) = target else { return };
        if let Some(r) = self.rdv.chunk_done(p, h.msg_id, r, (base, h.len, whole)) {
            complete_recv(r, p, &Header { len: whole, ..h });
        }
    }

    fn on_payload_done(&mut self, p: usize, h: Header, target: Target) {
        match target {
            Target::Recv(r) => {
                if h.kind == Kind::Eager {
                    self.answer(p, &h, None);
                }
                complete_recv(r, p, &h);
            }
            Target::Temp(data) if h.kind == Kind::Rget => self.on_rget(p, h, data),
            Target::Temp(data) if h.kind == Kind::Rput => {
                if let Err(reason) = self.on_rput(p, h, data) {
                    self.mark_dead(p, reason);
                }
            }
            Target::Temp(data) => self.deliver_eager(p, h, data),
            Target::Discard => {}
        }
    }

    /// Reads and dispatches everything peer `p` has sent, up to a budget.
    fn pump_rx(&mut self, p: usize) -> std::result::Result<bool, String> {
        let mut progressed = false;
        let mut budget = READ_BUDGET;
        loop {
            let Some(Some(peer)) = self.peers.get_mut(p) else {
                return Ok(progressed);
            };
            let rx = std::mem::replace(&mut peer.rx, Rx::Header);
            match rx {
                Rx::Header => {
                    if peer.rx_end - peer.rx_start >= HEADER_LEN {
                        let mut raw = [0u8; HEADER_LEN];
                        raw.copy_from_slice(&peer.rxbuf[peer.rx_start..peer.rx_start + HEADER_LEN]);
                        peer.rx_start += HEADER_LEN;
                        let h = Header::decode(&raw, self.limits.eager_max as u64)
                            .map_err(|e| format!("protocol violation: {}", e.0))?;
                        let next = self.on_header(p, h)?;
                        if let Some(Some(peer)) = self.peers.get_mut(p) {
                            peer.rx = next;
                        }
                        progressed = true;
                        continue;
                    }
                    if budget == 0 {
                        return Ok(progressed);
                    }
                    let want = HEADER_LEN - (peer.rx_end - peer.rx_start);
                    match peer.fill(want)? {
                        Fill::Got(n) => budget = budget.saturating_sub(n),
                        Fill::Empty => return Ok(progressed),
                    }
                }
                Rx::Payload {
                    hdr,
                    mut target,
                    mut got,
                    chunk,
                } => {
                    let total = hdr.payload_len() as usize;
                    if got == total {
                        match chunk {
                            Some(at) => self.on_chunk_done(p, hdr, target, at),
                            None => self.on_payload_done(p, hdr, target),
                        }
                        progressed = true;
                        continue;
                    }
                    let base = chunk.map_or(0, |(base, _)| base);
                    let dst: &mut [u8] = match &mut target {
                        Target::Recv(r) => &mut r.buf.bytes_mut()[base + got..base + total],
                        Target::Temp(v) => &mut v[got..total],
                        Target::Discard => &mut [],
                    };
                    let avail = peer.rx_end - peer.rx_start;
                    if avail > 0 {
                        let n = avail.min(total - got);
                        if !dst.is_empty() {
                            dst[..n].copy_from_slice(&peer.rxbuf[peer.rx_start..peer.rx_start + n]);
                        }
                        peer.rx_start += n;
                        got += n;
                        peer.rx = Rx::Payload {
                            hdr,
                            target,
                            got,
                            chunk,
                        };
                        progressed = true;
                        continue;
                    }
                    if budget == 0 {
                        peer.rx = Rx::Payload {
                            hdr,
                            target,
                            got,
                            chunk,
                        };
                        return Ok(progressed);
                    }
                    let r =
                        if dst.len() >= RXBUF / 2 || (peer.link.shm.is_some() && !dst.is_empty()) {
                            peer.link.read(dst).map(|f| {
                                if let Fill::Got(n) = f {
                                    got += n;
                                }
                                f
                            })
                        } else {
                            peer.fill(total - got)
                        };
                    let r = match r {
                        Ok(r) => r,
                        Err(e) => {
                            // Keep the partial receive so that mark_dead fails it.
                            peer.rx = Rx::Payload {
                                hdr,
                                target,
                                got,
                                chunk,
                            };
                            return Err(e);
                        }
                    };
                    peer.rx = Rx::Payload {
                        hdr,
                        target,
                        got,
                        chunk,
                    };
                    match r {
                        Fill::Got(n) => budget = budget.saturating_sub(n),
                        Fill::Empty => return Ok(progressed),
                    }
                }
            }
        }
    }

    /// Writes queued frames to peer `p` until the socket is full.
    fn pump_tx(&mut self, p: usize) -> std::result::Result<bool, String> {
        let mut progressed = false;
        loop {
            let Some(Some(peer)) = self.peers.get_mut(p) else {
                return Ok(progressed);
            };
            if peer.out.is_empty() {
                return Ok(progressed);
            }
            let written = {
                let mut iov = [IoSlice::new(&[]); MAX_IOV];
                let mut k = 0;
                let mut skip = peer.out_off;
                for o in peer.out.iter() {
                    if k + 2 > MAX_IOV {
                        break;
                    }
                    let payload = o
                        .payload
                        .as_ref()
                        .map(|b| &b.bytes()[o.base..o.base + o.plen])
                        .unwrap_or(&[]);
                    if skip < HEADER_LEN {
                        iov[k] = IoSlice::new(&o.hdr[skip..]);
                        k += 1;
                        if !payload.is_empty() {
                            iov[k] = IoSlice::new(payload);
                            k += 1;
                        }
                    } else if skip - HEADER_LEN < payload.len() {
                        iov[k] = IoSlice::new(&payload[skip - HEADER_LEN..]);
                        k += 1;
                    }
                    skip = 0;
                }
                match peer.link.write(&iov[..k])? {
                    0 => return Ok(progressed),
                    n => n,
                }
            };
            progressed = true;
            let mut n = written;
            let mut finished = Vec::new();
            while n > 0 {
                let Some(front) = peer.out.front() else { break };
                let flen = HEADER_LEN + front.plen;
                let left = flen - peer.out_off;
                if n >= left {
                    n -= left;
                    peer.out_off = 0;
                    if let Some(o) = peer.out.pop_front() {
                        finished.push(o);
                    }
                } else {
                    peer.out_off += n;
                    n = 0;
                }
            }
            // A zero-length tail frame has been written once its header has.
            for o in finished {
                self.frame_written(p, o);
            }
        }
    }

    fn frame_written(&mut self, p: usize, o: Out) {
        let Some(id) = o.send_id else { return };
        match o.kind {
            Kind::Eager => match self.sends.get_mut(&id) {
                Some(s) if s.waits_for_ack() => s.buf = o.payload,
                Some(_) => self.send_done(p, id, o.payload),
                None => {}
            },
            Kind::Data => {
                let end = o.base + o.plen;
                let more = self.sends.get(&id).filter(|s| end < s.len);
                if let Some(&PendingSend { len, dtype, .. }) = more {
                    if let Some(buf) = o.payload {
                        // Behind everything queued meanwhile (replies first): the next chunk.
                        let next = data_chunk(id, dtype, buf, (end, len), self.chunk(p));
                        self.push_out(p, next);
                    }
                    return;
                }
                self.send_done(p, id, o.payload);
            }
            _ => {}
        }
    }

    /// Send `id` to `p` succeeded once written: it gives its buffer back.
    fn send_done(&mut self, p: usize, id: u64, buf: Option<BoxBuf>) {
        if let Some(s) = self.sends.remove(&id) {
            s.cell.complete(Ok(s.status(p)), buf);
        }
    }

    /// Fails everything that depends on peer `p`.
    fn mark_dead(&mut self, p: usize, reason: String) {
        let rank = self.rank;
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return;
        };
        if peer.dead.is_some() {
            return;
        }
        let _ = peer.link.stream.shutdown(Shutdown::Both);
        peer.dead = Some(reason.clone());
        peer.out.clear();
        if let Rx::Payload {
            target: Target::Recv(r),
            ..
        } = std::mem::replace(&mut peer.rx, Rx::Header)
        {
            r.cell
                .complete(Err(peer_lost(r.op, rank, p, &reason)), None);
        }
        for r in self.matcher.withdraw_posted(|r| r.src == Some(p)) {
            r.cell
                .complete(Err(peer_lost(r.op, rank, p, &reason)), None);
        }
        for r in self.rdv.withdraw_source(p) {
            r.cell
                .complete(Err(peer_lost(r.op, rank, p, &reason)), None);
        }
        // A dead peer writes no more: its lent buffers are free again.
        let keys: Vec<_> = self.lent.keys().filter(|k| k.0 == p).copied().collect();
        for k in keys {
            if let Some(l) = self.lent.remove(&k) {
                l.r.cell
                    .complete(Err(peer_lost(l.r.op, rank, p, &reason)), None);
            }
        }
        let ids: Vec<u64> = self
            .sends
            .iter()
            .filter(|(_, s)| s.dst == p)
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            if let Some(s) = self.sends.remove(&id) {
                s.cell
                    .complete(Err(peer_lost(s.op, rank, p, &reason)), None);
            }
        }
        // Announced large messages can no longer be fetched; eager ones arrived whole.
        self.matcher
            .withdraw_unexpected(|u| u.src == p && u.hdr.kind != Kind::Eager);
    }

    fn reclaim(&mut self, ids: &[u64]) {
        let rank = self.rank;
        let hit = |id: u64| ids.contains(&id);
        let withdrawn = |op| Error::Aborted {
            op,
            rank,
            reason: "withdrawn by its collective".into(),
        };
        let owned = |b: &BoxBuf| -> BoxBuf { Box::new(b.bytes().to_vec()) };
        let scratch = |b: &BoxBuf| -> BoxBuf { Box::new(vec![0u8; b.bytes().len()]) };
        for r in self.matcher.withdraw_posted(|r| hit(r.id)) {
            r.cell.complete(Err(withdrawn(r.op)), None);
        }
        for r in self.rdv.receives_mut().filter(|r| hit(r.id)) {
            r.buf = scratch(&r.buf);
            r.cell.complete(Err(withdrawn(r.op)), None);
        }
        for peer in self.peers.iter_mut().flatten() {
            if let Rx::Payload {
                target: Target::Recv(r),
                ..
            } = &mut peer.rx
            {
                if hit(r.id) {
                    r.buf = scratch(&r.buf);
                    r.cell.complete(Err(withdrawn(r.op)), None);
                }
            }
            for o in peer.out.iter_mut().filter(|o| o.send_id.is_some_and(hit)) {
                if let Some(b) = &o.payload {
                    o.payload = Some(owned(b));
                }
            }
        }
        for (_, s) in self.sends.iter_mut().filter(|(id, _)| hit(**id)) {
            if let Some(b) = &s.buf {
                s.buf = Some(owned(b));
            }
        }
    }

    /// One sweep over every live peer. Returns whether anything moved.
    ///
    /// With `flush_replies` false, control frames produced while reading (Ack, Cts) stay queued
    /// until the next sweep or the next send to that peer, whichever comes first; a waiter uses
    /// this so that a reply and the message the user sends next leave in one write.
    fn progress(&mut self, flush_replies: bool) -> bool {
        let mut any = false;
        for p in 0..self.peers.len() {
            let live = matches!(self.peers.get(p), Some(Some(peer)) if peer.dead.is_none());
            if live {
                any |= self.pump(p, true, true, flush_replies);
            }
        }
        any
    }

    /// Fills `fds`/`owners` with every live peer's socket: readable always, writable when
    /// frames are queued. Shared-memory peers' sockets only carry doorbells: they are included
    /// with `doorbells` (to sleep on), left out otherwise (their rings are checked directly).
    fn poll_set(&self, fds: &mut Vec<libc::pollfd>, owners: &mut Vec<usize>, doorbells: bool) {
        for (p, peer) in self.peers.iter().enumerate() {
            if let Some(peer) = peer.as_ref().filter(|x| x.dead.is_none()) {
                let shm = peer.link.shm.is_some();
                if shm && !doorbells {
                    continue;
                }
                let mut events = libc::POLLIN;
                if !shm && !peer.out.is_empty() {
                    events |= libc::POLLOUT;
                }
                fds.push(libc::pollfd {
                    fd: peer.link.stream.as_raw_fd(),
                    events,
                    revents: 0,
                });
                owners.push(p);
            }
        }
    }

    /// Moves only the sockets poll(2) reported ready. The progress thread always works this
    /// way; a spinning waiter does when it has several peers (one poll instead of a read on
    /// each), and reads directly when it has one (on arrival one system call instead of two:
    /// measured as the difference between 1.05x and 0.96x Open MPI's 8 B latency).
    fn progress_ready(
        &mut self,
        fds: &[libc::pollfd],
        owners: &[usize],
        flush_replies: bool,
    ) -> bool {
        let mut any = false;
        for (fd, &p) in fds.iter().zip(owners) {
            let r = fd.revents;
            if r == 0 {
                continue;
            }
            let readable = r & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
            let writable = r & (libc::POLLOUT | libc::POLLERR) != 0;
            if self.is_shm(p) {
                any |= readable && self.ring_answered(p, flush_replies);
                continue;
            }
            any |= self.pump(p, readable, writable, flush_replies);
        }
        any | self.pump_shm(flush_replies)
    }

    fn is_shm(&self, p: usize) -> bool {
        self.shm_link(p).is_some()
    }

    /// The doorbell socket of shared-memory peer `p` is readable: drain it. If it closed, the
    /// peer is gone, but everything it wrote before closing is in the ring: take that first.
    /// Returns whether the peer was found dead.
    fn ring_answered(&mut self, p: usize, flush_replies: bool) -> bool {
        #[cfg(target_os = "linux")]
        if let Some(Some(peer)) = self.peers.get(p) {
            if let Err(reason) = shm::drain_doorbell(&peer.link.stream) {
                self.pump(p, true, false, flush_replies);
                self.mark_dead(p, reason);
                return true;
            }
        }
        let _ = (p, flush_replies);
        false
    }

    /// Moves every live shared-memory peer (a check of its rings costs no system call).
    fn pump_shm(&mut self, flush_replies: bool) -> bool {
        let mut any = false;
        for p in 0..self.peers.len() {
            if self.is_shm(p) {
                any |= self.pump(p, true, true, flush_replies);
            }
        }
        any
    }

    /// Before the progress thread sleeps: raises the sleep flags of every shared-memory link
    /// (so the peer rings the doorbell). Returns whether something is already waiting, in
    /// which case it must not sleep.
    fn prepare_sleep(&self) -> bool {
        let mut busy = false;
        #[cfg(target_os = "linux")]
        for peer in self.peers.iter().flatten().filter(|p| p.dead.is_none()) {
            if let Some(l) = &peer.link.shm {
                busy |= l.prepare_sleep(!peer.out.is_empty());
                // An answer to a lane send came (the peer rings only after the flag is up).
                busy |=
                    peer.lane_waits.iter().flatten().any(
                        |w| matches!(w, LaneWait::Op { seq, .. } if l.answered(*seq).is_some()),
                    );
            }
        }
        busy
    }

    /// After the progress thread woke: lowers the sleep flags.
    fn woke(&self) {
        #[cfg(target_os = "linux")]
        for peer in self.peers.iter().flatten() {
            if let Some(l) = &peer.link.shm {
                l.woke();
            }
        }
    }

    /// Writes, reads, and (with `flush_replies`) writes again what reading produced.
    fn pump(&mut self, p: usize, read: bool, write: bool, flush_replies: bool) -> bool {
        let live = matches!(self.peers.get(p), Some(Some(peer)) if peer.dead.is_none());
        if !live {
            return false;
        }
        self.poll_lane_acks(p);
        let r = (if write { self.pump_tx(p) } else { Ok(false) })
            .and_then(|a| Ok(a | (read && self.pump_lane(p)?)))
            .and_then(|a| Ok(a | (read && self.pump_rx(p)?)))
            .and_then(|a| Ok(a | (flush_replies && self.pump_tx(p)?)));
        r.unwrap_or_else(|reason| {
            self.mark_dead(p, reason);
            true
        })
    }

    fn abort_all(&mut self, reason: &str) {
        let rank = self.rank;
        self.closed = Some(reason.to_string());
        let aborted = |op| Error::Aborted {
            op,
            rank,
            reason: reason.to_string(),
        };
        for r in self.matcher.drain_posted() {
            r.cell.complete(Err(aborted(r.op)), None);
        }
        for r in self.rdv.drain() {
            r.cell.complete(Err(aborted(r.op)), None);
        }
        // Sends whose buffer a peer may be reading stay until it answers; the rest go.
        self.sends.retain(|_, s| {
            s.cell.complete(Err(aborted(s.op)), None);
            s.lent
        });
        // Lent buffers stay until the peer's Put (or death); their operations fail now.
        for l in self.lent.values() {
            l.r.cell.complete(Err(aborted(l.r.op)), None);
        }
        for peer in self.peers.iter_mut().flatten() {
            // Replies owed to peers (acks, clear-to-send, refusals) and a frame already half on
            // the wire still go out; only our own unsent messages are dropped.
            let mut first = peer.out_off > 0;
            peer.out
                .retain(|o| std::mem::take(&mut first) || o.send_id.is_none());
            if let Rx::Payload {
                target: Target::Recv(r),
                ..
            } = std::mem::replace(&mut peer.rx, Rx::Header)
            {
                r.cell.complete(Err(aborted(r.op)), None);
            }
        }
    }
}

/// poll(2) without waiting; returns the number of ready descriptors (0 on error).
fn poll_now(fds: &mut [libc::pollfd]) -> i32 {
    // SAFETY: `fds` is an exclusively borrowed slice of initialised pollfd structs whose length is
    // passed alongside; poll(2) only writes their `revents` fields.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) }
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

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poke(&self) {
        let _ = (&self.wake_tx).write(&[1]);
    }

    fn run_progress_thread(&self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut owners: Vec<usize> = Vec::new();
        let mut ends_seen = 0;
        let mut last_end = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            fds.clear();
            owners.clear();
            fds.push(libc::pollfd {
                fd: self.wake_rx.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            // Leave the sockets to waiters while they spin, and for a grace period after, so
            // that back-to-back waits do not have two threads fighting over each socket. The
            // grace counts from when this thread noticed that a spin ended (at most one poll
            // timeout late), so that waiters need not read the clock.
            let word = self.spinning.load(Ordering::Acquire);
            let now = Instant::now();
            if word / SPIN_ENDED != ends_seen {
                ends_seen = word / SPIN_ENDED;
                last_end = now;
            }
            let spinning = word & SPINNERS != 0
                || (!self.handoff.load(Ordering::Acquire)
                    && now.duration_since(last_end) < SPIN_GRACE);
            self.watching.store(!spinning, Ordering::Release);
            let mut busy = false;
            if !spinning {
                let st = self.lock();
                st.poll_set(&mut fds, &mut owners, true);
                busy = st.prepare_sleep();
            }
            let timeout_ms = match (busy, spinning) {
                (true, _) => 0,
                (false, true) => 1,
                (false, false) => 100,
            };
            // SAFETY: `fds` is a live, exclusively borrowed Vec of initialised pollfd structs and
            // its length is passed alongside; poll(2) only writes the `revents` fields.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if n > 0 && fds[0].revents != 0 {
                let mut sink = [0u8; 64];
                while matches!((&self.wake_rx).read(&mut sink), Ok(k) if k > 0) {}
            }
            if !spinning {
                let mut st = self.lock();
                st.woke();
                st.progress_ready(&fds[1..], &owners, true);
            }
        }
    }
}

/// The TCP progress engine of one process.
pub(crate) struct Engine {
    sh: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Takes over a connected mesh (`streams[rank]` is `None`) and starts the progress thread.
    /// `links[p]` is the shared-memory link to `p`, if it has one.
    pub(crate) fn start(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        links: Vec<Option<ShmLink>>,
        cfg: EngineConfig,
    ) -> Result<Arc<Engine>> {
        let mut peers = Vec::with_capacity(streams.len());
        let mut links = links.into_iter();
        for s in streams {
            let shm = links.next().flatten();
            peers.push(match s {
                None => None,
                Some(stream) => {
                    stream
                        .set_nonblocking(true)
                        .map_err(|e| Error::io("set socket nonblocking", e))?;
                    stream
                        .set_nodelay(true)
                        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
                    let shm_peer = shm.is_some();
                    let local = same_host(&stream) || shm_peer;
                    let sockbuf = cfg.sockbuf.unwrap_or(if local { LOCAL_SOCKBUF } else { 0 });
                    if sockbuf > 0 && shm.is_none() {
                        set_buffers(&stream, sockbuf)?;
                    }
                    Some(Peer {
                        link: Link { stream, shm },
                        out: VecDeque::new(),
                        out_off: 0,
                        rx: Rx::Header,
                        rxbuf: vec![0u8; RXBUF].into_boxed_slice(),
                        rx_start: 0,
                        rx_end: 0,
                        dead: None,
                        chunk: cfg.data_chunk.unwrap_or(if local {
                            LOCAL_DATA_CHUNK
                        } else {
                            DATA_CHUNK
                        }),
                        lane_waits: (0..if shm_peer { LANE_ACKS } else { 0 })
                            .map(|_| None)
                            .collect(),
                        lane_ops: 0,
                    })
                }
            });
        }
        let watch = peers
            .iter()
            .map(|p| p.as_ref()?.link.shm.as_ref().map(ShmLink::watch))
            .collect();
        let (wake_tx, wake_rx) =
            UnixStream::pair().map_err(|e| Error::io("create wake pipe", e))?;
        for s in [&wake_tx, &wake_rx] {
            s.set_nonblocking(true)
                .map_err(|e| Error::io("set wake pipe nonblocking", e))?;
        }
        let sh = Arc::new(Shared {
            rank,
            st: Mutex::new(State {
                rank,
                limits: Limits {
                    eager_max: cfg.eager_max,
                    shm_eager_max: cfg.shm_eager_max,
                },
                peers,
                matcher: Matcher::default(),
                sends: HashMap::default(),
                rdv: Reassembly::default(),
                lent: HashMap::new(),
                next_id: 0,
                closed: None,
                cancelled: Cancelled::default(),
            }),
            watch,
            wake_tx,
            wake_rx,
            spinning: AtomicU64::new(0),
            watching: AtomicBool::new(false),
            handoff: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            spin: cfg.spin,
            yield_spin: cfg.yield_spin,
        });
        let sh2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("distcomm-progress-{rank}"))
            .spawn(move || sh2.run_progress_thread())
            .map_err(|e| Error::io("spawn progress thread", e))?;
        Ok(Arc::new(Engine {
            sh,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Posts a send. The buffer is owned by the engine until the returned cell completes.
    pub(crate) fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize) -> (u64, Arc<OpCell>) {
        #[cfg(feature = "trace-messages")]
        trace_post("isend", self.sh.rank, Some(dst), &env, buf.bytes().len());
        let op = env.op;
        let cell = Arc::new(OpCell::default());
        let mut st = self.sh.lock();
        let id = st.alloc_id();
        let len = buf.bytes().len();
        let hdr = env.eager(id, len);
        let mut pending = env.pending(dst, len, cell.clone());
        if let Some(reason) = st.closed.clone() {
            let e = Error::Aborted {
                op,
                rank: self.sh.rank,
                reason,
            };
            cell.complete(Err(e), None);
            return (id, cell);
        }
        if dst == self.sh.rank {
            let data = buf.bytes().to_vec();
            pending.buf = Some(buf);
            st.sends.insert(id, pending);
            st.deliver_eager(dst, hdr, data);
            return (id, cell);
        }
        if let Some(reason) = st.dead_reason(dst) {
            cell.complete(Err(peer_lost(op, self.sh.rank, dst, &reason)), None);
            return (id, cell);
        }
        // A small message to a shared-memory peer goes through its lane when it may.
        if choice::lane_fits(len) {
            let waits = pending.waits_for_ack();
            let owner = if waits { Owner::Op(id) } else { Owner::Nobody };
            if st.lane_send(dst, &hdr, buf.bytes(), owner).is_some() {
                if waits {
                    pending.buf = Some(buf);
                    st.sends.insert(id, pending);
                } else {
                    cell.complete(Ok(pending.status(dst)), Some(buf));
                }
                return (id, cell);
            }
        }
        // A large message to a shared-memory peer is fetched by the receiver straight from our
        // buffer (never from a view of the caller's memory: the engine cannot stop a copy
        // under way in another process if the caller takes that memory back).
        let fetchable = !buf.is_view()
            && matches!(st.peers.get(dst), Some(Some(p)) if p.link.cma_pid().is_some());
        // Such a copy (by both sides at once) beats two copies through the ring from
        // `shm_eager_max` bytes on.
        let wire = st.limits.wire(len, fetchable);
        let out = if wire == Wire::Eager {
            let aux = if pending.waits_for_ack() {
                0
            } else {
                EAGER_NO_ACK
            };
            Out {
                hdr: Header { aux, ..hdr }.encode(),
                kind: Kind::Eager,
                payload: Some(buf),
                base: 0,
                plen: len,
                send_id: Some(id),
            }
        } else if wire == Wire::Fetch {
            let addr = buf.bytes().as_ptr() as u64;
            pending.buf = Some(buf);
            pending.lent = true;
            Out {
                hdr: Header {
                    kind: Kind::Rget,
                    ..hdr
                }
                .encode(),
                kind: Kind::Rget,
                payload: Some(Box::new(addr.to_le_bytes().to_vec())),
                base: 0,
                plen: RGET_PAYLOAD,
                send_id: Some(id),
            }
        } else {
            pending.buf = Some(buf);
            Out {
                hdr: Header {
                    kind: Kind::Rts,
                    ..hdr
                }
                .encode(),
                kind: Kind::Rts,
                payload: None,
                base: 0,
                plen: 0,
                send_id: Some(id),
            }
        };
        st.sends.insert(id, pending);
        st.push_out(dst, out);
        if let Err(reason) = st.pump_tx(dst) {
            st.mark_dead(dst, reason);
        }
        let backlog = matches!(st.peers.get(dst), Some(Some(p)) if !p.out.is_empty());
        drop(st);
        self.nudge(backlog);
        (id, cell)
    }

    /// Posts a receive from `src` (`None`: any source).
    pub(crate) fn irecv(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
    ) -> (u64, Arc<OpCell>) {
        #[cfg(feature = "trace-messages")]
        trace_post("irecv", self.sh.rank, src, &env, buf.bytes().len());
        let Envelope {
            op,
            dtype,
            ctx,
            tag,
            fp,
        } = env;
        let cell = Arc::new(OpCell::default());
        let mut st = self.sh.lock();
        let id = st.alloc_id();
        st.post_recv(Posted {
            id,
            op,
            src,
            ctx,
            tag,
            dtype,
            fp,
            buf,
            cell: cell.clone(),
        });
        let backlog = st.peers.iter().flatten().any(|p| !p.out.is_empty());
        drop(st);
        self.nudge(backlog);
        (id, cell)
    }

    /// After posting: if frames wait to be written and the progress thread sleeps on the
    /// sockets with an interest set that predates them, wake it so that it watches for
    /// writability. While waiters spin (or just spun) they write the backlog themselves, and a
    /// reply left queued there usually leaves together with the next message.
    fn nudge(&self, backlog: bool) {
        if backlog && self.sh.watching.load(Ordering::Acquire) {
            self.sh.poke();
        }
    }

    /// Tells `peers` (global ranks) that collective (`ctx`, `tag`) failed here, so that their
    /// operations of it fail too instead of waiting for us; refuses its later messages here.
    /// `lost`: the peer whose loss failed it, if that was the cause (the others name it then).
    pub(crate) fn cancel_collective(
        &self,
        env: Envelope,
        desync: bool,
        lost: Option<usize>,
        peers: &[usize],
    ) {
        let Envelope {
            dtype,
            ctx,
            tag,
            fp,
            ..
        } = env;
        let mut st = self.sh.lock();
        let by = self.sh.rank;
        st.cancelled.cancel(
            (ctx, tag),
            Cancel {
                by,
                fp,
                dtype,
                desync,
                lost,
            },
        );
        let hdr = Header {
            kind: Kind::Cancel,
            dtype,
            ctx,
            tag,
            aux: cancel_aux(desync, lost),
            msg_id: 0,
            len: 0,
            fp,
        };
        for &p in peers.iter().filter(|&&p| p != self.sh.rank) {
            st.push_out(
                p,
                Out {
                    hdr: hdr.encode(),
                    kind: Kind::Cancel,
                    payload: None,
                    base: 0,
                    plen: 0,
                    send_id: None,
                },
            );
            if let Err(reason) = st.pump_tx(p) {
                st.mark_dead(p, reason);
            }
        }
        let backlog = st.peers.iter().flatten().any(|p| !p.out.is_empty());
        drop(st);
        self.nudge(backlog);
    }

    /// Fails every pending operation and refuses new ones.
    pub(crate) fn abort(&self, reason: &str) {
        self.sh.lock().abort_all(reason);
        self.sh.poke();
    }

    /// Makes the engine let go of the buffers of operations `ids` (views of memory it does not
    /// own): queued or half-written sends get an owned copy of their data, receives not yet
    /// started are withdrawn, and receives under way continue into owned scratch memory (their
    /// data is discarded). Unfinished receives among them fail. Afterwards nothing in the engine
    /// points into the caller's memory.
    pub(crate) fn reclaim(&self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        let mut st = self.sh.lock();
        st.reclaim(ids);
    }

    /// Largest message sent without the receiver-ready handshake.
    pub(crate) fn eager_max(&self) -> usize {
        self.sh.lock().limits.eager_max
    }

    /// What carries messages to global rank `peer`.
    pub(crate) fn link_kind(&self, peer: usize) -> LinkKind {
        match self.sh.lock().peers.get(peer) {
            Some(Some(p)) if p.link.shm.is_some() => LinkKind::Shm,
            Some(Some(_)) => LinkKind::Tcp,
            _ => LinkKind::Loopback,
        }
    }

    /// Whether the connection to `peer` has failed, and why.
    pub(crate) fn peer_failure(&self, peer: usize) -> Option<String> {
        self.sh.lock().dead_reason(peer)
    }

    /// A blocking send of a small point-to-point message (`data`, at most `LANE_MAX` bytes)
    /// to shared-memory peer `dst` through its lane, the caller watching the answer word itself:
    /// no handle, no allocation, no acknowledgement frame. Declined (nothing sent) when the
    /// lane cannot take it now; handed to the engine when the answer is slow to come.
    pub(crate) fn send_small(&self, env: Envelope, data: &[u8], dst: usize) -> Fast {
        #[cfg(feature = "trace-messages")]
        trace_post("send (lane)", self.sh.rank, Some(dst), &env, data.len());
        let Some(Some(watch)) = self.sh.watch.get(dst) else {
            return Fast::Declined;
        };
        if !choice::lane_fits(data.len()) || refusal::scheduled(env.fp) {
            return Fast::Declined;
        }
        let h = env.eager(0, data.len());
        let sent = {
            let mut st = self.sh.lock();
            if st.closed.is_some() {
                None
            } else {
                st.lane_send(dst, &h, data, Owner::Caller)
            }
        };
        let Some(seq) = sent else {
            return Fast::Declined;
        };
        self.fast_wait(|| watch.answered(seq).is_some());
        if watch.answered(seq) == Some(true) {
            return Fast::Done(Ok(Status {
                peer: dst,
                tag: env.tag,
                bytes: data.len(),
            }));
        }
        self.sh.lock().adopt_lane_send(dst, seq, &env, data.len())
    }

    /// A blocking receive of a point-to-point message from shared-memory peer `src` straight
    /// from its lane into `out`, when nothing can come before it (see
    /// `State::recv_from_lane`) and it arrives within a short spin. `None`: nothing was
    /// received; the caller takes the general path.
    pub(crate) fn recv_small(
        &self,
        env: Envelope,
        out: &mut [u8],
        src: usize,
    ) -> Option<Result<Status>> {
        #[cfg(feature = "trace-messages")]
        trace_post("recv (lane)", self.sh.rank, Some(src), &env, out.len());
        let Some(Some(watch)) = self.sh.watch.get(src) else {
            return None;
        };
        let mut waited = false;
        loop {
            match self.sh.lock().recv_from_lane(src, &env, out) {
                LaneRecv::Got(r) => return Some(r),
                LaneRecv::Empty if !waited => {}
                LaneRecv::Empty | LaneRecv::Declined => return None,
            }
            // Ring bytes come first: the engine reads those.
            if watch.ring_incoming() || !self.fast_wait(|| watch.incoming()) {
                return None;
            }
            waited = true;
        }
    }

    /// Spins until `ready()` (yielding the core on every turn when ranks outnumber cores), at
    /// most [`FAST_SPIN`]; returns whether it became ready. Counts as a spinning waiter, so
    /// the progress thread keeps off the links meanwhile.
    fn fast_wait(&self, ready: impl Fn() -> bool) -> bool {
        if ready() {
            return true;
        }
        if self.sh.spin.is_zero() {
            return false;
        }
        self.spin_begin();
        let budget = self.sh.spin.min(FAST_SPIN);
        let mut start = None;
        let mut turns = 0u32;
        let ok = loop {
            if ready() {
                break true;
            }
            turns = turns.wrapping_add(1);
            if turns % 64 == 0 {
                let now = Instant::now();
                if now.duration_since(*start.get_or_insert(now)) >= budget {
                    break false;
                }
            }
            // Ranks with cores of their own poll without PAUSE: it takes tens of cycles on
            // recent cores, which the arrival of a small message would wait out (8 B half round
            // trip 0.259 -> 0.25 µs without it).
            if self.sh.yield_spin {
                std::thread::yield_now();
            }
        };
        self.spin_end(ok);
        ok
    }

    /// A waiter starts spinning: the progress thread keeps off the links until it ends.
    fn spin_begin(&self) {
        self.sh.spinning.fetch_add(SPINNER, Ordering::AcqRel);
        self.sh.handoff.store(false, Ordering::Release);
        if self.sh.watching.load(Ordering::Acquire) {
            // Get the progress thread off the sockets.
            self.sh.poke();
        }
    }

    /// A waiter stops spinning, `done` or about to sleep (then the progress thread must watch
    /// the links at once).
    fn spin_end(&self, done: bool) {
        if !done {
            self.sh.handoff.store(true, Ordering::Release);
        }
        // One step: one spinner fewer, one spin ended (for the progress thread's grace).
        let before = self
            .sh
            .spinning
            .fetch_add(SPIN_ENDED.wrapping_sub(SPINNER), Ordering::AcqRel);
        if before & SPINNERS == SPINNER && !done {
            self.sh.poke();
        }
    }
}

impl Engine {
    /// Spins (driving progress) while things move, then sleeps until the operation completes,
    /// is kicked, or the deadline passes. Returns whether it is done.
    fn spin_then_sleep(&self, cell: &OpCell, deadline: &mut Deadline) -> bool {
        if !self.sh.spin.is_zero() {
            self.spin_begin();
            // Spin while things move; sleep after `spin` without any progress.
            // Reading the clock costs as much as a turn of the loop: read it every few turns,
            // and note only whether anything moved in between. A wait that ends within the
            // first few turns never reads it.
            const CLOCK_EVERY: u32 = 32;
            let mut idle_since: Option<Instant> = None;
            let mut moved_since_clock = false;
            let mut turns = 0u32;
            let mut fds = Vec::new();
            let mut owners = Vec::new();
            loop {
                if cell.is_done() {
                    break;
                }
                if let Ok(mut st) = self.sh.st.try_lock() {
                    // One peer: read it directly (one system call when data arrives). Several:
                    // one poll(2) over all of them beats a read on each.
                    fds.clear();
                    owners.clear();
                    st.poll_set(&mut fds, &mut owners, false);
                    let moved = if fds.len() <= 1 {
                        st.progress(false)
                    } else if poll_now(&mut fds) > 0 {
                        st.progress_ready(&fds, &owners, false)
                    } else {
                        st.pump_shm(false)
                    };
                    moved_since_clock |= moved;
                }
                if cell.is_done() {
                    break;
                }
                turns = turns.wrapping_add(1);
                if !self.sh.yield_spin && turns % CLOCK_EVERY != 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let now = Instant::now();
                let deadline = deadline.from(now);
                if std::mem::take(&mut moved_since_clock) || idle_since.is_none() {
                    idle_since = Some(now);
                }
                let idle = idle_since.map_or(Duration::ZERO, |t| now.duration_since(t));
                // Once both sides are engaged in a large transfer, a pause is the TCP window
                // refilling, not an absent peer: sleeping there would halve the bandwidth.
                let budget = if cell.is_active() {
                    self.sh.spin.max(ACTIVE_SPIN)
                } else {
                    self.sh.spin
                };
                if now >= deadline || idle >= budget {
                    break;
                }
                if self.sh.yield_spin {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            self.spin_end(cell.is_done());
            if cell.is_done() {
                return true;
            }
        }
        block(cell, deadline.get())
    }
}

impl Driver for Engine {
    fn drive_until(&self, cell: &OpCell, deadline: &mut Deadline) -> bool {
        loop {
            if self.spin_then_sleep(cell, deadline) {
                return true;
            }
            if Instant::now() >= deadline.get() {
                return cell.is_done();
            }
        }
    }

    fn cancel(&self, op_id: u64) {
        let mut st = self.sh.lock();
        st.matcher.withdraw_posted(|r| r.id == op_id);
    }

    fn rank(&self) -> usize {
        self.sh.rank
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
        self.sh.poke();
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        let mut st = self.sh.lock();
        // Let queued frames (acks, last sends) go out, then close politely: half-close, and
        // drain until every peer has closed too, so that no unread data turns our close into a
        // reset that would destroy data the peer has not read yet.
        let linger = Instant::now() + Duration::from_secs(5);
        while Instant::now() < linger
            && (st
                .peers
                .iter()
                .flatten()
                .any(|p| p.dead.is_none() && !p.out.is_empty())
                || !st.lent.is_empty()
                || st.sends.values().any(|s| s.lent))
        {
            st.progress(true);
            std::thread::sleep(Duration::from_micros(200));
        }
        st.abort_all("process group shut down");
        // A peer that never answered may still copy from or into these buffers: leak them
        // rather than hand the memory back to the allocator.
        for (_, l) in st.lent.drain() {
            std::mem::forget(l.r.buf);
        }
        for (_, s) in st.sends.drain() {
            std::mem::forget(s.buf);
        }
        for peer in st.peers.iter_mut().flatten() {
            if peer.dead.is_some() {
                continue;
            }
            let stream = &mut peer.link.stream;
            let _ = stream.shutdown(Shutdown::Write);
            let _ = stream.set_nonblocking(false);
            let left = linger
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            let _ = stream.set_read_timeout(Some(left));
            let mut sink = [0u8; 4096];
            while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
        }
    }
}
