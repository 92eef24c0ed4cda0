//! Arrivals and posts: a message header that arrived (eager, rendezvous, fetch requests, the
//! replies to our sends) or a receive posted here goes through matching and the refusal check
//! (`protocol`), and what they decide becomes frames and completions: Ack/Nack/Cts to the
//! sender, the receive completed or failed, a payload read into its receive or kept.
//!
//! Owns the dispatch of headers; knows frames and the engine's queues, not how bytes move.

use super::*;

impl State {
    /// Sends the control frame `hdr` (a reply: Ack, Nack, Cts) to `p`; a reply to ourselves
    /// (a self-send) is handled in place. A self-send never uses Rts, so such a reply is Ack or
    /// Nack and cannot fail.
    pub(super) fn reply(&mut self, p: usize, hdr: Header) {
        if p == self.rank {
            let _ = self.on_header(p, hdr);
            return;
        }
        self.push_out(
            p,
            Out {
                hdr: hdr.encode(),
                kind: hdr.kind,
                payload: None,
                base: 0,
                plen: 0,
                send_id: None,
            },
        );
    }

    /// Checks a matched receive against a message header.
    pub(super) fn check(
        &self,
        r: &mut Posted,
        src: usize,
        h: &Header,
    ) -> std::result::Result<(), (Error, NackReason)> {
        let cap = r.buf.bytes().len() as u64;
        // A buffer sized by what arrives (pipeline tensors, byte objects) takes its length now.
        let fitted = !refusal::scheduled(r.fp)
            && h.len != cap
            && r.fp == h.fp
            && (r.dtype == DType::Bytes || r.dtype == h.dtype)
            && usize::try_from(h.len).is_ok_and(|n| r.buf.fit(n));
        let cap = if fitted { h.len } else { cap };
        let want = Expect {
            op: r.op,
            dtype: r.dtype,
            check: r.fp,
            cap,
        };
        refusal::check(self.rank, want, src, h)
    }

    /// Answers the sender of an eager message or Rts: Ack/Cts on success, Nack on refusal.
    /// Self-sends are answered in place. A lane message is answered in its answer word (when
    /// its sender waits for one), a refusal also with a Nack frame that says why.
    pub(super) fn answer(&mut self, src: usize, h: &Header, refusal: Option<Refusal>) {
        if h.aux & LANE != 0 {
            if h.aux & EAGER_NO_ACK == 0 {
                self.lane_answer(src, h.msg_id, refusal.is_some());
            }
            if refusal.is_none() {
                return;
            }
        }
        let (kind, aux, len, dtype, fp) = match refusal {
            None if h.kind == Kind::Eager && h.aux & EAGER_NO_ACK != 0 => return,
            None if h.kind == Kind::Rts => (Kind::Cts, 0, 0, h.dtype, Fingerprint::NONE),
            None => (Kind::Ack, 0, 0, h.dtype, Fingerprint::NONE),
            Some(r) => (
                Kind::Nack,
                r.reason as u32 | (h.aux & LANE),
                r.cap,
                r.dtype,
                r.fp,
            ),
        };
        self.reply(src, control(kind, h.msg_id, aux, len, dtype, fp));
    }

    /// Matches a message that arrived whole (an eager payload, or an Rget's buffer address)
    /// with a posted receive and checks it. Unmatched, it is queued as unexpected; refused, the
    /// sender is answered and the receive failed. Returns the receive and the data otherwise.
    pub(super) fn match_arrived(
        &mut self,
        src: usize,
        h: &Header,
        data: Vec<u8>,
    ) -> Option<(Posted, Vec<u8>)> {
        match self.take_matching(src, h) {
            Matched::Recv(r) => Some((r, data)),
            Matched::Unposted => {
                self.matcher.push_unexpected(Unexpected {
                    src,
                    hdr: *h,
                    data: Some(data),
                });
                None
            }
            Matched::Refused(r, why) => {
                self.refuse(src, h, r, why);
                None
            }
        }
    }

    /// Takes the posted receive that matches message `h` from `src` (one that arrived or was
    /// announced) and checks the message against it; a refusal is not answered yet (see
    /// [`refuse`](Self::refuse)).
    pub(super) fn take_matching(&mut self, src: usize, h: &Header) -> Matched {
        let Some(mut r) = self.matcher.take_posted(src, (h.ctx, h.tag)) else {
            return Matched::Unposted;
        };
        match self.check(&mut r, src, h) {
            Ok(()) => Matched::Recv(r),
            Err(why) => Matched::Refused(r, why),
        }
    }

