//! Refused messages and bad arguments: typed errors on both sides (invalid rank or tag, a
//! message too large for its receive, mismatched element types, small messages in the lane),
//! and the link carries on.

use distcomm::{Error, ProcessGroup};

use crate::common::{pattern, run, run_native};

#[test]
fn invalid_rank_and_tag_are_typed_errors() {
    run(
        "refusals::invalid_rank_and_tag_are_typed_errors",
        &[1, 3],
        |g| {
            let n = g.size();
            match g.isend(vec![1u8], n, 0) {
                Err(Error::InvalidRank {
                    peer, world, op, ..
                }) => {
                    assert_eq!((peer, world, op), (n, n, "isend"))
                }
                other => panic!("{other:?}"),
            }
            assert!(matches!(
                g.irecv(vec![1u8], n + 5, 0),
                Err(Error::InvalidRank { .. })
            ));
            assert!(matches!(
                g.send(&[1u8], 0, distcomm::MAX_TAG + 1),
                Err(Error::TagOutOfRange { .. })
            ));
            g.barrier().unwrap();
        },
    );
}

fn size_mismatch(g: &ProcessGroup, len: usize, tag: u32) {
    let peer = 1 - g.rank();
    if g.rank() == 0 {
        let data = pattern(1, len);
        let s = g.isend(data, peer, tag).unwrap();
        match s.wait() {
            Err(Error::MessageTooLarge {
                sent,
                capacity,
                src,
                dst,
                ..
            }) => {
                assert_eq!(
                    (sent, capacity, src, dst),
                    (len as u64, (len / 2) as u64, 0, 1)
                )
            }
            other => panic!("sender of {len} B: {other:?}"),
        }
    } else {
        let sentinel = vec![0xEEu8; len / 2];
        let r = g.irecv(sentinel, peer, tag).unwrap();
        match r.wait() {
            Err(Error::MessageTooLarge { sent, capacity, .. }) => {
                assert_eq!((sent, capacity), (len as u64, (len / 2) as u64))
            }
            other => panic!("receiver of {len} B: {other:?}"),
        }
        // Nothing is published: the failed receive gives no buffer back.
        assert!(r.into_buffer().is_err());
    }
}

#[test]
fn oversized_message_fails_both_sides() {
    run_native("refusals::oversized_message_fails_both_sides", &[2], |g| {
        size_mismatch(g, 1000, 1); // eager
        size_mismatch(g, 4 << 20, 2); // receiver-ready handshake
                                      // The connection survives: normal traffic continues.
        exchange_pair(g);
    });
}

fn exchange_pair(g: &ProcessGroup) {
    let peer = 1 - g.rank();
    let r = g.irecv(vec![0i32; 3], peer, 77).unwrap();
    g.send(&[g.rank() as i32; 3], peer, 77).unwrap();
    r.wait().unwrap();
    assert_eq!(r.into_buffer().unwrap(), vec![peer as i32; 3]);
}

#[test]
fn element_type_mismatch_fails_both_sides() {
    run_native(
        "refusals::element_type_mismatch_fails_both_sides",
        &[2],
        |g| {
            let peer = 1 - g.rank();
            for (tag, len) in [(1u32, 10usize), (2, 1 << 20)] {
                if g.rank() == 0 {
                    let s = g.isend(vec![1f32; len], peer, tag).unwrap();
                    match s.wait() {
                        Err(Error::DTypeMismatch { sent, expected, .. }) => {
                            assert_eq!(
                                (sent, expected),
                                (distcomm::DType::F32, distcomm::DType::I32)
                            )
                        }
                        other => panic!("{other:?}"),
                    }
                } else {
                    let r = g.irecv(vec![0i32; len], peer, tag).unwrap();
                    assert!(matches!(r.wait(), Err(Error::DTypeMismatch { .. })));
                }
            }
            // Raw bytes accept any element type.
            if g.rank() == 0 {
                g.send(&[1.0f32], peer, 3).unwrap();
            } else {
                let r = g.irecv_bytes(vec![0u8; 4], peer, 3).unwrap();
                r.wait().unwrap();
                assert_eq!(r.into_buffer().unwrap(), 1.0f32.to_le_bytes());
            }
            exchange_pair(g);
        },
    );
}

