//! The shared-memory lane: small messages in slots polled where they arrive, answered in an
//! answer word instead of an Ack frame; the blocking fast paths (`Engine::send_small`,
//! `Engine::recv_small`) and the ordering rules that let a message take the lane without
//! overtaking one on the ring.
//!
//! Owns the answer words we wait on; knows the lane's API (`shm`), not its memory layout.

use super::*;

/// What a receive posted in a lane takes: key (context, tag), element type, check word, and
/// up to how many bytes.
struct LanePost {
    key: (u32, u32),
    dtype: DType,
    fp: Fingerprint,
    cap: usize,
}

/// The lane's key of a point-to-point message.
fn lane_key(ctx: u32, tag: u32, dtype: DType) -> LaneKey {
    LaneKey {
        key: u64::from(ctx) | u64::from(tag) << 32,
        dtype: dtype as u8,
    }
}

impl State {
    /// The link to `p` when it is a shared-memory one (its socket carries the doorbell), with
    /// its shared-memory side.
    pub(super) fn shm_link(&self, p: usize) -> Option<(&Link, &ShmLink)> {
        let link = &self.peers.get(p)?.as_ref()?.link;
        Some((link, link.shm.as_ref()?))
    }

    /// Writes the answer word of lane message `seq` from `p`, ringing `p` if it sleeps.
    pub(super) fn lane_answer(&mut self, p: usize, seq: u64, refused: bool) {
        if let Some((link, shm)) = self.shm_link(p) {
            if shm.lane_answer(seq, refused) {
                link.ring();
            }
        }
    }

