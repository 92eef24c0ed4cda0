//! Collective benchmarks: one op at one size, timed over a loop, verified first.

use std::time::Instant;

use distcomm::commslog::bus_factor;
use distcomm::{padded_len, Error, OneBitState, ProcessGroup, ReduceOp, Reducible, Result};

use crate::bench::{median_spread, record, Record, REPS};

/// The element types `--dtype` accepts.
pub const DTYPES: &[&str] = &["f32", "f64", "f16", "bf16", "i32", "i64", "i8", "u8"];

/// An element type the benchmark can fill with whole numbers and check exactly: the values
/// the checks use (at most n² and n(n+1)/2) are exact in the float types, and integers wrap
/// here as their sums wrap in the reduction.
trait Val: Reducible + PartialEq {
    fn of(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// 1-bit compression works on f32 only.
    fn onebit(g: &ProcessGroup, _buf: &mut [Self], _state: &mut OneBitState) -> Result<()> {
        Err(Error::InvalidArgument {
            op: "onebit_all_reduce",
            rank: g.rank(),
            detail: "the 1-bit all_reduce takes f32 only".into(),
        })
    }
}

macro_rules! val {
    ($($t:ty),*; $($h:ty),*) => {
        $(impl Val for $t {
            fn of(x: f64) -> Self {
                x as i64 as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        })*
        $(impl Val for $h {
            fn of(x: f64) -> Self {
                <$h>::from_f64(x)
            }
            fn to_f64(self) -> f64 {
                <$h>::to_f64(self)
            }
        })*
    };
}

val!(f64, i32, i64, i8, u8; half::f16, half::bf16);

impl Val for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn onebit(g: &ProcessGroup, buf: &mut [f32], state: &mut OneBitState) -> Result<()> {
        g.onebit_all_reduce(buf, state)
    }
}

/// Buffers for one op: `S` = `size` bytes is the per-rank buffer of nccl-tests (the full
/// output for all_gather/gather, the full input for reduce_scatter/scatter/all_to_all).
struct Bufs<T> {
    a: Vec<T>,
    b: Vec<T>,
    block: usize,
    /// Error feedback of `onebit_all_reduce`.
    state: OneBitState,
}

fn bufs<T: Val>(op: &str, n: usize, size: usize) -> Bufs<T> {
    let count = (size / size_of::<T>()).max(1);
    let block = (count / n).max(1);
    // Ops made of per-rank blocks need a whole number of them.
    let len = match op {
        "all_reduce" | "onebit_all_reduce" | "broadcast" | "reduce" | "barrier" => count,
        _ => block * n,
    };
    Bufs {
        a: vec![T::of(0.0); len],
        b: vec![T::of(0.0); len],
        block,
        state: OneBitState::default(),
    }
}

fn once<T: Val>(g: &ProcessGroup, op: &str, x: &mut Bufs<T>) -> Result<()> {
    let (n, k) = (g.size(), x.block);
    match op {
        "all_reduce" => g.all_reduce(&mut x.a, ReduceOp::Sum),
        "onebit_all_reduce" => T::onebit(g, &mut x.a, &mut x.state),
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
fn verify<T: Val>(g: &ProcessGroup, op: &str, x: &mut Bufs<T>) -> Result<()> {
    let (n, r, k) = (g.size(), g.rank(), x.block);
    let v = |x: usize| T::of(x as f64);
    let tri = v(n * (n + 1) / 2);
    let pat = |i: usize| v(i % 101);
    match op {
        "all_reduce" | "onebit_all_reduce" | "reduce" | "reduce_scatter" => x.a.fill(v(r + 1)),
        "broadcast" => {
            for (i, e) in x.a.iter_mut().enumerate() {
                *e = if r == 0 { pat(i) } else { v(0) };
            }
        }
        "all_gather" | "gather" => x.a.fill(v(r)),
        "scatter" => {
            for (i, e) in x.a.iter_mut().enumerate() {
                *e = v(i / k);
            }
        }
        "all_to_all" => {
            for (i, e) in x.a.iter_mut().enumerate() {
                *e = v(r * n + i / k);
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
                .all(|&e| (e.to_f64() - onebit).abs() <= 1e-5 * onebit)
        }
        "all_reduce" => x.a.iter().all(|&e| e == tri),
        "reduce" => r != 0 || x.a.iter().all(|&e| e == tri),
        "reduce_scatter" => x.b[..k].iter().all(|&e| e == tri),
        "broadcast" => x.a.iter().enumerate().all(|(i, &e)| e == pat(i)),
        "all_gather" => (0..n * k).all(|i| x.b[i] == v(i / k)),
        "gather" => r != 0 || (0..n * k).all(|i| x.b[i] == v(i / k)),
        "scatter" => x.b[..k].iter().all(|&e| e == v(r)),
        "all_to_all" => (0..n * k).all(|i| x.b[i] == v((i / k) * n + r)),
        _ => true,
    };
    if !ok {
        return Err(Error::Config(format!("{op}: wrong result on rank {r}")));
    }
    Ok(())
}

/// Benchmarks `op` on `dtype` elements (one of [`DTYPES`]) at `size` bytes. Returns the
/// record on rank 0.
pub fn run_op(
    g: &ProcessGroup,
    op: &'static str,
    dtype: &str,
    size: usize,
    check: bool,
) -> Result<Option<Record>> {
    match dtype {
        "f64" => run_typed::<f64>(g, op, size, check),
        "f16" => run_typed::<half::f16>(g, op, size, check),
        "bf16" => run_typed::<half::bf16>(g, op, size, check),
        "i32" => run_typed::<i32>(g, op, size, check),
        "i64" => run_typed::<i64>(g, op, size, check),
        "i8" => run_typed::<i8>(g, op, size, check),
        "u8" => run_typed::<u8>(g, op, size, check),
        _ => run_typed::<f32>(g, op, size, check),
    }
}

fn run_typed<T: Val>(
    g: &ProcessGroup,
    op: &'static str,
    size: usize,
    check: bool,
) -> Result<Option<Record>> {
    let mut x = bufs::<T>(op, g.size(), size);
    if check {
        verify(g, op, &mut x)?;
    }
    // Enough iterations that a small op's loop lasts milliseconds: one scheduler hiccup in a
    // sub-millisecond loop moves a mean of half a microsecond by several. Large ops get 20
    // calls at least, in REPS loops whose median is the figure: 64 MiB all_reduce (world 2)
    // took 5 calls before, and three runs gave 5.9, 6.6 and 7.5 GB/s busbw.
    let per_loop = (((256usize << 20) / size.max(1)).clamp(20, 20_000)).div_ceil(REPS);
    for _ in 0..2 {
        once(g, op, &mut x)?;
    }
    let mut loops = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        g.barrier()?;
        let t = Instant::now();
        for _ in 0..per_loop {
            once(g, op, &mut x)?;
        }
        // The slowest rank's time is the op's time.
        let mut secs = [t.elapsed().as_secs_f64() / per_loop as f64];
        g.all_reduce(&mut secs, ReduceOp::Max)?;
        loops.push(secs[0]);
    }
    let (secs, spread) = median_spread(loops);
    let iters = per_loop * REPS;
    let bytes = match op {
        "barrier" => 0,
        _ => size_of_val(x.a.as_slice()),
    };
    let mut rec = record(
        g,
        op,
        T::DTYPE,
        bytes,
        iters,
        secs,
        bus_factor(op, g.size()),
    );
    rec.spread_pct = spread;
    Ok((g.rank() == 0).then_some(rec))
}
