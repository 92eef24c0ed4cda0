//! The shared-memory transport specifically: per-link choice and fallback, forced `shm`
//! refused with a clear error, no segment left in /dev/shm (after init, after a kill -9, and
//! from an earlier crash), and an oversubscribed world of 8. The whole point-to-point and
//! collective suites also run over it (`auto`, the default) and over `tcp` and `shm` in CI.
#![cfg(target_os = "linux")]

mod common;

use std::time::Duration;

use common::{is_rank, run, run_env, run_raw};
use distcomm::launch::{launch, LaunchConfig};
use distcomm::{Error, GroupBuilder, ProcessGroup, ReduceOp, TransportKind};

fn build(kind: TransportKind) -> distcomm::Result<ProcessGroup> {
    GroupBuilder::from_env()?.transport(kind).build()
}

/// Segments in /dev/shm created by any of `pids`.
fn segments_of(pids: &[i64]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    pids.iter()
                        .any(|p| n.starts_with(&format!("distcomm-{p}-")))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn all_pids(g: &ProcessGroup) -> Vec<i64> {
    let mut pids = vec![0i64; g.size()];
    g.all_gather(&[i64::from(std::process::id())], &mut pids)
        .unwrap();
    pids
}

#[test]
fn each_link_chooses_and_a_tcp_rank_gets_tcp() {
    run_raw(
        "each_link_chooses_and_a_tcp_rank_gets_tcp",
        &[3],
        &[],
        || {
            let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
            let kind = if rank == 2 {
                TransportKind::Tcp
            } else {
                TransportKind::Auto
            };
            let g = build(kind).unwrap();
            for peer in 0..3 {
                let want = match (rank, peer) {
                    (r, p) if r == p => "self",
                    (2, _) | (_, 2) => "tcp",
                    _ => "shm",
                };
                assert_eq!(g.transport_to(peer), Some(want), "rank {rank} → {peer}");
            }
            assert_eq!(g.transport(), if rank == 2 { "tcp" } else { "shm+tcp" });
            // Traffic over both kinds of link, small and large.
            for len in [3usize, 100_000, 3 << 20] {
                let mut x: Vec<f64> = (0..len).map(|i| (i % 7) as f64 + rank as f64).collect();
                g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                for (i, v) in x.iter().enumerate() {
                    assert_eq!(*v, 3.0 * (i % 7) as f64 + 3.0);
                }
                let (next, prev) = ((rank + 1) % 3, (rank + 2) % 3);
                let r = g.irecv(vec![0u8; len], prev, 1).unwrap();
                g.isend(common::pattern(rank as u64, len), next, 1)
                    .unwrap()
                    .wait()
                    .unwrap();
                assert_eq!(r.into_buffer().unwrap(), common::pattern(prev as u64, len));
            }
        },
    );
}

#[test]
fn forced_shm_with_a_tcp_peer_is_a_clear_error_on_both() {
    run_raw(
        "forced_shm_with_a_tcp_peer_is_a_clear_error_on_both",
        &[2],
        &[],
        || {
            let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
            let kind = if rank == 0 {
                TransportKind::Shm
            } else {
                TransportKind::Tcp
            };
            match build(kind) {
                Err(Error::Config(msg)) => {
                    assert!(msg.contains("DISTCOMM_TRANSPORT=shm"), "{msg}");
                    assert!(msg.contains("tcp"), "{msg}");
                }
                Err(e) => panic!("rank {rank}: expected a configuration error, got {e}"),
                Ok(_) => panic!("rank {rank}: forced shm with a tcp peer must not start"),
            }
        },
    );
}

#[test]
fn nothing_is_left_in_dev_shm_after_init() {
    run("nothing_is_left_in_dev_shm_after_init", &[2, 4], |g| {
        let pids = all_pids(g);
        g.barrier().unwrap();
        assert_eq!(segments_of(&pids), Vec::<String>::new());
    });
}

#[test]
fn segments_of_dead_processes_are_swept() {
    run_raw("segments_of_dead_processes_are_swept", &[2], &[], || {
        // A process that is gone for sure: a child we reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = format!("/dev/shm/distcomm-{dead}-deadbeef-0to1");
        std::fs::write(&stale, b"left by a crash").unwrap();
        let g = build(TransportKind::Auto).unwrap();
        assert!(!std::path::Path::new(&stale).exists(), "{stale} survived");
        g.barrier().unwrap();
    });
}

/// The body of the crash test, as rank processes: rank 2 kills itself (SIGKILL) mid-stream.
#[test]
fn a_killed_rank_leaves_no_segment() {
    const NAME: &str = "a_killed_rank_leaves_no_segment";
    if is_rank() {
        if std::env::var("DISTCOMM_HARNESS_TEST").as_deref() != Ok(NAME) {
            return;
        }
        // The launcher stops every rank (SIGTERM, then SIGKILL after 3 s) as soon as it sees
        // rank 2 die, which can be before the survivors have checked what they check here:
        // they ignore the SIGTERM and have the 3 s.
        // SAFETY: signal(2) with SIG_IGN installs no handler code; nothing else in this
        // process handles SIGTERM.
        unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
        let g = distcomm::init().unwrap();
        let rank = g.rank();
        let pids = all_pids(&g);
        if rank == 2 {
            let _streams: Vec<_> = [0, 1]
                .iter()
                .map(|&p| g.isend(vec![9u8; 4 << 20], p, 1).unwrap())
                .collect();
            std::thread::sleep(Duration::from_millis(20));
            // SAFETY: raise(2) with SIGKILL ends this process at once; no memory is involved.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        // The message the victim sent arrives; the next one never will.
        let first = g.irecv(vec![0u8; 4 << 20], 2, 1).unwrap();
        assert_eq!(first.into_buffer().unwrap(), vec![9u8; 4 << 20]);
        let r = g.irecv(vec![0u8; 8 << 20], 2, 1).unwrap();
        match r.wait() {
            Err(Error::PeerLost { peer: 2, .. }) => {}
            other => panic!("rank {rank}: expected the loss of rank 2, got {other:?}"),
        }
        assert_eq!(segments_of(&pids), Vec::<String>::new());
        // The survivors still talk.
        let mut x = [1i32];
        let pair = g.new_group(&[0, 1]).unwrap().unwrap();
        pair.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, [2]);
        let done = std::env::var("SHM_TEST_DONE_DIR").unwrap();
        std::fs::write(format!("{done}/ok-{rank}"), b"").unwrap();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cfg = LaunchConfig::local(3, exe.as_os_str());
    cfg.args = vec![NAME.into(), "--exact".into(), "--nocapture".into()];
    cfg.env.push(("DISTCOMM_HARNESS_TEST".into(), NAME.into()));
    // The launcher reports the first failure (the kill); survivors report success here.
    let done = std::env::temp_dir().join(format!("{NAME}-{}", std::process::id()));
    std::fs::create_dir_all(&done).unwrap();
    cfg.env
        .push(("SHM_TEST_DONE_DIR".into(), done.clone().into_os_string()));
    cfg.timeout = Some(Duration::from_secs(60));
    match launch(&cfg) {
        Err(Error::RankFailed { rank: 2, how }) => {
            assert!(how.contains("SIGKILL") || how.contains("signal 9"), "{how}")
        }
        other => panic!("the launcher must report rank 2's kill, got {other:?}"),
    }
    for r in [0, 1] {
        assert!(done.join(format!("ok-{r}")).exists(), "survivor {r} failed");
    }
    let _ = std::fs::remove_dir_all(&done);
}

#[test]
fn world_of_8_on_two_cores_stays_usable() {
    run("world_of_8_on_two_cores_stays_usable", &[8], |g| {
        let n = g.size();
        let r = g.rank();
        for len in [1usize, 1000, 1 << 18] {
            let mut x = vec![r as i64; len];
            g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert!(x.iter().all(|&v| v == (n * (n - 1) / 2) as i64));
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        for round in 0..50u32 {
            let rr = g.irecv(vec![0i64; 4], prev, round).unwrap();
            g.send(&[i64::from(round); 4], next, round).unwrap();
            assert_eq!(rr.into_buffer().unwrap(), vec![i64::from(round); 4]);
        }
        g.barrier().unwrap();
    });
}

#[test]
fn all_reduce_takes_the_arena_until_a_call_fails() {
    run(
        "all_reduce_takes_the_arena_until_a_call_fails",
        &[2, 3, 4],
        |g| {
            assert!(
                g.intranode_all_reduce(),
                "all ranks are local: the arena must be on"
            );
            let n = g.size() as i64;
            // Async and blocking calls interleaved: they must enter the arena in issue order.
            let a = g
                .all_reduce_async(vec![1i64; 100_000], ReduceOp::Sum)
                .unwrap();
            let mut b = vec![2i64; 10];
            g.all_reduce(&mut b, ReduceOp::Max).unwrap();
            assert_eq!(b, vec![2; 10]);
            assert_eq!(a.into_buffer().unwrap(), vec![n; 100_000]);
            // A desync (different counts) fails on every rank and turns the arena off...
            let mut bad = vec![1f32; 5 + g.rank()];
            assert!(matches!(
                g.all_reduce(&mut bad, ReduceOp::Sum),
                Err(Error::Desync { .. })
            ));
            g.barrier().unwrap();
            assert!(!g.intranode_all_reduce());
            // ...and all_reduce keeps working over the network algorithms.
            let mut c = vec![3i32; 1000];
            g.all_reduce(&mut c, ReduceOp::Sum).unwrap();
            assert_eq!(c, vec![3 * n as i32; 1000]);
        },
    );
}

#[test]
fn the_arena_can_be_turned_off() {
    run_env(
        "the_arena_can_be_turned_off",
        &[2],
        &[("DISTCOMM_SHM_ALLREDUCE", "0")],
        |g| {
            assert!(!g.intranode_all_reduce());
            let mut x = [1u8; 3];
            g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x, [2; 3]);
        },
    );
}

/// Runs inside a mount namespace with a 1 MiB /dev/shm (see the next test); does nothing
/// elsewhere.
#[test]
fn inner_full_dev_shm() {
    if std::env::var("SHM_TEST_FULL_NS").is_err() {
        return;
    }
    run_env(
        "inner_full_dev_shm",
        &[2, 3],
        &[("DISTCOMM_EXPECT_TRANSPORT", "tcp")],
        |g| {
            assert!(!g.intranode_all_reduce());
            let mut x = vec![1i64; 300_000];
            g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert!(x.iter().all(|&v| v == g.size() as i64));
        },
    );
}

#[test]
fn a_full_dev_shm_falls_back_to_tcp() {
    // Needs root for a private mount namespace; CI runs as root.
    let probe = std::process::Command::new("unshare")
        .args(["-m", "true"])
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: no private mount namespace here (needs root and unshare)");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount -t tmpfs -o size=1M tmpfs /dev/shm && exec '{}' inner_full_dev_shm --exact --nocapture",
        exe.display()
    );
    let out = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .env("SHM_TEST_FULL_NS", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("test inner_full_dev_shm ... ok"), "{text}");
}
