"""Tests for funshard.optim: parity with torch.optim (foreach), DTensor sharding, errors."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, HealthCheck, strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from funshard import optim
from funshard.testing import strategies

SHAPES = [(3, 5), (7,), (), (0, 3), (2, 3, 4)]
STEPS = 5


@pytest.fixture(scope="module")
def mesh():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))


def _make(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(s, generator=g, dtype=dtype) for i, s in enumerate(shapes)}
    grads = [{k: torch.randn(v.shape, generator=g, dtype=dtype) for k, v in params.items()}
             for _ in range(STEPS)]
    return params, grads


def _dist(t, mesh):
    return distribute_tensor(t, mesh, [Shard(0)] if t.ndim >= 1 else [Replicate()])


def _run_both(make_opt, make_torch, shapes=SHAPES, dtype=torch.float32, seed=0, mesh=None,
              lr_fn=None):
    """Run funshard and torch.optim side by side; return (ours, reference) param dicts."""
    init, grads = _make(shapes, dtype, seed)
    ref = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    topt = make_torch(list(ref.values()))
    if mesh is not None:
        params = {k: torch.nn.Parameter(_dist(v.clone(), mesh)) for k, v in init.items()}
    else:
        params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    ids = {k: id(v) for k, v in params.items()}
    opt = make_opt()
    state = opt.init(params)
    for step, g in enumerate(grads):
        for k, p in ref.items():
            p.grad = g[k].clone()
        if lr_fn is not None:
            topt.param_groups[0]["lr"] = lr_fn(step)
        topt.step()
        gs = {k: _dist(v, mesh) for k, v in g.items()} if mesh is not None else g
        params, state = opt.update(gs, state, params, step=step)
    assert {k: id(v) for k, v in params.items()} == ids  # leaf identity preserved
    for p in params.values():
        assert p.is_leaf and p.requires_grad
    ours = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in params.items()}
    return ours, {k: v.detach() for k, v in ref.items()}, state


def _assert_equal(ours, ref, bitwise=True, rtol=1e-6, atol=1e-7):
    for k in ref:
        if bitwise:
            assert torch.equal(ours[k], ref[k]), k
        else:
            torch.testing.assert_close(ours[k], ref[k], rtol=rtol, atol=atol)


SGD_CASES = [
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, weight_decay=0.01),
    dict(momentum=0.5, dampening=0.3, weight_decay=0.1),
    dict(momentum=0.0, weight_decay=0.05),
]


@pytest.mark.parametrize("use_mesh", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_parity(kw, dtype, use_mesh, request):
    mesh = request.getfixturevalue("mesh") if use_mesh else None
    ours, ref, _ = _run_both(lambda: optim.sgd(0.05, **kw),
                             lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=True, **kw),
                             dtype=dtype, mesh=mesh)
    _assert_equal(ours, ref)


ADAMW_CASES = [
    dict(),
    dict(weight_decay=0.0),
    dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
]


@pytest.mark.parametrize("use_mesh", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", ADAMW_CASES)
def test_adamw_parity(kw, dtype, use_mesh, request):
    mesh = request.getfixturevalue("mesh") if use_mesh else None
    ours, ref, state = _run_both(lambda: optim.adamw(1e-2, **kw),
                                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True, **kw),
                                 dtype=dtype, mesh=mesh)
    _assert_equal(ours, ref)
    assert isinstance(state, optim.AdamWState)


@pytest.mark.parametrize("which", ["sgd", "adamw"])
def test_lr_schedule(which):
    sched = lambda step: 0.1 / (1 + step)
    if which == "sgd":
        mk, mt = ((lambda: optim.sgd(sched, 0.9)),
                  (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)))
    else:
        mk, mt = ((lambda: optim.adamw(sched)),
                  (lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True)))
    ours, ref, _ = _run_both(mk, mt, lr_fn=sched)
    _assert_equal(ours, ref)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lr=st.floats(1e-5, 0.1),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    wd=st.floats(0.0, 0.5),
    shapes=st.lists(strategies.shapes(max_dims=3, max_side=4), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_adamw_property(lr, b1, b2, wd, shapes, seed):
    ours, ref, _ = _run_both(lambda: optim.adamw(lr, (b1, b2), weight_decay=wd),
                             lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2),
                                                          weight_decay=wd, foreach=True),
                             shapes=shapes, seed=seed)
    _assert_equal(ours, ref, bitwise=False, rtol=1e-5, atol=1e-6)


class Pair(NamedTuple):
    w: torch.Tensor
    frozen: torch.Tensor


def test_frozen_and_dtensor_state(mesh):
    w = torch.nn.Parameter(_dist(torch.randn(4, 3), mesh))
    frozen = _dist(torch.randn(5), mesh)  # requires_grad=False
    params = {"layer": Pair(w, frozen), "bias": None, "extra": [torch.nn.Parameter(torch.randn(2))]}
    opt = optim.adamw(0.1)
    state = opt.init(params)
    assert state.count["layer"] == Pair(0, None) and state.count["extra"] == [0]
    for tree in (state.exp_avg, state.exp_avg_sq):
        assert tree["layer"].frozen is None and tree["bias"] is None
        s = tree["layer"].w
        assert isinstance(s, DTensor) and s.placements == w.placements and s.shape == w.shape
        assert s.stride() == w.stride() and s.device_mesh == w.device_mesh and s.dtype == w.dtype
        assert not isinstance(tree["extra"][0], DTensor)
    before_frozen, before_extra = frozen.full_tensor().clone(), params["extra"][0].detach().clone()
    grads = {"layer": Pair(_dist(torch.ones(4, 3), mesh), None), "bias": None, "extra": [None]}
    new_params, new_state = opt.update(grads, state, params, step=0)
    assert new_params["layer"].frozen is frozen and new_params["layer"].w is w
    assert torch.equal(frozen.full_tensor(), before_frozen)
    assert torch.equal(new_params["extra"][0].detach(), before_extra)  # None grad: unchanged
    assert torch.equal(new_state.exp_avg["extra"][0], torch.zeros(2))
    assert new_state.exp_avg["layer"].frozen is None
    assert new_state.count["layer"] == Pair(1, None) and new_state.count["extra"] == [0]
    assert not torch.equal(w.full_tensor(), before_frozen.new_zeros(4, 3))


def test_sgd_no_momentum_state_is_empty():
    params = {"a": torch.randn(3, requires_grad=True)}
    state = optim.sgd(0.1).init(params)
    assert isinstance(state, optim.SGDState) and state.momentum_buffer == {"a": None}


@pytest.mark.parametrize("make, match", [
    (lambda: optim.sgd(-0.1), r"lr.*-0\.1"),
    (lambda: optim.sgd(0.1, momentum=-0.5), r"momentum.*-0\.5"),
    (lambda: optim.sgd(0.1, weight_decay=-1.0), r"weight_decay.*-1\.0"),
    (lambda: optim.sgd(0.1, nesterov=True), r"nesterov.*momentum=0\.0"),
    (lambda: optim.sgd(0.1, 0.9, nesterov=True, dampening=0.1), r"nesterov.*dampening=0\.1"),
    (lambda: optim.adamw(-1.0), r"lr.*-1\.0"),
    (lambda: optim.adamw(0.1, betas=(1.0, 0.9)), r"betas\[0\].*1\.0"),
    (lambda: optim.adamw(0.1, betas=(0.9, -0.1)), r"betas\[1\].*-0\.1"),
    (lambda: optim.adamw(0.1, eps=-1e-8), r"eps.*-1e-08"),
    (lambda: optim.adamw(0.1, weight_decay=-0.01), r"weight_decay.*-0\.01"),
])
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_tree_mismatch_and_shape_errors():
    params = {"a": torch.randn(3, requires_grad=True), "b": torch.randn(2, requires_grad=True)}
    opt = optim.adamw(0.1)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"differing path.*\bb\b.*\bc\b"):
        opt.update({"a": torch.ones(3), "c": torch.ones(2)}, state, params, step=0)
    with pytest.raises(ValueError, match=r"differing path"):
        opt.update({"a": torch.ones(3)}, state, params, step=0)
    with pytest.raises(ValueError, match=r"\bb\b.*\(2,\).*\(3,\)"):
        opt.update({"a": torch.ones(3), "b": torch.ones(3)}, state, params, step=0)
    with pytest.raises(ValueError, match=r"schedule.*-1\.0"):
        optim.sgd(lambda s: -1.0).update({"a": torch.ones(3), "b": None}, optim.SGDState(None),
                                         params, step=0)


def test_grads_untouched_and_key_order():
    params = {"z": torch.randn(3, requires_grad=True), "a": torch.randn(2, requires_grad=True)}
    grads = {"a": torch.randn(2), "z": torch.randn(3)}  # different insertion order is fine
    saved = {k: v.clone() for k, v in grads.items()}
    opt = optim.sgd(0.1, 0.9, nesterov=True)
    state = opt.init(params)
    for step in range(2):
        params, state = opt.update(grads, state, params, step=step)
    assert list(params) == ["z", "a"] and list(state.momentum_buffer) == ["z", "a"]
    assert all(torch.equal(grads[k], saved[k]) for k in grads)


# -- fused AdamW ([Note: fused Adam]) -------------------------------------------------------


@pytest.mark.parametrize("use_mesh", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw", ADAMW_CASES)
def test_fused_adamw_is_torchs_fused_adamw(kw, dtype, use_mesh, request):
    mesh = request.getfixturevalue("mesh") if use_mesh else None
    ours, ref, state = _run_both(lambda: optim.adamw(1e-2, fused=True, **kw),
                                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True, **kw),
                                 dtype=dtype, mesh=mesh)
    _assert_equal(ours, ref)
    assert isinstance(state, optim.AdamWState)  # the same state as unfused: checkpoints agree


def test_fused_adamw_schedule_mask_and_clip():
    """A schedule, no decay on some leaves and a clip: torch's clip_grad_norm_ and fused AdamW
    with two param groups (the clip's coefficient is computed apart, hence a tolerance)."""
    sched = lambda step: 0.1 / (1 + step)
    decay = lambda fqn: fqn in ("p0", "p4")

    def theirs(ps):
        return torch.optim.AdamW([{"params": [ps[0], ps[4]]},
                                  {"params": ps[1:4], "weight_decay": 0.0}],
                                 lr=0.1, weight_decay=0.1, fused=True)

    def ours():
        return optim.chain(optim.clip_by_global_norm(0.5),
                           optim.adamw(sched, weight_decay=0.1, mask=decay, fused=True))

    init, grads = _make(SHAPES, torch.float32, 3)
    ref = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    topt = theirs(list(ref.values()))
    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = ours()
    state = opt.init(params)
    for step, g in enumerate(grads):
        for k, p in ref.items():
            p.grad = g[k].clone()
        torch.nn.utils.clip_grad_norm_(ref.values(), 0.5)
        for group in topt.param_groups:
            group["lr"] = sched(step)
        topt.step()
        saved = {k: v.clone() for k, v in g.items()}
        params, state = opt.update(g, state, params, step=step)
        assert all(torch.equal(g[k], saved[k]) for k in g), "the kernel wrote into the grads"
    _assert_equal({k: v.detach() for k, v in params.items()},
                  {k: v.detach() for k, v in ref.items()},
                  bitwise=False, rtol=1e-5, atol=1e-6)


def test_fused_adam_read_by_a_later_transform_is_the_unfused_one():
    """A transform after a fused scale_by_adam that needs the update's values gets them
    computed the foreach way, once: bit for bit the unfused chain."""
    def make(fused):
        return optim.chain(optim.scale_by_adam(0.9, 0.99, 1e-8, fused=fused),
                           optim.clip_by_global_norm(0.01), optim.scale_by_learning_rate(0.1))

    a, _, sa = _run_both(lambda: make(True), lambda ps: torch.optim.SGD(ps, lr=0.0))
    b, _, sb = _run_both(lambda: make(False), lambda ps: torch.optim.SGD(ps, lr=0.0))
    _assert_equal(a, b)
    flat = lambda s: [t for t in optim.base.flatten(s)[1] if t is not None]
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(flat(sa), flat(sb)))


