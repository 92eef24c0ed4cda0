//! `distcomm bench staging`: each staged op on device buffers against the same op on host
//! buffers — `staged_isend` and `staged_irecv` between ranks 0 and 1, `staged_all_reduce`
//! (f32 sum) over the whole group. Reports per op the staged time, the host time, the time of
//! the copies the op must make (measured alone: a download for a send, an upload for a
//! receive, both for an all_reduce), the copies and staged bytes per op, and
//! staged ÷ (host + those copies): what staging costs beyond the copies it cannot avoid.
//!
//! Owns: the staging benchmarks and the devices this build can run them on. Must not know:
//! the other suites, the command line, or how results are written.

use std::sync::Arc;
use std::time::Instant;

use distcomm::device::{Device, Emulated, Host};
use distcomm::{CopyStats, DType, Error, ProcessGroup, ReduceOp, Result};

use super::record::{median, record, Record, Staging};

/// The line under the title of `bench staging`: what its rows compare.
pub const NOTE: &str = "# staged op on device buffers vs the same op on host buffers; ratio = staged ÷ (host + the copies it must make, timed alone)";

/// The devices this build can benchmark on.
pub const DEVICES: &str = if cfg!(all(feature = "wgpu", feature = "cuda")) {
    "emulated, host, wgpu, cuda"
} else if cfg!(feature = "wgpu") {
    "emulated, host, wgpu"
} else if cfg!(feature = "cuda") {
    "emulated, host, cuda"
} else {
    "emulated, host (build with --features wgpu or cuda for GPUs)"
};

/// Benchmarks the staged ops at `size` bytes on `device` (`--device`: one of [`DEVICES`]).
/// Returns the records on rank 0.
pub fn run_size(g: &ProcessGroup, device: &str, size: usize) -> Result<Vec<Record>> {
    match device {
        "emulated" => run_on(g, &Arc::new(Emulated), size),
        "host" => run_on(g, &Arc::new(Host), size),
        #[cfg(feature = "wgpu")]
        "wgpu" => run_on(g, &gpu::wgpu()?, size),
        #[cfg(feature = "cuda")]
        "cuda" => run_on(g, &gpu::cuda()?, size),
        other => Err(Error::Config(format!(
            "bench staging --device {other}: this build has {DEVICES}"
        ))),
    }
}

/// GPU devices, opened once per process (opening one takes a while).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu {
    use std::sync::{Arc, OnceLock};

    use distcomm::Result;

    #[cfg(feature = "wgpu")]
    pub fn wgpu() -> Result<Arc<distcomm::device::Wgpu>> {
        static DEV: OnceLock<Result<Arc<distcomm::device::Wgpu>>> = OnceLock::new();
        DEV.get_or_init(|| distcomm::device::Wgpu::new().map(Arc::new))
            .clone()
    }

    /// This rank's GPU: local ranks share the visible devices round-robin.
    #[cfg(feature = "cuda")]
    pub fn cuda() -> Result<Arc<distcomm::device::Cuda>> {
        static DEV: OnceLock<Result<Arc<distcomm::device::Cuda>>> = OnceLock::new();
        let local = std::env::var("LOCAL_RANK")
            .ok()
            .and_then(|r| r.parse().ok());
        DEV.get_or_init(|| distcomm::device::Cuda::for_local_rank(local.unwrap_or(0)).map(Arc::new))
            .clone()
    }
}

fn run_on<D: Device>(g: &ProcessGroup, dev: &Arc<D>, size: usize) -> Result<Vec<Record>> {
    let iters = ((256usize << 20) / size.max(1)).clamp(5, 2000);
    let (up, down) = copy_times(dev.as_ref(), size)?;
    let name = dev.name();
    let mut recs = Vec::new();
    for (op, copy) in [("staged_isend", down), ("staged_irecv", up)] {
        let send = op == "staged_isend";
        let host = point_to_point::<D>(g, iters, size, send, None)?.0;
        let staged = point_to_point(g, iters, size, send, Some(dev))?;
        recs.push(finish(
            g,
            (op, DType::U8),
            (size, iters),
            name,
            staged,
            host,
            copy,
        ));
    }
    if size % 4 == 0 {
        let host = all_reduce::<D>(g, iters, size, None)?.0;
        let staged = all_reduce(g, iters, size, Some(dev))?;
        let op = ("staged_all_reduce", DType::F32);
        recs.push(finish(g, op, (size, iters), name, staged, host, up + down));
    }
    Ok(if g.rank() == 0 { recs } else { Vec::new() })
}

