"""Device staging (design.md contract 5, issue 16 point 7) on a device the transports cannot
address: ``fakedev`` (tests/fake_device.py), whose copies to and from the host are counted.

Every body runs in spawned ranks (the device registration changes the whole process). What is
asserted, per device tensor: an input is copied device -> host once, when the operation is
posted, and never back; an output is never read, and is copied host -> device once, only after
the operation succeeded, in ``wait()`` / ``is_completed()``, however often those are called; a
receive or collective that timed out or failed leaves the device tensor bit-identical and
uncopied; a wait() racing the future's thread returns only after the publication; a host copy
that aliases the device memory is refused; and gloo, a stock transport, refuses the device.
"""

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fake_device as fd
from harness import run_ranks


def _bits(t):
    """The device memory of `t` as raw bytes (NaN payloads included)."""
    return fd.peek(t).view(torch.uint8)


def _same_bits(t, before):
    return torch.equal(_bits(t), before)


def _noise(n, dtype):
    """Values no transport produces by accident: random bits, NaN payloads included."""
    g = torch.Generator().manual_seed(1234 + n)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)


def _assert_copies(t, d2h, h2d, what):
    s = fd.stats(t)
    assert (s["d2h"], s["h2d"]) == (d2h, h2d), f"{what}: copies {s}"
    assert s["d2h_bytes"] == d2h * t.nbytes and s["h2d_bytes"] == h2d * t.nbytes, f"{what}: {s}"


def _until_done(w):
    """Spins until the transport finished the operation, without asking the Work (which would
    publish): the raw distcomm operation says so."""
    while not w._w.is_completed():
        time.sleep(0.0002)


def _payload(n, dtype, who):
    return ((torch.arange(n) * 7 + who) % 97).to(dtype)


# --- point-to-point -----------------------------------------------------------------------


