#!/usr/bin/env python3
"""Same-run comparison of distcomm with Open MPI on this machine, transport against transport
(TCP with TCP, shared memory with shared memory), and optionally PyTorch gloo.

    python3 scripts/compare.py p2p [--transport tcp|shm] [--reps 5] [--gloo /venv/bin/python] [--handles]
    python3 scripts/compare.py all_reduce --world 4 [--transport shm] [--sizes 8,1M,64M] [--reps 3]

p2p: half round trip and ping-pong bandwidth, world 2 (`--handles`: both with nonblocking calls
at every size, `distcomm bench p2p --handles` against scripts/mpi_handles.c's MPI_Isend/
MPI_Irecv/MPI_Wait; otherwise blocking calls up to 1 KiB against MPI_Send/MPI_Recv). all_reduce: time and bus bandwidth, world
N. Every size in --sizes (default 8,64M) gets both columns.

Needs Open MPI (`apt-get install openmpi-bin libopenmpi-dev`) and ../shared/bench/mpi_bench.c.
Runs alternate in pairs (which of the two goes first alternates too); the table shows the
median time of each and the median of per-pair ratios.
distcomm's pingpong reports the median iteration, its all_reduce the mean over the timed loop
(slowest rank); mpi_bench reports means on rank 0.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "..", "shared", "bench")


BTL = {"tcp": "tcp,self", "shm": "vader,self"}


def mpi_run(exe, world, op, transport):
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", BTL[transport],
         "-n", str(world), exe], capture_output=True, text=True, check=True).stdout
    res = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) > 7 and f[2] == op:
            size = int(f[3])
            res[size] = (float(f[5]), float(f[-1]) if op == "allreduce" else float(f[7]))
    return res


def ours_run(distcomm, world, suite, transport, sizes, extra=()):
    env = dict(os.environ, DISTCOMM_TRANSPORT=transport)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([distcomm, "bench", suite, "-n", str(world), "--sizes", sizes,
                        "--json", tmp.name, *extra], capture_output=True, check=True, env=env)
        recs = json.load(open(tmp.name))
    op = "pingpong" if suite == "p2p" else suite
    return {r["bytes"]: (r["time_us"], r["busbw_gbs"]) for r in recs if r["op"] == op}


def gloo_run(python, world, op):
    out = subprocess.run([python, os.path.join(BENCH, "gloo_bench.py"), str(world)],
                         capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) > 7 and f[2] == op:
            res[int(f[3])] = (float(f[5]), float(f[-1]) if op == "allreduce" else float(f[7]))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("suite", choices=["p2p", "all_reduce"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gloo", help="python with torch, to run gloo_bench.py once")
    ap.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    ap.add_argument("--sizes", default="8,64M", help="sizes known to mpi_bench (8,1K,64K,1M,16M,64M)")
    ap.add_argument("--handles", action="store_true",
                    help="p2p with nonblocking calls (isend/irecv + wait) on both sides")
    a = ap.parse_args()
    if a.handles and a.suite != "p2p":
        ap.error("--handles applies to p2p only")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "distcomm-cli"], cwd=ROOT, check=True)
    distcomm = os.path.join(ROOT, "target", "release", "distcomm")
    src = (os.path.join(ROOT, "scripts", "mpi_handles.c") if a.handles
           else os.path.join(BENCH, "mpi_bench.c"))
    mpi_exe = os.path.join(tempfile.gettempdir(),
                           "distcomm_mpi_handles" if a.handles else "distcomm_mpi_bench")
    subprocess.run(["mpicc", "-O2", "-o", mpi_exe, src], check=True)
    extra = ["--handles"] if a.handles else []
    mop = "pingpong" if a.suite == "p2p" else "allreduce"
    world = 2 if a.suite == "p2p" else a.world
    mpi, ours = [], []
    for k in range(a.reps):
        # Alternating which goes first, so that neither always runs on a host just warmed up.
        if k % 2 == 0:
            mpi.append(mpi_run(mpi_exe, world, mop, a.transport))
        ours.append(ours_run(distcomm, world, a.suite, a.transport, a.sizes, extra))
        if k % 2 == 1:
            mpi.append(mpi_run(mpi_exe, world, mop, a.transport))
    med = lambda runs, size, i: statistics.median(r[size][i] for r in runs)
    # The host changes speed from minute to minute: compare each run with its neighbour.
    pair_ratio = lambda size, i: statistics.median(
        o[size][i] / m[size][i] for o, m in zip(ours, mpi) if m[size][i])
    gloo = gloo_run(a.gloo, world, mop) if a.gloo else None
    sizes = sorted(ours[0])
    what = "half round trip" if a.suite == "p2p" else "all_reduce time"
    bw = "ping-pong bandwidth" if a.suite == "p2p" else "all_reduce busbw"
    calls = ", nonblocking calls (handles)" if a.handles else ""
    print(f"world {world}, {a.transport}{calls}, {a.reps} alternating pairs (median times; ratio: "
          f"median of per-pair ratios)")
    head = f"{'metric':<40}{'distcomm':>10}{'OMPI ' + a.transport:>10}{'ratio':>8}"
    if gloo:
        head += f"{'gloo':>10}{'ratio':>8}"
    print(head)
    for size in sizes:
        label = f"{size} B" if size < 1024 else (f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB")
        for i, name in ((0, f"{label} {what} (us)"), (1, f"{label} {bw} (GB/s)")):
            if i == 1 and size < 1024:
                continue
            o, m = med(ours, size, i), med(mpi, size, i)
            line = f"{name:<40}{o:>10.3f}{m:>10.3f}{pair_ratio(size, i):>7.2f}x"
            if gloo and size in gloo:
                g = gloo[size][i]
                line += f"{g:>10.3f}{(o / g if g else 0):>7.2f}x"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
