//! Intra-node paths of the collectives other than all_reduce: when the group has a shared
//! arena and every rank's part fits one of its slots, the call is one step of
//! [`Arena::exchange`] — each rank writes its part, one barrier, each reads what it needs — in
//! the place of the schedules' messages (Open MPI's `coll/sm` in spirit).
//!
//! Reductions combine in rank order on every rank that needs the result (the same bits
//! everywhere), 16-bit floats in `f32`, rounded once; averages divide at the end, as on the
//! network path.
//!
//! Owns: what each op puts into the arena and takes out. Must not know: how the arena
//! synchronises.

use std::mem::{size_of, size_of_val};

use super::arena::{Arena, Caches, Exchange, Published, Reads, Remote};
use super::collectives::{chose, Run};
use crate::backend::{typed, Coll};
use crate::call::{Call, CallKind};
use crate::commslog::count_sent;
use crate::copy::{copy, copy_bytes};
use crate::error::Result;
use crate::reduce::{ReduceOp, Reducible};

/// The largest part (bytes) any rank puts into the arena for `coll`, when it can go there:
/// `None` for all_reduce (it has its own path) and uneven all_to_all (a rank cannot find its
/// block in another's part without that rank's counts).
pub(super) fn part_bytes<T: Reducible>(coll: &Coll<'_>, call: &Call, n: usize) -> Option<usize> {
    let wide = widened::<T>;
    match coll {
        Coll::AllReduce(..) | Coll::Barrier => None,
        Coll::Broadcast(buf, _) => Some(buf.len()),
        Coll::Reduce(buf, ..) => Some(wide(buf.len())),
        Coll::AllGather(input, _) | Coll::Gather(input, ..) => Some(input.len()),
        Coll::Scatter(_, out, _) => Some(out.len() * n),
        Coll::ReduceScatter(input, ..) => Some(wide(input.len())),
        Coll::AllToAll((input, _), _) => (call.count != 0).then_some(input.len()),
    }
}

/// What `bytes` of `T` take in the arena's reductions (16-bit floats combine in f32).
fn widened<T: Reducible>(bytes: usize) -> usize {
    if T::WIDENS {
        bytes * (size_of::<f32>() / size_of::<T>())
    } else {
        bytes
    }
}

/// Whether a reduce whose part is `part` bytes takes one exchange step (else it goes the way
/// of all_reduce).
fn one_step_reduce(part: usize, arena: &Arena) -> bool {
    let max = match arena.oversubscribed() {
        true => OVERSUBSCRIBED_MAX,
        false => REDUCE_MAX,
    };
    part <= max.min(arena.slot_bytes())
}

/// Whether a reduce_scatter whose input is `part` bytes goes the way of all_reduce through the
/// arena (each rank reducing its share of every chunk, taking its block of the result): when
/// ranks outnumber cores, more than [`ONE_STEP_REDUCE_SCATTER_RANKS`], and the part is too
/// large for one exchange step; the network schedules' rounds then wait for every rank to be
/// scheduled in turn. Measured on 2 cores against the schedules (`scripts/ab.py`, 2 pairs, new
/// / old time): world 6 256 KiB 0.47, 1 MiB 0.76, 4 MiB 0.72; world 8 256 KiB-64 MiB
/// 0.64-0.76; but world 3 1 MiB 1.14, 4 MiB 1.09, world 4 0.88-1.13, and world 2 (cores of
/// their own) 0.96-1.04.
fn chunked_reduce_scatter(part: usize, arena: &Arena) -> bool {
    arena.oversubscribed()
        && arena.ranks() > ONE_STEP_REDUCE_SCATTER_RANKS
        && part > OVERSUBSCRIBED_MAX.min(arena.slot_bytes())
}

/// A reduce_scatter on up to this many ranks takes one exchange step up to [`PART_MAX`] even
/// when ranks outnumber cores: each rank writes its input, one barrier, each reduces its own
/// block from every slot straight into its output. Before, parts over [`OVERSUBSCRIBED_MAX`]
/// took the network schedules (halving) over the shared-memory links. Measured on 2 cores,
/// `distcomm bench reduce_scatter`, one step against the schedules, alternating runs (µs):
/// world 3 (4 pairs) 128 KiB 21 against 116, 256 KiB 43 against 114, 512 KiB 90 against 181,
/// 1 MiB 171 against 324; world 4 (4 pairs) 128 KiB 73 against 210, 256 KiB 132 against 278,
/// 512 KiB 253 against 377, 1 MiB 486 against 675. Against the chunked way of all_reduce
/// ([`chunked_reduce_scatter`]) world 4 gave 0.65-0.72x the time, but world 8 0.89-1.09x:
/// more ranks keep that way (worlds 5-7 were not measured).
const ONE_STEP_REDUCE_SCATTER_RANKS: usize = 4;

