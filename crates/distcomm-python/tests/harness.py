"""Runs a test body as N real ranks: spawned processes that rendezvous through a FileStore
(or any init_method) and run `distcomm` as their torch.distributed backend.

A rank that fails makes the test fail with that rank's traceback; a rank that hangs is killed
at the deadline and named.
"""

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback

import pytest


def _entry(fn, rank, world, init, args, q, env):
    os.environ.update(env)
    # Tools installed beside this interpreter (DeepSpeed's JIT builds call `ninja`).
    bindir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        import torch.distributed as dist

        import distcomm.torch  # noqa: F401  (registers the backend)

        if init is not None:
            dist.init_process_group("distcomm", init_method=init, rank=rank, world_size=world)
        out = fn(rank, world, *args)
        if init is not None and dist.is_initialized():
            dist.destroy_process_group()
        q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world, *args, timeout=120, init="file", env=None, expect_exit=None):
    """Runs `fn(rank, world, *args)` on `world` ranks; returns their results by rank.

    `init`: "file" (a fresh FileStore), a full init_method URL, or None (the body initialises).
    `expect_exit`: ranks allowed to die without reporting (fault tests).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="distcomm-py-")
    try:
        return _run(fn, world, args, timeout, init, env, expect_exit, ctx, q, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(fn, world, args, timeout, init, env, expect_exit, ctx, q, tmp):
    if init == "file":
        init = f"file://{tmp}/store"
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, init, args, q, dict(env or {})))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    expected = set(range(world)) - set(expect_exit or ())
    while len(results) + len(errors) < len(expected) and time.monotonic() < deadline:
        try:
            rank, status, out = q.get(timeout=0.5)
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs) and q.empty():
                break
            continue
        if status == "ok":
            results[rank] = out
        else:
            errors.append(f"rank {rank} failed:\n{out}")
    hung = [r for r in expected if r not in results and not any(e.startswith(f"rank {r} ") for e in errors)]
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout} s", pytrace=False)
    return [results.get(r) for r in range(world)]
