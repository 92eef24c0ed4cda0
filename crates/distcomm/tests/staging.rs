//! Staging of device buffers through host memory, in real processes, on every device this
//! build has: the emulated device (host memory the transports are told not to address),
//! wgpu (feature `wgpu`: lavapipe in CI) and CUDA (feature `cuda`: skipped where there is no
//! driver; `scripts/gpu-tests.sh` runs it on a GPU machine). The same suite for each:
//! exact copy counts (one per point-to-point direction; what a collective reads in, what it
//! writes out), a send's source never written, poll-before-wait, repeated completion, every
//! collective blocking and async, and failed or timed-out receives and collectives that leave
//! the device buffer bit-identical.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{pattern, run, run_native};
use distcomm::device::{Device, Emulated, EmulatedBuffer, Host};
use distcomm::{staging, Error, ProcessGroup, ReduceOp};

const CANARY: u8 = 0xA5;

/// A device the suite runs on, opened in each rank process.
trait TestDevice: Device + Sized {
    fn open() -> Self;
    /// Whether this machine has the device (the suite is skipped where it does not).
    fn available() -> bool {
        true
    }
    /// A buffer holding `bytes` (written outside staging's counters).
    fn filled(&self, bytes: &[u8]) -> Self::Buffer {
        let mut b = self.alloc(bytes.len()).expect("alloc");
        self.upload(bytes, &mut b).expect("fill");
        b
    }
    /// What a buffer holds (read outside staging's counters).
    fn read(&self, b: &Self::Buffer) -> Vec<u8> {
        let mut v = vec![0; self.len(b)];
        self.download(b, &mut v).expect("read back");
        v
    }
}

impl TestDevice for Emulated {
    fn open() -> Self {
        Emulated
    }
}

#[cfg(feature = "wgpu")]
impl TestDevice for distcomm::device::Wgpu {
    fn open() -> Self {
        distcomm::device::Wgpu::new()
            .unwrap_or_else(|e| panic!("{e} (install mesa-vulkan-drivers libvulkan1)"))
    }
}

#[cfg(feature = "cuda")]
impl TestDevice for distcomm::device::Cuda {
    fn open() -> Self {
        distcomm::device::Cuda::new(0).unwrap_or_else(|e| panic!("{e}"))
    }
    fn available() -> bool {
        let there = distcomm::device::Cuda::driver_present();
        if !there {
            eprintln!("no CUDA driver on this machine: CUDA staging tests skipped");
        }
        there
    }
}

fn bytes_of<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn elems<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut(&mut v).copy_from_slice(b);
    v
}

fn point_to_point_copies_once_each_way<D: TestDevice>(g: &ProcessGroup) {
    let dev = Arc::new(D::open());
    let n = g.size();
    let (next, prev) = ((g.rank() + 1) % n, (g.rank() + n - 1) % n);
    for len in [0usize, 5, 70_000, 3 << 20] {
        let before = staging::totals();
        let target = dev.filled(&vec![CANARY; len]);
        let r = g.irecv_device(&dev, target, prev, 1).unwrap();
        let data = pattern((g.rank() * 7 + len) as u64, len);
        let s = g.isend_device(&dev, dev.filled(&data), next, 1).unwrap();
        assert_eq!(
            s.copies().copies,
            1,
            "a staged send downloads once, at post"
        );
        assert_eq!(
            r.copies().copies,
            0,
            "a receive copies nothing before it completes"
        );
        let got = r.into_buffer().unwrap();
        assert_eq!(dev.read(&got), pattern((prev * 7 + len) as u64, len));
        let back = s.into_buffer().unwrap();
        assert_eq!(
            dev.read(&back),
            data,
            "the send's source comes back untouched"
        );
        let after = staging::totals();
        assert_eq!(after.copies - before.copies, 2, "one copy per direction");
        assert_eq!(after.bytes - before.bytes, 2 * len as u64);
    }
}

fn polling_publishes_once_and_completion_is_sticky<D: TestDevice>(g: &ProcessGroup) {
    let dev = Arc::new(D::open());
    let peer = 1 - g.rank();
    let r = g
        .irecv_device(&dev, dev.filled(&[CANARY; 4097]), peer, 3)
        .unwrap();
    let s = g
        .isend_device(&dev, dev.filled(&[g.rank() as u8; 4097]), peer, 3)
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
        assert_eq!(r.wait().unwrap().bytes, 4097);
    }
    assert_eq!(r.copies().copies, 1, "never published twice");
    assert_eq!(dev.read(&r.into_buffer().unwrap()), vec![peer as u8; 4097]);
    s.into_buffer().unwrap();
}

