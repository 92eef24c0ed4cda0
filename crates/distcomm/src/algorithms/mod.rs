//! Collective algorithms as pure schedules (sans-I/O): for a world of `n` ranks, what rank `r`
//! sends and receives in each round. No sockets, no clocks, no element types — ranges of
//! elements in the rank's buffers. [`simulate`] runs a schedule for every rank in one process,
//! which is how the schedules are tested.
//!
//! Every generator returns the same number of rounds for every rank (some rounds empty), so a
//! lock-step simulation matches sends with receives. The executor runs a rank's rounds in order;
//! within a round it posts every receive and send, then waits for all of them. Messages between
//! a pair of ranks match in posting order.
//!
//! | collective | small | large |
//! | --- | --- | --- |
//! | all_reduce | recursive doubling (⌈log₂ n⌉ rounds, non-powers of two folded in) | ring reduce-scatter + ring all-gather (bandwidth-optimal) |
//! | broadcast | binomial tree | scatter + ring all-gather (van de Geijn) |
//! | reduce | binomial tree | binomial tree |
//! | all_gather, reduce_scatter | recursive doubling / halving (log₂ n rounds; ring for other worlds) | the same |
//! | gather, scatter, all_to_all | direct | direct |

use smallvec::SmallVec;
use std::ops::Range;

/// Which of a rank's two buffers a range refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// The working/output buffer (receives always land here).
    Out,
    /// The read-only input buffer (all_to_all, scatter, gather).
    In,
}

/// One transfer of a rank in a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send `range` of `space` to `peer`.
    Send {
        peer: usize,
        space: Space,
        range: Range<usize>,
    },
    /// Receive from `peer` into `range` of the output buffer, combining with what is there when
    /// `reduce`, overwriting otherwise.
    Recv {
        peer: usize,
        range: Range<usize>,
        reduce: bool,
    },
}

/// A rank's schedule: rounds of concurrent steps.
pub type Schedule = Vec<Vec<Step>>;

/// Splits `count` elements into `n` contiguous chunks whose sizes differ by at most one.
pub fn chunks(count: usize, n: usize) -> Vec<Range<usize>> {
    let base = count / n;
    let extra = count % n;
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for i in 0..n {
        let len = base + usize::from(i < extra);
        out.push(start..start + len);
        start += len;
    }
    out
}

fn send(peer: usize, range: Range<usize>) -> Step {
    Step::Send {
        peer,
        space: Space::Out,
        range,
    }
}

fn recv(peer: usize, range: Range<usize>, reduce: bool) -> Step {
    Step::Recv {
        peer,
        range,
        reduce,
    }
}

/// Ring reduce-scatter over `n` chunks of `count` elements: afterwards rank `r` holds the full
/// reduction of chunk `r`. `n - 1` rounds.
pub fn ring_reduce_scatter(n: usize, r: usize, count: usize) -> Schedule {
    let c = chunks(count, n);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    (0..n.saturating_sub(1))
        .map(|s| {
            let sc = (r + 2 * n - s - 1) % n;
            let rc = (r + 2 * n - s - 2) % n;
            vec![send(next, c[sc].clone()), recv(prev, c[rc].clone(), true)]
        })
        .collect()
}

/// Ring all-gather over `n` chunks of `count` elements, chunk `i` starting at rank `i`.
/// `n - 1` rounds.
pub fn ring_all_gather(n: usize, r: usize, count: usize) -> Schedule {
    let c = chunks(count, n);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    (0..n.saturating_sub(1))
        .map(|s| {
            let sc = (r + n - s) % n;
            let rc = (r + 2 * n - s - 1) % n;
            vec![send(next, c[sc].clone()), recv(prev, c[rc].clone(), false)]
        })
        .collect()
}

/// The elements of chunks `first..first + len` of `c` (contiguous).
fn span(c: &[Range<usize>], first: usize, len: usize) -> Range<usize> {
    c[first].start..c[first + len - 1].end
}

