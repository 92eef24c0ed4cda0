//! The shared-memory arena's collectives (every rank on one host over shared memory): the
//! network path's results, in pieces and in small slots, and desyncs found on every rank.

mod common;

use common::run_native_env;
use distcomm::{Error, ProcessGroup, ReduceOp};
use half::bf16;

/// The shared-memory arena's path of the collectives other than all_reduce (every rank on one
/// host over shared memory, parts up to its limit) gives the network path's results, and a root
/// that differs between ranks is a desync on every rank, at that call or the next that reads
/// every rank (a dead rank is found by the arena's waiting, tested with all_reduce).
/// (Ranks on cores of their own, as far as the arena knows: so the mid sizes take direct steps
/// on any machine.)
#[test]
fn arena_collectives_match_and_detect_desync() {
    run_native_env(
        "arena_collectives_match_and_detect_desync",
        &[2, 3],
        &[ON_OWN_CORES],
        arena_collectives,
    );
}

/// The same where the ranks share a core's caches: the slots carry what direct steps carry on
/// cores of their own, up to megabytes.
#[test]
fn arena_collectives_on_shared_caches() {
    run_native_env(
        "arena_collectives_on_shared_caches",
        &[2],
        &[("DISTCOMM_SHM_SHARED_CACHES", "1")],
        arena_collectives,
    );
}

/// The arena's setting for ranks on cores of their own (direct steps from small blocks), so
/// that the tests of those steps take them whatever the arena would measure on the machine
/// that runs them (two hardware threads of one core share their caches).
const ON_OWN_CORES: (&str, &str) = ("DISTCOMM_SHM_SHARED_CACHES", "0");

/// The same in slots of 4099 bytes and without cross-memory copies (so no direct steps): parts
/// in many pieces of an odd size, reduces that do not fit one step.
#[test]
fn arena_collectives_in_small_slots() {
    let env = [
        ("DISTCOMM_SHM_ARENA_CHUNK", "4099"),
        ("DISTCOMM_SHM_CMA", "0"),
    ];
    run_native_env(
        "arena_collectives_in_small_slots",
        &[2, 3],
        &env,
        arena_collectives,
    );
}

/// The same through the slots (no cross-memory copies) with large copies streamed
/// (non-temporal stores), whichever the arena would measure on the machine that runs it
/// (`DISTCOMM_SHM_STREAM`); also a large all_reduce, whose chunks stream too.
#[test]
fn arena_collectives_streamed() {
    let env = [("DISTCOMM_SHM_CMA", "0"), ("DISTCOMM_SHM_STREAM", "1")];
    run_native_env(
        "arena_collectives_streamed",
        &[2, 3],
        &env,
        slots_collectives,
    );
}

/// The same with ordinary stores only.
#[test]
fn arena_collectives_not_streamed() {
    let env = [("DISTCOMM_SHM_CMA", "0"), ("DISTCOMM_SHM_STREAM", "0")];
    run_native_env(
        "arena_collectives_not_streamed",
        &[2, 3],
        &env,
        slots_collectives,
    );
}

/// [`arena_collectives`] and an all_reduce of 4 MiB and a little more.
fn slots_collectives(g: &ProcessGroup) {
    arena_collectives(g);
    let (n, r) = (g.size(), g.rank());
    let len = (1 << 20) + 77;
    let mut x: Vec<f32> = (0..len).map(|i| (r * 3 + i % 1009) as f32).collect();
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    let want = |i: usize| (0..n).map(|q| (q * 3 + i % 1009) as f32).sum::<f32>();
    assert!((0..len).all(|i| x[i] == want(i)), "all_reduce");
}

