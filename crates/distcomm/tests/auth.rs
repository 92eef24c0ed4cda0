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

#[test]
fn an_authenticated_store_serves_ranks_that_know_the_secret() {
    run_env(
        "an_authenticated_store_serves_ranks_that_know_the_secret",
        &[2, 3],
        &[("DISTCOMM_STORE_AUTH", "1")],
        |g| {
            let mut x = [2i64];
            g.all_reduce(&mut x, distcomm::ReduceOp::Sum).unwrap();
            assert_eq!(x[0] as usize, 2 * g.size());
        },
    );
}

mod store_auth {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};

    use distcomm::rendezvous::{proto, Store, TcpStore, TcpStoreServer};
    use distcomm::Error;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn the_secret_opens_it_and_nothing_else_does() {
        let server = TcpStoreServer::bind_authenticated("127.0.0.1:0", b"s3cret").unwrap();
        let addr = server.local_addr().to_string();
        let ok = TcpStore::connect_authenticated(&addr, T, b"s3cret").unwrap();
        ok.set("k", b"v").unwrap();
        match TcpStore::connect_authenticated(&addr, T, b"guess") {
            Err(Error::StoreAuth { detail, .. }) => assert!(detail.contains("secret"), "{detail}"),
            other => panic!("wrong secret: {other:?}"),
        }
        // A plain (PyTorch-style) client is refused at once, before any command runs.
        let t = Instant::now();
        assert!(TcpStore::connect(&addr, T).is_err());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // Nothing the strangers did reached the data.
        assert_eq!(ok.get("k").unwrap(), b"v");
        assert_eq!(ok.num_keys().unwrap(), 1);
    }

    #[test]
    fn a_raw_stranger_gets_nothing_back() {
        let server = TcpStoreServer::bind_authenticated("127.0.0.1:0", b"s3cret").unwrap();
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        // torch's validation, then a GET of "k" (u64 length-prefixed key).
        let mut msg = vec![proto::VALIDATE];
        msg.extend_from_slice(&proto::MAGIC.to_le_bytes());
        msg.push(proto::GET);
        msg.extend_from_slice(&1u64.to_le_bytes());
        msg.push(b'k');
        let _ = s.write_all(&msg);
        let mut buf = [0u8; 16];
        assert!(
            matches!(s.read(&mut buf), Ok(0) | Err(_)),
            "the server answered a stranger"
        );
    }

    #[test]
    fn an_authenticating_client_refuses_a_plain_store() {
        let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        assert!(matches!(
            TcpStore::connect_authenticated(&addr, T, b"s3cret"),
            Err(Error::StoreAuth { .. })
        ));
    }
}
