"""Frozen leaves of any dtype (integer and bool parameters with requires_grad=False) in
groups gathered again in backward, and a wholly frozen group: training equals one process,
frozen leaves stay bit-identical, a frozen group sends no gradient collective."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funshard as fs
from funshard.testing import CountCollectives, mesh


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.perm = nn.Parameter(torch.randperm(d), requires_grad=False)  # int64
        self.mask = nn.Parameter(torch.rand(d) > 0.3, requires_grad=False)  # bool

    def forward(self, x):
        return torch.tanh(self.lin(x))[:, self.perm] * self.mask


class Net(nn.Module):
    def __init__(self, d=6, n=3):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        for b in self.layers:
            x = x + b(x)
        return self.head(x)


def _loss(model):
    def loss_fn(params, batch):
        x, y = batch
        return nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)
    return loss_fn


def frozen_parity(spec, raf, steps=3, per_rank=3):
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    model.layers[1].lin.requires_grad_(False)  # a wholly frozen group
    ref = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    step = fs.train_step(_loss(model), fs.optim.sgd(lr=0.1),
                         policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(1)
    counts = None
    for _ in range(steps):
        x = torch.randn(world * per_rank, 6, generator=g)
        y = torch.randn(world * per_rank, 2, generator=g)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        with CountCollectives() as cc:
            state, _ = step(state, (x[sl], y[sl]))
        counts = dict(cc.counts)
        opt.zero_grad()
        loss = sum(_loss(ref)(dict(ref.named_parameters()), (x[j * per_rank:(j + 1) * per_rank],
                                                             y[j * per_rank:(j + 1) * per_rank]))
                   for j in range(world)) / world
        loss.backward()
        opt.step()
    full = fs.unshard(state.params)
    return {"err": max((full[n].double() - p.detach().double()).abs().max().item()
                       for n, p in ref.named_parameters()),
            "frozen_equal": all(torch.equal(full[n], v) for n, v in frozen.items()),
            "dtypes": sorted({str(full[n].dtype) for n in frozen}),
            "reduce_scatter": counts.get("reduce_scatter", 0),
            "groups": [gi.name for gi in fs.list_groups(fs.params(model))]}


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_frozen_leaves_on_one_rank(pools, raf):
    """A world of one with no cast (Group.alias): frozen leaves of every dtype stay as they
    were, the rest trains as one process; nothing is reduced."""
    r = pools.run(1, frozen_parity, raf)[0]
    assert r["err"] < 1e-6 and r["frozen_equal"], r
    assert r["reduce_scatter"] == 0, r


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_integer_and_bool_frozen_leaves_train_as_one_process(pools, spec, raf):
    for rank, r in enumerate(pools.run(spec, frozen_parity, raf)):
        assert r["err"] < 1e-6 and r["frozen_equal"], (rank, r)
        assert r["dtypes"] == ["torch.bool", "torch.float32", "torch.int64"], r
        assert r["groups"] == ["layers.0", "layers.1", "layers.2", ""], r
        # layers.1 is wholly frozen: one reduce-scatter for each of the other three groups
        assert r["reduce_scatter"] == 3, r


def frozen_mid_run(spec, compile, steps=6, freeze=2, thaw=4):
    """``0.weight`` frozen (``requires_grad_(False)`` on the state's DTensor) before step
    ``freeze`` and trainable again before step ``thaw``; torch.optim.AdamW on one process
    with the same parameter frozen and thawed the same way (its grad None meanwhile)."""
    import torch.nn.functional as F

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                         fs.optim.adamw(1e-2, weight_decay=0.1), compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    held = []
    for i in range(steps):
        if i in (freeze, thaw):
            state.params["0.weight"].requires_grad_(i == thaw)
            ref[0].weight.requires_grad_(i == thaw)
        if i == freeze:
            held = state.params["0.weight"].to_local().clone()
        x, y = torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 4, generator=g)
        state, _ = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
        if i == thaw - 1:  # frozen through its steps: not moved, not decayed
            held = torch.equal(held, state.params["0.weight"].to_local())
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    full = fs.unshard(state.params)
    torch._dynamo.reset()
    return held, max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("compile", [False, {"backend": "aot_eager"}], ids=["eager", "compiled"])
def test_a_parameter_frozen_mid_run_is_left_alone_then_trains_again(pools, compile):
    """As torch.optim skips a parameter whose grad is None: while frozen it gets no update
    (no weight decay either) and its Adam state waits; thawed, it trains on from it."""
    for held, err in pools.run(2, frozen_mid_run, compile, timeout=600):
        assert held is True and err < 1e-5, (held, err)
