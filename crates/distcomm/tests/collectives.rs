//! Collectives over real processes: every op × element type × world size 1–5 × sizes against a
//! serial reference; async with several in flight; subgroups; desync; bad arguments.

mod common;

use common::{run, run_native};
use distcomm::{DType, Element, Error, ProcessGroup, ReduceOp, Reducible};
use half::{bf16, f16};

const ALL: &[usize] = &[1, 2, 3, 4, 5];
/// 0, 1, odd, and above the ring / scatter thresholds for every element size.
const SIZES: &[usize] = &[0, 1, 7, 300_001];

/// Test values: small integers, so float sums and products are exact in every type.
trait Val: Reducible + PartialEq + std::fmt::Debug {
    fn v(x: i64) -> Self;
    /// Serial reference of one reduction step (16-bit floats: in f32, rounded by the caller).
    fn wide(self) -> f64;
    fn from_wide(x: f64) -> Self;
}

macro_rules! val_int {
    ($($t:ty),*) => {$(impl Val for $t {
        fn v(x: i64) -> Self { x as $t }
        fn wide(self) -> f64 { self as f64 }
        fn from_wide(x: f64) -> Self { x as $t }
    })*};
}
val_int!(u8, i8, i32, i64);
impl Val for f32 {
    fn v(x: i64) -> Self {
        x as f32
    }
    fn wide(self) -> f64 {
        self as f64
    }
    fn from_wide(x: f64) -> Self {
        x as f32
    }
}
impl Val for f64 {
    fn v(x: i64) -> Self {
        x as f64
    }
    fn wide(self) -> f64 {
        self
    }
    fn from_wide(x: f64) -> Self {
        x
    }
}
impl Val for f16 {
    fn v(x: i64) -> Self {
        f16::from_f32(x as f32)
    }
    fn wide(self) -> f64 {
        self.to_f64()
    }
    fn from_wide(x: f64) -> Self {
        f16::from_f64(x)
    }
}
impl Val for bf16 {
    fn v(x: i64) -> Self {
        bf16::from_f32(x as f32)
    }
    fn wide(self) -> f64 {
        self.to_f64()
    }
    fn from_wide(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

/// Rank `r`'s input element `i` for operator `op` (products stay small).
fn input(op: ReduceOp, r: usize, i: usize) -> i64 {
    match op {
        ReduceOp::Product => 1 + ((r + i) % 3) as i64,
        _ => ((r * 7 + i * 3) % 23) as i64 + if r % 2 == 0 { 0 } else { 1 },
    }
}

fn reference<T: Val>(op: ReduceOp, n: usize, i: usize) -> T {
    let xs: Vec<i64> = (0..n).map(|r| input(op, r, i)).collect();
    if T::INTEGER {
        // Wrapping integer semantics, done in i64 then truncated like the type would.
        let t = |x: i64| T::v(x).wide() as i64;
        let mut acc = t(xs[0]);
        for &x in &xs[1..] {
            let x = t(x);
            acc = t(match op {
                ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(x),
                ReduceOp::Product => acc.wrapping_mul(x),
                ReduceOp::Min => acc.min(x),
                ReduceOp::Max => acc.max(x),
                ReduceOp::BAnd => acc & x,
                ReduceOp::BOr => acc | x,
                ReduceOp::BXor => acc ^ x,
            });
        }
        if op == ReduceOp::Avg {
            acc /= n as i64;
        }
        return T::v(acc);
    }
    let ys: Vec<f64> = xs.iter().map(|&x| T::v(x).wide()).collect();
    let r = match op {
        ReduceOp::Sum => ys.iter().sum(),
        ReduceOp::Avg => (ys.iter().sum::<f64>() as f32 / n as f32) as f64,
        ReduceOp::Product => ys.iter().product(),
        ReduceOp::Min => ys.iter().cloned().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => ys.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        _ => unreachable!(),
    };
    if T::DTYPE == DType::F64 && op == ReduceOp::Avg {
        return T::from_wide(ys.iter().sum::<f64>() / n as f64);
    }
    T::from_wide(r)
}

fn ops<T: Reducible>() -> Vec<ReduceOp> {
    let mut v = vec![
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];
    if T::INTEGER {
        v.extend([ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor]);
    }
    v
}

fn check_all_reduce<T: Val>(g: &ProcessGroup) {
    let (n, r) = (g.size(), g.rank());
    for &len in SIZES {
        for op in ops::<T>() {
            let mut buf: Vec<T> = (0..len).map(|i| T::v(input(op, r, i))).collect();
            g.all_reduce(&mut buf, op)
                .unwrap_or_else(|e| panic!("{} {op:?} {len}: {e}", T::DTYPE));
            for (i, x) in buf.iter().enumerate() {
                let want: T = reference(op, n, i);
                assert_eq!(*x, want, "{} {op:?} len {len} element {i}", T::DTYPE);
            }
        }
    }
}

#[test]
fn all_reduce_every_type_op_and_size() {
    run("all_reduce_every_type_op_and_size", ALL, |g| {
        check_all_reduce::<f32>(g);
        check_all_reduce::<f64>(g);
        check_all_reduce::<f16>(g);
        check_all_reduce::<bf16>(g);
        check_all_reduce::<i8>(g);
        check_all_reduce::<u8>(g);
        check_all_reduce::<i32>(g);
        check_all_reduce::<i64>(g);
    });
}

fn data<T: Val>(r: usize, len: usize, salt: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::v(((r * 31 + i * 7 + salt) % 97) as i64))
        .collect()
}

fn check_movement<T: Val>(g: &ProcessGroup) {
    let (n, r) = (g.size(), g.rank());
    for &len in SIZES {
        for root in [0, n - 1] {
            // broadcast
            let mut b: Vec<T> = if r == root {
                data(root, len, 1)
            } else {
                vec![T::v(0); len]
            };
            g.broadcast(&mut b, root).unwrap();
            assert_eq!(
                b,
                data::<T>(root, len, 1),
                "broadcast {} len {len} root {root}",
                T::DTYPE
            );
            // reduce (max)
            let mut b: Vec<T> = data(r, len, 2);
            g.reduce(&mut b, root, ReduceOp::Max).unwrap();
            if r == root {
                let theirs: Vec<Vec<T>> = (0..n).map(|q| data::<T>(q, len, 2)).collect();
                let want: Vec<T> = (0..len)
                    .map(|i| {
                        theirs.iter().map(|t| t[i]).fold(T::v(0), |a, b| {
                            if b.wide() > a.wide() {
                                b
                            } else {
                                a
                            }
                        })
                    })
                    .collect();
                assert_eq!(b, want, "reduce {} len {len}", T::DTYPE);
            }
            // gather
            let mine: Vec<T> = data(r, len, 3);
            let mut out = vec![T::v(0); n * len];
            g.gather(&mine, (r == root).then_some(out.as_mut_slice()), root)
                .unwrap();
            if r == root {
                let want: Vec<T> = (0..n).flat_map(|q| data::<T>(q, len, 3)).collect();
                assert_eq!(out, want, "gather {} len {len}", T::DTYPE);
            }
            // scatter
            let full: Vec<T> = (0..n).flat_map(|q| data::<T>(q, len, 4)).collect();
            let mut out = vec![T::v(0); len];
            g.scatter((r == root).then_some(full.as_slice()), &mut out, root)
                .unwrap();
            assert_eq!(out, data::<T>(r, len, 4), "scatter {} len {len}", T::DTYPE);
        }
        // all_gather (contiguous and list)
        let mine: Vec<T> = data(r, len, 5);
        let lists = g.all_gather_list(&mine).unwrap();
        for (q, l) in lists.iter().enumerate() {
            assert_eq!(
                l,
                &data::<T>(q, len, 5),
                "all_gather {} len {len}",
                T::DTYPE
            );
        }
        // reduce_scatter (sum), one buffer and list forms
        let inp: Vec<T> = data(r, n * len, 6);
        let mut out = vec![T::v(0); len];
        g.reduce_scatter(&inp, &mut out, ReduceOp::Sum).unwrap();
        let theirs: Vec<Vec<T>> = (0..n).map(|q| data::<T>(q, n * len, 6)).collect();
        let want: Vec<T> = (0..len)
            .map(|i| {
                let sum = theirs.iter().map(|t| t[r * len + i].wide()).sum::<f64>();
                // Integers wrap (the cast from i64 truncates like the kernels' wrapping adds).
                if T::INTEGER {
                    T::v(sum as i64)
                } else {
                    T::from_wide(sum)
                }
            })
            .collect();
        assert_eq!(out, want, "reduce_scatter {} len {len}", T::DTYPE);
        let lists: Vec<Vec<T>> = (0..n)
            .map(|q| inp[q * len..(q + 1) * len].to_vec())
            .collect();
        let mut out2 = vec![T::v(0); len];
        g.reduce_scatter_list(&lists, &mut out2, ReduceOp::Sum)
            .unwrap();
        assert_eq!(out2, out);
        // all_to_all equal
        let inp: Vec<T> = data(r, n * len, 7);
        let mut out = vec![T::v(0); n * len];
        g.all_to_all(&inp, &mut out).unwrap();
        for q in 0..n {
            assert_eq!(
                &out[q * len..(q + 1) * len],
                &data::<T>(q, n * len, 7)[r * len..(r + 1) * len]
            );
        }
    }
    // all_to_all_v: rank r sends (r + j) % 3 elements to rank j.
    let cnt = |from: usize, to: usize| (from + to) % 3;
    let send: Vec<usize> = (0..n).map(|j| cnt(r, j)).collect();
    let recv: Vec<usize> = (0..n).map(|i| cnt(i, r)).collect();
    let inp: Vec<T> = data(r, send.iter().sum(), 8);
    let mut out = vec![T::v(0); recv.iter().sum()];
    g.all_to_all_v(&inp, &send, &mut out, &recv).unwrap();
    let mut off = 0;
    for i in 0..n {
        let theirs: Vec<T> = data(i, (0..n).map(|j| cnt(i, j)).sum(), 8);
        let start: usize = (0..r).map(|j| cnt(i, j)).sum();
        assert_eq!(
            &out[off..off + recv[i]],
            &theirs[start..start + recv[i]],
            "all_to_all_v from {i}"
        );
        off += recv[i];
    }
}

#[test]
fn data_movement_collectives() {
    run("data_movement_collectives", ALL, |g| {
        check_movement::<f32>(g);
        check_movement::<f64>(g);
        check_movement::<f16>(g);
        check_movement::<bf16>(g);
        check_movement::<i8>(g);
        check_movement::<u8>(g);
        check_movement::<i32>(g);
        check_movement::<i64>(g);
    });
}

#[test]
fn async_collectives_in_flight_together() {
    run("async_collectives_in_flight_together", &[1, 2, 3, 5], |g| {
        let (n, r) = (g.size(), g.rank());
        let a = g
            .all_reduce_async(vec![r as f32 + 1.0; 100_000], ReduceOp::Sum)
            .unwrap();
        let b = g.broadcast_async(vec![r as i32; 9], n - 1).unwrap();
        // A blocking collective between async ones.
        let mut x = [1i64];
        g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x[0], n as i64);
        let c = g.all_gather_async(vec![r as u8; 3]).unwrap();
        let d = g
            .reduce_scatter_async(vec![1i32; 4 * n], ReduceOp::Sum)
            .unwrap();
        let e = g.all_to_all_async(vec![r as f64; 2 * n]).unwrap();
        let f = g.gather_async(vec![r as i8], 0).unwrap();
        let h = g
            .scatter_async(
                if r == 0 {
                    (0..n as i32).collect()
                } else {
                    vec![]
                },
                1,
                0,
            )
            .unwrap();
        let expect = (n * (n + 1) / 2) as f32;
        assert!(a.into_buffer().unwrap().iter().all(|&v| v == expect));
        assert_eq!(b.into_buffer().unwrap(), vec![(n - 1) as i32; 9]);
        assert_eq!(
            c.into_buffer().unwrap(),
            (0..n).flat_map(|q| vec![q as u8; 3]).collect::<Vec<_>>()
        );
        assert_eq!(d.into_buffer().unwrap(), vec![n as i32; 4]);
        assert_eq!(
            e.into_buffer().unwrap(),
            (0..n).flat_map(|q| vec![q as f64; 2]).collect::<Vec<_>>()
        );
        let gathered = f.into_buffer().unwrap();
        if r == 0 {
            assert_eq!(gathered, (0..n as i8).collect::<Vec<_>>());
        }
        let scattered = h
            .into_buffer()
            .unwrap_or_else(|e| panic!("scatter_async: {e}"));
        assert_eq!(scattered, vec![r as i32]);
    });
}

