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

/// Socket buffers towards a peer on the same host, sending and receiving. Loopback TCP is
/// bound by memory copies, and a small send buffer keeps the data in cache between the sender's
/// copy in and the receiver's copy out: measured here, 64 MiB ping-pong went from ~2.9 GB/s
/// (autotuned, several MiB) to ~4 GB/s with 128 KiB both ways. A receive buffer of 1 MiB lets
/// both directions of an exchange stream at once (world 2 all_reduce over TCP, alternating
/// runs: 1 MiB 373-472 µs against 506-591 with 128 KiB, 16 MiB 6.1-7.0 ms against 11.1-11.5;
/// 1 MiB ping-pong unchanged, 180-240 µs). Across a real network the bandwidth-delay product
/// needs autotuning, so remote peers keep it.
pub const LOCAL_SOCKBUF: (usize, usize) = (128 * 1024, 1024 * 1024);

pub(crate) fn same_host(stream: &TcpStream) -> bool {
    match (stream.peer_addr(), stream.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}

/// Sets the send and receive buffers of `stream` (bytes each).
pub(crate) fn set_buffers(stream: &TcpStream, (send, recv): (usize, usize)) -> Result<()> {
    for (opt, bytes) in [(libc::SO_SNDBUF, send), (libc::SO_RCVBUF, recv)] {
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