/// The refusals of small messages reach both sides, whichever call sent or received them.
#[test]
fn small_message_refusals_fail_both_sides() {
    run_native(
        "refusals::small_message_refusals_fail_both_sides",
        &[2],
        |g| {
            let peer = 1 - g.rank();
            for nonblocking in [false, true] {
                let tag = u32::from(nonblocking);
                if g.rank() == 0 {
                    // Wrong element type.
                    let r = if nonblocking {
                        g.isend(vec![1f32; 2], peer, tag)
                            .and_then(|w| w.wait().map(|_| ()))
                    } else {
                        g.send(&[1f32; 2], peer, tag)
                    };
                    match r {
                        Err(Error::DTypeMismatch { sent, expected, .. }) => {
                            assert_eq!(
                                (sent, expected),
                                (distcomm::DType::F32, distcomm::DType::I32)
                            )
                        }
                        other => panic!("sender of a mistyped message: {other:?}"),
                    }
                    // Too large for the receive.
                    let r = if nonblocking {
                        g.isend(vec![7u8; 16], peer, tag)
                            .and_then(|w| w.wait().map(|_| ()))
                    } else {
                        g.send(&[7u8; 16], peer, tag)
                    };
                    match r {
                        Err(Error::MessageTooLarge { sent, capacity, .. }) => {
                            assert_eq!((sent, capacity), (16, 8))
                        }
                        other => panic!("sender of an oversized message: {other:?}"),
                    }
                } else {
                    let mut typed = [5i32; 2];
                    let r = if nonblocking {
                        g.irecv(vec![5i32; 2], peer, tag).and_then(|w| w.wait())
                    } else {
                        g.recv(&mut typed, peer, tag)
                    };
                    assert!(matches!(r, Err(Error::DTypeMismatch { .. })), "{r:?}");
                    assert_eq!(typed, [5; 2], "a refused message writes nothing");
                    let mut small = [9u8; 8];
                    let r = if nonblocking {
                        g.irecv(vec![9u8; 8], peer, tag).and_then(|w| w.wait())
                    } else {
                        g.recv(&mut small, peer, tag)
                    };
                    match r {
                        Err(Error::MessageTooLarge { sent, capacity, .. }) => {
                            assert_eq!((sent, capacity), (16, 8))
                        }
                        other => panic!("receiver of an oversized message: {other:?}"),
                    }
                    assert_eq!(small, [9; 8], "a refused message writes nothing");
                }
            }
            // A lane message with its payload in a chunk, refused for its size.
            if g.rank() == 0 {
                match g.send(&[3u8; 600], peer, 2) {
                    Err(Error::MessageTooLarge { sent, capacity, .. }) => {
                        assert_eq!((sent, capacity), (600, 300))
                    }
                    other => panic!("sender of 600 B into 300 B: {other:?}"),
                }
            } else {
                let mut out = [1u8; 300];
                assert!(matches!(
                    g.recv(&mut out, peer, 2),
                    Err(Error::MessageTooLarge { .. })
                ));
                assert_eq!(out, [1; 300], "a refused message writes nothing");
            }
            // The link carries on.
            exchange_pair(g);
        },
    );
}

