//! Staging of device buffers through host memory, on the emulated device (host memory the
//! transports are told not to address) in real processes: exact copy counts (one per
//! point-to-point direction, in + out for all_reduce, none for host memory), a send's source
//! never written, poll-before-wait, repeated completion, and failed or timed-out receives that
//! publish nothing.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{pattern, run, run_native};
use distcomm::device::{Device, Emulated, EmulatedBuffer, Host};
use distcomm::{staging, Error, ReduceOp};

const CANARY: u8 = 0xA5;

#[test]
fn staged_point_to_point_copies_once_each_way() {
    run("staged_point_to_point_copies_once_each_way", &[2, 3], |g| {
        let dev = Arc::new(Emulated);
        let n = g.size();
        let (next, prev) = ((g.rank() + 1) % n, (g.rank() + n - 1) % n);
        for len in [0usize, 5, 70_000, 3 << 20] {
            let before = staging::totals();
            let target = EmulatedBuffer::from_bytes(vec![CANARY; len]);
            let r = g.irecv_device(&dev, target, prev, 1).unwrap();
            let src = EmulatedBuffer::from_bytes(pattern((g.rank() * 7 + len) as u64, len));
            let s = g.isend_device(&dev, src.clone(), next, 1).unwrap();
            assert_eq!(
                s.copies().copies,
                1,
                "a staged send downloads once, at post time"
            );
            assert_eq!(
                r.copies().copies,
                0,
                "a receive copies nothing before it completes"
            );
            let got = r.into_buffer().unwrap();
            assert_eq!(
                got.bytes(),
                pattern((prev * 7 + len) as u64, len).as_slice()
            );
            assert_eq!(got.uploads(), 1, "published exactly once");
            let back = s.into_buffer().unwrap();
            assert_eq!(
                back, src,
                "the send's source comes back untouched (never uploaded into)"
            );
            let after = staging::totals();
            assert_eq!(after.copies - before.copies, 2);
            assert_eq!(after.bytes - before.bytes, 2 * len as u64);
        }
        // Host memory goes straight through: no copy.
        let host = Arc::new(Host);
        let before = staging::totals();
        let r = g.irecv_device(&host, vec![0u8; 16], prev, 2).unwrap();
        let s = g
            .isend_device(&host, vec![g.rank() as u8; 16], next, 2)
            .unwrap();
        assert_eq!(r.into_buffer().unwrap(), vec![prev as u8; 16]);
        s.into_buffer().unwrap();
        assert_eq!(staging::totals().copies, before.copies);
    });
}

#[test]
fn polling_publishes_once_and_completion_is_sticky() {
    run(
        "polling_publishes_once_and_completion_is_sticky",
        &[2],
        |g| {
            let dev = Arc::new(Emulated);
            let peer = 1 - g.rank();
            let mut r = g
                .irecv_device(
                    &dev,
                    EmulatedBuffer::from_bytes(vec![CANARY; 4096]),
                    peer,
                    3,
                )
                .unwrap();
            let s = g
                .isend_device(
                    &dev,
                    EmulatedBuffer::from_bytes(vec![g.rank() as u8; 4096]),
                    peer,
                    3,
                )
                .unwrap();
            while !r.is_completed() {
                std::thread::yield_now();
            }
            assert_eq!(
                r.copies().copies,
                1,
                "is_completed published before returning true"
            );
            for _ in 0..3 {
                assert!(r.is_completed());
                assert_eq!(r.wait().unwrap().bytes, 4096);
            }
            assert_eq!(r.copies().copies, 1, "never published twice");
            let got = r.into_buffer().unwrap();
            assert_eq!((got.bytes()[0], got.uploads()), (peer as u8, 1));
            s.into_buffer().unwrap();
        },
    );
}