#[test]
fn subgroups_disjoint_and_overlapping() {
    run("subgroups_disjoint_and_overlapping", &[1, 3, 4, 5], |g| {
        let (n, r) = (g.size(), g.rank());
        let evens: Vec<usize> = (0..n).step_by(2).collect();
        let odds: Vec<usize> = (1..n).step_by(2).collect();
        let first3: Vec<usize> = (0..n.min(3)).rev().collect();
        let ge = g.new_group(&evens).unwrap();
        let go = if odds.is_empty() {
            None
        } else {
            g.new_group(&odds).unwrap()
        };
        let g3 = g.new_group(&first3).unwrap();
        assert_eq!(ge.is_some(), r % 2 == 0);
        assert_eq!(go.is_some(), r % 2 == 1);
        assert_eq!(g3.is_some(), r < 3);
        for (sub, members) in [(&ge, &evens), (&go, &odds), (&g3, &first3)] {
            let Some(sub) = sub else { continue };
            assert_eq!(sub.size(), members.len());
            assert_eq!(sub.global_rank(sub.rank()), Some(r));
            let mut x = vec![r as i64; 5];
            sub.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x, vec![members.iter().sum::<usize>() as i64; 5]);
            // Point-to-point by group rank.
            let m = sub.size();
            let next = (sub.rank() + 1) % m;
            let prev = (sub.rank() + m - 1) % m;
            let w = sub.irecv(vec![0i64; 1], prev, 3).unwrap();
            sub.send(&[r as i64], next, 3).unwrap();
            let st = w.wait().unwrap();
            assert_eq!(st.peer, prev, "status names the group rank");
            assert_eq!(w.into_buffer().unwrap(), vec![members[prev] as i64]);
            sub.barrier().unwrap();
        }
        // The world still works after the subgroups.
        let mut y = [1u8];
        g.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        assert_eq!(y[0] as usize, n);
        assert!(g.new_group(&[0, 0]).is_err());
        assert!(g.new_group(&[n]).is_err());
    });
}

