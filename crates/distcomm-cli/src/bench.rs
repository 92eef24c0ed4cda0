//! `distcomm bench`: point-to-point ping-pong and streaming, and every collective, in the
//! nccl-tests style (size, count, type, op, time, algbw, busbw, check).

use std::path::PathBuf;
use std::time::Instant;

use distcomm::commslog::bus_factor;
use distcomm::{DType, Error, ProcessGroup, Result};
use serde::Serialize;

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// What to measure: p2p, a collective (all_reduce, broadcast, reduce, all_gather, gather,
    /// scatter, reduce_scatter, all_to_all, barrier), onebit_all_reduce (1-bit compressed,
    /// average) or all.
    #[arg(default_value = "p2p", value_parser = parse_suite)]
    suite: String,
    /// Ranks to start when not run under a launcher.
    #[arg(short = 'n', long = "nproc", default_value_t = 2)]
    nproc: usize,
    /// Message sizes, comma separated (suffixes K, M, G), instead of the 8 B … 64 MiB sweep.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Option<Vec<usize>>,
    /// A short smoke sweep.
    #[arg(long)]
    quick: bool,
    /// Write the results as JSON records to FILE.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw bandwidth against size into FILE.svg: one chart for point-to-point, one for the
    /// collectives (bus bandwidth), one line per op.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Skip result verification.
    #[arg(long)]
    no_check: bool,
    /// Messages in flight in the streaming test.
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// The device of `bench staging`: emulated (host memory staged as a GPU's would be), host
    /// (no staging), wgpu or cuda (builds with those features).
    #[arg(long, default_value = "emulated")]
    device: String,
    /// Element type of the collectives: f32, f64, f16, bf16, i32, i64, i8 or u8 (16-bit floats
    /// are reduced in f32 and rounded once: at 16 bits through the shared-memory all_reduce,
    /// as f32 over the network).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: String,
}

fn parse_dtype(s: &str) -> std::result::Result<String, String> {
    if crate::collbench::DTYPES.contains(&s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "unknown element type {s:?}; one of {}",
            crate::collbench::DTYPES.join(", ")
        ))
    }
}

const SUITES: &[&str] = &[
    "p2p",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "onebit_all_reduce",
    "staging",
    "all",
];

fn parse_suite(s: &str) -> std::result::Result<String, String> {
    if SUITES.contains(&s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "unknown benchmark {s:?}; one of {}",
            SUITES.join(", ")
        ))
    }
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s.trim_end_matches(['B', 'b']), 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("{s:?} is not a size like 8, 4K or 64M"))
}

/// One result line, as written by `--json`.
#[derive(Serialize, Clone)]
pub struct Record {
    pub op: &'static str,
    pub bytes: usize,
    /// Element type (`u8` for point-to-point).
    pub dtype: &'static str,
    /// Bytes per element.
    #[serde(skip)]
    pub elem: usize,
    pub world: usize,
    pub transport: &'static str,
    pub iters: usize,
    pub time_us: f64,
    /// Interquartile range of the timed repetitions (batches, loops), % of the reported time.
    pub spread_pct: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    /// `bench staging` only.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub staging: Option<Staging>,
}

