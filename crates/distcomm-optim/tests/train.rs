//! The `train` example end to end, as a user runs it: real ranks started by the launcher, each
//! optimizer, JSON out. Adam and 1-bit Adam must both learn, end close to each other, and 1-bit
//! Adam must send less.

use std::path::PathBuf;

use distcomm::launch::{launch, LaunchConfig};

/// `target/<profile>/examples/train`: built by a whole `cargo test` beside this test's binary,
/// and here when this test alone was asked for.
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir
        .join("examples")
        .join(format!("train{}", std::env::consts::EXE_SUFFIX));
    if !path.exists() {
        let release = dir.ends_with("release");
        let status = std::process::Command::new(env!("CARGO"))
            .args(["build", "-p", "distcomm-optim", "--example", "train"])
            .args(release.then_some("--release"))
            .status()
            .expect("run cargo");
        assert!(status.success(), "cargo build --example train failed");
    }
    path
}

fn train(optimizer: &str, world: usize) -> serde_json::Value {
    let out = std::env::temp_dir().join(format!(
        "distcomm-train-{optimizer}-{world}-{}.json",
        std::process::id()
    ));
    let mut cfg = LaunchConfig::local(world, example());
    cfg.args = [
        "--optimizer",
        optimizer,
        "--steps",
        "200",
        "--every",
        "50",
        "--json",
    ]
    .iter()
    .map(Into::into)
    .chain([out.clone().into_os_string()])
    .collect();
    cfg.timeout = Some(std::time::Duration::from_secs(120));
    launch(&cfg).unwrap_or_else(|e| panic!("train {optimizer} on {world} ranks: {e}"));
    let text = std::fs::read_to_string(&out).expect("json written");
    let _ = std::fs::remove_file(&out);
    serde_json::from_str(&text).expect("valid json")
}

#[test]
fn train_learns_with_every_optimizer_and_onebit_sends_less() {
    let world = 3;
    let runs: Vec<_> = ["adam", "adamw", "onebit-adam"]
        .iter()
        .map(|o| (o.to_string(), train(o, world)))
        .collect();
    for (o, r) in &runs {
        assert_eq!(r["optimizer"], o.as_str());
        assert_eq!(r["steps"], 200);
        assert_eq!(r["world"], world);
        let (first, last) = (
            r["initial_loss"].as_f64().unwrap(),
            r["final_loss"].as_f64().unwrap(),
        );
        assert!(last < 0.05 * first, "{o} did not learn: {first} -> {last}");
        assert!(r["wall_s"].as_f64().unwrap() > 0.0);
    }
    let loss = |i: usize| runs[i].1["final_loss"].as_f64().unwrap();
    let sent = |i: usize| runs[i].1["bytes_sent"].as_u64().unwrap();
    assert!(
        (loss(2) - loss(0)).abs() <= 0.25 * loss(0),
        "adam {} vs 1-bit {}",
        loss(0),
        loss(2)
    );
    assert!(
        sent(2) * 2 < sent(0),
        "1-bit Adam sent {} B, Adam {} B",
        sent(2),
        sent(0)
    );
}
