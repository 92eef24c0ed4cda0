//! Reassembly of large messages: a receive cleared to send (Cts, or a fetch that fell back to
//! streaming) waits for its message's Data chunks, each announced with its length, until the
//! length the sender announced has arrived.
//!
//! Owns the cleared receives by (source, message id) and the bounds checks of chunks; knows
//! nothing of where chunk bytes come from or of the receive's buffer.

use std::collections::HashMap;

/// Receives cleared to send, by (source, message id).
pub(crate) struct Reassembly<R> {
    cleared: HashMap<(usize, u64), Cleared<R>>,
}

struct Cleared<R> {
    r: R,
    /// The length the sender announced.
    whole: u64,
    /// How much has arrived.
    done: u64,
}

/// Where an arriving chunk goes.
pub(crate) enum Chunk<R> {
    /// Into `r` at `base`, of a message of `whole` bytes; hand `r` back with
    /// [`Reassembly::chunk_done`] once the chunk's bytes are in.
    Into { r: R, base: usize, whole: u64 },
    /// The chunk does not fit what was announced (a protocol violation): `r` fails.
    Overflow { r: R, detail: String },
    /// No receive waits for this message (a protocol violation).
    Unknown,
}

impl<R> Default for Reassembly<R> {
    fn default() -> Self {
        Reassembly {
            cleared: HashMap::new(),
        }
    }
}

impl<R> Reassembly<R> {
    /// `r` was cleared to receive message `msg` of `whole` bytes from `src`.
    pub(crate) fn expect(&mut self, src: usize, msg: u64, r: R, whole: u64) {
        self.cleared
            .insert((src, msg), Cleared { r, whole, done: 0 });
    }

    /// A chunk of `len` bytes of message `msg` from `src` arrives.
    pub(crate) fn chunk(&mut self, src: usize, msg: u64, len: u64) -> Chunk<R> {
        match self.cleared.remove(&(src, msg)) {
            Some(c) if len > 0 && c.done + len <= c.whole => Chunk::Into {
                r: c.r,
                base: c.done as usize,
                whole: c.whole,
            },
            Some(c) => Chunk::Overflow {
                detail: format!(
                    "{len} bytes of data after {} of the {} announced",
                    c.done, c.whole
                ),
                r: c.r,
            },
            None => Chunk::Unknown,
        }
    }

    /// The chunk `base..base + len` of message `msg` from `src` is in `r`: the receive back
    /// when the message is complete, otherwise `None` (it waits for the next chunk).
    pub(crate) fn chunk_done(
        &mut self,
        src: usize,
        msg: u64,
        r: R,
        (base, len, whole): (usize, u64, u64),
    ) -> Option<R> {
        let done = base as u64 + len;
        if done < whole {
            self.cleared.insert((src, msg), Cleared { r, whole, done });
            None
        } else {
            Some(r)
        }
    }

    /// Takes out every receive waiting for data from `src` (its loss).
    pub(crate) fn withdraw_source(&mut self, src: usize) -> Vec<R> {
        let keys: Vec<_> = self
            .cleared
            .keys()
            .filter(|k| k.0 == src)
            .copied()
            .collect();
        keys.into_iter()
            .filter_map(|k| self.cleared.remove(&k).map(|c| c.r))
            .collect()
    }

    /// Takes out every waiting receive.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = R> + '_ {
        self.cleared.drain().map(|(_, c)| c.r)
    }

    /// Every waiting receive.
    pub(crate) fn receives(&self) -> impl Iterator<Item = &R> {
        self.cleared.values().map(|c| &c.r)
    }

    /// Every waiting receive, to change.
    pub(crate) fn receives_mut(&mut self) -> impl Iterator<Item = &mut R> {
        self.cleared.values_mut().map(|c| &mut c.r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn chunks_fill_the_announced_length_in_order() {
        let mut re = Reassembly::default();
        re.expect(1, 9, "r", 10);
        let mut at = Vec::new();
        for len in [4, 4, 2] {
            let Chunk::Into { r, base, whole } = re.chunk(1, 9, len) else {
                panic!("chunk refused")
            };
            at.push(base);
            let back = re.chunk_done(1, 9, r, (base, len, whole));
            assert_eq!(back.is_some(), at.len() == 3);
        }
        assert_eq!(at, [0, 4, 8]);
        assert!(matches!(re.chunk(1, 9, 1), Chunk::Unknown));
    }

    #[test]
    fn overflow_and_empty_chunks_are_violations() {
        let mut re = Reassembly::default();
        re.expect(0, 1, "r", 8);
        let Chunk::Overflow { detail, .. } = re.chunk(0, 1, 9) else {
            panic!("accepted too much")
        };
        assert_eq!(detail, "9 bytes of data after 0 of the 8 announced");
        re.expect(0, 1, "r", 8);
        assert!(matches!(re.chunk(0, 1, 0), Chunk::Overflow { .. }));
        assert!(
            matches!(re.chunk(2, 1, 1), Chunk::Unknown),
            "another source's message"
        );
    }

    #[test]
    fn a_lost_source_takes_only_its_receives() {
        let mut re = Reassembly::default();
        re.expect(0, 1, "a", 8);
        re.expect(1, 1, "b", 8);
        re.expect(0, 2, "c", 8);
        let mut lost = re.withdraw_source(0);
        lost.sort_unstable();
        assert_eq!(lost, ["a", "c"]);
        assert!(matches!(re.chunk(1, 1, 8), Chunk::Into { r: "b", .. }));
    }

    proptest! {
        /// Any split of a message into chunks reassembles at consecutive offsets and completes
        /// exactly at the end.
        #[test]
        fn any_chunking_completes_once(whole in 1u64..10_000, cuts in prop::collection::vec(1u64..3_000, 1..20)) {
            let mut re = Reassembly::default();
            re.expect(3, 7, (), whole);
            let mut at = 0u64;
            let mut done = false;
            for c in cuts.iter().copied().chain(std::iter::repeat(3_000)) {
                let len = c.min(whole - at);
                let Chunk::Into { r, base, whole: w } = re.chunk(3, 7, len) else {
                    return Err(TestCaseError::fail("chunk refused"));
                };
                prop_assert_eq!(base as u64, at);
                at += len;
                if re.chunk_done(3, 7, r, (base, len, w)).is_some() {
                    done = true;
                    break;
                }
            }
            prop_assert!(done);
            prop_assert_eq!(at, whole);
            prop_assert!(matches!(re.chunk(3, 7, 1), Chunk::Unknown));
        }
    }
}
