//! The TCP link: socket tuning for the mesh's connections, and non-blocking reads and writes
//! on them (would-block is nothing read or written, end of stream an error).
//!
//! The progress engine that drives these sockets (and shared-memory links) is `engine`; its
//! types are re-exported here so that the paths callers use (`transport::tcp::Engine`, ...)
//! stay.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use crate::error::{Error, Result};

pub(crate) use super::engine::{Engine, EngineConfig, Fast};

/// Reads what the socket has into `dst`: `Ok(0)` when nothing is there now, `Err` when the
/// connection is gone.
pub(crate) fn read(stream: &mut TcpStream, dst: &mut [u8]) -> std::result::Result<usize, String> {
    loop {
        match stream.read(dst) {
            Ok(0) => return Err("connection closed by peer".into()),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Writes what fits of `iov`; `Ok(0)` when nothing fits now.
pub(crate) fn write(
    stream: &mut TcpStream,
    iov: &[IoSlice<'_>],
) -> std::result::Result<usize, String> {
    loop {
        match stream.write_vectored(iov) {
            Ok(0) => return Err("connection closed while writing".into()),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Socket buffers towards a peer on the same host, sending and receiving (0: left to the
/// kernel's autotuning), when ranks do not outnumber cores ([`CROWDED_LOCAL_SOCKBUF`] when they
/// do). Loopback TCP is bound by memory copies, and a send buffer that holds a large message
/// whole, but no more than the sender's cache, keeps the data in cache between the sender's copy
/// in and the receiver's copy out. 128 KiB (the kernel doubles it) cut a 1 MiB message into four
/// writes, each waiting for the receiver to drain the last; 512 KiB takes it in one.
/// Measured on 2 ranks over TCP, 512 KiB against 128 KiB, new / old time: `distcomm bench p2p`
/// in 6 rounds of alternating builds, ping-pong 1 MiB 0.60-0.81x (118-154 against 191-197 µs),
/// 16 MiB 0.60-0.79x, 64 MiB 0.61-0.89x; the collectives (`scripts/ab.py`, 3 pairs) at 1 MiB /
/// 16 MiB, all_reduce 0.76x / 0.75x, broadcast 0.78x / 0.78x, reduce 0.72x / 0.83x, gather
/// 0.73x / 0.66x, all_to_all 0.83x / 0.84x, the others 0.81-0.93x; 8 B-64 KiB 0.97-1.02x.
/// In the same rounds 256 KiB and 384 KiB gave less at 1 MiB (142-149 µs), 768 KiB and 1 MiB
/// less at every size (171-186 µs at 1 MiB: the doubled buffer outgrows this machine's 1 MiB
/// of L2 cache per core), and autotuning (several MiB) 171-183 µs at 1 MiB, with 64 MiB
/// ping-pong no faster than 128 KiB.
///
/// The receive buffer stays autotuned: it starts small (`tcp_rmem`, 128 KiB), so a stream of
/// small messages that a receiver drains slower than it comes soon fills the window, and the
/// sender's later writes wait in its queue and leave together in one segment; a fixed 1 MiB
/// sent every message as its own segment, each woken and read on its own (world 4 reduce of
/// 8 B, alternating runs: 3.0-3.2 segments a call against 1.4-1.9, 11.5-14.0 µs against
/// 8.5-11.7). Large transfers were no slower (world 2 all_reduce 1 MiB and 16 MiB, world 4
/// all_gather, alternating runs), since autotuning grows the buffer as the stream needs.
/// Across a real network the bandwidth-delay product needs autotuning both ways, so remote
/// peers keep it.
pub const LOCAL_SOCKBUF: (usize, usize) = (512 * 1024, 0);

/// [`LOCAL_SOCKBUF`] when ranks outnumber cores: the send buffer stays at 128 KiB there. At
/// world 4 on 2 cores the larger one measured no better beyond the noise of four ranks taking
/// turns on two cores (`scripts/ab.py`, 5 pairs, 512 KiB against 128 KiB: broadcast 64 KiB
/// 1.33x (1.05-1.51), 16 MiB 0.76x (0.46-1.04), reduce and scatter 0.96-1.29x with spreads of
/// 0.3-2.0).
pub const CROWDED_LOCAL_SOCKBUF: (usize, usize) = (128 * 1024, 0);

pub(crate) fn same_host(stream: &TcpStream) -> bool {
    match (stream.peer_addr(), stream.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}

/// Sets the send and receive buffers of `stream` (bytes each; 0 leaves that one to the kernel).
pub(crate) fn set_buffers(stream: &TcpStream, (send, recv): (usize, usize)) -> Result<()> {
    for (opt, bytes) in [(libc::SO_SNDBUF, send), (libc::SO_RCVBUF, recv)] {
        if bytes == 0 {
            continue;
        }
        let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
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