/// `wait` on one thread while another polls `is_completed`: one publication.
fn wait_and_poll_on_two_threads<D: TestDevice>(g: &ProcessGroup) {
    let dev = Arc::new(D::open());
    let peer = 1 - g.rank();
    for round in 0..20u8 {
        let r = g
            .irecv_device(&dev, dev.filled(&[CANARY; 1000]), peer, 9)
            .unwrap();
        let s = g
            .isend_device(&dev, dev.filled(&[round; 1000]), peer, 9)
            .unwrap();
        std::thread::scope(|sc| {
            sc.spawn(|| while !r.is_completed() {});
            assert_eq!(r.wait().unwrap().bytes, 1000);
        });
        assert_eq!(r.copies().copies, 1);
        assert_eq!(dev.read(&r.into_buffer().unwrap()), vec![round; 1000]);
        s.into_buffer().unwrap();
    }
}

fn a_timed_out_receive_publishes_nothing<D: TestDevice>(g: &ProcessGroup) {
    let dev = Arc::new(D::open());
    if g.rank() == 0 {
        let r = g
            .irecv_device(&dev, dev.filled(&[CANARY; 64]), 1, 4)
            .unwrap();
        let err = r.wait_timeout(Duration::from_millis(50)).unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(!r.is_completed());
        assert_eq!(r.copies().copies, 0, "a timeout publishes nothing");
        // Given up: the buffer comes back bit-identical, and the message goes elsewhere.
        let back = r.abandon().expect("a staged buffer comes back");
        assert_eq!(dev.read(&back), vec![CANARY; 64]);
        // A second receive waits through a timeout and then succeeds.
        let r = g.irecv_device(&dev, back, 1, 4).unwrap();
        assert!(r.wait_timeout(Duration::from_millis(20)).is_err());
        g.send(&[1u8], 1, 5).unwrap();
        assert_eq!(r.wait().unwrap().bytes, 64);
        assert_eq!(dev.read(&r.into_buffer().unwrap()), vec![7u8; 64]);
    } else {
        let mut go = [0u8];
        g.recv(&mut go, 0, 5).unwrap();
        let s = g.isend_device(&dev, dev.filled(&[7u8; 64]), 0, 4).unwrap();
        s.into_buffer().unwrap();
    }
}

fn a_dead_peer_leaves_the_device_buffer_bit_identical<D: TestDevice>(g: &ProcessGroup) {
    let dev = Arc::new(D::open());
    if g.rank() == 1 {
        let mut go = [0u8];
        g.recv(&mut go, 0, 7).unwrap();
        std::process::exit(0); // gone without sending
    }
    let before = pattern(11, 1 << 20);
    let r = g.irecv_device(&dev, dev.filled(&before), 1, 6).unwrap();
    drop(g.isend(vec![1u8], 1, 7).unwrap());
    let err = r.wait().unwrap_err();
    assert!(matches!(err, Error::PeerLost { peer: 1, .. }), "{err}");
    assert!(r.is_completed());
    assert_eq!(r.copies().copies, 0, "nothing published");
    assert!(
        matches!(r.wait().unwrap_err(), Error::PeerLost { .. }),
        "sticky"
    );
    let back = r.abandon().expect("the device buffer comes back");
    assert_eq!(dev.read(&back), before, "bit-identical");
}

