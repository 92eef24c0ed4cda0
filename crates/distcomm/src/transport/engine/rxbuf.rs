//! The receive buffer of a socket peer: where in its page reading starts, reading into it, and
//! when a large payload is read straight into its destination instead (the kernel's copy out
//! of socket pages is slow at some placements; see [`CopyRate`]).
//!
//! Owns the buffer's placement and the copy rates; knows nothing of frames.

use super::*;
use crate::copy::{index_at_page_offset, PAGE};

/// Where in its page a peer's receive buffer starts (see [`rx_base`]).
const RX_PAGE_OFFSET: usize = 2048;

/// A peer's receive buffer: [`RXBUF`] bytes from [`rx_base`].
pub(super) fn rx_buffer() -> (Box<[u8]>, usize) {
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
pub(super) fn rx_base(addr: usize) -> usize {
    index_at_page_offset(addr, RX_PAGE_OFFSET)
}

impl Peer {
    /// Reads into the receive buffer: from a socket as much as fits (one system call for many
    /// frames), from a shared-memory ring only the `want` bytes needed now (the rest is best
    /// copied straight to its destination).
    pub(super) fn fill(&mut self, want: usize) -> std::result::Result<Fill, String> {
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
        self.rx_end += r.bytes();
        if let Some(t) = t {
            self.copy.staged(r.bytes(), t.elapsed());
        }
        Ok(r)
    }

    /// Reads straight into `dst`, part of a payload's destination. From a socket the copy is
    /// timed, and one at under a third of the speed of reads into the receive buffer sends the
    /// rest of the payload through the buffer (see [`CopyRate`]).
    pub(super) fn read_direct(&mut self, dst: &mut [u8]) -> std::result::Result<Fill, String> {
        if self.link.shm.is_some() {
            return self.link.read(dst);
        }
        let t = Instant::now();
        let r = self.link.read(dst)?;
        if self.copy.slow(r.bytes(), t.elapsed()) {
            self.copy.bounce = true;
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
pub(super) struct CopyRate {
    /// Bytes per nanosecond of reads into the receive buffer (moving average; 0: none yet).
    staged: f64,
    /// The payload being read goes through the receive buffer from now on.
    bounce: bool,
}

impl CopyRate {
    /// Whether the rest of a payload of `total` bytes may be read straight into its
    /// destination.
    pub(super) fn direct(&self, total: usize) -> bool {
        !self.bounce || total > BOUNCE_MAX
    }

    /// The payload being read has all arrived: the next one starts reading directly again.
    pub(super) fn payload_done(&mut self) {
        self.bounce = false;
    }

    /// Notes a read of `n` bytes into the receive buffer that took `took`.
    fn staged(&mut self, n: usize, took: Duration) {
        if let Some(r) = copy_rate(n, took, COPY_PROBE) {
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
        copy_rate(n, took, COPY_PROBE).is_some_and(|r| self.staged > 0.0 && r < self.staged / 3.0)
    }
}

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
