"""A torch program that never imports distcomm: torch finds the backend through the package's
entry point. Prints one line per rank that the launcher tests check."""

import os
import sys

import torch
import torch.distributed as dist

init = sys.argv[1] if len(sys.argv) > 1 else "env://"
kwargs = {}
if init.startswith("tcp://"):
    kwargs = {"rank": int(sys.argv[2]), "world_size": int(sys.argv[3])}
dist.init_process_group("distcomm", init_method=init, **kwargs)
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((4,), float(rank + 1))
dist.all_reduce(x)
objs = [None] * world
dist.all_gather_object(objs, rank)
pg = dist.group.WORLD
# One write(2) of the whole line: ranks share the launcher's stdout pipe, and print()'s separate
# writes of text and newline can interleave with another rank's.
line = (f"OK rank={rank} world={world} sum={x[0].item():g} objs={objs} backend={dist.get_backend()} "
        f"group={type(pg).__name__}\n")
sys.stdout.flush()
os.write(sys.stdout.fileno(), line.encode())
dist.destroy_process_group()
