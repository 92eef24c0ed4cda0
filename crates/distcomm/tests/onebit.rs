//! 1-bit compressed all_reduce against a serial simulation of the same algorithm, written here
//! independently: world sizes 1–5, lengths divisible by nothing convenient, several calls in a
//! row (the error feedback carries over), and empty buffers.

mod common;

use common::run;
use distcomm::{padded_len, OneBitState};

/// One rank's error feedback in the simulation.
#[derive(Clone, Default)]
struct Sim {
    worker_error: Vec<f32>,
    server_error: Vec<f32>,
}

/// Rank r's input at call k.
fn input(r: usize, k: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7 + r * 13 + k * 29) % 23) as f32 - 11.0) * 0.1 + r as f32 * 0.01)
        .collect()
}

fn sign_bit(v: f32) -> bool {
    v >= 0.0
}

fn scale_of(x: &[f32]) -> f32 {
    let sq: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    (sq.sqrt() / (x.len() as f64).sqrt()) as f32
}

/// Every rank's output of one call, updating every rank's state, all in one process.
fn simulate(inputs: &[Vec<f32>], states: &mut [Sim]) -> Vec<Vec<f32>> {
    let n = inputs.len();
    let len = inputs[0].len();
    let padded = padded_len(len, n);
    let chunk = padded / n;
    // Workers: compensated, compressed.
    let mut worker_signs = vec![vec![false; padded]; n];
    let mut worker_scales = vec![0f32; n];
    for r in 0..n {
        let st = &mut states[r];
        if st.worker_error.len() != padded {
            st.worker_error = vec![0.0; padded];
            st.server_error = vec![0.0; chunk];
        }
        let mut x: Vec<f32> = (0..padded)
            .map(|i| inputs[r].get(i).copied().unwrap_or(0.0) + st.worker_error[i])
            .collect();
        let s = scale_of(&x);
        for (i, v) in x.iter_mut().enumerate() {
            worker_signs[r][i] = sign_bit(*v);
            *v -= s * if sign_bit(*v) { 1.0 } else { -1.0 };
        }
        worker_scales[r] = s;
        st.worker_error = x;
    }
    // Servers: rank s serves chunk s.
    let mut out_signs = vec![false; padded];
    let mut out_scales = vec![0f32; n];
    for s in 0..n {
        let mut m = states[s].server_error.clone();
        for (i, v) in m.iter_mut().enumerate() {
            for w in 0..n {
                let unit = if worker_signs[w][s * chunk + i] {
                    1.0
                } else {
                    -1.0
                };
                *v += worker_scales[w] / n as f32 * unit;
            }
        }
        let sc = scale_of(&m);
        for (i, v) in m.iter_mut().enumerate() {
            out_signs[s * chunk + i] = sign_bit(*v);
            *v -= sc * if sign_bit(*v) { 1.0 } else { -1.0 };
        }
        out_scales[s] = sc;
        states[s].server_error = m;
    }
    let out: Vec<f32> = (0..len)
        .map(|i| out_scales[i / chunk] * if out_signs[i] { 1.0 } else { -1.0 })
        .collect();
    vec![out; n]
}

#[test]
fn onebit_all_reduce_matches_the_serial_algorithm() {
    run(
        "onebit_all_reduce_matches_the_serial_algorithm",
        &[1, 2, 3, 4, 5],
        |g| {
            let (n, r) = (g.size(), g.rank());
            for len in [1usize, 7, 13, 1000, 12_345] {
                let mut mine = OneBitState::default();
                let mut sim: Vec<Sim> = vec![Sim::default(); n];
                for k in 0..3 {
                    let inputs: Vec<Vec<f32>> = (0..n).map(|q| input(q, k, len)).collect();
                    let want = simulate(&inputs, &mut sim);
                    let mut buf = inputs[r].clone();
                    g.onebit_all_reduce(&mut buf, &mut mine).unwrap();
                    for (i, (a, b)) in buf.iter().zip(&want[r]).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                            "world {n} len {len} call {k} elem {i}: {a} vs {b}"
                        );
                    }
                    assert_eq!(mine.worker_error().len(), padded_len(len, n));
                    for (a, b) in mine.worker_error().iter().zip(&sim[r].worker_error) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
                    }
                    assert_eq!(mine.server_error().len(), sim[r].server_error.len());
                    for (a, b) in mine.server_error().iter().zip(&sim[r].server_error) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()));
                    }
                }
                // An empty buffer zeroes both error buffers.
                g.onebit_all_reduce(&mut [], &mut mine).unwrap();
                assert!(mine.worker_error().iter().all(|&v| v == 0.0));
                assert!(mine.server_error().iter().all(|&v| v == 0.0));
            }
        },
    );
}

