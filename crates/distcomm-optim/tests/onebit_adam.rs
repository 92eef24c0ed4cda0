//! 1-bit Adam across real processes: the warm-up is Adam on the exactly averaged gradients
//! (checked against a serial computation of every rank's gradients), every rank holds
//! bit-identical parameters at every step of both stages, on a noisy quadratic (each rank its
//! own minibatch noise) the compressed stage keeps the parameters at the optimum's noise floor,
//! and parameters whose gradient is always zero stay put (the momentum mask).

#[path = "../../distcomm/tests/common/mod.rs"]
mod common;

use common::run;
use distcomm::ProcessGroup;
use distcomm_optim::{Adam, AdamConfig, Mode, OnebitAdam, OnebitAdamConfig, Tensor};

const LEN: usize = 1003;
const WARMUP: u64 = 100;
const STEPS: u64 = 400;

/// The optimum: loss ½‖p − target‖², some of it exactly zero.
fn target() -> Vec<f32> {
    (0..LEN)
        .map(|i| ((i * 13) % 41) as f32 / 10.0 - 2.0)
        .collect()
}

/// Deterministic noise in [-0.5, 0.5) for (rank, step, element): each rank's minibatch.
fn noise(r: usize, step: u64, i: usize) -> f32 {
    let mut x = (r as u64) << 40 ^ step << 20 ^ i as u64;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    (x % 1000) as f32 / 1000.0 - 0.5
}

/// Rank r's stochastic gradient at `step` (elements with a zero target get no noise: their
/// gradient is exactly zero all along).
fn grads(p: &[f32], r: usize, step: u64) -> Vec<f32> {
    let t = target();
    (0..LEN)
        .map(|i| {
            let e = if t[i] == 0.0 { 0.0 } else { noise(r, step, i) };
            p[i] - t[i] + e
        })
        .collect()
}

fn dist(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f32>()
        .sqrt()
}

/// Every rank's parameters, bit for bit the same?
fn agree(g: &ProcessGroup, p: &[f32]) -> bool {
    let all = g.all_gather_list(p).unwrap();
    all.iter()
        .all(|q| q.iter().zip(p).all(|(a, b)| a.to_bits() == b.to_bits()))
}

#[test]
fn onebit_adam_warms_up_exactly_then_compresses_in_step() {
    run(
        "onebit_adam_warms_up_exactly_then_compresses_in_step",
        &[1, 2, 3, 4],
        |g| {
            let (n, r) = (g.size(), g.rank());
            let cfg = OnebitAdamConfig {
                lr: 0.02,
                beta2: 0.99,
                weight_decay: 0.001,
                freeze_step: WARMUP,
                ..Default::default()
            };
            g.set_comms_log(true);
            let mut p = vec![0f32; LEN];
            let mut opt = OnebitAdam::new(cfg, LEN).unwrap();
            // The serial warm-up: fused AdamW, no bias correction, on the mean gradient.
            let mut ref_opt = Adam::new(AdamConfig {
                lr: cfg.lr,
                beta2: cfg.beta2,
                weight_decay: cfg.weight_decay,
                mode: Mode::AdamW,
                bias_correction: false,
                ..Default::default()
            })
            .unwrap();
            let (mut rp, mut rm, mut rv) = (vec![0f32; LEN], vec![0f32; LEN], vec![0f32; LEN]);
            let start = dist(&p, &target());
            let mut at_freeze = start;
            for step in 0..STEPS {
                assert_eq!(opt.compressing(), step >= WARMUP);
                if step == WARMUP {
                    at_freeze = dist(&p, &target());
                }
                let mut gr = grads(&p, r, step);
                opt.step(g, &mut p, &mut gr).unwrap();
                if step < WARMUP {
                    let mut mean = vec![0f32; LEN];
                    for q in 0..n {
                        for (m, x) in mean.iter_mut().zip(grads(&rp, q, step)) {
                            *m += x;
                        }
                    }
                    mean.iter_mut().for_each(|m| *m /= n as f32);
                    let t = Tensor::new(&mut rp, &mean, &mut rm, &mut rv).unwrap();
                    ref_opt.step(&mut [t]).unwrap();
                    let err = dist(&p, &rp);
                    assert!(
                        err <= 1e-4 * (1.0 + dist(&rp, &[0.0; LEN])),
                        "step {step}: {err}"
                    );
                }
                if step % 25 == 0 || step == STEPS - 1 {
                    assert!(agree(g, &p), "ranks diverged at step {step}");
                }
            }
            let end = dist(&p, &target());
            assert!(
                end < 0.06 * start && end < 1.2 * at_freeze,
                "world {n}: {start} -> {at_freeze} at the freeze -> {end}"
            );
            // After the warm-up, the momentum went by 1-bit all_reduce, one per step.
            let log = g.comms_log();
            let onebit = log.iter().find(|s| s.op == "onebit_all_reduce").unwrap();
            assert_eq!(onebit.count as u64, STEPS - WARMUP);
            assert_eq!(opt.steps(), STEPS);
            // Elements every rank's target holds at zero never move: their gradient is zero
            // all along, and the momentum mask keeps 1-bit noise off them.
            let zero: Vec<usize> = (0..LEN).filter(|&i| target()[i] == 0.0).collect();
            assert!(!zero.is_empty());
            assert!(zero.iter().all(|&i| p[i] == 0.0), "masked parameters moved");
        },
    );
}

#[test]
fn mismatched_lengths_are_refused() {
    run("mismatched_lengths_are_refused", &[1], |g| {
        let mut opt = OnebitAdam::new(OnebitAdamConfig::default(), 4).unwrap();
        let err = opt.step(g, &mut [0.0; 4], &mut [0.0; 3]).unwrap_err();
        assert!(err.to_string().contains("differ in length"), "{err}");
        assert!(OnebitAdam::new(
            OnebitAdamConfig {
                beta1: 1.0,
                ..Default::default()
            },
            4
        )
        .is_err());
    });
}
