//! Point-to-point over real processes and real sockets.

mod common;

use std::time::{Duration, Instant};

use common::{block_on, pattern, run, run_native};
use distcomm::{Error, ProcessGroup, Work};

const ALL: &[usize] = &[1, 2, 3, 4, 5];

fn ring(g: &ProcessGroup) -> (usize, usize) {
    let n = g.size();
    ((g.rank() + 1) % n, (g.rank() + n - 1) % n)
}

fn exchange(g: &ProcessGroup, len: usize, send_first: bool, tag: u32) {
    let (next, prev) = ring(g);
    let out = pattern((g.rank() * 1000 + len) as u64, len);
    let (s, r): (Work<Vec<u8>>, Work<Vec<u8>>);
    if send_first {
        s = g.isend(out.clone(), next, tag).unwrap();
        r = g.irecv(vec![0u8; len], prev, tag).unwrap();
    } else {
        r = g.irecv(vec![0u8; len], prev, tag).unwrap();
        s = g.isend(out.clone(), next, tag).unwrap();
    }
    let st = r.wait().unwrap();
    assert_eq!((st.peer, st.bytes, st.tag), (prev, len, tag));
    assert_eq!(s.wait().unwrap().bytes, len);
    let got = r.into_buffer().unwrap();
    assert!(
        got == pattern((prev * 1000 + len) as u64, len),
        "payload of {len} B from {prev} corrupted"
    );
    assert_eq!(
        s.into_buffer().unwrap(),
        out,
        "send buffer must come back intact"
    );
}

#[test]
fn isend_irecv_both_orders_all_sizes() {
    run("isend_irecv_both_orders_all_sizes", ALL, |g| {
        for (i, len) in [0usize, 1, 4096, 1 << 20, 64 << 20].into_iter().enumerate() {
            exchange(g, len, true, i as u32);
            exchange(g, len, false, 100 + i as u32);
        }
    });
}

#[test]
fn ring_of_sends_before_receives_never_deadlocks() {
    run(
        "ring_of_sends_before_receives_never_deadlocks",
        &[2, 3, 5],
        |g| {
            let (next, prev) = ring(g);
            // Large messages posted before any receive: needs a real progress engine.
            let sends: Vec<_> = (0..4)
                .map(|t| g.isend(vec![t as f32; 3 << 20], next, t).unwrap())
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            for t in 0..4 {
                let mut out = vec![0f32; 3 << 20];
                let st = g.recv(&mut out, prev, t).unwrap();
                assert_eq!(st.bytes, 12 << 20);
                assert!(out.iter().all(|&x| x == t as f32));
            }
            for s in sends {
                s.into_buffer().unwrap();
            }
        },
    );
}

#[test]
fn blocking_send_recv_typed() {
    run("blocking_send_recv_typed", &[2, 3], |g| {
        let (next, prev) = ring(g);
        let r = g.irecv(vec![0i64; 5], prev, 3).unwrap();
        g.send(&[g.rank() as i64; 5], next, 3).unwrap();
        r.wait().unwrap();
        assert_eq!(r.into_buffer().unwrap(), vec![prev as i64; 5]);
        let halfs = vec![half::bf16::from_f32(1.5); 7];
        let r = g.irecv(vec![half::bf16::ZERO; 7], prev, 4).unwrap();
        g.send(&halfs, next, 4).unwrap();
        r.wait().unwrap();
        assert_eq!(r.into_buffer().unwrap(), halfs);
    });
}

#[test]
fn many_outstanding_operations() {
    run("many_outstanding_operations", &[2, 4], |g| {
        let n = g.size();
        let per = 300;
        let mut recvs = Vec::new();
        for p in (0..n).filter(|&p| p != g.rank()) {
            for k in 0..per {
                let len = (k * 37) % 5000;
                recvs.push((p, k, len, g.irecv(vec![0u8; len], p, k as u32).unwrap()));
            }
        }
        let mut sends = Vec::new();
        for p in (0..n).filter(|&p| p != g.rank()) {
            for k in 0..per {
                let len = (k * 37) % 5000;
                sends.push(
                    g.isend(pattern((g.rank() * 7919 + k) as u64, len), p, k as u32)
                        .unwrap(),
                );
            }
        }
        for (p, k, len, w) in recvs {
            let got = w.into_buffer().unwrap();
            assert_eq!(got, pattern((p * 7919 + k) as u64, len));
        }
        for s in sends {
            s.into_buffer().unwrap();
        }
    });
}

