"""Rank 0 (the store's host) raises in a step and its script ends as torch asks scripts to:
``try: ... finally: dist.destroy_process_group()``; run by tests/test_misuse_edges.py as
``python fault_destroy.py PORT RANK LATE``: the peer reads rank 0's record ``LATE`` s after
its collective failed. The peer must name rank 0's error; neither prints
anything else (no exception ignored at exit, no store's C++ frames)."""

import os
import sys
import time

import torch
import torch.distributed as dist

import funshard as fs
from funshard.collectives import failures
from funshard.testing.models import MLP, mse_loss

port, rank, late = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
mesh = fs.make_mesh(timeout=20)
torch.manual_seed(0)
model = MLP(dim=5, hidden=7, layers=2, out=3)


def loss_fn(p, b):
    if rank == 0 and STEP[0] == 1:
        raise KeyError("boom on rank 0")
    return mse_loss(model)(p, b)


STEP = [0]
if late:
    explain = failures.explain

    def late_explain(*args, **kwargs):
        time.sleep(late)
        return explain(*args, **kwargs)

    failures.explain = late_explain
step = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2))
state = step.init(fs.shard(fs.params(model), mesh))
batch = (torch.randn(4, 5), torch.randn(4, 3))
try:
    for i in range(3):
        STEP[0] = i
        state, _ = step(state, batch)
finally:
    dist.destroy_process_group()