/// Reduce-scatter by recursive halving (the layout of [`ring_reduce_scatter`]): in round `k`
/// rank `r` exchanges half of what it still holds with `r ^ (n >> (k + 1))`, keeping the half
/// its own chunk lies in. log₂ n rounds and, like the ring, (n − 1)/n of the buffer sent.
/// Needs a commutative operation (all of [`crate::ReduceOp`] are). Worlds that are not powers
/// of two get the ring.
pub fn halving_reduce_scatter(n: usize, r: usize, count: usize) -> Schedule {
    if !n.is_power_of_two() {
        return ring_reduce_scatter(n, r, count);
    }
    let masks = std::iter::successors(Some(n / 2), |m| Some(m / 2)).take_while(|&m| m > 0);
    butterfly(n, r, count, masks, true)
}

/// All-gather by recursive doubling (the layout of [`ring_all_gather`]): in round `k` rank `r`
/// swaps the 2ᵏ chunks it holds with `r ^ 2ᵏ`. log₂ n rounds, (n − 1)/n of the buffer received
/// as with the ring. Worlds that are not powers of two get the ring.
pub fn doubling_all_gather(n: usize, r: usize, count: usize) -> Schedule {
    if !n.is_power_of_two() {
        return ring_all_gather(n, r, count);
    }
    let masks = std::iter::successors(Some(1), |m| Some(m * 2)).take_while(|&m| m < n);
    butterfly(n, r, count, masks, false)
}

/// One round per `mask` (a power of two below `n`, itself a power of two): `r` and `r ^ mask`
/// exchange the `mask` chunks aligned to it that hold their own chunk. Reducing (halving), each
/// sends the half the other keeps and reduces the half it keeps; gathering (doubling), each
/// sends the half it holds and receives the other's.
fn butterfly(
    n: usize,
    r: usize,
    count: usize,
    masks: impl Iterator<Item = usize>,
    reduce: bool,
) -> Schedule {
    let c = chunks(count, n);
    masks
        .map(|mask| {
            let partner = r ^ mask;
            let mine = span(&c, r & !(mask - 1), mask);
            let theirs = span(&c, partner & !(mask - 1), mask);
            if reduce {
                vec![send(partner, theirs), recv(partner, mine, true)]
            } else {
                vec![send(partner, mine), recv(partner, theirs, false)]
            }
        })
        .collect()
}

/// Bandwidth-optimal all-reduce: ring reduce-scatter then ring all-gather (2(n−1) rounds, each
/// rank sends 2(n−1)/n of the buffer).
pub fn ring_all_reduce(n: usize, r: usize, count: usize) -> Schedule {
    let mut s = ring_reduce_scatter(n, r, count);
    s.extend(ring_all_gather(n, r, count));
    s
}

/// Rabenseifner's all-reduce: [`halving_reduce_scatter`] then [`doubling_all_gather`]
/// (2 log₂ n rounds, each rank sends 2(n − 1)/n of the buffer, as the ring does in 2(n − 1)
/// rounds). Worlds that are not powers of two get the ring.
pub fn halving_doubling_all_reduce(n: usize, r: usize, count: usize) -> Schedule {
    let mut s = halving_reduce_scatter(n, r, count);
    s.extend(doubling_all_gather(n, r, count));
    s
}

/// `schedule` run on consecutive, balanced segments of at most `seg` of the `count` elements,
/// one after the other (each a complete collective on its slice), so that what a round moves
/// stays small enough to be reduced while it is still in cache.
pub fn segmented(count: usize, seg: usize, schedule: impl Fn(usize) -> Schedule) -> Schedule {
    let parts = count.div_ceil(seg.max(1)).max(1);
    let shift = |r: Range<usize>, by: usize| r.start + by..r.end + by;
    chunks(count, parts)
        .into_iter()
        .flat_map(|part| {
            schedule(part.len()).into_iter().map(move |round| {
                round
                    .into_iter()
                    .map(|step| match step {
                        Step::Send { peer, space, range } => Step::Send {
                            peer,
                            space,
                            range: shift(range, part.start),
                        },
                        Step::Recv {
                            peer,
                            range,
                            reduce,
                        } => Step::Recv {
                            peer,
                            range: shift(range, part.start),
                            reduce,
                        },
                    })
                    .collect()
            })
        })
        .collect()
}

