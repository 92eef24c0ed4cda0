//! The byte stream to one peer: a TCP socket, or a shared-memory link (rings and lane, `shm`)
//! beside it (then the socket only carries doorbells and reports the peer's death). Reads and
//! writes are non-blocking: would-block is reported as nothing read or written.
//!
//! Knows bytes only: no frame, no message.

use std::io::IoSlice;
use std::net::TcpStream;

#[cfg(target_os = "linux")]
use super::shm;
use super::ShmLink;

/// The byte stream to a peer: its socket, or a shared-memory link beside it (then the socket
/// only carries doorbells and reports the peer's death).
pub(crate) struct Link {
    pub(crate) stream: TcpStream,
    pub(crate) shm: Option<ShmLink>,
}

impl Link {
    /// Reads into `dst`; `Err` means the link is gone.
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> std::result::Result<Fill, String> {
        #[cfg(target_os = "linux")]
        if let Some(l) = &self.shm {
            let (n, ring) = l.read(dst).map_err(|e| e.to_string())?;
            if ring {
                shm::ring_doorbell(&self.stream);
            }
            return Ok(if n == 0 { Fill::Empty } else { Fill::Got(n) });
        }
        Ok(match super::tcp::read(&mut self.stream, dst)? {
            0 => Fill::Empty,
            n if n < dst.len() => Fill::Drained(n),
            n => Fill::Got(n),
        })
    }

    /// Writes what fits of `iov`; `Ok(0)` when nothing fits now.
    pub(crate) fn write(&mut self, iov: &[IoSlice<'_>]) -> std::result::Result<usize, String> {
        #[cfg(target_os = "linux")]
        if let Some(l) = &self.shm {
            let (n, ring) = l.write(iov).map_err(|e| e.to_string())?;
            if ring {
                shm::ring_doorbell(&self.stream);
            }
            return Ok(n);
        }
        super::tcp::write(&mut self.stream, iov)
    }

    /// Rings the shared-memory peer's doorbell (it sleeps and we published something).
    pub(crate) fn ring(&self) {
        #[cfg(target_os = "linux")]
        shm::ring_doorbell(&self.stream);
    }

    /// The peer's process id where a direct (cross-memory) copy from it is allowed.
    pub(crate) fn cma_pid(&self) -> Option<i32> {
        #[cfg(target_os = "linux")]
        if let Some(l) = self.shm.as_ref().filter(|l| l.cma) {
            return Some(l.pid);
        }
        None
    }

    pub(crate) fn no_more_cma(&mut self) {
        #[cfg(target_os = "linux")]
        if let Some(l) = &mut self.shm {
            l.cma = false;
        }
    }
}

pub(crate) enum Fill {
    Got(usize),
    /// Fewer bytes than asked from a socket: it held no more, and another read now would
    /// most likely find it empty (a system call for nothing; poll(2) says when more came).
    Drained(usize),
    Empty,
}

impl Fill {
    /// Bytes read.
    pub(crate) fn bytes(&self) -> usize {
        match *self {
            Fill::Got(n) | Fill::Drained(n) => n,
            Fill::Empty => 0,
        }
    }
}
