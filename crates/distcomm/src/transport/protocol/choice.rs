//! Which protocol a message takes, from its size and what its link can do (ob1's few lines
//! over a BTL's limits; UCX's selection by capability):
//!
//! * **lane** (shared-memory links): up to [`LANE_MAX`] bytes, in slots polled on the line the
//!   message arrives in, answered in an answer word; tried first, and the message falls back to
//!   the others when the lane cannot take it now;
//! * **eager**: up to the eager limit, inline, answered Ack (or Nack);
//! * **fetch** (links with cross-memory copies, from memory the engine owns): the receiver
//!   copies the message from the sender's buffer (Rget), and from [`SPLIT_MIN`] bytes asks the
//!   sender to write the head meanwhile (Rput/Put);
//! * **rendezvous**: Rts, the receiver's Cts once a receive matched, then Data chunks.
//!
//! Knows sizes and capabilities only: no link, no buffer, no frame.

pub(crate) use crate::transport::frame::LANE_MAX;

/// Messages at least this large are copied by both sides at once (Rput). Measured (2 ranks,
/// ping-pong): from 96 KiB to 1 MiB splitting took 0.55–0.63 of the time of one process
/// copying; at the smallest direct size (16–24 KiB) it still wins.
pub(crate) const SPLIT_MIN: usize = 16 << 10;

/// The engine's size limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Largest message sent inline.
    pub eager_max: usize,
    /// The same towards links with cross-memory copies (larger ones are fetched).
    pub shm_eager_max: usize,
}

/// How a message that does not take the lane travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    Eager,
    /// The receiver fetches it from our memory (Rget).
    Fetch,
    /// Rts, Cts, Data.
    Rendezvous,
}

/// Whether a message of `len` bytes may try the lane of a link that has one.
#[inline]
pub(crate) fn lane_fits(len: usize) -> bool {
    len <= LANE_MAX
}

impl Limits {
    /// The protocol of a message of `len` bytes; `fetchable`: the link allows cross-memory
    /// copies and the buffer is the engine's own (never a view of the caller's memory: a copy
    /// under way in another process cannot be stopped if the caller takes that memory back).
    #[inline]
    pub(crate) fn wire(&self, len: usize, fetchable: bool) -> Wire {
        let eager = if fetchable {
            self.shm_eager_max.min(self.eager_max)
        } else {
            self.eager_max
        };
        match (len <= eager, fetchable) {
            (true, _) => Wire::Eager,
            (false, true) => Wire::Fetch,
            (false, false) => Wire::Rendezvous,
        }
    }
}

/// How many bytes of a fetched message of `len` bytes the sender writes itself (the head,
/// a multiple of 64) while the receiver reads the rest: 0 below [`SPLIT_MIN`] or into memory
/// the engine does not own.
#[inline]
pub(crate) fn split(len: usize, own_memory: bool) -> usize {
    if len >= SPLIT_MIN && own_memory {
        (len / 2) & !63
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        eager_max: 64 << 10,
        shm_eager_max: 16 << 10,
    };

    #[test]
    fn size_and_capability_decide() {
        assert_eq!(L.wire(0, false), Wire::Eager);
        assert_eq!(L.wire(64 << 10, false), Wire::Eager);
        assert_eq!(L.wire((64 << 10) + 1, false), Wire::Rendezvous);
        // Towards a link with cross-memory copies the smaller limit applies.
        assert_eq!(L.wire(16 << 10, true), Wire::Eager);
        assert_eq!(L.wire((16 << 10) + 1, true), Wire::Fetch);
        // A smaller general limit wins over the shared-memory one.
        let small = Limits {
            eager_max: 1024,
            ..L
        };
        assert_eq!(small.wire(2048, true), Wire::Fetch);
        assert!(lane_fits(LANE_MAX) && !lane_fits(LANE_MAX + 1));
    }

    #[test]
    fn split_halves_large_own_buffers_on_cache_lines() {
        assert_eq!(split(SPLIT_MIN - 1, true), 0);
        assert_eq!(split(1 << 20, false), 0);
        let s = split(100_001, true);
        assert_eq!(s % 64, 0);
        assert!(s <= 50_000 && s > 50_000 - 64);
    }
}