/// Latency-optimal all-reduce: recursive doubling among the largest power of two `p ≤ n`; the
/// first `2(n − p)` ranks pair up first (even sends to odd) and get the result back at the end.
/// ⌈log₂ n⌉ + 2 rounds when `n` is not a power of two, log₂ n when it is.
pub fn recursive_doubling_all_reduce(n: usize, r: usize, count: usize) -> Schedule {
    let all = 0..count;
    let p = if n == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - n.leading_zeros())
    };
    let extra = n - p;
    let folded = extra > 0;
    let mut rounds: Schedule = Vec::new();
    // Fold-in round.
    if folded {
        let mut round = Vec::new();
        if r < 2 * extra {
            if r % 2 == 0 {
                round.push(send(r + 1, all.clone()));
            } else {
                round.push(recv(r - 1, all.clone(), true));
            }
        }
        rounds.push(round);
    }
    // Virtual rank among the p participants; None for the even ranks that folded in.
    let vrank = if r < 2 * extra {
        (r % 2 == 1).then_some(r / 2)
    } else {
        Some(r - extra)
    };
    let real = |v: usize| if v < extra { 2 * v + 1 } else { v + extra };
    let mut mask = 1;
    while mask < p {
        let mut round = Vec::new();
        if let Some(v) = vrank {
            let partner = real(v ^ mask);
            round.push(send(partner, all.clone()));
            round.push(recv(partner, all.clone(), true));
        }
        rounds.push(round);
        mask <<= 1;
    }
    if folded {
        let mut round = Vec::new();
        if r < 2 * extra {
            if r % 2 == 1 {
                round.push(send(r - 1, all.clone()));
            } else {
                round.push(recv(r + 1, all.clone(), false));
            }
        }
        rounds.push(round);
    }
    rounds
}

fn log2_ceil(n: usize) -> usize {
    (usize::BITS - n.saturating_sub(1).leading_zeros()) as usize
}

/// Binomial-tree broadcast of `count` elements from `root`: ⌈log₂ n⌉ rounds.
pub fn binomial_broadcast(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    (0..log2_ceil(n))
        .map(|k| {
            let mask = 1 << k;
            if v < mask && v + mask < n {
                vec![send(real(v + mask), 0..count)]
            } else if v >= mask && v < 2 * mask {
                vec![recv(real(v - mask), 0..count, false)]
            } else {
                vec![]
            }
        })
        .collect()
}

/// Binomial-tree reduce of `count` elements to `root`: ⌈log₂ n⌉ rounds. Non-root buffers are
/// left holding partial results.
pub fn binomial_reduce(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    (0..log2_ceil(n))
        .map(|k| {
            let mask = 1 << k;
            // A rank whose lowest set bit is `mask` sends up; those below receive from above.
            if v & mask != 0 && v & (mask - 1) == 0 {
                vec![send(real(v - mask), 0..count)]
            } else if v & ((mask << 1) - 1) == 0 && v + mask < n {
                vec![recv(real(v + mask), 0..count, true)]
            } else {
                vec![]
            }
        })
        .collect()
}

/// Reduce of `count` elements to `root` with every other rank sending straight to it, in one
/// round; the root adds them in rank order (from the root on).
pub fn direct_reduce(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let round = if r == root {
        (1..n)
            .map(|v| recv((v + root) % n, 0..count, true))
            .collect()
    } else {
        vec![send(root, 0..count)]
    };
    vec![round]
}

/// Broadcast for large buffers: the root scatters chunk `i` to rank `i`, then a ring all-gather
/// (each rank receives about 2× the buffer instead of log₂ n × through a tree).
pub fn scatter_all_gather_broadcast(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let c = chunks(count, n);
    let first = if r == root {
        (0..n)
            .filter(|&i| i != root)
            .map(|i| send(i, c[i].clone()))
            .collect()
    } else {
        vec![recv(root, c[r].clone(), false)]
    };
    let mut s = vec![first];
    s.extend(ring_all_gather(n, r, count));
    s
}

