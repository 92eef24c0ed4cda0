//! Composite collectives' streamed exchanges (the 1-bit all_reduce's two phases), over the
//! backend's point-to-point: blocks are produced and consumed one at a time while the others
//! travel.
//!
//! Owns: the order blocks go out and come in. Must not know: the backend (any backend's
//! point-to-point carries them; only its eager size is asked).

use std::time::Instant;

use super::Inner;
use crate::backend::CTX_COLL;
use crate::call::Envelope;
use crate::call::{Call, CallKind};
use crate::commslog::count_sent;
use crate::dtype::DType;
use crate::error::Result;
use crate::work::{boxed, wait_all, Pending, Work};

impl Inner {
    /// An equal all_to_all of byte blocks produced one at a time: `produce(d, block)` writes the
    /// block for rank `d`, peers' blocks first, in ring order from the next rank, each sent as
    /// soon as it is written, this rank's own last. `output` receives rank `q`'s block for us
    /// at `q · per`. See [`exchange`](Self::exchange) for how blocks travel. Part of a
    /// composite operation: not logged alone.
    pub(crate) fn all_to_all_streamed(
        &self,
        tag: u32,
        per: usize,
        output: &mut [u8],
        produce: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<()> {
        let n = self.size();
        if output.len() != n * per {
            let detail = format!("output holds {} bytes, needs {n} x {per}", output.len());
            return Err(self.invalid("all_to_all", detail));
        }
        let call = Call::new(CallKind::AllToAll, n * per)
            .bytes(n * per)
            .quiet(true);
        let blocks = self.exchange(&call, tag, per, produce, &mut || {})?;
        for (q, b) in blocks.into_iter().enumerate() {
            output[q * per..(q + 1) * per].copy_from_slice(&b);
            self.pool.give(b);
        }
        Ok(())
    }

    /// An all_gather of one byte block per rank, consumed rank by rank: `consume(q, block)`
    /// gets this rank's own block first, while the others are on their way, then the peers'.
    /// Part of a composite operation: not logged alone.
    pub(crate) fn all_gather_streamed(
        &self,
        tag: u32,
        block: &[u8],
        consume: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let (n, me, per) = (self.size(), self.rank, block.len());
        let call = Call::new(CallKind::AllGather, per)
            .bytes(n * per)
            .quiet(true);
        let mut fill = |_: usize, out: &mut [u8]| out.copy_from_slice(block);
        let blocks = self.exchange(&call, tag, per, &mut fill, &mut || consume(me, block))?;
        for (q, b) in blocks.into_iter().enumerate() {
            if q != me {
                consume(q, &b);
            }
            self.pool.give(b);
        }
        Ok(())
    }

    /// One round with every peer, for the streamed collectives: receives from every peer posted
    /// first; then `fill(d, block)` for every rank `d` in ring order from the next one, each
    /// peer's block sent as soon as it is filled and this rank's own filled last; then
    /// `overlap()` while the transfers run. Returns every rank's block for us, by rank (pool
    /// buffers). Cancels the call everywhere when it fails.
    ///
    /// On the native transports a block travels as eager messages of at most the eager size:
    /// every receive is posted before anything is sent, so none needs the clear-to-send
    /// round trip of a large message, which on a slow link waits behind the peer's own data
    /// (a 1 MiB exchange over 1 Gbit/s: 8.4 ms on the wire, up to twice that with the
    /// handshake).
    fn exchange(
        &self,
        call: &Call,
        tag: u32,
        per: usize,
        fill: &mut dyn FnMut(usize, &mut [u8]),
        overlap: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<u8>>> {
        let r = self.exchange_rounds(call, tag, per, fill, overlap);
        if let Err(e) = &r {
            self.backend.collective_failed(call, DType::U8, tag, e);
        }
        r
    }

    fn exchange_rounds(
        &self,
        call: &Call,
        tag: u32,
        per: usize,
        fill: &mut dyn FnMut(usize, &mut [u8]),
        overlap: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<u8>>> {
        let (n, me) = (self.size(), self.rank);
        let deadline = Instant::now() + self.timeout;
        let env = Envelope {
            op: call.kind.name(),
            dtype: DType::U8,
            ctx: CTX_COLL,
            tag,
            fp: call.fingerprint(),
        };
        let eager_max = self.backend.eager_max();
        let piece = eager_max.unwrap_or(per).max(1);
        let pieces = |len: usize| {
            (0..len.div_ceil(piece)).map(move |i| i * piece..((i + 1) * piece).min(len))
        };
        let mut recvs: Vec<(usize, std::ops::Range<usize>, Work<Vec<u8>>)> = Vec::new();
        let mut blocks: Vec<Vec<u8>> = (0..n).map(|_| self.pool.take_len(per)).collect();
        for i in 1..n {
            let q = (me + n - i) % n;
            for range in pieces(per) {
                let buf: Vec<u8> = self.pool.take_len(range.len());
                recvs.push((q, range, self.post_recv(env, boxed(buf), Some(q))?));
            }
        }
        let mut sends: Vec<Work<Vec<u8>>> = Vec::new();
        for i in 1..=n {
            let d = (me + i) % n;
            // Peer d's slot holds what we send it until its block to us arrives below.
            fill(d, &mut blocks[d]);
            if d == me {
                continue;
            }
            count_sent(per);
            for range in pieces(per) {
                let mut part: Vec<u8> = self.pool.take();
                part.extend_from_slice(&blocks[d][range]);
                let w = self.post_send(env, Box::new(part), d)?;
                // As in `execute_rounds`: a small send finishes in the background.
                if eager_max.is_none_or(|m| piece > m) {
                    sends.push(w);
                }
            }
        }
        overlap();
        {
            let mut all: Vec<&mut dyn Pending> = Vec::with_capacity(recvs.len() + sends.len());
            all.extend(recvs.iter_mut().map(|(_, _, w)| w as &mut dyn Pending));
            all.extend(sends.iter_mut().map(|w| w as &mut dyn Pending));
            wait_all(&mut all, deadline, self.timeout)?;
        }
        for (q, range, w) in recvs {
            let data = w.into_buffer()?;
            blocks[q][range].copy_from_slice(&data);
            self.pool.give(data);
        }
        for w in sends {
            if let Ok(b) = w.into_buffer() {
                self.pool.give(b);
            }
        }
        Ok(blocks)
    }
}
