"""distcomm as a torch.distributed backend.

``import distcomm.torch`` (or nothing at all: torch loads the package's entry point) makes
``torch.distributed.init_process_group("distcomm")`` and
``deepspeed.init_distributed(dist_backend="distcomm")`` run on distcomm::

    import torch.distributed as dist
    dist.init_process_group("distcomm")          # torchrun / env://, tcp://, file://
    t = torch.ones(4)
    dist.all_reduce(t)                           # blocking: runs in this thread, GIL released
    w = dist.all_reduce(t, async_op=True)        # queued on the group's own thread
    w.wait()

Semantics worth knowing:

* Rendezvous goes through the store torch hands over (no extra port). Subgroups
  (``new_group``) are built by their members alone over the world's connections.
* Tensors must be contiguous (a non-contiguous one is a ``ValueError``, as with gloo): the
  operation works on the tensor's own memory, zero-copy, and keeps the tensor alive until it
  ends, even when the caller drops the ``Work`` unwaited. Do not touch a tensor that is in
  flight before its ``wait()``.
* Reducing collectives take float32/64/16, bfloat16, int8/16/32/64, uint8 and bool (logical
  operators); the other collectives move any dtype as bytes. ``PREMUL_SUM`` multiplies by its
  factor, then sums. An operator a dtype cannot do (bitwise on floats, AVG on bool) raises
  ``ValueError`` before anything moves.
* Tensors on devices the transports cannot address (cuda, mps, xpu, ...) are staged through
  CPU memory: inputs are copied to the host once when the operation is posted, outputs are
  copied back once, only after the operation succeeded, in ``wait()`` / ``is_completed()``.
* Errors: a lost peer, a timeout, a desync or an abort raises
  ``torch.distributed.DistBackendError`` whose message names the operation, the local rank and
  the peer; bad arguments raise ``ValueError``, a dtype a peer did not send ``TypeError``.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as _ProcessGroup
from torch._C._distributed_c10d import Work as _TorchWork

from . import _distcomm

__all__ = ["register", "ProcessGroupDistcomm", "DistcommWork", "world_group"]

_distcomm.set_backend_error(dist.DistBackendError)

_REDUCE_DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "bool",
}

_R = dist.ReduceOp.RedOpType
_OPS = {
    _R.SUM: "sum",
    _R.PRODUCT: "product",
    _R.MIN: "min",
    _R.MAX: "max",
    _R.AVG: "avg",
    _R.BAND: "band",
    _R.BOR: "bor",
    _R.BXOR: "bxor",
    _R.PREMUL_SUM: "sum",
}

# Operators without a factor, keyed by torch's ReduceOp objects (they hash and compare by
# their type), for the fast path.
_FAST_OPS = {dist.ReduceOp(o): n for o, n in _OPS.items() if o != _R.PREMUL_SUM}

_CPU = torch.device("cpu")


class _Devices(list):
    """The devices of a distcomm group as torch asks for them: it holds CPU (monitored_barrier
    and the object collectives check for it), yet is false, because torch 2.15 reads a true
    ``_device_types`` as "a C++ backend is registered" and then attaches its flight recorder,
    which needs one. A group returned by a backend creator (what this is) has none."""

    def __bool__(self):
        return False


_DEVICES = _Devices([_CPU])

# The world group of this process (subgroups are built over it), and the backend objects that
# are still open.
_world = None
_lock = threading.Lock()


def world_group():
    """The distcomm world group of this process (``distcomm.Group``), or None."""
    return _world


class _Stage:
    """Device tensors of one operation and their host copies (design contract 5)."""

    __slots__ = ("pairs", "done", "lock")

    def __init__(self):
        self.pairs = []
        self.done = False
        # Publishers (wait / is_completed, the future's thread) take turns: none returns
        # before the copies back are made, and they are made once.
        self.lock = threading.Lock()

    def host(self, t, read, write):
        if t.device.type == "cpu":
            return t
        h = t.detach().to(_CPU, copy=True) if read else torch.empty(t.shape, dtype=t.dtype)
        if h.data_ptr() == t.data_ptr() and t.numel() > 0:
            raise ValueError(f"distcomm: copying a {t.device} tensor to the host aliased it")
        if write:
            self.pairs.append((t, h))
        return h

    def publish(self):
        with self.lock:
            if not self.done:
                self.done = True
                for dev, h in self.pairs:
                    dev.copy_(h)


def _check(t, what="tensor"):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"distcomm: {what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"distcomm: {what} must be contiguous (shape {tuple(t.shape)}, strides "
            f"{t.stride()}); pass t.contiguous()"
        )
    return t


def _region(t):
    return (t.data_ptr(), t.nbytes)


def _rdtype(t, op):
    d = _REDUCE_DTYPES.get(t.dtype)
    if d is None:
        raise TypeError(f"distcomm: {op} cannot reduce {t.dtype} tensors")
    return d


def _op(reduce_op):
    o = getattr(reduce_op, "op", reduce_op)
    name = _OPS.get(o)
    if name is None:
        raise ValueError(f"distcomm: unsupported reduce operator {reduce_op}")
    return name


def _premul(reduce_op, t, in_place):
    """For PREMUL_SUM: `t` times the factor (in place, or a new tensor)."""
    if getattr(reduce_op, "op", None) != _R.PREMUL_SUM:
        return t
    f = reduce_op.factor if hasattr(reduce_op, "factor") else None
    if f is None:
        raise ValueError("distcomm: PREMUL_SUM needs a factor (dist._make_nccl_premul_sum)")
    return t.mul_(f) if in_place else t * f


def _seconds(timeout):
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return s if s > 0 else None


def _future_of(work, done):
    """A torch Future completed with `work`'s result when it ends (at once if `done`, else
    from a thread that waits for it), or with its exception."""
    fut = torch.futures.Future()

    def settle():
        try:
            work.wait()
            fut.set_result(work.result())
        except Exception as e:  # noqa: BLE001 - handed to the future's waiter
            fut.set_exception(e)

    if done:
        settle()
    else:
        threading.Thread(target=settle, name="distcomm-future", daemon=True).start()
    return fut


class DistcommWork(_TorchWork):
    """torch's ``Work`` over a distcomm operation: ``wait(timeout)`` (a timeout raises and
    leaves it pending), ``is_completed()`` that never blocks, ``exception()``,
    ``get_future()``, ``_source_rank()`` of a receive from any source. Terminal state is sticky
    and staged outputs are published exactly once."""

    def __init__(self, work, result=None, stage=None):
        super().__init__()
        self._w = work
        self._result = result if result is not None else []
        self._stage = stage
        self._future = None

    def wait(self, timeout=None):
        self._w.wait(_seconds(timeout))
        if self._stage is not None:
            self._stage.publish()
        return True

    def is_completed(self):
        if not self._w.is_completed():
            return False
        if self._stage is not None and self._w.is_success():
            self._stage.publish()
        return True

    def is_success(self):
        return self.is_completed() and self._w.is_success()

    def exception(self):
        return self._w.exception()

    def source_rank(self):
        r = self._w.source_rank()
        if r is None:
            raise RuntimeError("distcomm: the receive has not completed")
        return r

    _source_rank = source_rank

    def result(self):
        return self._result

    def synchronize(self):
        pass

    def get_future(self):
        if self._future is not None:
            return self._future
        self._future = _future_of(self, self._w.is_completed())
        return self._future

    def __repr__(self):
        return f"DistcommWork({self._w!r})"


class _DoneWork(_TorchWork):
    """The handle of a synchronous call, which returns only once it is done (or raised)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return []

    def synchronize(self):
        pass

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result([])
        return fut


