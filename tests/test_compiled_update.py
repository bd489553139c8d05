"""The compiled step's update is its second program: ``adamw`` under a learning-rate schedule
and a clip, ``adam`` with an L2 penalty, ``sgd`` with Nesterov momentum and a decay mask
train as the eager step over 20 steps with no recompile (the schedule's value, the bias
corrections and the clip factor change every step: they reach the program as a tensor);
an optimizer it does not cover (a chain of the caller's) updates eagerly, in one graph."""

import gc

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard.testing import mesh
from test_compiled_step import _batches, _gpt, _loss

AOT = {"backend": "aot_eager"}

OPTIMIZERS = {
    "adamw_schedule": lambda: fs.optim.adamw(fs.optim.warmup_cosine(3e-3, 5, 20),
                                             weight_decay=0.1,
                                             mask=lambda fqn: fqn.endswith("weight")),
    "adam_l2": lambda: fs.optim.adam(1e-3, weight_decay=0.01),
    "sgd_nesterov": lambda: fs.optim.sgd(fs.optim.cosine(0.05, 0.0, 20), momentum=0.9,
                                         nesterov=True, weight_decay=0.01),
    "chain": lambda: fs.optim.chain(fs.optim.scale_by_adam(), fs.optim.scale(-1e-3)),
}
# the programs a run makes: the loss's, and the update's (SGD's first step, which sets
# each momentum buffer, is another); none for a chain the update program does not cover
GRAPHS = {"adamw_schedule": 2, "adam_l2": 2, "sgd_nesterov": 3, "chain": 1}


def train(spec, name, compile, steps=20):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    step = fs.train_step(_loss(model), OPTIMIZERS[name](), compile=compile,
                         policy=fs.Policy(clip_norm=0.5))
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    losses, graphs = [], []
    for x, y in _batches(steps, world):
        state, metrics = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
        losses.append(float(metrics["loss"]))
        graphs.append(counters["stats"]["unique_graphs"])
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    out = (losses, full, graphs, sum(counters["graph_break"].values()),
           dict(counters["recompiles"]) if "recompiles" in counters else {})
    torch._dynamo.reset()
    gc.collect()
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_update_program_trains_as_the_eager_step_over_20_steps(pools, name):
    spec = "2x2" if name == "adamw_schedule" else 2
    for rank, ((el, ep, *_), (cl, cp, graphs, breaks, recompiles)) in enumerate(zip(
            pools.run(spec, train, name, False, timeout=900),
            pools.run(spec, train, name, AOT, timeout=900))):
        assert graphs[-1] == GRAPHS[name] and breaks == 0 and not recompiles, (
            rank, graphs, breaks, recompiles)
        # 20 steps: the programs' roundings add up (5 steps stay within 1e-5 elsewhere)
        assert max(abs(a - b) for a, b in zip(cl, el)) <= 5e-5, (rank, cl, el)
        diff = max((cp[k] - ep[k]).abs().max().item() for k in ep)
        assert diff <= 5e-5, (rank, diff)
        init = dict(_gpt().named_parameters())
        moved = min((cp[k] - init[k]).abs().max().item() for k in cp)
        assert moved > 1e-4, (rank, moved)  # every leaf trained