/// Parts up to this many bytes of scatter and reduce_scatter take the arena when ranks do not
/// outnumber cores, and when they do, scatter at any number of ranks and reduce_scatter on up
/// to [`ONE_STEP_REDUCE_SCATTER_RANKS`] (reduce: up to [`REDUCE_MAX`]). Measured with
/// `scripts/ab.py` against the network schedules (shm links, one pair per point): world 2 at
/// 1 MiB, scatter 0.14x, reduce_scatter 0.53x the schedules' time; at 64 KiB 0.08x-0.57x.
/// Broadcast, gather and all_gather take it at every size, in pieces (world 2, arena against
/// network: 64 MiB broadcast 7.9-15.4 ms against 20.6-29.2, all_gather 15.5 against
/// 17.9-25.4; world 4 on 2 cores, 16 MiB: broadcast 6.2-6.9 against 9.5-16.4, all_gather
/// 6.3-7.8 against 10.7-10.8).
pub(super) const PART_MAX: usize = 1 << 20;
/// Reduce in one exchange step up to this part: the root alone combines every part (64 KiB,
/// world 2: 0.12x the binomial tree's time). Larger ones go the way of all_reduce, every rank
/// reducing its share and only the root copying the result out (world 2, arena against the
/// tree: 4 MiB 462-504 us against 681-683, 16 MiB 3.6-3.8 ms against 5.1-5.8; world 4 on 2
/// cores, 16 MiB 8.2 ms against 14.5-15.3). One step against that way (`scripts/ab.py`, world
/// 2, 4 pairs): 128 KiB 0.53x, 256 KiB 0.46x, 512 KiB 0.77x, 1 MiB 0.98x the time. When ranks
/// outnumber cores, one step only up to [`OVERSUBSCRIBED_MAX`].
pub(super) const REDUCE_MAX: usize = 512 << 10;
/// Parts of reduce, and of reduce_scatter on more than [`ONE_STEP_REDUCE_SCATTER_RANKS`],
/// up to this many bytes take one exchange step when ranks outnumber cores (at 1 MiB every
/// rank waits for the slowest to be scheduled; at 64 KiB 0.07x-0.60x the schedules' time).
/// Scatter takes it up to [`PART_MAX`] there too, where its blocks are too small for direct
/// steps ([`OVERSUBSCRIBED_SCATTER_MIN`]) or direct steps are off: before, parts between
/// 64 KiB and blocks of 64 KiB took the network schedules over the shared-memory links, 5x
/// behind Open MPI at world 4, 128 KiB. One step against them, alternating runs on 2 cores
/// (µs): world 3 (4 pairs) 128 KiB 11 against 73; world 4 (4 pairs) 128 KiB 12 against 94,
/// 192 KiB 15 against 110; world 6 (3 pairs) 128-256 KiB 11-17 against 149-188; world 8
/// (3 pairs) 128 KiB 22 against 42, 192-256 KiB 23-29 against 247-268. Without direct steps
/// (`DISTCOMM_SHM_CMA=0`, 4 pairs): world 3 128 KiB-1 MiB 10-48 against 33-58, world 4 13-65
/// against 58-97.
pub(super) const OVERSUBSCRIBED_MAX: usize = 64 << 10;

/// Whether a part of `bytes` of `coll` takes the arena.
pub(super) fn worth_it(coll: &Coll<'_>, bytes: usize, arena: &Arena) -> bool {
    let max = match coll {
        // Parts larger than a slot move in pieces, one exchange step each (see `pieces`).
        Coll::Broadcast(..) | Coll::AllGather(..) | Coll::Gather(..) => return true,
        Coll::AllToAll(..) => return bytes <= ALL_TO_ALL_MAX,
        // Larger reduces go the way of all_reduce (see `through_arena`), as far as it goes.
        Coll::Reduce(..) if !one_step_reduce(bytes, arena) => return bytes <= arena.max_bytes(),
        Coll::ReduceScatter(..) if chunked_reduce_scatter(bytes, arena) => {
            return bytes <= arena.max_bytes()
        }
        Coll::ReduceScatter(..) if arena.ranks() <= ONE_STEP_REDUCE_SCATTER_RANKS => PART_MAX,
        // Also when ranks outnumber cores (see `OVERSUBSCRIBED_MAX`).
        Coll::Scatter(..) => PART_MAX,
        _ if arena.oversubscribed() => OVERSUBSCRIBED_MAX,
        Coll::Reduce(..) => REDUCE_MAX,
        _ => PART_MAX,
    };
    bytes <= max.min(arena.slot_bytes())
}

/// The pieces (byte ranges) a part of `len` bytes moves in: one when it is small, else four
/// at least (a piece is copied out by the readers while the writer copies in the next), each
/// between 64 KiB and a slot, whole cache lines. Always one piece at least (an empty part
/// still takes its step).
fn pieces(len: usize, slot: usize) -> Pieces {
    let piece = if len <= PIECE_MIN.min(slot) {
        len.max(1)
    } else {
        let p = (len / 4).max(PIECE_MIN).min(slot);
        if p >= 64 {
            p & !63
        } else {
            p.max(1)
        }
    };
    Pieces { at: 0, len, piece }
}

/// The iterator of [`pieces`] (plainer than `step_by`, whose set-up divides: a small call's
/// one piece costs a few instructions this way).
struct Pieces {
    at: usize,
    len: usize,
    piece: usize,
}

impl Iterator for Pieces {
    type Item = std::ops::Range<usize>;

    fn next(&mut self) -> Option<Self::Item> {
        // An empty part is one empty piece: `at` passes `len` only after it.
        if self.at > self.len || (self.at == self.len && self.len != 0) {
            return None;
        }
        let a = self.at;
        let end = (a + self.piece).min(self.len);
        self.at = if end == a { a + 1 } else { end };
        Some(a..end)
    }
}

/// all_to_all through the arena up to this input (bytes): above it the network schedules'
/// single copies beat the arena's two (world 2, 16 MiB: 4.8 ms against 6.0-6.9; world 4 at
/// 4 MiB: arena 2.6-3.4 ms, network 3.4-3.5).
pub(super) const ALL_TO_ALL_MAX: usize = 4 << 20;