/// Every blocking collective on device buffers: right results, and copies in only what each
/// rank reads and out only what it writes.
fn every_collective_stages_exactly_what_it_reads_and_writes<D: TestDevice>(g: &ProcessGroup) {
    let dev = D::open();
    let (n, me) = (g.size(), g.rank());
    let root = n - 1;
    let k = 1001usize; // elements per rank
    let mine: Vec<f32> = (0..k).map(|i| (i * n + me) as f32).collect();
    let sum = |i: usize| (0..n).map(|r| (i * n + r) as f32).sum::<f32>();

    let mut buf = dev.filled(bytes_of(&mine));
    let c = g
        .all_reduce_device::<_, f32>(&dev, &mut buf, ReduceOp::Sum)
        .unwrap();
    assert_eq!(c.copies, 2);
    let got: Vec<f32> = elems(&dev.read(&buf));
    assert!(got.iter().enumerate().all(|(i, v)| *v == sum(i)));

    let mut buf = dev.filled(bytes_of(&mine));
    let c = g.broadcast_device::<_, f32>(&dev, &mut buf, root).unwrap();
    assert_eq!(c.copies, 1, "root: in only; others: out only");
    let want: Vec<f32> = (0..k).map(|i| (i * n + root) as f32).collect();
    assert_eq!(elems::<f32>(&dev.read(&buf)), want);

    let mut buf = dev.filled(bytes_of(&mine));
    let c = g
        .reduce_device::<_, f32>(&dev, &mut buf, root, ReduceOp::Sum)
        .unwrap();
    if me == root {
        assert_eq!(c.copies, 2);
        let got: Vec<f32> = elems(&dev.read(&buf));
        assert!(got.iter().enumerate().all(|(i, v)| *v == sum(i)));
    } else {
        assert_eq!(c.copies, 1, "a non-root's buffer is not written");
        assert_eq!(elems::<f32>(&dev.read(&buf)), mine);
    }

    let input = dev.filled(bytes_of(&mine));
    let mut out = dev.filled(&vec![CANARY; 4 * k * n]);
    let c = g
        .all_gather_device::<_, f32>(&dev, &input, &mut out)
        .unwrap();
    assert_eq!(c.copies, 2);
    let got: Vec<f32> = elems(&dev.read(&out));
    for r in 0..n {
        assert!((0..k).all(|i| got[r * k + i] == (i * n + r) as f32));
    }
    assert_eq!(
        elems::<f32>(&dev.read(&input)),
        mine,
        "an input is never written"
    );

    let mut out = (me == root).then(|| dev.filled(&vec![CANARY; 4 * k * n]));
    let c = g
        .gather_device::<_, f32>(&dev, &input, out.as_mut(), root)
        .unwrap();
    assert_eq!(c.copies, if me == root { 2 } else { 1 });
    if let Some(out) = out {
        assert_eq!(elems::<f32>(&dev.read(&out)), got);
    }

    let whole: Vec<i32> = (0..(k * n) as i32).map(|x| x * 3 - 7).collect();
    let src = (me == root).then(|| dev.filled(bytes_of(&whole)));
    let mut out = dev.filled(&vec![CANARY; 4 * k]);
    let c = g
        .scatter_device::<_, i32>(&dev, src.as_ref(), &mut out, root)
        .unwrap();
    assert_eq!(c.copies, if me == root { 2 } else { 1 });
    assert_eq!(elems::<i32>(&dev.read(&out)), whole[me * k..(me + 1) * k]);

    let blocks: Vec<i64> = (0..(k * n) as i64).map(|x| x + me as i64).collect();
    let input = dev.filled(bytes_of(&blocks));
    let mut out = dev.filled(&vec![CANARY; 8 * k]);
    let c = g
        .reduce_scatter_device::<_, i64>(&dev, &input, &mut out, ReduceOp::Max)
        .unwrap();
    assert_eq!(c.copies, 2);
    let want: Vec<i64> = (0..k).map(|i| (me * k + i + n - 1) as i64).collect();
    assert_eq!(elems::<i64>(&dev.read(&out)), want);

    let send: Vec<i8> = (0..k * n).map(|i| (i / k * 10 + me) as i8).collect();
    let input = dev.filled(bytes_of(&send));
    let mut out = dev.filled(&vec![CANARY; k * n]);
    let c = g
        .all_to_all_device::<_, i8>(&dev, &input, &mut out)
        .unwrap();
    assert_eq!(c.copies, 2);
    let got: Vec<i8> = elems(&dev.read(&out));
    assert!((0..k * n).all(|i| got[i] == (me * 10 + i / k) as i8));
}

/// A collective that fails (here: a wrong output size) publishes nothing.
fn a_failed_collective_publishes_nothing<D: TestDevice>(g: &ProcessGroup) {
    let dev = D::open();
    let input = dev.filled(&[1u8; 64]);
    let before = pattern(5, 4 * 16 * g.size() + 4);
    let mut out = dev.filled(&before);
    let err = g
        .all_gather_device::<_, f32>(&dev, &input, &mut out)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_eq!(dev.read(&out), before, "bit-identical");
    let mut odd = dev.filled(&[CANARY; 6]);
    let err = g
        .all_reduce_device::<_, f32>(&dev, &mut odd, ReduceOp::Sum)
        .unwrap_err();
    assert!(err.to_string().contains("not a whole number"), "{err}");
    assert_eq!(dev.read(&odd), vec![CANARY; 6]);
    g.barrier().unwrap();
}

