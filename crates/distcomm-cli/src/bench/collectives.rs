//! `distcomm bench <collective>`: one collective at one size on one element type, verified
//! against a serial reference, then timed over loops (the slowest rank's time, median of
//! [`REPS`] loops), in nccl-tests' convention (size = bytes per rank, algbw, busbw).
//!
//! Owns: the collectives the command times ([`Collective`], named by the library's
//! [`distcomm::call`] vocabulary), the element types it times them on ([`ElemType`]), their
//! reference checks and their header. Must not know: the other suites, the command line, or
//! how results are written.

use std::time::Instant;

use clap::builder::PossibleValue;
use distcomm::call::CallKind;
use distcomm::{padded_len, DType, Error, OneBitState, ProcessGroup, ReduceOp, Reducible, Result};

use super::record::{median_spread, record, Record, SPREAD};
use super::warm::warm_up;

/// Timed loops per collective row (the reported time is their median).
pub const REPS: usize = 5;

/// A collective `distcomm bench` times: one of the library's, or its 1-bit compressed
/// all_reduce (average, f32 only).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Collective {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    Gather,
    Scatter,
    ReduceScatter,
    AllToAll,
    Barrier,
    OneBitAllReduce,
}

impl Collective {
    /// Every collective, in the order `bench all` runs them (the library's wire order, then
    /// the 1-bit all_reduce).
    pub const ALL: [Collective; 10] = [
        Collective::AllReduce,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllGather,
        Collective::Gather,
        Collective::Scatter,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::Barrier,
        Collective::OneBitAllReduce,
    ];

    /// The library's kind of call; `None` for the 1-bit all_reduce, a benchmark of its own.
    pub fn kind(self) -> Option<CallKind> {
        Some(match self {
            Collective::AllReduce => CallKind::AllReduce,
            Collective::Broadcast => CallKind::Broadcast,
            Collective::Reduce => CallKind::Reduce,
            Collective::AllGather => CallKind::AllGather,
            Collective::Gather => CallKind::Gather,
            Collective::Scatter => CallKind::Scatter,
            Collective::ReduceScatter => CallKind::ReduceScatter,
            Collective::AllToAll => CallKind::AllToAll,
            Collective::Barrier => CallKind::Barrier,
            Collective::OneBitAllReduce => return None,
        })
    }

    /// The name on the command line and in the output: the library's ([`CallKind::name`]),
    /// and `onebit_all_reduce`.
    pub fn name(self) -> &'static str {
        self.kind().map_or("onebit_all_reduce", CallKind::name)
    }

    /// The nccl-tests bus factor on `n` ranks. The 1-bit all_reduce keeps the one it has always
    /// been reported with, all_gather's (n - 1) / n.
    fn bus_factor(self, n: usize) -> f64 {
        self.kind().unwrap_or(CallKind::AllGather).bus_factor(n)
    }

    /// Whether its buffer is one whole vector, not per-rank blocks.
    fn whole(self) -> bool {
        use Collective::*;
        matches!(
            self,
            AllReduce | OneBitAllReduce | Broadcast | Reduce | Barrier
        )
    }
}

/// An element type `--dtype` accepts, named as the library names it ([`DType::name`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ElemType {
    F32,
    F64,
    F16,
    Bf16,
    I32,
    I64,
    I8,
    U8,
}

impl ElemType {
    /// Every element type, in the order `--help` lists them.
    const ALL: [ElemType; 8] = [
        ElemType::F32,
        ElemType::F64,
        ElemType::F16,
        ElemType::Bf16,
        ElemType::I32,
        ElemType::I64,
        ElemType::I8,
        ElemType::U8,
    ];

    /// The library's element type.
    pub fn dtype(self) -> DType {
        match self {
            ElemType::F32 => DType::F32,
            ElemType::F64 => DType::F64,
            ElemType::F16 => DType::F16,
            ElemType::Bf16 => DType::BF16,
            ElemType::I32 => DType::I32,
            ElemType::I64 => DType::I64,
            ElemType::I8 => DType::I8,
            ElemType::U8 => DType::U8,
        }
    }
}

impl clap::ValueEnum for ElemType {
    fn value_variants<'a>() -> &'a [Self] {
        &ElemType::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.dtype().name()))
    }
}

