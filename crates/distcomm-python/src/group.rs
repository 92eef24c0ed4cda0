//! A distcomm process group as Python sees it: every torch.distributed operation on memory that
//! the Python layer describes as regions (address, bytes) of live tensors, which the operation
//! keeps alive until it ends.
//!
//! Point-to-point operations go to distcomm's engine at once (truly nonblocking). Collectives
//! run in issue order on the group's [`Queue`]: a synchronous one in the caller's thread (with
//! the GIL released) when nothing is queued before it, so a blocking `all_reduce` costs what it
//! costs in Rust. Reducing collectives run on the tensor's own element type; the others move
//! bytes, so they take every dtype.

use std::sync::Arc;
use std::time::Duration;

use distcomm::{DType, Error, Lent, ProcessGroup, ReduceOp, Reducible, Result, Status};
use half::{bf16, f16};
use pyo3::prelude::*;

use crate::errors::{invalid, to_py};
use crate::scratch::{Buf, Scratch};
use crate::store::PyStore;
use crate::work::{Job, Queue, State, Work};

/// `(address, bytes)` of a tensor's memory.
type Region = (usize, usize);

/// Element types of reducing collectives (`bool` reduces as bytes with logical operators).
#[derive(Clone, Copy, Debug)]
enum Dt {
    F32,
    F64,
    F16,
    Bf16,
    I8,
    U8,
    I16,
    I32,
    I64,
    Bool,
}

impl Dt {
    fn parse(s: &str) -> PyResult<Dt> {
        Ok(match s {
            "f32" => Dt::F32,
            "f64" => Dt::F64,
            "f16" => Dt::F16,
            "bf16" => Dt::Bf16,
            "i8" => Dt::I8,
            "u8" => Dt::U8,
            "i16" => Dt::I16,
            "i32" => Dt::I32,
            "i64" => Dt::I64,
            "bool" => Dt::Bool,
            other => return Err(invalid(format!("unknown element type {other:?}"))),
        })
    }

    /// The wire type of point-to-point messages (what a typed receive checks).
    fn wire(self) -> DType {
        match self {
            Dt::F32 => DType::F32,
            Dt::F64 => DType::F64,
            Dt::F16 => DType::F16,
            Dt::Bf16 => DType::BF16,
            Dt::I8 => DType::I8,
            Dt::U8 | Dt::Bool => DType::U8,
            Dt::I16 => DType::I16,
            Dt::I32 => DType::I32,
            Dt::I64 => DType::I64,
        }
    }
}

/// The operator, with `bool`'s logical meaning mapped onto bytes that hold 0 or 1.
fn reduce_op(dt: Dt, op: &str) -> PyResult<(Dt, ReduceOp)> {
    let op = match op {
        "sum" => ReduceOp::Sum,
        "product" => ReduceOp::Product,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "avg" => ReduceOp::Avg,
        "band" => ReduceOp::BAnd,
        "bor" => ReduceOp::BOr,
        "bxor" => ReduceOp::BXor,
        other => return Err(invalid(format!("unknown reduce operator {other:?}"))),
    };
    if let Dt::Bool = dt {
        let op = match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => ReduceOp::Max,
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => ReduceOp::Min,
            ReduceOp::BXor => ReduceOp::BXor,
            ReduceOp::Avg => return Err(invalid("ReduceOp.AVG is not defined for torch.bool")),
        };
        return Ok((Dt::U8, op));
    }
    Ok((dt, op))
}

/// Runs `$body` with `$T` the Rust type of `$dt`.
macro_rules! typed {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            Dt::F32 => {
                type $T = f32;
                $body
            }
            Dt::F64 => {
                type $T = f64;
                $body
            }
            Dt::F16 => {
                type $T = f16;
                $body
            }
            Dt::Bf16 => {
                type $T = bf16;
                $body
            }
            Dt::I8 => {
                type $T = i8;
                $body
            }
            Dt::U8 | Dt::Bool => {
                type $T = u8;
                $body
            }
            Dt::I16 => {
                type $T = i16;
                $body
            }
            Dt::I32 => {
                type $T = i32;
                $body
            }
            Dt::I64 => {
                type $T = i64;
                $body
            }
        }
    };
}

