//! The `distcomm` command end to end: launch, bench bare and under the launcher.

use std::process::Command;

fn distcomm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_distcomm"))
}

/// Runs `distcomm args…`, requires success, and returns its standard output.
fn run_ok<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let out = distcomm().args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
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
    let stdout = run_ok(&["bench", "--sizes", "8,100K", "-n", "2"]);
    assert!(
        stdout.contains("pingpong") && stdout.contains("stream"),
        "{stdout}"
    );
    assert!(stdout.contains("102400"), "{stdout}");
}

#[test]
fn bench_p2p_with_handles_says_so_and_verifies() {
    let stdout = run_ok(&["bench", "p2p", "--handles", "--sizes", "8,2K", "-n", "2"]);
    assert!(
        stdout.contains("isend/irecv handles at every size"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains("pingpong")).collect();
    assert!(
        rows.len() == 3 && rows[1..].iter().all(|l| l.ends_with("ok")),
        "{stdout}"
    );
}

#[test]
fn bench_explains_its_columns_and_says_where_the_plot_went() {
    let dir = std::env::temp_dir().join(format!("distcomm-cli-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("all.svg");
    let svg_arg = svg.to_string_lossy();
    let stdout = run_ok(&["bench", "all", "--sizes", "8,4K", "--plot", &svg_arg]);
    for said in [
        "world 2, transport",
        "time = half a round trip",
        "busbw = algbw x 1 (all_reduce)",
        "slowest rank",
        "iters",
        "spread",
        "# wrote a plot (point-to-point: ranks 0 and 1: 2 ops; collectives: 9 ops) to ",
    ] {
        assert!(stdout.contains(said), "no {said:?} in {stdout}");
    }
    // p2p rows have one bandwidth and no element count.
    let row = stdout
        .lines()
        .find(|l| l.contains(" pingpong "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert_eq!(row.split_whitespace().count(), 7, "{row}");
    let text = std::fs::read_to_string(&svg).unwrap();
    for part in [
        "<svg",
        "distcomm bench all: world 2",
        "point-to-point",
        "collectives",
    ] {
        assert!(text.contains(part), "no {part:?} in the plot");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_collectives_on_every_element_type() {
    // Each run verifies every collective against its reference before timing it.
    for dtype in ["bf16", "f16", "i8", "u8", "i64", "f64"] {
        let stdout = run_ok(&["bench", "all", "--sizes", "1K", "-n", "3", "--dtype", dtype]);
        for op in ["all_reduce", "reduce_scatter", "broadcast", "all_to_all"] {
            let line = stdout
                .lines()
                .find(|l| l.contains(&format!(" {op} ")))
                .unwrap_or_else(|| panic!("no {op} line for {dtype}: {stdout}"));
            assert!(line.contains(dtype) && line.ends_with("ok"), "{line}");
        }
        assert!(!stdout.contains("onebit"), "1-bit is f32 only: {stdout}");
    }
    let out = distcomm()
        .args(["bench", "onebit_all_reduce", "--quick", "--dtype", "bf16"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("f32 only"), "{stderr}");
}

#[test]
fn bench_runs_in_subgroups() {
    // Two groups of two ranks at once, each verifying every collective in its group.
    let stdout = run_ok(&["bench", "all", "--sizes", "1K", "-n", "4", "--group", "2"]);
    assert!(
        stdout.contains("world 2") && stdout.contains("2 groups of 2"),
        "{stdout}"
    );
    for op in ["all_reduce", "broadcast", "all_to_all", "stream"] {
        let line = stdout
            .lines()
            .find(|l| l.contains(&format!(" {op} ")))
            .unwrap_or_else(|| panic!("no {op} line: {stdout}"));
        assert!(line.ends_with("ok"), "{line}");
    }
    let out = distcomm()
        .args(["bench", "barrier", "-n", "4", "--group", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no multiple of 3"), "{stderr}");
}

#[test]
fn unknown_suites_and_element_types_list_the_accepted_ones() {
    for (args, listed) in [
        (&["bench", "allreduce"][..], "all_reduce, broadcast"),
        (
            &["bench", "all", "--dtype", "f128"][..],
            "f32, f64, f16, bf16",
        ),
    ] {
        let out = distcomm().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(listed), "{args:?}: {stderr}");
    }
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
        let json_arg = json.to_string_lossy();
        run_ok(&[
            "bench", "staging", "--device", device, "--sizes", "8,1M", "--json", &json_arg,
        ]);
        let recs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let recs = recs.as_array().unwrap();
        let ops: Vec<&str> = recs.iter().map(|r| r["op"].as_str().unwrap()).collect();
        let each = ["staged_isend", "staged_irecv", "staged_all_reduce"];
        assert_eq!(ops, [each, each].concat());
        for r in recs {
            // In and out for an all_reduce, one copy per point-to-point direction.
            let want = copies * if r["op"] == "staged_all_reduce" { 2 } else { 1 };
            assert_eq!(r["device"], device);
            assert_eq!(r["copies_per_op"], want);
            assert_eq!(
                r["staged_bytes_per_op"],
                want * r["bytes"].as_u64().unwrap()
            );
            assert!(r["host_time_us"].as_f64().unwrap() > 0.0);
            assert!(r["ratio"].as_f64().unwrap() > 0.0);
        }
    }
    // A device this build lacks is a clear error.
    let out = distcomm()
        .args(["bench", "staging", "--device", "tpu", "--sizes", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("this build has emulated, host"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench staging` on real GPU buffers (lavapipe in CI) runs and reports the wgpu device.
#[cfg(feature = "wgpu")]
#[test]
fn bench_staging_on_wgpu() {
    let stdout = run_ok(&["bench", "staging", "--device", "wgpu", "--sizes", "4100"]);
    assert!(
        stdout.contains("staged_irecv") && stdout.contains("wgpu"),
        "{stdout}"
    );
}
