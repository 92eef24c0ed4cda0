//! The arena's `broken` flag word: which rank broke the arena, why, and the peer that caused it,
//! so that the ranks still waiting there can name the cause (a leaf of `arena.rs`).

/// Why a rank broke the arena, as its flag word says: bit 0 set (broken), the reason in bits
/// 8–15, the rank that broke it + 1 in bits 16–39, the peer that caused it + 1 in bits 40–63
/// (global ranks). A word this version cannot read still means broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Broken {
    PeerLost { by: usize, peer: usize },
    Timeout { by: usize, peer: usize },
    Desync { by: usize, peer: usize },
    Other { by: usize },
}

impl Broken {
    const RANK_MASK: u64 = (1 << 24) - 1;

    /// The same word with every rank passed through `f` (global ranks to a group's).
    /// The rank that stopped the arena.
    pub(super) fn by(self) -> usize {
        match self {
            Broken::PeerLost { by, .. }
            | Broken::Timeout { by, .. }
            | Broken::Desync { by, .. }
            | Broken::Other { by } => by,
        }
    }

    pub(super) fn ranks(self, f: impl Fn(usize) -> usize) -> Broken {
        match self {
            Broken::PeerLost { by, peer } => Broken::PeerLost {
                by: f(by),
                peer: f(peer),
            },
            Broken::Timeout { by, peer } => Broken::Timeout {
                by: f(by),
                peer: f(peer),
            },
            Broken::Desync { by, peer } => Broken::Desync {
                by: f(by),
                peer: f(peer),
            },
            Broken::Other { by } => Broken::Other { by: f(by) },
        }
    }

    pub(super) fn encode(self) -> u64 {
        let (why, by, peer) = match self {
            Broken::PeerLost { by, peer } => (1, by, Some(peer)),
            Broken::Timeout { by, peer } => (2, by, Some(peer)),
            Broken::Desync { by, peer } => (3, by, Some(peer)),
            Broken::Other { by } => (4, by, None),
        };
        let field = |r: usize| (r as u64 + 1) & Self::RANK_MASK;
        1 | why << 8 | field(by) << 16 | peer.map_or(0, field) << 40
    }

    pub(super) fn decode(word: u64) -> Option<Broken> {
        let rank = |shift: u32| ((word >> shift) & Self::RANK_MASK).checked_sub(1);
        let by = rank(16)? as usize;
        let peer = rank(40).map(|p| p as usize);
        match ((word >> 8) & 0xff, peer) {
            (1, Some(peer)) => Some(Broken::PeerLost { by, peer }),
            (2, Some(peer)) => Some(Broken::Timeout { by, peer }),
            (3, Some(peer)) => Some(Broken::Desync { by, peer }),
            (4, None) => Some(Broken::Other { by }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Broken;

    #[test]
    fn the_broken_word_says_who_and_why() {
        for b in [
            Broken::PeerLost { by: 0, peer: 3 },
            Broken::Timeout { by: 7, peer: 0 },
            Broken::Desync { by: 2, peer: 1 },
            Broken::Other { by: 5 },
        ] {
            let w = b.encode();
            assert_eq!(w & 1, 1, "{b:?} must read as broken");
            assert_eq!(Broken::decode(w), Some(b));
        }
        // The old flag (1) and unknown reasons still mean broken, without a cause.
        assert_eq!(Broken::decode(1), None);
        assert_eq!(Broken::decode(1 | 9 << 8 | 1 << 16), None);
    }
}
