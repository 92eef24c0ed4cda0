#!/usr/bin/env python3
"""PyTorch gloo's all_reduce of 16-bit floats (the peer of distcomm's over TCP).

    python scripts/gloo_half_bench.py WORLD [bfloat16|float16] [SIZES]

SIZES: bytes per rank, comma separated (default 65536,1048576,16777216). Starts WORLD local
ranks (torch.multiprocessing) and prints one line per size, `gloo16 <dtype> <bytes> <us>`: the
slowest rank's mean time per call. Alternate it with
`DISTCOMM_TRANSPORT=tcp distcomm bench all_reduce -n WORLD --dtype bf16 --sizes 64K,1M,16M`
and compare per pair. Needs torch (a venv outside the repo, as scripts/python-tests.sh makes).
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, port, dtype, sizes):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for size in sizes:
        t = torch.ones(size // 2, dtype=dtype)
        iters = max(5, min(200, (64 << 20) // size))
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        took = torch.tensor([(time.perf_counter() - t0) / iters])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"gloo16 {dtype} {size} {took.item() * 1e6:.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1])
    dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
    sizes = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "65536,1048576,16777216").split(",")]
    mp.spawn(run, args=(world, 29000 + os.getpid() % 1000, dtype, sizes), nprocs=world)
