#!/usr/bin/env python3
"""distcomm against Open MPI at single (op, size) points, with many timed repetitions per run.

    python3 scripts/point_compare.py --ops reduce,scatter --world 2 --size 8 \
        [--transport shm|tcp] [--pairs 10] [--inner 10] [--distcomm target/release/distcomm]

`coll_compare.py` (../shared/bench) times each point once per run, so one scheduler hiccup in a
run of a few milliseconds moves a pair's ratio by tens of percent. Here every run repeats the
point `--inner` times (`--sizes S,S,...` for both programs) and keeps the median; runs of the two
alternate, `--pairs` times, and the ratio reported is the median of per-pair ratios (distcomm
time / Open MPI time, below 1 is faster), with its spread and how many pairs were at or below 1.
Open MPI runs `mpi_coll_bench` as `coll_compare.py` builds it (/tmp/mpi_coll_bench).

`--caches shared|separate` keeps only pairs run while the two vCPUs of a 2-rank job share a
core's caches or not, read before and after the pair as `scripts/ab.py --caches` does (these
machines switch between the two from minute to minute, and both libraries' small and mid-size
points move by up to 2x, or 4x for distcomm's all_reduce of 4 KiB - 1 MiB, with it); up to 30
tries per pair kept.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "bench"))
from coll_compare import BTL  # noqa: E402
from ab import caches_now, limits_exe  # noqa: E402


def mpi_times(exe, op, world, sizes, transport):
    out = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl",
                          BTL[transport], "-n", str(world), exe, op, sizes],
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    return [float(l.split("time_us=")[1].split()[0]) for l in out.splitlines()
            if l.startswith("mpi_coll ")]


def distcomm_times(exe, op, world, sizes, transport):
    env = dict(os.environ, DISTCOMM_TRANSPORT=transport)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([exe, "bench", op, "-n", str(world), "--sizes", sizes, "--no-check",
                        "--json", tmp.name], capture_output=True, check=True, env=env, timeout=1800)
        return [float(r["time_us"]) for r in json.load(open(tmp.name))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ops", required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", required=True, help="bytes, suffixes K and M allowed")
    ap.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--distcomm", default="target/release/distcomm")
    ap.add_argument("--mpi-bench", default=os.path.join(tempfile.gettempdir(), "mpi_coll_bench"))
    ap.add_argument("--caches", choices=["shared", "separate"],
                    help="keep only pairs run in this cache mode (see above)")
    a = ap.parse_args()
    limits = limits_exe() if a.caches else None
    in_mode = lambda: limits is None or caches_now(limits) == a.caches  # noqa: E731
    sizes = ",".join([a.size] * a.inner)
    run = {"distcomm": lambda op: distcomm_times(a.distcomm, op, a.world, sizes, a.transport),
           "mpi": lambda op: mpi_times(a.mpi_bench, op, a.world, sizes, a.transport)}
    for op in a.ops.split(","):
        ratios, ours, theirs = [], [], []
        tries = 0
        while len(ratios) < a.pairs and tries < 30 * a.pairs:
            tries += 1
            if not in_mode():
                time.sleep(2)
                continue
            got = {k: statistics.median(run[k](op))
                   for k in (["distcomm", "mpi"] if tries % 2 else ["mpi", "distcomm"])}
            if not in_mode():
                continue
            ratios.append(got["distcomm"] / got["mpi"])
            ours.append(got["distcomm"])
            theirs.append(got["mpi"])
        if not ratios:
            print(f"{op:15s} world {a.world} {a.size:>5s}: no pair in the {a.caches} cache mode")
            continue
        mode = f", {a.caches} caches" if a.caches else ""
        print(f"{op:15s} world {a.world} {a.size:>5s} {a.transport}{mode}: "
              f"{statistics.median(ratios):.3f}x (pairs {min(ratios):.2f}-{max(ratios):.2f}, "
              f"{sum(r <= 1 for r in ratios)}/{len(ratios)} at or below 1; "
              f"distcomm {statistics.median(ours):.3f} us, Open MPI {statistics.median(theirs):.3f} us)",
              flush=True)


if __name__ == "__main__":
    main()
