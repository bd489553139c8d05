"""The direct path (one rank, no cast): loss_fn computes on autograd leaves over the state's
own shards, kept from step to step. See [Note: the direct path] in funshard.step.direct."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funshard as fs
from funshard.collectives import force_collectives
from funshard.step.lazy import LazyParam
from funshard.testing import capture, mesh
from funshard.testing.models import MatMulT


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def what_loss_fn_gets(spec, how):
    """The types loss_fn is given on two steps, and whether the second step's are the first
    step's objects."""
    model = _mlp()
    seen = []

    def loss_fn(p, b):
        seen.append(dict(p))
        x = b[0].to(p["0.weight"].dtype)
        return F.mse_loss(torch.func.functional_call(model, p, (x,)).float(), b[1])

    policy = fs.Policy(param_dtype=torch.bfloat16) if how == "bf16" else fs.Policy()
    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1), policy=policy)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    with force_collectives(how == "forced"):
        for b in _batches(2):
            state, _ = step(state, b)
    kinds = sorted({"stand-in" if isinstance(t, LazyParam) else type(t).__name__
                    for t in seen[0].values()})
    same = all(seen[0][k] is seen[1][k] for k in seen[0])
    return kinds, same


@pytest.mark.parametrize("how,kinds,same", [
    ("plain", ["Tensor"], True), ("bf16", ["stand-in"], False),
    ("forced", ["stand-in"], False)])
def test_which_steps_take_the_direct_path(pools, how, kinds, same):
    """One rank with no cast: plain leaves, the same objects every step; a cast, or the
    collectives forced, keep the stand-ins."""
    assert pools.run(1, what_loss_fn_gets, how)[0] == (kinds, same)


def kept_parameters(spec):
    """loss_fn keeps the parameters of the first step and computes every later step from
    them, ignoring what it is given: on one rank they are the live parameters, so the run
    equals one whose loss_fn uses what it is given."""
    model = _mlp()
    kept = {}

    def keeper(p, b):
        if not kept:
            kept.update(p)
        return F.mse_loss(torch.func.functional_call(model, kept, (b[0],)), b[1])

    def plain(p, b):
        return F.mse_loss(torch.func.functional_call(model, p, (b[0],)), b[1])

    out = []
    for fn in (keeper, plain):
        step = fs.train_step(fn, fs.optim.adamw(lr=0.05))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        for b in _batches(3):
            state, _ = step(state, b)
        out.append(fs.unshard(state.params))
    live = max((kept[k] - out[0][k]).abs().max().item() for k in kept)
    err = max((out[0][k] - out[1][k]).abs().max().item() for k in kept)
    return live, err


def test_a_kept_parameter_is_the_live_parameter(pools):
    live, err = pools.run(1, kept_parameters)[0]
    assert live == 0.0 and err == 0.0, (live, err)


def done_to_a_leaf(spec, kind):
    """loss_fn (or its caller) does something to a parameter that would outlast the step if
    the leaf were reused: it lasts one step. Returns the direct path's parameters after three
    steps and the same run's with the stand-ins (the collectives forced), or, for a gradient
    from outside the step, a run without it."""
    model = _mlp()
    kept = {}

    def loss_fn(p, b):
        w = p["2.weight"]
        if kind == "hook":  # every step: the direct path must not stack them
            w.register_hook(lambda g: g * 0.5)
        if not kept and kind == "data":  # step 1 only
            w.data = w.data.clone()
        if not kept and kind == "requires_grad":
            w.requires_grad_(False)
        kept.update(p)
        return F.mse_loss(torch.func.functional_call(model, p, (b[0],)), b[1])

    def run(forced, outside=True):
        kept.clear()
        step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1))
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        seen, mine = [], None
        with force_collectives(forced):
            for j, b in enumerate(_batches(3)):
                state, _ = step(state, b)
                seen.append(fs.unshard(state.params)["2.weight"].clone())
                if j == 0 and kind == "outside_grad" and outside:
                    mine = kept["2.weight"]
                    (mine * 2).sum().backward()  # the caller's own gradient
        return fs.unshard(state.params), seen, None if mine is None else mine.grad

    direct, seen, grad = run(False)
    if kind == "requires_grad":  # frozen in step 1 only: steps 2 and 3 train it
        return [float(not torch.equal(a, b)) for a, b in zip(seen, seen[1:])], True
    other, _, _ = run(kind != "outside_grad", outside=False)
    err = max((direct[k] - other[k]).abs().max().item() for k in direct)
    # the caller's gradient stays the caller's, on the tensor it differentiated
    return [err], (grad is not None) == (kind == "outside_grad")


