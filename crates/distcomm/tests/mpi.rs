//! Error mapping shared by both backends, written for the MPI one (where MPI's own return
//! codes and truncation rules are underneath): a receive buffer too small for the message is a
//! typed error with both sizes, and the pair goes on working; a buffer that takes the size of
//! the message gets it exactly; bad ranks and tags are refused before anything is sent.

mod common;

use common::run;
use distcomm::Error;

#[test]
fn a_truncated_receive_is_a_typed_error_with_both_sizes() {
    run(
        "a_truncated_receive_is_a_typed_error_with_both_sizes",
        &[2],
        |g| {
            let peer = 1 - g.rank();
            if g.rank() == 0 {
                // The native backend refuses on the sender's side too; MPI's send completes.
                let _ = g.isend(vec![7u8; 100], peer, 3).unwrap().wait();
            } else {
                let err = g.irecv(vec![0u8; 10], peer, 3).unwrap().wait().unwrap_err();
                match err {
                    Error::MessageTooLarge { sent, capacity, .. } => {
                        assert_eq!((sent, capacity), (100, 10))
                    }
                    e => panic!("expected MessageTooLarge, got {e}"),
                }
            }
            // The pair still works, and a shorter message fills a prefix.
            if g.rank() == 0 {
                g.send(&[1u8, 2, 3], peer, 4).unwrap();
            } else {
                let mut out = [0u8; 8];
                let st = g.recv(&mut out, peer, 4).unwrap();
                assert_eq!((st.bytes, &out[..3]), (3, &[1u8, 2, 3][..]));
            }
            let obj = if g.rank() == 0 {
                g.isend_object(vec![9u8; 12345], peer, 5)
                    .unwrap()
                    .wait()
                    .unwrap();
                None
            } else {
                Some(g.irecv_object(peer, 5).unwrap().into_buffer().unwrap())
            };
            if let Some(o) = obj {
                assert_eq!(o, vec![9u8; 12345]);
            }
        },
    );
}

#[test]
fn bad_ranks_and_tags_are_refused_before_sending() {
    run(
        "bad_ranks_and_tags_are_refused_before_sending",
        &[2, 3],
        |g| {
            let n = g.size();
            assert!(matches!(
                g.isend(vec![1u8], n, 0).unwrap_err(),
                Error::InvalidRank { .. }
            ));
            assert!(matches!(
                g.irecv(vec![1u8], n + 5, 0).unwrap_err(),
                Error::InvalidRank { .. }
            ));
            assert!(matches!(
                g.isend(vec![1u8], 0, distcomm::MAX_TAG + 1).unwrap_err(),
                Error::TagOutOfRange { .. }
            ));
            let mut x = [1f32];
            assert!(matches!(
                g.broadcast(&mut x, n).unwrap_err(),
                Error::InvalidRank { .. }
            ));
        },
    );
}
