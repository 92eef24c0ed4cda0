//! Data-parallel training of a small MLP on deterministic synthetic data, on N ranks:
//!
//! ```text
//! cargo build --release --example train -p distcomm-optim
//! distcomm launch -n 4 -- target/release/examples/train --optimizer onebit-adam --steps 300
//! ```
//!
//! The task: regress the output of a fixed random "teacher" network (plus noise) from 32
//! inputs. Each rank draws its own minibatch every step (a deterministic function of rank and
//! step), computes gradients by hand-written backpropagation, and the optimizer (learning rate
//! decaying linearly to zero) keeps every rank's replica identical:
//!
//! * `adam` / `adamw`: gradients averaged by an exact all_reduce, then the fused CPU Adam
//!   (L2 decay) or AdamW (decoupled decay);
//! * `onebit-adam`: [`OnebitAdam`] — exact warm-up, then the momentum by 1-bit all_reduce.
//!
//! Rank 0 prints the mean training loss per step, the bytes this rank sent for the optimizer
//! (from the comms log), the wall time, and the loss on a fixed held-out set at the end;
//! `--json FILE` writes `{optimizer, steps, initial_loss, final_loss, bytes_sent, wall_s,
//! world}`.

use std::time::Instant;

use clap::{Parser, ValueEnum};
use distcomm::{ProcessGroup, ReduceOp};
use distcomm_optim::{Adam, AdamConfig, Mode, OnebitAdam, OnebitAdamConfig, Tensor};

