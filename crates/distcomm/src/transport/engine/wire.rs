//! Moving frames: reading a peer's link into headers and payloads (into the receive they
//! belong to, or a temporary), writing queued frames with vectored writes, and what a frame
//! written completes (eager sends, Data chunks of a large message).
//!
//! Knows frames and the link's read/write; the meaning of a header is `recv`'s.

use super::*;

impl State {
    /// Reads and dispatches everything peer `p` has sent, up to a budget.
    pub(super) fn pump_rx(&mut self, p: usize) -> std::result::Result<bool, String> {
        let mut progressed = false;
        let mut budget = READ_BUDGET;
        let mut drained = false;
        loop {
            let Some(Some(peer)) = self.peers.get_mut(p) else {
                return Ok(progressed);
            };
            let rx = std::mem::replace(&mut peer.rx, Rx::Header);
            match rx {
                Rx::Header => {
                    if peer.rx_end - peer.rx_start >= HEADER_LEN {
                        let mut raw = [0u8; HEADER_LEN];
                        raw.copy_from_slice(&peer.rxbuf[peer.rx_start..peer.rx_start + HEADER_LEN]);
                        peer.rx_start += HEADER_LEN;
                        let h = Header::decode(&raw, self.limits.eager_max as u64)
                            .map_err(|e| format!("protocol violation: {}", e.0))?;
                        let next = self.on_header(p, h)?;
                        if let Some(Some(peer)) = self.peers.get_mut(p) {
                            peer.rx = next;
                        }
                        progressed = true;
                        continue;
                    }
                    // The last read, for a header, found the socket drained: what came is
                    // handled, the next frame is left to poll(2) (reading now would mostly
                    // find nothing, a system call for nothing per pump). After reads within a
                    // payload, reading goes on: a large message streams in while we read.
                    if budget == 0 || drained {
                        return Ok(progressed);
                    }
                    let want = HEADER_LEN - (peer.rx_end - peer.rx_start);
                    match peer.fill(want)? {
                        Fill::Got(n) => budget = budget.saturating_sub(n),
                        Fill::Drained(n) => {
                            budget = budget.saturating_sub(n);
                            drained = true;
                        }
                        Fill::Empty => return Ok(progressed),
                    }
                }
                Rx::Payload {
                    hdr,
                    mut target,
                    mut got,
                    chunk,
                } => {
                    let total = hdr.payload_len() as usize;
                    if got == total {
                        peer.copy.payload_done();
                        match chunk {
                            Some(at) => self.on_chunk_done(p, hdr, target, at),
                            None => self.on_payload_done(p, hdr, target),
                        }
                        progressed = true;
                        continue;
                    }
                    let base = chunk.map_or(0, |(base, _)| base);
                    let dst: &mut [u8] = match &mut target {
                        Target::Recv(r) => &mut r.buf.bytes_mut()[base + got..base + total],
                        Target::Temp(v) => &mut v[got..total],
                        Target::Discard => &mut [],
                    };
                    let avail = peer.rx_end - peer.rx_start;
                    if avail > 0 {
                        let n = avail.min(total - got);
                        if !dst.is_empty() {
                            copy_bytes(
                                &mut dst[..n],
                                &peer.rxbuf[peer.rx_start..peer.rx_start + n],
                            );
                        }
                        peer.rx_start += n;
                        got += n;
                        peer.rx = Rx::Payload {
                            hdr,
                            target,
                            got,
                            chunk,
                        };
                        progressed = true;
                        continue;
                    }
                    if budget == 0 {
                        peer.rx = Rx::Payload {
                            hdr,
                            target,
                            got,
                            chunk,
                        };
                        return Ok(progressed);
                    }
                    let direct = if peer.link.shm.is_some() {
                        !dst.is_empty()
                    } else {
                        dst.len() >= RXBUF / 2 && peer.copy.direct(total)
                    };
                    let r = if direct {
                        peer.read_direct(dst).inspect(|f| got += f.bytes())
                    } else {
                        peer.fill(total - got)
                    };
                    let r = match r {
                        Ok(r) => r,
                        Err(e) => {
                            // Keep the partial receive so that mark_dead fails it.
                            peer.rx = Rx::Payload {
                                hdr,
                                target,
                                got,
                                chunk,
                            };
                            return Err(e);
                        }
                    };
                    peer.rx = Rx::Payload {
                        hdr,
                        target,
                        got,
                        chunk,
                    };
                    match r {
                        Fill::Got(n) | Fill::Drained(n) => {
                            budget = budget.saturating_sub(n);
                            drained = false;
                        }
                        Fill::Empty => return Ok(progressed),
                    }
                }
            }
        }
    }