#[test]
fn subgroups_made_by_members_only() {
    // torch's way: only members construct a group. Evens and odds are made in opposite
    // orders on their members, non-members never call, and a subgroup of a subgroup works.
    run_native("subgroups_made_by_members_only", &[1, 2, 4, 5], |g| {
        let (n, r) = (g.size(), g.rank());
        let evens: Vec<usize> = (0..n).step_by(2).collect();
        let odds: Vec<usize> = (1..n).step_by(2).collect();
        let mine = if r % 2 == 0 { &evens } else { &odds };
        let pair: Vec<usize> = if n > 1 { vec![0, n - 1] } else { vec![0] };
        let (sub, p) = if r % 2 == 0 {
            let s = g.subgroup(mine).unwrap();
            (s, pair.contains(&r).then(|| g.subgroup(&pair).unwrap()))
        } else {
            let p = pair.contains(&r).then(|| g.subgroup(&pair).unwrap());
            (g.subgroup(mine).unwrap(), p)
        };
        assert_eq!(sub.size(), mine.len());
        let mut x = vec![r as i64; 3];
        sub.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, vec![mine.iter().sum::<usize>() as i64; 3]);
        if let Some(p) = p {
            let mut y = [1i32];
            p.all_reduce(&mut y, ReduceOp::Sum).unwrap();
            assert_eq!(
                y[0] as usize,
                pair.iter().collect::<std::collections::HashSet<_>>().len()
            );
        }
        // The same members twice: two groups with contexts of their own.
        let again = g.subgroup(mine).unwrap();
        let mut z = [2.0f32];
        again.all_reduce(&mut z, ReduceOp::Max).unwrap();
        assert_eq!(z[0], 2.0);
        // A subgroup of the subgroup (its ranks are the subgroup's).
        if sub.size() >= 2 && sub.rank() < 2 {
            let inner = sub.subgroup(&[1, 0]).unwrap();
            assert_eq!(inner.global_rank(inner.rank()), Some(r));
            inner.barrier().unwrap();
        }
        assert!(g.subgroup(&[]).is_err());
        if n > 1 {
            let others: Vec<usize> = (0..n).filter(|&q| q != r).collect();
            let e = g.subgroup(&others).unwrap_err();
            assert!(e.to_string().contains("only members"), "{e}");
        }
        g.barrier().unwrap();
    });
}

