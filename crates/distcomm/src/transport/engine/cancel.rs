//! Cancellation by key (context, tag): a key cancelled here or by a peer (a Cancel frame)
//! fails its operations and refuses its later messages (Nack `Cancelled`).
//!
//! Owns the Cancel frame and the errors of cancelled operations.

use super::*;

impl State {
    /// Refuses a message of a cancelled collective, so that its sender's operation ends.
    pub(super) fn refuse_cancelled(&mut self, src: usize, h: &Header) {
        let refusal = Refusal {
            reason: NackReason::Cancelled,
            cap: 0,
            dtype: h.dtype,
            fp: Fingerprint::NONE,
        };
        self.answer(src, h, Some(refusal));
    }

    /// A peer reports that collective (`h.ctx`, `h.tag`) failed there: fail our operations of it
    /// and refuse its later messages.
    pub(super) fn cancel_collective_from(&mut self, p: usize, h: &Header) {
        let key = (h.ctx, h.tag);
        let rank = self.rank;
        let lost = (h.aux >> 8)
            .checked_sub(1)
            .map(|l| l as usize)
            .filter(|&l| l < self.peers.len());
        let cancel = Cancel {
            by: p,
            fp: h.fp,
            dtype: h.dtype,
            desync: h.aux & 1 == 1,
            lost,
        };
        for r in self.matcher.withdraw_posted(|r| (r.ctx, r.tag) == key) {
            r.cell
                .complete(Err(cancel.error(rank, r.op, r.fp, r.dtype)), None);
        }
        // Our sends of it fail now; their entries stay until the peer's reply (which may still
        // come) so that the reply is not mistaken for a protocol violation.
        for s in self.sends.values().filter(|s| (s.ctx, s.tag) == key) {
            s.cell
                .complete(Err(cancel.error(rank, s.op, s.fp, s.dtype)), None);
        }
        // Messages of it already here will never be received: refuse them.
        let dropped = self
            .matcher
            .withdraw_unexpected(|u| (u.hdr.ctx, u.hdr.tag) == key);
        for u in dropped {
            self.refuse_cancelled(u.src, &u.hdr);
        }
        self.cancelled.cancel(key, cancel);
    }
}

/// The `aux` word of a Cancel frame: bit 0 desync, bits 8.. the lost peer + 1 (0: none).
pub(super) fn cancel_aux(desync: bool, lost: Option<usize>) -> u32 {
    u32::from(desync) | lost.map_or(0, |p| (p as u32).saturating_add(1) << 8)
}

impl Cancel {
    /// The error an operation (`op`, our call `fp`/`dtype`) of the cancelled collective gets.
    pub(super) fn error(
        &self,
        rank: usize,
        op: &'static str,
        fp: Fingerprint,
        dtype: DType,
    ) -> Error {
        let theirs = self.fp.describe(self.dtype);
        match (self.desync, self.by == rank) {
            (false, false) if self.lost.is_some_and(|p| p != rank) => Error::PeerLost {
                op,
                rank,
                peer: self.lost.unwrap_or(self.by),
                reason: format!(
                    "rank {} lost its connection to it during collective {theirs} and cancelled \
                     the collective",
                    self.by
                ),
            },
            (true, false) => Error::Desync {
                op,
                rank,
                peer: self.by,
                ours: fp.describe(dtype),
                theirs: format!("{theirs}, which found a mismatch and cancelled"),
            },
            _ => Error::Aborted {
                op,
                rank,
                reason: format!(
                    "rank {} failed collective {theirs} and cancelled it",
                    self.by
                ),
            },
        }
    }
}