    /// Refuses the message `h` from `src` that matched receive `r`: answers the sender with
    /// why, and fails the receive.
    pub(super) fn refuse(
        &mut self,
        src: usize,
        h: &Header,
        r: Posted,
        (e, reason): (Error, NackReason),
    ) {
        self.answer(src, h, Some(r.refusal(reason)));
        r.cell.complete(Err(e), None);
    }

    /// Delivers a fully received eager payload: into a matching posted receive, or into the
    /// unexpected queue.
    pub(super) fn deliver_eager(&mut self, src: usize, h: Header, data: Vec<u8>) {
        if let Some((mut r, data)) = self.match_arrived(src, &h, data) {
            copy_bytes(&mut r.buf.bytes_mut()[..data.len()], &data);
            self.spare_temps.give(data);
            self.answer(src, &h, None);
            complete_recv(r, src, &h);
        }
    }

    /// Matches a newly posted receive against the unexpected queue, or queues it.
    pub(super) fn post_recv(&mut self, mut r: Posted) {
        let Some(u) = self.matcher.take_unexpected(r.src, (r.ctx, r.tag)) else {
            if let Some(c) = self.cancelled.get((r.ctx, r.tag)) {
                let e = self.cancelled_error(c, r.op, r.fp, r.dtype);
                r.cell.complete(Err(e), None);
                return;
            }
            if let Some(src) = r.src {
                if let Some(reason) = self.dead_reason(src) {
                    r.cell
                        .complete(Err(peer_lost(r.op, self.rank, src, &reason)), None);
                    return;
                }
            }
            if let Some(reason) = &self.closed {
                let e = Error::Aborted {
                    op: r.op,
                    rank: self.rank,
                    reason: reason.clone(),
                };
                r.cell.complete(Err(e), None);
                return;
            }
            self.matcher.push_posted(r);
            return;
        };
        if let Err(refused) = self.check(&mut r, u.src, &u.hdr) {
            self.refuse(u.src, &u.hdr, r, refused);
            return;
        }
        match u.data {
            Some(addr) if u.hdr.kind == Kind::Rget => self.fetch(u.src, u.hdr, r, &addr),
            Some(data) => {
                copy_bytes(&mut r.buf.bytes_mut()[..data.len()], &data);
                self.spare_temps.give(data);
                self.answer(u.src, &u.hdr, None);
                complete_recv(r, u.src, &u.hdr);
            }
            None => {
                self.answer(u.src, &u.hdr, None);
                self.rdv.expect(u.src, u.hdr.msg_id, r, u.hdr.len);
            }
        }
    }

    pub(super) fn protocol(&self, detail: String) -> std::result::Result<Rx, String> {
        Err(format!("protocol violation: {detail}"))
    }

