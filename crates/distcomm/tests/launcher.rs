//! The launcher: torchrun variables, output prefixing, failure naming and stopping the others.

use std::time::{Duration, Instant};

use distcomm::launch::{launch, LaunchConfig};
use distcomm::Error;

fn sh(n: usize, script: &str) -> LaunchConfig {
    let mut cfg = LaunchConfig::local(n, "sh");
    cfg.args = vec!["-c".into(), script.into()];
    cfg.timeout = Some(Duration::from_secs(60));
    cfg
}

#[test]
fn every_rank_gets_torchrun_variables() {
    let script = r#"[ "$WORLD_SIZE" = 3 ] && [ "$LOCAL_WORLD_SIZE" = 3 ] && [ "$RANK" = "$LOCAL_RANK" ] \
        && [ -n "$MASTER_PORT" ] && [ "$MASTER_ADDR" = 127.0.0.1 ] && [ "$TORCHELASTIC_USE_AGENT_STORE" = True ]"#;
    launch(&sh(3, script)).unwrap();
}

#[test]
fn a_failing_rank_is_named_and_the_others_are_stopped() {
    let t = Instant::now();
    let err = launch(&sh(3, r#"if [ "$RANK" = 1 ]; then exit 3; fi; sleep 60"#)).unwrap_err();
    match err {
        Error::RankFailed { rank, how } => {
            assert_eq!(rank, 1);
            assert!(how.contains("code 3"), "{how}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "others were not stopped"
    );
}

#[test]
fn a_killed_rank_reports_its_signal() {
    let err = launch(&sh(
        2,
        r#"if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 60"#,
    ))
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("rank 0") && text.contains("SIGKILL"),
        "{text}"
    );
}

#[test]
fn a_missing_program_is_a_clear_error() {
    let cfg = LaunchConfig::local(2, "/nonexistent/program");
    let text = launch(&cfg).unwrap_err().to_string();
    assert!(text.contains("/nonexistent/program"), "{text}");
}
