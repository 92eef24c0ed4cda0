#!/usr/bin/env python3
"""Same-run comparison of distcomm's TCP transport with Open MPI's TCP transport (and,
optionally, PyTorch gloo) on this machine.

    python3 scripts/compare.py p2p [--reps 5] [--gloo /path/to/venv/bin/python]
    python3 scripts/compare.py all_reduce --world 4 [--reps 3] [--gloo ...]

p2p: 8 B half round trip and 64 MiB ping-pong bandwidth, world 2.
all_reduce: time at 8 B and bus bandwidth at 64 MiB, world N.

Needs Open MPI (`apt-get install openmpi-bin libopenmpi-dev`) and ../shared/bench/mpi_bench.c.
Runs are interleaved (MPI, distcomm, MPI, ...) and the median over repetitions is reported.
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
BIG = 64 << 20


def mpi_run(exe, world, op):
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "tcp,self",
         "-n", str(world), exe], capture_output=True, text=True, check=True).stdout
    res = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) > 7 and f[2] == op:
            size = int(f[3])
            res[size] = (float(f[5]), float(f[-1]) if op == "allreduce" else float(f[7]))
    return res


def ours_run(distcomm, world, suite):
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([distcomm, "bench", suite, "-n", str(world), "--sizes", "8,64M",
                        "--json", tmp.name], capture_output=True, check=True)
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
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "distcomm-cli"], cwd=ROOT, check=True)
    distcomm = os.path.join(ROOT, "target", "release", "distcomm")
    mpi_exe = os.path.join(tempfile.gettempdir(), "distcomm_mpi_bench")
    subprocess.run(["mpicc", "-O2", "-o", mpi_exe, os.path.join(BENCH, "mpi_bench.c")], check=True)
    mop = "pingpong" if a.suite == "p2p" else "allreduce"
    world = 2 if a.suite == "p2p" else a.world
    mpi, ours = [], []
    for _ in range(a.reps):
        mpi.append(mpi_run(mpi_exe, world, mop))
        ours.append(ours_run(distcomm, world, a.suite))
    med = lambda runs, size, i: statistics.median(r[size][i] for r in runs)
    small = ("8 B half round trip (us)" if a.suite == "p2p" else "8 B all_reduce time (us)")
    big = ("64 MiB ping-pong bandwidth (GB/s)" if a.suite == "p2p" else "64 MiB all_reduce busbw (GB/s)")
    rows = [(small, med(ours, 8, 0), med(mpi, 8, 0)), (big, med(ours, BIG, 1), med(mpi, BIG, 1))]
    gloo = gloo_run(a.gloo, world, mop) if a.gloo else None
    print(f"world {world}, {a.reps} interleaved runs each")
    head = f"{'metric':<36}{'distcomm':>10}{'OMPI tcp':>10}{'ratio':>8}"
    if gloo:
        head += f"{'gloo':>10}{'ratio':>8}"
    print(head)
    for i, (name, o, m) in enumerate(rows):
        line = f"{name:<36}{o:>10.3f}{m:>10.3f}{o / m:>7.2f}x"
        if gloo:
            g = gloo[8][0] if i == 0 else gloo[BIG][1]
            line += f"{g:>10.3f}{o / g:>7.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