#[test]
fn desync_is_an_error_on_every_involved_rank() {
    run_native("desync_is_an_error_on_every_involved_rank", &[2, 3], |g| {
        let r = g.rank();
        // Same collective, different counts.
        let mut buf = vec![1f32; 10 + r];
        match g.all_reduce(&mut buf, ReduceOp::Sum) {
            Err(Error::Desync { ours, theirs, .. }) => {
                assert!(
                    ours.contains("all_reduce") && theirs.contains("all_reduce"),
                    "{ours} / {theirs}"
                )
            }
            other => panic!("rank {r}: expected desync, got {other:?}"),
        }
        g.barrier().unwrap();
        // Different collectives at the same point.
        let mut buf = vec![1f32; 8];
        let res = if r == 0 {
            g.all_reduce(&mut buf, ReduceOp::Sum)
        } else {
            g.broadcast(&mut buf, 0)
        };
        match res {
            Err(Error::Desync { ours, theirs, .. }) => {
                assert!(ours != theirs, "{ours} / {theirs}");
                assert!(ours.contains("broadcast") || theirs.contains("broadcast"));
            }
            other => panic!("rank {r}: expected desync, got {other:?}"),
        }
        g.barrier().unwrap();
        // After the errors, matching collectives work again.
        let mut ok = vec![1i32; 4];
        g.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        assert_eq!(ok, vec![g.size() as i32; 4]);
    });
}