def body_p2p(rank, world):
    fd.install()
    for n in (1, 1000, 1 << 18):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            if rank == 0:
                d = fd.to_device(_payload(n, dtype, 0))
                before = _bits(d)
                fd.reset()
                w = dist.isend(d, 1, tag=1)
                # Copied in once, when posted: the caller may reuse the device tensor now.
                _assert_copies(d, 1, 0, "isend posted")
                assert fd.stats(None)["ops"] == ["detach.default"], fd.stats(None)
                w.wait()
                w.wait()
                assert w.is_completed() and w.is_success()
                _assert_copies(d, 1, 0, "isend waited")
                assert _same_bits(d, before)
            else:
                r = fd.to_device(_noise(n, dtype))
                fd.reset()
                w = dist.irecv(r, 0, tag=1)
                # The host target is allocated, the device tensor neither read nor written.
                assert fd.stats(r) == fd.stats(None) == {
                    "d2h": 0, "h2d": 0, "d2h_bytes": 0, "h2d_bytes": 0, "ops": []
                }, fd.stats(None)
                w.wait()
                _assert_copies(r, 0, 1, "irecv waited")
                assert torch.equal(fd.peek(r), _payload(n, dtype, 0)), (n, dtype)
                for _ in range(3):
                    assert w.wait() and w.is_completed() and w.is_success()
                assert w.get_future().wait() is not None
                _assert_copies(r, 0, 1, "irecv waited again")
                assert fd.stats(None)["ops"] == [], fd.stats(None)
    dist.barrier()

    # A timed-out receive leaves the device tensor bit-identical; a later wait publishes once.
    n, dtype = 4096, torch.float32
    if rank == 1:
        r = fd.to_device(_noise(n, dtype))
        before = _bits(r)
        fd.reset()
        w = dist.irecv(r, 0, tag=2)
        for ms in (1, 50):
            with pytest.raises(dist.DistBackendError, match="timed out"):
                w.wait(timedelta(milliseconds=ms))
            assert not w.is_completed()
            assert _same_bits(r, before)
            _assert_copies(r, 0, 0, "irecv timed out")
        dist.barrier()  # only now does rank 0 send
        assert w.wait(timedelta(seconds=60))
        _assert_copies(r, 0, 1, "irecv after the timeout")
        assert torch.equal(fd.peek(r), _payload(n, dtype, 0))
        assert w.wait() and w.is_completed()
        _assert_copies(r, 0, 1, "irecv waited twice")
    else:
        dist.barrier()
        dist.send(fd.to_device(_payload(n, dtype, 0)), 1, tag=2)

    # A failed receive (the message is longer than the tensor) never publishes, however it is
    # asked; its error stays.
    if rank == 1:
        r = fd.to_device(_noise(10, dtype))
        before = _bits(r)
        fd.reset()
        w = dist.irecv(r, 0, tag=3)
        with pytest.raises(dist.DistBackendError, match="bytes"):
            w.wait()
        assert _same_bits(r, before)
        assert w.is_completed() and not w.is_success() and w.exception() is not None
        with pytest.raises(dist.DistBackendError, match="bytes"):
            w.wait(timedelta(seconds=5))
        with pytest.raises(dist.DistBackendError):
            w.get_future().wait()
        assert w.is_completed()
        assert _same_bits(r, before)
        _assert_copies(r, 0, 0, "failed irecv")
    else:
        s = fd.to_device(torch.ones(100))
        fd.reset()
        w = dist.isend(s, 1, tag=3)
        _assert_copies(s, 1, 0, "isend of a message too long")
        with pytest.raises(dist.DistBackendError, match="bytes"):
            w.wait()
        _assert_copies(s, 1, 0, "isend of a message too long, failed")
    dist.barrier()

    # is_completed() publishes exactly once, however often it is called.
    if rank == 1:
        r = fd.to_device(_noise(n, dtype))
        before = _bits(r)
        fd.reset()
        w = dist.irecv(r, 0, tag=4)
        assert not w.is_completed()
        dist.barrier()
        _until_done(w)
        _assert_copies(r, 0, 0, "irecv done, not yet asked")
        assert _same_bits(r, before)
        assert w.is_completed()
        _assert_copies(r, 0, 1, "irecv is_completed")
        assert torch.equal(fd.peek(r), _payload(n, dtype, 0))
        for _ in range(5):
            assert w.is_completed() and w.is_success()
        w.wait()
        _assert_copies(r, 0, 1, "irecv is_completed x6, wait")
    else:
        dist.barrier()
        dist.send(fd.to_device(_payload(n, dtype, 0)), 1, tag=4)

    # get_future() on a pending receive: the future completes after the publication, once.
    if rank == 1:
        r = fd.to_device(_noise(n, dtype))
        fd.reset()
        w = dist.irecv(r, 0, tag=5)
        fut = w.get_future()
        dist.barrier()
        fut.wait()
        _assert_copies(r, 0, 1, "irecv future")
        assert torch.equal(fd.peek(r), _payload(n, dtype, 0))
        w.wait()
        assert w.is_completed()
        _assert_copies(r, 0, 1, "irecv future, wait")
    else:
        dist.barrier()
        dist.send(fd.to_device(_payload(n, dtype, 0)), 1, tag=5)

    # Blocking recv from any source into a device tensor.
    if rank == 1:
        r = fd.to_device(_noise(n, dtype))
        fd.reset()
        assert dist.recv(r, tag=6) == 0
        _assert_copies(r, 0, 1, "recv from any source")
        assert torch.equal(fd.peek(r), _payload(n, dtype, 0))
    else:
        dist.send(fd.to_device(_payload(n, dtype, 0)), 1, tag=6)
    dist.barrier()
    return True


def test_p2p_staging():
    assert run_ranks(body_p2p, 2, timeout=180) == [True, True]


# --- collectives ----------------------------------------------------------------------------


MODES = ("sync", "wait", "is_completed", "future")


def _post(fn, mode, outs, ins_only):
    """Runs collective `fn(async_op)` and checks its copies: each of `outs` (tensors the
    operation writes; `(tensor, reads)`) and `ins_only` copied in once when posted, nothing
    copied back until the Work publishes (by `mode`: the blocking call itself, `wait()`,
    `is_completed()` or the future), then each of `outs` copied back once, however often the
    Work is asked again."""
    fd.reset()
    w = fn(mode != "sync")
    if mode != "sync":
        for t, reads in outs + [(t, True) for t in ins_only]:
            _assert_copies(t, 1 if reads else 0, 0, "posted")
        befores = [_bits(t) for t, _ in outs]
        _until_done(w)
        dist.barrier()  # more operations, on other tensors: still nothing copied back
        for (t, reads), before in zip(outs, befores):
            _assert_copies(t, 1 if reads else 0, 0, "done, not waited")
            assert _same_bits(t, before), "a device tensor changed before wait()"
        if mode == "wait":
            assert w.wait()
        elif mode == "future":
            w.get_future().wait()
        else:
            while not w.is_completed():
                time.sleep(0.0002)
    for t, reads in outs:
        _assert_copies(t, 1 if reads else 0, 1, f"published ({mode})")
    if mode != "sync":
        for _ in range(3):
            assert w.is_completed() and w.is_success() and w.wait()
        w.get_future().wait()
    for t, reads in outs:
        _assert_copies(t, 1 if reads else 0, 1, f"published ({mode}), asked again")
    for t in ins_only:
        _assert_copies(t, 1, 0, "input only")
    return w