/// The record of `op` at (size, iterations): staged (seconds and copies per op) against host
/// seconds and the seconds of the copies it must make.
fn finish(
    g: &ProcessGroup,
    (op, dtype): (&'static str, DType),
    (size, iters): (usize, usize),
    device: &'static str,
    (staged, stats): (f64, CopyStats),
    host: f64,
    copy: f64,
) -> Record {
    let mut rec = record(g, op, dtype, size, iters, staged, 1.0);
    rec.staging = Some(Staging {
        device,
        copies_per_op: stats.copies,
        staged_bytes_per_op: stats.bytes,
        host_time_us: host * 1e6,
        copy_us: copy * 1e6,
        ratio: staged / (host + copy),
    });
    rec
}

/// Seconds of one upload and one download of `size` bytes, alone (median of five).
fn copy_times<D: Device>(dev: &D, size: usize) -> Result<(f64, f64)> {
    let mut buf = dev.alloc(size)?;
    let mut host = vec![1u8; size];
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        dev.upload(&host, &mut buf)?;
        up.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        dev.download(&buf, &mut host)?;
        down.push(t.elapsed().as_secs_f64());
    }
    Ok((median(up), median(down)))
}

/// Seconds per message from rank 0's side of `iters` messages between ranks 0 and 1: rank 0
/// sends (`send`) or receives, on `dev`'s buffers when given, host buffers otherwise; rank 1
/// uses host buffers. Byte messages: staged point-to-point moves bytes. A send is timed until rank 1 acknowledges the last message.
fn point_to_point<D: Device>(
    g: &ProcessGroup,
    iters: usize,
    size: usize,
    send: bool,
    dev: Option<&Arc<D>>,
) -> Result<(f64, CopyStats)> {
    g.barrier()?;
    let mut stats = CopyStats::default();
    let mut t = Instant::now();
    // One more message than timed: the first, untimed, faults the buffers in.
    match (g.rank(), send) {
        (0, _) => {
            let mut dbuf = dev.map(|d| d.alloc(size)).transpose()?;
            let mut hbuf = vec![7u8; size];
            for i in 0..=iters {
                if i == 1 {
                    t = Instant::now();
                }
                match (dev, dbuf.take()) {
                    (Some(d), Some(b)) => {
                        let w = if send {
                            g.isend_device(d, b, 1, 11)?
                        } else {
                            g.irecv_device(d, b, 1, 11)?
                        };
                        w.wait()?;
                        stats = w.copies();
                        dbuf = Some(w.into_buffer()?);
                    }
                    _ if send => hbuf = g.isend_bytes(hbuf, 1, 11)?.into_buffer()?,
                    _ => hbuf = g.irecv_bytes(hbuf, 1, 11)?.into_buffer()?,
                }
            }
            if send {
                g.recv(&mut [0u8], 1, 12)?;
            }
        }
        (1, _) => {
            let mut buf = vec![7u8; size];
            for _ in 0..=iters {
                buf = if send {
                    g.irecv_bytes(buf, 0, 11)?.into_buffer()?
                } else {
                    g.isend_bytes(buf, 0, 11)?.into_buffer()?
                };
            }
            if send {
                g.send(&[1u8], 0, 12)?;
            }
        }
        _ => {}
    }
    let secs = t.elapsed().as_secs_f64() / iters as f64;
    g.barrier()?;
    Ok((secs, stats))
}

/// Seconds per f32 sum all_reduce of `size` bytes over the group, on `dev`'s buffers when
/// given, host buffers otherwise (timed on each rank; rank 0's is reported).
fn all_reduce<D: Device>(
    g: &ProcessGroup,
    iters: usize,
    size: usize,
    dev: Option<&Arc<D>>,
) -> Result<(f64, CopyStats)> {
    let mut stats = CopyStats::default();
    let mut host = vec![1f32; size / 4];
    let mut dbuf = dev.map(|d| d.alloc(size)).transpose()?;
    g.barrier()?;
    let mut t = Instant::now();
    for i in 0..=iters {
        if i == 1 {
            t = Instant::now(); // the first, untimed, faults the buffers in
        }
        match (dev, dbuf.as_mut()) {
            (Some(d), Some(b)) => {
                stats = g.all_reduce_device::<_, f32>(d.as_ref(), b, ReduceOp::Sum)?
            }
            _ => g.all_reduce(&mut host, ReduceOp::Sum)?,
        }
    }
    let secs = t.elapsed().as_secs_f64() / iters as f64;
    g.barrier()?;
    Ok((secs, stats))
}