const INPUTS: usize = 32;
const HIDDEN: usize = 64;
const BATCH: usize = 32;

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Opt {
    Adam,
    Adamw,
    OnebitAdam,
}

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "adam")]
    optimizer: Opt,
    #[arg(long, default_value_t = 300)]
    steps: u64,
    #[arg(long, default_value_t = 0.003)]
    lr: f32,
    /// Warm-up steps of 1-bit Adam (default: a fifth of the steps).
    #[arg(long)]
    freeze_step: Option<u64>,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 10)]
    every: u64,
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// splitmix64: the deterministic source of every number here.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Uniform in [-1, 1) from a seed.
fn uniform(seed: u64) -> f32 {
    (mix(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// The MLP y = w2 · tanh(W1 x + b1) + b2, its parameters flat: W1, b1, w2, b2.
struct Mlp;

impl Mlp {
    const LEN: usize = HIDDEN * INPUTS + HIDDEN + HIDDEN + 1;

    fn init(seed: u64, scale: f32) -> Vec<f32> {
        (0..Self::LEN as u64)
            .map(|i| uniform(seed ^ (i << 8)) * scale)
            .collect()
    }

    /// Output and hidden activations for one input.
    fn forward(p: &[f32], x: &[f32], h: &mut [f32]) -> f32 {
        let (w1, rest) = p.split_at(HIDDEN * INPUTS);
        let (b1, rest) = rest.split_at(HIDDEN);
        let (w2, b2) = rest.split_at(HIDDEN);
        for (j, hj) in h.iter_mut().enumerate() {
            let row = &w1[j * INPUTS..(j + 1) * INPUTS];
            let z: f32 = row.iter().zip(x).map(|(w, x)| w * x).sum::<f32>() + b1[j];
            *hj = z.tanh();
        }
        h.iter().zip(w2).map(|(h, w)| h * w).sum::<f32>() + b2[0]
    }

    /// Mean squared error over a batch, adding its gradient into `grad`.
    fn loss_and_grad(p: &[f32], batch: &[(Vec<f32>, f32)], grad: &mut [f32]) -> f32 {
        let mut h = [0f32; HIDDEN];
        let k = 1.0 / batch.len() as f32;
        let mut loss = 0.0;
        let (g1, rest) = grad.split_at_mut(HIDDEN * INPUTS);
        let (gb1, rest) = rest.split_at_mut(HIDDEN);
        let (gw2, gb2) = rest.split_at_mut(HIDDEN);
        let w2 = &p[HIDDEN * INPUTS + HIDDEN..HIDDEN * INPUTS + 2 * HIDDEN];
        for (x, y) in batch {
            let out = Self::forward(p, x, &mut h);
            let err = out - y;
            loss += 0.5 * err * err * k;
            let d = err * k;
            gb2[0] += d;
            for j in 0..HIDDEN {
                gw2[j] += d * h[j];
                let dz = d * w2[j] * (1.0 - h[j] * h[j]);
                gb1[j] += dz;
                for (g, xi) in g1[j * INPUTS..(j + 1) * INPUTS].iter_mut().zip(x) {
                    *g += dz * xi;
                }
            }
        }
        loss
    }
}

/// A minibatch: inputs from `seed`, targets from the teacher plus noise.
fn batch(teacher: &[f32], seed: u64, n: usize) -> Vec<(Vec<f32>, f32)> {
    let mut h = [0f32; HIDDEN];
    (0..n as u64)
        .map(|s| {
            let base = mix(seed ^ (s << 32));
            let x: Vec<f32> = (0..INPUTS as u64).map(|i| uniform(base ^ i)).collect();
            let y = Mlp::forward(teacher, &x, &mut h) + 0.05 * uniform(base ^ 0xFFFF);
            (x, y)
        })
        .collect()
}

enum Optimizer {
    Exact {
        adam: Adam,
        m: Vec<f32>,
        v: Vec<f32>,
    },
    OneBit(OnebitAdam),
}

impl Optimizer {
    fn set_lr(&mut self, lr: f32) -> Result<(), String> {
        match self {
            Optimizer::Exact { adam, .. } => adam.set_lr(lr),
            Optimizer::OneBit(o) => o.set_lr(lr),
        }
        .map_err(|e| e.to_string())
    }

    fn step(&mut self, g: &ProcessGroup, p: &mut [f32], grad: &mut [f32]) -> Result<(), String> {
        match self {
            Optimizer::Exact { adam, m, v } => {
                g.all_reduce(grad, ReduceOp::Avg)
                    .map_err(|e| e.to_string())?;
                let t = Tensor::new(p, grad, m, v).map_err(|e| e.to_string())?;
                adam.step(&mut [t]).map_err(|e| e.to_string())
            }
            Optimizer::OneBit(o) => o.step(g, p, grad).map_err(|e| e.to_string()),
        }
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("train: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = Args::parse();
    let g = distcomm::init().map_err(|e| e.to_string())?;
    let (n, r) = (g.size(), g.rank());
    let teacher = Mlp::init(7, 0.3);
    let mut p = Mlp::init(1234, 0.2);
    let mut opt = match args.optimizer {
        Opt::Adam | Opt::Adamw => {
            let (mode, weight_decay) = match args.optimizer {
                Opt::Adam => (Mode::Adam, 0.0),
                _ => (Mode::AdamW, 0.01),
            };
            let cfg = AdamConfig {
                lr: args.lr,
                mode,
                weight_decay,
                ..Default::default()
            };
            Optimizer::Exact {
                adam: Adam::new(cfg).map_err(|e| e.to_string())?,
                m: vec![0.0; Mlp::LEN],
                v: vec![0.0; Mlp::LEN],
            }
        }
        Opt::OnebitAdam => {
            let cfg = OnebitAdamConfig {
                lr: args.lr,
                freeze_step: args.freeze_step.unwrap_or(args.steps / 5),
                ..Default::default()
            };
            Optimizer::OneBit(OnebitAdam::new(cfg, Mlp::LEN).map_err(|e| e.to_string())?)
        }
    };
    let name = args
        .optimizer
        .to_possible_value()
        .map(|v| v.get_name().to_string());
    let name = name.unwrap_or_default();
    if r == 0 {
        println!(
            "# train: {name}, {n} ranks, {} parameters, {} steps",
            Mlp::LEN,
            args.steps
        );
    }
    // Held out: the same set on every rank (and the replicas are identical).
    let test = batch(&teacher, 0xDEAD_BEEF, 2048);
    let initial_loss = Mlp::loss_and_grad(&p, &test, &mut vec![0f32; Mlp::LEN]);
    let mut grad = vec![0f32; Mlp::LEN];
    g.barrier().map_err(|e| e.to_string())?;
    let start = Instant::now();
    for step in 0..args.steps {
        let data = batch(&teacher, mix(step) ^ ((r as u64) << 48), BATCH);
        grad.iter_mut().for_each(|x| *x = 0.0);
        let loss = Mlp::loss_and_grad(&p, &data, &mut grad);
        // Linear decay to zero, so that runs end settled rather than wherever the noise was.
        opt.set_lr(args.lr * (1.0 - step as f32 / args.steps as f32))?;
        g.set_comms_log(true);
        opt.step(&g, &mut p, &mut grad)?;
        g.set_comms_log(false);
        if step % args.every == 0 || step + 1 == args.steps {
            let mut mean = [loss];
            g.all_reduce(&mut mean, ReduceOp::Avg)
                .map_err(|e| e.to_string())?;
            if r == 0 {
                println!("step {step:>5}  loss {:.6}", mean[0]);
            }
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    let final_loss = Mlp::loss_and_grad(&p, &test, &mut vec![0f32; Mlp::LEN]);
    let bytes_sent: u64 = g.comms_log().iter().map(|s| s.sent_bytes).sum();
    if r == 0 {
        println!(
            "# final held-out loss {final_loss:.6}, sent {bytes_sent} B (rank 0), {wall_s:.2} s"
        );
        if let Some(path) = &args.json {
            let rec = serde_json::json!({
                "optimizer": name,
                "steps": args.steps,
                "initial_loss": initial_loss,
                "final_loss": final_loss,
                "bytes_sent": bytes_sent,
                "wall_s": wall_s,
                "world": n,
            });
            std::fs::write(path, format!("{rec}\n"))
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    Ok(())
}
