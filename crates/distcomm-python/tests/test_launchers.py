"""The launchers users start torch programs with: torchrun (env://), tcp:// and file://
init methods, and `distcomm launch -- python train.py`. The program never imports distcomm."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
SCRIPT = str(HERE / "scripts" / "train_tiny.py")
REPO = HERE.parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    e = dict(os.environ)
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    return e


def check(out, world):
    # Each rank writes its line with one write(2); split on the marker anyway, so that output a
    # launcher interleaves still counts each rank once.
    lines = sorted("OK rank=" + l for l in out.split("OK rank=")[1:])
    assert len(lines) == world, out
    for r, line in enumerate(lines):
        assert f"rank={r} world={world} sum={world * (world + 1) // 2}" in line, line
        assert "backend=distcomm group=ProcessGroupDistcomm" in line, line


@pytest.mark.parametrize("world", [1, 3])
def test_torchrun(world):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-port", str(free_port()), SCRIPT]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env())
    assert p.returncode == 0, p.stdout + p.stderr
    check(p.stdout, world)


def test_tcp_init_method():
    port = free_port()
    world = 2
    procs = [
        subprocess.Popen([sys.executable, SCRIPT, f"tcp://127.0.0.1:{port}", str(r), str(world)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
        for r in range(world)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    check("".join(o for o, _ in outs), world)


def distcomm_bin():
    for profile in ("release", "debug"):
        b = REPO / "target" / profile / "distcomm"
        if b.exists():
            return str(b)
    pytest.fail("the distcomm command is not built: run `cargo build -p distcomm-cli` first")


def test_distcomm_launch():
    world = 2
    cmd = [distcomm_bin(), "launch", "-n", str(world), "--master-port", str(free_port()), "--",
           sys.executable, SCRIPT]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env())
    assert p.returncode == 0, p.stdout + p.stderr
    check(p.stdout, world)


def _hash_store_body():
    import torch
    import torch.distributed as dist

    import distcomm.torch  # noqa: F401

    # A store object handed over directly (HashStore: in-process), as torch's own tests do.
    dist.init_process_group("distcomm", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.arange(4.0)
    dist.all_reduce(x)
    assert torch.equal(x, torch.arange(4.0))
    sub = dist.new_group([0])
    dist.all_reduce(x, group=sub)
    dist.destroy_process_group()
    # And again in the same process: a new world over a new store.
    dist.init_process_group("distcomm", store=dist.HashStore(), rank=0, world_size=1)
    dist.barrier()
    dist.destroy_process_group()
    return True


def test_hash_store_and_reinit():
    from harness import run_ranks

    assert run_ranks(lambda_free_hash_store, 1, init=None) == [True]


def lambda_free_hash_store(rank, world):
    return _hash_store_body()