#[test]
fn bad_arguments_are_typed_errors() {
    run("bad_arguments_are_typed_errors", &[1, 2], |g| {
        let n = g.size();
        let mut f = vec![1f32; 3];
        assert!(matches!(
            g.all_reduce(&mut f, ReduceOp::BXor),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            g.broadcast(&mut f, n),
            Err(Error::InvalidRank { .. })
        ));
        let mut small = vec![0f32; 1];
        assert!(matches!(
            g.all_gather(&f, &mut small),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            g.reduce_scatter(&f, &mut small, ReduceOp::Sum),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            g.all_to_all_v(&f, &[1], &mut small, &[1]),
            Err(Error::InvalidArgument { .. })
        ));
        // Nothing was consumed: the next collective still matches on every rank.
        g.all_reduce(&mut f, ReduceOp::Sum).unwrap();
        assert_eq!(f, vec![n as f32; 3]);
    });
}

/// 16-bit floats whose sums and averages round: rank `r`'s element `i` (with an infinity,
/// a NaN, and values near the top of f16's range here and there).
fn inexact(r: usize, i: usize) -> f32 {
    let h = (r as u64 * 0x9e37_79b9 + i as u64 * 0x85eb_ca6b) % 20_011;
    match (i % 97, i % 101, r) {
        (5, _, 0) => f32::INFINITY,
        (_, 7, 1) => f32::NAN,
        (11, _, _) => 30_000.0 + r as f32 * 1.5,
        _ => (h as f32 - 10_000.0) * 0.013_7,
    }
}

/// Bytes of 16-bit floats from which all_reduce, reduce_scatter and reduce over the network
/// send them at 16 bits, each chunk reduced by its owner in rank order (`HALF_DIRECT_MIN` in
/// `backend/native/collectives/sixteen_bit.rs`).
const HALF_DIRECT_MIN: usize = 64 << 10;