#[test]
fn a_timed_out_receive_publishes_nothing_until_it_succeeds() {
    run(
        "a_timed_out_receive_publishes_nothing_until_it_succeeds",
        &[2],
        |g| {
            let dev = Arc::new(Emulated);
            if g.rank() == 0 {
                let mut r = g
                    .irecv_device(&dev, EmulatedBuffer::from_bytes(vec![CANARY; 64]), 1, 4)
                    .unwrap();
                let err = r.wait_timeout(Duration::from_millis(50)).unwrap_err();
                assert!(err.is_timeout(), "{err}");
                assert!(!r.is_completed());
                assert_eq!(r.copies().copies, 0, "a timeout publishes nothing");
                g.send(&[1u8], 1, 5).unwrap(); // now send it
                assert_eq!(r.wait().unwrap().bytes, 64);
                let got = r.into_buffer().unwrap();
                assert_eq!((got.bytes(), got.uploads()), (&[7u8; 64][..], 1));
            } else {
                let mut go = [0u8];
                g.recv(&mut go, 0, 5).unwrap();
                g.isend_device(&dev, EmulatedBuffer::from_bytes(vec![7u8; 64]), 0, 4)
                    .unwrap()
                    .into_buffer()
                    .unwrap();
            }
        },
    );
}

#[test]
fn a_receive_from_a_dead_peer_leaves_the_device_buffer_bit_identical() {
    run_native(
        "a_receive_from_a_dead_peer_leaves_the_device_buffer_bit_identical",
        &[2],
        |g| {
            let dev = Arc::new(Emulated);
            if g.rank() == 1 {
                let mut go = [0u8];
                g.recv(&mut go, 0, 7).unwrap();
                std::process::exit(0); // gone without sending
            }
            let mut r = g
                .irecv_device(
                    &dev,
                    EmulatedBuffer::from_bytes(vec![CANARY; 1 << 20]),
                    1,
                    6,
                )
                .unwrap();
            drop(g.isend(vec![1u8], 1, 7).unwrap());
            let err = r.wait().unwrap_err();
            assert!(matches!(err, Error::PeerLost { peer: 1, .. }), "{err}");
            assert!(r.is_completed());
            assert_eq!(r.copies().copies, 0, "nothing published");
            // The error is kept, and the buffer never comes back written.
            assert!(matches!(r.wait().unwrap_err(), Error::PeerLost { .. }));
            assert!(r.into_buffer().is_err());
        },
    );
}

#[test]
fn staged_all_reduce_copies_in_and_out() {
    run("staged_all_reduce_copies_in_and_out", &[1, 2, 3], |g| {
        let dev = Emulated;
        let vals: Vec<f32> = (0..1000).map(|i| (i + g.rank()) as f32).collect();
        let mut buf = EmulatedBuffer::from_bytes(bytemuck::cast_slice(&vals).to_vec());
        let stats = g
            .all_reduce_device::<_, f32>(&dev, &mut buf, ReduceOp::Sum)
            .unwrap();
        assert_eq!((stats.copies, stats.bytes), (2, 8000));
        let n = g.size();
        let got: &[f32] = bytemuck::cast_slice(buf.bytes());
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, (n * i + n * (n - 1) / 2) as f32);
        }
        let mut odd = EmulatedBuffer::from_bytes(vec![0u8; 6]);
        assert!(g
            .all_reduce_device::<_, f32>(&dev, &mut odd, ReduceOp::Sum)
            .is_err());
        assert_eq!(dev.len(&odd), 6);
    });
}

#[test]
fn async_staged_all_reduce_copies_back_only_inside_completion() {
    run(
        "async_staged_all_reduce_copies_back_only_inside_completion",
        &[1, 2, 3],
        |g| {
            let dev = Arc::new(Emulated);
            let n = g.size();
            let vals: Vec<i64> = (0..5000).map(|i| (i * 3 + g.rank()) as i64).collect();
            let buf = EmulatedBuffer::from_bytes(bytemuck::cast_slice(&vals).to_vec());
            let w = g
                .all_reduce_device_async::<_, i64>(&dev, buf, ReduceOp::Sum)
                .unwrap();
            assert_eq!(w.copies().copies, 1, "copied in at issue");
            // A blocking collective meanwhile; then completion publishes, once.
            let mut x = [1i32];
            g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            while !w.is_completed() {
                std::thread::yield_now();
            }
            assert_eq!(w.copies().copies, 2, "copied out inside completion");
            let out = w.into_buffer().unwrap();
            assert_eq!(out.uploads(), 1);
            let got: &[i64] = bytemuck::cast_slice(out.bytes());
            for (i, v) in got.iter().enumerate() {
                assert_eq!(*v, (n * i * 3 + n * (n - 1) / 2) as i64);
            }
        },
    );
}