/// Smallest piece of a part that moves in pieces.
const PIECE_MIN: usize = 64 << 10;

/// Gather, scatter, all_gather, even all_to_all and broadcast move by direct steps (one
/// cross-memory copy, see `arena/direct.rs`) where the arena takes them and each block a rank
/// copies has at least this many bytes; below, the slots' two copies cost less than the system
/// call and the wait for the readers. Measured with `scripts/ab.py` against the slots (world 2,
/// 4 pairs, new / old time): blocks of 4 KiB 1.20-1.59, 8 KiB 0.88-0.98, 16 KiB 0.63-0.74,
/// 32 KiB 0.46-0.87 (all_gather, all_to_all, scatter, broadcast); an earlier machine of the
/// same kind gave 0.92-1.22 for 32 KiB blocks, 0.70-0.78 for 128 KiB, 0.44-0.91 for 512 KiB.
/// When ranks outnumber cores, scatter from [`OVERSUBSCRIBED_SCATTER_MIN`].
pub(super) const DIRECT_MIN: usize = 16 << 10;
/// A broadcast takes direct steps up to this size: beyond, the root copying pieces in while the
/// readers copy the previous ones out (both cores at work) moves more than one cross-memory copy
/// (world 2, 3 pairs: 1 MiB 0.55 the slots' time, 2 MiB 0.93, 4 MiB 1.26, 16 MiB 1.39).
pub(super) const DIRECT_BROADCAST_MAX: usize = 2 << 20;
/// When ranks outnumber cores, gather and all_to_all take direct steps only from blocks this
/// large (world 4 on 2 cores: all_to_all 256 KiB blocks 1.45 the slots' time, 4 MiB 0.66; gather
/// 64 KiB 1.26, world 3 gather 340 KiB 1.15, world 4 4 MiB 0.72), scatter from 64 KiB
/// (0.21-0.96 from 64 KiB), broadcast and all_gather never (a root that waits for its readers
/// costs a context switch each: world 4 broadcast 1.15-2.45, all_gather 1.02-1.68).
pub(super) const OVERSUBSCRIBED_DIRECT_MIN: usize = 1 << 20;
/// When ranks outnumber cores, scatter takes direct steps from blocks this large (see
/// [`OVERSUBSCRIBED_DIRECT_MIN`]; smaller blocks were not measured there).
pub(super) const OVERSUBSCRIBED_SCATTER_MIN: usize = 64 << 10;

/// all_reduce takes two direct steps (see [`Run::direct_all_reduce`]) from this many bytes on,
/// when ranks do not outnumber cores (nor share a core's caches). Measured on 2 ranks on cores
/// of their own (a cache line's round trip 410-570 ns), `DISTCOMM_SHM_SHARED_CACHES=0` against
/// `=1` (the slots), 3 alternating pairs (µs): 2 MiB 654-672 against 557-575, 4 MiB 1308-1373
/// against 1108-1159, 16 MiB 5250-5323 against 4748-4902, 24 MiB 7584-8517 against 7992-8821,
/// 32 MiB 10942-11435 against 11469-11916, 48 MiB 15111-16615 against 17317-17850, 64 MiB
/// 20576-21405 against 22768-23330. (An earlier session measured it ahead from 2 MiB: the
/// machine's two vCPUs had other placements then.)
pub(super) const DIRECT_ALL_REDUCE_MIN: usize = 32 << 20;

/// Where the ranks share a core's caches ([`Caches::Shared`]), direct steps (gather,
/// scatter, all_gather, all_to_all, a two-rank reduce) only from blocks this large, so
/// broadcast (direct only up to [`DIRECT_BROADCAST_MAX`]) and all_reduce never: the slots'
/// two copies then pass through caches both ranks share and beat the kernel's one copy (which
/// moves 10 GB/s here either way). Measured on such a pair (world 2, `DISTCOMM_SHM_CMA=0`
/// against `=1`, alternating runs, µs, slots against direct): gather 64 KiB 2.4 against 6.1, 1 MiB 50 against 54-78, 4 MiB 194-196 against
/// 285-372, 16 MiB 1141-2725 against 846-2789; broadcast 1 MiB 43-61 against 103-127; reduce
/// 64 KiB 5.0 against 9.9, 1 MiB 95 against 116, 16 MiB 2291 against 2006; all_reduce 16 MiB
/// 3084 against 3346, 64 MiB 13826 against 16682.
pub(super) const SHARED_CACHES_DIRECT_MIN: usize = 4 << 20;

