"""A save on one rank only: run by tests/test_checkpoint_partial.py as
``python fault_partial_save.py PORT RANK TIMEOUT TRANSPORT SAVER DIR`` on 2 ranks.

Both ranks make one step; then rank SAVER calls ``fs.checkpoint.save`` alone (the
``torch.save`` habit, ``if rank == 0: save(...)``) while the other makes its next step.
TRANSPORT is a ``Policy(transport=)`` name, or ``default``. Each rank prints one line,
``RAISED <seconds> <type>: <message>`` (seconds since it made its diverging call) or
``NO ERROR``.
"""

import os
import sys
import time

import torch

import funshard as fs
from funshard.testing.models import MLP, mse_loss

port, rank, timeout, transport, saver, base = (int(sys.argv[1]), int(sys.argv[2]),
                                               float(sys.argv[3]), sys.argv[4],
                                               int(sys.argv[5]), sys.argv[6])
os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
mesh = fs.make_mesh(shard=2, timeout=timeout)
torch.manual_seed(0)
model = MLP(dim=5, hidden=7, layers=3, out=3)
g = torch.Generator().manual_seed(rank + 1)
batch = (torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g))
policy = fs.Policy() if transport == "default" else fs.Policy(transport=transport)
step = fs.train_step(mse_loss(model), fs.optim.adamw(lr=1e-2), policy=policy)
state = step.init(fs.shard(fs.params(model), mesh))
state, _ = step(state, batch)

t = time.monotonic()
try:
    if rank == saver:
        fs.checkpoint.save(f"{base}/step_1", state)
    else:
        state, _ = step(state, batch)
    print("NO ERROR", flush=True)
except Exception as e:  # noqa: BLE001 - reported to the test, then raised as uncaught
    print(f"RAISED {time.monotonic() - t:.1f} {type(e).__name__}: {e}".replace("\n", " | "),
          flush=True)
    raise
os._exit(0)
