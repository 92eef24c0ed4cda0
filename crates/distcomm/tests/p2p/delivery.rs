//! Delivery: both posting orders at every size, progress without the receiver, typed and
//! blocking calls, many in flight, any-source, tag matching and non-overtaking order (small and
//! large messages mixed), late partners.

use std::time::Duration;

use distcomm::{ProcessGroup, Work};

use crate::common::{pattern, run};
use crate::ring;

const ALL: &[usize] = &[1, 2, 3, 4, 5];

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
    run("delivery::isend_irecv_both_orders_all_sizes", ALL, |g| {
        for (i, len) in [0usize, 1, 4096, 1 << 20, 64 << 20].into_iter().enumerate() {
            exchange(g, len, true, i as u32);
            exchange(g, len, false, 100 + i as u32);
        }
    });
}

#[test]
fn ring_of_sends_before_receives_never_deadlocks() {
    run(
        "delivery::ring_of_sends_before_receives_never_deadlocks",
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
    run("delivery::blocking_send_recv_typed", &[2, 3], |g| {
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
    run("delivery::many_outstanding_operations", &[2, 4], |g| {
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
    run(
        "delivery::any_source_reports_who_sent",
        &[1, 2, 3, 5],
        |g| {
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
        },
    );
}

#[test]
fn tags_match_and_order_is_non_overtaking() {
    run(
        "delivery::tags_match_and_order_is_non_overtaking",
        &[2, 3],
        |g| {
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
        },
    );
}

/// Small messages (which a shared-memory link carries in its lane: one slot each, the longer
/// ones' payload in the slot's chunk) and large ones (its ring), on one tag and through every
/// receive call: each arrives in order.
#[test]
fn small_and_large_messages_on_one_tag_keep_their_order() {
    run(
        "delivery::small_and_large_messages_on_one_tag_keep_their_order",
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
    run(
        "delivery::many_small_sends_before_any_receive",
        &[2, 3],
        |g| {
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
        },
    );
}

/// A blocking send whose receiver comes late, and a blocking receive whose sender comes late,
/// both complete (past the shared-memory fast path's short spin, through the general wait).
#[test]
fn late_partners_of_blocking_calls() {
    run("delivery::late_partners_of_blocking_calls", &[2], |g| {
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

/// A receiver already waiting when messages come (a ping-pong's rhythm, where the
/// shared-memory lane lets a waiting receive take its message before the sender waits for an
/// answer): a large message sent first on a tag still reaches the first receive of that tag,
/// ahead of the small one sent behind it, whatever calls receive them.
#[test]
fn a_waiting_receive_takes_messages_in_order() {
    run(
        "delivery::a_waiting_receive_takes_messages_in_order",
        &[2],
        |g| {
            let peer = 1 - g.rank();
            for round in 0..300u64 {
                let big = pattern(round, 1500 + (round as usize % 3) * 40_000);
                let small = pattern(round + 1000, 8);
                if g.rank() == 0 {
                    let mut go = [0u8];
                    g.recv(&mut go, peer, 9).unwrap();
                    let w = g.isend(big, peer, 5).unwrap();
                    g.send(&small, peer, 5).unwrap();
                    w.wait().unwrap();
                } else {
                    g.send(&[1u8], peer, 9).unwrap();
                    let mut out = vec![0u8; 81_500];
                    let got = if round % 2 == 0 {
                        let st = g.recv(&mut out, peer, 5).unwrap();
                        out.truncate(st.bytes);
                        out
                    } else {
                        let w = g.irecv(out, peer, 5).unwrap();
                        let n = w.wait().unwrap().bytes;
                        let mut out = w.into_buffer().unwrap();
                        out.truncate(n);
                        out
                    };
                    assert!(got == big, "round {round}: the large message came second");
                    let mut s = [0u8; 8];
                    g.recv(&mut s, peer, 5).unwrap();
                    assert_eq!(s.to_vec(), small, "round {round}");
                }
            }
            g.barrier().unwrap();
        },
    );
}

/// Two threads receiving from one peer at once, each on its own tag, in a ping-pong's rhythm:
/// each gets its own messages, in order.
#[test]
fn threads_receiving_from_one_peer_get_their_own_messages() {
    run(
        "delivery::threads_receiving_from_one_peer_get_their_own_messages",
        &[2],
        |g| {
            const N: u64 = 500;
            let peer = 1 - g.rank();
            if g.rank() == 0 {
                for i in 0..N {
                    for tag in [5u32, 7] {
                        g.send(&(i * 10 + u64::from(tag)).to_le_bytes(), peer, tag)
                            .unwrap();
                    }
                }
            } else {
                std::thread::scope(|sc| {
                    for tag in [5u32, 7] {
                        sc.spawn(move || {
                            for i in 0..N {
                                let mut b = [0u8; 8];
                                g.recv(&mut b, peer, tag).unwrap();
                                assert_eq!(u64::from_le_bytes(b), i * 10 + u64::from(tag));
                            }
                        });
                    }
                });
            }
            g.barrier().unwrap();
        },
    );
}