/// The header of the collectives' rows on `n` ranks: what is timed and how.
pub fn header(n: usize) -> Vec<String> {
    let names = |ops: &[CallKind]| ops.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ");
    use CallKind::*;
    vec![
        "#".into(),
        format!(
            "# collectives: size = bytes per rank (the nccl-tests convention); time = \
             mean per call over a loop, of the slowest rank, median of {REPS} loops"
        ),
        format!(
            "# algbw = size / time; busbw = algbw x {} ({}), x {} ({}), x 1 ({})",
            fmt_factor(AllReduce.bus_factor(n)),
            names(&[AllReduce]),
            fmt_factor(AllGather.bus_factor(n)),
            names(&[AllGather, ReduceScatter, AllToAll, Gather, Scatter]),
            names(&[Broadcast, Reduce]),
        ),
        format!("# iters = calls timed; {SPREAD}; a barrier has no size"),
        format!(
            "# {:>10} {:>10} {:>6} {:>17} {:>7} {:>11} {:>12} {:>12} {:>7} {:>6}",
            "size",
            "count",
            "type",
            "op",
            "iters",
            "time(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "spread",
            "check"
        ),
    ]
}

/// A factor with at most three decimals and no trailing zeros (`1`, `0.5`, `1.333`).
fn fmt_factor(f: f64) -> String {
    format!("{f:.3}")
        .trim_end_matches('0')
        .trim_end_matches('.')
        .to_string()
}

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

fn bufs<T: Val>(op: Collective, n: usize, size: usize) -> Bufs<T> {
    let count = (size / size_of::<T>()).max(1);
    let block = (count / n).max(1);
    // Ops made of per-rank blocks need a whole number of them.
    let len = if op.whole() { count } else { block * n };
    Bufs {
        a: vec![T::of(0.0); len],
        b: vec![T::of(0.0); len],
        block,
        state: OneBitState::default(),
    }
}

fn once<T: Val>(g: &ProcessGroup, op: Collective, x: &mut Bufs<T>) -> Result<()> {
    use Collective::*;
    let (n, k) = (g.size(), x.block);
    match op {
        AllReduce => g.all_reduce(&mut x.a, ReduceOp::Sum),
        OneBitAllReduce => T::onebit(g, &mut x.a, &mut x.state),
        Broadcast => g.broadcast(&mut x.a, 0),
        Reduce => g.reduce(&mut x.a, 0, ReduceOp::Sum),
        AllGather => g.all_gather(&x.a[..k], &mut x.b[..n * k]),
        Gather => {
            let out = (g.rank() == 0).then_some(&mut x.b[..n * k]);
            g.gather(&x.a[..k], out, 0)
        }
        Scatter => {
            let inp = (g.rank() == 0).then_some(&x.a[..n * k]);
            g.scatter(inp, &mut x.b[..k], 0)
        }
        ReduceScatter => g.reduce_scatter(&x.a[..n * k], &mut x.b[..k], ReduceOp::Sum),
        AllToAll => g.all_to_all(&x.a[..n * k], &mut x.b[..n * k]),
        Barrier => g.barrier(),
    }
}