/// A root whose small broadcasts need nobody to wait for runs ahead of the others, by more
/// calls than the arena has control lines: it must wait for the slowest before it writes a
/// line again, and every rank still gets every call's value, in order (a rank that sleeps now
/// and then falls far behind; broadcasts of slot size in between). Then the other way round:
/// the senders of small gathers run ahead of a root that sleeps now and then. (World 2 runs
/// ahead by at most half the lines, taking lines for writing before it needs them; world 3
/// on this machine's 2 cores by all of them.)
#[test]
fn arena_root_running_ahead_reuses_no_line_too_early() {
    run_native_env(
        "arena_root_running_ahead_reuses_no_line_too_early",
        &[2, 3],
        &[],
        |g: &ProcessGroup| {
            let (n, r) = (g.size(), g.rank());
            for i in 0..2000i64 {
                if r == n - 1 && i % 500 == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let mut v = if r == 0 { [i, !i] } else { [0, 0] };
                g.broadcast(&mut v, 0).unwrap();
                assert_eq!(v, [i, !i], "rank {r}: call {i}");
                if i % 300 == 0 {
                    let mut big: Vec<i64> = vec![if r == 0 { i } else { 0 }; 1000];
                    g.broadcast(&mut big, 0).unwrap();
                    assert!(big.iter().all(|&x| x == i), "rank {r}: call {i} (slots)");
                }
            }
            for i in 0..2000i64 {
                if r == 0 && i % 500 == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let mine = [i, r as i64];
                if r == 0 {
                    let mut all = vec![0i64; 2 * n];
                    g.gather(&mine, Some(&mut all), 0).unwrap();
                    let want: Vec<i64> = (0..n as i64).flat_map(|q| [i, q]).collect();
                    assert_eq!(all, want, "gather {i}");
                } else {
                    g.gather(&mine, None, 0).unwrap();
                }
            }
        },
    );
}

/// Large all_reduces of ranks on cores of their own (world 2 here: not outnumbering the cores)
/// move through the slots with non-temporal stores, reduces on two ranks take a direct step:
/// every element type's result as elsewhere (integer averages, 16-bit floats rounded once),
/// lengths that do not divide among the ranks, a reduce leaves the other ranks' buffers as
/// they were, and an operator that differs between ranks is a desync on every rank, not a
/// hang or a wrong result.
#[test]
fn arena_large_all_reduce_on_own_cores() {
    let env = [ON_OWN_CORES, ("DISTCOMM_SHM_STREAM", "1")];
    run_native_env(
        "arena_large_all_reduce_on_own_cores",
        &[2, 3],
        &env,
        large_all_reduce,
    );
}

/// The same where ordinary stores beat streaming ones (cores sharing their last-level cache):
/// world 2 all_reduces from 2 MiB (but those of 16-bit floats) take two direct steps instead.
#[test]
fn arena_large_all_reduce_by_direct_steps() {
    let env = [ON_OWN_CORES, ("DISTCOMM_SHM_STREAM", "0")];
    run_native_env(
        "arena_large_all_reduce_by_direct_steps",
        &[2],
        &env,
        large_all_reduce,
    );
}

