//! The `distcomm` command end to end: launch, bench bare and under the launcher.

use std::process::Command;

fn distcomm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_distcomm"))
}

#[test]
fn bench_under_launch_writes_json_records() {
    let dir = std::env::temp_dir().join(format!("distcomm-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("p2p.json");
    let out = distcomm()
        .args(["launch", "-n", "3", "--"])
        .arg(env!("CARGO_BIN_EXE_distcomm"))
        .args(["bench", "p2p", "--quick", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("[rank0]: "),
        "output is prefixed by rank: {stdout}"
    );
    let recs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let recs = recs.as_array().unwrap();
    assert_eq!(recs.len(), 6, "3 sizes x (pingpong, stream)");
    for r in recs {
        for key in [
            "op",
            "bytes",
            "world",
            "transport",
            "iters",
            "time_us",
            "algbw_gbs",
            "busbw_gbs",
        ] {
            assert!(r.get(key).is_some(), "record lacks {key}: {r}");
        }
        assert_eq!(r["world"], 3);
        assert_eq!(
            r["transport"],
            if cfg!(target_os = "linux") {
                "shm"
            } else {
                "tcp"
            }
        );
        assert!(r["time_us"].as_f64().unwrap() > 0.0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bare_bench_starts_its_own_ranks() {
    let out = distcomm()
        .args(["bench", "--sizes", "8,100K", "-n", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("pingpong") && stdout.contains("stream"),
        "{stdout}"
    );
    assert!(stdout.contains("102400"), "{stdout}");
}

#[test]
fn launch_names_the_failing_rank() {
    let out = distcomm()
        .args([
            "launch",
            "-n",
            "2",
            "--",
            "sh",
            "-c",
            "[ \"$RANK\" = 1 ] && exit 7; sleep 30",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rank 1 exited with code 7"), "{stderr}");
}

#[test]
fn incomplete_environment_names_missing_variables() {
    let out = distcomm()
        .args(["bench", "--quick"])
        .env("RANK", "0")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("WORLD_SIZE") && stderr.contains("MASTER_PORT"),
        "{stderr}"
    );
}

#[test]
fn bench_staging_reports_copies_per_op() {
    let dir = std::env::temp_dir().join(format!("distcomm-cli-staging-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (device, copies) in [("emulated", 1), ("host", 0)] {
        let json = dir.join(format!("{device}.json"));
        let out = distcomm()
            .args([
                "bench", "staging", "--device", device, "--sizes", "8,1M", "--json",
            ])
            .arg(&json)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let recs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let recs = recs.as_array().unwrap();
        assert_eq!(recs.len(), 2);
        for r in recs {
            assert_eq!(r["op"], "staged_irecv");
            assert_eq!(r["device"], device);
            assert_eq!(r["copies_per_op"], copies);
            assert_eq!(
                r["staged_bytes_per_op"],
                copies * r["bytes"].as_u64().unwrap()
            );
            assert!(r["host_time_us"].as_f64().unwrap() > 0.0);
        }
    }
    let out = distcomm()
        .args(["bench", "staging", "--device", "cuda", "--sizes", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
