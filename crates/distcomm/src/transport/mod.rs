//! Transports: how bytes move between two ranks. They know nothing of collectives or of the API
//! above them.
//!
//! * `frame`: the bounded wire header shared by the native transports (wire internals, not
//!   public API: the fuzz targets reach it through `distcomm::__fuzz`, feature `fuzzing`);
//! * `protocol`: the sans-I/O core (matching, protocol choice, refusals, reassembly,
//!   cancellation by key), unit-tested in one process;
//! * `engine`: the progress engine that carries out the core's decisions over the links, and
//!   its poll loop (`engine::progress`);
//! * `link`: the byte stream to one peer, `tcp` (socket) or `shm` (rings and lane beside it);
//! * `shm` (Linux): shared-memory links between ranks on one host, chosen automatically
//!   ([`TransportKind`]);
//! * `connect_mesh`: establishing the mesh through the rendezvous store, with the versioned,
//!   authenticated `handshake` checked before any user buffer is touched.

pub(crate) mod engine;
pub(crate) mod frame;
pub(crate) mod handshake;
pub(crate) mod link;
pub(crate) mod protocol;
#[cfg(target_os = "linux")]
pub(crate) mod shm;
pub(crate) mod tcp;

#[cfg(target_os = "linux")]
pub(crate) use shm::ShmLink;

#[cfg(target_os = "linux")]
pub(crate) use shm::ShmWatch;

/// Stand-in for the shared-memory link where the platform has none (it has no values: the
/// engine's calls on it are never made).
#[cfg(not(target_os = "linux"))]
pub(crate) enum ShmLink {}

#[cfg(not(target_os = "linux"))]
#[allow(clippy::unused_self)]
impl ShmLink {
    pub fn watch(&self) -> ShmWatch {
        match *self {}
    }
    pub fn answered(&self, _seq: u64) -> Option<bool> {
        match *self {}
    }
    pub fn next_lane_seq(&self) -> u64 {
        match *self {}
    }
    pub fn lane_send(
        &self,
        _head: &[u8; frame::LANE_HEAD],
        _payload: &[u8],
        _offer: Option<LaneKey>,
    ) -> std::io::Result<Option<LaneSent>> {
        match *self {}
    }
    pub fn lane_post(&self, _k: LaneKey, _cap: usize, _owner: u64) -> bool {
        match *self {}
    }
    pub fn lane_withdraw(&self, _owner: u64, _disown: bool) -> bool {
        match *self {}
    }
    pub fn lane_held(&self) -> Option<u64> {
        match *self {}
    }
    pub fn lane_peek(
        &self,
        _head: &mut [u8; frame::LANE_HEAD],
    ) -> std::io::Result<Option<LaneMsg>> {
        match *self {}
    }
    pub fn lane_copy(&self, _m: LaneMsg, _dst: &mut [u8]) {
        match *self {}
    }
    pub fn lane_release(&self, _m: LaneMsg, _answer: Option<bool>) -> bool {
        match *self {}
    }
    pub fn lane_answer(&self, _seq: u64, _refused: bool) -> bool {
        match *self {}
    }
}

/// A lane message found by `ShmLink::lane_peek`: its slot's sequence number (its id
/// for the answer), its length, and whether a receive posted for it accepted it already (its
/// sender waits for no answer; 16 bytes in all: 24 cost 10-20 % of an 8-512 B ping-pong).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneMsg {
    pub seq: u64,
    pub len: u32,
    pub pre: bool,
}

/// The key (context in the low half, tag in the high one) and element type of a
/// point-to-point message, or of what a posted receive takes (`dtype` 0: any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneKey {
    pub key: u64,
    pub dtype: u8,
}

/// What `ShmLink::lane_send` did: the message's sequence number, whether the consumer sleeps
/// and needs a doorbell, and whether a posted receive accepted it already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneSent {
    pub seq: u64,
    pub ring: bool,
    pub pre: bool,
}

/// Stand-in for [`ShmLink`]'s watcher where the platform has no shared memory.
#[cfg(not(target_os = "linux"))]
pub(crate) enum ShmWatch {}

#[cfg(not(target_os = "linux"))]
impl ShmWatch {
    pub fn answered(&self, _seq: u64) -> Option<bool> {
        match *self {}
    }
    pub fn incoming(&self) -> bool {
        match *self {}
    }
    pub fn ring_incoming(&self) -> bool {
        match *self {}
    }
}

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

use crate::device::Memory;
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use handshake::{Hello, HELLO_LEN, TOKEN_LEN};

pub use crate::config::TransportKind;
/// Largest message a shared-memory peer's lane carries (blocking sends up to it take the lane).
pub use frame::LANE_MAX;
pub(crate) use protocol::cancel::{CancelNote, CancelledOp};

