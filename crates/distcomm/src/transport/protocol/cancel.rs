//! Cancellation by key: traffic of a (context, tag) key cancelled here or by a peer. Every
//! operation of the key fails, posted or later, and its messages are refused (Nack
//! `Cancelled`) so that their senders' operations end too.
//!
//! Owns the table of cancelled keys, each with an opaque note of who cancelled it and why (the
//! first cancellation wins); what a key or a note means belongs to the layer that cancels.

use std::collections::HashMap;

use super::matching::Key;
use crate::dtype::DType;
use crate::error::Error;
use crate::transport::frame::{Fingerprint, Header, Kind, NackReason};

/// Who cancelled a key and why, as the cancelling layer put it: the transport carries it (in
/// the Cancel frame) and keeps it, but never interprets `check` or `why`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CancelNote {
    /// The rank that cancelled the key.
    pub by: usize,
    /// Its check word and element type for the key's traffic.
    pub check: Fingerprint,
    pub dtype: DType,
    /// The cancelling layer's reason word (opaque).
    pub why: u32,
}

impl CancelNote {
    /// The length word of the refusal (Nack `Cancelled`) of a message of a key this note
    /// cancelled: `by` + 1 in the high half, `why` in the low one. The refusal carries the
    /// note's check word and element type in its own, so that the sender's operation fails with
    /// the same error as if the Cancel frame had reached it first (it may still be on its way
    /// from `by`).
    pub(crate) fn refusal_len(&self) -> u64 {
        ((self.by as u64).saturating_add(1) << 32) | u64::from(self.why)
    }

    /// The note a refusal `h` carries (see [`CancelNote::refusal_len`]), if it is a Nack
    /// `Cancelled` that carries one from a rank below `world`.
    pub(crate) fn from_refusal(h: &Header, world: usize) -> Option<CancelNote> {
        if h.kind != Kind::Nack || h.aux != NackReason::Cancelled as u32 {
            return None;
        }
        let by = usize::try_from((h.len >> 32).checked_sub(1)?).ok()?;
        (by < world).then_some(CancelNote {
            by,
            check: h.fp,
            dtype: h.dtype,
            why: h.len as u32,
        })
    }
}

/// An operation of a cancelled key that fails now.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CancelledOp {
    /// This rank and the world size.
    pub rank: usize,
    pub world: usize,
    /// The operation, for its error.
    pub op: &'static str,
    /// Its check word and element type.
    pub check: Fingerprint,
    pub dtype: DType,
}

/// Turns the note of a cancelled key into the error of one of its operations: supplied by the
/// layer that cancels keys (the engine's configuration), since only it knows what they mean.
pub(crate) type CancelError = fn(&CancelNote, &CancelledOp) -> Error;

/// Cancelled keys and their notes. Grows by one entry per cancelled key.
pub(crate) struct Cancelled<N> {
    keys: HashMap<Key, N>,
}

impl<N> Default for Cancelled<N> {
    fn default() -> Self {
        Cancelled {
            keys: HashMap::new(),
        }
    }
}

impl<N> Cancelled<N> {
    /// Whether `key` is cancelled (no hashing while nothing is: the message path's check).
    #[inline]
    pub(crate) fn contains(&self, key: Key) -> bool {
        !self.keys.is_empty() && self.keys.contains_key(&key)
    }

    /// The note of cancelled `key`.
    #[inline]
    pub(crate) fn get(&self, key: Key) -> Option<&N> {
        if self.keys.is_empty() {
            return None;
        }
        self.keys.get(&key)
    }

    /// Cancels `key` with `note`, unless it already is (the first note stays). Returns whether
    /// this cancelled it.
    pub(crate) fn cancel(&mut self, key: Key, note: N) -> bool {
        use std::collections::hash_map::Entry;
        match self.keys.entry(key) {
            Entry::Occupied(_) => false,
            Entry::Vacant(v) => {
                v.insert(note);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_note_stays() {
        let mut c = Cancelled::default();
        assert!(!c.contains((1, 2)));
        assert!(c.cancel((1, 2), "first"));
        assert!(!c.cancel((1, 2), "second"));
        assert_eq!(c.get((1, 2)), Some(&"first"));
        assert!(!c.contains((1, 3)) && !c.contains((2, 2)));
    }

    #[test]
    fn a_refusal_carries_the_note() {
        let note = CancelNote {
            by: 3,
            check: Fingerprint::NONE,
            dtype: DType::F32,
            why: 0x401,
        };
        let nack = |len| Header {
            kind: Kind::Nack,
            dtype: note.dtype,
            ctx: 1,
            tag: 2,
            aux: NackReason::Cancelled as u32,
            msg_id: 9,
            len,
            fp: note.check,
        };
        assert_eq!(
            CancelNote::from_refusal(&nack(note.refusal_len()), 4),
            Some(note)
        );
        // None carried (an empty length word), or one naming a rank outside the world.
        assert_eq!(CancelNote::from_refusal(&nack(0), 4), None);
        assert_eq!(CancelNote::from_refusal(&nack(note.refusal_len()), 3), None);
        let other = Header {
            aux: NackReason::TooLarge as u32,
            ..nack(note.refusal_len())
        };
        assert_eq!(CancelNote::from_refusal(&other, 4), None);
    }
}
