//! The kernel's copy into socket pages, timed: a large payload whose writes run at a fraction
//! of the best speed seen goes on through a bounce buffer placed half a page away from it.
//!
//! The kernel copies a write into its socket pages with `rep movsb`, which on AMD Zen 3 runs at
//! a fraction of its speed when the source lies a few bytes before the destination's offset
//! modulo 4 KiB (see `rxbuf` for the copy out, `shm::cma` for copies across processes). Where
//! those pages start depends on everything this thread wrote before, to any socket, so no
//! placement of a caller's buffer is safe; the bounce buffer shifts the source by half a page.
//! Measured over TCP, a torch tensor of 1 MiB sent and received by `dist.send`/`recv` from 80
//! bytes into its page: every write of it at 1.9-2.4 GB/s against 6.1-7.3 from 2048 bytes in;
//! per message 520-680 µs without the bounce buffer, 317-383 with it (2048 bytes in: 191-223).
//!
//! Owns: the write rates and a peer's bounce buffer. Knows nothing of frames.

use super::*;
use crate::copy::{index_at_page_offset, PAGE};

/// Writes of at least this many bytes time the kernel's copy. Smaller ones take as long in
/// the rest of the write (64 KiB: 1.6-3.0 GB/s from the bounce buffer, 1.6-1.9 from a badly
/// placed source).
const PROBE: usize = 128 << 10;
/// A write at under the best speed seen divided by this is slow.
const SLOW: f64 = 2.5;
/// The best speed seen fades by this factor with every timed write, so that it follows the
/// machine when it slows down (these machines change speed from minute to minute), slowly
/// enough to last from one probe to the next.
const FADE: f64 = 0.995;
/// One payload in this many goes through the bounce buffer from its start (see
/// [`TxRate::probe`]).
const PROBE_EVERY: u64 = 16;
/// The bounce buffer takes a payload on in pieces this large: still in cache when the kernel
/// copies them, and what it holds per peer.
const PIECE: usize = 256 << 10;

/// The speed of the kernel's copy into socket pages, learned from large writes (one per engine:
/// it belongs to the machine, not to a peer).
pub(super) struct TxRate {
    /// Bytes per nanosecond, the best seen lately (0: none yet).
    best: f64,
    /// Payloads timed so far.
    payloads: u64,
    /// Nothing is timed: ranks outnumber cores, and a write preempted halfway would look slow
    /// (world 4 on 2 cores, timed: gather 256 KiB 1.18x, all_to_all 16 MiB 1.16x the time).
    off: bool,
}

impl TxRate {
    /// Writes are timed unless `off`.
    pub(super) fn new(off: bool) -> Self {
        TxRate {
            best: 0.0,
            payloads: 0,
            off,
        }
    }

    /// Whether writes of a message of `len` bytes are timed.
    pub(super) fn times(&self, len: usize) -> bool {
        !self.off && (PROBE..=TIMED_MAX).contains(&len)
    }

    /// Whether the payload about to be written goes through the bounce buffer whole, to learn
    /// what a well-placed write takes: the first of all and one in
    /// [`PROBE_EVERY`] (a process whose every payload lies badly would otherwise never see a
    /// better speed).
    pub(super) fn probe(&mut self) -> bool {
        let probe = self.best == 0.0 || self.payloads % PROBE_EVERY == 0;
        self.payloads += 1;
        probe
    }

    /// Notes a write of `n` bytes of one payload that took `took`, from the bounce buffer or
    /// not; returns whether it was slow: the rest of the payload should go on through the
    /// bounce buffer.
    pub(super) fn slow(&mut self, n: usize, took: Duration, bounced: bool) -> bool {
        let Some(r) = copy_rate(n, took, PROBE) else {
            return false;
        };
        let slow = !bounced && r < self.best / SLOW;
        self.best = r.max(self.best * FADE);
        slow
    }
}

/// Payloads up to this size are timed; larger ones lie in memory, not cache, where copying
/// them once more costs more than a slow kernel copy (broadcast over TCP, world 2, with them:
/// 16 MiB 1.52x, 64 MiB 1.72x the time).
const TIMED_MAX: usize = 4 << 20;