#[test]
fn any_source_reports_who_sent() {
    run("any_source_reports_who_sent", &[1, 2, 3, 5], |g| {
        if g.rank() == 0 {
            let mut seen = Vec::new();
            for _ in 0..g.size() - 1 {
                let mut out = [0i32; 1];
                let st = g.recv_any(&mut out, 9).unwrap();
                assert_eq!(st.peer as i32, out[0]);
                assert_eq!(st.bytes, 4);
                seen.push(st.peer);
            }
            seen.sort();
            assert_eq!(seen, (1..g.size()).collect::<Vec<_>>());
        } else {
            g.send(&[g.rank() as i32], 0, 9).unwrap();
        }
        g.barrier().unwrap();
    });
}

#[test]
fn tags_match_and_order_is_non_overtaking() {
    run("tags_match_and_order_is_non_overtaking", &[2, 3], |g| {
        let n = g.size();
        if g.rank() != 0 {
            // Interleave two tags, mixing eager and large messages.
            let mut sends = Vec::new();
            for i in 0..40u32 {
                let len = if i % 7 == 0 { 100_000 } else { 3 };
                let mut v = vec![0i32; len];
                v[0] = i as i32;
                sends.push(g.isend(v, 0, 1 + (i % 2)).unwrap());
            }
            for s in sends {
                s.into_buffer().unwrap();
            }
        } else {
            for src in 1..n {
                // Everything with tag 2 first, then tag 1: each in the order it was posted.
                for tag in [2u32, 1] {
                    let mut last = None;
                    for _ in 0..20 {
                        let mut v = vec![0i32; 100_000];
                        let st = g.recv(&mut v, src, tag).unwrap();
                        assert_eq!(st.tag, tag);
                        assert_eq!(v[0] % 2, tag as i32 - 1);
                        if let Some(l) = last {
                            assert!(v[0] > l, "message {} overtook {l}", v[0]);
                        }
                        last = Some(v[0]);
                    }
                }
            }
        }
        g.barrier().unwrap();
    });
}

