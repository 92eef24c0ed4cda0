"""PyTorch's TCPStore client against distcomm's store server.

Run under distcomm's launcher, which hosts the store (torch is needed here, never by the test suite):

    distcomm launch -n 2 -- python scripts/torch_store_client.py
"""
import datetime
import os

import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(
    os.environ["MASTER_ADDR"],
    int(os.environ["MASTER_PORT"]),
    is_master=False,
    timeout=datetime.timedelta(seconds=30),
)
store.set(f"torch/k{rank}", f"v{rank}")
for r in range(world):
    assert store.get(f"torch/k{r}") == f"v{r}".encode()
total = store.add("torch/counter", 1)
assert 1 <= total <= world
store.wait([f"torch/k{r}" for r in range(world)])
try:
    store.wait(["torch/never"], datetime.timedelta(milliseconds=200))
    raise SystemExit("wait on a missing key did not time out")
except Exception as e:  # DistStoreError (a RuntimeError subclass)
    assert "timeout" in str(e).lower() or "timed out" in str(e).lower(), e
# The connection is still in sync after the cancelled wait.
assert store.get(f"torch/k{rank}") == f"v{rank}".encode()
assert store.compare_set(f"torch/cs{rank}", "", "a") == b"a"
assert store.compare_set(f"torch/cs{rank}", "a", "b") == b"b"
store.append(f"torch/app{rank}", "x")
store.append(f"torch/app{rank}", "y")
assert store.get(f"torch/app{rank}") == b"xy"
store.multi_set([f"torch/m{rank}a", f"torch/m{rank}b"], ["1", "2"])
assert store.multi_get([f"torch/m{rank}a", f"torch/m{rank}b"]) == [b"1", b"2"]
assert store.check([f"torch/k{rank}"]) and not store.check(["torch/never"])
assert store.delete_key(f"torch/m{rank}a") and not store.delete_key(f"torch/m{rank}a")
assert store.num_keys() > 0
print(f"rank {rank}: torch TCPStore client OK against distcomm's server")
