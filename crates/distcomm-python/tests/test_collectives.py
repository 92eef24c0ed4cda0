"""Every torch.distributed collective on the distcomm backend, every dtype, worlds 1-4,
synchronous and async, against references computed locally from every rank's inputs."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
R = dist.ReduceOp
N = 37  # not a multiple of anything interesting


def data(rank, n, dtype, salt=0, small=False):
    """Rank `rank`'s input: values whose sums and products are exact in every dtype."""
    if dtype == torch.bool:
        return torch.tensor([(rank + i + salt) % 3 == 0 for i in range(n)])
    k = 2 if small else 4
    v = torch.tensor([((rank * 7 + i * 3 + salt) % k) + (1 if small else 0) for i in range(n)])
    if dtype.is_floating_point:
        v = v.to(torch.float64) - (0 if small else 1.5)
    return v.to(dtype)


def reference(inputs, op, world):
    x = [t.to(torch.float64) if t.dtype.is_floating_point else t for t in inputs]
    out = x[0].clone()
    for t in x[1:]:
        if op == R.SUM or op == R.AVG:
            out = out + t if out.dtype != torch.bool else out | t
        elif op == R.PRODUCT:
            out = out * t if out.dtype != torch.bool else out & t
        elif op == R.MIN:
            out = torch.minimum(out, t)
        elif op == R.MAX:
            out = torch.maximum(out, t)
        elif op == R.BAND:
            out = out & t
        elif op == R.BOR:
            out = out | t
        elif op == R.BXOR:
            out = out ^ t
    if op == R.AVG:
        out = out / world if out.dtype.is_floating_point else torch.div(out, world, rounding_mode="trunc")
    return out.to(inputs[0].dtype)


def ops_for(dtype):
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if dtype != torch.bool:
        ops.append(R.AVG)
    if not dtype.is_floating_point:
        ops += [R.BAND, R.BOR, R.BXOR]
    return ops


def finish(work, async_op):
    if async_op:
        assert work is not None
        work.wait()
        assert work.is_completed()


def body_all_reduce(rank, world):
    for async_op in (False, True):
        for dtype in DTYPES:
            for op in ops_for(dtype):
                small = op == R.PRODUCT
                t = data(rank, N, dtype, small=small)
                finish(dist.all_reduce(t, op=op, async_op=async_op), async_op)
                ref = reference([data(r, N, dtype, small=small) for r in range(world)], op, world)
                assert torch.equal(t, ref), (dtype, op, async_op, t, ref)
        # PREMUL_SUM: times the factor, then summed.
        t = data(rank, N, torch.float32)
        finish(dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0), async_op=async_op), async_op)
        ref = reference([data(r, N, torch.float32) * 2 for r in range(world)], R.SUM, world)
        assert torch.equal(t, ref)
    # Operators a dtype cannot do fail before anything moves, on every rank alike.
    t = torch.ones(4)
    with pytest.raises(ValueError, match="bitwise|BAnd|band|integer"):
        dist.all_reduce(t, op=R.BAND)
    with pytest.raises(ValueError, match="AVG"):
        dist.all_reduce(torch.ones(4, dtype=torch.bool), op=R.AVG)
    with pytest.raises(TypeError, match="uint32"):
        dist.all_reduce(torch.ones(4, dtype=torch.uint32))
    # torch itself reduces complex tensors as pairs of reals.
    c = torch.complex(torch.ones(3), torch.full((3,), float(rank)))
    dist.all_reduce(c)
    assert torch.equal(c, torch.complex(torch.full((3,), float(world)), torch.full((3,), float(sum(range(world))))))
    assert torch.equal(t, torch.ones(4))
    # coalesced: several tensors, one call.
    ts = [data(rank, n, torch.float32, salt=n) for n in (1, 5, 300)]
    dist.all_reduce_coalesced(ts)
    for n, t in zip((1, 5, 300), ts):
        assert torch.equal(t, reference([data(r, n, torch.float32, salt=n) for r in range(world)], R.SUM, world))
    return True