#[test]
fn padding_gives_every_rank_whole_bytes() {
    for n in 1..=8 {
        for len in [0usize, 1, 7, 8, 63, 64, 65, 1000] {
            let p = padded_len(len, n);
            assert!(
                p >= len && p % (8 * n) == 0 && p - len < 8 * n,
                "{len} on {n}: {p}"
            );
        }
    }
}

#[test]
fn async_calls_in_flight_together_match_too() {
    run("async_calls_in_flight_together_match_too", &[2, 3], |g| {
        use std::sync::{Arc, Mutex};
        let (n, r) = (g.size(), g.rank());
        let lens = [1000usize, 77];
        let states: Vec<Arc<Mutex<OneBitState>>> = lens
            .iter()
            .map(|_| Arc::new(Mutex::new(OneBitState::default())))
            .collect();
        let mut sims: Vec<Vec<Sim>> = lens.iter().map(|_| vec![Sim::default(); n]).collect();
        for k in 0..3 {
            // Both in flight, plus a blocking all_reduce between them.
            let works: Vec<_> = lens
                .iter()
                .zip(&states)
                .enumerate()
                .map(|(j, (&len, st))| {
                    g.onebit_all_reduce_async(input(r, k + 10 * j, len), st.clone())
                        .unwrap()
                })
                .collect();
            let mut x = [1i32];
            g.all_reduce(&mut x, distcomm::ReduceOp::Sum).unwrap();
            assert_eq!(x[0] as usize, n);
            for (j, w) in works.into_iter().enumerate() {
                let got = w.into_buffer().unwrap();
                let inputs: Vec<Vec<f32>> = (0..n).map(|q| input(q, k + 10 * j, lens[j])).collect();
                let want = simulate(&inputs, &mut sims[j]);
                for (a, b) in got.iter().zip(&want[r]) {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
                }
            }
        }
    });
}

#[test]
fn the_comms_log_counts_the_bytes_each_call_sent() {
    common::run_native_env(
        "the_comms_log_counts_the_bytes_each_call_sent",
        &[2, 3, 4],
        // The network schedule, so that the exact all_reduce's bytes follow the ring formula.
        &[("DISTCOMM_SHM_ALLREDUCE", "0")],
        |g| {
            let n = g.size() as u64;
            g.set_comms_log(true);
            let len = 3 << 18; // 3 MiB of f32, divisible by every world size here
            let mut st = OneBitState::default();
            let mut x = input(g.rank(), 0, len);
            g.onebit_all_reduce(&mut x, &mut st).unwrap();
            g.all_reduce(&mut x, distcomm::ReduceOp::Avg).unwrap();
            let log = g.comms_log();
            assert_eq!(
                log.len(),
                2,
                "sub-collectives of the 1-bit call are not logged alone"
            );
            let onebit = log.iter().find(|s| s.op == "onebit_all_reduce").unwrap();
            let exact = log.iter().find(|s| s.op == "all_reduce").unwrap();
            // Phase 1 all_to_all and phase 2 all_gather of signs (one chunk to each peer),
            // plus two ring all_gathers of one f32 scale per rank.
            let per = padded_len(len, n as usize) as u64 / 8 / n;
            assert_eq!(onebit.sent_bytes, (n - 1) * (2 * per + 8));
            // The ring all_reduce: a 1/n chunk per step, 2(n-1) steps.
            assert_eq!(exact.sent_bytes, 2 * (n - 1) * (4 * len as u64 / n));
            assert!(onebit.sent_bytes * 30 <= exact.sent_bytes);
        },
    );
}
