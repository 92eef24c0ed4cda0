#!/usr/bin/env python3
"""Two distcomm builds against each other, op by op and size by size, in alternating runs.

    python3 scripts/ab.py --old /tmp/distcomm-old --new target/release/distcomm \
        [--world 2,4] [--transport shm|tcp] [--ops all_reduce,...,p2p] \
        [--sizes 8,1K,64K,1M,16M,64M] [--reps 3] [--json OUT]

For every (op, world) it runs `distcomm bench <op> -n <world> --sizes ... --no-check --json`
with each build, `--reps` times, alternating which goes first. Each pair gives a ratio (new
time / old time, below 1 is faster); the table shows the median ratio, its spread (min-max over
pairs) and the median times. The machines change speed from minute to minute: only ratios of
adjacent runs are compared. A point is "slower beyond noise" when even its fastest pair is
slower than the old build by more than `--noise` (default 10 %).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
       "reduce_scatter", "all_to_all", "barrier"]


def run(exe, op, world, sizes, transport):
    env = dict(os.environ, DISTCOMM_TRANSPORT=transport)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [exe, "bench", op, "--no-check", "--json", tmp.name]
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
    a = ap.parse_args()
    rows = []
    slower = 0
    print(f"# new {a.new} / old {a.old}, transport {a.transport}, {a.reps} alternating pairs")
    print(f"{'op':<16}{'world':>6}{'bytes':>10}{'old us':>12}{'new us':>12}{'ratio':>8}  spread")
    for world in map(int, a.world.split(",")):
        for op in a.ops.split(","):
            if op == "p2p" and world != 2:
                continue
            olds, news = [], []
            for rep in range(a.reps):
                order = [("old", a.old), ("new", a.new)]
                if rep % 2:
                    order.reverse()
                got = {}
                for name, exe in order:
                    got[name] = run(exe, op, world, a.sizes, a.transport)
                olds.append(got["old"])
                news.append(got["new"])
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
