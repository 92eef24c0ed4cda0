#!/usr/bin/env python3
"""Open MPI's collective benchmark behind `distcomm bench`'s command line: the noise floor.

    python3 ../shared/bench/coll_compare.py --distcomm scripts/ompi_as_distcomm.py \
        --world 2,4 --transport tcp --ops broadcast --sizes 8,1K --reps 10

coll_compare.py runs `<distcomm> bench <op> -n <world> --sizes <sizes> --no-check --json <out>`
with DISTCOMM_TRANSPORT set. This script answers that call with Open MPI's `mpi_coll_bench`
(the same binary coll_compare.py builds in the temp directory) and writes its times in
distcomm's JSON shape, so the table compares Open MPI with itself in alternating pairs. Its
ratios show how far from 1.0 a point strays on this machine when nothing differs at all: a
distcomm ratio inside that spread is not a measured difference.
"""
import json
import os
import sys
import tempfile

# Open MPI's side of the comparison, exactly as coll_compare.py runs and parses it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                                "bench"))
from coll_compare import mpi_run  # noqa: E402


def main():
    a = sys.argv[1:]
    if len(a) < 2 or a[0] != "bench":
        sys.exit("usage: ompi_as_distcomm.py bench OP -n WORLD --sizes SIZES [--no-check] --json OUT")
    op = a[1]
    world = int(a[a.index("-n") + 1])
    sizes = a[a.index("--sizes") + 1]
    out = a[a.index("--json") + 1]
    exe = os.path.join(tempfile.gettempdir(), "mpi_coll_bench")
    times = mpi_run(exe, world, [op], sizes, os.environ.get("DISTCOMM_TRANSPORT", "shm"))
    rows = [{"op": o, "bytes": b, "time_us": t} for (o, b), t in times.items()]
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