/// Where the ranks are near (a short round trip, yet one cross-memory copy beats the slots'
/// two: [`Caches::Near`]), direct steps only from blocks this large. Measured on such a pair
/// (world 2, 3 rounds gated on a round trip under 0.2 µs, µs, slots against direct): 64 KiB
/// gather 3.9 against 5.4, all_gather 5.4 against 6.7, scatter 5.0 against 5.4, all_to_all
/// 5.4 against 5.7 (the slots ahead), broadcast 7.5 against 6.4; 256
/// KiB broadcast 29.8 against 16.3, all_gather 21.7 against 12.3, gather 15.1 against 11.7,
/// scatter 20.2 against 11.7, all_to_all 21.7 against 12.3; 1 MiB broadcast 102 against 60,
/// gather 58 against 44, scatter 53 against 40, all_to_all 78 against 45. all_reduce keeps
/// the slots there (64 MiB: 16.8 ms against 18.1 with direct steps); reduce see
/// [`NEAR_REDUCE_MIN`]; all_gather, scatter and all_to_all see [`NEAR_SPREAD_DIRECT_MIN`].
pub(super) const NEAR_DIRECT_MIN: usize = 256 << 10;
/// [`NEAR_DIRECT_MIN`] of all_gather, scatter and all_to_all (every rank, or every rank but the
/// root, copies a block of its own). Measured on another host of this kind (AMD EPYC,
/// set-up's probe: slots 29-40 µs against 20-33 for the cross-memory copy), world 2, direct
/// steps from 16 KiB (`DISTCOMM_SHM_SHARED_CACHES=0`) against the slots, 3 alternating rounds
/// with a round trip under 0.2 µs, direct / slots time: blocks of 64 KiB all_gather 0.74x,
/// scatter 0.77x, all_to_all 0.80x; of 128 KiB 0.60x, 0.51x, 0.66x; of 32 KiB the slots
/// ahead (1.04-1.10x). This threshold against 256 KiB (`scripts/ab.py --caches shared`, two
/// runs of 3 pairs): blocks of 64 KiB all_gather 0.26x / 0.74x, scatter 0.83x / 0.89x,
/// all_to_all 0.91x / 0.86x; of 128 KiB 0.22x / 0.72x, 0.72x / 0.68x, 0.76x / 0.72x.
/// Gather (64 KiB blocks 1.02x, 128 KiB 0.94x) and broadcast (64 KiB 0.84x in one
/// measurement, 1.02x in the other) keep [`NEAR_DIRECT_MIN`].
pub(super) const NEAR_SPREAD_DIRECT_MIN: usize = 64 << 10;
/// Where the ranks are near, a two-rank reduce takes its direct step only from this many
/// bytes (same measurement as [`NEAR_DIRECT_MIN`], µs, one step through the slots against
/// the direct step: 256 KiB 20.3 against 29.5, 1 MiB 120 against 96).
pub(super) const NEAR_REDUCE_MIN: usize = 1 << 20;

/// The smallest block of a direct step in `arena`, when ranks do not outnumber cores: `min`
/// on cores of their own, `near` where the ranks are near, [`SHARED_CACHES_DIRECT_MIN`] where
/// they share a core's caches (each at least `min`).
fn direct_min(arena: &Arena, (min, near): (usize, usize)) -> usize {
    match arena.caches() {
        Caches::Apart => min,
        Caches::Near => min.max(near),
        Caches::Shared => min.max(SHARED_CACHES_DIRECT_MIN),
    }
}

/// Whether an all_reduce of `bytes` takes the direct steps in `arena`.
pub(super) fn direct_all_reduce_worth_it(arena: &Arena, bytes: usize) -> bool {
    arena.direct()
        && !arena.oversubscribed()
        && arena.caches() == Caches::Apart
        && bytes >= DIRECT_ALL_REDUCE_MIN
}

/// A reduce on two ranks takes a direct step (see [`Run::direct_reduce`]) from this many
/// bytes, when ranks do not outnumber cores, for every type but the 16-bit floats (which
/// combine in f32 through scratch). Measured on 2 ranks, `distcomm bench reduce` in alternating
/// runs (µs, direct against the slots): 8 KiB 2.8-3.0 against 2.0-2.3, 16 KiB 3.9-4.1 against
/// 3.5-4.1, 32 KiB 5.2-6.3 against 6.3-7.6, 64 KiB 8.8-10.4 against 11.3-14.1, 256 KiB
/// 27-33 against 39-45, 1 MiB 130-169 against 233-250, 4 MiB 715-775 against 1124-1471,
/// 16 MiB 1839-2146 against 4313-6028, 64 MiB 14238-14847 against 26908-33059. (With the
/// root's own part copied to scratch and combined through `reduce_all`, as more ranks need, it
/// was no faster than the slots; more ranks were not measured here, where they outnumber the
/// cores.)
pub(super) const DIRECT_REDUCE_MIN: usize = 32 << 10;

/// Whether a reduce of `bytes` of `T` on `n` ranks takes a direct step.
fn direct_reduce_worth_it<T: Reducible>(arena: &Arena, n: usize, bytes: usize) -> bool {
    n == 2
        && !T::WIDENS
        && arena.direct()
        && !arena.oversubscribed()
        && bytes >= direct_min(arena, (DIRECT_REDUCE_MIN, NEAR_REDUCE_MIN))
}

/// Whether `coll` moves by a direct step in `arena`.
pub(super) fn direct_worth_it(coll: &Coll<'_>, arena: &Arena, n: usize) -> bool {
    let crowded = arena.oversubscribed();
    let near = match coll {
        Coll::AllGather(..) | Coll::Scatter(..) | Coll::AllToAll(..) => NEAR_SPREAD_DIRECT_MIN,
        _ => NEAR_DIRECT_MIN,
    };
    let direct_min = direct_min(arena, (DIRECT_MIN, near));
    let crowded_min = if crowded {
        OVERSUBSCRIBED_DIRECT_MIN
    } else {
        direct_min
    };
    let (block, min) = match coll {
        Coll::Broadcast(buf, _) if !crowded && buf.len() <= DIRECT_BROADCAST_MAX => {
            (buf.len(), direct_min)
        }
        Coll::AllGather(input, _) if !crowded => (input.len(), direct_min),
        Coll::Scatter(_, out, _) if crowded => (out.len(), OVERSUBSCRIBED_SCATTER_MIN),
        Coll::Scatter(_, out, _) => (out.len(), direct_min),
        Coll::Gather(input, ..) => (input.len(), crowded_min),
        Coll::AllToAll((input, _), _) => (input.len() / n.max(1), crowded_min),
        _ => return false,
    };
    arena.direct() && block >= min
}