    /// Sends a small message through the lane of shared-memory peer `p` if the ordering rules
    /// allow it now: nothing queued for the ring (the lane itself refuses while ring bytes are
    /// unread), a free slot, and a free answer word when `owner` waits for the answer. Returns
    /// its sequence number, and whether the receive `p` posted for it accepted it already
    /// (then nobody waits for its answer); `None` leaves the message to the ring.
    pub(super) fn lane_send(
        &mut self,
        p: usize,
        h: &Header,
        data: &[u8],
        owner: Owner,
    ) -> Option<(u64, bool)> {
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return None;
        };
        let link = peer.link.shm.as_ref()?;
        if peer.dead.is_some() || !peer.out.is_empty() || !choice::lane_fits(data.len()) {
            return None;
        }
        // The answer word this message would use is free, or not needed.
        let at = (link.next_lane_seq() % LANE_ACKS) as usize;
        let free = matches!(owner, Owner::Nobody)
            || match peer.lane_waits.get(at)? {
                None => true,
                Some(LaneWait::Caller { seq, .. }) => link.answered(*seq) == Some(true),
                Some(LaneWait::Op { .. }) => false,
            };
        if !free {
            return None;
        }
        // Only a message that waits for its answer may be taken by a posted receive: the
        // others (scheduled) are checked against their receive's check word instead.
        let offer = matches!(owner, Owner::Caller).then(|| lane_key(h.ctx, h.tag, h.dtype));
        let sent = match link.lane_send(&h.encode_lane(), data, offer) {
            Ok(sent) => sent?,
            Err(e) => {
                self.mark_dead(p, e.to_string());
                return None;
            }
        };
        if sent.ring {
            peer.link.ring();
        }
        if matches!(owner, Owner::Caller) && !sent.pre {
            peer.lane_waits[at] = Some(LaneWait::Caller {
                seq: sent.seq,
                nack: None,
            });
        }
        Some((sent.seq, sent.pre))
    }

    /// Posts receive `owner` (key `(ctx, tag)`, element type `dtype`, check word `fp`, up to
    /// `cap` bytes) in `p`'s lane, so that a message it accepts is taken by it at once, its
    /// sender waiting for no answer (see `shm`). Only a point-to-point receive posts (a
    /// scheduled one checks more than the lane says).
    fn lane_post(&self, p: usize, r: LanePost, owner: u64) {
        if refusal::scheduled(r.fp) {
            return;
        }
        if let Some((_, link)) = self.shm_link(p) {
            let k = lane_key(r.key.0, r.key.1, r.dtype);
            // A raw receive takes any type.
            let dtype = if r.dtype == DType::Bytes { 0 } else { k.dtype };
            link.lane_post(LaneKey { dtype, ..k }, r.cap, owner);
        }
    }

    /// Withdraws receive `owner`'s post in `p`'s lane, if it has one (see
    /// [`ShmLink::lane_withdraw`]): `false` when a message it accepted took its place first,
    /// unless `disown`: then that message is left to the engine, like any other.
    pub(super) fn lane_withdraw(&self, p: usize, owner: u64, disown: bool) -> bool {
        self.shm_link(p)
            .is_none_or(|(_, link)| link.lane_withdraw(owner, disown))
    }

    /// Whether receive `owner` may take the head of `p`'s lane, and must: `Some(true)` when a
    /// post of its own accepted it (whatever else came since), `Some(false)` when another
    /// receive's post did (nobody else may take it), `None` otherwise.
    fn lane_held_for(&self, p: usize, owner: u64) -> Option<bool> {
        let held = self.shm_link(p)?.1.lane_held()?;
        Some(held == owner)
    }

    /// The next message of `p`'s lane, if one is there, with its decoded header; nothing is
    /// taken until [`State::lane_release`].
    pub(super) fn lane_peek(
        &self,
        p: usize,
    ) -> std::result::Result<Option<(Header, LaneMsg)>, String> {
        let Some((_, link)) = self.shm_link(p) else {
            return Ok(None);
        };
        let mut head = [0u8; LANE_HEAD];
        let Some(m) = link.lane_peek(&mut head).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        let mut h = Header::decode_lane(&head, m.seq, m.len as usize)
            .map_err(|e| format!("protocol violation: {}", e.0))?;
        if m.pre {
            // Its sender waits for no answer: never write one, whoever takes it (an answer
            // written late would overwrite a later message's).
            h.aux |= EAGER_NO_ACK;
        }
        Ok(Some((h, m)))
    }

    /// Copies the payload of lane message `m` from `p` into `dst`.
    pub(super) fn lane_copy(&self, p: usize, m: LaneMsg, dst: &mut [u8]) {
        if let Some((_, link)) = self.shm_link(p) {
            link.lane_copy(m, dst);
        }
    }

    /// Releases lane message `m` from `p`; with `accept`, also writes its answer word
    /// "accepted" (in the same step).
    pub(super) fn lane_release(&mut self, p: usize, m: LaneMsg, accept: bool) {
        if let Some((link, shm)) = self.shm_link(p) {
            if shm.lane_release(m, accept.then_some(false)) {
                link.ring();
            }
        }
    }

    /// Takes every message waiting in shared-memory peer `p`'s lane, in order. Called before
    /// reading its ring: a lane message is never behind unread ring bytes (see `shm`).
    pub(super) fn pump_lane(&mut self, p: usize) -> std::result::Result<bool, String> {
        let mut any = false;
        while let Some((h, m)) = self.lane_peek(p)? {
            if m.pre
                && self
                    .shm_link(p)
                    .is_some_and(|(_, l)| l.lane_held().is_some())
            {
                // Taken by the receive posted for it, whose caller spins for it.
                break;
            }
            any = true;
            self.lane_deliver(p, h, m);
        }
        Ok(any)
    }

    /// Takes lane message `m` from `p` and delivers it like an eager frame's payload: straight
    /// from the lane into a matching posted receive (answered in the same step as the release),
    /// else into a spare buffer on the unexpected queue.
    pub(super) fn lane_deliver(&mut self, p: usize, h: Header, m: LaneMsg) {
        if self.cancelled.contains((h.ctx, h.tag)) {
            self.lane_release(p, m, false);
            self.refuse_cancelled(p, &h);
            return;
        }
        match self.take_matching(p, &h) {
            Matched::Recv(mut r) => {
                // `check` made sure the buffer holds at least `h.len == m.len` bytes.
                self.lane_accept(p, &h, m, r.buf.bytes_mut());
                complete_recv(r, p, &h);
            }
            Matched::Unposted => {
                let mut data = self.spare_temps.take_len(m.len as usize);
                self.lane_copy(p, m, &mut data);
                self.lane_release(p, m, false);
                self.matcher.push_unexpected(Unexpected {
                    src: p,
                    hdr: h,
                    data: Some(data),
                });
            }
            Matched::Refused(r, why) => {
                self.lane_release(p, m, false);
                self.refuse(p, &h, r, why);
            }
        }
    }

    /// Copies lane message `m` (header `h`) from `p` into the first `m.len` bytes of `dst`
    /// and releases its slot, answering "accepted" in the same step when its sender waits for
    /// an answer.
    fn lane_accept(&mut self, p: usize, h: &Header, m: LaneMsg, dst: &mut [u8]) {
        self.lane_copy(p, m, &mut dst[..m.len as usize]);
        self.lane_release(p, m, h.aux & EAGER_NO_ACK == 0);
    }

    /// Completes our lane sends to `p` whose answer word says accepted.
    pub(super) fn poll_lane_acks(&mut self, p: usize) {
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return;
        };
        let Some(link) = peer.link.shm.as_ref().filter(|_| peer.lane_ops > 0) else {
            return;
        };
        for w in peer.lane_waits.iter_mut() {
            if let Some(LaneWait::Op { seq, id }) = *w {
                if link.answered(seq) == Some(true) {
                    *w = None;
                    peer.lane_ops -= 1;
                    if let Some(s) = self.sends.remove(&id) {
                        s.cell.complete(Ok(s.status(p)), s.buf);
                    }
                }
            }
        }
    }

    /// `p` refused our lane message `h.msg_id` (a sequence number): fail the send waiting for
    /// it, or keep the refusal for the blocking caller that watches it.
    pub(super) fn lane_refused(&mut self, p: usize, h: Header) -> std::result::Result<Rx, String> {
        let Some(Some(peer)) = self.peers.get_mut(p) else {
            return Ok(Rx::Header);
        };
        let h = Header {
            aux: h.aux & !LANE,
            ..h
        };
        let Some(w) = peer.lane_waits.get_mut((h.msg_id % LANE_ACKS) as usize) else {
            return Ok(Rx::Header);
        };
        match w {
            Some(LaneWait::Op { seq, id }) if *seq == h.msg_id => {
                let id = *id;
                *w = None;
                peer.lane_ops -= 1;
                self.on_header(p, Header { msg_id: id, ..h })
            }
            Some(LaneWait::Caller { seq, nack }) if *seq == h.msg_id => {
                *nack = Some(h);
                Ok(Rx::Header)
            }
            // A message nobody waits an answer for (a scheduled one).
            _ => Ok(Rx::Header),
        }
    }

    /// A blocking receive (`env`, into `out`) from shared-memory peer `p`, taken straight from
    /// its lane if nothing can come before it: no earlier receive of this (source, tag) is
    /// posted, none of its messages is queued, `p`'s ring holds no half-read frame. Messages of
    /// other tags that come first are delivered as usual.
    pub(super) fn recv_from_lane(
        &mut self,
        p: usize,
        env: &Envelope,
        out: &mut [u8],
        owner: u64,
    ) -> LaneTake<Result<Status>> {
        let key = (env.ctx, env.tag);
        // A message the receive's post (below) accepted is its own, whatever came since.
        let held = self.lane_held_for(p, owner);
        if held == Some(false)
            || held.is_none()
                && (!self.lane_idle(p)
                    || self.matcher.posted_could_take(p, key)
                    || self.matcher.unexpected_from(p, key))
        {
            return LaneTake::Declined;
        }
        let (h, m) = match self.lane_next(p, key) {
            Ok(Some(msg)) => msg,
            Ok(None) => {
                let post = LanePost {
                    key,
                    dtype: env.dtype,
                    fp: env.fp,
                    cap: out.len(),
                };
                self.lane_post(p, post, owner);
                return LaneTake::Empty;
            }
            Err(()) => return LaneTake::Declined,
        };
        let cap = out.len() as u64;
        LaneTake::Got(match refusal::check(self.rank, env.expect(cap), p, &h) {
            Ok(()) => {
                // `refusal::check` made sure `out` holds at least `m.len` bytes.
                self.lane_accept(p, &h, m, out);
                Ok(Status {
                    peer: p,
                    tag: env.tag,
                    bytes: m.len as usize,
                })
            }
            Err((e, reason)) => {
                self.lane_release(p, m, false);
                let refusal = Refusal {
                    reason,
                    cap,
                    dtype: env.dtype,
                    fp: env.fp,
                };
                self.answer(p, &h, Some(refusal));
                Err(e)
            }
        })
    }

    /// Whether `p` is a live shared-memory peer with no half-read frame in its ring (so the
    /// head of its lane is the next thing it sent that we have not taken), and the engine is
    /// open.
    fn lane_idle(&self, p: usize) -> bool {
        self.closed.is_none()
            && matches!(self.peers.get(p), Some(Some(peer)) if peer.dead.is_none()
                && peer.link.shm.is_some()
                && matches!(peer.rx, Rx::Header)
                && peer.rx_start == peer.rx_end)
    }

    /// The first message of `key` (context, tag) at the head of `p`'s lane, the messages of
    /// other keys ahead of it delivered as usual on the way; `Ok(None)` when there is none now,
    /// `Err(())` when the link failed (then `p` is marked dead).
    fn lane_next(
        &mut self,
        p: usize,
        key: (u32, u32),
    ) -> std::result::Result<Option<(Header, LaneMsg)>, ()> {
        loop {
            match self.lane_peek(p) {
                Ok(Some((h, m))) if (h.ctx, h.tag) == key => return Ok(Some((h, m))),
                Ok(Some((h, m))) => self.lane_deliver(p, h, m),
                Ok(None) => return Ok(None),
                Err(reason) => {
                    self.mark_dead(p, reason);
                    return Err(());
                }
            }
        }
    }

    /// The waiter of posted receive `id` takes its message straight from its source's lane,
    /// as a blocking receive would ([`State::recv_from_lane`]), when the receive is the one
    /// that message goes to anyway: named source, shared-memory link idle, no receive posted
    /// before it that could take it, none of its messages queued. Messages of other keys that
    /// come first are delivered as usual. On success the receive leaves the queue with the
    /// message in its buffer and its cell untouched (the handle, consumed, never reads it).
    pub(super) fn claim(&mut self, id: u64) -> LaneTake<(Status, BoxBuf)> {
        let Some((at, Some(src), key)) = self
            .matcher
            .find_posted(|r| r.id == id)
            .filter(|&(_, _, first)| first)
            .map(|(i, r, _)| (i, r.src, (r.ctx, r.tag)))
        else {
            return LaneTake::Declined;
        };
        let held = self.lane_held_for(src, id);
        if held == Some(false)
            || held.is_none()
                && (!self.lane_idle(src)
                    || self.cancelled.contains(key)
                    || self.matcher.unexpected_from(src, key))
        {
            return LaneTake::Declined;
        }
        let (h, m) = match self.lane_next(src, key) {
            Ok(Some(msg)) => msg,
            Ok(None) => {
                // (Not while frames wait to be written: the caller leaves at once for the
                // general wait.)
                if let Some(r) = self.matcher.posted_at(at).filter(|r| r.id == id) {
                    let post = LanePost {
                        key,
                        dtype: r.dtype,
                        fp: r.fp,
                        cap: r.buf.bytes().len(),
                    };
                    if !self.backlog() {
                        self.lane_post(src, post, id);
                    }
                }
                return LaneTake::Empty;
            }
            Err(()) => return LaneTake::Declined,
        };
        // Still posted: nothing else takes receives out while we hold the lock, and the
        // messages delivered on the way had other keys (and may have taken receives posted
        // before it: then it moved).
        let at = if self.matcher.posted_at(at).is_some_and(|r| r.id == id) {
            Some(at)
        } else {
            self.matcher.find_posted(|r| r.id == id).map(|(i, _, _)| i)
        };
        let Some(mut r) = at.and_then(|i| self.matcher.remove_posted(i)) else {
            return LaneTake::Declined;
        };
        match self.check(&mut r, src, &h) {
            Ok(()) => {
                // `check` made sure the buffer holds at least `h.len == m.len` bytes.
                self.lane_accept(src, &h, m, r.buf.bytes_mut());
                let status = Status {
                    peer: src,
                    tag: h.tag,
                    bytes: m.len as usize,
                };
                // Take what came behind it too, and write the replies those left queued, as a
                // sweep would: the sender writes to its ring only once the lane is empty, and
                // waits for the replies.
                if let Err(reason) = self.pump_lane(src).and_then(|_| self.pump_tx(src)) {
                    self.mark_dead(src, reason);
                }
                LaneTake::Got((status, r.buf))
            }
            Err(why) => {
                self.lane_release(src, m, false);
                self.refuse(src, &h, r, why);
                LaneTake::Declined
            }
        }
    }

    /// The watcher of lane send `t` (a blocking caller or a handle) stops watching its answer
    /// word: `cell` gets the outcome now if it is known (with `buf` on success), otherwise the
    /// send becomes one the engine completes when the answer comes, under `id` (a handle's,
    /// given when it was posted) or a new one; then that id.
    pub(super) fn adopt_lane_send(
        &mut self,
        t: &Ticket,
        cell: &Arc<OpCell>,
        buf: Option<BoxBuf>,
        id: Option<u64>,
    ) -> Option<u64> {
        let (p, seq, env) = (t.peer, t.seq, &t.env);
        let rank = self.rank;
        let at = (seq % LANE_ACKS) as usize;
        // Still waiting for its answer: with the refusal the engine read for it, if any.
        let waiting = match self.peers.get_mut(p) {
            Some(Some(peer)) => match peer.lane_waits.get(at) {
                Some(Some(LaneWait::Caller { seq: s, nack })) if *s == seq => {
                    let nack = *nack;
                    let accepted =
                        peer.link.shm.as_ref().and_then(|l| l.answered(seq)) == Some(true);
                    if accepted || nack.is_some() {
                        peer.lane_waits[at] = None;
                    }
                    (!accepted).then_some(nack)
                }
                _ => None,
            },
            _ => None,
        };
        // Accepted, or its word reused (which needs the answer "accepted").
        let Some(nack) = waiting else {
            cell.complete(Ok(t.status()), buf);
            return None;
        };
        let id = id.unwrap_or_else(|| self.alloc_id());
        let mut pending = env.pending(p, t.len, cell.clone());
        pending.buf = buf;
        if let Some(h) = nack {
            self.sends.insert(id, pending);
            let _ = self.on_header(p, Header { msg_id: id, ..h });
            return Some(id);
        }
        if let Some(reason) = self.dead_reason(p) {
            cell.complete(Err(peer_lost(env.op, rank, p, &reason)), None);
            return None;
        }
        if let Some(reason) = self.closed.clone() {
            let op = env.op;
            cell.complete(Err(Error::Aborted { op, rank, reason }), None);
            return None;
        }
        if let Some(Some(peer)) = self.peers.get_mut(p) {
            peer.lane_waits[at] = Some(LaneWait::Op { seq, id });
            peer.lane_ops += 1;
        }
        self.sends.insert(id, pending);
        Some(id)
    }
}
