"""torch.func over functions of fs.unshard(params), and double backward through the step:
each equals the same computation on full parameters in one process; what cannot work is
refused by name."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import capture, mesh
from funshard.testing.models import MLP


def _model():
    torch.manual_seed(0)
    return MLP(dim=5, hidden=7, layers=2, out=3)


def transforms(spec):
    m = mesh(spec)
    model = _model()
    sp = fs.shard(fs.params(model), m)
    full = {k: v.detach().clone() for k, v in fs.params(model).items()}
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    t = torch.randn(4, 5, generator=torch.Generator().manual_seed(7))

    def f(p, x):
        return torch.func.functional_call(model, p, (x,))

    out = {}
    # vmap over the batch, with the parameters gathered inside
    got = torch.func.vmap(lambda xi: f(fs.unshard(sp), xi[None])[0])(x)
    out["vmap"] = (got - f(full, x)).abs().max().item()
    # grad and jvp with respect to the input
    g = torch.func.grad(lambda xi: f(fs.unshard(sp), xi).pow(2).sum())(x)
    out["grad_x"] = (g - torch.func.grad(lambda xi: f(full, xi).pow(2).sum())(x)).abs().max()
    _, jt = torch.func.jvp(lambda xi: f(fs.unshard(sp), xi), (x,), (t,))
    out["jvp_x"] = (jt - torch.func.jvp(lambda xi: f(full, xi), (x,), (t,))[1]).abs().max()
    # grad with respect to the parameters: of the full ones, then reduced to shards
    gfull = torch.func.grad(lambda p: f(p, x).pow(2).mean())(fs.unshard(sp))
    gs = fs.reduce_grads(gfull, like=sp)
    out["grad_p"] = {k: v.full_tensor() for k, v in gs.items()}
    out["grad_p_mine"] = torch.func.grad(lambda p: f(p, x).pow(2).mean())(full)
    # through the shards themselves: refused by name
    out["refused"] = [capture(lambda: torch.func.grad(lambda p: f(fs.unshard(p), x).sum())(sp)),
                      capture(lambda: torch.func.vmap(lambda w: fs.unshard({"w": w})["w"])(
                          sp["inp.weight"]))]
    return {k: (float(v) if isinstance(v, torch.Tensor) and v.ndim == 0 else v)
            for k, v in out.items()}


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_torch_func_over_unshard(pools, spec):
    results = pools.run(spec, transforms)
    for r in results:
        assert r["vmap"] == 0.0 and r["grad_x"] == 0.0 and r["jvp_x"] == 0.0, r
        for t, msg in r["refused"]:
            assert t == "NotImplementedError" and "torch.func" in msg, msg
    # the reduced gradient is the mean over ranks of each rank's full gradient
    for k in results[0]["grad_p"]:
        want = sum(r["grad_p_mine"][k] for r in results) / len(results)
        for r in results:
            assert (r["grad_p"][k] - want).abs().max() < 1e-6, k


def _penalty(model):
    def loss_fn(params, batch):
        x, y = batch
        x = x.clone().requires_grad_(True)
        loss = F.mse_loss(torch.func.functional_call(model, params, (x,)), y)
        gx, = torch.autograd.grad(loss, x, create_graph=True)
        return loss + gx.pow(2).sum()  # a gradient penalty: double backward
    return loss_fn


def penalty_parity(spec, raf, steps=3, per_rank=2):
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    ref = copy.deepcopy(model)
    step = fs.train_step(_penalty(model), fs.optim.sgd(lr=0.1),
                         policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(world * per_rank, 5, generator=g)
        y = torch.randn(world * per_rank, 3, generator=g)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        state, _ = step(state, (x[sl], y[sl]))
        opt.zero_grad()
        loss = sum(_penalty(ref)(dict(ref.named_parameters()),
                                 (x[j * per_rank:(j + 1) * per_rank],
                                  y[j * per_rank:(j + 1) * per_rank]))
                   for j in range(world)) / world
        loss.backward()
        opt.step()
    full = fs.unshard(state.params)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)  # 1: the leaves of Group.alias
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_gradient_penalty_through_the_step_equals_one_process(pools, spec, raf):
    for err in pools.run(spec, penalty_parity, raf):
        assert err < 1e-6, err
