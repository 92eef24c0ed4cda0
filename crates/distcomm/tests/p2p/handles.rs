//! Work handles and the buffers they own: timeouts that keep the operation, `Future`,
//! withdrawal on drop, per-call deadlines of the blocking calls, lent memory held until the
//! operation ends.

use std::time::{Duration, Instant};

use distcomm::Error;

use crate::common::{block_on, run};
use crate::ring;

#[test]
fn wait_timeout_keeps_the_operation() {
    run("handles::wait_timeout_keeps_the_operation", &[2], |g| {
        let peer = 1 - g.rank();
        let r = g.irecv(vec![0u8; 16], peer, 5).unwrap();
        assert!(!r.is_completed());
        let t = Instant::now();
        match r.wait_timeout(Duration::from_millis(100)) {
            Err(Error::Timeout { peer: Some(p), .. }) => assert_eq!(p, peer),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(!r.is_completed());
        g.barrier().unwrap();
        let s = g.isend(vec![7u8; 16], peer, 5).unwrap();
        let st = r.wait().unwrap();
        assert_eq!(st.bytes, 16);
        // Sticky: the same answer again, and completed.
        assert_eq!(r.wait().unwrap(), st);
        assert!(r.is_completed());
        s.wait().unwrap();
        assert_eq!(r.into_buffer().unwrap(), vec![7u8; 16]);
    });
}

#[test]
fn work_is_a_future() {
    run("handles::work_is_a_future", &[2], |g| {
        let peer = 1 - g.rank();
        let r = g.irecv(vec![0f64; 1000], peer, 1).unwrap();
        let s = g.isend(vec![g.rank() as f64; 1000], peer, 1).unwrap();
        let (a, b) = block_on(async { (r.await, s.await) });
        assert_eq!(a.unwrap().bytes, 8000);
        assert_eq!(b.unwrap().peer, peer);
    });
}

#[test]
fn dropped_receive_is_withdrawn() {
    run("handles::dropped_receive_is_withdrawn", &[2], |g| {
        let peer = 1 - g.rank();
        if g.rank() == 0 {
            let r = g.irecv(vec![0u8; 4], peer, 2).unwrap();
            drop(r);
            g.barrier().unwrap();
            let mut out = [0u8; 4];
            g.recv(&mut out, peer, 2).unwrap();
            assert_eq!(out, [1, 2, 3, 4]);
        } else {
            g.barrier().unwrap();
            g.send(&[1u8, 2, 3, 4], peer, 2).unwrap();
        }
    });
}

#[test]
fn blocking_calls_take_a_per_call_deadline() {
    run(
        "handles::blocking_calls_take_a_per_call_deadline",
        &[2],
        |g| {
            let peer = 1 - g.rank();
            let mut out = [9u8; 4];
            let t = Instant::now();
            match g.recv_timeout(&mut out, peer, 11, Duration::from_millis(150)) {
                Err(Error::Timeout { peer: Some(p), .. }) => assert_eq!(p, peer),
                other => panic!("expected a timeout, got {other:?}"),
            }
            assert!(
                t.elapsed() >= Duration::from_millis(150) && t.elapsed() < Duration::from_secs(2)
            );
            assert_eq!(
                out, [9u8; 4],
                "a timed-out receive leaves the buffer untouched"
            );
            g.barrier().unwrap();
            // The withdrawn receive does not swallow a later message.
            if g.rank() == 0 {
                g.send_timeout(&[1u8, 2, 3, 4], peer, 11, Duration::from_secs(5))
                    .unwrap();
            } else {
                g.recv_timeout(&mut out, peer, 11, Duration::from_secs(5))
                    .unwrap();
                assert_eq!(out, [1, 2, 3, 4]);
            }
        },
    );
}

/// Owner of lent memory that counts its drops, to see when the operation lets go of it.
struct Owner(
    #[allow(dead_code)] Vec<u8>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
);

impl Drop for Owner {
    fn drop(&mut self) {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn lend(
    len: usize,
    fill: u8,
    drops: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> (distcomm::Lent, *const u8) {
    let mut v = vec![fill; len];
    let ptr = v.as_mut_ptr();
    // SAFETY: the vector moves into the owner (its heap memory does not move) and nothing else
    // touches it while the Lent lives.
    let lent = unsafe { distcomm::Lent::new(ptr, len, Box::new(Owner(v, drops.clone()))) };
    (lent, ptr)
}

#[test]
fn lent_memory_is_held_until_the_operation_ends() {
    run(
        "handles::lent_memory_is_held_until_the_operation_ends",
        &[2, 3],
        |g| {
            use std::sync::atomic::Ordering;
            let (next, prev) = ring(g);
            let drops = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            for len in [0usize, 8, 1000, 70_000, 1 << 20] {
                let (rl, rptr) = lend(len, 0, &drops);
                let rw = g
                    .irecv_lent(rl, distcomm::DType::U8, Some(prev), 9)
                    .unwrap();
                let (sl, _) = lend(len, g.rank() as u8 + 1, &drops);
                let sw = g.isend_lent(sl, distcomm::DType::U8, next, 9).unwrap();
                let st = rw.wait().unwrap();
                assert_eq!((st.peer, st.bytes), (prev, len));
                let back = rw.into_buffer().unwrap();
                assert_eq!(back.len(), len);
                // SAFETY: the receive is complete and `back` (holding the memory) is alive.
                let got = unsafe { std::slice::from_raw_parts(rptr, len) };
                assert!(got.iter().all(|&b| b == prev as u8 + 1), "len {len}");
                drop(back);
                sw.wait().unwrap();
                drop(sw);
            }
            // A detached receive still takes its message; its owner goes once it has.
            let before = drops.load(Ordering::SeqCst);
            let (rl, _) = lend(64, 0, &drops);
            g.irecv_lent(rl, distcomm::DType::Bytes, Some(prev), 10)
                .unwrap()
                .detach();
            g.barrier().unwrap();
            g.send(&[7u8; 64], next, 10).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while drops.load(Ordering::SeqCst) == before && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(
                drops.load(Ordering::SeqCst),
                before + 1,
                "the detached receive let go of its owner"
            );
            // A length that is not whole elements is refused before anything is sent.
            let (bad, _) = lend(6, 0, &drops);
            assert!(matches!(
                g.isend_lent(bad, distcomm::DType::F32, next, 11),
                Err(Error::InvalidArgument { .. })
            ));
            g.barrier().unwrap();
        },
    );
}

/// Small sends over shared memory are watched by their handles (the answer word, no engine
/// sweep) and small receives take their message straight from the lane when waited: every
/// way of finishing such a handle gives the one outcome and the buffer, and matching order
/// holds whichever receive is waited first. (The same body runs on TCP and MPI, where the
/// general path does it all.)
#[test]
fn small_handles_finish_every_way_in_order() {
    run(
        "handles::small_handles_finish_every_way_in_order",
        &[2],
        |g| {
            let peer = 1 - g.rank();
            if g.rank() == 0 {
                // Waited, then the buffer taken.
                let s = g.isend(vec![1u8; 8], peer, 1).unwrap();
                assert_eq!(s.wait().unwrap().bytes, 8);
                assert_eq!(s.into_buffer().unwrap(), vec![1u8; 8]);
                // Dropped before the receiver has even posted: it still arrives, once.
                drop(g.isend(vec![2u8; 8], peer, 2).unwrap());
                // Awaited as a future.
                let s = g.isend(vec![3u8; 8], peer, 3).unwrap();
                assert_eq!(block_on(s).unwrap().peer, peer);
                // Two messages of one tag, sent once the receiver has posted both receives
                // and waits for its second one (rounds: the timing varies).
                for _ in 0..20 {
                    g.recv(&mut [0u8; 1], peer, 9).unwrap();
                    let a = g.isend(vec![4u8; 8], peer, 4).unwrap();
                    let b = g.isend(vec![5u8; 16], peer, 4).unwrap();
                    assert_eq!(b.into_buffer().unwrap(), vec![5u8; 16]);
                    assert_eq!(a.into_buffer().unwrap(), vec![4u8; 8]);
                }
                // More sends in flight than the lane has answer words, waited last first.
                let many: Vec<_> = (0..40u8)
                    .map(|k| g.isend(vec![k; 24], peer, 10 + u32::from(k)).unwrap())
                    .collect();
                for (k, w) in many.into_iter().enumerate().rev() {
                    assert_eq!(w.into_buffer().unwrap(), vec![k as u8; 24]);
                }
                g.barrier().unwrap();
            } else {
                assert_eq!(
                    g.irecv(vec![0u8; 8], peer, 1)
                        .unwrap()
                        .into_buffer()
                        .unwrap(),
                    vec![1u8; 8]
                );
                // Rank 0 has dropped its next send by now, most likely before this receive.
                std::thread::sleep(Duration::from_millis(20));
                let r = g.irecv(vec![0u8; 8], peer, 2).unwrap();
                assert_eq!(r.into_buffer().unwrap(), vec![2u8; 8]);
                let r = g.irecv(vec![0u8; 8], peer, 3).unwrap();
                assert_eq!(r.into_buffer().unwrap(), vec![3u8; 8]);
                for _ in 0..20 {
                    let first = g.irecv(vec![0u8; 16], peer, 4).unwrap();
                    let second = g.irecv(vec![0u8; 16], peer, 4).unwrap();
                    g.send(&[1u8], peer, 9).unwrap();
                    // Non-overtaking: the second receive gets the second message even when
                    // waited first (its waiter may not take the message at the head of the
                    // lane), and the first one the first.
                    assert_eq!(second.into_buffer().unwrap(), vec![5u8; 16]);
                    let got = first.into_buffer().unwrap();
                    assert_eq!(&got[..8], &[4u8; 8]);
                }
                let many: Vec<_> = (0..40u8)
                    .map(|k| g.irecv(vec![0u8; 24], peer, 10 + u32::from(k)).unwrap())
                    .collect();
                for (k, w) in many.into_iter().enumerate() {
                    assert_eq!(w.into_buffer().unwrap(), vec![k as u8; 24]);
                }
                g.barrier().unwrap();
            }
        },
    );
}

/// Small sends polled with `is_completed` only after later sends have used the lane's answer
/// words again (over shared memory each word serves one send in flight; 16 per direction):
/// every poll still turns true and every buffer comes back, in batches of up to 40.
#[test]
fn small_sends_polled_late_complete() {
    run("handles::small_sends_polled_late_complete", &[2], |g| {
        let peer = 1 - g.rank();
        let batches = [16u8, 16, 40];
        if g.rank() == 0 {
            let mut sent = Vec::new();
            for (b, &n) in batches.iter().enumerate() {
                for k in 0..n {
                    let tag = 100 * b as u32 + u32::from(k);
                    sent.push((k, g.isend(vec![k; 8], peer, tag).unwrap()));
                }
                // The receiver has taken the whole batch.
                g.recv(&mut [0u8; 1], peer, 1).unwrap();
            }
            let t = Instant::now();
            while !sent.iter().all(|(_, w)| w.is_completed()) {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "sends taken by the receiver still pending after {:?}",
                    t.elapsed()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            for (k, w) in sent {
                assert_eq!(w.into_buffer().unwrap(), vec![k; 8]);
            }
        } else {
            for (b, &n) in batches.iter().enumerate() {
                for k in 0..n {
                    let mut got = [0u8; 8];
                    g.recv(&mut got, peer, 100 * b as u32 + u32::from(k))
                        .unwrap();
                    assert_eq!(got, [k; 8]);
                }
                g.send(&[1u8], peer, 1).unwrap();
            }
        }
        g.barrier().unwrap();
    });
}
