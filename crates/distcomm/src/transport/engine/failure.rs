//! What ends operations other than their completion: a peer lost (every operation that
//! depends on it fails with an error naming it), an abort of the whole engine, and the
//! withdrawal of buffers the caller takes back (`reclaim`).
//!
//! Knows the engine's queues; nothing of why the layers above abort.

use super::*;

/// How many read budgets of a lost peer's last words are read at most.
const LAST_WORDS_ROUNDS: usize = 4;

impl State {
    /// Fails everything that depends on peer `p`.
    ///
    /// Its last words come first: what `p` wrote before its connection ended (typically the
    /// cancellation of a collective, naming the rank whose loss was the real cause) is read and
    /// acted on before its loss is declared, so that a survivor which left after hearing of a
    /// death is not blamed for it by ranks whose write to it failed first.
    pub(super) fn mark_dead(&mut self, p: usize, reason: String) {
        let rank = self.rank;
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return;
        };
        if peer.dead.is_some() {
            return;
        }
        // Marked first: a failure while reading the last words ends here.
        peer.dead = Some(reason.clone());
        self.read_last_words(p);
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return;
        };
        let _ = peer.link.stream.shutdown(Shutdown::Both);
        peer.out.clear();
        if let Rx::Payload {
            target: Target::Recv(r),
            ..
        } = std::mem::replace(&mut peer.rx, Rx::Header)
        {
            r.cell
                .complete(Err(peer_lost(r.op, rank, p, &reason)), None);
        }
        for r in self.matcher.withdraw_posted(|r| r.src == Some(p)) {
            r.cell
                .complete(Err(peer_lost(r.op, rank, p, &reason)), None);
        }
        for r in self.rdv.withdraw_source(p) {
            r.cell
                .complete(Err(peer_lost(r.op, rank, p, &reason)), None);
        }
        // A dead peer writes no more: its lent buffers are free again.
        let keys: Vec<_> = self.lent.keys().filter(|k| k.0 == p).copied().collect();
        for k in keys {
            if let Some(l) = self.lent.remove(&k) {
                l.r.cell
                    .complete(Err(peer_lost(l.r.op, rank, p, &reason)), None);
            }
        }
        let ids: Vec<u64> = self
            .sends
            .iter()
            .filter(|(_, s)| s.dst == p)
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            if let Some(s) = self.sends.remove(&id) {
                s.cell
                    .complete(Err(peer_lost(s.op, rank, p, &reason)), None);
            }
        }
        // Announced large messages can no longer be fetched; eager ones arrived whole.
        self.matcher
            .withdraw_unexpected(|u| u.src == p && u.hdr.kind != Kind::Eager);
    }

    /// Reads and handles what `p` left in its socket and lane, up to a bound (a peer declared
    /// dead for another reason may still be writing): the answers to our lane sends first.
    fn read_last_words(&mut self, p: usize) {
        self.poll_lane_acks(p);
        for _ in 0..LAST_WORDS_ROUNDS {
            let lane = self.pump_lane(p).unwrap_or(false);
            if !(self.pump_rx(p).unwrap_or(false) || lane) {
                break;
            }
        }
    }

    pub(super) fn reclaim(&mut self, ids: &[u64]) {
        let rank = self.rank;
        let hit = |id: u64| ids.contains(&id);
        let withdrawn = |op| Error::Aborted {
            op,
            rank,
            reason: "withdrawn by its caller".into(),
        };
        let owned = |b: &BoxBuf| -> BoxBuf { Box::new(b.bytes().to_vec()) };
        let scratch = |b: &BoxBuf| -> BoxBuf { Box::new(vec![0u8; b.bytes().len()]) };
        for r in self.matcher.withdraw_posted(|r| hit(r.id)) {
            r.cell.complete(Err(withdrawn(r.op)), None);
        }
        for r in self.rdv.receives_mut().filter(|r| hit(r.id)) {
            r.buf = scratch(&r.buf);
            r.cell.complete(Err(withdrawn(r.op)), None);
        }
        for peer in self.peers.iter_mut().flatten() {
            if let Rx::Payload {
                target: Target::Recv(r),
                ..
            } = &mut peer.rx
            {
                if hit(r.id) {
                    r.buf = scratch(&r.buf);
                    r.cell.complete(Err(withdrawn(r.op)), None);
                }
            }
            for o in peer.out.iter_mut().filter(|o| o.send_id.is_some_and(hit)) {
                if let Some(b) = &o.payload {
                    o.payload = Some(owned(b));
                }
            }
        }
        for (_, s) in self.sends.iter_mut().filter(|(id, _)| hit(**id)) {
            if let Some(b) = &s.buf {
                s.buf = Some(owned(b));
            }
        }
    }

    pub(super) fn abort_all(&mut self, reason: &str) {
        let rank = self.rank;
        self.closed = Some(reason.to_string());
        let aborted = |op| Error::Aborted {
            op,
            rank,
            reason: reason.to_string(),
        };
        for r in self.matcher.drain_posted() {
            r.cell.complete(Err(aborted(r.op)), None);
        }
        for r in self.rdv.drain() {
            r.cell.complete(Err(aborted(r.op)), None);
        }
        // Sends whose buffer a peer may be reading stay until it answers; the rest go.
        self.sends.retain(|_, s| {
            s.cell.complete(Err(aborted(s.op)), None);
            s.lent
        });
        // Lent buffers stay until the peer's Put (or death); their operations fail now.
        for l in self.lent.values() {
            l.r.cell.complete(Err(aborted(l.r.op)), None);
        }
        for peer in self.peers.iter_mut().flatten() {
            // Replies owed to peers (acks, clear-to-send, refusals) and a frame already half on
            // the wire still go out; only our own unsent messages are dropped.
            let mut first = peer.out_off > 0;
            peer.out
                .retain(|o| std::mem::take(&mut first) || o.send_id.is_none());
            if let Rx::Payload {
                target: Target::Recv(r),
                ..
            } = std::mem::replace(&mut peer.rx, Rx::Header)
            {
                r.cell.complete(Err(aborted(r.op)), None);
            }
        }
    }
}
