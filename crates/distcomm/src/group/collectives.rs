//! Collective operations: each blocking (on slices, run in the caller's thread) and async
//! (on owned buffers, run in issue order by the group's collective thread, returning a
//! [`Work`]). This layer checks arguments, numbers the call, puts this rank's own block in
//! place, and hands the call to the group's backend on type-erased buffers.
//!
//! Every message of a collective carries the call's fingerprint (kind, operator, root, count,
//! element type) and its sequence number as tag, so ranks that call different collectives, or
//! the same one differently, both get [`Error::Desync`] naming both calls instead of wrong data.
//!
//! Semantics worth knowing:
//! * `f16`/`bf16` reductions are carried out in `f32` and rounded once at the end;
//! * integer `Avg` is the wrapping sum divided by the group size, rounded toward zero;
//! * `reduce` leaves partial results in non-root buffers;
//! * dropping an async collective's handle lets it run to completion (withdrawing it would
//!   desynchronise the group).

use std::mem::size_of_val;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use smallvec::SmallVec;

use super::{Inner, Job, ProcessGroup, Turn};
use crate::backend::{Coll, CollCall};
use crate::call::{Call, CallKind};
use crate::commslog::sent_bytes;
use crate::completion::block;
use crate::copy::copy;
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Reducible};
use crate::work::{Deadline, Driver, OpCell, Work};

fn bytes<T: Reducible>(x: &[T]) -> &[u8] {
    bytemuck::cast_slice(x)
}

fn bytes_mut<T: Reducible>(x: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(x)
}

impl Inner {
    fn check_op<T: Reducible>(&self, op_name: &'static str, op: ReduceOp) -> Result<()> {
        if op.is_bitwise() && !T::INTEGER {
            return Err(self.invalid(
                op_name,
                format!("bitwise {} is not defined for {}", op.name(), T::DTYPE),
            ));
        }
        Ok(())
    }

    /// Runs collective `coll` of elements of `T` on the backend in its `turn`, and books it in
    /// the comms log (bytes sent: what the backend counted).
    pub(crate) fn run<T: Reducible>(&self, call: Call, turn: Turn, coll: Coll<'_>) -> Result<()> {
        let since = self.log.is_on().then(|| (Instant::now(), sent_bytes()));
        let c = CollCall {
            call,
            dtype: T::DTYPE,
            tag: turn.no(),
            turn,
            timeout: self.timeout,
        };
        let r = self.backend.collective(c, coll);
        if let (Ok(()), Some((started, sent)), false) = (&r, since, call.quiet) {
            let (took, sent) = (started.elapsed(), sent_bytes() - sent);
            self.log
                .record(call.kind.name(), call.bytes, self.size(), took, sent);
        }
        r
    }

    fn all_reduce_on<T: Reducible>(&self, turn: Turn, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let call = Call::new(CallKind::AllReduce, buf.len())
            .op(op)
            .bytes(size_of_val(buf));
        self.run::<T>(call, turn, Coll::AllReduce(bytes_mut(buf), op))
    }

    fn broadcast_on<T: Reducible>(&self, turn: Turn, buf: &mut [T], root: usize) -> Result<()> {
        let call = Call::new(CallKind::Broadcast, buf.len())
            .root(root)
            .bytes(size_of_val(buf));
        self.run::<T>(call, turn, Coll::Broadcast(bytes_mut(buf), root))
    }

    fn reduce_on<T: Reducible>(
        &self,
        turn: Turn,
        buf: &mut [T],
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let call = Call::new(CallKind::Reduce, buf.len())
            .op(op)
            .root(root)
            .bytes(size_of_val(buf));
        self.run::<T>(call, turn, Coll::Reduce(bytes_mut(buf), root, op))
    }