/// Gather of `block` elements per rank into the root's output (rank `i` at `i * block`). The
/// root's own block is the caller's to copy.
pub fn direct_gather(n: usize, r: usize, root: usize, block: usize) -> Schedule {
    let round = if r == root {
        (0..n)
            .filter(|&i| i != root)
            .map(|i| recv(i, i * block..(i + 1) * block, false))
            .collect()
    } else {
        vec![Step::Send {
            peer: root,
            space: Space::In,
            range: 0..block,
        }]
    };
    vec![round]
}

/// Gather of the balanced [`chunks`] of `count` elements: every rank but `root` sends its
/// chunk (the whole of its input) to `root`, which receives chunk `i` at its place in its
/// output. The root's own chunk is the caller's to place.
pub fn gather_chunks(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let c = chunks(count, n);
    let round = if r == root {
        (0..n)
            .filter(|&i| i != root)
            .map(|i| recv(i, c[i].clone(), false))
            .collect()
    } else {
        vec![Step::Send {
            peer: root,
            space: Space::In,
            range: 0..c[r].len(),
        }]
    };
    vec![round]
}

/// Scatter of the root's input (block `i` to rank `i`) into every output (`block` elements).
pub fn direct_scatter(n: usize, r: usize, root: usize, block: usize) -> Schedule {
    let round = if r == root {
        (0..n)
            .filter(|&i| i != root)
            .map(|i| Step::Send {
                peer: i,
                space: Space::In,
                range: i * block..(i + 1) * block,
            })
            .collect()
    } else {
        vec![recv(root, 0..block, false)]
    };
    vec![round]
}

/// Blocks of the binomial tree's subtree rooted at virtual rank `v` (ranks counted from the
/// root) among `n`: `v` itself and the ranks below it, `v .. v + subtree(n, v)`.
pub fn subtree(n: usize, v: usize) -> usize {
    if v == 0 {
        n
    } else {
        (v & v.wrapping_neg()).min(n - v)
    }
}