/// Runs `coll` (broadcast, gather, scatter, all_gather or all_to_all: see [`direct_worth_it`])
/// as one direct step of `arena` (`s`: the call of `kind`): every rank reads its blocks straight
/// from the buffers of the ranks that hold them.
fn direct_step(
    arena: &Arena,
    s: &Exchange<'_>,
    kind: CallKind,
    me: usize,
    n: usize,
    coll: Coll<'_>,
) -> Result<()> {
    let op = s.op;
    let all = (Reads::All, Reads::All);
    let ignore = &mut |_: usize, _: &Remote| Ok(());
    match coll {
        Coll::Broadcast(buf, root) if me == root => {
            count_sent(buf.len());
            arena.exchange_direct(s, (Reads::Nobody, Reads::All), buf, ignore)
        }
        Coll::Broadcast(buf, root) => {
            let mut get = |_: usize, part: &Remote| part.read(op, 0, buf);
            arena.exchange_direct(s, (Reads::Rank(root), Reads::Nobody), &[], &mut get)
        }
        Coll::AllGather(input, out) | Coll::Gather(input, Some(out), _) => {
            let k = input.len();
            count_sent(k);
            let mut get = |r: usize, part: &Remote| part.read(op, 0, &mut out[r * k..][..k]);
            // Nobody reads the root's part of a gather.
            let (mine, reads) = match kind {
                CallKind::Gather => (&[][..], (Reads::All, Reads::Nobody)),
                _ => (input, all),
            };
            arena.exchange_direct(s, reads, mine, &mut get)
        }
        Coll::Gather(input, None, root) => {
            count_sent(input.len());
            arena.exchange_direct(s, (Reads::Nobody, Reads::Rank(root)), input, ignore)
        }
        Coll::Scatter(input, out, root) => {
            let k = out.len();
            if me == root {
                let input = input.unwrap_or_default();
                count_sent(input.len());
                return arena.exchange_direct(s, (Reads::Nobody, Reads::All), input, ignore);
            }
            let mut get = |_: usize, part: &Remote| part.read(op, me * k, out);
            arena.exchange_direct(s, (Reads::Rank(root), Reads::Nobody), &[], &mut get)
        }
        Coll::AllToAll((input, _), (out, _)) => {
            let k = input.len() / n.max(1);
            count_sent(input.len());
            // Our own block stays out (the caller copied it already).
            let mut get = |r: usize, part: &Remote| part.read(op, me * k, &mut out[r * k..][..k]);
            arena.exchange_direct(s, all, input, &mut get)
        }
        _ => Err(crate::error::Error::Aborted {
            op,
            rank: me,
            reason: "internal: this collective has no direct step".into(),
        }),
    }
}

/// The arena's chunked reduction of `buf` in the call `s` (see [`Arena::all_reduce`]), the
/// elements `take` taking the result; averages of other types than 16-bit floats are divided
/// here (the arena divides those).
fn chunked_reduce<T: Reducible>(
    arena: &Arena,
    s: &Exchange<'_>,
    (buf, take): (&mut [T], std::ops::Range<usize>),
    op: ReduceOp,
) -> Result<()> {
    count_sent(size_of_val(buf));
    arena.all_reduce(s, (&mut *buf, take.clone()), op)?;
    if op == ReduceOp::Avg && !T::WIDENS {
        T::finish_avg(&mut buf[take], arena.ranks());
    }
    Ok(())
}

/// Elements of a piece of [`reduce_from`] on `n` ranks: 32-128 KiB per rank, 256 KiB of
/// scratch in all at most, so that it stays in the cache between the copies and the reduction
/// (128 KiB pieces on 2 ranks: 16 MiB all_reduce 4271-5522 µs against 4505-6466 in 32 KiB
/// ones, alternating runs).
fn reduce_piece<T>(n: usize) -> usize {
    ((256 << 10) / n.max(1)).clamp(32 << 10, 128 << 10) / size_of::<T>().max(1)
}

