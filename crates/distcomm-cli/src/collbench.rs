//! Collective benchmarks: one op at one size, timed over a loop, verified first.

use std::time::Instant;

use distcomm::commslog::bus_factor;
use distcomm::{padded_len, Error, OneBitState, ProcessGroup, ReduceOp, Result};

use crate::bench::{record, Record};

/// Buffers for one op: `S` = `size` bytes is the per-rank buffer of nccl-tests (the full
/// output for all_gather/gather, the full input for reduce_scatter/scatter/all_to_all).
struct Bufs {
    a: Vec<f32>,
    b: Vec<f32>,
    block: usize,
    /// Error feedback of `onebit_all_reduce`.
    state: OneBitState,
}

fn bufs(op: &str, n: usize, size: usize) -> Bufs {
    let count = (size / 4).max(1);
    let block = (count / n).max(1);
    // Ops made of per-rank blocks need a whole number of them.
    let len = match op {
        "all_reduce" | "onebit_all_reduce" | "broadcast" | "reduce" | "barrier" => count,
        _ => block * n,
    };
    Bufs {
        a: vec![0.0; len],
        b: vec![0.0; len],
        block,
        state: OneBitState::default(),
    }
}

fn once(g: &ProcessGroup, op: &str, x: &mut Bufs) -> Result<()> {
    let (n, k) = (g.size(), x.block);
    match op {
        "all_reduce" => g.all_reduce(&mut x.a, ReduceOp::Sum),
        "onebit_all_reduce" => g.onebit_all_reduce(&mut x.a, &mut x.state),
        "broadcast" => g.broadcast(&mut x.a, 0),
        "reduce" => g.reduce(&mut x.a, 0, ReduceOp::Sum),
        "all_gather" => g.all_gather(&x.a[..k], &mut x.b[..n * k]),
        "gather" => {
            let out = (g.rank() == 0).then_some(&mut x.b[..n * k]);
            g.gather(&x.a[..k], out, 0)
        }
        "scatter" => {
            let inp = (g.rank() == 0).then_some(&x.a[..n * k]);
            g.scatter(inp, &mut x.b[..k], 0)
        }
        "reduce_scatter" => g.reduce_scatter(&x.a[..n * k], &mut x.b[..k], ReduceOp::Sum),
        "all_to_all" => g.all_to_all(&x.a[..n * k], &mut x.b[..n * k]),
        _ => g.barrier(),
    }
}

/// Runs `op` once on known data and checks the result against a serial reference.
fn verify(g: &ProcessGroup, op: &str, x: &mut Bufs) -> Result<()> {
    let (n, r, k) = (g.size(), g.rank(), x.block);
    let tri = (n * (n + 1) / 2) as f32;
    let pat = |i: usize| (i % 251) as f32;
    match op {
        "all_reduce" | "onebit_all_reduce" | "reduce" | "reduce_scatter" => {
            x.a.fill(r as f32 + 1.0)
        }
        "broadcast" => {
            for (i, v) in x.a.iter_mut().enumerate() {
                *v = if r == 0 { pat(i) } else { 0.0 };
            }
        }
        "all_gather" | "gather" => x.a.fill(r as f32),
        "scatter" => {
            for (i, v) in x.a.iter_mut().enumerate() {
                *v = (i / k) as f32;
            }
        }
        "all_to_all" => {
            for (i, v) in x.a.iter_mut().enumerate() {
                *v = (r * n + i / k) as f32;
            }
        }
        _ => {}
    }
    once(g, op, x)?;
    // Constant inputs r + 1 compress without loss but for the padding, which shrinks every
    // scale by √(len / padded): the result is the mean, (n + 1) / 2, times that.
    let len = x.a.len();
    let onebit = (n + 1) as f64 / 2.0 * (len as f64 / padded_len(len, n) as f64).sqrt();
    let ok = match op {
        "onebit_all_reduce" => {
            x.state = OneBitState::default();
            x.a.iter()
                .all(|&v| (f64::from(v) - onebit).abs() <= 1e-5 * onebit)
        }
        "all_reduce" => x.a.iter().all(|&v| v == tri),
        "reduce" => r != 0 || x.a.iter().all(|&v| v == tri),
        "reduce_scatter" => x.b[..k].iter().all(|&v| v == tri),
        "broadcast" => x.a.iter().enumerate().all(|(i, &v)| v == pat(i)),
        "all_gather" => (0..n * k).all(|i| x.b[i] == (i / k) as f32),
        "gather" => r != 0 || (0..n * k).all(|i| x.b[i] == (i / k) as f32),
        "scatter" => x.b[..k].iter().all(|&v| v == r as f32),
        "all_to_all" => (0..n * k).all(|i| x.b[i] == ((i / k) * n + r) as f32),
        _ => true,
    };
    if !ok {
        return Err(Error::Config(format!("{op}: wrong result on rank {r}")));
    }
    Ok(())
}

/// Benchmarks `op` at `size` bytes. Returns the record on rank 0.
pub fn run_op(
    g: &ProcessGroup,
    op: &'static str,
    size: usize,
    check: bool,
) -> Result<Option<Record>> {
    let mut x = bufs(op, g.size(), size);
    if check {
        verify(g, op, &mut x)?;
    }
    // Enough iterations that a small op's loop lasts milliseconds: one scheduler hiccup in a
    // sub-millisecond loop moves a mean of half a microsecond by several.
    let iters = ((256usize << 20) / size.max(1)).clamp(5, 20_000);
    for _ in 0..2 {
        once(g, op, &mut x)?;
    }
    g.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        once(g, op, &mut x)?;
    }
    // The slowest rank's time is the op's time.
    let mut secs = [t.elapsed().as_secs_f64() / iters as f64];
    g.all_reduce(&mut secs, ReduceOp::Max)?;
    let bytes = match op {
        "barrier" => 0,
        _ => x.a.len() * 4,
    };
    let rec = record(g, op, bytes, iters, secs[0], bus_factor(op, g.size()));
    Ok((g.rank() == 0).then_some(rec))
}
