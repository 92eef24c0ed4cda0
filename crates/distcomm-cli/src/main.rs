//! The `distcomm` command: `launch` local ranks torchrun-style, and `bench` communication.
//!
//! Owns: the command line and `launch`. The benchmarks are [`bench`]'s; this file must not know
//! their suites, records or output.

mod bench;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "distcomm",
    version,
    about = "Communication layer for distributed training"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start ranks of PROGRAM with torchrun's environment; stop all when one fails.
    Launch(LaunchArgs),
    /// Communication benchmarks (nccl-tests style). Bare, it starts its own local ranks.
    Bench(bench::BenchArgs),
}

#[derive(clap::Args)]
#[command(
    override_usage = "distcomm launch [-n RANKS] [OPTIONS] [--] PROGRAM [ARGS]...",
    after_help = "Examples:\n  distcomm launch -n 4 -- ./target/release/my_prog --steps 10\n  \
                  distcomm launch -n 2 -- python train.py\n\nEvery rank gets torchrun's variables \
                  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...) and a fresh job \
                  secret; its output lines are prefixed with [rankN]."
)]
struct LaunchArgs {
    /// Ranks on this node.
    #[arg(
        short = 'n',
        long = "nproc-per-node",
        value_name = "RANKS",
        default_value_t = 1
    )]
    nproc: usize,
    /// Number of nodes.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index (node 0 hosts the store).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Store port on node 0 (0 picks a free port; single node only).
    #[arg(long)]
    master_port: Option<u16>,
    /// Program and its arguments.
    #[arg(
        value_name = "PROGRAM",
        trailing_var_arg = true,
        required = true,
        allow_hyphen_values = true
    )]
    command: Vec<OsString>,
}

fn run_launch(a: LaunchArgs) -> distcomm::Result<()> {
    let mut it = a.command.into_iter();
    let program = it
        .next()
        .ok_or_else(|| distcomm::Error::Config("no program given".into()))?;
    let port = match a.master_port {
        Some(p) => p,
        None if a.nnodes == 1 => 0,
        None => distcomm::env::DEFAULT_MASTER_PORT,
    };
    if a.nnodes > 1 && port == 0 {
        return Err(distcomm::Error::Config(
            "multi-node launches need a fixed --master-port".into(),
        ));
    }
    let mut cfg = distcomm::launch::LaunchConfig::local(a.nproc, program);
    cfg.args = it.collect();
    cfg.nnodes = a.nnodes;
    cfg.node_rank = a.node_rank;
    cfg.master_addr = a.master_addr;
    cfg.master_port = port;
    distcomm::launch::forward_signals();
    distcomm::launch::launch(&cfg)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The library's events: `DISTCOMM_DEBUG` (and `DISTCOMM_DEBUG_SUBSYS`) when set, else
    // warnings only.
    if let Err(e) = distcomm::diag::install_stderr(Some("distcomm=warn")) {
        eprintln!("distcomm: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.cmd {
        Cmd::Launch(a) => run_launch(a),
        Cmd::Bench(a) => bench::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("distcomm: {e}");
            ExitCode::FAILURE
        }
    }
}
