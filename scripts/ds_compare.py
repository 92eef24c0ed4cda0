#!/usr/bin/env python3
"""distcomm's all_reduce against DeepSpeed's own CPU shared-memory kernel
(`deepspeed.comm.inference_all_reduce`, ../shared/bench/ds_shm_bench.py), 16-bit and f32, in
alternating runs on this host.

    python3 scripts/ds_compare.py --venv /tmp/tv [--pairs 3] [--world 2] [--sizes 8,64K,32M]
        [--dtypes bf16,f16,f32]

The venv needs torch, deepspeed and ninja (`python3 -m venv /tmp/tv && /tmp/tv/bin/pip install
torch deepspeed ninja`). Each pair runs `distcomm bench all_reduce -n W --dtype D` (shared
memory) and `torchrun --nproc-per-node W ds_shm_bench.py --dtype D`, alternating which goes
first; the ratio is distcomm's time over DeepSpeed's, the median of per-pair ratios, each pair's
ratio in brackets. On a CPU without AVX-512 DeepSpeed's 16-bit calls go through gloo (its
`vector_kernel_level` decides); its f32 kernel is its real one.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DS_BENCH = os.path.join(ROOT, "..", "shared", "bench", "ds_shm_bench.py")
TORCH_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def ds_run(venv, world, dtype, sizes, tries=3):
    """DeepSpeed's times by size. Its processes sometimes abort at teardown, after printing
    every result ("terminate called without an active exception"): such a run counts when it
    printed a time for every size; a run that did not is tried again, `tries` times in all."""
    env = dict(os.environ, PATH=os.path.join(venv, "bin") + ":" + os.environ["PATH"],
               DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world))
    for _ in range(tries):
        p = subprocess.run([os.path.join(venv, "bin", "torchrun"), "--nproc-per-node",
                            str(world), DS_BENCH, "--dtype", TORCH_DTYPE[dtype], "--sizes", sizes],
                           capture_output=True, text=True, env=env, timeout=1800)
        got = {int(line.split("bytes=")[1].split()[0]): float(line.split("time_us=")[1])
               for line in p.stdout.splitlines() if line.startswith("ds_shm")}
        if len(got) == len(sizes.split(",")):
            if p.returncode != 0:
                print(f"(DeepSpeed's {dtype} run exited with {p.returncode} after printing every "
                      "result; counted)", file=sys.stderr)
            return got
    sys.exit(f"DeepSpeed's benchmark failed ({dtype}, {tries} tries; the venv needs torch, "
             f"deepspeed and ninja):\n{p.stderr[-3000:]}")


def ours_run(distcomm, world, dtype, sizes):
    env = dict(os.environ, DISTCOMM_TRANSPORT="shm")
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        subprocess.run([distcomm, "bench", "all_reduce", "-n", str(world), "--dtype", dtype,
                        "--sizes", sizes, "--no-check", "--json", tmp.name],
                       capture_output=True, check=True, env=env, timeout=1800)
        return {int(r["bytes"]): float(r["time_us"]) for r in json.load(open(tmp.name))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--venv", required=True, help="a venv with torch, deepspeed and ninja")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="8,64K,32M")
    ap.add_argument("--dtypes", default="bf16,f16,f32")
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "distcomm-cli"], cwd=ROOT, check=True)
    distcomm = os.path.join(ROOT, "target", "release", "distcomm")
    print(f"world {a.world}, shared memory, {a.pairs} alternating pairs: distcomm / DeepSpeed "
          "inference_all_reduce time (median of per-pair ratios; < 1 = distcomm faster)")
    for dtype in a.dtypes.split(","):
        pairs = {}
        for i in range(a.pairs):
            if i % 2 == 0:
                ours = ours_run(distcomm, a.world, dtype, a.sizes)
                ds = ds_run(a.venv, a.world, dtype, a.sizes)
            else:
                ds = ds_run(a.venv, a.world, dtype, a.sizes)
                ours = ours_run(distcomm, a.world, dtype, a.sizes)
            for size, t in ours.items():
                # DeepSpeed rounds a size to whole elements: take its nearest.
                near = min(ds, key=lambda s: abs(s - size))
                pairs.setdefault(size, []).append((t, ds[near]))
        for size, v in sorted(pairs.items()):
            ratios = [x / y for x, y in v]
            print(f"{dtype:<5}{size:>10} distcomm {statistics.median(x for x, _ in v):10.2f} us  "
                  f"DS {statistics.median(y for _, y in v):10.2f} us  ratio "
                  f"{statistics.median(ratios):.2f} {[round(r, 2) for r in ratios]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