/// Which side of a list collective is the per-rank list.
#[derive(Clone, Copy)]
enum List {
    /// One input per rank, each the size of the single output (scatter, reduce_scatter).
    Inputs,
    /// One output per rank, each the size of the single input (all_gather, gather).
    Outputs,
}

/// Checks that `parts` holds `n` regions of `single`'s size, one per rank; else the error says
/// what `who` (e.g. `"all_gather"`, `"gather's root"`) needs.
fn one_per_rank(who: &str, n: usize, list: List, parts: &[Region], single: Region) -> PyResult<()> {
    if parts.len() == n && parts.iter().all(|p| p.1 == single.1) {
        return Ok(());
    }
    let (parts_name, single_name) = match list {
        List::Inputs => ("inputs", "output"),
        List::Outputs => ("outputs", "input"),
    };
    Err(invalid(format!(
        "{who} needs {n} {parts_name} of {} bytes each (the {single_name}'s size)",
        single.1
    )))
}

/// Memory regions of live tensors, held alive by `keep` for as long as this value lives.
struct Mem {
    _keep: Py<PyAny>,
}

/// A typed mutable view of a region.
///
/// # Safety
/// The region must belong to a tensor kept alive for the view's whole use, that nobody else
/// reads or writes meanwhile (torch's rule for tensors in flight), and that overlaps no other
/// view in use at the same time.
unsafe fn view<'a, T: Reducible>(op: &'static str, rank: usize, r: Region) -> Result<&'a mut [T]> {
    let size = std::mem::size_of::<T>();
    if r.1 == 0 {
        return Ok(&mut []);
    }
    if r.1 % size != 0 || r.0 % std::mem::align_of::<T>() != 0 || r.0 == 0 {
        return Err(Error::InvalidArgument {
            op,
            rank,
            detail: format!(
                "tensor memory at {:#x} ({} bytes) is not an aligned array of {size}-byte elements",
                r.0, r.1
            ),
        });
    }
    // SAFETY: non-null, aligned, `r.1` bytes of initialised tensor memory (any bit pattern is
    // a valid value of these plain types), exclusive by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(r.0 as *mut T, r.1 / size) })
}

fn overlaps(a: Region, b: Region) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Whether `parts` lie back to back in memory; the region they span.
fn contiguous(parts: &[Region]) -> Option<Region> {
    let first = parts.first()?;
    let mut end = first.0;
    for p in parts {
        if p.0 != end && p.1 > 0 {
            return None;
        }
        end = p.0 + p.1;
    }
    Some((first.0, end - first.0))
}

/// The bytes of `parts`, one after the other, in a scratch buffer.
///
/// # Safety
/// As [`view`], for reading.
unsafe fn concat<'s>(
    scratch: &'s Scratch,
    op: &'static str,
    rank: usize,
    parts: &[Region],
) -> Result<Buf<'s>> {
    let mut buf = scratch.get(parts.iter().map(|p| p.1).sum());
    let dst = buf.bytes();
    let mut at = 0;
    for &p in parts {
        // SAFETY: forwarded from the caller.
        dst[at..at + p.1].copy_from_slice(unsafe { view::<u8>(op, rank, p)? });
        at += p.1;
    }
    Ok(buf)
}

/// Copies `src` into `parts` in order.
///
/// # Safety
/// As [`view`].
unsafe fn spread(op: &'static str, rank: usize, src: &[u8], parts: &[Region]) -> Result<()> {
    let mut at = 0;
    for &p in parts {
        // SAFETY: forwarded from the caller.
        let dst = unsafe { view::<u8>(op, rank, p)? };
        dst.copy_from_slice(&src[at..at + p.1]);
        at += p.1;
    }
    Ok(())
}

/// A distcomm process group.
#[pyclass(module = "distcomm._distcomm", frozen)]
pub struct Group {
    pg: Arc<ProcessGroup>,
    queue: Arc<Queue>,
    scratch: Arc<Scratch>,
}

impl Group {
    fn wrap(pg: ProcessGroup, name: String) -> Group {
        let rank = pg.rank();
        Group {
            queue: Arc::new(Queue::new(name, rank)),
            pg: Arc::new(pg),
            scratch: Arc::default(),
        }
    }

    fn rank_(&self) -> usize {
        self.pg.rank()
    }

