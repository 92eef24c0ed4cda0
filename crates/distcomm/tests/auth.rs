//! Transport authentication: the launcher's job secret is proven on every connection; a rank
//! with another secret, or none, is refused with a clear error and never talks to the others.

mod common;

use common::{run, run_env, run_raw};
use distcomm::Error;

#[test]
fn launched_ranks_authenticate_with_the_generated_secret() {
    run(
        "launched_ranks_authenticate_with_the_generated_secret",
        &[2, 3],
        |g| {
            assert!(std::env::var("DISTCOMM_SECRET").is_ok_and(|s| s.len() == 64));
            let mut x = [1i32];
            g.all_reduce(&mut x, distcomm::ReduceOp::Sum).unwrap();
            assert_eq!(x[0] as usize, g.size());
        },
    );
}

#[test]
fn no_secret_anywhere_means_no_authentication() {
    run_env(
        "no_secret_anywhere_means_no_authentication",
        &[2],
        &[("DISTCOMM_SECRET", "")],
        |g| {
            g.barrier().unwrap();
        },
    );
}

fn rank1_with_secret(secret: Option<&str>) {
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    if rank == 1 {
        // SAFETY (test): this rank's process is single-threaded at this point.
        match secret {
            Some(s) => std::env::set_var("DISTCOMM_SECRET", s),
            None => std::env::remove_var("DISTCOMM_SECRET"),
        }
    }
    match (rank, distcomm::init()) {
        (
            1,
            Err(Error::Auth {
                peer: 0, detail, ..
            }),
        ) => {
            let want = if secret.is_some() {
                "DISTCOMM_SECRET?"
            } else {
                "we do not"
            };
            assert!(detail.contains(want), "{detail}");
        }
        (0, Err(Error::Timeout { peer: Some(1), .. })) => {}
        (r, other) => panic!("rank {r}: expected refusal, got {other:?}"),
    }
}

#[test]
fn a_rank_with_the_wrong_secret_is_refused() {
    run_raw(
        "a_rank_with_the_wrong_secret_is_refused",
        &[2],
        &[("DISTCOMM_TIMEOUT", "3")],
        || rank1_with_secret(Some("not the job secret")),
    );
}

#[test]
fn a_rank_without_the_secret_is_refused() {
    run_raw(
        "a_rank_without_the_secret_is_refused",
        &[2],
        &[("DISTCOMM_TIMEOUT", "3")],
        || rank1_with_secret(None),
    );
}