/// What carries the bytes towards one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkKind {
    /// A TCP connection.
    Tcp,
    /// Shared-memory rings and lane (beside a TCP connection for wake-ups and failures).
    Shm,
    /// This process itself: no link.
    Loopback,
}

impl LinkKind {
    /// The name the API reports (`"tcp"`, `"shm"`, `"self"`).
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::Tcp => "tcp",
            LinkKind::Shm => "shm",
            LinkKind::Loopback => "self",
        }
    }

    /// Whether this link moves bytes of memory `mem` itself. Every native link copies through
    /// this process's address space — socket I/O, shared-memory rings, cross-memory attach — so
    /// each addresses host memory only; everything else is staged.
    pub fn addresses(self, mem: Memory) -> bool {
        mem == Memory::Host
    }
}

/// Settings of the shared-memory links.
#[derive(Debug, Clone)]
pub(crate) struct ShmConfig {
    pub kind: TransportKind,
    /// Ring capacity per direction (rounded up to a power of two).
    pub ring: usize,
    /// Whether large messages may use cross-memory attach.
    pub cma: bool,
}

/// Default ring capacity per direction of a shared-memory link.
pub(crate) const DEFAULT_RING: usize = 1 << 20;

/// Decides with every peer whether its link uses shared memory, and sets those links up
/// (on the authenticated, still blocking streams). `None` entries use TCP.
pub(crate) fn setup_shm(
    streams: &[Option<TcpStream>],
    rank: usize,
    cfg: &ShmConfig,
    deadline: Instant,
) -> Result<Vec<Option<ShmLink>>> {
    #[cfg(target_os = "linux")]
    {
        shm::setup(streams, rank, cfg, deadline)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (rank, deadline);
        if cfg.kind == TransportKind::Shm && streams.len() > 1 {
            return Err(Error::Config(
                "DISTCOMM_TRANSPORT=shm: the shared-memory transport is only available on Linux"
                    .into(),
            ));
        }
        Ok(streams.iter().map(|_| None).collect())
    }
}

/// The address other ranks should use to reach this host: `DISTCOMM_HOST` if set, loopback when
/// the master is on loopback, otherwise the local interface that routes to the master.
pub fn advertise_ip(master: &str) -> Result<IpAddr> {
    advertise_ip_or(master, crate::config::Reader::env().host()?)
}

/// [`advertise_ip`] with `DISTCOMM_HOST` already read (`host`).
pub(crate) fn advertise_ip_or(master: &str, host: Option<IpAddr>) -> Result<IpAddr> {
    if let Some(ip) = host {
        return Ok(ip);
    }
    let target = (master, 9)
        .to_socket_addrs()
        .map_err(|e| Error::io(format!("resolve master address {master}"), e))?
        .next()
        .ok_or_else(|| Error::Config(format!("master address {master} did not resolve")))?;
    if target.ip().is_loopback() {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    let bind: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0"
            .parse()
            .map_err(|_| Error::Config("bad bind".into()))?
    } else {
        "[::]:0"
            .parse()
            .map_err(|_| Error::Config("bad bind".into()))?
    };
    let probe = UdpSocket::bind(bind).map_err(|e| Error::io("probe local address", e))?;
    probe
        .connect(target)
        .map_err(|e| Error::io(format!("route to master {master}"), e))?;
    Ok(probe
        .local_addr()
        .map_err(|e| Error::io("probe local address", e))?
        .ip())
}

