"""A soak trial: run by tests/test_catalogue.py as ``python fault_soak.py PORT RANK DIR``.

Two ranks (make_mesh(timeout=2)) train and save ``DIR/step_<n>`` (keep=2) after every step,
forever; rank 1 prints ``READY`` once training started, and the test kills or stops it at a
random moment (inside a step or a save). Rank 0 prints ``RAISED <time.time()> <type>:
<message>`` and exits 1. ``python fault_soak.py load DIR...`` loads each DIR's newest
checkpoint on one process and prints ``LOADED <step>`` (or ``FAILED <error>``) per DIR.
"""

import sys
import time
from datetime import timedelta

import torch

import funshard as fs
from funshard.testing.models import MLP, mse_loss


def make(mesh):
    torch.manual_seed(0)
    model = MLP(dim=16, hidden=64, layers=4, out=4)
    step = fs.train_step(mse_loss(model), fs.optim.adamw(lr=1e-3))
    return step, step.init(fs.shard(fs.params(model), mesh))


if sys.argv[1] == "load":
    step, like = make(fs.make_mesh())
    for d in sys.argv[2:]:
        try:
            state = fs.checkpoint.load(fs.checkpoint.latest(d), like=like)
            print(f"LOADED {state.step}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"FAILED {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
    sys.exit(0)

port, rank, base = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# the rendezvous may take long on a loaded machine; collectives get 2 s
store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=120))
torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                     timeout=timedelta(seconds=2))
step, state = make(fs.make_mesh())
g = torch.Generator().manual_seed(rank)
try:
    while True:
        x = torch.randn(8, 16, generator=g)
        state, _ = step(state, (x, x[:, :4]))
        fs.checkpoint.save(f"{base}/step_{state.step:06d}", state, keep=2)
        if state.step == 1 and rank == 1:
            print("READY", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"RAISED {time.time():.3f} {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
    sys.exit(1)
