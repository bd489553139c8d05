"""fs.optim.from_torch: elementwise torch.optim optimizers on local shards equal the same
optimizer on one process (2 ranks, 2x2); state checkpointed on 2 ranks and loaded resharded
on 2x2; non-elementwise optimizers refused by name."""

from __future__ import annotations

import pytest
import torch

import funshard as fs
from funshard import optim
from funshard.testing import mesh

SHAPES = {"w": (5, 3), "b": (7,), "s": (), "e": (1, 4)}
STEPS = 4
CASES = [
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1)),
    ("RMSprop", dict(lr=1e-2, momentum=0.5, centered=True)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    ("Adadelta", dict(lr=1.0)),
    ("Adamax", dict(lr=1e-2)),
    ("NAdam", dict(lr=1e-2)),
    ("RAdam", dict(lr=1e-2)),
    ("Rprop", dict(lr=1e-2)),
    ("ASGD", dict(lr=1e-2, t0=1)),
]


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    init = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    grads = [{k: (None if (k == "b" and step == 0) else torch.randn(s, generator=g))
              for k, s in SHAPES.items()} for step in range(STEPS)]  # "b" starts a step late
    return init, grads


def _one_process(name, kw, init, grads, upto=STEPS):
    ref = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = getattr(torch.optim, name)(list(ref.values()), **kw)
    for step in range(upto):
        for k, p in ref.items():
            p.grad = None if grads[step][k] is None else grads[step][k].clone()
        opt.step()
    return {k: v.detach() for k, v in ref.items()}


def _sharded(m, init):
    params = fs.shard({k: v.clone() for k, v in init.items()}, m)
    for p in fs.pytree.leaves(params):
        p.requires_grad_(True)
    return params


def _grads(step_grads, like):
    full = {k: (torch.zeros(SHAPES[k]) if g is None else g) for k, g in step_grads.items()}
    out = fs.reshard(full, like=like)
    return {k: (None if step_grads[k] is None else v) for k, v in out.items()}


def _run(opt, params, state, grads, start, stop):
    for step in range(start, stop):
        params, state = opt.update(_grads(grads[step], params), state, params, step=step)
    return params, state


def shards_vs_one(spec, cases):
    m = mesh(spec)
    init, grads = _data(1)
    out = {}
    for name, kw in cases:
        opt = optim.from_torch(getattr(torch.optim, name), **kw)
        params = _sharded(m, init)
        params, state = _run(opt, params, opt.init(params), grads, 0, STEPS)
        full, ref = fs.unshard(params), _one_process(name, kw, init, grads)
        out[name] = max(((full[k] - ref[k]).abs() / (1 + ref[k].abs())).max().item()
                        for k in SHAPES)
    return out


@pytest.mark.parametrize("spec", [2, "2x2"])
def test_elementwise_torch_optimizers_on_shards_equal_one_process(pools, spec):
    for errs in pools.run(spec, shards_vs_one, CASES):
        assert set(errs) == {n for n, _ in CASES}
        assert all(e < 1e-6 for e in errs.values()), errs


def test_scalars_kept_elsewhere_cross_once_per_key(monkeypatch):
    """Where torch keeps a per-parameter scalar on another device than the state's (Adam's
    step on the CPU for a GPU parameter), the update moves every leaf's at once, and trains
    as torch does; "cpu:0" stands in for the other device here (a copy each way)."""
    init, grads = _data(3)
    probe, moves = optim.torch_optim._probe, []

    def elsewhere(cls, kwargs, like):
        return {k: (e, torch.device("cpu", 0) if dev is not None else None, dt)
                for k, (e, dev, dt) in probe(cls, kwargs, like).items()}

    monkeypatch.setattr(optim.torch_optim, "_probe", elsewhere)
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: moves.append(a) or to(t, *a, **kw))
    m = fs.make_mesh(device_type="cpu")
    for name, kw in [("Adam", dict(lr=1e-2)), ("NAdam", dict(lr=1e-2))]:
        opt = optim.from_torch(getattr(torch.optim, name), **kw)
        params = _sharded(m, init)
        moves.clear()
        params, state = _run(opt, params, opt.init(params), grads, 0, STEPS)
        full, ref = fs.unshard(params), _one_process(name, kw, init, grads)
        assert all(torch.allclose(full[k], ref[k], rtol=1e-6, atol=1e-7) for k in SHAPES), name
        # per step: each scalar key there and back once (step 0: only back), not per leaf
        scalars = sum(dev is not None for _, dev, _ in elsewhere(
            getattr(torch.optim, name), kw, init["w"]).values())
        crossings = [a for a in moves if a and a[0] == torch.device("cpu", 0)]
        assert len(crossings) == scalars * (STEPS - 1), (name, len(crossings), scalars)