def body_collectives(rank, world):
    fd.install()
    for n in (1, 1000, 1 << 18):
        for mode in MODES:
            # all_reduce: in and out.
            x = fd.to_device(torch.full((n,), float(rank + 1)))
            _post(lambda a: dist.all_reduce(x, async_op=a), mode, [(x, True)], [])
            assert torch.equal(fd.peek(x), torch.full((n,), float(world * (world + 1) // 2)))

            i = fd.to_device(_payload(n, torch.int32, rank))
            _post(lambda a: dist.all_reduce(i, op=dist.ReduceOp.MAX, async_op=a), mode,
                  [(i, True)], [])
            want = torch.stack([_payload(n, torch.int32, r) for r in range(world)]).amax(0)
            assert torch.equal(fd.peek(i), want)

            # broadcast: in and out on every rank.
            root = world - 1
            b = fd.to_device(_payload(n, torch.bfloat16, rank))
            _post(lambda a: dist.broadcast(b, src=root, async_op=a), mode, [(b, True)], [])
            assert torch.equal(fd.peek(b), _payload(n, torch.bfloat16, root))

            # all_gather_into_tensor: the output is never read.
            inp = fd.to_device(_payload(n, torch.float32, rank))
            out = fd.to_device(_noise(n * world, torch.float32))
            _post(lambda a: dist.all_gather_into_tensor(out, inp, async_op=a), mode,
                  [(out, False)], [inp])
            want = torch.cat([_payload(n, torch.float32, r) for r in range(world)])
            assert torch.equal(fd.peek(out), want)
            assert torch.equal(fd.peek(inp), _payload(n, torch.float32, rank))

            # reduce_scatter_tensor: the output is never read.
            inp = fd.to_device(torch.cat([torch.full((n,), float(rank * 10 + c)) for c in range(world)]))
            out = fd.to_device(_noise(n, torch.float32))
            _post(lambda a: dist.reduce_scatter_tensor(out, inp, async_op=a), mode,
                  [(out, False)], [inp])
            want = torch.full((n,), float(sum(r * 10 + rank for r in range(world))))
            assert torch.equal(fd.peek(out), want)
    # Several async collectives in flight, waited in reverse order: each copied back once,
    # in its own wait.
    xs = [fd.to_device(torch.full((4096,), float(rank + k))) for k in range(4)]
    fd.reset()
    ws = [dist.all_reduce(x, async_op=True) for x in xs]
    for w in ws:
        _until_done(w)
    for k in reversed(range(4)):
        ws[k].wait()
        for j, x in enumerate(xs):
            _assert_copies(x, 1, 1 if j >= k else 0, f"in flight: {j} after wait {k}")
        assert torch.equal(fd.peek(xs[k]), torch.full((4096,), float(sum(r + k for r in range(world)))))
    s = fd.stats(None)
    assert (s["d2h"], s["h2d"]) == (4, 4), s
    dist.barrier()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_collective_staging(world):
    assert run_ranks(body_collectives, world, timeout=240) == [True] * world


def body_collective_failures(rank, world):
    fd.install()
    store = dist.distributed_c10d._get_default_store()
    # A timed-out wait on an async collective: nothing published; a later wait publishes once.
    x = fd.to_device(torch.full((1000,), float(rank + 1)))
    fd.reset()
    if rank == 0:
        w = dist.all_reduce(x, async_op=True)
        before = _bits(x)
        with pytest.raises(dist.DistBackendError, match="timed out"):
            w.wait(timedelta(milliseconds=50))
        assert not w.is_completed()
        assert _same_bits(x, before)
        _assert_copies(x, 1, 0, "all_reduce timed out")
        store.set("staging-go", "1")  # only now does rank 1 join
        assert w.wait(timedelta(seconds=60))
    else:
        store.wait(["staging-go"])
        w = dist.all_reduce(x, async_op=True)
        w.wait()
    assert w.wait() and w.is_completed()
    _assert_copies(x, 1, 1, "all_reduce after a timeout")
    assert torch.equal(fd.peek(x), torch.full((1000,), 3.0))

    # A failed collective (a desync: all_reduce against broadcast) never publishes, whichever
    # way it is asked, and its buffers keep their bits (the group is unusable afterwards).
    x = fd.to_device(_noise(1000, torch.float32))
    before = _bits(x)
    fd.reset()
    if rank == 0:
        w = dist.all_reduce(x, async_op=True)
    else:
        w = dist.broadcast(x, src=0, async_op=True)
    with pytest.raises(dist.DistBackendError):
        w.wait()
    assert w.is_completed() and not w.is_success() and w.exception() is not None
    with pytest.raises(dist.DistBackendError):
        w.wait()
    with pytest.raises(Exception):
        w.get_future().wait()
    assert _same_bits(x, before)
    _assert_copies(x, 1, 0, "failed collective")
    return True


def test_collective_failures_never_publish():
    assert run_ranks(body_collective_failures, 2, timeout=120) == [True, True]


def body_concurrent_publish(rank, world):
    """wait() returns only once the device tensor is published, even while another thread
    (the one completing the Work's future) is the one publishing it."""
    fd.install()
    n = 4096
    if rank == 0:
        dist.barrier()
        dist.send(fd.to_device(_payload(n, torch.float32, 0)), 1, tag=1)
        return True
    r = fd.to_device(_noise(n, torch.float32))
    started, release = threading.Event(), threading.Event()

    def hold(dev):  # the first host -> device copy stops here until released
        if not started.is_set():
            started.set()
            release.wait(60)

    fd.BEFORE_H2D = hold
    fd.reset()
    w = dist.irecv(r, 0, tag=1)
    fut = w.get_future()  # a thread now waits on the receive, and will publish it
    dist.barrier()
    assert started.wait(60), "the future's thread never published"
    seen = []

    def waiter():
        try:
            w.wait()
            seen.append(fd.peek(r))
        except BaseException as e:
            seen.append(repr(e))

    t = threading.Thread(target=waiter)
    t.start()
    t.join(1.0)  # a wait() that does not wait for the publication returns now, too early
    release.set()
    t.join(60)
    fut.wait()
    fd.BEFORE_H2D = None
    assert len(seen) == 1, seen
    assert torch.equal(seen[0], _payload(n, torch.float32, 0)), \
        "wait() returned before the device tensor was published"
    _assert_copies(r, 0, 1, "two publishers")
    return True


def test_wait_returns_after_a_concurrent_publication():
    assert run_ranks(body_concurrent_publish, 2, timeout=120) == [True, True]


# --- the device itself ------------------------------------------------------------------------


def body_alias_guard(rank, world):
    """A to("cpu") that aliases the device memory instead of copying is refused, and the
    device tensor is untouched."""
    fd.install()
    x = fd.to_device(torch.arange(8.0))
    fd.ALIAS_ON_TO_HOST = True
    with pytest.raises(ValueError, match="aliased"):
        dist.all_reduce(x)
    with pytest.raises(ValueError, match="aliased"):
        dist.broadcast(x, src=0)
    fd.ALIAS_ON_TO_HOST = False
    assert torch.equal(fd.peek(x), torch.arange(8.0))
    _assert_copies(x, 0, 0, "aliased")
    dist.all_reduce(x)
    assert torch.equal(fd.peek(x), torch.arange(8.0) * world)
    return True


def test_alias_guard():
    assert run_ranks(body_alias_guard, 2) == [True, True]


def body_gloo_refuses(rank, world):
    """The device is one a stock transport cannot address: gloo, even when named the group's
    backend for it, refuses its tensors (rather than silently getting the memory behind them)."""
    fd.install()
    g = dist.new_group(backend=f"cpu:gloo,{fd.NAME}:gloo")  # gloo itself gets the tensor
    x = fd.to_device(torch.ones(4))
    with pytest.raises(Exception) as e:
        dist.all_reduce(x, group=g)
    assert torch.equal(fd.peek(x), torch.ones(4))
    dist.all_reduce(x)  # distcomm stages it
    assert torch.equal(fd.peek(x), torch.full((4,), float(world)))
    return str(e.value)


def test_gloo_refuses_the_device():
    for m in run_ranks(body_gloo_refuses, 2):
        assert "unsupported device type fakedev" in m, m