@pytest.mark.parametrize("kind", ["hook", "data", "outside_grad", "requires_grad"])
def test_what_is_done_to_a_parameter_lasts_one_step(pools, kind):
    got, ok = pools.run(1, done_to_a_leaf, kind)[0]
    expect = [1.0, 1.0] if kind == "requires_grad" else [0.0]
    assert got == expect and ok, (got, ok)


def _loss(kind, model, p, b):
    if kind == "custom_function":  # a Function is the first to touch '0.weight'
        h = MatMulT.apply(b[0], p["0.weight"]) + p["0.bias"]
        return F.mse_loss(torch.relu(h) @ p["2.weight"].t() + p["2.bias"], b[1])
    with torch.autograd.graph.save_on_cpu():  # saved-tensor hooks around the whole model
        return F.mse_loss(torch.func.functional_call(model, p, (b[0],)), b[1])


def what_stand_ins_refuse(spec, kind):
    """What the stand-ins refuse at world N (a custom Function meeting a parameter first,
    other saved-tensor hooks) trains as one process does on the direct path."""
    model = _mlp()
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = fs.train_step(lambda p, b: _loss(kind, model, p, b), fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    for b in _batches(3):
        state, _ = step(state, b)
        opt.zero_grad()
        _loss(kind, ref, dict(ref.named_parameters()), b).backward()
        opt.step()
    full = fs.unshard(state.params)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("kind", ["custom_function", "saved_tensors_hooks"])
def test_what_stand_ins_refuse_trains_on_the_direct_path(pools, kind):
    err = pools.run(1, what_stand_ins_refuse, kind)[0]
    assert err < 1e-6, err


def refused_and_accumulated(spec, how):
    """A step the step refuses (a NaN batch) or skips leaves the kept leaves clean for the
    next, accumulation sums micro-batches in the leaves' hand-over, and a reduce dtype rounds
    the gradients: the direct path ends where the stand-ins' (the collectives forced) end,
    and a refused step as if never run."""
    model = _mlp()

    def loss_fn(p, b):
        return F.mse_loss(torch.func.functional_call(model, p, (b[0],)), b[1])

    def run(policy, batches, forced=False):
        step = fs.train_step(loss_fn, fs.optim.adamw(lr=0.05), policy=policy)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        kinds = []
        with force_collectives(forced):
            for b in batches:
                got = []

                def one():  # the step, its metrics read (where a refusal raises)
                    out = step(state, b)
                    dict(out[1])
                    got.append(out)

                kinds.append(capture(one)[0])
                state = got[0][0] if got else state
        return fs.unshard(state.params), kinds

    plain = _batches(3)
    bad = (torch.full((4, 4), float("nan")), torch.zeros(4, 2))
    policy = fs.Policy(accumulate=2 if how == "accumulate" else 1,
                       skip_nonfinite=how == "skip",
                       reduce_dtype=torch.bfloat16 if how == "reduce_bf16" else None)
    batches = plain if how in ("accumulate", "reduce_bf16") else [plain[0], bad, *plain[1:]]
    direct, kinds = run(policy, batches)
    stand, stand_kinds = run(policy, batches, forced=True)
    errs = [max((direct[k] - stand[k]).abs().max().item() for k in direct)]
    if how == "refuse":  # as if the NaN batch had never come
        ref, _ = run(fs.Policy(), plain)
        errs.append(max((direct[k] - ref[k]).abs().max().item() for k in direct))
    return errs, kinds, stand_kinds


# reduce_bf16: gradients rounded to bfloat16 on the way, as the bucket does at any world
@pytest.mark.parametrize("how", ["refuse", "skip", "accumulate", "reduce_bf16"])
def test_refused_skipped_and_accumulated_steps_on_the_direct_path(pools, how):
    errs, kinds, stand_kinds = pools.run(1, refused_and_accumulated, how)[0]
    assert all(e == 0.0 for e in errs), errs
    expected = [None, "FloatingPointError" if how == "refuse" else None, None, None]
    assert kinds == stand_kinds == expected[:len(kinds)], (kinds, stand_kinds)