/// The body of [`arena_large_all_reduce_on_own_cores`].
fn large_all_reduce(g: &ProcessGroup) {
    if g.transport() != "shm" {
        return;
    }
    let (n, r) = (g.size(), g.rank());
    let len = (32 << 20) / 4 + 7;
    let val = |q: usize, i: usize| ((q * 7 + i * 13) % 1000) as f32;
    let mut x: Vec<f32> = (0..len).map(|i| val(r, i)).collect();
    g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    let bad = (0..len).find(|&i| x[i] != (0..n).map(|q| val(q, i)).sum::<f32>());
    assert_eq!(bad, None, "rank {r}: sum differs at element {bad:?}");
    let mut ints = vec![10 * (r as i64 + 1); (32 << 20) / 8 + 3];
    g.all_reduce(&mut ints, ReduceOp::Avg).unwrap();
    let want = 10 * (1..=n as i64).sum::<i64>() / n as i64;
    assert!(ints.iter().all(|&v| v == want), "{:?}", &ints[..4]);
    let mut halves = vec![bf16::from_f32(0.1 * (r as f32 + 1.0)); (32 << 20) / 2 + 1];
    g.all_reduce(&mut halves, ReduceOp::Sum).unwrap();
    let exact: f32 = (1..=n)
        .map(|q| bf16::from_f32(0.1 * q as f32).to_f32())
        .sum();
    let want = bf16::from_f32(exact);
    assert!(halves.iter().all(|&v| v == want), "{:?}", &halves[..4]);
    // A reduce (on two ranks a direct step from 32 KiB): the root gets the result, the
    // others' buffers stay as they were.
    let mut z: Vec<f32> = (0..len).map(|i| val(r, i)).collect();
    g.reduce(&mut z, n - 1, ReduceOp::Max).unwrap();
    let want = |i: usize| match r == n - 1 {
        true => (0..n).map(|q| val(q, i)).fold(f32::MIN, f32::max),
        false => val(r, i),
    };
    let bad = (0..len).find(|&i| z[i] != want(i));
    assert_eq!(bad, None, "rank {r}: reduce differs at element {bad:?}");
    let mut small = vec![(r + 1) as i64; 5000];
    g.reduce(&mut small, 0, ReduceOp::Sum).unwrap();
    let want = if r == 0 {
        (n * (n + 1) / 2) as i64
    } else {
        1 + r as i64
    };
    assert!(small.iter().all(|&v| v == want), "{:?}", &small[..4]);
    let op = if r == 0 { ReduceOp::Max } else { ReduceOp::Sum };
    let mut y = vec![1f32; 8 << 20];
    let t = std::time::Instant::now();
    match g.all_reduce(&mut y, op) {
        Err(Error::Desync { .. } | Error::Aborted { .. }) => {}
        other => panic!("rank {r}: expected a desync, got {other:?}"),
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
}

/// A subgroup whose members share a host sets up an arena of its own at its first collective
/// and gets the same results and desync detection there as the world (here with group ranks
/// that are not the global ones: the last ranks in reverse), while a group of one beside it
/// has none.
#[test]
fn subgroup_arenas() {
    run_native_env(
        "subgroup_arenas",
        &[3, 4],
        &[ON_OWN_CORES],
        |g: &ProcessGroup| {
            if g.transport() != "shm" {
                return;
            }
            let (n, r) = (g.size(), g.rank());
            let members: Vec<usize> = (1..n).rev().collect();
            if r == 0 {
                let solo = g.subgroup(&[0]).unwrap();
                let mut x = [1.5f32];
                solo.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, [1.5]);
                assert!(!solo.intranode_all_reduce());
            } else {
                let sub = g.subgroup(&members).unwrap();
                assert_eq!(sub.rank(), n - 1 - r);
                assert!(
                    !sub.intranode_all_reduce(),
                    "set up at the first collective"
                );
                let mut x = vec![r as i64; 5];
                sub.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, vec![members.iter().sum::<usize>() as i64; 5]);
                assert!(
                    sub.intranode_all_reduce(),
                    "rank {r}: no arena in the subgroup"
                );
                arena_collectives(&sub);
            }
            // The world's arena is its own: the subgroup's desync above did not break it.
            let mut y = [1i32];
            g.all_reduce(&mut y, ReduceOp::Sum).unwrap();
            assert_eq!(y, [n as i32]);
            assert!(g.intranode_all_reduce());
        },
    );
}

/// A reduce_scatter of 0.6-1 MB parts on three, four and five ranks. On a machine where they
/// outnumber the cores (the 2-core machines of CI), three and four ranks take one exchange
/// step (each reducing its own block from every slot), five go the way of all_reduce through
/// the arena, every rank taking its block; with five cores or more, one step or the network
/// paths. On every path: blocks of odd lengths across the chunks, sums in rank order, integer
/// and 16-bit averages divided once (rounded once), and an operator that differs between ranks
/// is a desync on every rank, not a wrong result.
#[test]
fn arena_reduce_scatter_large_parts() {
    run_native_env(
        "arena_reduce_scatter_large_parts",
        &[3, 4, 5],
        &[],
        |g: &ProcessGroup| {
            let (n, r) = (g.size(), g.rank());
            // Parts of 0.6, 0.8 and 1.0 MB on 3, 4 and 5 ranks (the bf16 ones widened to f32,
            // a few bytes more), all under the arena's one-step limit of 1 MiB.
            let k = 50_001;
            let val = |q: usize, i: usize| ((q * 7 + i * 13) % 1000) as f32;
            let input: Vec<f32> = (0..n * k).map(|i| val(r, i)).collect();
            let mut out = vec![0f32; k];
            g.reduce_scatter(&input, &mut out, ReduceOp::Sum).unwrap();
            let want = |i: usize| (0..n).map(|q| val(q, r * k + i)).sum::<f32>();
            let bad = (0..k).find(|&i| out[i] != want(i));
            assert_eq!(bad, None, "rank {r}: sum differs at element {bad:?}");
            let ints = vec![10 * (r as i64 + 1); n * k];
            let mut avg = vec![0i64; k];
            g.reduce_scatter(&ints, &mut avg, ReduceOp::Avg).unwrap();
            let tri = 10 * (1..=n as i64).sum::<i64>();
            assert!(avg.iter().all(|&v| v == tri / n as i64), "{:?}", &avg[..4]);
            let halves = vec![bf16::from_f32(0.1 * (r as f32 + 1.0)); n * k + n];
            let mut got = vec![bf16::ZERO; k + 1];
            g.reduce_scatter(&halves, &mut got, ReduceOp::Avg).unwrap();
            let exact: f32 = (1..=n)
                .map(|q| bf16::from_f32(0.1 * q as f32).to_f32())
                .sum();
            let want = bf16::from_f32(exact / n as f32);
            assert!(got.iter().all(|&v| v == want), "{:?}", &got[..4]);
            let op = if r == n - 1 {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            };
            match g.reduce_scatter(&input, &mut out, op) {
                Err(Error::Desync { .. } | Error::Aborted { .. }) => {}
                other => panic!("rank {r}: expected a desync, got {other:?}"),
            }
        },
    );
}

