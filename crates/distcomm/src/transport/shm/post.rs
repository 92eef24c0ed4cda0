//! Receives posted in the lane (see "Pre-accepted messages" in the parent module): what a
//! post's word says and accepts, and posting, holding and withdrawing one.
//!
//! Owns: the post's protocol. Must not know: the engine's receives (a post names its owner
//! only by an id).

use super::*;

/// A receive we posted in the lane: the message's sequence number, the word it replaced, the
/// word posted, and the receive's id.
#[derive(Debug, Clone, Copy)]
pub(super) struct Post {
    pub(super) seq: u64,
    pub(super) prev: u64,
    pub(super) word: u64,
    pub(super) owner: u64,
}

/// Whether slot word `w` is a receive posted for message `seq`.
pub(super) const fn posted_for(w: u64, seq: u64) -> bool {
    w & POSTED != 0 && w & POST_SEQ_MASK == seq & POST_SEQ_MASK
}

impl Ring {
    /// The key word of lane slot `seq`.
    fn slot_key(&self, seq: u64) -> &AtomicU64 {
        self.atomic64(Self::slot_off(seq) + KEY_AT)
    }

    /// Whether slot word `w` is a receive posted for message `seq` that accepts a message of
    /// `len` bytes with key `k` (the key word read after the word was acquired).
    pub(super) fn accepts(&self, w: u64, seq: u64, k: LaneKey, len: usize) -> bool {
        let dtype = (w >> DTYPE_SHIFT) as u8 & 0xf;
        posted_for(w, seq)
            && len as u64 <= (w >> LEN_SHIFT) & LEN_MASK
            && (dtype == 0 || dtype == k.dtype)
            && self.slot_key(seq).load(Ordering::Relaxed) == k.key
    }
}

impl ShmLink {
    /// The owner of the receive posted for the next lane message, when that message is there
    /// and the post accepted it: the message is that receive's to take.
    pub fn lane_held(&self) -> Option<u64> {
        let p = self.rx_post.get()?;
        let w = self.rx.slot_seq(p.seq).load(Ordering::Acquire);
        (publishes(w, p.seq) && w & PRE_ACCEPTED != 0).then_some(p.owner)
    }

    /// Posts receive `owner` (an id no other receive has), taking `k` and up to `cap` bytes,
    /// for the next lane message (see the module documentation), unless that message is there
    /// already or another receive posted first. Returns whether `owner`'s post is there.
    pub fn lane_post(&self, k: LaneKey, cap: usize, owner: u64) -> bool {
        if let Some(p) = self.rx_post.get() {
            return p.owner == owner;
        }
        let seq = self.rx_lane.get() + 1;
        let r = &self.rx;
        let slot = r.slot_seq(seq);
        let prev = slot.load(Ordering::Acquire);
        if publishes(prev, seq) {
            return false;
        }
        let n = self.rx_posts.get().wrapping_add(1);
        self.rx_posts.set(n);
        let word = POSTED
            | u64::from(k.dtype & 0xf) << DTYPE_SHIFT
            | (cap.min(LANE_MAX) as u64) << LEN_SHIFT
            | u64::from(n) << EPOCH_SHIFT
            | seq & POST_SEQ_MASK;
        r.slot_key(seq).store(k.key, Ordering::Relaxed);
        if slot
            .compare_exchange(prev, word, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // The message came meanwhile.
            return false;
        }
        self.rx_post.set(Some(Post {
            seq,
            prev,
            word,
            owner,
        }));
        true
    }

    /// Withdraws `owner`'s post, if it has one. Returns `false` when a message it accepted
    /// took its slot first: that message is the receive's to take, unless `disown`: then it
    /// is taken like any other. (A message the post did not accept ends it just the same.)
    pub fn lane_withdraw(&self, owner: u64, disown: bool) -> bool {
        let Some(p) = self.rx_post.get().filter(|p| p.owner == owner) else {
            return true;
        };
        let slot = self.rx.slot_seq(p.seq);
        match slot.compare_exchange(p.word, p.prev, Ordering::AcqRel, Ordering::Acquire) {
            Err(w) if !disown && publishes(w, p.seq) && w & PRE_ACCEPTED != 0 => false,
            _ => {
                self.rx_post.set(None);
                true
            }
        }
    }
}