    /// Queues (or runs, see [`Queue::submit`]) a collective over the group.
    fn run(
        &self,
        py: Python<'_>,
        op: &'static str,
        sync: bool,
        keep: Py<PyAny>,
        f: impl FnOnce(&ProcessGroup, &Scratch) -> Result<()> + Send + 'static,
    ) -> PyResult<Option<Work>> {
        let pg = self.pg.clone();
        let scratch = self.scratch.clone();
        let mem = Mem { _keep: keep };
        let rank = pg.rank();
        let job: Job = Box::new(move || {
            let r = f(&pg, &scratch);
            drop(mem);
            r.map(|()| Status {
                peer: rank,
                tag: 0,
                bytes: 0,
            })
        });
        self.queue.submit(py, op, sync, self.pg.timeout(), job)
    }
}

#[pymethods]
impl Group {
    /// The world group: rendezvous through `store` (any torch store), connect the mesh.
    #[staticmethod]
    #[pyo3(signature = (store, rank, size, timeout, local_size=None))]
    fn world(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        size: usize,
        timeout: f64,
        local_size: Option<usize>,
    ) -> PyResult<Group> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(invalid(format!(
                "timeout {timeout} s is not a positive duration"
            )));
        }
        let t = Duration::from_secs_f64(timeout);
        let store = Arc::new(PyStore::new(store, t));
        let mut b = distcomm::GroupBuilder::new(rank, size)
            .store(store)
            .timeout(t);
        if let Some(n) = local_size {
            b = b.local_world(n);
        }
        let pg = py.detach(|| b.build()).map_err(|e| to_py(py, &e))?;
        Ok(Group::wrap(pg, format!("world-{rank}")))
    }

    /// A subgroup of group ranks `ranks`, made by its members alone (see
    /// `ProcessGroup::subgroup`).
    fn subgroup(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<Group> {
        let pg = py
            .detach(|| self.pg.subgroup(&ranks))
            .map_err(|e| to_py(py, &e))?;
        let name = format!("group-{}", pg.rank());
        Ok(Group::wrap(pg, name))
    }

    fn rank(&self) -> usize {
        self.pg.rank()
    }

    fn size(&self) -> usize {
        self.pg.size()
    }

    /// Global (world) rank of group rank `r`.
    fn global_rank(&self, r: usize) -> Option<usize> {
        self.pg.global_rank(r)
    }

    /// `"shm"`, `"tcp"`, `"shm+tcp"` or `"self"`.
    fn transport(&self) -> &'static str {
        self.pg.transport()
    }

    /// Whether all_reduce runs through the shared-memory arena.
    fn intranode_all_reduce(&self) -> bool {
        self.pg.intranode_all_reduce()
    }

    /// Default deadline, seconds.
    fn timeout(&self) -> f64 {
        self.pg.timeout().as_secs_f64()
    }

    /// Starts sending `region` (of `tensor`, kept alive until the send ends) to `dst`.
    fn isend(
        &self,
        py: Python<'_>,
        tensor: Py<PyAny>,
        region: Region,
        dtype: &str,
        dst: usize,
        tag: u32,
    ) -> PyResult<Work> {
        let dt = Dt::parse(dtype)?.wire();
        let lent = lend(tensor, region);
        let w = self
            .pg
            .isend_lent(lent, dt, dst, tag)
            .map_err(|e| to_py(py, &e))?;
        Ok(Work::new(
            "send",
            self.rank_(),
            State::P2p(w),
            self.pg.timeout(),
        ))
    }

    /// Starts receiving into `region` of `tensor` from `src` (None: any source). `dtype`
    /// `"bytes"` accepts any element type.
    #[pyo3(signature = (tensor, region, dtype, src, tag))]
    fn irecv(
        &self,
        py: Python<'_>,
        tensor: Py<PyAny>,
        region: Region,
        dtype: &str,
        src: Option<usize>,
        tag: u32,
    ) -> PyResult<Work> {
        let dt = match dtype {
            "bytes" => DType::Bytes,
            d => Dt::parse(d)?.wire(),
        };
        let lent = lend(tensor, region);
        let w = self
            .pg
            .irecv_lent(lent, dt, src, tag)
            .map_err(|e| to_py(py, &e))?;
        Ok(Work::new(
            "recv",
            self.rank_(),
            State::P2p(w),
            self.pg.timeout(),
        ))
    }

    /// all_reduce of every region in place (several: coalesced into one call).
    fn all_reduce(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        regions: Vec<Region>,
        dtype: &str,
        op: &str,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        let (dt, op) = reduce_op(Dt::parse(dtype)?, op)?;
        let name = "all_reduce";
        self.run(py, name, sync, keep, move |g, scratch| {
            let me = g.rank();
            typed!(dt, T => {
                if let [one] = regions.as_slice() {
                    // SAFETY: a live tensor's memory (kept by the job), ours alone while in flight.
                    return g.all_reduce(unsafe { view::<T>(name, me, *one)? }, op);
                }
                // SAFETY: as above; the regions are read, then written, one at a time.
                let mut flat = unsafe { concat(scratch, name, me, &regions)? };
                g.all_reduce(flat.typed::<T>(), op)?;
                // SAFETY: as above.
                unsafe { spread(name, me, flat.bytes(), &regions) }
            })
        })
    }

    /// broadcast of `region` from group rank `root`.
    fn broadcast(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        region: Region,
        root: usize,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        self.run(py, "broadcast", sync, keep, move |g, _| {
            // SAFETY: a live tensor's memory (kept by the job), ours alone while in flight.
            let buf = unsafe { view::<u8>("broadcast", g.rank(), region)? };
            g.broadcast(buf, root)
        })
    }

    /// reduce of `region` into group rank `root`.
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        region: Region,
        dtype: &str,
        op: &str,
        root: usize,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        let (dt, op) = reduce_op(Dt::parse(dtype)?, op)?;
        self.run(py, "reduce", sync, keep, move |g, scratch| {
            typed!(dt, T => {
                // SAFETY: a live tensor's memory (kept by the job), ours alone while in flight.
                let buf = unsafe { view::<T>("reduce", g.rank(), region)? };
                if g.rank() == root {
                    return g.reduce(buf, root, op);
                }
                // torch leaves non-root tensors as they were; distcomm leaves partial sums.
                let mut copy = scratch.get(region.1);
                let copy = copy.typed::<T>();
                copy.copy_from_slice(buf);
                g.reduce(copy, root, op)
            })
        })
    }

    /// all_gather of `input` into `outputs` (one region per rank, in rank order).
    fn all_gather(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        input: Region,
        outputs: Vec<Region>,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        let n = self.pg.size();
        one_per_rank("all_gather", n, List::Outputs, &outputs, input)?;
        self.run(py, "all_gather", sync, keep, move |g, scratch| {
            let me = g.rank();
            let op = "all_gather";
            // SAFETY (every view and copy below): live tensors kept by the job, ours alone
            // while in flight; an input that overlaps an output is copied first.
            let mut inp = unsafe { owned_if_overlapping(scratch, op, me, input, &outputs)? };
            let inp_ref: &[u8] = match &mut inp {
                Some(v) => v.bytes(),
                None => unsafe { view::<u8>(op, me, input)? },
            };
            match contiguous(&outputs) {
                Some(all) => g.all_gather(inp_ref, unsafe { view::<u8>(op, me, all)? }),
                None => {
                    let mut flat = scratch.get(input.1 * n);
                    g.all_gather(inp_ref, flat.bytes())?;
                    unsafe { spread(op, me, flat.bytes(), &outputs) }
                }
            }
        })
    }

    /// gather of `input` into `outputs` of group rank `root` (empty elsewhere).
    fn gather(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        input: Region,
        outputs: Vec<Region>,
        root: usize,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        let n = self.pg.size();
        let me = self.pg.rank();
        if me == root {
            one_per_rank("gather's root", n, List::Outputs, &outputs, input)?;
        }
        self.run(py, "gather", sync, keep, move |g, scratch| {
            let op = "gather";
            // SAFETY (every view and copy below): live tensors kept by the job, ours alone
            // while in flight; an input that overlaps an output is copied first.
            let mut inp = unsafe { owned_if_overlapping(scratch, op, me, input, &outputs)? };
            let inp_ref: &[u8] = match &mut inp {
                Some(v) => v.bytes(),
                None => unsafe { view::<u8>(op, me, input)? },
            };
            if me != root {
                return g.gather(inp_ref, None, root);
            }
            match contiguous(&outputs) {
                Some(all) => g.gather(inp_ref, Some(unsafe { view::<u8>(op, me, all)? }), root),
                None => {
                    let mut flat = scratch.get(input.1 * n);
                    g.gather(inp_ref, Some(flat.bytes()), root)?;
                    unsafe { spread(op, me, flat.bytes(), &outputs) }
                }
            }
        })
    }

    /// scatter of `inputs` (group rank `root`; empty elsewhere) into `output`.
    fn scatter(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        inputs: Vec<Region>,
        output: Region,
        root: usize,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        let n = self.pg.size();
        let me = self.pg.rank();
        if me == root {
            one_per_rank("scatter's root", n, List::Inputs, &inputs, output)?;
        }
        self.run(py, "scatter", sync, keep, move |g, scratch| {
            let op = "scatter";
            // SAFETY (every view and copy below): live tensors kept by the job, ours alone
            // while in flight; inputs are copied when they are not one block or overlap the
            // output.
            let out = unsafe { view::<u8>(op, me, output)? };
            if me != root {
                return g.scatter(None, out, root);
            }
            match contiguous(&inputs).filter(|all| !overlaps(*all, output)) {
                Some(all) => g.scatter(Some(unsafe { view::<u8>(op, me, all)? }), out, root),
                None => {
                    let mut flat = unsafe { concat(scratch, op, me, &inputs)? };
                    g.scatter(Some(flat.bytes()), out, root)
                }
            }
        })
    }

    /// reduce_scatter of `inputs` (one region per rank) into `output`.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        inputs: Vec<Region>,
        output: Region,
        dtype: &str,
        op: &str,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        let n = self.pg.size();
        one_per_rank("reduce_scatter", n, List::Inputs, &inputs, output)?;
        let (dt, op) = reduce_op(Dt::parse(dtype)?, op)?;
        self.run(py, "reduce_scatter", sync, keep, move |g, scratch| {
            let me = g.rank();
            let name = "reduce_scatter";
            typed!(dt, T => {
                // SAFETY (every view and copy below): live tensors kept by the job, ours
                // alone while in flight; inputs are copied when they are not one block or
                // overlap the output.
                let out = unsafe { view::<T>(name, me, output)? };
                match contiguous(&inputs).filter(|all| !overlaps(*all, output)) {
                    Some(all) => g.reduce_scatter(unsafe { view::<T>(name, me, all)? }, out, op),
                    None => {
                        let mut flat = unsafe { concat(scratch, name, me, &inputs)? };
                        g.reduce_scatter(flat.typed::<T>(), out, op)
                    }
                }
            })
        })
    }

    /// all_to_all: `inputs[j]` goes to rank `j`, `outputs[i]` comes from rank `i` (any sizes
    /// that the ranks agree on).
    fn all_to_all(
        &self,
        py: Python<'_>,
        keep: Py<PyAny>,
        inputs: Vec<Region>,
        outputs: Vec<Region>,
        sync: bool,
    ) -> PyResult<Option<Work>> {
        let n = self.pg.size();
        if inputs.len() != n || outputs.len() != n {
            return Err(invalid(format!(
                "all_to_all needs {n} inputs and {n} outputs, got {} and {}",
                inputs.len(),
                outputs.len()
            )));
        }
        self.run(py, "all_to_all", sync, keep, move |g, scratch| {
            let me = g.rank();
            let op = "all_to_all";
            let send: Vec<usize> = inputs.iter().map(|r| r.1).collect();
            let recv: Vec<usize> = outputs.iter().map(|r| r.1).collect();
            let even = send.iter().chain(&recv).all(|&c| c == send[0]);
            // SAFETY (every view and copy below): live tensors kept by the job, ours alone
            // while in flight; inputs are copied when they are not one block or overlap an
            // output.
            let out_all = contiguous(&outputs);
            let inp_all =
                contiguous(&inputs).filter(|all| outputs.iter().all(|o| !overlaps(*all, *o)));
            let mut owned;
            let inp: &[u8] = match inp_all {
                Some(all) => unsafe { view::<u8>(op, me, all)? },
                None => {
                    owned = unsafe { concat(scratch, op, me, &inputs)? };
                    owned.bytes()
                }
            };
            let mut flat = None;
            let out: &mut [u8] = match out_all {
                Some(all) => unsafe { view::<u8>(op, me, all)? },
                None => flat.insert(scratch.get(recv.iter().sum())).bytes(),
            };
            if even {
                g.all_to_all(inp, out)?;
            } else {
                g.all_to_all_v(inp, &send, out, &recv)?;
            }
            if let Some(mut flat) = flat {
                unsafe { spread(op, me, flat.bytes(), &outputs)? };
            }
            Ok(())
        })
    }

    /// barrier over the group.
    fn barrier(&self, py: Python<'_>, sync: bool) -> PyResult<Option<Work>> {
        let keep = py.None();
        self.run(py, "barrier", sync, keep, |g, _| g.barrier())
    }

    /// A barrier whose root (rank 0) names the ranks that did not arrive within `timeout`
    /// seconds (all of them with `wait_all`, else the first).
    fn monitored_barrier(&self, py: Python<'_>, timeout: f64, wait_all: bool) -> PyResult<()> {
        let t = Duration::from_secs_f64(timeout.max(0.001));
        py.detach(|| monitored_barrier(&self.pg, t, wait_all))
            .map_err(|e| to_py(py, &e))
    }

    /// Fails every pending operation of this process (all groups).
    fn abort(&self) {
        self.pg.abort();
    }
}