/// The 16-bit all_reduce, reduce and reduce_scatter equal reducing the same (16-bit) inputs in
/// f32 and rounding once (dividing first for averages), bit for bit where the reduction order
/// is fixed: through the arena (rank order), over the network from [`HALF_DIRECT_MIN`] bytes
/// (rank order) and on two ranks (any order).
fn check_rounds_once<T: Val>(g: &ProcessGroup, to: fn(T) -> f32, from: fn(f32) -> T) {
    let (n, r) = (g.size(), g.rank());
    // Whether a call of `elems` elements reduces in rank order.
    let rank_order = |elems: usize| {
        let net16 = g.transport() != "mpi" && elems * size_of::<T>() >= HALF_DIRECT_MIN;
        g.intranode_all_reduce() || net16 && elems >= n
    };
    // One element, the inline path (<= 40 B), the one-barrier path (<= 16 KiB), a single
    // chunk and several; over the network, 8_193 elements are at 16 bits from world 4 on
    // (reduce_scatter), 12_289 from world 3, 300_001 everywhere (one segment; CI runs this
    // again in segments of 4099 bytes). The reduce_scatter takes n·len elements: up to
    // 12_289 beyond two ranks (the debug build's reference is slow on crowded cores).
    for len in [1, 19, 20, 21, 5_000, 8_193, 12_289, 300_001] {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Product,
            ReduceOp::Min,
            ReduceOp::Max,
        ] {
            // Rank r's values 2^-r (odd ranks 2^-(20 + r)) times `inexact`'s: their exact
            // sum needs more bits than f32 has, so a reduction in another order than rank
            // order rounds differently here and there. The values near the top of f16's range
            // stay as they are: their sums overflow 16 bits, their averages do not.
            let input = |r: usize, i: usize| {
                let scale = if i % 97 == 11 { 0 } else { r % 2 * 20 + r };
                from(if op == ReduceOp::Product {
                    1.0 + inexact(r, i) / 4096.0
                } else {
                    inexact(r, i) * 2f32.powi(-(scale as i32))
                })
            };
            let mut buf: Vec<T> = (0..len).map(|i| input(r, i)).collect();
            g.all_reduce(&mut buf, op)
                .unwrap_or_else(|e| panic!("{} {op:?} {len}: {e}", T::DTYPE));
            // A reduce (in place at the root) combines the same way.
            let root = n - 1;
            let mut red: Vec<T> = (0..len).map(|i| input(r, i)).collect();
            g.reduce(&mut red, root, op)
                .unwrap_or_else(|e| panic!("reduce {} {op:?} {len}: {e}", T::DTYPE));
            // reduce_scatter of `len` elements per rank: every rank's input is its values of
            // 0..n·len, block `b` going to rank `b`.
            let rs_len = if n > 2 { len.min(12_289) } else { len };
            let whole: Vec<T> = (0..n * rs_len).map(|j| input(r, j)).collect();
            let mut block = vec![from(0.0); rs_len];
            g.reduce_scatter(&whole, &mut block, op)
                .unwrap_or_else(|e| panic!("reduce_scatter {} {op:?} {rs_len}: {e}", T::DTYPE));
            let any_order = n <= 2 || matches!(op, ReduceOp::Min | ReduceOp::Max);
            let checks = [
                ("all_reduce", &buf, 0, rank_order(len)),
                ("reduce", &red, 0, rank_order(len) && r == root),
                ("reduce_scatter", &block, r * rs_len, rank_order(n * rs_len)),
            ];
            // MPI's MIN/MAX of a NaN follow the MPI library (Open MPI: NaN wins where
            // distcomm's kernels keep the other operand).
            let mpi = g.transport() == "mpi";
            for (what, got, at, fixed) in checks {
                if !(fixed || any_order && (what != "reduce" || r == root)) {
                    continue;
                }
                for (i, x) in got.iter().enumerate() {
                    let i = at + i;
                    let nan = (0..n).any(|q| to(input(q, i)).is_nan());
                    if mpi && nan && matches!(op, ReduceOp::Min | ReduceOp::Max) {
                        continue;
                    }
                    let mut acc = [to(input(0, i))];
                    for q in 1..n {
                        f32::reduce_into(&mut acc, &[to(input(q, i))], op);
                    }
                    if op == ReduceOp::Avg {
                        f32::finish_avg(&mut acc, n);
                    }
                    let (got, want) = (to(*x), to(from(acc[0])));
                    assert!(
                        got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
                        "{what} {} {op:?} world {n} len {len} element {i}: {got} want {want}",
                        T::DTYPE
                    );
                }
            }
        }
    }
}

