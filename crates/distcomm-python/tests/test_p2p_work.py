"""Point-to-point, Work semantics (design contract 2), subgroups, errors and faults through
torch.distributed on the distcomm backend."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks


def body_p2p(rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for n in (0, 1, 300, 70_000, 1 << 20):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
            send = (torch.arange(n) % 7 + rank).to(dtype)
            recv = torch.zeros(n, dtype=dtype)
            # Both ranks post the send first: nonblocking means no deadlock at any size.
            s = dist.isend(send, nxt, tag=n % 1000)
            r = dist.irecv(recv, prv, tag=n % 1000)
            r.wait()
            s.wait()
            assert torch.equal(recv, (torch.arange(n) % 7 + prv).to(dtype)), (n, dtype)
    # Non-overtaking: messages of one (source, tag) arrive in posting order.
    sends = [dist.isend(torch.full((3,), float(i)), nxt, tag=5) for i in range(20)]
    for i in range(20):
        t = torch.zeros(3)
        dist.recv(t, prv, tag=5)
        assert t[0].item() == i
    for s in sends:
        s.wait()
    # Receive from any source reports who sent (through dist.recv's return and the Work).
    if rank == 0:
        seen = set()
        for _ in range(world - 1):
            t = torch.zeros(1)
            src = dist.recv(t, tag=77)
            assert t.item() == src
            seen.add(src)
        assert seen == set(range(1, world))
        w = dist.irecv(torch.zeros(1), tag=78) if world > 1 else None
        if w is not None:
            w.wait()
            assert w._source_rank() == world - 1
    else:
        dist.send(torch.tensor([float(rank)]), 0, tag=77)
        if rank == world - 1:
            dist.send(torch.tensor([1.0]), 0, tag=78)
    # A dropped, unwaited receive still lands (the operation keeps the tensor alive).
    box = torch.zeros(4)
    dist.irecv(box, prv, tag=90)
    dist.send(torch.full((4,), 9.0), nxt, tag=90)
    deadline = time.monotonic() + 10
    while not torch.equal(box, torch.full((4,), 9.0)) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert torch.equal(box, torch.full((4,), 9.0))
    dist.barrier()
    return True


def body_work(rank, world):
    peer = 1 - rank
    # wait(timeout) raises, leaves the receive pending, and a later wait succeeds.
    t = torch.zeros(5)
    w = dist.irecv(t, peer, tag=1)
    assert not w.is_completed()
    with pytest.raises(dist.DistBackendError, match="timed out"):
        w.wait(timedelta(milliseconds=50))
    assert not w.is_completed() and w.exception() is None
    dist.barrier()
    dist.send(torch.full((5,), float(rank)), peer, tag=1)
    assert w.wait(timedelta(seconds=30))
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    assert torch.equal(t, torch.full((5,), float(peer)))
    # Several async collectives in flight, waited out of order; futures complete with them.
    xs = [torch.full((1000,), float(rank + i)) for i in range(6)]
    ws = [dist.all_reduce(x, async_op=True) for x in xs]
    futs = [w.get_future() for w in ws[:3]]
    for w in reversed(ws):
        w.wait()
    for i, x in enumerate(xs):
        assert torch.equal(x, torch.full((1000,), float(2 * i + 1)))
    for f in futs:
        out = f.wait()
        assert isinstance(out, list)
    # A sync call after queued async ones runs after them (issue order).
    a = torch.ones(3)
    wa = dist.all_reduce(a, async_op=True)
    b = torch.ones(3) * 5
    dist.all_reduce(b)
    wa.wait()
    assert torch.equal(a, torch.full((3,), 2.0)) and torch.equal(b, torch.full((3,), 10.0))
    # DDP-style comm hook: a future's value chain.
    g = torch.ones(8) * (rank + 1)
    fut = dist.all_reduce(g, async_op=True).get_future().then(lambda f: f.value()[0] / 2)
    assert torch.equal(fut.wait(), torch.full((8,), 1.5))
    return True


def body_subgroups(rank, world):
    # torch: every rank calls new_group; only members construct the backend.
    evens = list(range(0, world, 2))
    odds = list(range(1, world, 2))
    ge = dist.new_group(evens)
    go = dist.new_group(odds)
    g3 = dist.new_group([0, 1, 2])
    both = dist.new_group(list(range(world)))
    mine, group = (evens, ge) if rank % 2 == 0 else (odds, go)
    x = torch.ones(4) * rank
    dist.all_reduce(x, group=group)
    assert torch.equal(x, torch.full((4,), float(sum(mine))))
    if rank < 3:
        y = torch.tensor([rank])
        dist.broadcast(y, src=2, group=g3)
        assert y.item() == 2
        outs = [torch.zeros(1, dtype=torch.int64) for _ in range(3)]
        dist.all_gather(outs, torch.tensor([rank * 10]), group=g3)
        assert [o.item() for o in outs] == [0, 10, 20]
        # Point-to-point inside a subgroup by global rank.
        if rank == 0:
            dist.send(torch.tensor([5.0]), 2, group=g3)
        elif rank == 2:
            t = torch.zeros(1)
            dist.recv(t, 0, group=g3)
            assert t.item() == 5.0
    z = torch.ones(2)
    dist.all_reduce(z, group=both)
    assert torch.equal(z, torch.full((2,), float(world)))
    # A group of a subset whose members create it at different times relative to others.
    last = world - 1
    if rank in (1, last):
        pair = dist.new_group([1, last], use_local_synchronization=True)
        p = torch.ones(1)
        dist.all_reduce(p, group=pair)
        assert p.item() == 2
        dist.destroy_process_group(pair)
    dist.barrier()
    return True


def body_errors(rank, world):
    t = torch.ones(4)
    with pytest.raises(ValueError):
        dist.send(t, 99)
    with pytest.raises((ValueError, RuntimeError)):
        dist.all_gather([torch.zeros(4)], t)  # wrong number of outputs
    with pytest.raises(ValueError, match="contiguous"):
        dist.broadcast(torch.zeros(3, 3).t(), 0)
    # A message longer than the receive: both sides fail, the receive tensor stays untouched.
    if rank == 0:
        with pytest.raises(dist.DistBackendError, match="bytes"):
            dist.send(torch.ones(100), 1, tag=3)
    elif rank == 1:
        r = torch.full((10,), -1.0)
        with pytest.raises(dist.DistBackendError, match="bytes"):
            dist.recv(r, 0, tag=3)
        assert torch.equal(r, torch.full((10,), -1.0))
    # Different collectives on different ranks: a desync error naming both calls.
    if rank == 0:
        with pytest.raises(dist.DistBackendError, match="all_reduce.*broadcast|broadcast.*all_reduce"):
            dist.all_reduce(torch.ones(4))
    else:
        with pytest.raises(dist.DistBackendError, match="all_reduce.*broadcast|broadcast.*all_reduce"):
            dist.broadcast(torch.ones(4), 0)
    return True


def body_killed(rank, world):
    x = torch.ones(1 << 20)
    dist.all_reduce(x)
    if rank == 1:
        os._exit(3)  # dies between collectives, as a crashed rank does
    t0 = time.monotonic()
    with pytest.raises(dist.DistBackendError) as e:
        for _ in range(1000):
            dist.all_reduce(x)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "rank 1" in msg, msg
    return took


def body_monitored(rank, world):
    if rank == world - 1:
        time.sleep(3)  # too late for the barrier
        return None
    # Rank 0 names the late rank; the others learn that the barrier failed.
    match = rf"\[{world - 1}\]" if rank == 0 else "did not reach"
    with pytest.raises(dist.DistBackendError, match=match):
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_p2p(world):
    assert run_ranks(body_p2p, world) == [True] * world


def test_work_semantics():
    assert run_ranks(body_work, 2) == [True, True]


@pytest.mark.parametrize("world", [3, 4])
def test_subgroups(world):
    assert run_ranks(body_subgroups, world) == [True] * world


def test_errors():
    assert run_ranks(body_errors, 2) == [True, True]


@pytest.mark.parametrize("world", [2, 3])
def test_killed_rank_is_named_within_seconds(world):
    took = run_ranks(body_killed, world, expect_exit=[1], timeout=90)
    for r, t in enumerate(took):
        if r != 1:
            assert t < 30, f"rank {r} took {t:.1f} s to notice"


def test_monitored_barrier_names_the_late_rank():
    run_ranks(body_monitored, 3, timeout=60)