/// Async collectives copy in at issue and out only inside completion, once.
fn async_collectives_copy_back_only_inside_completion<D: TestDevice>(g: &ProcessGroup) {
    let dev = Arc::new(D::open());
    let (n, me) = (g.size(), g.rank());
    let vals: Vec<i64> = (0..5000).map(|i| (i * 3 + me) as i64).collect();
    let w = g
        .all_reduce_device_async::<_, i64>(&dev, dev.filled(bytes_of(&vals)), ReduceOp::Sum)
        .unwrap();
    assert_eq!(w.copies().copies, 1, "copied in at issue");
    // A blocking collective meanwhile; then completion publishes, once.
    let mut x = [1i32];
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    while !w.is_completed() {
        std::thread::yield_now();
    }
    assert_eq!(w.copies().copies, 2, "copied out inside completion");
    let got: Vec<i64> = elems(&dev.read(&w.into_buffer().unwrap()));
    assert!(got
        .iter()
        .enumerate()
        .all(|(i, v)| *v == (n * i * 3 + n * (n - 1) / 2) as i64));

    let w = g
        .broadcast_device_async::<_, u8>(&dev, dev.filled(&[me as u8; 333]), 0)
        .unwrap();
    assert_eq!(w.copies().copies, u64::from(me == 0));
    w.wait().unwrap();
    assert_eq!(w.copies().copies, 1, "root: in only; others: out only");
    assert_eq!(dev.read(&w.into_buffer().unwrap()), vec![0u8; 333]);

    // 6000 elements: all_to_all splits them evenly on worlds 1, 2 and 3.
    let vals: Vec<i64> = (0..6000).map(|i| (i * 3 + me) as i64).collect();
    let input = dev.filled(bytes_of(&vals));
    let w = g
        .all_gather_device_async::<_, i64>(&dev, &input, dev.alloc(8 * 6000 * n).unwrap())
        .unwrap();
    let w2 = g
        .all_to_all_device_async::<_, i64>(&dev, &input, dev.alloc(8 * 6000).unwrap())
        .unwrap();
    let gathered: Vec<i64> = elems(&dev.read(&w.into_buffer().unwrap()));
    for r in 0..n {
        assert_eq!(gathered[r * 6000 + 7], (7 * 3 + r) as i64);
    }
    assert_eq!(w2.copies().copies, 1, "nothing out before completion");
    let exchanged: Vec<i64> = elems(&dev.read(&w2.into_buffer().unwrap()));
    let k = 6000 / n;
    for r in 0..n {
        assert_eq!(exchanged[r * k], ((me * k) * 3 + r) as i64);
    }

    let w = g
        .reduce_device_async::<_, i64>(&dev, dev.filled(bytes_of(&vals)), n - 1, ReduceOp::Min)
        .unwrap();
    w.wait().unwrap();
    let got: Vec<i64> = elems(&dev.read(&w.into_buffer().unwrap()));
    if me == n - 1 {
        assert_eq!(got[5], 15, "the minimum over ranks of 5 * 3 + rank");
    } else {
        assert_eq!(got, vals, "a non-root's buffer is not written");
    }

    let whole: Vec<i64> = (0..(4 * n) as i64).collect();
    let src = (me == 0).then(|| dev.filled(bytes_of(&whole)));
    let w = g
        .scatter_device_async::<_, i64>(&dev, src.as_ref(), dev.alloc(32).unwrap(), 0)
        .unwrap();
    assert_eq!(
        w.copies().copies,
        u64::from(me == 0),
        "the root's input in, at issue"
    );
    let got: Vec<i64> = elems(&dev.read(&w.into_buffer().unwrap()));
    assert_eq!(got, whole[4 * me..4 * me + 4]);

    let wrong =
        g.reduce_scatter_device_async::<_, i64>(&dev, &input, dev.alloc(3).unwrap(), ReduceOp::Sum);
    assert!(wrong.is_err(), "a wrong output size fails at issue");
    g.barrier().unwrap();
}