fn arena_collectives(g: &ProcessGroup) {
    {
        let (n, r) = (g.size(), g.rank());
        if g.transport() != "shm" {
            return; // DISTCOMM_TRANSPORT=tcp: no arena
        }
        // The arena's own path, first: small parts of every op give the right results.
        let mut b = vec![r as i32 + 7; 3];
        g.broadcast(&mut b, n - 1).unwrap();
        assert_eq!(b, vec![n as i32 + 6; 3]);
        g.barrier().unwrap();
        let mut out = vec![0u8; 2 * n];
        g.all_to_all(&vec![r as u8; 2 * n], &mut out).unwrap();
        let want: Vec<u8> = (0..n).flat_map(|q| [q as u8; 2]).collect();
        assert_eq!(out, want);
        let mut red = [0f32; 2];
        g.reduce_scatter(&vec![1f32 + r as f32; 2 * n], &mut red, ReduceOp::Avg)
            .unwrap();
        let avg = (1..=n).sum::<usize>() as f32 / n as f32;
        assert_eq!(red, [avg; 2]);
        // Parts that move in pieces (several exchange steps per call), of lengths that are no
        // multiple of a piece or a cache line.
        let len = 300_007;
        let pat = |q: usize, i: usize| (q * 31 + i * 7 + i / 251) as u8;
        let mut b: Vec<u8> = (0..len).map(|i| pat(r, i)).collect();
        g.broadcast(&mut b, n - 1).unwrap();
        assert!(b.iter().enumerate().all(|(i, &x)| x == pat(n - 1, i)));
        // Beyond 2 MiB: one direct step on cores of their own, pieces through the slots where
        // the ranks share caches.
        let mut big: Vec<u8> = (0..(3 << 20) + 13).map(|i| pat(r + 1, i)).collect();
        g.broadcast(&mut big, 0).unwrap();
        assert!(big.iter().enumerate().all(|(i, &x)| x == pat(1, i)), "big");
        let mine: Vec<u8> = (0..len).map(|i| pat(r, i)).collect();
        let mut all = vec![0u8; n * len];
        g.all_gather(&mine, &mut all).unwrap();
        for q in 0..n {
            assert!((0..len).all(|i| all[q * len + i] == pat(q, i)), "block {q}");
        }
        let mut gathered = (r == 0).then(|| vec![0u8; n * len]);
        g.gather(&mine, gathered.as_deref_mut(), 0).unwrap();
        if let Some(all) = gathered {
            assert!((0..n * len).all(|i| all[i] == pat(i / len, i % len)));
        }
        let mut block = vec![0u8; len];
        let whole: Vec<u8> = (0..n * len).map(|i| pat(i / len + 1, i % len)).collect();
        let root = n / 2;
        g.scatter((r == root).then_some(&whole[..]), &mut block, root)
            .unwrap();
        assert!((0..len).all(|i| block[i] == pat(r + 1, i)), "scatter");
        // Where ranks outnumber cores (world 3 on 2 cores): blocks too small for direct steps
        // in a part over 64 KiB take one exchange step.
        let mid = 40_003;
        let mut block = vec![0u8; mid];
        let whole: Vec<u8> = (0..n * mid).map(|i| pat(i / mid + 2, i % mid)).collect();
        g.scatter((r == root).then_some(&whole[..]), &mut block, root)
            .unwrap();
        assert!(
            (0..mid).all(|i| block[i] == pat(r + 2, i)),
            "scatter, mid-size"
        );
        let k = 100_003;
        let a2a: Vec<u8> = (0..n * k).map(|i| pat(r + i / k, i % k)).collect();
        let mut got = vec![0u8; n * k];
        g.all_to_all(&a2a, &mut got).unwrap();
        // Block q of ours is block `r` of rank q's input.
        assert!((0..n * k).all(|i| got[i] == pat(i / k + r, i % k)));
        // A reduce larger than one exchange step goes the way of all_reduce; averages divide
        // once, on the root (integers and 16-bit floats).
        let mut ints = vec![3 * (r as i32 + 1); 100_003];
        g.reduce(&mut ints, n - 1, ReduceOp::Avg).unwrap();
        let tri = 3 * (n * (n + 1) / 2) as i32;
        if r == n - 1 {
            assert!(
                ints.iter().all(|&x| x == tri / n as i32),
                "{:?}",
                &ints[..4]
            );
        }
        let mut halves = vec![bf16::from_f32(2.0 * (r as f32 + 1.0)); 100_003];
        g.reduce(&mut halves, 0, ReduceOp::Avg).unwrap();
        if r == 0 {
            let want = bf16::from_f32(tri as f32 * 2.0 / 3.0 / n as f32);
            assert!(halves.iter().all(|&x| x == want), "{:?}", &halves[..4]);
        }
        // Broadcast from different roots: a rank that reads a root whose call differs finds it
        // at once; the roots read nobody and do not wait, and every rank finds it by the next
        // call that reads everyone (here a barrier), through the chain of earlier calls.
        let mut buf = vec![1i32; 16];
        let desync = |e: Result<(), Error>, what: &str| match e {
            Err(Error::Desync { ours, theirs, .. }) => Some((ours, theirs)),
            Err(other) => panic!("rank {r}: {what}: expected desync, got {other:?}"),
            Ok(()) => None,
        };
        match desync(g.broadcast(&mut buf, r % 2), "broadcast") {
            Some((ours, theirs)) => {
                assert!(
                    ours.contains("root=") && theirs.contains("root="),
                    "{ours} / {theirs}"
                );
                assert_ne!(ours, theirs);
            }
            None => {
                let (ours, theirs) = desync(g.barrier(), "barrier after it")
                    .unwrap_or_else(|| panic!("rank {r}: the desync went unnoticed"));
                assert!(ours.contains("earlier collective"), "{ours} / {theirs}");
            }
        }
    }
}