#[test]
fn sixteen_bit_floats_reduce_in_f32_and_round_once() {
    run(
        "sixteen_bit_floats_reduce_in_f32_and_round_once",
        ALL,
        |g| {
            check_rounds_once::<bf16>(g, bf16::to_f32, bf16::from_f32);
            check_rounds_once::<f16>(g, f16::to_f32, f16::from_f32);
        },
    );
}

#[allow(dead_code)]
fn _element_bound<T: Element>() {}

#[test]
fn bandwidth_algorithms_forced_at_every_size() {
    let env = [
        ("DISTCOMM_ALL_REDUCE_RING_MIN", "1"),
        ("DISTCOMM_BROADCAST_SCATTER_MIN", "1"),
    ];
    common::run_env(
        "bandwidth_algorithms_forced_at_every_size",
        ALL,
        &env,
        |g| {
            check_all_reduce::<f32>(g);
            check_all_reduce::<bf16>(g);
            check_all_reduce::<i32>(g);
            check_movement::<i64>(g);
        },
    );
}

#[test]
fn latency_algorithms_forced_at_every_size() {
    let env = [("DISTCOMM_ALL_REDUCE_RING_MIN", "1000000000000")];
    common::run_env(
        "latency_algorithms_forced_at_every_size",
        &[2, 3, 5],
        &env,
        |g| {
            check_all_reduce::<f64>(g);
            check_all_reduce::<u8>(g);
        },
    );
}

