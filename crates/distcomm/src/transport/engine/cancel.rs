//! Cancellation by key (context, tag): a key cancelled here (`Engine::cancel_key`) or by a
//! peer (a Cancel frame) fails its operations and refuses its later messages (Nack
//! `Cancelled`), so that their senders' operations end too.
//!
//! Owns the Cancel frame; the note it carries and the errors of cancelled operations belong to
//! the layer that cancels (the configuration's `cancel_error`).

use super::*;

impl State {
    /// The error of operation `op` (check word `check`, `dtype`) of a key cancelled by `note`.
    pub(super) fn cancelled_error(
        &self,
        note: &CancelNote,
        op: &'static str,
        check: Fingerprint,
        dtype: DType,
    ) -> Error {
        let what = CancelledOp {
            rank: self.rank,
            world: self.peers.len(),
            op,
            check,
            dtype,
        };
        (self.cancel_error)(note, &what)
    }

    /// Refuses a message of a cancelled key, so that its sender's operation ends; the refusal
    /// carries the key's note, so that the sender's error says why.
    pub(super) fn refuse_cancelled(&mut self, src: usize, h: &Header) {
        let note = self.cancelled.get((h.ctx, h.tag)).copied();
        let refusal = Refusal {
            reason: NackReason::Cancelled,
            cap: note.map_or(0, |n| n.refusal_len()),
            dtype: note.map_or(h.dtype, |n| n.dtype),
            fp: note.map_or(Fingerprint::NONE, |n| n.check),
        };
        self.answer(src, h, Some(refusal));
    }

    /// Cancels key (`h.ctx`, `h.tag`) for `note` (here or from peer `note.by`): fails our
    /// operations of it and refuses its messages, those here and those to come.
    pub(super) fn cancel_key(&mut self, key: Key, note: CancelNote) {
        self.cancelled.cancel(key, note);
        for r in self.matcher.withdraw_posted(|r| (r.ctx, r.tag) == key) {
            let e = self.cancelled_error(&note, r.op, r.fp, r.dtype);
            r.cell.complete(Err(e), None);
        }
        // Receives under way fail now too (else they would wait for their sender, and a sender
        // that leaves after hearing of the cancellation would be blamed for it); their data
        // still arrives into their buffer, so the stream stays whole.
        let mut under_way: Vec<&Posted> = self
            .rdv
            .receives()
            .chain(self.lent.values().map(|l| &l.r))
            .collect();
        for peer in self.peers.iter().flatten() {
            if let Rx::Payload {
                target: Target::Recv(r),
                ..
            } = &peer.rx
            {
                under_way.push(r);
            }
        }
        for r in under_way.into_iter().filter(|r| (r.ctx, r.tag) == key) {
            r.cell
                .complete(Err(self.cancelled_error(&note, r.op, r.fp, r.dtype)), None);
        }
        // Our sends of it fail now; their entries stay until the peer's reply (which may still
        // come) so that the reply is not mistaken for a protocol violation.
        for s in self.sends.values().filter(|s| (s.ctx, s.tag) == key) {
            let e = self.cancelled_error(&note, s.op, s.fp, s.dtype);
            s.cell.complete(Err(e), None);
        }
        // Messages of it already here will never be received: refuse them.
        let dropped = self
            .matcher
            .withdraw_unexpected(|u| (u.hdr.ctx, u.hdr.tag) == key);
        for u in dropped {
            self.refuse_cancelled(u.src, &u.hdr);
        }
    }

    /// Peer `p` cancelled key (`h.ctx`, `h.tag`) (a Cancel frame: `aux` is its reason word).
    pub(super) fn cancelled_by_peer(&mut self, p: usize, h: &Header) {
        let note = CancelNote {
            by: p,
            check: h.fp,
            dtype: h.dtype,
            why: h.aux,
        };
        self.cancel_key((h.ctx, h.tag), note);
    }
}
