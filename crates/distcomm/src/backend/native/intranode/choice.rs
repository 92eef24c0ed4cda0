//! When a collective takes the shared arena, and how: which parts fit it, from which sizes
//! blocks move by direct steps (one cross-memory copy) instead of the slots, by op, placement
//! and crowding, each threshold with its measurement.
//!
//! Owns: the choice. Must not know: how a step runs (the parent module).

use super::super::arena::{Arena, Caches, INLINE};
use crate::backend::Coll;
use crate::call::Call;
use crate::reduce::Reducible;

/// The largest part (bytes) any rank puts into the arena for `coll`, when it can go there:
/// `None` for all_reduce (it has its own path) and uneven all_to_all (a rank cannot find its
/// block in another's part without that rank's counts).
pub(in crate::backend::native) fn part_bytes<T: Reducible>(
    coll: &Coll<'_>,
    call: &Call,
    n: usize,
) -> Option<usize> {
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
pub(super) fn widened<T: Reducible>(bytes: usize) -> usize {
    if T::WIDENS {
        bytes * (size_of::<f32>() / size_of::<T>())
    } else {
        bytes
    }
}

/// Whether a reduce whose part is `part` bytes takes one exchange step (else it goes the way
/// of all_reduce).
pub(super) fn one_step_reduce(part: usize, arena: &Arena) -> bool {
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
pub(super) fn chunked_reduce_scatter(part: usize, arena: &Arena) -> bool {
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
pub(in crate::backend::native) const PART_MAX: usize = 1 << 20;
/// Reduce in one exchange step up to this part: the root alone combines every part (64 KiB,
/// world 2: 0.12x the binomial tree's time). Larger ones go the way of all_reduce, every rank
/// reducing its share and only the root copying the result out (world 2, arena against the
/// tree: 4 MiB 462-504 us against 681-683, 16 MiB 3.6-3.8 ms against 5.1-5.8; world 4 on 2
/// cores, 16 MiB 8.2 ms against 14.5-15.3). One step against that way (`scripts/ab.py`, world
/// 2, 4 pairs): 128 KiB 0.53x, 256 KiB 0.46x, 512 KiB 0.77x, 1 MiB 0.98x the time. When ranks
/// outnumber cores, one step only up to [`OVERSUBSCRIBED_MAX`].
pub(in crate::backend::native) const REDUCE_MAX: usize = 512 << 10;
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
pub(in crate::backend::native) const OVERSUBSCRIBED_MAX: usize = 64 << 10;

/// Whether `coll`, whose largest part is `bytes`, takes `arena` (`Some`), and if so whether as
/// one direct step (`Some(true)`). Parts that travel in the control lines (and fit a slot,
/// however small one is configured) always take it, by exchange steps, without the checks of
/// larger ones: a small call's few instructions count.
pub(in crate::backend::native) fn arena_way(
    coll: &Coll<'_>,
    bytes: usize,
    arena: &Arena,
    n: usize,
) -> Option<bool> {
    if bytes <= INLINE.min(arena.slot_bytes()) {
        return Some(false);
    }
    let direct = direct_worth_it(coll, arena, n);
    (direct || worth_it(coll, bytes, arena)).then_some(direct)
}

/// Whether a part of `bytes` of `coll` takes the arena.
fn worth_it(coll: &Coll<'_>, bytes: usize, arena: &Arena) -> bool {
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

/// all_to_all through the arena up to this input (bytes): above it the network schedules'
/// single copies beat the arena's two (world 2, 16 MiB: 4.8 ms against 6.0-6.9; world 4 at
/// 4 MiB: arena 2.6-3.4 ms, network 3.4-3.5).
pub(in crate::backend::native) const ALL_TO_ALL_MAX: usize = 4 << 20;

/// Whether a copy of `len` bytes into a rank's part of an exchange step (a broadcast's piece,
/// a gather's or all_gather's, a scatter's input, an all_to_all's block, a reduction's input)
/// takes non-temporal stores (`copy::copy_bytes_streaming`): from [`STREAM_PART_MIN`] where
/// the arena streams ([`Arena::streams`]: ranks apart, or outnumbering the cores, where set-up
/// measured streaming the faster; the readers of the part then run on another core, whose
/// cache an ordinary store must first take each line back from, unless the two share a
/// last-level cache).
/// Measured on 2 cores in alternating runs (µs, non-temporal against ordinary stores), the
/// two vCPUs apart: all_to_all world 8, blocks of 32 KiB 114-144 against 291-295, 128 KiB
/// 352-418 against 1147-1155, 512 KiB 1400-1463 against 4018-4721 (Open MPI 470-590 at
/// 128 KiB); world 4, 64 KiB 39-54 against 125-141, 256 KiB 143-211 against 555-559;
/// broadcast world 3 / 8, 1 MiB 117 / 184 against 470-590 / 560-600, 16 MiB 2.0-2.2 ms /
/// 6.3 against 6.8-8.0 / 11.7; all_gather 1 MiB 122 / 212 against 385 / 380, gather and
/// scatter 0.5-1.0x. Near: all_to_all world 4, 64 KiB 54 against 36, 256 KiB 142 against
/// 139; broadcast world 3 / 8, 64 KiB 6.5 / 14 against 10.8 / 19, 1 MiB 73 / 150 against
/// 140 / 194, 16 MiB 2.4 ms / 5.8 against 1.6 / 5.3 (Open MPI world 3: 3.6 ms); all_gather
/// 1 MiB 107 / 171 against 136 / 181; gather and scatter 0.9-1.5x, the same within the noise.
/// One-step reductions trade: world 3 reduce_scatter apart 64 KiB 17 against 29-31, 1 MiB
/// 170-175 against 400-407, reduce 64 KiB 21 against 29-60, near 17 against 12, 182 against
/// 111, 17 against 9 (Open MPI's world 3 reduce of 64 KiB: 20 µs); so the slower placement
/// comes nearer the faster. (All of this on AMD EPYC VMs. On an Intel Xeon 5th gen VM, whose
/// two vCPUs are apart but share the last-level cache, ordinary stores won instead, world 4 on
/// 2 cores: reduce 64 KiB 0.43x the streamed time, all_to_all 64 KiB 0.59x, gather 1 MiB 0.51x,
/// reduce_scatter 1 MiB 0.62x; set-up's probe finds that out, see `arena/setup.rs`.)
/// all_to_all blocks stream from [`STREAM_ALL_TO_ALL_MIN`].
pub(super) fn stream_part(arena: &Arena, len: usize, all_to_all: bool) -> bool {
    let min = match all_to_all {
        true => STREAM_ALL_TO_ALL_MIN,
        false => STREAM_PART_MIN,
    };
    len >= min && arena.streams()
}

/// See [`stream_part`]: smaller parts were not measured.
const STREAM_PART_MIN: usize = 32 << 10;
/// all_to_all's blocks stream from this size (see [`stream_part`]). Measured on 2 cores
/// against 32 KiB (µs, three runs): the vCPUs apart, world 3 64 KiB (blocks of 21 KiB) 13
/// against 28-30, world 4 64 KiB 16-23 against 36-42 (Open MPI 31), world 8 64 KiB 42-61
/// against 84, 128 KiB 63-67 against 159-164; near, world 3 13 against 11, world 4 16
/// against 17, 26 against 35, world 8 49 against 30, 67 against 48 (Open MPI's world 8 64
/// KiB: 123).
const STREAM_ALL_TO_ALL_MIN: usize = 8 << 10;

/// Gather, scatter, all_gather, even all_to_all and broadcast move by direct steps (one
/// cross-memory copy, see `arena/direct.rs`) where the arena takes them and each block a rank
/// copies has at least this many bytes; below, the slots' two copies cost less than the system
/// call and the wait for the readers. Measured with `scripts/ab.py` against the slots (world 2,
/// 4 pairs, new / old time): blocks of 4 KiB 1.20-1.59, 8 KiB 0.88-0.98, 16 KiB 0.63-0.74,
/// 32 KiB 0.46-0.87 (all_gather, all_to_all, scatter, broadcast); an earlier machine of the
/// same kind gave 0.92-1.22 for 32 KiB blocks, 0.70-0.78 for 128 KiB, 0.44-0.91 for 512 KiB.
/// When ranks outnumber cores, scatter from [`OVERSUBSCRIBED_SCATTER_MIN`].
pub(in crate::backend::native) const DIRECT_MIN: usize = 16 << 10;
/// Where the ranks are near or share a core's caches, a broadcast takes direct steps up to
/// this size: beyond, the root copying pieces in while the readers copy the previous ones out
/// (both cores at work) moves more than one cross-memory copy. Measured on such a pair (world
/// 2, 3 rounds gated on a round trip under 0.2 µs, µs, slots against direct): 4 MiB 154
/// against 238, 16 MiB 560 against 1097, 64 MiB 4924 against 6489 (an earlier host: 1 MiB
/// 0.55 the slots' time, 2 MiB 0.93, 4 MiB 1.26, 16 MiB 1.39). Ranks apart take direct steps
/// at every size: there the slots' lines cross between the cores' caches one by one (this
/// host, a round trip of 340-470 ns: 2.5 MiB 1010-1107 µs through the slots, 4 MiB
/// 1415-1663, 8 MiB 2188-2646, against 4 MiB 241 and 16 MiB 1155 direct, Open MPI's 16 MiB
/// 2313-2888).
pub(in crate::backend::native) const DIRECT_BROADCAST_MAX: usize = 2 << 20;
/// When ranks outnumber cores, gather and all_to_all take direct steps only from blocks this
/// large where the arena streams ([`OVERSUBSCRIBED_PLAIN_DIRECT_MIN`] where it does not).
/// Measured on AMD EPYC VMs (world 4 on 2 cores: all_to_all 256 KiB blocks 1.45 the slots'
/// time, 4 MiB 0.66; gather 64 KiB 1.26, world 3 gather 340 KiB 1.15, world 4 4 MiB 0.72),
/// scatter from 64 KiB
/// (0.21-0.96 from 64 KiB), broadcast and all_gather never (a root that waits for its readers
/// costs a context switch each: world 4 broadcast 1.15-2.45, all_gather 1.02-1.68).
pub(in crate::backend::native) const OVERSUBSCRIBED_DIRECT_MIN: usize = 1 << 20;
/// [`OVERSUBSCRIBED_DIRECT_MIN`] where set-up found ordinary stores into the slots faster than
/// streaming ones ([`Arena::streams`] false: cores that share their last-level cache, where a
/// reader finds the lines a writer just stored there): each block of the slots' way is then
/// written by one core and read by another through that cache twice over, against one
/// cross-memory copy from a buffer nobody writes meanwhile. Measured on an Intel Xeon VM of
/// that kind (2 vCPUs), `distcomm bench`, 3 alternating runs (µs, direct steps from 16 KiB
/// blocks against the slots): all_to_all world 3, 64 KiB 12.4-13.4 against 15.5, 256 KiB
/// 29-33 against 47-48, 1 MiB 130-135 against 197-208; world 4, 64 KiB (16 KiB blocks) 21-27
/// against 20-34, 256 KiB 40-46 against 61-84, 1 MiB 155-158 against 275-338; world 8, 1 MiB
/// 331-413 against 532-618, 4 MiB 1170-1389 against 1962-2105; gather world 3, 64 KiB (21 KiB
/// blocks) 7.3-8.2 against 5.3-5.4, 256 KiB 14.5-16.1 against 18-32, 1 MiB 39-49 against
/// 62-104; world 4, 64 KiB 9.2-13.6 against 6.3-9.2, 256 KiB 15-17 against 17-19, 1 MiB
/// 41-47 against 66-69; world 8, 1 MiB 51-57 against 94-113, 4 MiB 251-266 against 427-465.
/// So from 64 KiB blocks.
pub(in crate::backend::native) const OVERSUBSCRIBED_PLAIN_DIRECT_MIN: usize = 64 << 10;
/// When ranks outnumber cores, scatter takes direct steps from blocks this large (see
/// [`OVERSUBSCRIBED_DIRECT_MIN`]; smaller blocks were not measured there).
pub(in crate::backend::native) const OVERSUBSCRIBED_SCATTER_MIN: usize = 64 << 10;

/// Where the ranks share a core's caches ([`Caches::Shared`]), direct steps (gather,
/// scatter, all_gather, all_to_all, a two-rank reduce) only from blocks this large, so
/// broadcast (direct only up to [`DIRECT_BROADCAST_MAX`]) and all_reduce never: the slots'
/// two copies then pass through caches both ranks share and beat the kernel's one copy (which
/// moves 10 GB/s here either way). Measured on such a pair (world 2, `DISTCOMM_SHM_CMA=0`
/// against `=1`, alternating runs, µs, slots against direct): gather 64 KiB 2.4 against 6.1, 1 MiB 50 against 54-78, 4 MiB 194-196 against
/// 285-372, 16 MiB 1141-2725 against 846-2789; broadcast 1 MiB 43-61 against 103-127; reduce
/// 64 KiB 5.0 against 9.9, 1 MiB 95 against 116, 16 MiB 2291 against 2006; all_reduce 16 MiB
/// 3084 against 3346, 64 MiB 13826 against 16682.
pub(in crate::backend::native) const SHARED_CACHES_DIRECT_MIN: usize = 4 << 20;

/// Where the ranks are near (a short round trip, yet one cross-memory copy beats the slots'
/// two: [`Caches::Near`]), direct steps only from blocks this large. Measured on such a pair
/// (world 2, 3 rounds gated on a round trip under 0.2 µs, µs, slots against direct): 64 KiB
/// gather 3.9 against 5.4, all_gather 5.4 against 6.7, scatter 5.0 against 5.4, all_to_all
/// 5.4 against 5.7 (the slots ahead), broadcast 7.5 against 6.4; 256
/// KiB broadcast 29.8 against 16.3, all_gather 21.7 against 12.3, gather 15.1 against 11.7,
/// scatter 20.2 against 11.7, all_to_all 21.7 against 12.3; 1 MiB broadcast 102 against 60,
/// gather 58 against 44, scatter 53 against 40, all_to_all 78 against 45. all_reduce keeps
/// the slots there (64 MiB: 16.8 ms against 18.1 with direct steps); reduce see
/// [`NEAR_REDUCE_MIN`]; all_gather, scatter, all_to_all and broadcast see
/// [`NEAR_SPREAD_DIRECT_MIN`].
pub(in crate::backend::native) const NEAR_DIRECT_MIN: usize = 256 << 10;
/// [`NEAR_DIRECT_MIN`] of all_gather, scatter, all_to_all and broadcast (every rank, or every
/// rank but the root, copies a block of its own, or the root's whole buffer). Measured on
/// another host of this kind (AMD EPYC, set-up's probe: slots 29-40 µs against 20-33 for the
/// cross-memory copy), world 2, direct steps from 16 KiB (`DISTCOMM_SHM_SHARED_CACHES=0`)
/// against the slots, 3 alternating rounds with a round trip under 0.2 µs, direct / slots
/// time: blocks of 64 KiB all_gather 0.74x, scatter 0.77x, all_to_all 0.80x; of 128 KiB
/// 0.60x, 0.51x, 0.66x; of 32 KiB the slots ahead (1.04-1.10x). This threshold against
/// 256 KiB (`scripts/ab.py --caches shared`, two runs of 3 pairs): blocks of 64 KiB
/// all_gather 0.26x / 0.74x, scatter 0.83x / 0.89x, all_to_all 0.91x / 0.86x; of 128 KiB
/// 0.22x / 0.72x, 0.72x / 0.68x, 0.76x / 0.72x.
/// Broadcast too: 64 KiB 0.84x in one measurement, 1.02x in another, then (set-up's probe:
/// slots 31-32 µs against 23-24, 4 rounds gated on a round trip under 0.2 µs, direct /
/// slots time) 64 KiB 0.84x (0.84-0.85; 6.4 µs against 7.7), 128 KiB 0.72x. Gather keeps
/// [`NEAR_DIRECT_MIN`]: 64 KiB blocks 1.02x, 128 KiB 0.94x, then 1.37x and 1.12x.
pub(in crate::backend::native) const NEAR_SPREAD_DIRECT_MIN: usize = 64 << 10;
/// Where the ranks are near, a two-rank reduce takes its direct step only from this many
/// bytes (same measurement as [`NEAR_DIRECT_MIN`], µs, one step through the slots against
/// the direct step: 256 KiB 20.3 against 29.5, 1 MiB 120 against 96).
pub(in crate::backend::native) const NEAR_REDUCE_MIN: usize = 1 << 20;

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

/// Whether a broadcast of `bytes` may take a direct step in `arena` (see
/// [`DIRECT_BROADCAST_MAX`]).
fn broadcast_direct_fits(arena: &Arena, bytes: usize) -> bool {
    arena.caches() == Caches::Apart || bytes <= DIRECT_BROADCAST_MAX
}

/// A reduce on two ranks takes a direct step (see
/// [`Run::direct_reduce`](super::super::collectives::Run::direct_reduce)) from this many
/// bytes, when ranks do not outnumber cores, for every type but the 16-bit floats (which
/// combine in f32 through scratch). Measured on 2 ranks, `distcomm bench reduce` in alternating
/// runs (µs, direct against the slots): 8 KiB 2.8-3.0 against 2.0-2.3, 16 KiB 3.9-4.1 against
/// 3.5-4.1, 32 KiB 5.2-6.3 against 6.3-7.6, 64 KiB 8.8-10.4 against 11.3-14.1, 256 KiB
/// 27-33 against 39-45, 1 MiB 130-169 against 233-250, 4 MiB 715-775 against 1124-1471,
/// 16 MiB 1839-2146 against 4313-6028, 64 MiB 14238-14847 against 26908-33059. (With the
/// root's own part copied to scratch and combined through `reduce_all`, as more ranks need, it
/// was no faster than the slots; more ranks were not measured here, where they outnumber the
/// cores.)
pub(in crate::backend::native) const DIRECT_REDUCE_MIN: usize = 32 << 10;

/// all_reduce takes two direct steps (see
/// [`Run::direct_all_reduce`](super::super::collectives::Run::direct_all_reduce)) from this many
/// bytes where the ranks are apart, do not outnumber the cores, and set-up found that ordinary
/// stores beat streaming ones ([`Arena::streams`] false: the cores share their last-level
/// cache, so the kernel's copy of lines the other rank just wrote finds them there). Every
/// type but the 16-bit floats, which combine in f32 through scratch (bf16 world 2, 2-64 MiB:
/// 0.9-1.14x the slots' time, no gain). Measured on an Intel Xeon VM of that kind (two vCPUs,
/// 260 MiB of shared L3), world 2 f32, `distcomm bench all_reduce`, 3 alternating runs (µs,
/// direct steps against the slots): 1 MiB 209-223 against 171-181, 1.5 MiB 317-329 against
/// 299-316, 2 MiB 352-361 against 412-452, 4 MiB 535-680 against 832-842, 16 MiB 2153-2512
/// against 3414-3910 (Open MPI 2683), 64 MiB 17.9-19.8 ms against 19.4-21.7. Where the arena
/// streams (AMD EPYC, ranks apart) the slots won: 16 MiB 2.8 ms against 6.5 direct; near or
/// sharing a core's caches too (64 MiB 16.8 ms against 18.1; 13.8 against 16.7).
pub(in crate::backend::native) const DIRECT_ALL_REDUCE_MIN: usize = 2 << 20;

/// Whether an all_reduce of `bytes` of `T` takes two direct steps in `arena` (see
/// [`DIRECT_ALL_REDUCE_MIN`]).
pub(in crate::backend::native) fn direct_all_reduce_worth_it<T: Reducible>(
    arena: &Arena,
    bytes: usize,
) -> bool {
    // The size first: every arena all_reduce asks, and small ones end there.
    bytes >= DIRECT_ALL_REDUCE_MIN
        && !T::WIDENS
        && arena.direct()
        && !arena.oversubscribed()
        && arena.caches() == Caches::Apart
        && !arena.streams()
}

/// Whether a reduce of `bytes` of `T` on `n` ranks takes a direct step.
pub(super) fn direct_reduce_worth_it<T: Reducible>(arena: &Arena, n: usize, bytes: usize) -> bool {
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
        Coll::AllGather(..) | Coll::Scatter(..) | Coll::AllToAll(..) | Coll::Broadcast(..) => {
            NEAR_SPREAD_DIRECT_MIN
        }
        _ => NEAR_DIRECT_MIN,
    };
    let direct_min = direct_min(arena, (DIRECT_MIN, near));
    let crowded_min = if crowded && arena.streams() {
        OVERSUBSCRIBED_DIRECT_MIN
    } else if crowded {
        OVERSUBSCRIBED_PLAIN_DIRECT_MIN
    } else {
        direct_min
    };
    let (block, min) = match coll {
        Coll::Broadcast(buf, _) if !crowded && broadcast_direct_fits(arena, buf.len()) => {
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