/// Combines the elements `range` of every rank's buffer into `buf[range]`, in rank order,
/// piece by piece: the other ranks' from `parts` (copied across processes into `scratch`, `n`
/// pieces of `piece` elements), this rank's (the one `parts` has no part for) from `buf`.
/// Two ranks combine straight into `buf` (`a op b` equals `b op a` for every operator, so the
/// values are rank order's; only the sign of a zero from Min/Max, or which NaN payload a sum of
/// two NaNs keeps, may differ), except 16-bit floats, which combine in f32 through
/// `reduce_all`. Every rank gets the same bits either way: each element is combined once.
fn reduce_from<T: Reducible>(
    parts: &[Option<Remote>],
    (buf, range): (&mut [T], std::ops::Range<usize>),
    (scratch, piece): (&mut [T], usize),
    (op, name): (ReduceOp, &'static str),
) -> Result<()> {
    let (n, size) = (parts.len(), size_of::<T>());
    let pair = n == 2 && !T::WIDENS;
    for at in range.clone().step_by(piece.max(1)) {
        let end = (at + piece).min(range.end);
        let len = end - at;
        if pair {
            if let Some(part) = parts.iter().flatten().next() {
                let dst = &mut scratch[..len];
                part.read(name, at * size, bytemuck::cast_slice_mut(dst))?;
                T::reduce_into(&mut buf[at..end], dst, op);
            }
            continue;
        }
        for (r, part) in parts.iter().enumerate() {
            let dst = &mut scratch[r * piece..r * piece + len];
            match part {
                Some(part) => part.read(name, at * size, bytemuck::cast_slice_mut(dst))?,
                None => copy(dst, &buf[at..end]),
            }
        }
        let scratch = &*scratch;
        T::reduce_all(&mut buf[at..end], n, &|r| &scratch[r * piece..][..len], op);
    }
    Ok(())
}

impl Run<'_> {
    /// The arena's view of `call` (fingerprint `fp`, sequence number `tag`) on `T`.
    pub(super) fn exchange<'a, T: Reducible>(
        &'a self,
        call: &Call,
        fp: &'a crate::call::Fingerprint,
        tag: u32,
    ) -> Exchange<'a> {
        Exchange {
            op: call.kind.name(),
            fp,
            dtype: T::DTYPE,
            tag,
            timeout: self.timeout,
            engine: &self.engine,
        }
    }

    /// reduce by one direct step of `arena` (`s`: the call): the root reads every other rank's
    /// buffer across processes, piece by piece, and combines them with its own in rank order
    /// into its buffer; the others publish theirs and return once the root is done. One
    /// cross-memory copy of each other buffer and one pass of reduction (on two ranks straight
    /// into the root's buffer), against the slots' copy in of every part and the root's
    /// reduction out of them. Averages of other types than 16-bit floats: the caller divides.
    fn direct_reduce<T: Reducible>(
        &self,
        arena: &Arena,
        s: &Exchange<'_>,
        (buf, op): (&mut [T], ReduceOp),
        root: usize,
    ) -> Result<()> {
        let n = self.size();
        if self.rank != root {
            let mine = Published::of(bytemuck::cast_slice(buf));
            let reads = (Reads::Nobody, Reads::Rank(root));
            return arena.exchange_direct_all(s, reads, mine, &mut |_| Ok(()));
        }
        let piece = reduce_piece::<T>(n);
        let mut scratch: Vec<T> = self.pool.take_len(n * piece);
        let whole = 0..buf.len();
        let mut reduce = |parts: &[Option<Remote>]| {
            reduce_from(
                parts,
                (&mut *buf, whole.clone()),
                (&mut scratch, piece),
                (op, s.op),
            )
        };
        let reads = (Reads::All, Reads::Nobody);
        let done = arena.exchange_direct_all(s, reads, Published::of(&[]), &mut reduce);
        self.pool.give(scratch);
        done
    }

    /// all_reduce by two direct steps of `arena` (`s`: the call): every rank reads its share
    /// (`chunks(len, n)[me]`) of every other rank's buffer across processes, piece by piece,
    /// and combines them in rank order into its own buffer; then reads every other rank's
    /// reduced share into its buffer. Two cross-memory copies of (n − 1)/n of the buffer and
    /// one pass of reduction per rank, against the slots' copy in, reduction and copy out of
    /// all of it. A rank only ever writes its own buffer, and only where no other rank reads
    /// in that step: its share in the first, the others' in the second (each step ends once
    /// every reader is done). 16-bit floats combine in f32 and round once, as everywhere.
    pub(super) fn direct_all_reduce<T: Reducible>(
        &self,
        arena: &Arena,
        s: &Exchange<'_>,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me, name) = (self.size(), self.rank, s.op);
        let size = size_of::<T>();
        let shares = crate::algorithms::chunks(buf.len(), n);
        let whole = Published::of(bytemuck::cast_slice(buf));
        let piece = reduce_piece::<T>(n);
        let mut scratch: Vec<T> = self.pool.take_len(n * piece);
        let mine = shares[me].clone();
        let mut reduce_share = |parts: &[Option<Remote>]| {
            reduce_from(
                parts,
                (&mut *buf, mine.clone()),
                (&mut scratch, piece),
                (op, name),
            )
        };
        let all = (Reads::All, Reads::All);
        let done = arena.exchange_direct_all(s, all, whole, &mut reduce_share);
        self.pool.give(scratch);
        done?;
        let mut gather_shares = |parts: &[Option<Remote>]| {
            for (r, part) in parts.iter().enumerate() {
                if let Some(part) = part {
                    let share = shares[r].clone();
                    let dst = bytemuck::cast_slice_mut(&mut buf[share.clone()]);
                    part.read(name, share.start * size, dst)?;
                }
            }
            Ok(())
        };
        arena.exchange_direct_all(s, all, whole, &mut gather_shares)
    }

    /// Runs `coll` through the arena (its part fits: see [`part_bytes`]; with `direct`, as one
    /// direct step: see [`direct_worth_it`]), in the call's turn.
    pub(super) fn through_arena<T: Reducible>(
        &self,
        arena: &Arena,
        call: &Call,
        tag: u32,
        (coll, direct): (Coll<'_>, bool),
    ) -> Result<()> {
        let (n, me) = (self.size(), self.rank);
        let direct_reduce = matches!(&coll, Coll::Reduce(buf, ..)
            if direct_reduce_worth_it::<T>(arena, n, buf.len()));
        let algo = match direct || direct_reduce {
            true => "shared-memory arena, direct copies",
            false => "shared-memory arena",
        };
        chose(&call.algo(algo), T::DTYPE, me, n, 1);
        let fp = call.fingerprint();
        let s = self.exchange::<T>(call, &fp, tag);
        if direct {
            return direct_step(arena, &s, call.kind, me, n, coll);
        }
        match coll {
            Coll::Broadcast(buf, root) => {
                if me == root {
                    count_sent(buf.len());
                }
                for c in pieces(buf.len(), arena.slot_bytes()) {
                    let len = c.len();
                    let sizes = |r: usize| if r == root { len } else { 0 };
                    let buf = &mut buf[c];
                    if me == root {
                        let mut put = |part: &mut [u8]| copy_bytes(part, buf);
                        arena.exchange(&s, Reads::Nobody, &sizes, &mut put, &mut |_, _| Ok(()))?;
                    } else {
                        let mut get = |r: usize, part: &[u8]| {
                            if r == root {
                                copy_bytes(buf, part);
                            }
                            Ok(())
                        };
                        arena.exchange(&s, Reads::Rank(root), &sizes, &mut |_| {}, &mut get)?;
                    }
                }
                Ok(())
            }
            Coll::AllGather(input, out) | Coll::Gather(input, Some(out), _) => {
                let k = input.len();
                count_sent(k);
                for c in pieces(k, arena.slot_bytes()) {
                    let len = c.len();
                    let mut get = |r: usize, part: &[u8]| {
                        if r != me {
                            copy_bytes(&mut out[r * k + c.start..r * k + c.end], part);
                        }
                        Ok(())
                    };
                    let mut put = |part: &mut [u8]| copy_bytes(part, &input[c.clone()]);
                    arena.exchange(&s, Reads::All, &|_| len, &mut put, &mut get)?;
                }
                Ok(())
            }
            Coll::Gather(input, None, _) => {
                count_sent(input.len());
                for c in pieces(input.len(), arena.slot_bytes()) {
                    let len = c.len();
                    let mut put = |part: &mut [u8]| copy_bytes(part, &input[c.clone()]);
                    arena.exchange(&s, Reads::Nobody, &|_| len, &mut put, &mut |_, _| Ok(()))?;
                }
                Ok(())
            }
            Coll::Scatter(input, out, root) => {
                let k = out.len();
                let sizes = |r: usize| if r == root { n * k } else { 0 };
                let mut get = |r: usize, part: &[u8]| {
                    if r == root && me != root {
                        copy_bytes(out, &part[me * k..(me + 1) * k]);
                    }
                    Ok(())
                };
                let mut put = |part: &mut [u8]| {
                    if let Some(input) = input {
                        count_sent(input.len());
                        copy_bytes(part, input);
                    }
                };
                let reads = if me == root {
                    Reads::Nobody
                } else {
                    Reads::Rank(root)
                };
                arena.exchange(&s, reads, &sizes, &mut put, &mut get)
            }
            Coll::AllToAll((input, _), (out, _)) => {
                let k = input.len() / n.max(1);
                count_sent(input.len());
                // Piece `c` of every block: the part holds n pieces, the one for rank `q` at
                // `q * len`.
                for c in pieces(k, arena.slot_bytes() / n.max(1)) {
                    let len = c.len();
                    let block = |q: usize| q * k + c.start..q * k + c.end;
                    // Our own block stays out (the caller copied it already).
                    let mut put = |p: &mut [u8]| {
                        for q in (0..n).filter(|&q| q != me) {
                            copy_bytes(&mut p[q * len..(q + 1) * len], &input[block(q)]);
                        }
                    };
                    let mut get = |r: usize, part: &[u8]| {
                        if r != me {
                            copy_bytes(&mut out[block(r)], &part[me * len..(me + 1) * len]);
                        }
                        Ok(())
                    };
                    arena.exchange(&s, Reads::All, &|_| n * len, &mut put, &mut get)?;
                }
                Ok(())
            }
            Coll::Reduce(buf, root, op) => {
                let buf = crate::backend::typed_mut::<T>(s.op, buf)?;
                if direct_reduce {
                    count_sent(size_of_val(buf));
                    self.direct_reduce(arena, &s, (&mut *buf, op), root)?;
                    if me == root && op == ReduceOp::Avg && !T::WIDENS {
                        T::finish_avg(buf, n);
                    }
                    return Ok(());
                }
                if !one_step_reduce(widened::<T>(size_of_val(buf)), arena) {
                    // Larger: every rank reduces its share, as all_reduce does.
                    let take = if me == root { 0..buf.len() } else { 0..0 };
                    return chunked_reduce(arena, &s, (buf, take), op);
                }
                let whole = 0..buf.len();
                self.reduce_block(arena, &s, Io::InPlace(buf, me == root), whole, op)
            }
            Coll::ReduceScatter(input, out, op) => {
                let out = crate::backend::typed_mut::<T>(s.op, out)?;
                let input = typed::<T>(s.op, input)?;
                let k = out.len();
                if chunked_reduce_scatter(widened::<T>(size_of_val(input)), arena) {
                    // Larger: every rank reduces its share of a working copy, as all_reduce
                    // does, and takes its block of the result.
                    let mut work: Vec<T> = self.pool.copy_of(input);
                    let block = me * k..(me + 1) * k;
                    let done = chunked_reduce(arena, &s, (&mut work, block.clone()), op);
                    if done.is_ok() {
                        copy(out, &work[block]);
                    }
                    self.pool.give(work);
                    return done;
                }
                // The reduction reads every rank's whole input, and writes this rank's block.
                self.reduce_block(
                    arena,
                    &s,
                    Io::Apart(input, Some(out)),
                    me * k..(me + 1) * k,
                    op,
                )
            }
            Coll::Barrier => {
                arena.exchange(&s, Reads::All, &|_| 0, &mut |_| {}, &mut |_, _| Ok(()))
            }
            Coll::AllReduce(..) => Ok(()),
        }
    }

    /// Every rank puts its input; where `io` has an output, the elements `block` of every rank's
    /// input are reduced into it (in rank order, 16-bit floats in `f32`, averages divided).
    fn reduce_block<T: Reducible>(
        &self,
        arena: &Arena,
        s: &Exchange<'_>,
        mut io: Io<'_, T>,
        block: std::ops::Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size();
        if T::WIDENS {
            let mut wide = self.pool.take_len::<f32>(io.input().len());
            T::widen_into(io.input(), &mut wide);
            let reading = io.reads();
            let mut acc = self
                .pool
                .take_len::<f32>(if reading { block.len() } else { 0 });
            let into = reading.then_some(&mut acc[..]);
            let r = self.exchange_reduce(arena, s, Io::Apart(&wide, into), &block, op);
            if let (Ok(()), Some(out)) = (&r, io.output()) {
                if op == ReduceOp::Avg {
                    f32::finish_avg(&mut acc, n);
                }
                T::narrow(out, &acc);
            }
            self.pool.give(wide);
            self.pool.give(acc);
            return r;
        }
        self.exchange_reduce(arena, s, io.reborrow(), &block, op)?;
        if let (ReduceOp::Avg, Some(out)) = (op, io.output()) {
            T::finish_avg(out, n);
        }
        Ok(())
    }

    /// The exchange of a reduction: puts the input, and where `io` has an output, reduces
    /// `block` of every rank's part into it in rank order, straight from the arena (which holds
    /// every part once it is put, so the output may be the input itself).
    fn exchange_reduce<A: Reducible>(
        &self,
        arena: &Arena,
        s: &Exchange<'_>,
        io: Io<'_, A>,
        block: &std::ops::Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        let reading = io.reads();
        let bytes = size_of_val(io.input());
        count_sent(bytes);
        // `exchange` calls `put` once, before any `get` (never from inside one): the two
        // borrows never overlap, so neither can fail.
        let io = std::cell::RefCell::new(io);
        let mut put = |p: &mut [u8]| copy_bytes(p, bytemuck::cast_slice(io.borrow().input()));
        let mut get = |r: usize, part: &[u8]| {
            let mut io = io.borrow_mut();
            let Some(acc) = io.output() else {
                return Ok(());
            };
            let theirs = &typed::<A>(s.op, part)?[block.clone()];
            if r == 0 {
                copy(acc, theirs);
            } else {
                A::reduce_into(acc, theirs, op);
            }
            Ok(())
        };
        let reads = if reading { Reads::All } else { Reads::Nobody };
        arena.exchange(s, reads, &|_| bytes, &mut put, &mut get)
    }
}

