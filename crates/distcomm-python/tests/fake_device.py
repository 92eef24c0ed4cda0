"""A torch device whose memory no transport can address: ``fakedev``, a Python-only PrivateUse1
backend (torch 2.15's ``_setup_privateuseone_for_python_backend``).

A ``fakedev`` tensor is a wrapper tensor subclass (``_make_wrapper_subclass``: device
``fakedev:0``, no storage of its own) over a private CPU tensor, its "device memory". Every aten
op on it reaches ``__torch_dispatch__``, which runs the op on the CPU tensors and wraps the
results again; factory ops that name the device (``torch.zeros(..., device="fakedev")``,
``cpu.to("fakedev")``) reach a PrivateUse1 fallback that does the same. Whatever moves data
between the device and the host is counted and logged:

* device -> host: ``_to_copy`` to the CPU (``t.to("cpu")``, ``t.cpu()``) and ``cpu.copy_(t)``;
* host -> device: ``t.copy_(cpu)`` (and so ``cpu.to("fakedev")``);
* every other op that takes a device tensor is logged too (a read or write on the device).

``stats(t)`` sums them for one tensor's device memory (or all), ``reset()`` starts again,
``peek(t)`` reads the device memory without being counted.

``data_ptr()`` answers the address of the device memory, so a host "copy" that aliases it is
visible (``ALIAS_ON_TO_HOST`` makes ``to("cpu")`` alias, as an undecomposed ``to()`` can).
torch.distributed ops (namespace ``c10d``) are redispatched to the PrivateUse1 key rather than
run on the CPU tensors, so a C++ backend sees the device (gloo refuses it) instead of silently
getting host memory.

``install()`` changes the whole process (the PrivateUse1 name can be set once): call it only
in processes of their own, such as the ranks ``harness.run_ranks`` spawns.
"""

import threading

import torch
from torch.utils import _pytree as pytree

NAME = "fakedev"
DEVICE = None  # torch.device("fakedev", 0), once installed
CPU = torch.device("cpu")

# Tests set this to make to("cpu") return a view of the device memory instead of a copy.
ALIAS_ON_TO_HOST = False
# Tests set this to a callable(device tensor) run just before each host -> device copy.
BEFORE_H2D = None

_log = []  # (kind, storage key, nbytes, op name): kind "d2h", "h2d" or "op"
_lock = threading.Lock()
_installed = False


class FakeDeviceTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, mem):
        r = torch.Tensor._make_wrapper_subclass(
            cls, mem.shape, strides=mem.stride(), storage_offset=mem.storage_offset(),
            dtype=mem.dtype, device=DEVICE,
        )
        r._mem = mem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def data_ptr(self):
        return self._mem.data_ptr()

    def __repr__(self):
        return f"FakeDeviceTensor({self._mem!r}, device={DEVICE})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _key(t):
    return t._mem.untyped_storage()._cdata


def _record(kind, t, nbytes, func):
    with _lock:
        _log.append((kind, _key(t), nbytes, func.__name__))


def _run(func, args, kwargs):
    if func.namespace == "c10d":
        # A collective of a C++ backend: it must see the device, as with a real accelerator.
        ks = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
        return func.redispatch(ks, *args, **kwargs)
    leaves = pytree.tree_leaves((args, kwargs))
    fakes = [x for x in leaves if isinstance(x, FakeDeviceTensor)]
    dev = kwargs.get("device")
    to_host = dev is not None and torch.device(dev).type != NAME
    on_device = not to_host and (bool(fakes) or dev is not None)

    if func is torch.ops.aten._to_copy.default and fakes and to_host:
        if ALIAS_ON_TO_HOST:
            return args[0]._mem.view(args[0]._mem.shape)
        _record("d2h", args[0], args[0].nbytes, func)
    elif func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        if isinstance(dst, FakeDeviceTensor) and not isinstance(src, FakeDeviceTensor):
            _record("h2d", dst, dst.nbytes, func)
            if BEFORE_H2D is not None:
                BEFORE_H2D(dst)
        elif isinstance(src, FakeDeviceTensor) and not isinstance(dst, FakeDeviceTensor):
            _record("d2h", src, dst.nbytes, func)
        else:
            _record("op", dst, 0, func)
    else:
        for f in fakes:
            _record("op", f, 0, func)

    def unwrap(x):
        if isinstance(x, FakeDeviceTensor):
            return x._mem
        if isinstance(x, torch.device) and x.type == NAME:
            return CPU
        return x

    out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
    # In-place ops return an input: hand back the caller's object, not a new wrapper.
    inputs = {id(unwrap(x)): x for x in leaves if isinstance(x, torch.Tensor)}

    def wrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in inputs:
            return inputs[id(x)]
        return FakeDeviceTensor(x) if on_device else x

    return pytree.tree_map(wrap, out)


def _fallback(op, *args, **kwargs):
    return _run(op, args, kwargs)


def install():
    """Makes ``fakedev`` a torch device in this process (idempotent)."""
    global _installed, _lib, DEVICE
    if _installed:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(NAME)
    DEVICE = torch.device(NAME, 0)
    _lib = torch.library.Library("_", "IMPL")
    _lib.fallback(_fallback, "PrivateUse1")
    _installed = True


def reset():
    """Forgets every copy and op recorded so far."""
    with _lock:
        _log.clear()


def stats(t=None):
    """Copies recorded since ``reset()``: ``{"d2h", "h2d", "d2h_bytes", "h2d_bytes", "ops"}``,
    all device tensors together or only those over `t`'s device memory."""
    with _lock:
        events = list(_log)
    if t is not None:
        events = [e for e in events if e[1] == _key(t)]
    s = {"d2h": 0, "h2d": 0, "d2h_bytes": 0, "h2d_bytes": 0, "ops": []}
    for kind, _, n, name in events:
        if kind == "op":
            s["ops"].append(name)
        else:
            s[kind] += 1
            s[kind + "_bytes"] += n
    return s


def to_device(x):
    """A device tensor holding a copy of CPU tensor `x` (not counted)."""
    return FakeDeviceTensor(x.detach().clone())


def peek(t):
    """The device memory of `t` as a CPU tensor, read without being counted."""
    return t._mem.clone()