/// The tag monitored barriers use (the top of the user tag space).
const MONITOR_TAG: u32 = distcomm::MAX_TAG;

fn monitored_barrier(g: &ProcessGroup, t: Duration, wait_all: bool) -> Result<()> {
    let me = g.rank();
    let n = g.size();
    let op = "monitored_barrier";
    if me != 0 {
        g.send_timeout::<u8>(&[], 0, MONITOR_TAG, t)?;
        let mut ok = [0u8; 1];
        g.recv_timeout(&mut ok, 0, MONITOR_TAG, t + t)?;
        if ok[0] == 1 {
            return Ok(());
        }
        return Err(Error::Aborted {
            op,
            rank: me,
            reason: "rank 0 reported ranks that did not reach the barrier".into(),
        });
    }
    let mut missing = Vec::new();
    let mut pending: Vec<_> = Vec::new();
    for r in 1..n {
        pending.push((r, g.irecv_bytes(Vec::new(), r, MONITOR_TAG)?));
    }
    let deadline = std::time::Instant::now() + t;
    for (r, w) in &mut pending {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if w.wait_timeout(left.max(Duration::from_millis(1))).is_err() {
            missing.push(*r);
            if !wait_all {
                break;
            }
        }
    }
    let verdict = [u8::from(missing.is_empty())];
    for r in 1..n {
        if !missing.contains(&r) {
            // A rank that is late gets the verdict when it arrives, if it still listens.
            let _ = g
                .isend(verdict.to_vec(), r, MONITOR_TAG)
                .map(|w| w.detach());
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Aborted {
        op,
        rank: me,
        reason: format!(
            "rank(s) {missing:?} did not reach the barrier within {t:?}{}",
            if wait_all { "" } else { " (the first found)" }
        ),
    })
}

fn lend(tensor: Py<PyAny>, region: Region) -> Lent {
    // SAFETY: the region is the memory of `tensor`, which the Lent keeps alive (its owner) for
    // as long as the operation holds it; torch's rule for tensors in flight (not touched until
    // the operation's wait) makes the operation its only user meanwhile. An empty region is
    // never dereferenced.
    unsafe { Lent::new(region.0 as *mut u8, region.1, Box::new(tensor)) }
}

/// An input that overlaps one of `outputs` (torch's in-place all_gather: the input is the
/// rank's own chunk of the output), copied so the two are never aliased.
///
/// # Safety
/// As [`view`], for reading `input`.
unsafe fn owned_if_overlapping<'s>(
    scratch: &'s Scratch,
    op: &'static str,
    rank: usize,
    input: Region,
    outputs: &[Region],
) -> Result<Option<Buf<'s>>> {
    if outputs.iter().any(|o| overlaps(input, *o)) {
        // SAFETY: forwarded from the caller.
        return Ok(Some(unsafe { concat(scratch, op, rank, &[input])? }));
    }
    Ok(None)
}
