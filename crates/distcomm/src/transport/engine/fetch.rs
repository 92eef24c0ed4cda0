//! Cross-memory copies towards shared-memory peers: the receiver fetches a large message
//! from the sender's buffer (Rget), from `choice::SPLIT_MIN` bytes on with the sender writing
//! the head meanwhile (Rput, answered by Put); where the kernel refuses, the message streams
//! (Cts, Data) instead and the link stops trying.
//!
//! Owns the lent buffers' lifecycle; knows nothing of matching or of sockets.

use super::*;

impl State {
    /// A peer asks us to fetch a large message (`addr`: its buffer address, 8 bytes).
    pub(super) fn on_rget(&mut self, src: usize, h: Header, addr: Vec<u8>) {
        if let Some((r, addr)) = self.match_arrived(src, &h, addr) {
            self.fetch(src, h, r, &addr);
        }
    }

    /// Copies a matched Rget message straight from the sender's memory and acknowledges it;
    /// a message of at least `choice::SPLIT_MIN` bytes into memory we own is copied by both sides at
    /// once (we ask the sender to write the head with an Rput while we read the tail). Where
    /// the kernel refuses, has it streamed instead (Cts), and stops trying on that link.
    pub(super) fn fetch(&mut self, src: usize, h: Header, mut r: Posted, addr: &[u8]) {
        let addr = address(addr);
        let pid = match self.peers.get(src) {
            Some(Some(peer)) => peer.link.cma_pid(),
            _ => None,
        };
        #[cfg(target_os = "linux")]
        if let Some(pid) = pid {
            let n = h.len as usize;
            let split = choice::split(n, !r.buf.is_view());
            if split > 0 {
                let ours = r.buf.bytes().as_ptr() as u64;
                self.push_out(
                    src,
                    Out {
                        hdr: control(Kind::Rput, h.msg_id, 0, split as u64, h.dtype, h.fp).encode(),
                        kind: Kind::Rput,
                        payload: Some(Box::new(ours.to_le_bytes().to_vec())),
                        base: 0,
                        plen: RGET_PAYLOAD,
                        send_id: None,
                    },
                );
                if let Err(reason) = self.pump_tx(src) {
                    self.mark_dead(src, reason);
                }
            }
            let tail = &mut r.buf.bytes_mut()[split..n];
            let copied = shm::cma_read(pid, addr + split as u64, tail);
            if split > 0 {
                r.cell.kick();
                let own_failed = copied.is_err();
                let lent = Lent {
                    r,
                    h,
                    addr,
                    split,
                    own_failed,
                };
                self.lent.insert((src, h.msg_id), lent);
                return;
            }
            if copied.is_ok() {
                self.reply(
                    src,
                    control(Kind::Ack, h.msg_id, 0, 0, h.dtype, Fingerprint::NONE),
                );
                complete_recv(r, src, &h);
                return;
            }
            if let Some(Some(peer)) = self.peers.get_mut(src) {
                peer.link.no_more_cma();
            }
        }
        let _ = (pid, addr);
        self.stream_instead(src, h, r);
    }

    /// Has a large message streamed (Cts, then Data) instead of copied directly.
    pub(super) fn stream_instead(&mut self, src: usize, h: Header, r: Posted) {
        let cts = control(Kind::Cts, h.msg_id, 0, 0, h.dtype, Fingerprint::NONE);
        self.reply(src, cts);
        r.cell.kick();
        self.rdv.expect(src, h.msg_id, r, h.len);
    }

    /// Sender side of an Rput: write the head of message `h.msg_id` into the receiver's buffer
    /// at `addr`, and say whether that worked (Put).
    pub(super) fn on_rput(
        &mut self,
        p: usize,
        h: Header,
        addr: Vec<u8>,
    ) -> std::result::Result<(), String> {
        let addr = address(&addr);
        let pid = match self.peers.get(p) {
            Some(Some(peer)) => peer.link.cma_pid(),
            _ => None,
        };
        let Some(s) = self.sends.get(&h.msg_id).filter(|s| s.dst == p) else {
            return Err(format!(
                "protocol violation: put request for unknown message {}",
                h.msg_id
            ));
        };
        let n = (h.len as usize).min(s.len);
        let written = match (&s.buf, pid) {
            #[cfg(target_os = "linux")]
            (Some(buf), Some(pid)) => shm::cma_write(pid, addr, &buf.bytes()[..n]).is_ok(),
            _ => false,
        };
        s.cell.kick();
        let put = control(
            Kind::Put,
            h.msg_id,
            u32::from(!written),
            0,
            h.dtype,
            Fingerprint::NONE,
        );
        self.reply(p, put);
        Ok(())
    }

    /// Receiver side of Put: the sender wrote the head (or could not). Finish the message.
    pub(super) fn on_put(&mut self, p: usize, h: Header) -> std::result::Result<(), String> {
        let Some(l) = self.lent.remove(&(p, h.msg_id)) else {
            return Err(format!(
                "protocol violation: put for unknown message {}",
                h.msg_id
            ));
        };
        let Lent {
            mut r,
            h: rh,
            addr,
            split,
            own_failed,
        } = l;
        let mut ok = !own_failed;
        if ok && h.aux != 0 {
            // The sender could not write the head: read it ourselves, or have it all streamed.
            let pid = self.peers.get(p).and_then(|x| x.as_ref()?.link.cma_pid());
            ok = match pid {
                #[cfg(target_os = "linux")]
                Some(pid) => shm::cma_read(pid, addr, &mut r.buf.bytes_mut()[..split]).is_ok(),
                _ => false,
            };
            let _ = (addr, split);
        }
        if ok {
            self.reply(
                p,
                control(Kind::Ack, rh.msg_id, 0, 0, rh.dtype, Fingerprint::NONE),
            );
            complete_recv(r, p, &rh);
        } else {
            if let Some(Some(peer)) = self.peers.get_mut(p) {
                peer.link.no_more_cma();
            }
            self.stream_instead(p, rh, r);
        }
        Ok(())
    }
}
