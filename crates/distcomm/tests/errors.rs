//! Errors as users see them: what `fn main() -> distcomm::Result<()>` prints (the `Debug`
//! form), the hints of errors with a likely fix, and a dead rank named by every survivor, over
//! the shared-memory arena and over TCP. Diagnostics (`DISTCOMM_DEBUG`) at the end.

mod common;

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{mpi_mode, run_native_env};
use distcomm::{Error, GroupBuilder, ProcessGroup, ReduceOp};

/// Marks a re-executed child of the tests below (which test body to run).
const CHILD: &str = "DISTCOMM_ERRORS_CHILD";

/// Runs test `name` of this binary again as a plain process (no launcher variables), with
/// `env`; returns its stdout and stderr together.
fn child_output(name: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name);
    for v in [
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID",
        "DISTCOMM_BACKEND",
    ] {
        cmd.env_remove(v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the test binary");
    String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
}

fn is_child(name: &str) -> bool {
    std::env::var(CHILD).as_deref() == Ok(name)
}

/// What a user's `main` returning `distcomm::Result` does when started without a launcher
/// (a test returning `Result` prints its error the same way, through `Debug`).
#[test]
fn child_init_without_a_launcher() -> distcomm::Result<()> {
    if is_child("child_init_without_a_launcher") {
        distcomm::init()?;
    }
    Ok(())
}

#[test]
fn without_a_launcher_main_prints_a_readable_error_with_the_fix() {
    if mpi_mode().is_some() || std::env::var(CHILD).is_ok() {
        return;
    }
    let text = child_output("child_init_without_a_launcher", &[]);
    println!("{text}");
    assert!(
        text.contains("Error: incomplete environment: missing RANK, WORLD_SIZE"),
        "{text}"
    );
    assert!(text.contains("hint: "), "{text}");
    assert!(text.contains("distcomm launch -n 2 -- PROGRAM"), "{text}");
    assert!(
        text.contains("torchrun") && text.contains("mpirun"),
        "{text}"
    );
    assert!(text.contains("[Error::MissingEnv]"), "{text}");
    assert!(
        !text.contains("MissingEnv {"),
        "the derived Debug form: {text}"
    );
}

#[test]
fn a_taken_store_port_says_which_variable_to_change() {
    if mpi_mode().is_some() {
        return;
    }
    // Another "job" holds the port.
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let built = GroupBuilder::new(0, 2)
        .store_addr(&format!("127.0.0.1:{port}"))
        .timeout(Duration::from_secs(5))
        .build();
    let Err(err) = built else {
        panic!("the store's port is taken")
    };
    let text = format!("{err:?}");
    println!("{text}");
    assert!(matches!(err, Error::Io { .. }), "{text}");
    assert!(
        text.contains(&format!("store: listen on 127.0.0.1:{port}")),
        "{text}"
    );
    for fix in ["DISTCOMM_MASTER_PORT", "MASTER_PORT", "--master-port"] {
        assert!(text.contains(fix), "no {fix} in {text}");
    }
    assert!(err.hint().is_some());
}

/// The last rank dies in the middle of a large all_reduce; every survivor's error must be a
/// peer-lost error naming it, whether the survivor saw the death itself or heard of it from
/// another survivor (the arena's broken flag, a TCP collective's cancellation).
fn every_survivor_names_the_dead_rank(g: &ProcessGroup) {
    let (n, r) = (g.size(), g.rank());
    let mut x = vec![1f32; 1000];
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    if r == n - 1 {
        let _w = g
            .all_reduce_async(vec![1f32; 8 << 20], ReduceOp::Sum)
            .unwrap();
        std::thread::sleep(Duration::from_millis(1));
        std::process::exit(0);
    }
    let t = Instant::now();
    let mut big = vec![1f32; 8 << 20];
    names_the_last_rank(g, g.all_reduce(&mut big, ReduceOp::Sum));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

/// Asserts that `got` is the loss of the group's last rank.
fn names_the_last_rank(g: &ProcessGroup, got: distcomm::Result<()>) {
    let (n, r) = (g.size(), g.rank());
    match got {
        Err(e @ Error::PeerLost { peer, .. }) => {
            println!("rank {r}: {e}");
            assert_eq!(peer, n - 1, "rank {r} names the wrong peer: {e}");
        }
        other => panic!(
            "rank {r}: expected the loss of rank {}, got {other:?}",
            n - 1
        ),
    }
}

/// The same when the collective is a gather of the arena's direct steps (the root copies straight
/// from every other rank's buffer, which waits for it): the dead rank never publishes its part.
fn survivors_of_a_direct_step_name_the_dead_rank(g: &ProcessGroup) {
    let (n, r) = (g.size(), g.rank());
    let mut x = vec![1f32; 1000];
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    if r == n - 1 {
        std::thread::sleep(Duration::from_millis(1));
        std::process::exit(0);
    }
    let mine = vec![r as u8; 1 << 20];
    let mut all = (r == 0).then(|| vec![0u8; n << 20]);
    names_the_last_rank(g, g.gather(&mine, all.as_deref_mut(), 0));
}

/// A member gone before a subgroup's first collective (where the subgroup sets up its arena,
/// waiting for every member) is named by every survivor at once, not after the deadline.
fn survivors_of_a_subgroup_set_up_name_the_dead_rank(g: &ProcessGroup) {
    let (n, r) = (g.size(), g.rank());
    let all: Vec<usize> = (0..n).collect();
    let sub = g.subgroup(&all).unwrap();
    let mut x = vec![1f32; 1000];
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    if r == n - 1 {
        std::process::exit(0);
    }
    let t = Instant::now();
    let mut y = vec![1f32; 1000];
    names_the_last_rank(&sub, sub.all_reduce(&mut y, ReduceOp::Sum));
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_dead_rank_is_named_by_every_survivor_of_a_subgroup_set_up() {
    run_native_env(
        "a_dead_rank_is_named_by_every_survivor_of_a_subgroup_set_up",
        &[3],
        &[],
        survivors_of_a_subgroup_set_up_name_the_dead_rank,
    );
}

#[test]
fn a_dead_rank_is_named_by_every_survivor_of_a_direct_step() {
    run_native_env(
        "a_dead_rank_is_named_by_every_survivor_of_a_direct_step",
        &[3],
        &[("DISTCOMM_SHM_SHARED_CACHES", "0")],
        survivors_of_a_direct_step_name_the_dead_rank,
    );
}

#[test]
fn a_dead_rank_is_named_by_every_survivor() {
    // World 2: the all_reduce takes the arena's direct steps (as on cores of their own), where
    // the survivor may be copying from the dead rank's memory as it goes.
    run_native_env(
        "a_dead_rank_is_named_by_every_survivor",
        &[2, 3, 4],
        &[("DISTCOMM_SHM_SHARED_CACHES", "0")],
        every_survivor_names_the_dead_rank,
    );
}

#[test]
fn a_dead_rank_is_named_by_every_survivor_over_tcp() {
    run_native_env(
        "a_dead_rank_is_named_by_every_survivor_over_tcp",
        &[3, 4],
        &[("DISTCOMM_TRANSPORT", "tcp")],
        every_survivor_names_the_dead_rank,
    );
}

/// A rank of a job with `DISTCOMM_DEBUG=INFO` and no subscriber of its own.
#[test]
fn child_rank_with_debug_info() {
    if !is_child("child_rank_with_debug_info") {
        return;
    }
    let g = distcomm::init().unwrap();
    let mut x = vec![1f32; 8];
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, vec![g.size() as f32; 8]);
}

/// Launches a 2-rank job of [`child_rank_with_debug_info`] (prefixing each rank's output, as
/// `distcomm launch` does), so that the test above it can read what the ranks printed.
#[test]
fn child_launch_debug_job() {
    if !is_child("child_launch_debug_job") {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cfg = distcomm::launch::LaunchConfig::local(2, exe.as_os_str());
    let name = "child_rank_with_debug_info";
    cfg.args = vec![name.into(), "--exact".into(), "--nocapture".into()];
    cfg.env = vec![(CHILD.into(), name.into())];
    cfg.timeout = Some(Duration::from_secs(60));
    distcomm::launch::launch(&cfg).unwrap();
}

#[test]
fn distcomm_debug_says_how_each_rank_is_set_up() {
    if mpi_mode().is_some() || std::env::var(CHILD).is_ok() {
        return;
    }
    let text = child_output(
        "child_launch_debug_job",
        &[
            ("DISTCOMM_DEBUG", "DEBUG"),
            ("DISTCOMM_DEBUG_SUBSYS", "init,coll"),
        ],
    );
    println!("{text}");
    for rank in 0..2 {
        let ready = format!("rank {rank} of 2 ready");
        let line = text
            .lines()
            .find(|l| l.contains(&ready))
            .unwrap_or_else(|| panic!("no {ready:?} in\n{text}"));
        for field in [
            "INFO",
            "distcomm::init",
            "world=2",
            "host=",
            "backend=\"native\"",
            "auth=",
        ] {
            assert!(line.contains(field), "no {field} in {line}");
        }
        assert!(text.contains(&format!("links of rank {rank}: ")), "{text}");
    }
    // DEBUG: the algorithm of each collective (the all_reduce and init's barrier).
    assert!(text.contains("distcomm::coll"), "{text}");
    assert!(text.contains("all_reduce by"), "{text}");
    // The subsystem filter keeps the per-message events out.
    assert!(!text.contains("distcomm::msg"), "{text}");
}
