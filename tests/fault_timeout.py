"""A stuck rank: run by tests/test_faults.py as ``python fault_timeout.py PORT RANK [WHEN]``;
WHEN ``later``: both ranks gather once first (the transport's handshake is done), then one
is stuck."""

import os
import sys
import time

import torch

import funshard as fs

port, rank = int(sys.argv[1]), int(sys.argv[2])
os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
mesh = fs.make_mesh(timeout=2)
s = fs.shard({"w": torch.randn(8, 4)}, mesh)
if sys.argv[3:] == ["later"]:
    fs.unshard(s)
if rank == 1:
    time.sleep(20)  # stuck: never joins the all-gather
    sys.exit(0)
t = time.monotonic()
try:
    fs.unshard(s)
except fs.CollectiveTimeout as e:
    print(f"TIMEOUT after {time.monotonic() - t:.1f}s: {e}", flush=True)
    os._exit(0)
print("NO ERROR", flush=True)
os._exit(1)