/// A socket peer's bounce buffer: bytes `from..to` of the payload of frame `key` (its send and
/// where the frame starts in the message), copied to `buf[base..]`.
#[derive(Default)]
pub(super) struct TxBounce {
    key: Option<(u64, usize)>,
    buf: Vec<u8>,
    base: usize,
    from: usize,
    to: usize,
}

impl TxBounce {
    /// The rest of frame `key`'s payload goes through the bounce buffer.
    pub(super) fn start(&mut self, key: (u64, usize)) {
        self.key = Some(key);
        (self.from, self.to) = (0, 0);
    }

    /// What to write of `payload`, frame `key`'s, from byte `pos` on: the payload itself, or
    /// once a write of it was slow, the bounce buffer's piece (copied now when `pos` is past the
    /// last one). Returns the bytes and whether they end before the payload does.
    pub(super) fn next<'a>(
        &'a mut self,
        key: (u64, usize),
        payload: &'a [u8],
        pos: usize,
    ) -> (&'a [u8], bool) {
        if self.key != Some(key) {
            return (&payload[pos..], false);
        }
        if !(self.from..self.to).contains(&pos) {
            let to = (pos + PIECE).min(payload.len());
            if self.buf.is_empty() {
                self.buf = vec![0; PIECE + PAGE];
            }
            let src = &payload[pos..to];
            let at = (src.as_ptr() as usize + PAGE / 2) % PAGE;
            self.base = index_at_page_offset(self.buf.as_ptr() as usize, at);
            crate::copy::copy_bytes(&mut self.buf[self.base..self.base + src.len()], src);
            (self.from, self.to) = (pos, to);
        }
        let piece = &self.buf[self.base + pos - self.from..self.base + self.to - self.from];
        (piece, self.to < payload.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_at_under_the_best_speed_over_two_and_a_half_is_slow() {
        let mut r = TxRate::new(false);
        assert!(r.times(PROBE) && r.times(TIMED_MAX) && !r.times(TIMED_MAX + 1));
        assert!(!TxRate::new(true).times(PROBE));
        let us = Duration::from_micros;
        // The first payload of all is a probe, and one in PROBE_EVERY after it.
        assert!(r.probe());
        // A write from the bounce buffer is never slow; it sets the speed to expect.
        assert!(!r.slow(256 << 10, us(40), true));
        assert!((1..PROBE_EVERY).all(|_| !r.probe()));
        assert!(r.probe());
        assert!(r.slow(256 << 10, us(120), false));
        assert!(!r.slow(256 << 10, us(48), false));
        // Small writes are not timed.
        assert!(!r.slow(PROBE - 1, us(1000), false));
    }

    #[test]
    fn the_bounce_buffer_holds_the_payload_half_a_page_from_it_piece_by_piece() {
        let payload: Vec<u8> = (0..PIECE * 2 + 100).map(|i| (i % 251) as u8).collect();
        let mut b = TxBounce::default();
        // Another frame's payload goes straight.
        let (bytes, early) = b.next((1, 0), &payload, 10);
        assert_eq!((bytes.as_ptr(), early), (payload[10..].as_ptr(), false));
        b.start((1, 0));
        let mut pos = 10;
        let mut pieces = 0;
        loop {
            let (bytes, early) = b.next((1, 0), &payload, pos);
            assert_eq!(bytes, &payload[pos..pos + bytes.len()]);
            let shift =
                (bytes.as_ptr() as usize).wrapping_sub(payload[pos..].as_ptr() as usize) % PAGE;
            assert_eq!(shift, PAGE / 2);
            let (len, first) = (bytes.len(), bytes.as_ptr());
            pieces += 1;
            // A short write: the rest of the piece comes from the buffer again.
            let (again, _) = b.next((1, 0), &payload, pos + 7);
            assert_eq!(
                (again.as_ptr(), again.len()),
                (first.wrapping_add(7), len - 7)
            );
            pos += len;
            if !early {
                break;
            }
        }
        assert_eq!((pos, pieces), (payload.len(), 3));
        // Another frame: straight again.
        let (bytes, _) = b.next((2, 0), &payload, 0);
        assert_eq!(bytes.as_ptr(), payload.as_ptr());
    }
}
