//! `distcomm bench staging`: receives into device buffers against the same receives into host
//! buffers, rank 1 → rank 0. Reports per op the staged time, the host time, the time of one
//! upload of the size alone, the copies and staged bytes per op, and
//! staged ÷ (host + upload): what staging costs beyond the one copy it must make.

use std::sync::Arc;
use std::time::Instant;

use distcomm::device::{Device, Emulated, Host};
use distcomm::{Error, ProcessGroup, Result};

use crate::bench::{median, record, Record, Staging};

/// Benchmarks staged receives of `size` bytes on `device`. Returns the record on rank 0.
pub fn run_size(g: &ProcessGroup, device: &str, size: usize) -> Result<Option<Record>> {
    match device {
        "emulated" => run_on(g, &Arc::new(Emulated), size),
        "host" => run_on(g, &Arc::new(Host), size),
        other => Err(Error::Config(format!(
            "bench staging --device {other}: this build has the host and emulated devices (wgpu and cuda are not written yet)"
        ))),
    }
}

fn run_on<D: Device>(g: &ProcessGroup, dev: &Arc<D>, size: usize) -> Result<Option<Record>> {
    if g.rank() > 1 {
        g.barrier()?;
        g.barrier()?;
        return Ok(None);
    }
    let iters = ((256usize << 20) / size.max(1)).clamp(5, 2000);
    // Host receives, then device receives, each timed on rank 0 from first post to last wait.
    g.barrier()?;
    let host = timed(
        g,
        iters,
        |g| {
            let mut buf = vec![0u8; size];
            for _ in 0..iters {
                buf = g.irecv_bytes(buf, 1, 11)?.into_buffer()?;
            }
            Ok(())
        },
        size,
    )?;
    g.barrier()?;
    let mut copies = 0;
    let mut staged_bytes = 0;
    let staged = timed(
        g,
        iters,
        |g| {
            let mut buf = dev.alloc(size)?;
            for _ in 0..iters {
                let mut w = g.irecv_device(dev, buf, 1, 11)?;
                w.wait()?;
                let c = w.copies();
                (copies, staged_bytes) = (c.copies, c.bytes);
                buf = w.into_buffer()?;
            }
            Ok(())
        },
        size,
    )?;
    if g.rank() != 0 {
        return Ok(None);
    }
    // One upload of the size, alone.
    let mut target = dev.alloc(size)?;
    let src = vec![1u8; size];
    let uploads: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            dev.upload(&src, &mut target)
                .map(|()| t.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    let upload = median(uploads);
    let mut rec = record(g, "staged_irecv", size, iters, staged, 1.0);
    rec.staging = Some(Staging {
        device: dev.name(),
        copies_per_op: copies,
        staged_bytes_per_op: staged_bytes,
        host_time_us: host * 1e6,
        upload_us: upload * 1e6,
        ratio: staged / (host + upload),
    });
    Ok(Some(rec))
}

/// Seconds per receive: rank 0 runs `recv` (iters receives), rank 1 sends as many messages.
fn timed(
    g: &ProcessGroup,
    iters: usize,
    recv: impl FnOnce(&ProcessGroup) -> Result<()>,
    size: usize,
) -> Result<f64> {
    if g.rank() == 1 {
        let mut buf = vec![7u8; size];
        for _ in 0..iters {
            buf = g.isend(buf, 0, 11)?.into_buffer()?;
        }
        return Ok(0.0);
    }
    let t = Instant::now();
    recv(g)?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}