#[test]
fn wait_timeout_keeps_the_operation() {
    run("wait_timeout_keeps_the_operation", &[2], |g| {
        let peer = 1 - g.rank();
        let r = g.irecv(vec![0u8; 16], peer, 5).unwrap();
        assert!(!r.is_completed());
        let t = Instant::now();
        match r.wait_timeout(Duration::from_millis(100)) {
            Err(Error::Timeout { peer: Some(p), .. }) => assert_eq!(p, peer),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(!r.is_completed());
        g.barrier().unwrap();
        let s = g.isend(vec![7u8; 16], peer, 5).unwrap();
        let st = r.wait().unwrap();
        assert_eq!(st.bytes, 16);
        // Sticky: the same answer again, and completed.
        assert_eq!(r.wait().unwrap(), st);
        assert!(r.is_completed());
        s.wait().unwrap();
        assert_eq!(r.into_buffer().unwrap(), vec![7u8; 16]);
    });
}

#[test]
fn work_is_a_future() {
    run("work_is_a_future", &[2], |g| {
        let peer = 1 - g.rank();
        let r = g.irecv(vec![0f64; 1000], peer, 1).unwrap();
        let s = g.isend(vec![g.rank() as f64; 1000], peer, 1).unwrap();
        let (a, b) = block_on(async { (r.await, s.await) });
        assert_eq!(a.unwrap().bytes, 8000);
        assert_eq!(b.unwrap().peer, peer);
    });
}

#[test]
fn dropped_receive_is_withdrawn() {
    run("dropped_receive_is_withdrawn", &[2], |g| {
        let peer = 1 - g.rank();
        if g.rank() == 0 {
            let r = g.irecv(vec![0u8; 4], peer, 2).unwrap();
            drop(r);
            g.barrier().unwrap();
            let mut out = [0u8; 4];
            g.recv(&mut out, peer, 2).unwrap();
            assert_eq!(out, [1, 2, 3, 4]);
        } else {
            g.barrier().unwrap();
            g.send(&[1u8, 2, 3, 4], peer, 2).unwrap();
        }
    });
}

#[test]
fn invalid_rank_and_tag_are_typed_errors() {
    run("invalid_rank_and_tag_are_typed_errors", &[1, 3], |g| {
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
    });
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
    run_native("oversized_message_fails_both_sides", &[2], |g| {
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
    run_native("element_type_mismatch_fails_both_sides", &[2], |g| {
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
    });
}

#[test]
fn peer_exit_mid_transfer_fails_dependent_operations() {
    run_native(
        "peer_exit_mid_transfer_fails_dependent_operations",
        &[2, 3, 4],
        |g| {
            if g.rank() == 1 {
                // Take part of a large message, then vanish without a word.
                let _r = g.irecv(vec![0u8; 1], 0, 99).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                std::process::exit(0);
            }
            let t = Instant::now();
            if g.rank() == 0 {
                let s = g.isend(vec![1u8; 32 << 20], 1, 1).unwrap();
                let r = g.irecv(vec![0u8; 8], 1, 2).unwrap();
                for res in [s.wait(), r.wait()] {
                    match res {
                        Err(Error::PeerLost {
                            peer: 1, rank: 0, ..
                        }) => {}
                        other => panic!("expected peer 1 lost, got {other:?}"),
                    }
                }
                assert!(
                    t.elapsed() < Duration::from_secs(5),
                    "detection took {:?}",
                    t.elapsed()
                );
                // A new operation towards the dead peer fails at once.
                assert!(matches!(
                    g.isend(vec![1u8], 1, 3).unwrap().wait(),
                    Err(Error::PeerLost { .. })
                ));
            }
            // Survivors still talk to each other.
            if g.size() > 2 {
                let other = if g.rank() == 0 { 2 } else { 0 };
                if g.rank() == 0 || g.rank() == 2 {
                    let r = g.irecv(vec![0u8; 3], other, 5).unwrap();
                    g.send(&[g.rank() as u8; 3], other, 5).unwrap();
                    r.wait().unwrap();
                    assert_eq!(r.into_buffer().unwrap(), vec![other as u8; 3]);
                }
            }
        },
    );
}

#[test]
fn abort_fails_pending_work() {
    run("abort_fails_pending_work", &[2], |g| {
        let peer = 1 - g.rank();
        if g.rank() == 1 {
            // Stay connected while rank 0 aborts, so that its failure is the abort, not us.
            std::thread::sleep(Duration::from_millis(300));
            return;
        }
        let r = g.irecv(vec![0u8; 8], peer, 1).unwrap();
        g.abort();
        assert!(matches!(r.wait(), Err(Error::Aborted { .. })));
        assert!(matches!(
            g.isend(vec![0u8], peer, 1).unwrap().wait(),
            Err(Error::Aborted { .. })
        ));
    });
}

#[test]
fn a_stopped_peer_times_out_without_closing_anything() {
    run_native(
        "a_stopped_peer_times_out_without_closing_anything",
        &[3],
        |g| {
            match g.rank() {
                1 => {
                    g.send(&[std::process::id() as i64], 0, 1).unwrap();
                    // Stopped by rank 0 here; once continued, answer and finish.
                    let mut go = [0u8];
                    g.recv(&mut go, 0, 9).unwrap();
                    g.send(&[42i32], 0, 5).unwrap();
                }
                0 => {
                    let mut pid = [0i64];
                    g.recv(&mut pid, 1, 1).unwrap();
                    let signal = |sig: libc::c_int| {
                        // SAFETY: kill(2) on the pid rank 1 just reported; no memory is involved.
                        let rc = unsafe { libc::kill(pid[0] as libc::pid_t, sig) };
                        assert_eq!(rc, 0, "kill({sig})");
                    };
                    signal(libc::SIGSTOP);
                    let reply = g.irecv(vec![0i32; 1], 1, 5).unwrap();
                    let t = Instant::now();
                    match reply.wait_timeout(Duration::from_millis(300)) {
                        Err(Error::Timeout {
                            peer: Some(1),
                            rank: 0,
                            ..
                        }) => {}
                        other => panic!("expected a timeout naming rank 1, got {other:?}"),
                    }
                    assert!(t.elapsed() < Duration::from_secs(2));
                    assert!(
                        g.peer_failure(1).is_none(),
                        "a timeout must not close the connection"
                    );
                    // Unrelated traffic is unaffected.
                    let r2 = g.irecv(vec![0u8; 2], 2, 7).unwrap();
                    g.send(&[5u8, 6], 2, 7).unwrap();
                    assert_eq!(r2.wait().unwrap().bytes, 2);
                    signal(libc::SIGCONT);
                    g.send(&[1u8], 1, 9).unwrap();
                    // The receive that timed out is still posted and now completes.
                    reply.wait().unwrap();
                    assert_eq!(reply.into_buffer().unwrap(), vec![42]);
                }
                _ => {
                    let r = g.irecv(vec![0u8; 2], 0, 7).unwrap();
                    g.send(&[1u8, 2], 0, 7).unwrap();
                    assert_eq!(r.into_buffer().unwrap(), vec![5, 6]);
                }
            }
        },
    );
}

#[test]
fn killed_rank_fails_every_dependent_operation_and_spares_the_rest() {
    run_native(
        "killed_rank_fails_every_dependent_operation_and_spares_the_rest",
        &[4],
        |g| {
            let r = g.rank();
            let victim = 3;
            let mut warm = [1f32];
            g.all_reduce(&mut warm, distcomm::ReduceOp::Sum).unwrap();
            if r == victim {
                // Streams towards everyone, then vanish, before joining the collective the others
                // have in flight, without any cleanup (no destructor runs: to the peers this is a
                // kill -9).
                let _sends: Vec<_> = (0..3)
                    .map(|p| g.isend(vec![7u8; 1 << 20], p, 1).unwrap())
                    .collect();
                std::thread::sleep(Duration::from_millis(50));
                std::process::exit(0);
            }
            // Survivors: receive streams from the victim (more than it will send), send to it,
            // and join the collective.
            let t = Instant::now();
            let mut pending: Vec<Work<Vec<u8>>> = (0..4)
                .map(|_| g.irecv(vec![0u8; 1 << 20], victim, 1).unwrap())
                .collect();
            pending.push(g.isend(vec![1u8; 4 << 20], victim, 2).unwrap());
            let coll = g
                .all_reduce_async(vec![1f32; 1 << 20], distcomm::ReduceOp::Sum)
                .unwrap();
            let mut lost = 0;
            for w in pending {
                match w.wait() {
                    Ok(_) => {}
                    Err(Error::PeerLost { peer, .. }) => {
                        assert_eq!(peer, victim);
                        lost += 1;
                    }
                    Err(e) => panic!("rank {r}: unexpected {e}"),
                }
            }
            let coll = coll.into_buffer();
            assert!(
                coll.is_err(),
                "the collective cannot succeed without rank {victim}"
            );
            let took = t.elapsed();
            assert!(lost >= 2, "rank {r}: only {lost} operations saw the loss");
            assert!(
                took < Duration::from_secs(2),
                "rank {r}: detection took {took:?}"
            );
            println!("rank {r}: {lost} operations failed with PeerLost(rank {victim}), collective failed, in {took:?} from posting (victim died ~50 ms in)");
            // The survivors still talk, point-to-point and in a new group.
            let (next, prev) = ((r + 1) % 3, (r + 2) % 3);
            let rr = g.irecv(vec![0u16 as u8; 1], prev, 3).unwrap();
            g.send(&[r as u8], next, 3).unwrap();
            rr.wait().unwrap();
            assert_eq!(rr.into_buffer().unwrap(), vec![prev as u8]);
            let survivors = g.new_group(&[0, 1, 2]).unwrap().unwrap();
            let mut x = [1i32];
            survivors
                .all_reduce(&mut x, distcomm::ReduceOp::Sum)
                .unwrap();
            assert_eq!(x[0], 3);
        },
    );
}

#[test]
fn blocking_calls_take_a_per_call_deadline() {
    run("blocking_calls_take_a_per_call_deadline", &[2], |g| {
        let peer = 1 - g.rank();
        let mut out = [9u8; 4];
        let t = Instant::now();
        match g.recv_timeout(&mut out, peer, 11, Duration::from_millis(150)) {
            Err(Error::Timeout { peer: Some(p), .. }) => assert_eq!(p, peer),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t.elapsed() >= Duration::from_millis(150) && t.elapsed() < Duration::from_secs(2));
        assert_eq!(
            out, [9u8; 4],
            "a timed-out receive leaves the buffer untouched"
        );
        g.barrier().unwrap();
        // The withdrawn receive does not swallow a later message.
        if g.rank() == 0 {
            g.send_timeout(&[1u8, 2, 3, 4], peer, 11, Duration::from_secs(5))
                .unwrap();
        } else {
            g.recv_timeout(&mut out, peer, 11, Duration::from_secs(5))
                .unwrap();
            assert_eq!(out, [1, 2, 3, 4]);
        }
    });
}

/// Small messages (which a shared-memory link carries in its lane, one cache line each) and
/// large ones (its ring), on one tag and through every receive call: each arrives in order.
#[test]
fn small_and_large_messages_on_one_tag_keep_their_order() {
    run(
        "small_and_large_messages_on_one_tag_keep_their_order",
        &[2],
        |g| {
            let lens = [
                8usize,
                100_000,
                8,
                1,
                32,
                4096,
                33,
                8,
                2 << 20,
                16,
                0,
                1000,
                1024,
                1025,
                88,
                8,
            ];
            let msg = |i: usize| {
                let mut v = pattern(i as u64, lens[i]);
                if let Some(b) = v.first_mut() {
                    *b = i as u8;
                }
                v
            };
            for round in 0..3 {
                if g.rank() == 0 {
                    // Nonblocking and blocking sends mixed, back to back.
                    let mut sends = Vec::new();
                    for i in 0..lens.len() {
                        if (i + round) % 3 == 0 {
                            g.send(&msg(i), 1, 7).unwrap();
                        } else {
                            sends.push(g.isend(msg(i), 1, 7).unwrap());
                        }
                    }
                    for s in sends {
                        s.into_buffer().unwrap();
                    }
                } else {
                    if round == 1 {
                        // Let everything arrive unexpected first.
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    // An early nonblocking receive comes before a later blocking one.
                    let first = g.irecv(vec![0u8; lens[0]], 0, 7).unwrap();
                    for (i, &len) in lens.iter().enumerate().skip(1) {
                        let mut out = vec![0u8; len];
                        let st = g.recv(&mut out, 0, 7).unwrap();
                        assert_eq!((st.peer, st.bytes), (0, len));
                        assert!(out == msg(i), "round {round}: message {i} out of order");
                    }
                    first.wait().unwrap();
                    assert_eq!(first.into_buffer().unwrap(), msg(0));
                }
            }
            g.barrier().unwrap();
        },
    );
}

/// More small messages in flight than a shared-memory lane has slots or answer words.
#[test]
fn many_small_sends_before_any_receive() {
    run("many_small_sends_before_any_receive", &[2, 3], |g| {
        let (next, prev) = ring(g);
        let sends: Vec<_> = (0..200i32)
            .map(|i| g.isend(vec![i; 2], next, 4).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        for i in 0..200i32 {
            let mut out = [0i32; 2];
            g.recv(&mut out, prev, 4).unwrap();
            assert_eq!(out, [i; 2]);
        }
        for (i, s) in sends.into_iter().enumerate() {
            assert_eq!(s.into_buffer().unwrap(), vec![i as i32; 2]);
        }
        g.barrier().unwrap();
    });
}

/// The refusals of small messages reach both sides, whichever call sent or received them.
#[test]
fn small_message_refusals_fail_both_sides() {
    run_native("small_message_refusals_fail_both_sides", &[2], |g| {
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
        // A message over several lane slots, refused for its size.
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
    });
}

/// A blocking send whose receiver comes late, and a blocking receive whose sender comes late,
/// both complete (past the shared-memory fast path's short spin, through the general wait).
#[test]
fn late_partners_of_blocking_calls() {
    run("late_partners_of_blocking_calls", &[2], |g| {
        let peer = 1 - g.rank();
        for late in [0, 1] {
            if g.rank() == late {
                std::thread::sleep(Duration::from_millis(30));
                let mut out = [0i64; 1];
                g.recv(&mut out, peer, 11).unwrap();
                assert_eq!(out, [42]);
                std::thread::sleep(Duration::from_millis(30));
                g.send(&[43i64], peer, 12).unwrap();
            } else {
                g.send(&[42i64], peer, 11).unwrap();
                let mut out = [0i64; 1];
                g.recv(&mut out, peer, 12).unwrap();
                assert_eq!(out, [43]);
            }
        }
    });
}

/// A blocking small send (which waits for its answer past the shared-memory fast path) and a
/// blocking small receive towards a peer that exits fail with `PeerLost`, promptly.
#[test]
fn blocking_small_calls_to_a_peer_that_exits_fail() {
    run_native(
        "blocking_small_calls_to_a_peer_that_exits_fail",
        &[2],
        |g| {
            if g.rank() == 1 {
                std::thread::sleep(Duration::from_millis(100));
                std::process::exit(0);
            }
            let t = Instant::now();
            let lost = |r: distcomm::Result<()>| match r {
                Err(Error::PeerLost {
                    peer: 1, rank: 0, ..
                }) => {}
                other => panic!("expected peer 1 lost, got {other:?}"),
            };
            lost(g.send(&[1u8; 8], 1, 7));
            lost(g.recv(&mut [0u8; 8], 1, 8).map(|_| ()));
            lost(g.send(&[1u8; 8], 1, 9));
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "detection took {:?}",
                t.elapsed()
            );
        },
    );
}

/// Owner of lent memory that counts its drops, to see when the operation lets go of it.
struct Owner(
    #[allow(dead_code)] Vec<u8>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
);

impl Drop for Owner {
    fn drop(&mut self) {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn lend(
    len: usize,
    fill: u8,
    drops: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> (distcomm::Lent, *const u8) {
    let mut v = vec![fill; len];
    let ptr = v.as_mut_ptr();
    // SAFETY: the vector moves into the owner (its heap memory does not move) and nothing else
    // touches it while the Lent lives.
    let lent = unsafe { distcomm::Lent::new(ptr, len, Box::new(Owner(v, drops.clone()))) };
    (lent, ptr)
}

#[test]
fn lent_memory_is_held_until_the_operation_ends() {
    run(
        "lent_memory_is_held_until_the_operation_ends",
        &[2, 3],
        |g| {
            use std::sync::atomic::Ordering;
            let (next, prev) = ring(g);
            let drops = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            for len in [0usize, 8, 1000, 70_000, 1 << 20] {
                let (rl, rptr) = lend(len, 0, &drops);
                let rw = g
                    .irecv_lent(rl, distcomm::DType::U8, Some(prev), 9)
                    .unwrap();
                let (sl, _) = lend(len, g.rank() as u8 + 1, &drops);
                let sw = g.isend_lent(sl, distcomm::DType::U8, next, 9).unwrap();
                let st = rw.wait().unwrap();
                assert_eq!((st.peer, st.bytes), (prev, len));
                let back = rw.into_buffer().unwrap();
                assert_eq!(back.len(), len);
                // SAFETY: the receive is complete and `back` (holding the memory) is alive.
                let got = unsafe { std::slice::from_raw_parts(rptr, len) };
                assert!(got.iter().all(|&b| b == prev as u8 + 1), "len {len}");
                drop(back);
                sw.wait().unwrap();
                drop(sw);
            }
            // A detached receive still takes its message; its owner goes once it has.
            let before = drops.load(Ordering::SeqCst);
            let (rl, _) = lend(64, 0, &drops);
            g.irecv_lent(rl, distcomm::DType::Bytes, Some(prev), 10)
                .unwrap()
                .detach();
            g.barrier().unwrap();
            g.send(&[7u8; 64], next, 10).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while drops.load(Ordering::SeqCst) == before && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(
                drops.load(Ordering::SeqCst),
                before + 1,
                "the detached receive let go of its owner"
            );
            // A length that is not whole elements is refused before anything is sent.
            let (bad, _) = lend(6, 0, &drops);
            assert!(matches!(
                g.isend_lent(bad, distcomm::DType::F32, next, 11),
                Err(Error::InvalidArgument { .. })
            ));
            g.barrier().unwrap();
        },
    );
}