_DONE = _DoneWork()


def _work(w, result=None, stage=None):
    """torch's handle for the Rust call's outcome (`None`: a synchronous call that is done)."""
    if stage is not None and not stage.pairs:
        stage = None
    if w is None:
        if stage is not None:
            stage.publish()
        return _DONE
    return DistcommWork(w, result, stage)


class ProcessGroupDistcomm(_ProcessGroup):
    """A torch process group whose every operation runs on a distcomm group."""

    def __init__(self, group, rank, size):
        super().__init__(rank, size)
        self._g = group
        self._name = ""
        self._desc = ""

    # torch names a group through its C++ backend, which a group returned by a backend
    # creator does not have: keep the names here.
    def _set_group_name(self, name):
        self._name = name

    def _set_group_desc(self, desc):
        self._desc = desc

    @property
    def group_name(self):
        return self._name

    @property
    def group_desc(self):
        return self._desc

    # --- identity -------------------------------------------------------------------------

    def getBackendName(self):
        return "distcomm"

    def name(self):
        return "distcomm"

    @property
    def _device_types(self):
        return _DEVICES

    def _get_backend(self, device):
        return self

    get_backend = _get_backend

    supports_coalescing = False

    @property
    def distcomm_group(self):
        """The underlying ``distcomm.Group``."""
        return self._g

    def __repr__(self):
        return (
            f"ProcessGroupDistcomm(rank={self._g.rank()}, size={self._g.size()}, "
            f"transport={self._g.transport()})"
        )

    # --- point-to-point ---------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        (t,) = tensors
        if not t.is_cpu:
            t = _Stage().host(t, read=True, write=False)
        _check(t)
        return DistcommWork(self._g.isend(t, (t.data_ptr(), t.nbytes), _REDUCE_DTYPES.get(t.dtype, "u8"), dst, tag))

    def recv(self, tensors, src, tag):
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._recv(tensors, None, tag)

    def _recv(self, tensors, src, tag):
        (t,) = tensors
        _check(t)
        if t.is_cpu:
            d = _REDUCE_DTYPES.get(t.dtype, "bytes")
            return DistcommWork(self._g.irecv(t, (t.data_ptr(), t.nbytes), d, src, tag), tensors)
        st = _Stage()
        h = st.host(t, read=False, write=True)
        d = _REDUCE_DTYPES.get(h.dtype, "bytes")
        return _work(self._g.irecv(h, _region(h), d, src, tag), [t], st)

    # --- collectives ----------------------------------------------------------------------

    def allreduce(self, tensors, opts):
        # The path of every blocking all_reduce of one CPU tensor: as little Python as it takes.
        if len(tensors) == 1:
            t = tensors[0]
            op = _FAST_OPS.get(opts.reduceOp)
            if op is not None and t.is_cpu and t.is_contiguous():
                d = _REDUCE_DTYPES.get(t.dtype) or _rdtype(t, "all_reduce")
                w = self._g.all_reduce(tensors, [(t.data_ptr(), t.nbytes)], d, op, not opts.asyncOp)
                return _DONE if w is None else DistcommWork(w, tensors)
        return self._allreduce_many(tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        return self._allreduce_many(tensors, opts)

    def _allreduce_many(self, tensors, opts):
        if not tensors:
            raise ValueError("distcomm: all_reduce needs at least one tensor")
        st = _Stage()
        hs = [st.host(_check(t), read=True, write=True) for t in tensors]
        d = {h.dtype for h in hs}
        if len(d) != 1:
            raise TypeError(f"distcomm: coalesced all_reduce needs one dtype, got {sorted(map(str, d))}")
        for h in hs:
            _premul(opts.reduceOp, h, True)
        w = self._g.all_reduce(
            hs, [_region(h) for h in hs], _rdtype(hs[0], "all_reduce"), _op(opts.reduceOp),
            not opts.asyncOp,
        )
        return _work(w, list(tensors), st)

    def broadcast(self, tensors, opts):
        (t,) = tensors
        st = _Stage()
        h = st.host(_check(t), read=True, write=True)
        w = self._g.broadcast(h, _region(h), opts.rootRank, not opts.asyncOp)
        return _work(w, [t], st)

    def reduce(self, tensors, opts):
        (t,) = tensors
        st = _Stage()
        h = st.host(_check(t), read=True, write=True)
        _premul(opts.reduceOp, h, True)
        w = self._g.reduce(
            h, _region(h), _rdtype(h, "reduce"), _op(opts.reduceOp), opts.rootRank,
            not opts.asyncOp,
        )
        return _work(w, [t], st)

    def allgather(self, output_tensors, input_tensors, opts):
        (outs,) = output_tensors
        (inp,) = input_tensors
        return self._all_gather(list(outs), inp, opts, result=[list(outs)])

    def all_gather_single(self, output, input, opts):
        return self._all_gather([output], input, opts, result=[output], split=True)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        works = [self._all_gather([o], i, opts, result=[o], split=True) for o, i in zip(outputs, inputs)]
        return _Many(works, list(outputs))

    def _all_gather(self, outs, inp, opts, result, split=False):
        st = _Stage()
        hi = st.host(_check(inp, "input"), read=True, write=False)
        ho = [st.host(_check(o, "output"), read=False, write=True) for o in outs]
        if split:
            regions = _split(ho[0], self._g.size(), hi.nbytes, "all_gather_into_tensor")
        else:
            regions = [_region(o) for o in ho]
        w = self._g.all_gather((hi, ho), _region(hi), regions, not opts.asyncOp)
        return _work(w, result, st)

    def gather(self, output_tensors, input_tensors, opts):
        (inp,) = input_tensors
        outs = list(output_tensors[0]) if output_tensors else []
        st = _Stage()
        hi = st.host(_check(inp, "input"), read=True, write=False)
        ho = [st.host(_check(o, "output"), read=False, write=True) for o in outs]
        w = self._g.gather((hi, ho), _region(hi), [_region(o) for o in ho], opts.rootRank, not opts.asyncOp)
        return _work(w, [outs], st)

    def scatter(self, output_tensors, input_tensors, opts):
        (out,) = output_tensors
        ins = list(input_tensors[0]) if input_tensors else []
        st = _Stage()
        ho = st.host(_check(out, "output"), read=False, write=True)
        hi = [st.host(_check(i, "input"), read=True, write=False) for i in ins]
        w = self._g.scatter((hi, ho), [_region(i) for i in hi], _region(ho), opts.rootRank, not opts.asyncOp)
        return _work(w, [out], st)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        (out,) = output_tensors
        (ins,) = input_tensors
        st = _Stage()
        ho = st.host(_check(out, "output"), read=False, write=True)
        hi = [_premul(opts.reduceOp, st.host(_check(i, "input"), read=True, write=False), False) for i in ins]
        w = self._g.reduce_scatter(
            (hi, ho), [_region(i) for i in hi], _region(ho), _rdtype(ho, "reduce_scatter"),
            _op(opts.reduceOp), not opts.asyncOp,
        )
        return _work(w, [out], st)

    def reduce_scatter_single(self, output, input, opts):
        st = _Stage()
        ho = st.host(_check(output, "output"), read=False, write=True)
        hi = _premul(opts.reduceOp, st.host(_check(input, "input"), read=True, write=False), False)
        regions = _split(hi, self._g.size(), ho.nbytes, "reduce_scatter_tensor")
        w = self._g.reduce_scatter(
            (hi, ho), regions, _region(ho), _rdtype(ho, "reduce_scatter_tensor"),
            _op(opts.reduceOp), not opts.asyncOp,
        )
        return _work(w, [output], st)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Many(works, list(outputs))

    def alltoall(self, output_tensors, input_tensors, opts):
        st = _Stage()
        ho = [st.host(_check(o, "output"), read=False, write=True) for o in output_tensors]
        hi = [st.host(_check(i, "input"), read=True, write=False) for i in input_tensors]
        w = self._g.all_to_all((hi, ho), [_region(i) for i in hi], [_region(o) for o in ho], not opts.asyncOp)
        return _work(w, list(output_tensors), st)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        st = _Stage()
        ho = st.host(_check(output, "output"), read=False, write=True)
        hi = st.host(_check(input, "input"), read=True, write=False)
        n = self._g.size()
        outs = _split_rows(ho, n, output_split_sizes, "output")
        ins = _split_rows(hi, n, input_split_sizes, "input")
        w = self._g.all_to_all((hi, ho), ins, outs, not opts.asyncOp)
        return _work(w, [output], st)

    def barrier(self, opts=None):
        sync = not getattr(opts, "asyncOp", False) if opts is not None else True
        return _work(self._g.barrier(sync))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        s = _seconds(timeout) or self._g.timeout()
        self._g.monitored_barrier(s, bool(wait_all_ranks))

    # --- lifetime -------------------------------------------------------------------------

    def abort(self):
        self._g.abort()

    def shutdown(self):
        global _world
        with _lock:
            if _world is self._g:
                _world = None
        self._g = _Closed()


class _Closed:
    """What a group is after shutdown: every call says so."""

    def __getattr__(self, name):
        raise dist.DistBackendError("distcomm: the process group was destroyed")


class _Many(_TorchWork):
    """One handle over several operations (coalesced calls)."""

    def __init__(self, works, result):
        super().__init__()
        if not works:
            raise ValueError("distcomm: a coalesced call needs at least one tensor")
        self._works = works
        self._result = result

    def wait(self, timeout=None):
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def is_success(self):
        return all(w.is_success() for w in self._works)

    def exception(self):
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def result(self):
        return self._result

    def synchronize(self):
        pass

    def get_future(self):
        return _future_of(self, self.is_completed())


def _split(t, n, chunk, op):
    if t.nbytes != n * chunk:
        raise ValueError(
            f"distcomm: {op}: the large tensor holds {t.nbytes} bytes, not {n} x {chunk}"
        )
    base = t.data_ptr()
    return [(base + i * chunk, chunk) for i in range(n)]


def _split_rows(t, n, sizes, what):
    rows = t.shape[0] if t.dim() > 0 else 1
    row = t.nbytes // rows if rows else 0
    if not sizes:
        if rows % n != 0:
            raise ValueError(f"distcomm: all_to_all_single: {what} of {rows} rows does not split into {n}")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows:
        raise ValueError(
            f"distcomm: all_to_all_single: {what} split sizes {list(sizes)} must be {n} sizes summing to {rows}"
        )
    base, at, out = t.data_ptr(), 0, []
    for s in sizes:
        out.append((base + at, s * row))
        at += s * row
    return out


def _create(opts, backend_options=None):
    """torch's constructor hook (extended API): the world group or a members-only subgroup."""
    global _world
    timeout = opts.timeout.total_seconds() if opts.timeout else 1800.0
    ranks = list(opts.global_ranks_in_group)
    with _lock:
        world = _world
    if world is None or not ranks:
        # The default group, or a group of a job whose world runs on another backend: a mesh
        # of its own, through its own store.
        local = os.environ.get("LOCAL_WORLD_SIZE")
        g = _distcomm.Group.world(
            opts.store, opts.group_rank, opts.group_size, timeout,
            int(local) if local else None,
        )
        if not ranks:
            with _lock:
                _world = g
    else:
        g = world.subgroup(ranks)
    return ProcessGroupDistcomm(g, opts.group_rank, opts.group_size)


_registered = False


def register():
    """Registers ``"distcomm"`` with torch.distributed (idempotent; the entry point calls it)."""
    global _registered
    if _registered:
        return
    devices = ["cpu"]
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        cur = acc.current_accelerator()
        if cur is not None and cur.type not in devices:
            devices.append(cur.type)
    dist.Backend.register_backend("distcomm", _create, extended_api=True, devices=devices)
    _registered = True


register()