macro_rules! device_suite {
    ($m:ident, $dev:ty) => {
        mod $m {
            use super::*;

            fn go(name: &str, worlds: &[usize], body: fn(&ProcessGroup)) {
                if <$dev as TestDevice>::available() {
                    run(name, worlds, body);
                }
            }

            #[test]
            fn point_to_point() {
                let name = concat!(stringify!($m), "::point_to_point");
                go(name, &[2, 3], point_to_point_copies_once_each_way::<$dev>);
            }

            #[test]
            fn polling() {
                let name = concat!(stringify!($m), "::polling");
                go(
                    name,
                    &[2],
                    polling_publishes_once_and_completion_is_sticky::<$dev>,
                );
            }

            #[test]
            fn two_threads() {
                let name = concat!(stringify!($m), "::two_threads");
                go(name, &[2], wait_and_poll_on_two_threads::<$dev>);
            }

            #[test]
            fn timeout() {
                let name = concat!(stringify!($m), "::timeout");
                go(name, &[2], a_timed_out_receive_publishes_nothing::<$dev>);
            }

            #[test]
            fn dead_peer() {
                if <$dev as TestDevice>::available() {
                    let name = concat!(stringify!($m), "::dead_peer");
                    let body = a_dead_peer_leaves_the_device_buffer_bit_identical::<$dev>;
                    run_native(name, &[2], body);
                }
            }

            #[test]
            fn collectives() {
                let name = concat!(stringify!($m), "::collectives");
                let body = every_collective_stages_exactly_what_it_reads_and_writes::<$dev>;
                go(name, &[1, 2, 3], body);
            }

            #[test]
            fn failed_collective() {
                let name = concat!(stringify!($m), "::failed_collective");
                go(name, &[1, 2], a_failed_collective_publishes_nothing::<$dev>);
            }

            #[test]
            fn async_collectives() {
                let name = concat!(stringify!($m), "::async_collectives");
                let body = async_collectives_copy_back_only_inside_completion::<$dev>;
                go(name, &[1, 2, 3], body);
            }
        }
    };
}

device_suite!(emulated, Emulated);
#[cfg(feature = "wgpu")]
device_suite!(wgpu, distcomm::device::Wgpu);
#[cfg(feature = "cuda")]
device_suite!(cuda, distcomm::device::Cuda);

/// Only the emulated device can see inside its buffers: a staged send's source is never
/// uploaded into, and a receive is uploaded into exactly once.
#[test]
fn a_staged_send_source_is_never_written() {
    run("a_staged_send_source_is_never_written", &[2], |g| {
        let dev = Arc::new(Emulated);
        let peer = 1 - g.rank();
        let src = EmulatedBuffer::from_bytes(pattern(g.rank() as u64, 100_000));
        let r = g
            .irecv_device(&dev, EmulatedBuffer::from_bytes(vec![0; 100_000]), peer, 1)
            .unwrap();
        let s = g.isend_device(&dev, src.clone(), peer, 1).unwrap();
        assert_eq!(r.into_buffer().unwrap().uploads(), 1);
        let back = s.into_buffer().unwrap();
        assert_eq!((back.uploads(), &back), (0, &src));
    });
}

/// Memory the group addresses goes straight through: no copy, point-to-point or collective.
#[test]
fn host_memory_goes_direct() {
    run("host_memory_goes_direct", &[2], |g| {
        let host = Arc::new(Host);
        assert!(g.addresses(distcomm::device::Memory::Host));
        assert!(!g.addresses(distcomm::device::Memory::Emulated));
        let peer = 1 - g.rank();
        let before = staging::totals();
        let r = g.irecv_device(&host, vec![0u8; 16], peer, 2).unwrap();
        let s = g
            .isend_device(&host, vec![g.rank() as u8; 16], peer, 2)
            .unwrap();
        assert_eq!(r.into_buffer().unwrap(), vec![peer as u8; 16]);
        s.into_buffer().unwrap();
        // A byte buffer is aligned for u8 always; for f32 when the allocator says so.
        let mut buf = vec![1u8; 64];
        let c = g
            .all_reduce_device::<_, u8>(host.as_ref(), &mut buf, ReduceOp::Sum)
            .unwrap();
        assert_eq!((c.copies, buf), (0, vec![2u8; 64]));
        assert_eq!(staging::totals().copies, before.copies);
    });
}
