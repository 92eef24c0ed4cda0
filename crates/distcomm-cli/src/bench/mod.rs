//! `distcomm bench`: point-to-point ping-pong and streaming, and every collective, in the
//! nccl-tests style (size, count, type, op, time, algbw, busbw, check).
//!
//! Owns: the command line of `bench` ([`BenchArgs`], the [`Suites`] it names), starting its own
//! ranks when not under a launcher, and the run: which suites at which sizes, the progress bar,
//! headers and rows, `--json` and `--plot`. The suites ([`p2p`], [`collectives`], [`staging`])
//! measure, after [`warm`]ing up; [`record`] (a leaf) is what they report and how a row reads;
//! [`plot`] draws records. Must not know: how any op is run, timed or checked.

mod collectives;
mod p2p;
mod plot;
mod record;
mod staging;
mod warm;

use std::path::PathBuf;

use clap::builder::PossibleValue;
use distcomm::{Error, ProcessGroup, Result};

use collectives::{Collective, ElemType};
use record::{row, write_out, Record, Title};

/// One benchmark suite.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Suite {
    /// Ping-pong and streaming between ranks 0 and 1.
    P2p,
    /// One collective on the collectives' element type.
    Collective(Collective),
    /// Staged ops on device buffers against the same ops on host buffers.
    Staging,
}

impl Suite {
    /// The suite's name on the command line and in the output.
    pub fn name(self) -> &'static str {
        match self {
            Suite::P2p => "p2p",
            Suite::Collective(c) => c.name(),
            Suite::Staging => "staging",
        }
    }

    /// Whether it runs between ranks 0 and 1, so needs two ranks at least.
    fn needs_a_pair(self) -> bool {
        matches!(self, Suite::P2p | Suite::Staging)
    }

    /// Whether it runs at every size (a barrier has none).
    fn sized(self) -> bool {
        self != Suite::Collective(Collective::Barrier)
    }
}

/// What `distcomm bench SUITE` runs: one suite, or all.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Suites {
    One(Suite),
    /// p2p and every collective (the 1-bit all_reduce only on f32); not staging.
    All,
}

impl Suites {
    /// Every choice, in the order `--help` lists them (and `all` runs its suites).
    const VARIANTS: [Suites; Collective::ALL.len() + 3] = {
        let mut v = [Suites::All; Collective::ALL.len() + 3];
        v[0] = Suites::One(Suite::P2p);
        let mut i = 0;
        while i < Collective::ALL.len() {
            v[i + 1] = Suites::One(Suite::Collective(Collective::ALL[i]));
            i += 1;
        }
        v[i + 1] = Suites::One(Suite::Staging);
        v
    };

    /// The name on the command line and in the output's title.
    pub fn name(self) -> &'static str {
        match self {
            Suites::One(s) => s.name(),
            Suites::All => "all",
        }
    }

    /// The suites to run, in order, with the collectives on `elem`.
    fn expand(self, elem: ElemType) -> Vec<Suite> {
        match self {
            Suites::One(s) => vec![s],
            // The 1-bit all_reduce compresses f32 only.
            Suites::All => Suites::VARIANTS
                .iter()
                .filter_map(|s| match s {
                    Suites::One(Suite::Staging) | Suites::All => None,
                    Suites::One(Suite::Collective(Collective::OneBitAllReduce))
                        if elem != ElemType::F32 =>
                    {
                        None
                    }
                    Suites::One(s) => Some(*s),
                })
                .collect(),
        }
    }
}

impl clap::ValueEnum for Suites {
    fn value_variants<'a>() -> &'a [Self] {
        &Suites::VARIANTS
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.name()))
    }
}

/// The arguments of `distcomm bench`.
#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// What to measure: p2p, a collective, onebit_all_reduce (1-bit compressed, average),
    /// staging (see --device) or all (p2p and the collectives).
    #[arg(default_value = "p2p")]
    suite: Suites,
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
    /// Time the p2p ping-pong with `isend`/`irecv` handles at every size (by default messages
    /// up to 1 KiB take the blocking calls, whose shared-memory fast path needs no handle).
    #[arg(long)]
    handles: bool,
    /// The device of `bench staging`: emulated (host memory staged as a GPU's would be), host
    /// (no staging), wgpu or cuda (builds with those features).
    #[arg(long, default_value = "emulated")]
    device: String,
    /// Element type of the collectives (16-bit floats are reduced in f32 and rounded once; they
    /// travel at 16 bits through the shared-memory arena, and over the network in all_reduce,
    /// reduce_scatter and reduce from 64 KiB, as f32 otherwise).
    #[arg(long, default_value = "f32")]
    dtype: ElemType,
    /// Run every suite in subgroups of K consecutive ranks at once (as tensor- or
    /// data-parallel groups are), each group on its own; the figures are those of rank 0's
    /// group. The world must be a multiple of K.
    #[arg(long, value_name = "K")]
    group: Option<usize>,
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    distcomm::config::parse_bytes(s).ok_or_else(|| format!("{s:?} is not a size like 8, 4K or 64M"))
}