/// What `bench staging` adds to a record.
#[derive(Serialize, Clone)]
pub struct Staging {
    pub device: &'static str,
    pub copies_per_op: u64,
    pub staged_bytes_per_op: u64,
    /// The same receive into host memory.
    pub host_time_us: f64,
    /// The copies the op must make (a download for a send, an upload for a receive, both for
    /// an all_reduce), timed alone.
    pub copy_us: f64,
    /// Staged time ÷ (host time + those copies).
    pub ratio: f64,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.suite == "onebit_all_reduce" && args.dtype != "f32" {
        return Err(Error::Config(format!(
            "bench onebit_all_reduce compresses f32 only, not {}",
            args.dtype
        )));
    }
    if !distcomm::env::JobEnv::present() {
        return self_launch(&args);
    }
    let group = distcomm::init()?;
    let sizes = match (&args.sizes, args.quick) {
        (Some(s), _) => s.clone(),
        (None, true) => vec![8, 4096, 1 << 20],
        (None, false) => {
            let mut v: Vec<usize> = (0..12).map(|i| 8usize << (2 * i)).collect();
            v.push(64 << 20);
            v
        }
    };
    let suites: Vec<&'static str> = match args.suite.as_str() {
        // The 1-bit all_reduce compresses f32 only.
        "all" => SUITES[..SUITES.len() - 2]
            .iter()
            .copied()
            .filter(|s| *s != "onebit_all_reduce" || args.dtype == "f32")
            .collect(),
        one => SUITES.iter().copied().filter(|s| *s == one).collect(),
    };

    if (suites.contains(&"p2p") || suites.contains(&"staging")) && group.size() < 2 {
        return Err(Error::Config(format!(
            "bench {} needs at least 2 ranks",
            args.suite
        )));
    }
    let lead = group.rank() == 0;
    let bar = if lead {
        let steps = suites.iter().filter(|s| **s != "barrier").count() * sizes.len() + 1;
        let b = indicatif::ProgressBar::new(steps as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let say = |line: String| {
        if bar.is_hidden() {
            println!("{line}");
        } else {
            bar.println(line);
        }
    };
    let title = Title {
        suite: args.suite.clone(),
        world: group.size(),
        transport: group.transport(),
        backend: if group.transport() == "mpi" {
            "mpi"
        } else {
            "native"
        },
        dtype: args.dtype.clone(),
    };
    if lead {
        say(format!("# {}", title.line()));
        if args.suite == "staging" {
            say("# staged op on device buffers vs the same op on host buffers; ratio = staged ÷ (host + the copies it must make, timed alone)".into());
        }
    }
    let mut records = Vec::new();
    let mut coll_header = false;
    for suite in &suites {
        if lead {
            for line in header(suite, group.size(), args.window.max(1), &mut coll_header) {
                say(line);
            }
        }
        // A barrier has no size.
        let sizes = if *suite == "barrier" {
            &sizes[..1]
        } else {
            &sizes[..]
        };
        for &size in sizes {
            bar.set_message(format!("{suite} {size} B"));
            let recs = match *suite {
                "p2p" => {
                    let mut v = Vec::new();
                    v.extend(pingpong(&group, size, !args.no_check)?);
                    group.barrier()?;
                    v.extend(stream(&group, size, args.window.max(1), !args.no_check)?);
                    v
                }
                "staging" => crate::stagebench::run_size(&group, &args.device, size)?,
                op => crate::collbench::run_op(&group, op, &args.dtype, size, !args.no_check)?
                    .into_iter()
                    .collect(),
            };
            group.barrier()?;
            for rec in recs {
                if let Some(st) = &rec.staging {
                    say(format!(
                        "  {:>10} {:>8} {:>17} staged {:>10.1} us  host {:>10.1} us  copies {} ({:>9.1} us)  ratio {:.3}",
                        rec.bytes, st.device, rec.op, rec.time_us, st.host_time_us, st.copies_per_op, st.copy_us, st.ratio
                    ));
                    records.push(rec);
                    continue;
                }
                let check = if args.no_check { "skip" } else { "ok" };
                say(row(&rec, check));
                records.push(rec);
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if lead {
        if let Some(path) = &args.json {
            let text = serde_json::to_string_pretty(&records)
                .map_err(|e| Error::Config(format!("serialise results: {e}")))?;
            write_out(path, &text, &format!("{} JSON records", records.len()))?;
        }
        if let Some(path) = &args.plot {
            let (svg, charts) = crate::plot::svg(&records, &title)?;
            write_out(path, &svg, &format!("a plot ({charts})"))?;
        }
    }
    Ok(())
}

/// Writes `text` to `path` and says so.
fn write_out(path: &std::path::Path, text: &str, what: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("write {}", path.display()), e))?;
    let shown = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    println!("# wrote {what} to {}", shown.display());
    Ok(())
}

/// What a run measured on what: the output's first line and the plot's title.
pub struct Title {
    pub suite: String,
    pub world: usize,
    pub transport: &'static str,
    pub backend: &'static str,
    pub dtype: String,
}

impl Title {
    pub fn line(&self) -> String {
        format!(
            "distcomm bench {}: world {}, transport {}, backend {}, collectives on {}",
            self.suite, self.world, self.transport, self.backend, self.dtype
        )
    }
}

/// Whether `op` is point-to-point (timed and drawn apart from the collectives).
pub fn is_p2p(op: &str) -> bool {
    matches!(op, "pingpong" | "stream")
}

/// The column header of `suite`, with what is timed and how (`coll_done`: the collectives'
/// header is out already; they share it).
fn header(suite: &str, n: usize, window: usize, coll_done: &mut bool) -> Vec<String> {
    let spread = "spread = interquartile range of the timed repetitions, % of time";
    match suite {
        "p2p" => vec![
            "#".into(),
            "# pingpong: ranks 0 and 1 send a message back and forth; time = half a round trip, \
             median of ~40 timed batches"
                .into(),
            format!(
                "# stream: rank 0 posts {window} isends of size bytes, rank 1 as many irecvs; \
                 time = per message, median over windows"
            ),
            format!("# bw = size / time; iters = messages timed; {spread}"),
            format!(
                "# {:>10} {:>14} {:>7} {:>11} {:>10} {:>7} {:>6}",
                "size", "op", "iters", "time(us)", "bw(GB/s)", "spread", "check"
            ),
        ],
        "staging" => Vec::new(),
        _ if !std::mem::replace(coll_done, true) => {
            let mut v = vec![
                "#".into(),
                format!(
                    "# collectives: size = bytes per rank (the nccl-tests convention); time = \
                     mean per call over a loop, of the slowest rank, median of {REPS} loops"
                ),
                format!(
                    "# algbw = size / time; busbw = algbw x {} (all_reduce), x {} (all_gather, \
                     reduce_scatter, all_to_all, gather, scatter), x 1 (broadcast, reduce)",
                    fmt_factor(bus_factor("all_reduce", n)),
                    fmt_factor(bus_factor("all_gather", n)),
                ),
                format!("# iters = calls timed; {spread}; a barrier has no size"),
            ];
            v.push(format!(
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
            ));
            v
        }
        _ => Vec::new(),
    }
}

fn fmt_factor(f: f64) -> String {
    format!("{f:.3}")
        .trim_end_matches('0')
        .trim_end_matches('.')
        .to_string()
}

/// One result line under its header.
fn row(rec: &Record, check: &str) -> String {
    let spread = format!("{:.0}%", rec.spread_pct);
    if is_p2p(rec.op) {
        return format!(
            "  {:>10} {:>14} {:>7} {:>11.2} {:>10.3} {:>7} {:>6}",
            rec.bytes, rec.op, rec.iters, rec.time_us, rec.algbw_gbs, spread, check
        );
    }
    format!(
        "  {:>10} {:>10} {:>6} {:>17} {:>7} {:>11.2} {:>12.3} {:>12.3} {:>7} {:>6}",
        rec.bytes,
        rec.bytes / rec.elem.max(1),
        rec.dtype,
        rec.op,
        rec.iters,
        rec.time_us,
        rec.algbw_gbs,
        rec.busbw_gbs,
        spread,
        check
    )
}

/// Timed loops per collective row (the reported time is their median).
pub const REPS: usize = 5;

/// The median of `samples` and their interquartile range in % of it.
pub fn median_spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| {
        v.get(((v.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
    };
    let med = at(0.5).unwrap_or(0.0);
    let iqr = at(0.75).unwrap_or(0.0) - at(0.25).unwrap_or(0.0);
    (med, if med > 0.0 { 100.0 * iqr / med } else { 0.0 })
}

fn self_launch(args: &BenchArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("find own executable", e))?;
    let mut cfg = distcomm::launch::LaunchConfig::local(args.nproc, exe.as_os_str());
    cfg.args = std::env::args_os().skip(1).collect();
    cfg.prefix_output = false;
    distcomm::launch::forward_signals();
    distcomm::launch::launch(&cfg)
}

fn iters_for(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(10, 2000)
}

pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

fn verify(buf: &[u8], seed: u64, what: &str) -> Result<()> {
    let mut want = vec![0u8; buf.len()];
    fill(&mut want, seed);
    if let Some(i) = buf.iter().zip(&want).position(|(a, b)| a != b) {
        return Err(Error::Config(format!(
            "{what}: payload corrupted at byte {i} of {}",
            buf.len()
        )));
    }
    Ok(())
}

pub fn median(v: Vec<f64>) -> f64 {
    median_spread(v).0
}

/// A result with algbw = bytes / time and busbw = algbw × `factor` (nccl-tests).
pub fn record(
    g: &ProcessGroup,
    op: &'static str,
    dtype: DType,
    bytes: usize,
    iters: usize,
    secs: f64,
    factor: f64,
) -> Record {
    let algbw = if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    };
    Record {
        op,
        bytes,
        dtype: dtype.name(),
        elem: dtype.size(),
        world: g.size(),
        transport: g.transport(),
        iters,
        time_us: secs * 1e6,
        spread_pct: 0.0,
        algbw_gbs: algbw,
        busbw_gbs: algbw * factor,
        staging: None,
    }
}

/// One round trip 0 -> 1 -> 0: small messages with the blocking calls on slices (what
/// `MPI_Send`/`MPI_Recv` are), larger ones with owned buffers (no copies in distcomm).
fn round_trip(g: &ProcessGroup, buf: Vec<u8>, mut rbuf: Vec<u8>) -> Result<(Vec<u8>, Vec<u8>)> {
    if buf.len() <= BLOCKING_MAX {
        if g.rank() == 0 {
            g.send(&buf, 1, 0)?;
            g.recv(&mut rbuf, 1, 1)?;
        } else {
            g.recv(&mut rbuf, 0, 0)?;
            g.send(&rbuf, 0, 1)?;
        }
        return Ok((buf, rbuf));
    }
    if g.rank() == 0 {
        let r = g.irecv(rbuf, 1, 1)?;
        let s = g.isend(buf, 1, 0)?;
        let buf = s.into_buffer()?;
        let rbuf = r.into_buffer()?;
        Ok((buf, rbuf))
    } else {
        let got = g.irecv(rbuf, 0, 0)?.into_buffer()?;
        let got = g.isend(got, 0, 1)?.into_buffer()?;
        Ok((buf, got))
    }
}

/// Largest ping-pong message timed with the blocking calls: those that fit a shared-memory
/// lane, where the blocking calls take their fast path (over shared memory, 8 B: 0.24 µs
/// against 0.45 µs with handles on owned buffers; 1 KiB: 0.70 against 0.94). Above it owned
/// buffers save the copies in and out of the slices.
const BLOCKING_MAX: usize = distcomm::transport::frame::LANE_MAX;

fn pingpong(g: &ProcessGroup, size: usize, check: bool) -> Result<Option<Record>> {
    if g.rank() > 1 {
        return Ok(None);
    }
    let mut buf = vec![0u8; size];
    let mut rbuf = vec![0u8; size];
    let iters = iters_for(size);
    // Verified, untimed round trips before and after the timed ones.
    let checked = |buf: Vec<u8>, rbuf: Vec<u8>, seed: u64| -> Result<(Vec<u8>, Vec<u8>)> {
        let mut buf = buf;
        if check && g.rank() == 0 {
            fill(&mut buf, seed);
        }
        let (buf, rbuf) = round_trip(g, buf, rbuf)?;
        if check {
            verify(&rbuf, seed, "pingpong")?;
        }
        Ok((buf, rbuf))
    };
    (buf, rbuf) = checked(buf, rbuf, size as u64)?;
    for _ in 0..2 {
        (buf, rbuf) = round_trip(g, buf, rbuf)?;
    }
    // Timed in batches (median over batches): reading the clock around every round trip
    // would add its own cost (~40 ns) to the smallest ones.
    let batch = (iters / 40).max(1);
    let mut samples = Vec::with_capacity(iters / batch);
    for _ in 0..iters / batch {
        let t = Instant::now();
        for _ in 0..batch {
            (buf, rbuf) = round_trip(g, buf, rbuf)?;
        }
        samples.push(t.elapsed().as_secs_f64() / (2 * batch) as f64);
    }
    checked(buf, rbuf, size as u64 + 1)?;
    let timed = samples.len() * batch;
    Ok((g.rank() == 0).then(|| timed_record(g, "pingpong", (size, timed), samples)))
}

fn stream(g: &ProcessGroup, size: usize, window: usize, check: bool) -> Result<Option<Record>> {
    if g.rank() > 1 {
        return Ok(None);
    }
    let iters = ((256usize << 20) / (size.max(1) * window)).clamp(5, 200);
    let mut bufs: Vec<Vec<u8>> = (0..window).map(|_| vec![0u8; size]).collect();
    let mut samples = Vec::with_capacity(iters);
    for it in 0..iters + 1 {
        let verify_round = it == 0 && check;
        let t = Instant::now();
        if g.rank() == 0 {
            if verify_round {
                for (k, b) in bufs.iter_mut().enumerate() {
                    fill(b, (size * 31 + k) as u64);
                }
            }
            let works: Vec<_> = bufs
                .drain(..)
                .enumerate()
                .map(|(k, b)| g.isend(b, 1, 10 + k as u32))
                .collect::<Result<_>>()?;
            for w in works {
                bufs.push(w.into_buffer()?);
            }
            let mut ack = [0u8; 1];
            g.recv(&mut ack, 1, 9)?;
        } else {
            let works: Vec<_> = bufs
                .drain(..)
                .enumerate()
                .map(|(k, b)| g.irecv(b, 0, 10 + k as u32))
                .collect::<Result<_>>()?;
            for (k, w) in works.into_iter().enumerate() {
                let b = w.into_buffer()?;
                if verify_round {
                    verify(&b, (size * 31 + k) as u64, "stream")?;
                }
                bufs.push(b);
            }
            g.send(&[1u8], 0, 9)?;
        }
        if it > 0 {
            samples.push(t.elapsed().as_secs_f64() / window as f64);
        }
    }
    Ok((g.rank() == 0).then(|| timed_record(g, "stream", (size, iters * window), samples)))
}

/// A point-to-point record of `samples` (seconds per message) over `iters` messages.
fn timed_record(
    g: &ProcessGroup,
    op: &'static str,
    (size, iters): (usize, usize),
    samples: Vec<f64>,
) -> Record {
    let (secs, spread) = median_spread(samples);
    let mut rec = record(g, op, DType::U8, size, iters, secs, 1.0);
    rec.spread_pct = spread;
    rec
}
