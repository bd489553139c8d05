"""One rank fails or misbehaves; run by tests/test_catalogue.py as
``python fault_rank.py MODE PORT RANK WORLD [DIR]`` with make_mesh(timeout=TIMEOUT).

Each rank prints one line, ``RAISED <time.time()> <type>: <message>`` or ``NO ERROR``, then
exits as an uncaught error would (the failing rank's process ends, as under torchrun). Modes:
see MODES below.
"""

import os
import sys
import time

import torch

import funshard as fs
from funshard.testing.models import MLP, mse_loss

TIMEOUT = float(os.environ.get("FUNSHARD_FAULT_TIMEOUT", "20"))
mode, port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
base = sys.argv[5] if len(sys.argv) > 5 else None
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
mesh = fs.make_mesh(timeout=TIMEOUT)
torch.manual_seed(0)
model = MLP(dim=5, hidden=7, layers=3, out=3)
g = torch.Generator().manual_seed(rank + 1)
batch = (torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g))
FAILING = int(os.environ.get("FUNSHARD_FAILING", "1"))


def loss_fn(p, b):
    if mode == "loss_raises" and rank == FAILING and STEP[0] == 2:
        raise KeyError("boom in loss_fn")
    if mode.startswith("caught_") and STEP[0] == 2 and (rank == FAILING or mode == "caught_alike"):
        loss = mse_loss(model)(p, b)  # forward: every group gathered, as on every rank
        raise KeyError(f"boom in loss_fn, after forward ({loss.shape})")
    if mode == "loss_branch" and rank == FAILING and STEP[0] == 2:
        swap = {"layers.0.0": "layers.1.0", "layers.1.0": "layers.0.0"}  # another branch
        q = {swap.get(k.rsplit(".", 1)[0], k.rsplit(".", 1)[0]) + "." + k.rsplit(".", 1)[1]: v
             for k, v in p.items()}
        return mse_loss(model)(q, b)
    return mse_loss(model)(p, b)


STEP = [0]
step = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2))
state = step.init(fs.shard(fs.params(model), mesh))


def run():
    global state
    for i in range(4):
        STEP[0] = i
        if mode == "skip_step" and rank == FAILING and i == 2:
            continue
        if mode == "save_instead" and rank == FAILING and i == 2:
            fs.checkpoint.save(f"{base}/step_x", state)
            continue
        if mode.startswith("caught_") and i == 2 and (rank == FAILING or mode == "caught_alike"):
            try:  # a caller that skips a batch its step raised on, and goes on
                state, _ = step(state, batch)
            except KeyError:
                if mode == "caught_unshard":  # or gathers the weights to save them
                    fs.unshard(state.params)
            continue
        state, _ = step(state, batch)
        if mode == "save_raises" and i == 1:
            if rank == FAILING:
                fs.checkpoint.saving._write_shards = _boom
            fs.checkpoint.save(f"{base}/ck", state)


def _boom(*a, **k):
    raise OSError("boom in save")


t = time.monotonic()
try:
    run()
    print("NO ERROR", flush=True)
except Exception as e:  # noqa: BLE001 - reported to the test, then raised as uncaught
    print(f"RAISED {time.time():.3f} {type(e).__name__}: {e}".replace("\n", " | "),
          flush=True)
    raise