/// Runs `distcomm bench`: under a launcher as one of its ranks, else on `--nproc` ranks of
/// its own.
pub fn run(args: BenchArgs) -> Result<()> {
    let dtype = args.dtype.dtype().name();
    let onebit = Suites::One(Suite::Collective(Collective::OneBitAllReduce));
    if args.suite == onebit && args.dtype != ElemType::F32 {
        return Err(Error::Config(format!(
            "bench onebit_all_reduce compresses f32 only, not {dtype}"
        )));
    }
    if !distcomm::env::JobEnv::present() {
        return self_launch(&args);
    }
    let world = distcomm::init()?;
    let sub = match args.group {
        None => None,
        Some(k) if k >= 1 && world.size() % k == 0 => {
            let first = world.rank() / k * k;
            let mine: Vec<usize> = (first..first + k).collect();
            Some(world.subgroup(&mine)?)
        }
        Some(k) => {
            return Err(Error::Config(format!(
                "bench --group {k}: the world of {} ranks is no multiple of {k}",
                world.size()
            )))
        }
    };
    let group = sub.as_ref().unwrap_or(&world);
    let sizes = match (&args.sizes, args.quick) {
        (Some(s), _) => s.clone(),
        (None, true) => vec![8, 4096, 1 << 20],
        (None, false) => {
            let mut v: Vec<usize> = (0..12).map(|i| 8usize << (2 * i)).collect();
            v.push(64 << 20);
            v
        }
    };
    let suites = args.suite.expand(args.dtype);
    if suites.iter().any(|s| s.needs_a_pair()) && group.size() < 2 {
        return Err(Error::Config(format!(
            "bench {} needs at least 2 ranks",
            args.suite.name()
        )));
    }
    let lead = world.rank() == 0;
    let bar = if lead {
        let steps = suites.iter().filter(|s| s.sized()).count() * sizes.len() + 1;
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
        suite: args.suite.name(),
        world: group.size(),
        transport: group.transport(),
        backend: if group.transport() == "mpi" {
            "mpi"
        } else {
            "native"
        },
        dtype,
    };
    if lead {
        say(format!("# {}", title.line()));
        if let Some(k) = args.group {
            say(format!(
                "# in {} groups of {k} ranks at once; figures of the group of world rank 0",
                world.size() / k
            ));
        }
        if args.suite == Suites::One(Suite::Staging) {
            say(staging::NOTE.into());
        }
    }
    let window = args.window.max(1);
    let check = !args.no_check;
    let mut records = Vec::new();
    let mut coll_header = false;
    for &suite in &suites {
        if lead {
            for line in header(
                suite,
                group.size(),
                (window, args.handles),
                &mut coll_header,
            ) {
                say(line);
            }
        }
        let sizes = if suite.sized() {
            &sizes[..]
        } else {
            &sizes[..1]
        };
        for &size in sizes {
            bar.set_message(format!("{} {size} B", suite.name()));
            let recs = run_size(group, &args, suite, size)?;
            world.barrier()?;
            // Every group's rank 0 has records: the lead's group speaks for all.
            for rec in recs.into_iter().filter(|_| lead) {
                say(row(&rec, if check { "ok" } else { "skip" }));
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
            let (svg, charts) = plot::svg(&records, &title)?;
            write_out(path, &svg, &format!("a plot ({charts})"))?;
        }
    }
    Ok(())
}

/// One suite at one size: the records on rank 0.
fn run_size(g: &ProcessGroup, args: &BenchArgs, suite: Suite, size: usize) -> Result<Vec<Record>> {
    let check = !args.no_check;
    match suite {
        Suite::P2p => p2p::run_size(g, size, (args.window.max(1), args.handles), check),
        Suite::Staging => staging::run_size(g, &args.device, size),
        Suite::Collective(op) => Ok(collectives::run_op(g, op, args.dtype, size, check)?
            .into_iter()
            .collect()),
    }
}

/// The column header of `suite` (`p2p`: the stream's window and whether the ping-pong uses
/// handles; `coll_done`: the collectives' header is out already; they share it).
fn header(suite: Suite, n: usize, p2p: (usize, bool), coll_done: &mut bool) -> Vec<String> {
    match suite {
        Suite::P2p => p2p::header(p2p.0, p2p.1),
        Suite::Staging => Vec::new(),
        Suite::Collective(_) if !std::mem::replace(coll_done, true) => collectives::header(n),
        Suite::Collective(_) => Vec::new(),
    }
}

fn self_launch(args: &BenchArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("find own executable", e))?;
    let mut cfg = distcomm::launch::LaunchConfig::local(args.nproc, exe.as_os_str());
    cfg.args = std::env::args_os().skip(1).collect();
    cfg.prefix_output = false;
    distcomm::launch::forward_signals();
    distcomm::launch::launch(&cfg)
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::{parse_size, ElemType, Suite, Suites};

    #[test]
    fn suites_are_named_and_all_expands_in_order() {
        let names: Vec<_> = Suites::value_variants().iter().map(|s| s.name()).collect();
        assert_eq!(
            names.join(" "),
            "p2p all_reduce broadcast reduce all_gather gather scatter reduce_scatter \
             all_to_all barrier onebit_all_reduce staging all"
        );
        let all: Vec<_> = Suites::All.expand(ElemType::F32);
        assert_eq!(all.len(), 11);
        assert_eq!(all[0], Suite::P2p);
        assert!(!all.contains(&Suite::Staging));
        let bf16: Vec<_> = Suites::All.expand(ElemType::Bf16);
        assert_eq!(bf16, all[..10]);
        assert_eq!(
            Suites::from_str("all_to_all", false).map(Suites::name),
            Ok("all_to_all")
        );
        assert!(Suites::from_str("allreduce", false).is_err());
    }

    #[test]
    fn sizes_take_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("100B"), Ok(100));
        assert!(parse_size("x").is_err());
    }
}