/// Where a reduction through the arena takes its input from and puts its result.
enum Io<'a, T> {
    /// Puts the input; reduces into the output, when there is one (a rank that reads).
    Apart(&'a [T], Option<&'a mut [T]>),
    /// Puts the buffer and, when reading (`true`), reduces into the same buffer.
    InPlace(&'a mut [T], bool),
}

impl<T> Io<'_, T> {
    fn reads(&self) -> bool {
        matches!(self, Io::Apart(_, Some(_)) | Io::InPlace(_, true))
    }

    fn input(&self) -> &[T] {
        match self {
            Io::Apart(input, _) => input,
            Io::InPlace(buf, _) => buf,
        }
    }

    fn reborrow(&mut self) -> Io<'_, T> {
        match self {
            Io::Apart(input, out) => Io::Apart(input, out.as_deref_mut()),
            Io::InPlace(buf, reading) => Io::InPlace(buf, *reading),
        }
    }

    /// The output of a rank that reads (in place: the input's buffer, read before).
    fn output(&mut self) -> Option<&mut [T]> {
        match self {
            Io::Apart(_, out) => out.as_deref_mut(),
            Io::InPlace(buf, true) => Some(buf),
            Io::InPlace(_, false) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pieces` covers the part exactly once, in order, in pieces of one size but the last,
    /// and an empty part in one empty piece.
    #[test]
    fn pieces_cover_a_part_once_in_order() {
        for slot in [64, 1000, 64 << 10, 1 << 20] {
            for len in [
                0,
                1,
                7,
                64,
                1000,
                65535,
                65536,
                65537,
                300_000,
                1 << 20,
                5 << 20,
            ] {
                let got: Vec<_> = pieces(len, slot).collect();
                if len == 0 {
                    assert_eq!(got, vec![0..0]);
                    continue;
                }
                assert_eq!(got.first().map(|r| r.start), Some(0), "{len} {slot}");
                assert_eq!(got.last().map(|r| r.end), Some(len), "{len} {slot}");
                for w in got.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "{len} {slot}");
                    assert_eq!(w[0].len(), got[0].len(), "{len} {slot}");
                }
                assert!(got.iter().all(|r| !r.is_empty() && r.len() <= slot.max(1)));
            }
        }
    }
}
