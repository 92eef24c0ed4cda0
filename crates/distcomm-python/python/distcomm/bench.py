"""Torch-level benchmark: every torch.distributed op through the torch API, on distcomm and on
gloo, in the same run, alternating.

    python -m distcomm.bench [--world 2] [--backends distcomm,gloo] [--ops all_reduce,...]
                             [--sizes 8,64K,64M] [--dtype float32] [--repeat 3] [--json FILE]

What is timed (nccl-tests conventions, as `distcomm bench`): S is the bytes of one rank's
buffer; each point is the slowest rank's mean over clamp(256 MiB / S, 5, 2000) blocking calls
after 3 warm-up calls (`pingpong`: half a round trip between ranks 0 and 1, `send`/`recv`);
busbw = algbw x the nccl-tests factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
all_to_all (n-1)/n with S the whole output; the others 1). Every backend runs in its own
freshly spawned ranks; with --repeat R the backends alternate R times and the median is
reported, with the ratio to the first backend. (DeepSpeed's shared-memory all_reduce kernel is
timed by its own peer script, ``../shared/bench/ds_shm_bench.py`` under torchrun: started from
here, its ranks ran it ~100x slower than that script does.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

OPS = [
    "pingpong", "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier",
]


def _size(s):
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1].upper()] if s[-1].upper() in m else int(s)


def _human(n):
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def _factor(op, n):
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
              "all_to_all", "all_to_all_single"):
        return (n - 1) / n
    return 1.0


def _calls(op, rank, n, S, dtype):
    """The callable timed for `op` on a per-rank buffer of S bytes, and the bytes it reports."""
    import torch
    import torch.distributed as dist

    e = max(S // dtype.itemsize, 1)
    t = torch.ones(e, dtype=dtype)
    if op == "pingpong":
        peer = 1 - rank

        def f():
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
        return f, t.nbytes, 2
    if op == "all_reduce":
        return (lambda: dist.all_reduce(t)), t.nbytes, 1
    if op == "broadcast":
        return (lambda: dist.broadcast(t, 0)), t.nbytes, 1
    if op == "reduce":
        return (lambda: dist.reduce(t, 0)), t.nbytes, 1
    if op == "barrier":
        return dist.barrier, 0, 1
    # Ops whose S is the whole output (nccl-tests): each rank contributes S / n.
    k = max(e // n, 1)
    part = torch.ones(k, dtype=dtype)
    whole = torch.ones(k * n, dtype=dtype)
    parts = [torch.ones(k, dtype=dtype) for _ in range(n)]
    if op == "all_gather":
        return (lambda: dist.all_gather(parts, part)), whole.nbytes, 1
    if op == "all_gather_into_tensor":
        return (lambda: dist.all_gather_into_tensor(whole, part)), whole.nbytes, 1
    if op == "gather":
        return (lambda: dist.gather(part, parts if rank == 0 else None, 0)), whole.nbytes, 1
    if op == "scatter":
        return (lambda: dist.scatter(part, parts if rank == 0 else None, 0)), whole.nbytes, 1
    if op == "reduce_scatter":
        return (lambda: dist.reduce_scatter(part, parts)), whole.nbytes, 1
    if op == "reduce_scatter_tensor":
        return (lambda: dist.reduce_scatter_tensor(part, whole)), whole.nbytes, 1
    if op == "all_to_all":
        outs = [torch.ones(k, dtype=dtype) for _ in range(n)]
        return (lambda: dist.all_to_all(outs, parts)), whole.nbytes, 1
    if op == "all_to_all_single":
        out = torch.ones(k * n, dtype=dtype)
        return (lambda: dist.all_to_all_single(out, whole)), whole.nbytes, 1
    raise ValueError(f"unknown op {op}")


def _rank_main(rank, world, backend, init, ops, sizes, dtype_name, q):
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    if backend == "distcomm":
        import distcomm.torch  # noqa: F401
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    rows = []
    for op in ops:
        if op == "pingpong" and world < 2:
            continue
        for S in sizes if op != "barrier" else [0]:
            f, nbytes, per_call = _calls(op, rank, world, S, dtype)
            iters = max(5, min(2000, (256 << 20) // max(nbytes, 1)))
            for _ in range(3):
                f()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            mine = torch.tensor([(time.perf_counter() - t0) / iters / per_call], dtype=torch.float64)
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            rows.append(dict(op=op, bytes=nbytes,
                             iters=iters, time_us=mine.item() * 1e6))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def run_backend(backend, world, ops, sizes, dtype):
    """Spawns `world` ranks on `backend`; returns rank 0's rows."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tempfile.mkdtemp(prefix='distcomm-bench-')}/store"
    procs = [ctx.Process(target=_rank_main, args=(r, world, backend, init, ops, sizes, dtype, q))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=3600)
    for p in procs:
        p.join()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m distcomm.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backends", default="distcomm,gloo")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default="8,1K,64K,1M,16M,64M")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", help="write every record here")
    a = ap.parse_args(argv)
    # DeepSpeed's JIT build and our spawned ranks find tools beside this interpreter.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    backends = a.backends.split(",")
    ops = [o for o in a.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        ap.error(f"unknown ops {unknown}; choose from {','.join(OPS)}")
    sizes = [_size(s) for s in a.sizes.split(",")]
    runs = {b: [] for b in backends}
    for _ in range(a.repeat):
        for b in backends:
            runs[b].append(run_backend(b, a.world, ops, sizes, a.dtype))
    table = {}
    for b, reps in runs.items():
        for rows in reps:
            for r in rows:
                table.setdefault((r["op"], r["bytes"]), {}).setdefault(b, []).append(r)
    print(f"# distcomm.bench: world {a.world}, dtype {a.dtype}, backends {','.join(backends)}, "
          f"{a.repeat} alternating run(s), median shown")
    print("# time(us): slowest rank's mean per call (pingpong: half round trip); "
          "busbw by the nccl-tests factors; ratio: this backend's time / the first's")
    print(f"# {'op':>22} {'size':>8} {'backend':>9} {'iters':>6} {'time(us)':>11} "
          f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'ratio':>7}")
    records = []
    for (op, nbytes), per in sorted(table.items(), key=lambda kv: (OPS.index(kv[0][0]), kv[0][1])):
        base = None
        for b in backends:
            if b not in per:
                continue
            t = statistics.median(r["time_us"] for r in per[b])
            base = t if base is None else base
            algbw = nbytes / (t * 1e-6) / 1e9 if t > 0 and nbytes else 0.0
            busbw = algbw * _factor(op, a.world)
            ratio = t / base if base else 1.0
            print(f"  {op:>22} {_human(nbytes):>8} {b:>9} {per[b][0]['iters']:>6} {t:>11.2f} "
                  f"{algbw:>12.3f} {busbw:>12.3f} {ratio:>7.2f}")
            records.append(dict(op=op, bytes=nbytes, backend=b, world=a.world, dtype=a.dtype,
                                iters=per[b][0]["iters"], time_us=t, algbw_gbs=algbw,
                                busbw_gbs=busbw, runs=[r["time_us"] for r in per[b]]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"# wrote {len(records)} records to {a.json}")


if __name__ == "__main__":
    main()