/// Connects every pair of ranks: each rank listens, publishes its address in `store`,
/// connects to every lower rank and accepts every higher one, running the [`handshake`] on each
/// connection (with `secret`, mutual HMAC authentication). Returns one stream per peer (`None`
/// at our own rank). Connections that fail the handshake are refused, logged and closed; the
/// ranks still missing then time out with an error naming them.
pub(crate) fn connect_mesh(
    store: &dyn Store,
    rank: usize,
    world: usize,
    ip: IpAddr,
    timeout: Duration,
    secret: Option<&[u8]>,
) -> Result<Vec<Option<TcpStream>>> {
    let deadline = Instant::now() + timeout;
    let listener =
        TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("listen on {ip}"), e))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("listener address", e))?;
    store.set(&format!("tcp/addr/{rank}"), local.to_string().as_bytes())?;
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();

    for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
        let raw = store.get(&format!("tcp/addr/{peer}"))?;
        let text = String::from_utf8_lossy(&raw).to_string();
        let addr: SocketAddr = text.parse().map_err(|_| Error::Protocol {
            rank,
            peer,
            detail: format!("published address {text:?} is not host:port"),
        })?;
        let s = connect_retry(addr, deadline).map_err(|e| Error::PeerLost {
            op: "connect",
            rank,
            peer,
            reason: e.to_string(),
        })?;
        *slot = Some(handshake_connect(s, rank, world, peer, secret, deadline)?);
    }

    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("listener nonblocking", e))?;
    let mut missing = world - rank - 1;
    while missing > 0 {
        let (s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<usize> = (rank + 1..world)
                        .filter(|&p| streams[p].is_none())
                        .collect();
                    return Err(Error::Timeout {
                        op: "connect mesh",
                        rank,
                        peer: waiting.first().copied(),
                        after: timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(Error::io("accept", e)),
        };
        match handshake_accept(s, rank, world, &streams, secret, deadline) {
            Ok((r, s)) => {
                streams[r] = Some(s);
                missing -= 1;
            }
            Err(why) => crate::diag::always!(
                WARN,
                target: "distcomm::net",
                "rank {rank}: refused connection from {from}: {why}"
            ),
        }
    }
    Ok(streams)
}

fn handshake_connect(
    mut s: TcpStream,
    rank: usize,
    world: usize,
    peer: usize,
    secret: Option<&[u8]>,
    deadline: Instant,
) -> Result<TcpStream> {
    let lost = |e: std::io::Error| Error::PeerLost {
        op: "handshake",
        rank,
        peer,
        reason: format!("{e} (a peer that refuses our credentials closes the connection)"),
    };
    let auth = |detail: String| Error::Auth { rank, peer, detail };
    s.set_read_timeout(Some(remaining(deadline)))
        .map_err(lost)?;
    let me = Hello {
        rank,
        world,
        auth: secret.is_some(),
        nonce: handshake::nonce().map_err(auth)?,
    };
    s.write_all(&me.encode()).map_err(lost)?;
    let mut buf = [0u8; HELLO_LEN];
    s.read_exact(&mut buf).map_err(lost)?;
    let theirs =
        Hello::decode(&buf, world).map_err(|detail| Error::Protocol { rank, peer, detail })?;
    if theirs.rank != peer {
        return Err(Error::Protocol {
            rank,
            peer,
            detail: format!("address of rank {peer} answered as rank {}", theirs.rank),
        });
    }
    handshake::auth_agrees(me.auth, theirs.auth).map_err(auth)?;
    let mut mac_a = [0u8; TOKEN_LEN];
    s.read_exact(&mut mac_a).map_err(lost)?;
    if !handshake::verify(secret, b'A', &theirs, &me, &mac_a) {
        return Err(auth(
            "it could not prove the job secret (wrong DISTCOMM_SECRET?)".into(),
        ));
    }
    s.write_all(&handshake::mac(secret, b'C', &theirs, &me))
        .map_err(lost)?;
    let mut ok = [0u8; 1];
    s.read_exact(&mut ok).map_err(lost)?;
    if ok[0] != 1 {
        return Err(auth("it refused our credentials".into()));
    }
    Ok(s)
}

/// Runs the acceptor's side; returns the peer's rank and the stream, or why it was refused.
fn handshake_accept(
    mut s: TcpStream,
    rank: usize,
    world: usize,
    streams: &[Option<TcpStream>],
    secret: Option<&[u8]>,
    deadline: Instant,
) -> std::result::Result<(usize, TcpStream), String> {
    let io = |e: std::io::Error| e.to_string();
    s.set_nonblocking(false).map_err(io)?;
    s.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(10))))
        .map_err(io)?;
    let mut buf = [0u8; HELLO_LEN];
    s.read_exact(&mut buf)
        .map_err(|e| format!("no hello: {e}"))?;
    let theirs = Hello::decode(&buf, world)?;
    if theirs.rank <= rank || streams[theirs.rank].is_some() {
        return Err(format!(
            "unexpected connection claiming rank {}",
            theirs.rank
        ));
    }
    let me = Hello {
        rank,
        world,
        auth: secret.is_some(),
        nonce: handshake::nonce()?,
    };
    s.write_all(&me.encode()).map_err(io)?;
    handshake::auth_agrees(me.auth, theirs.auth)?;
    s.write_all(&handshake::mac(secret, b'A', &me, &theirs))
        .map_err(io)?;
    let mut mac_c = [0u8; TOKEN_LEN];
    s.read_exact(&mut mac_c).map_err(|e| {
        format!(
            "rank {} left the handshake without proving the job secret; it did not accept ours \
             (different DISTCOMM_SECRET?): {e}",
            theirs.rank
        )
    })?;
    if !handshake::verify(secret, b'C', &me, &theirs, &mac_c) {
        return Err(format!(
            "rank {} could not prove the job secret (wrong DISTCOMM_SECRET?)",
            theirs.rank
        ));
    }
    s.write_all(&[1]).map_err(io)?;
    Ok((theirs.rank, s))
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn connect_retry(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    let mut backoff = Duration::from_millis(1);
    loop {
        match TcpStream::connect_timeout(&addr, remaining(deadline)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
        }
    }
}
