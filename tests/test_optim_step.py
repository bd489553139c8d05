"""fs.optim chains, from_torch and muon inside fs.train_step (grads as the step gives them:
local shards, None for unused leaves) on 2 ranks and 2x2, against torch on one process."""

from __future__ import annotations

import pytest
import torch

import funshard as fs
from funshard import optim
from funshard.testing import mesh
from funshard.testing.models import MLP, mse_loss

STEPS = 3
NO_DECAY = lambda fqn: not fqn.endswith("bias")


def _ours(name):
    if name in ("chain", "fused"):
        return optim.chain(optim.clip_by_global_norm(0.05),
                           optim.adamw(optim.warmup_cosine(1e-2, 1, STEPS), weight_decay=0.1,
                                       mask=NO_DECAY, fused=name == "fused"))
    if name == "torch":
        return optim.from_torch(torch.optim.RAdam, lr=1e-2)
    return optim.muon(lr=0.02, momentum=0.9)


def _theirs(name, model):
    named = dict(model.named_parameters())
    if name in ("chain", "fused"):
        opt = torch.optim.AdamW([{"params": [p for n, p in named.items() if NO_DECAY(n)]},
                                 {"params": [p for n, p in named.items() if not NO_DECAY(n)],
                                  "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1,
                                fused=name == "fused")
        lr = optim.warmup_cosine(1e-2, 1, STEPS)
        return [opt], torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr(s) / 1e-2)
    if name == "torch":
        return [torch.optim.RAdam(model.parameters(), lr=1e-2)], None
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(mats, lr=0.02, momentum=0.9),
            torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.01)], None


def train(spec, name):
    m = mesh(spec)
    torch.manual_seed(0)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    ref = MLP(dim=5, hidden=7, layers=2, out=3)
    ref.load_state_dict(model.state_dict())
    step = fs.train_step(mse_loss(model), _ours(name))
    state = step.init(fs.shard(fs.params(model), m))
    opts, sched = _theirs(name, ref)
    g = torch.Generator().manual_seed(1)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for _ in range(STEPS):
        x, y = torch.randn(world * 2, 5, generator=g), torch.randn(world * 2, 3, generator=g)
        state, _ = step(state, (x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2]))
        loss = torch.nn.functional.mse_loss(ref(x), y)
        for o in opts:
            o.zero_grad()
        loss.backward()
        if name in ("chain", "fused"):
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        for o in opts:
            o.step()
        if sched is not None:
            sched.step()
    full = fs.unshard(state.params)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("name", ["chain", "fused", "torch", "muon"])
@pytest.mark.parametrize("spec", [2, "2x2"])
def test_train_step_with_optimizer_equals_one_process(pools, spec, name):
    for err in pools.run(spec, train, name):
        assert err < 1e-5, err