    /// Handles a decoded header from peer `p` (or a local reply for self-sends) and returns the
    /// receive state that follows it.
    pub(super) fn on_header(&mut self, p: usize, h: Header) -> std::result::Result<Rx, String> {
        if matches!(h.kind, Kind::Eager | Kind::Rts | Kind::Rget)
            && self.cancelled.contains((h.ctx, h.tag))
        {
            self.refuse_cancelled(p, &h);
            return Ok(match h.kind {
                Kind::Eager | Kind::Rget => Rx::Payload {
                    hdr: h,
                    target: Target::Discard,
                    got: 0,
                    chunk: None,
                },
                _ => Rx::Header,
            });
        }
        match h.kind {
            Kind::Eager => {
                let target = match self.take_matching(p, &h) {
                    Matched::Unposted => Target::Temp(self.spare_temps.take_len(h.len as usize)),
                    Matched::Recv(r) => Target::Recv(r),
                    Matched::Refused(r, why) => {
                        self.refuse(p, &h, r, why);
                        Target::Discard
                    }
                };
                Ok(Rx::Payload {
                    hdr: h,
                    target,
                    got: 0,
                    chunk: None,
                })
            }
            Kind::Rts => {
                match self.take_matching(p, &h) {
                    Matched::Unposted => self.matcher.push_unexpected(Unexpected {
                        src: p,
                        hdr: h,
                        data: None,
                    }),
                    Matched::Recv(r) => {
                        self.answer(p, &h, None);
                        r.cell.kick();
                        self.rdv.expect(p, h.msg_id, r, h.len);
                    }
                    Matched::Refused(r, why) => self.refuse(p, &h, r, why),
                }
                Ok(Rx::Header)
            }
            Kind::Rget | Kind::Rput => Ok(Rx::Payload {
                hdr: h,
                target: Target::Temp(vec![0u8; RGET_PAYLOAD]),
                got: 0,
                chunk: None,
            }),
            Kind::Put => {
                self.on_put(p, h)?;
                Ok(Rx::Header)
            }
            Kind::Data => match self.rdv.chunk(p, h.msg_id, h.len) {
                Chunk::Into { r, base, whole } => Ok(Rx::Payload {
                    hdr: Header { tag: r.tag, ..h },
                    target: Target::Recv(r),
                    got: 0,
                    chunk: Some((base, whole)),
                }),
                Chunk::Overflow { r, detail } => {
                    r.cell.complete(
                        Err(Error::Protocol {
                            rank: self.rank,
                            peer: p,
                            detail: detail.clone(),
                        }),
                        None,
                    );
                    self.protocol(detail)
                }
                Chunk::Unknown => self.protocol(format!("data for unknown message {}", h.msg_id)),
            },
            Kind::Cts => {
                let Some(s) = self.sends.get_mut(&h.msg_id).filter(|s| s.dst == p) else {
                    return self
                        .protocol(format!("clear-to-send for unknown message {}", h.msg_id));
                };
                let Some(buf) = s.buf.take() else {
                    return self.protocol(format!("second clear-to-send for message {}", h.msg_id));
                };
                s.cell.kick();
                let first = data_chunk(h.msg_id, h.dtype, buf, (0, s.len), self.chunk(p));
                self.push_out(p, first);
                Ok(Rx::Header)
            }
            Kind::Cancel => {
                self.cancelled_by_peer(p, &h);
                Ok(Rx::Header)
            }
            Kind::Nack if h.aux & LANE != 0 => self.lane_refused(p, h),
            // The refusal of a message sent without waiting for an answer (EAGER_NO_ACK):
            // the layer above cancels its key where that matters.
            Kind::Nack if !self.sends.contains_key(&h.msg_id) => Ok(Rx::Header),
            Kind::Ack | Kind::Nack => {
                if self.sends.get(&h.msg_id).is_none_or(|s| s.dst != p) {
                    return self.protocol(format!("reply for unknown message {}", h.msg_id));
                }
                let Some(s) = self.sends.remove(&h.msg_id) else {
                    return self.protocol(format!("reply for unknown message {}", h.msg_id));
                };
                let result = if h.kind == Kind::Ack {
                    Ok(s.status(p))
                } else if let Some(note) = CancelNote::from_refusal(&h, self.peers.len()) {
                    Err(self.cancelled_error(&note, s.op, s.fp, s.dtype))
                } else {
                    Err(refusal::refused(self.rank, s.sent(), p, &h))
                };
                let buf = if result.is_ok() { s.buf } else { None };
                s.cell.complete(result, buf);
                Ok(Rx::Header)
            }
        }
    }

    /// A chunk of a cleared message arrived: wait for the next, or complete the receive.
    pub(super) fn on_chunk_done(
        &mut self,
        p: usize,
        h: Header,
        target: Target,
        (base, whole): (usize, u64),
    ) {
        let Target::Recv(r) = target else { return };
        if let Some(r) = self.rdv.chunk_done(p, h.msg_id, r, (base, h.len, whole)) {
            complete_recv(r, p, &Header { len: whole, ..h });
        }
    }

    pub(super) fn on_payload_done(&mut self, p: usize, h: Header, target: Target) {
        match target {
            Target::Recv(r) => {
                if h.kind == Kind::Eager {
                    self.answer(p, &h, None);
                }
                complete_recv(r, p, &h);
            }
            Target::Temp(data) if h.kind == Kind::Rget => self.on_rget(p, h, data),
            Target::Temp(data) if h.kind == Kind::Rput => {
                if let Err(reason) = self.on_rput(p, h, data) {
                    self.mark_dead(p, reason);
                }
            }
            Target::Temp(data) => self.deliver_eager(p, h, data),
            Target::Discard => {}
        }
    }
}
