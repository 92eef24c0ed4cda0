#!/usr/bin/env python3
"""Same-run comparison of distcomm's TCP point-to-point with Open MPI's TCP transport (and,
optionally, PyTorch gloo), world 2: 8 B half round trip and 64 MiB ping-pong bandwidth.

    python3 scripts/compare_p2p.py [--reps 5] [--gloo /path/to/venv/bin/python]

Needs Open MPI (`apt-get install openmpi-bin libopenmpi-dev`) and ../shared/bench/mpi_bench.c.
Runs are interleaved (MPI, distcomm, MPI, ...) and the median over repetitions is reported.
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


def mpi_run(exe):
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "tcp,self", "-n", "2", exe],
        capture_output=True, text=True, check=True).stdout
    res = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) > 6 and f[2] == "pingpong":
            res[int(f[3])] = (float(f[5]), float(f[7]))
    return res


def ours_run(distcomm):
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([distcomm, "bench", "p2p", "--sizes", "8,64M", "--json", tmp.name],
                       capture_output=True, check=True)
        recs = json.load(open(tmp.name))
    return {r["bytes"]: (r["time_us"], r["algbw_gbs"]) for r in recs if r["op"] == "pingpong"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gloo", help="python with torch, to run gloo_bench.py once")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "distcomm-cli"], cwd=ROOT, check=True)
    distcomm = os.path.join(ROOT, "target", "release", "distcomm")
    mpi_exe = os.path.join(tempfile.gettempdir(), "distcomm_mpi_bench")
    subprocess.run(["mpicc", "-O2", "-o", mpi_exe, os.path.join(BENCH, "mpi_bench.c")], check=True)
    mpi, ours = [], []
    for _ in range(a.reps):
        mpi.append(mpi_run(mpi_exe))
        ours.append(ours_run(distcomm))
    med = lambda runs, size, i: statistics.median(r[size][i] for r in runs)
    lat_m, lat_o = med(mpi, 8, 0), med(ours, 8, 0)
    bw_m, bw_o = med(mpi, 64 << 20, 1), med(ours, 64 << 20, 1)
    print(f"{'metric':<34}{'distcomm':>12}{'Open MPI tcp':>14}{'ratio':>9}")
    print(f"{'8 B half round trip (us)':<34}{lat_o:>12.2f}{lat_m:>14.2f}{lat_o / lat_m:>8.2f}x")
    print(f"{'64 MiB ping-pong bandwidth (GB/s)':<34}{bw_o:>12.3f}{bw_m:>14.3f}{bw_o / bw_m:>8.2f}x")
    print(f"(median of {a.reps} interleaved runs each; distcomm reports the median iteration, "
          "mpi_bench the mean)")
    if a.gloo:
        out = subprocess.run([a.gloo, os.path.join(BENCH, "gloo_bench.py"), "2"],
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            f = line.split()
            if len(f) > 6 and f[2] == "pingpong" and f[3] in ("8", "67108864"):
                print(f"gloo pingpong {f[3]:>9} B: {f[5]} us, {f[7]} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