    fn all_gather_on<T: Reducible>(&self, turn: Turn, input: &[T], output: &mut [T]) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, input.len());
        if output.len() != n * k {
            return Err(self.invalid(
                "all_gather",
                format!("output holds {} elements, needs {n} x {k}", output.len()),
            ));
        }
        copy(&mut output[r * k..(r + 1) * k], input);
        let call = Call::new(CallKind::AllGather, k).bytes(size_of_val(output));
        self.run::<T>(call, turn, Coll::AllGather(bytes(input), bytes_mut(output)))
    }

    fn gather_on<T: Reducible>(
        &self,
        turn: Turn,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, input.len());
        let call = Call::new(CallKind::Gather, k)
            .root(root)
            .bytes(n * size_of_val(input));
        let out = match output {
            Some(out) if r == root => {
                if out.len() != n * k {
                    return Err(self.invalid(
                        "gather",
                        format!("output holds {} elements, needs {n} x {k}", out.len()),
                    ));
                }
                // The root's own block is the backend's to place (after the others').
                Some(bytes_mut(out))
            }
            None if r == root => {
                return Err(self.invalid("gather", "the root needs an output".into()))
            }
            _ => None,
        };
        self.run::<T>(call, turn, Coll::Gather(bytes(input), out, root))
    }

    fn scatter_on<T: Reducible>(
        &self,
        turn: Turn,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        let (n, r, k) = (self.size(), self.rank, output.len());
        let call = Call::new(CallKind::Scatter, k)
            .root(root)
            .bytes(n * size_of_val(output));
        if r != root {
            return self.run::<T>(call, turn, Coll::Scatter(None, bytes_mut(output), root));
        }
        let input =
            input.ok_or_else(|| self.invalid("scatter", "the root needs an input".into()))?;
        if input.len() != n * k {
            return Err(self.invalid(
                "scatter",
                format!("input holds {} elements, needs {n} x {k}", input.len()),
            ));
        }
        // The root's own block is the backend's to place: while the others copy theirs.
        let coll = Coll::Scatter(Some(bytes(input)), bytes_mut(output), root);
        self.run::<T>(call, turn, coll)
    }

    fn reduce_scatter_on<T: Reducible>(
        &self,
        turn: Turn,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, k) = (self.size(), output.len());
        if input.len() != n * k {
            return Err(self.invalid(
                "reduce_scatter",
                format!("input holds {} elements, needs {n} x {k}", input.len()),
            ));
        }
        let call = Call::new(CallKind::ReduceScatter, k)
            .op(op)
            .bytes(size_of_val(input));
        let coll = Coll::ReduceScatter(bytes(input), bytes_mut(output), op);
        self.run::<T>(call, turn, coll)
    }

    /// `send`/`recv`: the buffer and the element count per peer; `uneven` for the `_v` form.
    fn all_to_all_on<T: Reducible>(
        &self,
        turn: Turn,
        send: (&[T], &[usize]),
        recv: (&mut [T], &[usize]),
        uneven: bool,
    ) -> Result<()> {
        let ((input, send_counts), (output, recv_counts)) = (send, recv);
        let (n, r) = (self.size(), self.rank);
        // This rank's own range of a split, once the split is checked. No list of ranges, and
        // equal counts on the stack: their three allocations per call cost a small all_to_all
        // (world 2, 8 B, shared memory, 6 alternating pairs) 1/0.86 of its time.
        let own = |counts: &[usize], total: usize, what: &str| -> Result<std::ops::Range<usize>> {
            if counts.len() != n || counts.iter().sum::<usize>() != total {
                return Err(self.invalid(
                    "all_to_all",
                    format!("{what} counts {counts:?} must be {n} numbers summing to {total}"),
                ));
            }
            let start = counts[..r].iter().sum::<usize>();
            Ok(start..start + counts[r])
        };
        let sr = own(send_counts, input.len(), "send")?;
        let rr = own(recv_counts, output.len(), "receive")?;
        if sr.len() != rr.len() {
            return Err(self.invalid(
                "all_to_all",
                "this rank's own send and receive counts differ".into(),
            ));
        }
        copy(&mut output[rr], &input[sr]);
        // Uneven splits differ per rank, so only the equal form fingerprints its count.
        let call = Call::new(CallKind::AllToAll, if uneven { 0 } else { input.len() })
            .bytes(size_of_val(input));
        let coll = Coll::AllToAll(
            (bytes(input), send_counts),
            (bytes_mut(output), recv_counts),
        );
        self.run::<T>(call, turn, coll)
    }
}

/// Driver of async collective handles: the collective thread makes the progress; waiting
/// only sleeps.
struct Waiter {
    rank: usize,
}

impl Driver for Waiter {
    fn drive_until(&self, cell: &OpCell, deadline: &mut Deadline) -> bool {
        let deadline = deadline.get();
        loop {
            if block(cell, deadline) {
                return true;
            }
            if Instant::now() >= deadline {
                return cell.is_done();
            }
        }
    }
    fn cancel(&self, _op_id: u64) {}
    fn rank(&self) -> usize {
        self.rank
    }
}