/// Binomial-tree scatter of `block` elements per rank from `root`: ⌈log₂ n⌉ rounds, the root
/// sending ⌈log₂ n⌉ messages instead of n − 1 (each rank relays its subtree's blocks). Every
/// rank works in a buffer of [`subtree`]`(n, v)` blocks in *virtual* order (`v = (r − root) mod
/// n`): the root's holds all n, block `v` for rank `(v + root) mod n`; a rank's own block ends
/// first in its buffer.
pub fn binomial_scatter(n: usize, r: usize, root: usize, block: usize) -> Schedule {
    let v = (r + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let rounds = log2_ceil(n);
    (0..rounds)
        .map(|j| {
            let mask = 1 << (rounds - 1 - j);
            if v & ((mask << 1) - 1) == 0 && v + mask < n {
                let len = subtree(n, v + mask) * block;
                vec![send(real(v + mask), mask * block..mask * block + len)]
            } else if v != 0 && v & v.wrapping_neg() == mask {
                vec![recv(real(v - mask), 0..subtree(n, v) * block, false)]
            } else {
                vec![]
            }
        })
        .collect()
}

/// All-to-all with per-peer counts: rank `r` sends `send[i]` (a range of its input) to rank `i`
/// and receives into `recv[i]` (a range of its output). Own blocks are the caller's to copy.
pub fn direct_all_to_all(
    n: usize,
    r: usize,
    send_ranges: &[Range<usize>],
    recv_ranges: &[Range<usize>],
) -> Schedule {
    let mut round = Vec::new();
    for k in 1..n {
        // Staggered partners spread the load.
        let to = (r + k) % n;
        let from = (r + n - k) % n;
        round.push(recv(from, recv_ranges[from].clone(), false));
        round.push(Step::Send {
            peer: to,
            space: Space::In,
            range: send_ranges[to].clone(),
        });
    }
    vec![round]
}

/// Whether, within `round`, the ranges that receives overwrite (`reduce == false`) overlap
/// neither each other nor any range the round sends from its output. Only then may an executor
/// let transfers touch the buffer in place, concurrently.
pub fn disjoint_in_place(round: &[Step]) -> bool {
    // On the stack for the usual few steps: collectives run this on every round of every call.
    let mut written: SmallVec<[&Range<usize>; 8]> = SmallVec::new();
    let mut read: SmallVec<[&Range<usize>; 8]> = SmallVec::new();
    for st in round {
        match st {
            Step::Recv {
                range,
                reduce: false,
                ..
            } => written.push(range),
            Step::Send {
                space: Space::Out,
                range,
                ..
            } => read.push(range),
            _ => {}
        }
    }
    let overlap = |a: &Range<usize>, b: &Range<usize>| a.start < b.end && b.start < a.end;
    written.iter().enumerate().all(|(i, w)| {
        written[i + 1..].iter().all(|o| !overlap(w, o)) && read.iter().all(|r| !overlap(w, r))
    })
}

/// Runs the schedules of all ranks in lock-step on in-memory buffers: `outs[r]` and `ins[r]`
/// are rank `r`'s buffers; `combine(dst, src)` reduces. Returns an error for a schedule whose
/// sends and receives do not pair up (counts or sizes).
pub fn simulate<T: Clone>(
    schedules: &[Schedule],
    outs: &mut [Vec<T>],
    ins: &[Vec<T>],
    combine: impl Fn(&mut [T], &[T]),
) -> Result<(), String> {
    let n = schedules.len();
    let rounds = schedules.first().map_or(0, |s| s.len());
    if schedules.iter().any(|s| s.len() != rounds) {
        return Err("ranks disagree on the number of rounds".into());
    }
    for k in 0..rounds {
        // Messages in flight this round: (src, dst) -> payloads in posting order.
        let mut wire: Vec<Vec<Vec<Vec<T>>>> = vec![vec![Vec::new(); n]; n];
        for (src, s) in schedules.iter().enumerate() {
            for st in &s[k] {
                if let Step::Send { peer, space, range } = st {
                    let buf = match space {
                        Space::Out => &outs[src],
                        Space::In => &ins[src],
                    };
                    let data = buf.get(range.clone()).ok_or("send range out of bounds")?;
                    wire[src][*peer].push(data.to_vec());
                }
            }
        }
        for (dst, s) in schedules.iter().enumerate() {
            for st in &s[k] {
                if let Step::Recv {
                    peer,
                    range,
                    reduce,
                } = st
                {
                    let q = &mut wire[*peer][dst];
                    if q.is_empty() {
                        return Err(format!(
                            "round {k}: rank {dst} waits for {peer}, who sent nothing"
                        ));
                    }
                    let data = q.remove(0);
                    if data.len() != range.len() {
                        return Err(format!(
                            "round {k}: size mismatch {} vs {}",
                            data.len(),
                            range.len()
                        ));
                    }
                    let dstbuf = outs[dst]
                        .get_mut(range.clone())
                        .ok_or("recv range out of bounds")?;
                    if *reduce {
                        combine(dstbuf, &data);
                    } else {
                        dstbuf.clone_from_slice(&data);
                    }
                }
            }
        }
        if wire.iter().flatten().any(|q| !q.is_empty()) {
            return Err(format!("round {k}: a message was never received"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn inputs(n: usize, count: usize) -> Vec<Vec<i64>> {
        (0..n)
            .map(|r| (0..count).map(|i| (r * 1000 + i) as i64 + 1).collect())
            .collect()
    }

    fn sum_of(ins: &[Vec<i64>]) -> Vec<i64> {
        let mut s = vec![0; ins[0].len()];
        for v in ins {
            for (a, b) in s.iter_mut().zip(v) {
                *a += b;
            }
        }
        s
    }

    fn add(d: &mut [i64], s: &[i64]) {
        d.iter_mut().zip(s).for_each(|(a, b)| *a += b);
    }

    proptest! {
        #[test]
        fn all_reduce_schedules(n in 1usize..12, count in 0usize..40, algo in 0usize..3) {
            let ins = inputs(n, count);
            let mut outs = ins.clone();
            let s: Vec<_> = (0..n).map(|r| match algo { 0 => ring_all_reduce(n, r, count), 1 => recursive_doubling_all_reduce(n, r, count), _ => halving_doubling_all_reduce(n, r, count) }).collect();
            simulate(&s, &mut outs, &ins, add).unwrap();
            let want = sum_of(&ins);
            for o in &outs { prop_assert_eq!(o, &want); }
        }

        #[test]
        fn segmented_ring_all_reduce(n in 1usize..9, count in 0usize..60, seg in 1usize..25) {
            let ins = inputs(n, count);
            let mut outs = ins.clone();
            let s: Vec<_> = (0..n)
                .map(|r| segmented(count, seg, |len| ring_all_reduce(n, r, len)))
                .collect();
            simulate(&s, &mut outs, &ins, add).unwrap();
            let want = sum_of(&ins);
            for o in &outs { prop_assert_eq!(o, &want); }
            let rounds = 2 * n.saturating_sub(1) * count.div_ceil(seg).max(1);
            prop_assert_eq!(s[0].len(), rounds);
        }

        #[test]
        fn broadcast_and_reduce_schedules(n in 1usize..12, count in 0usize..30, root_seed: usize, large: bool) {
            let root = root_seed % n;
            let ins = inputs(n, count);
            let mut outs = ins.clone();
            let s: Vec<_> = (0..n).map(|r| if large { scatter_all_gather_broadcast(n, r, root, count) } else { binomial_broadcast(n, r, root, count) }).collect();
            simulate(&s, &mut outs, &ins, add).unwrap();
            for o in &outs { prop_assert_eq!(o, &ins[root]); }
            let mut outs = ins.clone();
            let s: Vec<_> = (0..n).map(|r| if large { direct_reduce(n, r, root, count) } else { binomial_reduce(n, r, root, count) }).collect();
            simulate(&s, &mut outs, &ins, add).unwrap();
            prop_assert_eq!(&outs[root], &sum_of(&ins));
        }

        #[test]
        fn binomial_scatter_delivers(n in 1usize..12, block in 0usize..5, root_seed: usize) {
            let root = root_seed % n;
            let ins = inputs(n, block);
            let virt = |r: usize| (r + n - root) % n;
            // The root's buffer holds the blocks in virtual order; each rank ends with its own
            // first.
            let all: Vec<i64> = (0..n).flat_map(|v| ins[(v + root) % n].clone()).collect();
            let mut outs: Vec<Vec<i64>> = (0..n).map(|r| if r == root { all.clone() } else { vec![0; subtree(n, virt(r)) * block] }).collect();
            let s: Vec<_> = (0..n).map(|r| binomial_scatter(n, r, root, block)).collect();
            simulate(&s, &mut outs, &ins, add).unwrap();
            for r in 0..n { prop_assert_eq!(&outs[r][..block], &ins[r][..]); }
            // The root talks to ⌈log₂ n⌉ ranks.
            let talks = s[root].iter().flatten().count();
            prop_assert_eq!(talks, (usize::BITS - n.saturating_sub(1).leading_zeros()) as usize);
        }

        #[test]
        fn gather_family(n in 1usize..10, block in 0usize..9, root_seed: usize) {
            let root = root_seed % n;
            let ins = inputs(n, block);
            // all_gather: own block placed first.
            let placed: Vec<Vec<i64>> = (0..n).map(|r| { let mut o = vec![0; n * block]; o[r * block..(r + 1) * block].copy_from_slice(&ins[r]); o }).collect();
            let all: Vec<i64> = ins.concat();
            for gen in [ring_all_gather, doubling_all_gather] {
                let mut outs = placed.clone();
                let s: Vec<_> = (0..n).map(|r| gen(n, r, n * block)).collect();
                simulate(&s, &mut outs, &ins, add).unwrap();
                for o in &outs { prop_assert_eq!(o, &all); }
            }
            // reduce_scatter: full inputs, block r reduced.
            let full = inputs(n, n * block);
            let want = sum_of(&full);
            for gen in [ring_reduce_scatter, halving_reduce_scatter] {
                let mut outs = full.clone();
                let s: Vec<_> = (0..n).map(|r| gen(n, r, n * block)).collect();
                simulate(&s, &mut outs, &full, add).unwrap();
                for (r, o) in outs.iter().enumerate() {
                    let c = &chunks(n * block, n)[r];
                    prop_assert_eq!(&o[c.clone()], &want[c.clone()]);
                }
            }
            // The balanced chunks of an uneven count, gathered to the root.
            let count = n * block + block % n;
            let c = chunks(count, n);
            let whole: Vec<i64> = inputs(1, count).concat();
            let own: Vec<Vec<i64>> = (0..n).map(|r| whole[c[r].clone()].to_vec()).collect();
            let mut outs = vec![vec![0i64; count]; n];
            outs[root][c[root].clone()].copy_from_slice(&own[root]);
            let s: Vec<_> = (0..n).map(|r| gather_chunks(n, r, root, count)).collect();
            simulate(&s, &mut outs, &own, add).unwrap();
            prop_assert_eq!(&outs[root], &whole);
            // gather / scatter.
            let mut outs = vec![vec![0i64; n * block]; n];
            outs[root][root * block..(root + 1) * block].copy_from_slice(&ins[root]);
            let s: Vec<_> = (0..n).map(|r| direct_gather(n, r, root, block)).collect();
            simulate(&s, &mut outs, &ins, add).unwrap();
            prop_assert_eq!(&outs[root], &all);
            let big: Vec<Vec<i64>> = (0..n).map(|_| all.clone()).collect();
            let mut outs = vec![vec![0i64; block]; n];
            outs[root].copy_from_slice(&all[root * block..(root + 1) * block]);
            let s: Vec<_> = (0..n).map(|r| direct_scatter(n, r, root, block)).collect();
            simulate(&s, &mut outs, &big, add).unwrap();
            for (r, o) in outs.iter().enumerate() { prop_assert_eq!(o, &ins[r]); }
        }
    }

    #[test]
    fn every_schedule_can_run_in_place() {
        for n in 1..12 {
            for r in 0..n {
                let all = [
                    ring_all_reduce(n, r, 100),
                    recursive_doubling_all_reduce(n, r, 100),
                    halving_doubling_all_reduce(n, r, 100),
                    binomial_broadcast(n, r, n / 2, 100),
                    scatter_all_gather_broadcast(n, r, n / 2, 100),
                    binomial_reduce(n, r, 0, 100),
                    ring_all_gather(n, r, 10 * n),
                    doubling_all_gather(n, r, 10 * n),
                    halving_reduce_scatter(n, r, 10 * n),
                    direct_gather(n, r, 0, 10),
                    direct_scatter(n, r, 0, 10),
                ];
                for s in all {
                    assert!(
                        s.iter().all(|round| disjoint_in_place(round)),
                        "n {n} r {r}"
                    );
                }
            }
        }
        let bad = vec![recv(1, 0..4, false), send(1, 2..6)];
        assert!(!disjoint_in_place(&bad));
    }

    #[test]
    fn chunking_is_balanced() {
        let c = chunks(10, 4);
        assert_eq!(c, vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(chunks(2, 4).iter().map(|r| r.len()).sum::<usize>(), 2);
    }

    #[test]
    fn recursive_doubling_round_count() {
        assert_eq!(recursive_doubling_all_reduce(8, 3, 1).len(), 3);
        assert_eq!(recursive_doubling_all_reduce(5, 3, 1).len(), 4);
        assert_eq!(recursive_doubling_all_reduce(1, 0, 1).len(), 0);
        assert_eq!(doubling_all_gather(8, 5, 80).len(), 3);
        assert_eq!(halving_reduce_scatter(16, 5, 160).len(), 4);
        assert_eq!(halving_reduce_scatter(6, 5, 60).len(), 5);
    }
}