def body_movers(rank, world):
    """broadcast, all_gather(+_into_tensor), gather, scatter, all_to_all(+_single): any dtype."""
    for async_op in (False, True):
        for dtype in DTYPES + [torch.complex64]:
            mk = (lambda r, n=N, s=0: data(r, n, dtype, s)) if dtype != torch.complex64 else (
                lambda r, n=N, s=0: torch.complex(data(r, n, torch.float32, s), data(r, n, torch.float32, s + 1)))
            for root in {0, world - 1}:
                t = mk(rank) if rank == root else torch.zeros_like(mk(rank))
                finish(dist.broadcast(t, root, async_op=async_op), async_op)
                assert torch.equal(t, mk(root)), ("broadcast", dtype, root)

                outs = [torch.zeros_like(mk(0)) for _ in range(world)] if rank == root else None
                finish(dist.gather(mk(rank), outs, dst=root, async_op=async_op), async_op)
                if rank == root:
                    for r in range(world):
                        assert torch.equal(outs[r], mk(r)), ("gather", dtype)

                ins = [mk(r, s=5) for r in range(world)] if rank == root else None
                out = torch.zeros_like(mk(0))
                finish(dist.scatter(out, ins, src=root, async_op=async_op), async_op)
                assert torch.equal(out, mk(rank, s=5)), ("scatter", dtype)

            outs = [torch.zeros_like(mk(0)) for _ in range(world)]
            finish(dist.all_gather(outs, mk(rank), async_op=async_op), async_op)
            for r in range(world):
                assert torch.equal(outs[r], mk(r)), ("all_gather", dtype)

            big = torch.zeros(world * N, dtype=mk(0).dtype)
            finish(dist.all_gather_into_tensor(big, mk(rank), async_op=async_op), async_op)
            assert torch.equal(big, torch.cat([mk(r) for r in range(world)])), ("agit", dtype)

            # In place: the input is this rank's chunk of the output (ZeRO does this).
            big = torch.zeros(world * N, dtype=mk(0).dtype)
            big[rank * N:(rank + 1) * N] = mk(rank)
            finish(dist.all_gather_into_tensor(big, big[rank * N:(rank + 1) * N], async_op=async_op), async_op)
            assert torch.equal(big, torch.cat([mk(r) for r in range(world)])), ("agit in place", dtype)

            ins = [mk(rank, 3, s=j) for j in range(world)]
            outs = [torch.zeros_like(mk(0, 3)) for _ in range(world)]
            finish(dist.all_to_all(outs, ins, async_op=async_op), async_op)
            for r in range(world):
                assert torch.equal(outs[r], mk(r, 3, s=rank)), ("all_to_all", dtype)

            inp = torch.cat([mk(rank, 2, s=j) for j in range(world)])
            out = torch.zeros_like(inp)
            finish(dist.all_to_all_single(out, inp, async_op=async_op), async_op)
            assert torch.equal(out, torch.cat([mk(r, 2, s=rank) for r in range(world)])), ("a2a single", dtype)

        # Uneven splits: rank r sends j + r + 1 rows to rank j.
        send = [j + rank + 1 for j in range(world)]
        recv = [rank + r + 1 for r in range(world)]
        inp = torch.cat([torch.full((s, 3), float(rank * 100 + j)) for j, s in enumerate(send)])
        out = torch.zeros(sum(recv), 3)
        finish(dist.all_to_all_single(out, inp, recv, send, async_op=async_op), async_op)
        want = torch.cat([torch.full((s, 3), float(r * 100 + rank)) for r, s in enumerate(recv)])
        assert torch.equal(out, want)
    return True


def body_reducers(rank, world):
    """reduce, reduce_scatter, reduce_scatter_tensor on every dtype and operator."""
    for async_op in (False, True):
        for dtype in DTYPES:
            for op in ops_for(dtype):
                small = op == R.PRODUCT
                root = world - 1
                t = data(rank, N, dtype, small=small)
                mine = t.clone()
                finish(dist.reduce(t, root, op=op, async_op=async_op), async_op)
                if rank == root:
                    ref = reference([data(r, N, dtype, small=small) for r in range(world)], op, world)
                    assert torch.equal(t, ref), ("reduce", dtype, op)
                else:
                    assert torch.equal(t, mine), "reduce changed a non-root tensor"

                ins = [data(rank, 5, dtype, salt=j, small=small) for j in range(world)]
                out = torch.zeros_like(ins[0])
                finish(dist.reduce_scatter(out, ins, op=op, async_op=async_op), async_op)
                ref = reference([data(r, 5, dtype, salt=rank, small=small) for r in range(world)], op, world)
                assert torch.equal(out, ref), ("reduce_scatter", dtype, op)

                inp = torch.cat(ins)
                out = torch.zeros_like(ins[0])
                finish(dist.reduce_scatter_tensor(out, inp, op=op, async_op=async_op), async_op)
                assert torch.equal(out, ref), ("reduce_scatter_tensor", dtype, op)
                assert torch.equal(inp, torch.cat(ins)), "reduce_scatter_tensor changed its input"
    return True


def body_misc(rank, world):
    """barrier, monitored_barrier, object collectives, batch_isend_irecv, coalescing manager."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    dist.barrier()
    finish(dist.barrier(async_op=True), True)
    dist.monitored_barrier()
    dist.monitored_barrier(wait_all_ranks=True)

    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(world)]
    lst = [{"root": True, "payload": list(range(50))}] if rank == 0 else [None]
    dist.broadcast_object_list(lst, 0)
    assert lst[0]["payload"] == list(range(50))
    got = [None] * world if rank == 0 else None
    dist.gather_object(("g", rank), got, dst=0)
    if rank == 0:
        assert got == [("g", r) for r in range(world)]
    out = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(world)] if rank == 0 else None, src=0)
    assert out[0] == ("s", rank)

    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        send = torch.full((6,), float(rank))
        recv = torch.zeros(6)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)])
        for r in reqs:
            r.wait()
        assert torch.equal(recv, torch.full((6,), float(prv)))

    with _coalescing_manager(async_ops=True) as cm:
        a, b = torch.ones(3) * rank, torch.ones(5) * (rank + 1)
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    s = sum(range(world))
    assert torch.equal(a, torch.ones(3) * s) and torch.equal(b, torch.ones(5) * (s + world))

    outs = [torch.zeros(world * 2), torch.zeros(world * 3)]
    with _coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(rank)))
        dist.all_gather_into_tensor(outs[1], torch.full((3,), float(rank)))
    cm.wait()
    assert torch.equal(outs[0], torch.arange(world).repeat_interleave(2).float())
    assert torch.equal(outs[1], torch.arange(world).repeat_interleave(3).float())

    outs = [torch.zeros(2), torch.zeros(3)]
    with _coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], torch.ones(world * 2))
        dist.reduce_scatter_tensor(outs[1], torch.ones(world * 3))
    cm.wait()
    assert torch.equal(outs[0], torch.full((2,), float(world)))
    assert torch.equal(outs[1], torch.full((3,), float(world)))

    # Non-contiguous tensors are refused like gloo refuses them, with the fix in the message.
    t = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(t)
    assert dist.get_backend() == "distcomm"
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce(world):
    assert run_ranks(body_all_reduce, world) == [True] * world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_movers(world):
    assert run_ranks(body_movers, world) == [True] * world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reducers(world):
    assert run_ranks(body_reducers, world) == [True] * world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_misc(world):
    assert run_ranks(body_misc, world) == [True] * world