impl ProcessGroup {
    /// Queues `f` on the group's collective thread and returns its handle.
    pub(crate) fn spawn<T: Reducible>(
        &self,
        op: &'static str,
        f: impl FnOnce(&Inner) -> Result<Vec<T>> + Send + 'static,
    ) -> Result<Work<Vec<T>>> {
        let cell = OpCell::fresh();
        let inner = self.inner.clone();
        let done = cell.clone();
        let job: Job = Box::new(move || {
            let rank = inner.rank;
            let result = f(&inner);
            // Release the group before anyone can see the result: the caller may then drop
            // its group and expect the engine to shut down (flushing replies) in its thread.
            drop(inner);
            match result {
                Ok(v) => done.complete(
                    Ok(crate::Status {
                        peer: rank,
                        tag: 0,
                        bytes: std::mem::size_of_val(v.as_slice()),
                    }),
                    Some(Box::new(v)),
                ),
                Err(e) => done.complete(Err(e), None),
            }
        });
        let mut slot = self.inner.worker.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("distcomm-coll-{}", self.rank()))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .map_err(|e| Error::io("spawn collective thread", e))?;
            *slot = Some(tx);
        }
        let sent = slot
            .as_ref()
            .map(|tx| tx.send(job).is_ok())
            .unwrap_or(false);
        if !sent {
            return Err(Error::Aborted {
                op,
                rank: self.rank(),
                reason: "collective thread is gone".into(),
            });
        }
        let driver: Arc<dyn Driver> = Arc::new(Waiter { rank: self.rank() });
        Ok(Work::new(cell, driver, 0, op, None, self.inner.timeout))
    }

    /// Reduces `buf` across the group in place; every rank ends with the result.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// # let group = distcomm::init()?;
    /// let mut grads = vec![1.0f32; 1024];
    /// group.all_reduce(&mut grads, distcomm::ReduceOp::Avg)?;
    /// # Ok(()) }
    /// ```
    pub fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.inner.check_op::<T>("all_reduce", op)?;
        let turn = self.inner.issue();
        self.inner.all_reduce_on(turn, buf, op)
    }

    /// Async [`all_reduce`](Self::all_reduce): the reduced buffer comes back from
    /// [`Work::into_buffer`].
    pub fn all_reduce_async<T: Reducible>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_op::<T>("all_reduce", op)?;
        let turn = self.inner.issue_shared();
        self.spawn("all_reduce", move |g| {
            g.all_reduce_on(turn, &mut buf, op)?;
            Ok(buf)
        })
    }

    /// Copies `buf` of rank `root` into `buf` of every rank.
    pub fn broadcast<T: Reducible>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.inner.check_rank("broadcast", root)?;
        let turn = self.inner.issue();
        self.inner.broadcast_on(turn, buf, root)
    }

    /// Async [`broadcast`](Self::broadcast).
    pub fn broadcast_async<T: Reducible>(
        &self,
        mut buf: Vec<T>,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_rank("broadcast", root)?;
        let turn = self.inner.issue_shared();
        self.spawn("broadcast", move |g| {
            g.broadcast_on(turn, &mut buf, root)?;
            Ok(buf)
        })
    }

    /// Reduces `buf` of every rank into `buf` of `root` (other ranks' buffers are left holding
    /// partial results).
    pub fn reduce<T: Reducible>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        self.inner.check_rank("reduce", root)?;
        self.inner.check_op::<T>("reduce", op)?;
        let turn = self.inner.issue();
        self.inner.reduce_on(turn, buf, root, op)
    }

    /// Async [`reduce`](Self::reduce).
    pub fn reduce_async<T: Reducible>(
        &self,
        mut buf: Vec<T>,
        root: usize,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_rank("reduce", root)?;
        self.inner.check_op::<T>("reduce", op)?;
        let turn = self.inner.issue_shared();
        self.spawn("reduce", move |g| {
            g.reduce_on(turn, &mut buf, root, op)?;
            Ok(buf)
        })
    }

    /// Gathers every rank's `input` into `output` (rank `i`'s block at `i * input.len()`).
    pub fn all_gather<T: Reducible>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let turn = self.inner.issue();
        self.inner.all_gather_on(turn, input, output)
    }

    /// [`all_gather`](Self::all_gather) into one buffer per rank.
    pub fn all_gather_list<T: Reducible>(&self, input: &[T]) -> Result<Vec<Vec<T>>> {
        let mut out = vec![T::zeroed(); input.len() * self.size()];
        self.all_gather(input, &mut out)?;
        Ok(split(&out, input.len(), self.size()))
    }

    /// Async [`all_gather`](Self::all_gather); the handle's buffer is the `n × len` output.
    pub fn all_gather_async<T: Reducible>(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        let turn = self.inner.issue_shared();
        self.spawn("all_gather", move |g| {
            let mut out = vec![T::zeroed(); input.len() * g.size()];
            g.all_gather_on(turn, &input, &mut out)?;
            Ok(out)
        })
    }

    /// Gathers every rank's `input` into `output` of `root` (`None` elsewhere).
    pub fn gather<T: Reducible>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.inner.check_rank("gather", root)?;
        let turn = self.inner.issue();
        self.inner.gather_on(turn, input, output, root)
    }

    /// Async [`gather`](Self::gather); the root's handle gives the `n × len` output, the
    /// others' an empty buffer.
    pub fn gather_async<T: Reducible>(&self, input: Vec<T>, root: usize) -> Result<Work<Vec<T>>> {
        self.inner.check_rank("gather", root)?;
        let turn = self.inner.issue_shared();
        self.spawn("gather", move |g| {
            if g.rank == root {
                let mut out = vec![T::zeroed(); input.len() * g.size()];
                g.gather_on(turn, &input, Some(&mut out), root)?;
                Ok(out)
            } else {
                g.gather_on(turn, &input, None, root)?;
                Ok(Vec::new())
            }
        })
    }

    /// Scatters block `i` of the root's `input` (`None` elsewhere) into `output` of rank `i`.
    pub fn scatter<T: Reducible>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.inner.check_rank("scatter", root)?;
        let turn = self.inner.issue();
        self.inner.scatter_on(turn, input, output, root)
    }

    /// Async [`scatter`](Self::scatter) of blocks of `block` elements (non-roots pass an empty
    /// input); the handle's buffer is this rank's block.
    pub fn scatter_async<T: Reducible>(
        &self,
        input: Vec<T>,
        block: usize,
        root: usize,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_rank("scatter", root)?;
        let turn = self.inner.issue_shared();
        self.spawn("scatter", move |g| {
            let mut out = vec![T::zeroed(); block];
            let inp = (g.rank == root).then_some(input.as_slice());
            g.scatter_on(turn, inp, &mut out, root)?;
            Ok(out)
        })
    }

    /// Reduces `input` (`n` blocks of `output.len()`) across ranks; rank `i` gets block `i`.
    pub fn reduce_scatter<T: Reducible>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.inner.check_op::<T>("reduce_scatter", op)?;
        let turn = self.inner.issue();
        self.inner.reduce_scatter_on(turn, input, output, op)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with one input buffer per destination rank.
    pub fn reduce_scatter_list<T: Reducible>(
        &self,
        inputs: &[Vec<T>],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if inputs.len() != self.size() || inputs.iter().any(|b| b.len() != output.len()) {
            return Err(self.inner.invalid(
                "reduce_scatter",
                format!("needs {} inputs of {} elements", self.size(), output.len()),
            ));
        }
        self.reduce_scatter(&inputs.concat(), output, op)
    }

    /// Async [`reduce_scatter`](Self::reduce_scatter); the handle's buffer is this rank's block.
    pub fn reduce_scatter_async<T: Reducible>(
        &self,
        input: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>> {
        self.inner.check_op::<T>("reduce_scatter", op)?;
        let n = self.size();
        if input.len() % n != 0 {
            return Err(self.inner.invalid(
                "reduce_scatter",
                format!(
                    "input of {} elements does not split into {n} blocks",
                    input.len()
                ),
            ));
        }
        let turn = self.inner.issue_shared();
        self.spawn("reduce_scatter", move |g| {
            let mut out = vec![T::zeroed(); input.len() / n];
            g.reduce_scatter_on(turn, &input, &mut out, op)?;
            Ok(out)
        })
    }

    /// Equal all-to-all: block `j` of `input` goes to rank `j`, arriving as block `i` (from rank
    /// `i`) of its `output`.
    pub fn all_to_all<T: Reducible>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let counts = self.equal_counts("all_to_all", input.len(), output.len())?;
        let turn = self.inner.issue();
        self.inner
            .all_to_all_on(turn, (input, &counts), (output, &counts), false)
    }

    /// All-to-all with uneven splits: `send_counts[j]` elements go to rank `j`,
    /// `recv_counts[i]` arrive from rank `i`.
    pub fn all_to_all_v<T: Reducible>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let turn = self.inner.issue();
        self.inner
            .all_to_all_on(turn, (input, send_counts), (output, recv_counts), true)
    }

    /// Async equal [`all_to_all`](Self::all_to_all); the handle's buffer is the output.
    pub fn all_to_all_async<T: Reducible>(&self, input: Vec<T>) -> Result<Work<Vec<T>>> {
        let counts = self.equal_counts("all_to_all", input.len(), input.len())?;
        let turn = self.inner.issue_shared();
        self.spawn("all_to_all", move |g| {
            let mut out = vec![T::zeroed(); input.len()];
            g.all_to_all_on(turn, (&input, &counts), (&mut out, &counts), false)?;
            Ok(out)
        })
    }

    /// The counts of an equal split of `inp` elements (on the stack up to 16 ranks).
    fn equal_counts(
        &self,
        op: &'static str,
        inp: usize,
        out: usize,
    ) -> Result<SmallVec<[usize; 16]>> {
        let n = self.size();
        if inp % n != 0 || inp != out {
            return Err(self.inner.invalid(
                op,
                format!("input {inp} and output {out} must be equal multiples of {n}"),
            ));
        }
        Ok(smallvec::smallvec![inp / n; n])
    }
}

fn split<T: Clone>(v: &[T], k: usize, n: usize) -> Vec<Vec<T>> {
    (0..n).map(|i| v[i * k..(i + 1) * k].to_vec()).collect()
}
