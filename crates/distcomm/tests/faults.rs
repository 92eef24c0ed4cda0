//! Timeouts and lifetimes: per-call deadlines of collectives, the `DISTCOMM_TIMEOUT` default,
//! and what dropping a group with pending work does. (Peer death, SIGSTOP on point-to-point and
//! abort are in `p2p.rs`; kill -9 through the launcher in `shm.rs`; authentication in `auth.rs`.)

mod common;

use std::time::{Duration, Instant};

use common::{run, run_env, run_raw};
use distcomm::{Error, ReduceOp};

#[test]
fn a_collective_deadline_fires_on_a_stopped_peer_and_the_group_recovers() {
    run(
        "a_collective_deadline_fires_on_a_stopped_peer_and_the_group_recovers",
        &[3],
        |g| {
            let mut pids = [0i64; 3];
            g.all_gather(&[i64::from(std::process::id())], &mut pids)
                .unwrap();
            let rank = g.rank();
            if rank == 1 {
                // Stopped by rank 0 while waiting here; resumed after the others gave up.
                let mut go = [0u8];
                g.recv(&mut go, 0, 1).unwrap();
                let mut x = vec![1f32; 1000];
                match g.all_reduce(&mut x, ReduceOp::Sum) {
                    Err(e @ (Error::Aborted { .. } | Error::Desync { .. })) => {
                        let text = e.to_string();
                        assert!(text.contains("all_reduce"), "{text}");
                    }
                    other => panic!("rank 1: the cancelled collective must fail, got {other:?}"),
                }
            } else {
                if rank == 0 {
                    // SAFETY: kill(2) on rank 1's pid; no memory is involved.
                    assert_eq!(
                        unsafe { libc::kill(pids[1] as libc::pid_t, libc::SIGSTOP) },
                        0
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
                let t = Instant::now();
                let mut x = vec![1f32; 1000];
                let short = g.with_timeout(Duration::from_millis(400));
                let err = short.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                let took = t.elapsed();
                assert!(took < Duration::from_secs(2), "rank {rank}: {took:?}");
                match &err {
                    Error::Timeout { peer, .. } => assert!(peer.is_some(), "{err}"),
                    // The other survivor timed out first and cancelled the collective.
                    Error::Aborted { .. } => {}
                    other => panic!("rank {rank}: expected a timeout, got {other}"),
                }
                println!("rank {rank}: {err} after {took:?}");
                assert_eq!(
                    g.timeout(),
                    distcomm::DEFAULT_TIMEOUT,
                    "the group keeps its default"
                );
                assert!(g.peer_failure(1).is_none(), "a timeout closes nothing");
                if rank == 0 {
                    // SAFETY: as above.
                    assert_eq!(
                        unsafe { libc::kill(pids[1] as libc::pid_t, libc::SIGCONT) },
                        0
                    );
                    g.send(&[1u8], 1, 1).unwrap();
                }
            }
            // Everyone is past the failed call: the group works again.
            let mut y = vec![rank as i64 + 1; 10];
            g.all_reduce(&mut y, ReduceOp::Sum).unwrap();
            assert_eq!(y, vec![6; 10]);
        },
    );
}

#[test]
fn the_timeout_comes_from_the_environment() {
    run_env(
        "the_timeout_comes_from_the_environment",
        &[2],
        &[("DISTCOMM_TIMEOUT", "7")],
        |g| {
            assert_eq!(g.timeout(), Duration::from_secs(7));
            let h = g.with_timeout(Duration::from_millis(1500));
            assert_eq!(h.timeout(), Duration::from_millis(1500));
            assert_eq!(g.timeout(), Duration::from_secs(7));
            // A per-call deadline on a receive nobody sends: a timeout naming the peer.
            let peer = 1 - g.rank();
            let mut out = [0u8; 4];
            let t = Instant::now();
            match h.recv(&mut out, peer, 99) {
                Err(Error::Timeout { peer: Some(p), .. }) => assert_eq!(p, peer),
                other => panic!("{other:?}"),
            }
            assert!(t.elapsed() >= Duration::from_millis(1500));
            g.barrier().unwrap();
        },
    );
}

#[test]
fn pending_work_outlives_its_dropped_group() {
    run_raw("pending_work_outlives_its_dropped_group", &[2], &[], || {
        // Defined behaviour: a handle keeps the connections it needs; dropping the group
        // neither fails nor loses the operation.
        let g = distcomm::init().unwrap();
        if g.rank() == 0 {
            let r = g.irecv(vec![0i32; 3], 1, 5).unwrap();
            g.send(&[0u8], 1, 6).unwrap();
            drop(g);
            assert_eq!(r.into_buffer().unwrap(), vec![7, 8, 9]);
        } else {
            let mut ready = [0u8];
            g.recv(&mut ready, 0, 6).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            g.send(&[7i32, 8, 9], 0, 5).unwrap();
        }
    });
}