    /// Writes queued frames to peer `p` until the socket is full.
    pub(super) fn pump_tx(&mut self, p: usize) -> std::result::Result<bool, String> {
        let mut progressed = false;
        loop {
            let Some(Some(peer)) = self.peers.get_mut(p) else {
                return Ok(progressed);
            };
            if peer.out.is_empty() {
                return Ok(progressed);
            }
            // The front frame's payload, when large and going to a socket, is timed (see
            // `txcopy`): its key, whether its bytes come from the bounce buffer, and how many
            // bytes of the frame are left.
            let mut timed = None;
            let started;
            let written = {
                let mut iov = [IoSlice::new(&[]); MAX_IOV];
                let mut k = 0;
                let skip = peer.out_off;
                let mut frames = peer.out.iter();
                let mut more = true;
                if let Some(o) = frames.next() {
                    let rest = o.payload_bytes();
                    let first = skip < HEADER_LEN;
                    // By the whole message's size (a Data frame carries one chunk of it).
                    let message = || o.payload.as_ref().map_or(0, |b| b.bytes().len());
                    if peer.link.shm.is_none() && !rest.is_empty() && self.tx_rate.times(message())
                    {
                        if let Some(id) = o.send_id {
                            let key = (id, o.base);
                            // Now and then a payload goes through the bounce buffer from its
                            // start: the speed to expect.
                            if first && self.tx_rate.probe() {
                                peer.tx.start(key);
                            }
                            timed = Some((key, false, HEADER_LEN + o.plen - skip));
                        }
                    }
                    if first {
                        iov[k] = IoSlice::new(&o.hdr[skip..]);
                        k += 1;
                    }
                    let pos = skip.saturating_sub(HEADER_LEN).min(rest.len());
                    let bytes = match &mut timed {
                        Some((key, bounced, _)) => {
                            let (bytes, early) = peer.tx.next(*key, rest, pos);
                            *bounced = bytes.as_ptr() != rest[pos..].as_ptr();
                            // The frame's next bytes come from the next piece: nothing after
                            // them.
                            more = !early;
                            bytes
                        }
                        None => &rest[pos..],
                    };
                    if !bytes.is_empty() {
                        iov[k] = IoSlice::new(bytes);
                        k += 1;
                    }
                }
                for o in frames {
                    if !more || k + 2 > MAX_IOV {
                        break;
                    }
                    iov[k] = IoSlice::new(&o.hdr);
                    k += 1;
                    let payload = o.payload_bytes();
                    if !payload.is_empty() {
                        iov[k] = IoSlice::new(payload);
                        k += 1;
                    }
                }
                started = timed.is_some().then(Instant::now);
                match peer.link.write(&iov[..k])? {
                    0 => return Ok(progressed),
                    n => n,
                }
            };
            if let (Some((key, bounced, left)), Some(t)) = (timed, started) {
                if self.tx_rate.slow(written, t.elapsed(), bounced) && written < left {
                    peer.tx.start(key);
                }
            }
            progressed = true;
            // Every frame `written` completes leaves the queue, one at a time (no list: this
            // runs on every send). What `frame_written` queues goes behind them all. A
            // zero-length tail frame has been written once its header has.
            let mut n = written;
            while n > 0 {
                let Some(Some(peer)) = self.peers.get_mut(p) else {
                    break;
                };
                let Some(front) = peer.out.front() else { break };
                let left = HEADER_LEN + front.plen - peer.out_off;
                if n < left {
                    peer.out_off += n;
                    break;
                }
                n -= left;
                peer.out_off = 0;
                if let Some(o) = peer.out.pop_front() {
                    self.frame_written(p, o);
                }
            }
        }
    }

    pub(super) fn frame_written(&mut self, p: usize, o: Out) {
        let Some(id) = o.send_id else { return };
        match o.kind {
            Kind::Eager => match self.sends.get_mut(&id) {
                Some(s) if s.waits_for_ack() => s.buf = o.payload,
                Some(_) => self.send_done(p, id, o.payload),
                None => {}
            },
            Kind::Data => {
                let end = o.base + o.plen;
                let more = self.sends.get(&id).filter(|s| end < s.len);
                if let Some(&PendingSend { len, dtype, .. }) = more {
                    if let Some(buf) = o.payload {
                        // Behind everything queued meanwhile (replies first): the next chunk.
                        let next = data_chunk(id, dtype, buf, (end, len), self.chunk(p));
                        self.push_out(p, next);
                    }
                    return;
                }
                self.send_done(p, id, o.payload);
            }
            _ => {}
        }
    }

    /// Send `id` to `p` succeeded once written: it gives its buffer back.
    pub(super) fn send_done(&mut self, p: usize, id: u64, buf: Option<BoxBuf>) {
        if let Some(s) = self.sends.remove(&id) {
            s.cell.complete(Ok(s.status(p)), buf);
        }
    }

    /// Writes, reads, and (with `flush_replies`) writes again what reading produced.
    pub(super) fn pump(&mut self, p: usize, read: bool, write: bool, flush_replies: bool) -> bool {
        let live = matches!(self.peers.get(p), Some(Some(peer)) if peer.dead.is_none());
        if !live {
            return false;
        }
        self.poll_lane_acks(p);
        let r = (if write { self.pump_tx(p) } else { Ok(false) })
            .and_then(|a| Ok(a | (read && self.pump_lane(p)?)))
            .and_then(|a| Ok(a | (read && self.pump_rx(p)?)))
            .and_then(|a| Ok(a | (flush_replies && self.pump_tx(p)?)));
        r.unwrap_or_else(|reason| {
            self.mark_dead(p, reason);
            true
        })
    }
}

/// The frame that carries `buf[base..]` of message `msg_id` (`len` bytes in all), up to one
/// `chunk`.
pub(super) fn data_chunk(
    msg_id: u64,
    dtype: DType,
    buf: BoxBuf,
    (base, len): (usize, usize),
    chunk: usize,
) -> Out {
    let plen = (len - base).min(chunk);
    let hdr = Header {
        kind: Kind::Data,
        dtype,
        ctx: 0,
        tag: 0,
        aux: 0,
        msg_id,
        len: plen as u64,
        fp: Fingerprint::NONE,
    };
    Out {
        hdr: hdr.encode(),
        kind: Kind::Data,
        payload: Some(buf),
        base,
        plen,
        send_id: Some(msg_id),
    }
}

impl Out {
    /// The bytes this frame carries after its header.
    fn payload_bytes(&self) -> &[u8] {
        self.payload
            .as_ref()
            .map(|b| &b.bytes()[self.base..self.base + self.plen])
            .unwrap_or(&[])
    }
}
