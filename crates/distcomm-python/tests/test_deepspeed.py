"""DeepSpeed (from PyPI, CPU accelerator) on the distcomm backend: init_distributed, the
isend/irecv payload contract, the collectives ZeRO uses, and ZeRO stage 1 and 2 training steps
whose losses equal the same run on gloo."""

import os

import pytest
import torch

from harness import run_ranks

deepspeed = pytest.importorskip("deepspeed")

ENV = {"DS_ACCELERATOR": "cpu", "DISTCOMM_TEST_QUIET": "1"}


def _init(backend, rank, world, init):
    import deepspeed
    import deepspeed.comm as dcomm

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "LOCAL_SIZE": str(world)})
    deepspeed.init_distributed(dist_backend=backend, init_method=init, rank=rank,
                               world_size=world, verbose=False)
    return dcomm


def body_comm(rank, world, init):
    import distcomm.torch  # noqa: F401

    dcomm = _init("distcomm", rank, world, init)
    assert dcomm.get_world_size() == world and dcomm.get_rank() == rank
    import torch.distributed as dist

    assert dist.get_backend() == "distcomm"
    # PR #8303's contract: the payload is there after wait().
    peer = 1 - rank
    if rank == 0:
        dcomm.isend(torch.arange(10.0), peer).wait()
    else:
        t = torch.zeros(10)
        dcomm.irecv(t, peer).wait()
        assert torch.equal(t, torch.arange(10.0))
    x = torch.ones(8) * (rank + 1)
    dcomm.all_reduce(x)
    assert torch.equal(x, torch.full((8,), 3.0))
    out = torch.zeros(world * 4)
    dcomm.all_gather_into_tensor(out, torch.full((4,), float(rank)))
    assert torch.equal(out, torch.arange(world).repeat_interleave(4).float())
    part = torch.zeros(4)
    dcomm.reduce_scatter_tensor(part, torch.ones(world * 4))
    assert torch.equal(part, torch.full((4,), float(world)))
    b = torch.full((3,), float(rank))
    dcomm.broadcast(b, 0)
    assert torch.equal(b, torch.zeros(3))
    dcomm.barrier()
    dist.destroy_process_group()
    return True


def _train(backend, rank, world, init, stage):
    import deepspeed

    if backend == "distcomm":
        import distcomm.torch  # noqa: F401
    _init(backend, rank, world, init)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(4):
        xb = torch.randn(4, 16, generator=g)
        yb = torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(xb), yb)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    import torch.distributed as dist

    dist.destroy_process_group()
    return losses


def body_train(rank, world, init, stage):
    return _train("distcomm", rank, world, init, stage)


def body_train_gloo(rank, world, init, stage):
    return _train("gloo", rank, world, init, stage)


def test_deepspeed_comm():
    assert run_ranks(body_comm, 2, "env://", init=None, env=_env(29641), timeout=240) == [True, True]


def _env(port):
    return dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_losses_equal_gloo(stage):
    ours = run_ranks(body_train, 2, "env://", stage, init=None, env=_env(29642 + stage), timeout=300)
    theirs = run_ranks(body_train_gloo, 2, "env://", stage, init=None, env=_env(29652 + stage), timeout=300)
    assert len(ours[0]) == 4
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7), (a, b)
    # The loss went down: the optimizer stepped on reduced gradients.
    assert ours[0][-1] < ours[0][0]
