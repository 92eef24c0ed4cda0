//! Multi-process test harness: a test body runs as N real processes (this test binary,
//! re-executed with only that test selected) for each requested world size. No device gate:
//! world sizes 1–5 run on any machine. Each rank asserts which transport actually ran.

#![allow(dead_code)]

use std::time::Duration;

use distcomm::launch::{launch, LaunchConfig};
use distcomm::ProcessGroup;

const CHILD: &str = "DISTCOMM_HARNESS_TEST";

/// The transport every rank must report: `DISTCOMM_EXPECT_TRANSPORT`, else what
/// `DISTCOMM_TRANSPORT` asks for (`auto` is shared memory on one Linux host).
pub fn expected_transport() -> String {
    if mpi_mode().is_some() {
        return "mpi".into();
    }
    if let Ok(t) = std::env::var("DISTCOMM_EXPECT_TRANSPORT") {
        return t;
    }
    match std::env::var("DISTCOMM_TRANSPORT").as_deref() {
        Ok("tcp") => "tcp".into(),
        _ if cfg!(target_os = "linux") => "shm".into(),
        _ => "tcp".into(),
    }
}

/// True in a rank process started by [`run`].
pub fn is_rank() -> bool {
    std::env::var(CHILD).is_ok()
}

/// Runs `body` on every rank of a world of each size in `worlds`. `name` must be the test
/// function's name (the binary is re-executed with `name --exact`).
pub fn run(name: &str, worlds: &[usize], body: fn(&ProcessGroup)) {
    run_env(name, worlds, &[], body)
}

/// The world size when this test binary runs as a rank of an `mpirun` job on the MPI backend
/// (`DISTCOMM_BACKEND=mpi mpirun -n N <test binary> --test-threads=1`): every process runs every
/// test, each test runs once, on that world size, if it is one of the test's.
pub fn mpi_mode() -> Option<usize> {
    if std::env::var("DISTCOMM_BACKEND").as_deref() != Ok("mpi") {
        return None;
    }
    std::env::var("OMPI_COMM_WORLD_SIZE").ok()?.parse().ok()
}

/// Like [`run`] for tests of what only the native backend does (refusing a message on the
/// sender's side too, peers dying, desync detection): skipped on the MPI backend.
pub fn run_native(name: &str, worlds: &[usize], body: fn(&ProcessGroup)) {
    run_native_env(name, worlds, &[], body);
}

/// [`run_native`] with extra environment.
pub fn run_native_env(name: &str, worlds: &[usize], env: &[(&str, &str)], body: fn(&ProcessGroup)) {
    if mpi_mode().is_none() {
        run_env(name, worlds, env, body);
    }
}

fn run_mpi(n: usize, worlds: &[usize], env: &[(&str, &str)], body: fn(&ProcessGroup)) {
    if !worlds.contains(&n) {
        return;
    }
    // Tests run one at a time in each rank (--test-threads=1), so the environment is ours.
    for (k, v) in env {
        std::env::set_var(k, v);
    }
    let group = distcomm::init().unwrap_or_else(|e| panic!("init failed: {e}"));
    assert_eq!(group.transport(), "mpi", "wrong backend ran");
    body(&group);
    // In step for the next test, on a group of its own (the test's may have been aborted).
    drop(group);
    let sync = distcomm::init().and_then(|g| g.barrier());
    sync.unwrap_or_else(|e| panic!("final barrier: {e}"));
    for (k, _) in env {
        std::env::remove_var(k);
    }
}

/// Like [`run`] with extra environment for the ranks.
pub fn run_env(name: &str, worlds: &[usize], env: &[(&str, &str)], body: fn(&ProcessGroup)) {
    if let Some(n) = mpi_mode() {
        return run_mpi(n, worlds, env, body);
    }
    if let Ok(selected) = std::env::var(CHILD) {
        if selected != name {
            return;
        }
        let group = distcomm::init().unwrap_or_else(|e| panic!("init failed: {e}"));
        if group.size() > 1 {
            assert_eq!(
                group.transport(),
                expected_transport(),
                "wrong transport ran"
            );
        }
        body(&group);
        return;
    }
    launch_ranks(name, worlds, env);
}

/// Runs `body` as every rank without initialising a group first (for tests of init itself).
pub fn run_raw(name: &str, worlds: &[usize], env: &[(&str, &str)], body: fn()) {
    if mpi_mode().is_some() {
        return;
    }
    if let Ok(selected) = std::env::var(CHILD) {
        if selected == name {
            body();
        }
        return;
    }
    launch_ranks(name, worlds, env);
}

fn launch_ranks(name: &str, worlds: &[usize], env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("test binary path");
    for &n in worlds {
        let mut cfg = LaunchConfig::local(n, exe.as_os_str());
        cfg.args = vec![
            name.into(),
            "--exact".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ];
        cfg.env.push((CHILD.into(), name.into()));
        for (k, v) in env {
            cfg.env.push(((*k).into(), (*v).into()));
        }
        cfg.timeout = Some(Duration::from_secs(120));
        if let Err(e) = launch(&cfg) {
            panic!("{name} with world size {n}: {e}");
        }
    }
}

/// A payload whose bytes depend on (seed, index), to catch misplaced or stale data.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Minimal executor for testing `Work` as a `Future`.
pub fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park_timeout(Duration::from_millis(100)),
        }
    }
}
