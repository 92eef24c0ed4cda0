#!/usr/bin/env python3
"""Two distcomm builds against each other, op by op and size by size, in alternating runs.

    python3 scripts/ab.py --old /tmp/distcomm-old --new target/release/distcomm \
        [--world 2,4] [--transport shm|tcp] [--ops all_reduce,...,p2p] \
        [--sizes 8,1K,64K,1M,16M,64M] [--reps 3] [--json OUT] [--bench-args="--handles"]
        [--caches shared|separate]

For every (op, world) it runs `distcomm bench <op> -n <world> --sizes ... --no-check --json`
with each build, `--reps` times, alternating which goes first. Each pair gives a ratio (new
time / old time, below 1 is faster); the table shows the median ratio, its spread (min-max over
pairs) and the median times. The machines change speed from minute to minute: only ratios of
adjacent runs are compared. A point is "slower beyond noise" when even its fastest pair is
slower than the old build by more than `--noise` (default 10 %).

`--bench-args` passes more arguments to every `distcomm bench` run (`--handles`, `--dtype bf16`).
`--caches` keeps only pairs run while the two CPUs of a 2-rank job share a core's caches
(`shared`) or not (`separate`), as `../shared/bench/limits shm-lat` reads the cache-line round
trip before and after the pair (< 200 ns shared, >= 250 ns separate; these VMs switch between
the two from minute to minute); other pairs are run again, up to 30 tries per pair kept
(a try in the wrong mode waits 2 s).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
       "reduce_scatter", "all_to_all", "barrier"]


LIMITS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared",
                      "bench", "limits")


def caches_now(limits):
    """'shared' or 'separate' by the cache-line round trip, or None in between."""
    out = subprocess.run([limits, "shm-lat"], capture_output=True, text=True, check=True).stdout
    rtt = float(out.split("median ")[1].split(" ns")[0])
    return "shared" if rtt < 200 else "separate" if rtt >= 250 else None


def limits_exe():
    """Builds ../shared/bench/limits into the temp dir; returns the path of its binary."""
    target = os.path.join(tempfile.gettempdir(), "distcomm_limits")
    subprocess.run(["cargo", "build", "--release", "-q", "--target-dir", target], cwd=LIMITS,
                   check=True)
    return os.path.join(target, "release", "limits")


def run(exe, op, world, sizes, transport, extra=()):
    env = dict(os.environ, DISTCOMM_TRANSPORT=transport)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [exe, "bench", op, "--no-check", "--json", tmp.name, *extra]
        if op != "p2p":
            cmd += ["-n", str(world)]
        cmd += ["--sizes", sizes]
        subprocess.run(cmd, capture_output=True, check=True, env=env, timeout=1800)
        return {(r["op"], int(r["bytes"])): float(r["time_us"]) for r in json.load(open(tmp.name))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--world", default="2")
    ap.add_argument("--transport", choices=["tcp", "shm"], default="shm")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--sizes", default="8,1K,64K,1M,16M,64M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--noise", type=float, default=0.10)
    ap.add_argument("--json")
    ap.add_argument("--bench-args", default="", help="more arguments for every distcomm bench run")
    ap.add_argument("--caches", choices=["shared", "separate"],
                    help="keep only pairs run in this cache mode (see above)")
    a = ap.parse_args()
    extra = shlex.split(a.bench_args)
    limits = limits_exe() if a.caches else None
    rows = []
    slower = 0
    print(f"# new {a.new} / old {a.old}, transport {a.transport}, {a.reps} alternating pairs")
    print(f"{'op':<16}{'world':>6}{'bytes':>10}{'old us':>12}{'new us':>12}{'ratio':>8}  spread")
    for world in map(int, a.world.split(",")):
        for op in a.ops.split(","):
            if op == "p2p" and world != 2:
                continue
            olds, news = [], []
            tries = 0
            while len(olds) < a.reps and tries < 30 * a.reps:
                tries += 1
                if limits and caches_now(limits) != a.caches:
                    time.sleep(2)  # the mode lasts minutes: look again a little later
                    continue
                order = [("old", a.old), ("new", a.new)]
                if tries % 2:
                    order.reverse()
                got = {}
                for name, exe in order:
                    got[name] = run(exe, op, world, a.sizes, a.transport, extra)
                if limits and caches_now(limits) != a.caches:
                    continue
                olds.append(got["old"])
                news.append(got["new"])
            if not olds:
                print(f"{op:<16}{world:>6}  no pair in the {a.caches} cache mode", flush=True)
                continue
            for key in sorted(olds[0], key=lambda k: (k[0], k[1])):
                name, size = key
                ratios = [n[key] / o[key] for o, n in zip(olds, news) if key in n and o[key] > 0]
                if not ratios:
                    continue
                r = statistics.median(ratios)
                beyond = min(ratios) > 1 + a.noise
                slower += beyond
                row = {"op": name, "world": world, "bytes": size, "ratio": r,
                       "min": min(ratios), "max": max(ratios),
                       "old_us": statistics.median(o[key] for o in olds),
                       "new_us": statistics.median(n[key] for n in news if key in n)}
                rows.append(row)
                mark = "  SLOWER" if beyond else ""
                print(f"{name:<16}{world:>6}{size:>10}{row['old_us']:>12.2f}{row['new_us']:>12.2f}"
                      f"{r:>8.2f}  {min(ratios):.2f}-{max(ratios):.2f}{mark}", flush=True)
    print(f"# {len(rows)} points, {slower} slower beyond noise (every pair > {1 + a.noise:.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