def test_fused_adamw_is_one_kernel_per_update():
    """The fused path runs: one aten._fused_adamw_ for every leaf, no foreach Adam ops (on
    the CPU the two give the same bits, so parity alone cannot tell them apart)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func._opname)
            return func(*args, **(kwargs or {}))

    init, grads = _make([(3, 5), (7,), (2, 3, 4)], torch.float32, 0)
    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    for fused, want in ((True, 1), (False, 0)):
        opt = optim.adamw(1e-2, weight_decay=0.1, fused=fused)
        state = opt.init(params)
        with Ops() as ops:
            params, state = opt.update(grads[0], state, params, step=0)
        assert ops.names.count("_fused_adamw_") == want, ops.names
        assert ("_foreach_addcdiv_" in ops.names) != fused, ops.names


def test_adam_state_without_counts_counts_the_optimizers_steps():
    """An AdamState made without ``count`` (as before counts were kept, or by hand): every
    leaf's bias corrections count the optimizer's steps; with every leaf updated each step
    that is what the counts give, bit for bit."""
    torch.manual_seed(0)
    params = {"a": torch.randn(3, requires_grad=True), "b": torch.randn(2, 2, requires_grad=True)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(3)]
    opt = optim.adamw(0.1, weight_decay=0.01)
    ends = []
    for counted in (True, False):
        ps = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        state = opt.init(ps)
        if not counted:
            state = state._replace(count=None)
        for step, g in enumerate(grads):
            ps, state = opt.update(g, state, ps, step=step)
        assert (state.count == {"a": 3, "b": 3}) if counted else state.count is None
        ends.append(ps)
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in params)
