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

mod choice;

pub(super) use self::choice::*;
use super::arena::{Arena, Exchange, Published, Reads, Remote};
use super::collectives::{chose, Run};
use crate::backend::{typed, Coll};
use crate::call::{Call, CallKind};
use crate::commslog::count_sent;
use crate::copy::{copy, copy_bytes, copy_bytes_streaming_if};
use crate::error::Result;
use crate::reduce::{ReduceOp, Reducible};

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
    Pieces {
        at: 0,
        stop: len.max(1),
        len,
        piece,
    }
}

/// The iterator of [`pieces`] (plainer than `step_by`, whose set-up divides: a small call's
/// one piece costs a few instructions this way): starts `at`, `at + piece`, ... below `stop`
/// (at least 1, so that an empty part is one empty piece), each piece ending by `len`.
struct Pieces {
    at: usize,
    stop: usize,
    len: usize,
    piece: usize,
}

impl Iterator for Pieces {
    type Item = std::ops::Range<usize>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.stop {
            return None;
        }
        let a = self.at;
        self.at = a.saturating_add(self.piece);
        Some(a..self.at.min(self.len))
    }
}

/// Smallest piece of a part that moves in pieces.
const PIECE_MIN: usize = 64 << 10;

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
            if kind != CallKind::Gather {
                return arena.exchange_direct(s, all, input, &mut get);
            }
            // Nobody reads the root's part of a gather; its own block once the others are free.
            arena.exchange_direct(s, (Reads::All, Reads::Nobody), &[], &mut get)?;
            copy_bytes(&mut out[me * k..][..k], input);
            Ok(())
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
                // Our own block while the others read theirs.
                let own = &mut |_: &[Option<Remote>]| {
                    copy_bytes(out, &input[me * k..][..k]);
                    Ok(())
                };
                let reads = (Reads::Nobody, Reads::All);
                return arena.exchange_direct_all(s, reads, Published::of(input), own);
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

/// Copies `src` into (a block of) this rank's part of an exchange step of `arena` (of an
/// all_to_all: `all_to_all`): with non-temporal stores where [`stream_part`] says so.
fn put_part(arena: &Arena, dst: &mut [u8], src: &[u8], all_to_all: bool) {
    copy_bytes_streaming_if(stream_part(arena, src.len(), all_to_all), dst, src);
}

/// Elements of a piece of [`reduce_from`] on `n` ranks: 32-128 KiB per rank, 256 KiB of
/// scratch in all at most, so that it stays in the cache between the copies and the reduction
/// (128 KiB pieces on 2 ranks, measured with the direct-step all_reduce of earlier versions:
/// 16 MiB 4271-5522 µs against 4505-6466 in 32 KiB ones, alternating runs).
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

    /// all_reduce by two direct steps of `arena` (`s`: the call; see
    /// [`direct_all_reduce_worth_it`]): every rank reads its share (`chunks(len, n)[me]`) of
    /// every other rank's buffer across processes, piece by piece, and combines them in rank
    /// order into its own buffer; then reads every other rank's reduced share into its buffer.
    /// Two cross-memory copies of (n − 1)/n of the buffer and one pass of reduction per rank,
    /// against the slots' copy in, reduction and copy out of all of it. A rank only ever
    /// writes its own buffer, and only where no other rank reads in that step: its share in the
    /// first, the others' in the second (each step ends once every reader is done). Averages of
    /// other types than 16-bit floats: the caller divides.
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
            let share = (&mut *buf, mine.clone());
            reduce_from(parts, share, (&mut scratch, piece), (op, name))
        };
        let all = (Reads::All, Reads::All);
        let done = arena.exchange_direct_all(s, all, whole, &mut reduce_share);
        self.pool.give(scratch);
        done?;
        let mut gather_shares = |parts: &[Option<Remote>]| {
            for (r, part) in parts.iter().enumerate() {
                if let Some(part) = part {
                    let share = shares[r].clone();
                    let at = share.start * size;
                    part.read(name, at, bytemuck::cast_slice_mut(&mut buf[share]))?;
                }
            }
            Ok(())
        };
        arena.exchange_direct_all(s, all, whole, &mut gather_shares)
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
                        let mut put = |part: &mut [u8]| put_part(arena, part, buf, false);
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
                // Nobody reads the root's part of a gather: it puts none in.
                let gather_root = call.kind == CallKind::Gather;
                for c in pieces(k, arena.slot_bytes()) {
                    let len = c.len();
                    let mut get = |r: usize, part: &[u8]| {
                        if r != me {
                            copy_bytes(&mut out[r * k + c.start..r * k + c.end], part);
                        }
                        Ok(())
                    };
                    let mut put = |part: &mut [u8]| {
                        if !gather_root {
                            put_part(arena, part, &input[c.clone()], false);
                        }
                    };
                    let sizes = |r: usize| if gather_root && r == me { 0 } else { len };
                    arena.exchange(&s, Reads::All, &sizes, &mut put, &mut get)?;
                }
                if gather_root {
                    copy_bytes(&mut out[me * k..][..k], input);
                }
                Ok(())
            }
            Coll::Gather(input, None, _) => {
                count_sent(input.len());
                for c in pieces(input.len(), arena.slot_bytes()) {
                    let len = c.len();
                    let mut put = |part: &mut [u8]| put_part(arena, part, &input[c.clone()], false);
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
                        put_part(arena, part, input, false);
                    }
                };
                if me != root {
                    return arena.exchange(&s, Reads::Rank(root), &sizes, &mut put, &mut get);
                }
                arena.exchange(&s, Reads::Nobody, &sizes, &mut put, &mut get)?;
                // Our own block while the others copy theirs out.
                if let Some(input) = input {
                    copy_bytes(out, &input[me * k..][..k]);
                }
                Ok(())
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
                            let dst = &mut p[q * len..(q + 1) * len];
                            put_part(arena, dst, &input[block(q)], true);
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
        let mut put =
            |p: &mut [u8]| put_part(arena, p, bytemuck::cast_slice(io.borrow().input()), false);
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