/// A receiver already waiting when the message comes (a ping-pong's rhythm: the shared-memory
/// lane then lets its receive take the message before the sender waits for an answer) still
/// refuses what it must, on both sides, and takes what it may, whichever call sends or
/// receives; a message of another tag in between waits for its own receive.
#[test]
fn refusals_reach_both_sides_when_the_receiver_waits_first() {
    run_native(
        "refusals::refusals_reach_both_sides_when_the_receiver_waits_first",
        &[2],
        |g| {
            let peer = 1 - g.rank();
            for round in 0..400u32 {
                let (kind, handles) = (round % 4, round / 4 % 2 == 1);
                if g.rank() == 1 {
                    // "Go", then straight into the receive.
                    g.send(&[round as u8], peer, 9).unwrap();
                    let r = match kind {
                        0 | 3 => {
                            let got = if handles {
                                let w = g.irecv(vec![0f32; 2], peer, 3).unwrap();
                                w.into_buffer().map(|b| (8, [b[0], b[1]]))
                            } else {
                                let mut out = [0f32; 2];
                                g.recv(&mut out, peer, 3).map(|s| (s.bytes, out))
                            };
                            assert_eq!(got.unwrap(), (8, [f32::from(round as u8), 2.0]));
                            if kind == 3 {
                                let mut other = [0u8; 4];
                                g.recv(&mut other, peer, 4).unwrap();
                                assert_eq!(other, [round as u8; 4]);
                            }
                            continue;
                        }
                        1 => {
                            let mut small = [9u8; 8];
                            let r = if handles {
                                g.irecv(vec![9u8; 8], peer, 3)
                                    .and_then(|w| w.into_buffer())
                                    .map(|_| ())
                            } else {
                                g.recv(&mut small, peer, 3).map(|_| ())
                            };
                            assert_eq!(small, [9; 8], "a refused message writes nothing");
                            r
                        }
                        _ => {
                            let mut typed = [5i32; 2];
                            let r = if handles {
                                g.irecv(vec![5i32; 2], peer, 3)
                                    .and_then(|w| w.into_buffer())
                                    .map(|_| ())
                            } else {
                                g.recv(&mut typed, peer, 3).map(|_| ())
                            };
                            assert_eq!(typed, [5; 2], "a refused message writes nothing");
                            r
                        }
                    };
                    match (kind, r) {
                        (1, Err(Error::MessageTooLarge { sent, capacity, .. })) => {
                            assert_eq!((sent, capacity), (16, 8))
                        }
                        (2, Err(Error::DTypeMismatch { .. })) => {}
                        (k, other) => panic!("round {round}, receiver of kind {k}: {other:?}"),
                    }
                } else {
                    let mut go = [0u8];
                    g.recv(&mut go, peer, 9).unwrap();
                    assert_eq!(go[0], round as u8);
                    let send = |data: Vec<u8>, dtype_f32: bool| {
                        if dtype_f32 {
                            let v: Vec<f32> = data.iter().map(|&b| f32::from(b)).collect();
                            if handles {
                                g.isend(v, peer, 3).and_then(|w| w.wait().map(|_| ()))
                            } else {
                                g.send(&v, peer, 3)
                            }
                        } else if handles {
                            g.isend(data, peer, 3).and_then(|w| w.wait().map(|_| ()))
                        } else {
                            g.send(&data, peer, 3)
                        }
                    };
                    // (Its receive comes after tag 3's: a blocking send would wait for it.)
                    let other =
                        (kind == 3).then(|| g.isend(vec![round as u8; 4], peer, 4).unwrap());
                    let r = match kind {
                        0 | 3 => send(vec![round as u8, 2], true),
                        1 => send(vec![7u8; 16], false),
                        _ => send(vec![1, 2], true),
                    };
                    match (kind, r) {
                        (0 | 3, Ok(())) => {}
                        (1, Err(Error::MessageTooLarge { sent, capacity, .. })) => {
                            assert_eq!((sent, capacity), (16, 8))
                        }
                        (2, Err(Error::DTypeMismatch { sent, expected, .. })) => assert_eq!(
                            (sent, expected),
                            (distcomm::DType::F32, distcomm::DType::I32)
                        ),
                        (k, other) => panic!("round {round}, sender of kind {k}: {other:?}"),
                    }
                    if let Some(w) = other {
                        w.wait().unwrap();
                    }
                }
            }
            exchange_pair(g);
        },
    );
}