def test_lr_schedule_is_torch_lambda_lr():
    init, grads = _data(2)
    sched = lambda step: 0.1 / (1 + step)
    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = optim.from_torch(torch.optim.SGD, lr=sched, momentum=0.9)
    state = opt.init(params)
    for step in range(STEPS):
        params, state = opt.update(grads[step], state, params, step=step)
    ref = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    topt = torch.optim.SGD(list(ref.values()), lr=0.1, momentum=0.9)
    lam = torch.optim.lr_scheduler.LambdaLR(topt, lambda s: sched(s) / 0.1)
    for step in range(STEPS):
        for k, p in ref.items():
            p.grad = grads[step][k]
        topt.step(), lam.step()
    for k in SHAPES:
        torch.testing.assert_close(params[k].detach(), ref[k].detach(), rtol=1e-7, atol=1e-7)


def save_half(spec, path, counts=True):
    """Two steps, saved; ``counts=False``: as a state made before the host kept its counts."""
    m = mesh(spec)
    init, grads = _data(3)
    opt = optim.from_torch(torch.optim.Adam, lr=1e-2)
    params = _sharded(m, init)
    params, state = _run(opt, params, opt.init(params), grads, 0, 2)
    assert state.count == {"w": 2, "b": 1, "s": 2, "e": 2}, state.count  # ("b": a step late)
    state = state if counts else state._replace(count=None)
    fs.checkpoint.save(path, fs.TrainState(params, state, 2))
    return sorted(fs.state_dict(state, "sharded"))


def load_rest(spec, path):
    m = mesh(spec)
    init, grads = _data(3)
    opt = optim.from_torch(torch.optim.Adam, lr=1e-2)
    fresh = _sharded(m, init)
    st = fs.checkpoint.load(path, like=fs.TrainState(fresh, opt.init(fresh), 0))
    params, _ = _run(opt, st.params, st.opt_state, grads, st.step, STEPS)
    full, ref = fs.unshard(params), _one_process("Adam", dict(lr=1e-2), init, grads)
    return max((full[k] - ref[k]).abs().max().item() for k in SHAPES)


@pytest.mark.parametrize("counts", [True, False], ids=["counts", "saved_before_counts"])
def test_state_checkpoints_on_2_and_loads_resharded_on_2x2(pools, tmp_path, counts):
    """Saved on 2 ranks, loaded on 2x2, the rest of the steps as one process; a checkpoint
    saved before the host kept torch's step counts (no ``count``) loads as well: the counts
    are read from ``stepped``."""
    path = str(tmp_path / "step_2")
    keys = pools.run(2, save_half, path, counts)[0]
    assert "state.exp_avg.w" in keys and "state.step.s" in keys and "stepped.b" in keys
    assert ("count.b" in keys) == counts, keys
    for err in pools.run("2x2", load_rest, path):
        assert err < 1e-6, err


def test_a_state_dict_without_host_counts_loads_and_steps_alike():
    """A state dict of a state made before the host kept torch's step counts loads with
    them unknown (None), and the steps after it are those of the state it came from, bit
    for bit, its counts read back from ``stepped``."""
    init, grads = _data(4)
    m = fs.make_mesh(device_type="cpu")
    opt = optim.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    params = _sharded(m, init)
    params, state = _run(opt, params, opt.init(params), grads, 0, 2)
    sd = fs.state_dict(fs.TrainState(params, state, 2), "full")
    old = {k: v for k, v in sd.items() if not k.startswith("opt_state.count.")}
    assert len(old) == len(sd) - len(SHAPES)
    like = _sharded(m, init)
    like = fs.TrainState(like, opt.init(like), 0)
    loaded = fs.load_state_dict(old, like=like)
    assert loaded.opt_state.count == {k: None for k in SHAPES}, loaded.opt_state.count
    with pytest.raises(ValueError, match="type mismatch at 'opt_state.count.w'"):
        fs.load_state_dict({**sd, "opt_state.count.w": None}, like=like)  # only if absent
    a, sa = _run(opt, params, state, grads, 2, STEPS)
    b, sb = _run(opt, loaded.params, loaded.opt_state, grads, 2, STEPS)
    assert all(torch.equal(a[k].full_tensor(), b[k].full_tensor()) for k in SHAPES)
    assert sa.count == sb.count == {"w": 4, "b": 3, "s": 4, "e": 4}, (sa.count, sb.count)


@pytest.mark.parametrize("name, why", [
    ("Adafactor", r"row and column"), ("Muon", r"fs\.optim\.muon"), ("LBFGS", r"closure"),
    ("SparseAdam", r"sparse gradients")])
def test_non_elementwise_refused_by_name(name, why):
    with pytest.raises(ValueError, match=rf"torch\.optim\.{name} is refused: .*{why}.*Elementwise "
                                         r"torch\.optim optimizers work \(SGD, Adam"):
        optim.from_torch(getattr(torch.optim, name), lr=0.1)


def test_unknown_class_needs_elementwise_true():
    class Mine(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match=r"Mine is not known to be elementwise.*elementwise=True"):
        optim.from_torch(Mine, lr=0.1)
    params = {"a": torch.ones(3, requires_grad=True)}
    opt = optim.from_torch(Mine, elementwise=True, lr=0.5)
    params, _ = opt.update({"a": torch.ones(3)}, opt.init(params), params, step=0)
    assert torch.equal(params["a"].detach(), torch.full((3,), 0.5))
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer class"):
        optim.from_torch(torch.nn.Linear, lr=0.1)