#[test]
fn comms_log_counts_ops_and_keeps_async_async() {
    common::run_env(
        "comms_log_counts_ops_and_keeps_async_async",
        &[2, 3],
        &[("DISTCOMM_COMMS_LOG", "1")],
        |g| {
            let r = g.rank();
            if r != 0 {
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
            let t = std::time::Instant::now();
            let w = g.all_reduce_async(vec![1f32; 256], ReduceOp::Sum).unwrap();
            if r == 0 {
                assert!(
                    t.elapsed() < std::time::Duration::from_millis(100),
                    "issuing blocked"
                );
                assert!(!w.is_completed(), "completed before the peers joined");
            }
            w.into_buffer().unwrap();
            for _ in 0..3 {
                let mut x = vec![0i32; 10];
                g.all_reduce(&mut x, ReduceOp::Max).unwrap();
            }
            let mut b = vec![0u8; 100];
            g.broadcast(&mut b, 0).unwrap();
            let stats = g.comms_log();
            let find = |op: &str, bytes: usize| {
                stats
                    .iter()
                    .find(|s| s.op == op && s.bytes == bytes)
                    .cloned()
            };
            assert_eq!(
                find("all_reduce", 1024).map(|s| s.count),
                Some(1),
                "{stats:?}"
            );
            assert_eq!(
                find("all_reduce", 40).map(|s| s.count),
                Some(3),
                "{stats:?}"
            );
            let bc = find("broadcast", 100).unwrap();
            assert!(bc.p50_us > 0.0 && bc.p99_us >= bc.p50_us && bc.total_bytes == 100);
            assert!(g.comms_log_summary().contains("all_reduce"));
            g.set_comms_log(false);
            g.all_reduce(&mut [0i32; 10], ReduceOp::Max).unwrap();
            assert_eq!(
                g.comms_log()
                    .iter()
                    .find(|s| s.bytes == 40)
                    .map(|s| s.count),
                Some(3)
            );
        },
    );
}

#[test]
fn a_rank_dying_mid_collective_fails_the_others_promptly() {
    run_native(
        "a_rank_dying_mid_collective_fails_the_others_promptly",
        &[3, 4],
        |g| {
            let (n, r) = (g.size(), g.rank());
            // Warm up: everyone connected and in step.
            let mut x = vec![1f32; 1000];
            g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            if r == n - 1 {
                // Vanish in the middle of a large collective: 16 MiB takes ~10 ms here over
                // shared memory (and longer over TCP), so 1 ms in it is well inside it (with
                // 20 ms the collective had sometimes finished, rightly, before the exit).
                let _w = g
                    .all_reduce_async(vec![1f32; 4 << 20], ReduceOp::Sum)
                    .unwrap();
                std::thread::sleep(std::time::Duration::from_millis(1));
                std::process::exit(0);
            }
            let t = std::time::Instant::now();
            let mut big = vec![1f32; 4 << 20];
            match g.all_reduce(&mut big, ReduceOp::Sum) {
                Err(Error::PeerLost { .. }) | Err(Error::Aborted { .. }) => {}
                other => panic!("rank {r}: expected a failure, got {other:?}"),
            }
            assert!(
                t.elapsed() < std::time::Duration::from_secs(5),
                "took {:?}",
                t.elapsed()
            );
        },
    );
}

/// A root far ahead of its receivers over TCP: its collective sends go straight to the socket
/// while nothing is queued, then, once the socket is full, part-written and queued; every
/// receiver still gets every broadcast whole and in order.
#[test]
fn a_root_far_ahead_over_tcp_loses_and_reorders_nothing() {
    common::run_native_env(
        "a_root_far_ahead_over_tcp_loses_and_reorders_nothing",
        &[2, 3],
        &[("DISTCOMM_TRANSPORT", "tcp")],
        |g| {
            let r = g.rank();
            // Sizes up to the largest eager message (64 KiB), odd ones included, so that
            // writes stop in headers and in payloads.
            for i in 0..300i32 {
                let len = [16_000, 1, 4093, 16_000, 16_383][i as usize % 5];
                let value = |k: usize| i.wrapping_mul(7919).wrapping_add(k as i32);
                let mut x: Vec<i32> = match r {
                    0 => (0..len).map(value).collect(),
                    _ => vec![0; len],
                };
                g.broadcast(&mut x, 0).unwrap();
                if r != 0 {
                    let bad = (0..len).find(|&k| x[k] != value(k));
                    assert_eq!(bad, None, "rank {r}: broadcast {i} differs at that element");
                    if i % 150 == 1 {
                        // Fall behind: the root fills the socket (12 MB in all) meanwhile.
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                }
            }
            g.barrier().unwrap();
        },
    );
}

/// A root far behind its senders over TCP: their small messages of many rooted calls wait
/// unexpected (or unread in the socket) when it comes, and it takes each as it came, without
/// a handle, into the right call: reduced (f64, whose payloads need not be aligned for it) or
/// copied in order. A message that does not fit its call is refused as on the general path.
#[test]
fn a_root_far_behind_over_tcp_takes_every_small_message_into_its_call() {
    common::run_native_env(
        "a_root_far_behind_over_tcp_takes_every_small_message_into_its_call",
        &[2, 3],
        &[("DISTCOMM_TRANSPORT", "tcp")],
        |g| {
            let (n, r) = (g.size(), g.rank());
            if r == 0 {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            for i in 0..200usize {
                let len = [1, 3, 1000, 7][i % 4];
                let value = |q: usize, k: usize| (i * 31 + q * 7 + k) as f64;
                let mut x: Vec<f64> = (0..len).map(|k| value(r, k)).collect();
                g.reduce(&mut x, 0, ReduceOp::Sum).unwrap();
                if r == 0 {
                    let want: Vec<f64> = (0..len)
                        .map(|k| (0..n).map(|q| value(q, k)).sum())
                        .collect();
                    assert_eq!(x, want, "reduce {i}");
                }
                let mine: Vec<i32> = (0..len).map(|k| (i * 1000 + r * 100 + k) as i32).collect();
                let mut all = vec![0i32; len * n];
                let out = (r == 0).then_some(all.as_mut_slice());
                g.gather(&mine, out, 0).unwrap();
                if r == 0 {
                    for (q, block) in all.chunks(len).enumerate() {
                        let want: Vec<i32> =
                            (0..len).map(|k| (i * 1000 + q * 100 + k) as i32).collect();
                        assert_eq!(block, want.as_slice(), "gather {i}, block of rank {q}");
                    }
                }
            }
            // A sender whose call does not match (more elements than the root's) while the
            // root is late: the root says so (the sender may have returned already).
            if r == 0 {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            let mut x = vec![1f64; if r == 1 { 5 } else { 4 }];
            let res = g.reduce(&mut x, 0, ReduceOp::Sum);
            if r == 0 {
                assert!(
                    matches!(res, Err(Error::Desync { .. })),
                    "rank {r}: expected desync, got {res:?}"
                );
            }
            g.barrier().unwrap();
            let mut ok = vec![1i32; 4];
            g.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
            assert_eq!(ok, vec![n as i32; 4]);
        },
    );
}