/// Runs `op` once on known data and checks the result against a serial reference.
fn verify<T: Val>(g: &ProcessGroup, op: Collective, x: &mut Bufs<T>) -> Result<()> {
    use Collective::*;
    let (n, r, k) = (g.size(), g.rank(), x.block);
    let v = |x: usize| T::of(x as f64);
    let tri = v(n * (n + 1) / 2);
    let pat = |i: usize| v(i % 101);
    match op {
        AllReduce | OneBitAllReduce | Reduce | ReduceScatter => x.a.fill(v(r + 1)),
        Broadcast => {
            for (i, e) in x.a.iter_mut().enumerate() {
                *e = if r == 0 { pat(i) } else { v(0) };
            }
        }
        AllGather | Gather => x.a.fill(v(r)),
        Scatter => {
            for (i, e) in x.a.iter_mut().enumerate() {
                *e = v(i / k);
            }
        }
        AllToAll => {
            for (i, e) in x.a.iter_mut().enumerate() {
                *e = v(r * n + i / k);
            }
        }
        Barrier => {}
    }
    once(g, op, x)?;
    // Constant inputs r + 1 compress without loss but for the padding, which shrinks every
    // scale by √(len / padded): the result is the mean, (n + 1) / 2, times that.
    let len = x.a.len();
    let onebit = (n + 1) as f64 / 2.0 * (len as f64 / padded_len(len, n) as f64).sqrt();
    let ok = match op {
        OneBitAllReduce => {
            x.state = OneBitState::default();
            x.a.iter()
                .all(|&e| (e.to_f64() - onebit).abs() <= 1e-5 * onebit)
        }
        AllReduce => x.a.iter().all(|&e| e == tri),
        Reduce => r != 0 || x.a.iter().all(|&e| e == tri),
        ReduceScatter => x.b[..k].iter().all(|&e| e == tri),
        Broadcast => x.a.iter().enumerate().all(|(i, &e)| e == pat(i)),
        AllGather => (0..n * k).all(|i| x.b[i] == v(i / k)),
        Gather => r != 0 || (0..n * k).all(|i| x.b[i] == v(i / k)),
        Scatter => x.b[..k].iter().all(|&e| e == v(r)),
        AllToAll => (0..n * k).all(|i| x.b[i] == v((i / k) * n + r)),
        Barrier => true,
    };
    if !ok {
        return Err(Error::Config(format!(
            "{}: wrong result on rank {r}",
            op.name()
        )));
    }
    Ok(())
}

/// Benchmarks `op` on `elem` elements at `size` bytes (`check`: verify it first). Returns the
/// record on rank 0.
pub fn run_op(
    g: &ProcessGroup,
    op: Collective,
    elem: ElemType,
    size: usize,
    check: bool,
) -> Result<Option<Record>> {
    match elem {
        ElemType::F32 => run_typed::<f32>(g, op, size, check),
        ElemType::F64 => run_typed::<f64>(g, op, size, check),
        ElemType::F16 => run_typed::<half::f16>(g, op, size, check),
        ElemType::Bf16 => run_typed::<half::bf16>(g, op, size, check),
        ElemType::I32 => run_typed::<i32>(g, op, size, check),
        ElemType::I64 => run_typed::<i64>(g, op, size, check),
        ElemType::I8 => run_typed::<i8>(g, op, size, check),
        ElemType::U8 => run_typed::<u8>(g, op, size, check),
    }
}

fn run_typed<T: Val>(
    g: &ProcessGroup,
    op: Collective,
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
    // Rank 0's word to go on warming up comes in a broadcast after every batch.
    warm_up(
        g.rank() == 0,
        || {
            for _ in 0..per_loop.div_ceil(4) {
                once(g, op, &mut x)?;
            }
            Ok(())
        },
        |more| {
            let mut word = [u8::from(more)];
            g.broadcast(&mut word, 0)?;
            Ok(word[0] == 1)
        },
    )?;
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
        Collective::Barrier => 0,
        _ => size_of_val(x.a.as_slice()),
    };
    let factor = op.bus_factor(g.size());
    let mut rec = record(g, op.name(), T::DTYPE, bytes, iters, secs, factor);
    rec.spread_pct = spread;
    Ok((g.rank() == 0).then_some(rec))
}

#[cfg(test)]
mod tests {
    use super::{Collective, ElemType};
    use distcomm::call::CallKind;

    #[test]
    fn every_collective_kind_of_the_library_is_benchmarked_under_its_name() {
        for kind in CallKind::ALL
            .into_iter()
            .filter(|k| *k != CallKind::PointToPoint)
        {
            let c = Collective::ALL.iter().find(|c| c.kind() == Some(kind));
            assert_eq!(c.map(|c| c.name()), Some(kind.name()), "{kind:?}");
        }
        assert_eq!(Collective::OneBitAllReduce.name(), "onebit_all_reduce");
        // The 1-bit all_reduce keeps its figures: busbw = algbw x (n - 1) / n.
        assert_eq!(Collective::OneBitAllReduce.bus_factor(4), 0.75);
    }

    #[test]
    fn element_types_are_named_as_the_library_names_them() {
        let names: Vec<_> = ElemType::ALL.iter().map(|e| e.dtype().name()).collect();
        assert_eq!(
            names,
            ["f32", "f64", "f16", "bf16", "i32", "i64", "i8", "u8"]
        );
    }
}
