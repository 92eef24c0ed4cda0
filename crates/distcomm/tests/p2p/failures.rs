//! Failing peers: exit mid-transfer, abort, a stopped peer, a killed rank, blocking calls to a
//! peer that exits — every dependent operation fails promptly with an error that names the
//! peer, and the survivors carry on.

use std::time::{Duration, Instant};

use distcomm::{Error, Work};

use crate::common::{run, run_native};

#[test]
fn peer_exit_mid_transfer_fails_dependent_operations() {
    run_native(
        "failures::peer_exit_mid_transfer_fails_dependent_operations",
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
    run("failures::abort_fails_pending_work", &[2], |g| {
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
        "failures::a_stopped_peer_times_out_without_closing_anything",
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
        "failures::killed_rank_fails_every_dependent_operation_and_spares_the_rest",
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

/// A blocking small send (which waits for its answer past the shared-memory fast path) and a
/// blocking small receive towards a peer that exits fail with `PeerLost`, promptly.
#[test]
fn blocking_small_calls_to_a_peer_that_exits_fail() {
    run_native(
        "failures::blocking_small_calls_to_a_peer_that_exits_fail",
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

/// A small send polled with `is_completed` (over shared memory, a send written into the lane
/// whose handle watches its answer) towards a peer that exits without taking it: the poll
/// turns true promptly and the handle reports `PeerLost` naming the peer, never a poll that
/// stays false.
#[test]
fn small_send_polled_to_a_peer_that_exits_fails() {
    run_native(
        "failures::small_send_polled_to_a_peer_that_exits_fails",
        &[2],
        |g| {
            if g.rank() == 1 {
                std::thread::sleep(Duration::from_millis(100));
                std::process::exit(0);
            }
            let t = Instant::now();
            let s = g.isend(vec![1u8; 8], 1, 7).unwrap();
            while !s.is_completed() {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the send to a peer that exited is still pending after {:?}",
                    t.elapsed()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            match s.wait() {
                Err(Error::PeerLost {
                    peer: 1, rank: 0, ..
                }) => {}
                other => panic!("expected peer 1 lost, got {other:?}"),
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "detection took {:?}",
                t.elapsed()
            );
        },
    );
}