/// Parts large enough for the arena's direct steps (every rank copies straight from the others'
/// buffers) and a root that differs between ranks: the roots wait for their readers, and every
/// rank gets the desync (at that call or the next that reads every rank) instead of waiting for
/// its deadline.
#[test]
fn arena_direct_steps_detect_desync() {
    run_native_env(
        "arena_direct_steps_detect_desync",
        &[2, 3],
        &[ON_OWN_CORES],
        |g: &ProcessGroup| {
            if g.transport() != "shm" {
                return;
            }
            let r = g.rank();
            let mut buf = vec![r as u8; 1 << 20];
            let t = std::time::Instant::now();
            // A rank whose root agrees with its own may finish the call: it finds the desync
            // at the next call that reads every rank.
            let got = match g.broadcast(&mut buf, r % 2) {
                Ok(()) => g.barrier(),
                e => e,
            };
            match got {
                Err(Error::Desync { .. } | Error::Aborted { .. }) => {}
                // A rank that got the desync returns and exits; one whose next call runs on
                // the network (the arena stopped) may then find it gone, promptly, by name
                // (1 run in ~250 on two busy cores; the rank that stopped the arena itself is
                // reported with the arena's reason instead).
                Err(Error::PeerLost { peer, .. }) if peer != r => {}
                other => panic!("rank {r}: expected a desync, got {other:?}"),
            }
            assert!(t.elapsed() < std::time::Duration::from_secs(5));
        },
    );
}
