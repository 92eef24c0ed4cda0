//! The protocol core: the decisions of point-to-point messaging as plain state machines, with
//! no sockets, clocks, threads or locks (quinn's sans-I/O shape; the `ob1` PML over Open MPI's
//! byte-moving BTLs). The engine (`tcp`) feeds them what arrived and what was posted and
//! carries out what they decide.
//!
//! * [`matching`]: posted and unexpected queues, non-overtaking per (source, context, tag),
//!   receives from any source;
//! * [`choice`]: which protocol a message takes (lane, eager, cross-memory fetch, rendezvous)
//!   from its size and what the link can do;
//! * [`refusal`]: whether a matched receive takes a message, and the errors both sides report
//!   when it does not (too large, wrong element type, a check word that differs);
//! * [`reassembly`]: large messages arriving in chunks into the receive cleared for them;
//! * [`cancel`]: keys (context, tag) whose traffic was cancelled, with an opaque record of why.
//!
//! What it must not know: how bytes move (sockets, rings, `poll(2)`), time, and what the layers
//! above use a context, a tag or a check word for.

pub(crate) mod cancel;
pub(crate) mod choice;
pub(crate) mod matching;
pub(crate) mod reassembly;
pub(crate) mod refusal;

/// The pieces together, as the engine drives them for one large message: matching pairs the
/// announcement (Rts) with a receive in either posting order, the choice says rendezvous, the
/// refusal check passes, reassembly takes the chunks; a peer lost mid-transfer takes its
/// receive out of reassembly (so it can fail, naming that peer) and leaves the others alone.
#[cfg(test)]
mod tests {
    use super::choice::{Limits, Wire};
    use super::matching::{Key, Matcher, Message, Receive};
    use super::reassembly::{Chunk, Reassembly};
    use super::refusal::{check, Expect};
    use crate::dtype::DType;
    use crate::transport::frame::{Fingerprint, Header, Kind};

    #[derive(Debug, PartialEq)]
    struct Recv {
        id: u32,
        src: Option<usize>,
        cap: u64,
    }
    impl Receive for Recv {
        fn source(&self) -> Option<usize> {
            self.src
        }
        fn key(&self) -> Key {
            (0, 9)
        }
    }
    struct Rts {
        src: usize,
        h: Header,
    }
    impl Message for Rts {
        fn source(&self) -> usize {
            self.src
        }
        fn key(&self) -> Key {
            (self.h.ctx, self.h.tag)
        }
    }

    fn rts(msg_id: u64, len: u64) -> Header {
        Header {
            kind: Kind::Rts,
            dtype: DType::F32,
            ctx: 0,
            tag: 9,
            aux: 0,
            msg_id,
            len,
            fp: Fingerprint::NONE,
        }
    }

    /// Matches `r` with an Rts from `src` in the given order; the cleared receive.
    fn pair(m: &mut Matcher<Recv, Rts>, r: Recv, src: usize, h: Header, post_first: bool) -> Recv {
        if post_first {
            m.push_posted(r);
            m.take_posted(src, (h.ctx, h.tag))
                .expect("the posted receive takes the Rts")
        } else {
            m.push_unexpected(Rts { src, h });
            let u = m
                .take_unexpected(r.src, r.key())
                .expect("the Rts waits for it");
            assert_eq!(u.h.msg_id, h.msg_id);
            r
        }
    }

    #[test]
    fn rendezvous_in_both_posting_orders() {
        let limits = Limits {
            eager_max: 1024,
            shm_eager_max: 1024,
        };
        for post_first in [true, false] {
            let (len, src) = (10_000u64, 1);
            assert_eq!(limits.wire(len as usize, false), Wire::Rendezvous);
            let mut m = Matcher::default();
            let h = rts(7, len);
            let r = pair(
                &mut m,
                Recv {
                    id: 1,
                    src: Some(src),
                    cap: len,
                },
                src,
                h,
                post_first,
            );
            let want = Expect {
                op: "recv",
                dtype: DType::F32,
                check: Fingerprint::NONE,
                cap: r.cap,
            };
            assert!(check(0, want, src, &h).is_ok());
            let mut re = Reassembly::default();
            re.expect(src, h.msg_id, r, h.len);
            let (mut at, mut chunks) = (0u64, 0);
            let done = loop {
                let n = 4096.min(len - at);
                let Chunk::Into { r, base, whole } = re.chunk(src, h.msg_id, n) else {
                    panic!("chunk refused");
                };
                assert_eq!((base as u64, whole), (at, len));
                at += n;
                chunks += 1;
                if let Some(r) = re.chunk_done(src, h.msg_id, r, (base, n, whole)) {
                    break r;
                }
            };
            assert_eq!((done.id, at, chunks), (1, len, 3));
            assert!(matches!(re.chunk(src, h.msg_id, 1), Chunk::Unknown));
        }
    }

    #[test]
    fn peer_loss_mid_transfer_takes_only_its_receive() {
        let mut m: Matcher<Recv, Rts> = Matcher::default();
        let mut re = Reassembly::default();
        // Two large receives under way, from ranks 1 and 2; an any-source receive posted.
        for (id, src) in [(1, 1), (2, 2)] {
            let r = pair(
                &mut m,
                Recv {
                    id,
                    src: Some(src),
                    cap: 8192,
                },
                src,
                rts(u64::from(id), 8192),
                true,
            );
            re.expect(src, u64::from(id), r, 8192);
        }
        m.push_posted(Recv {
            id: 3,
            src: None,
            cap: 8,
        });
        let Chunk::Into { r, base, whole } = re.chunk(1, 1, 4096) else {
            panic!("chunk refused")
        };
        assert!(re.chunk_done(1, 1, r, (base, 4096, whole)).is_none());
        // Rank 1 dies half-way: its receive comes out (to fail naming rank 1).
        let lost = re.withdraw_source(1);
        assert_eq!(lost.iter().map(|r| r.id).collect::<Vec<_>>(), [1]);
        assert!(m.withdraw_posted(|r| r.src == Some(1)).is_empty());
        // Rank 2's transfer and the any-source receive are untouched.
        assert!(matches!(re.chunk(2, 2, 8192), Chunk::Into { base: 0, .. }));
        assert_eq!(m.take_posted(2, (0, 9)).map(|r| r.id), Some(3));
    }
}
