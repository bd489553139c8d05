"""fs.optim composition: chain / masked / multi_transform / clip / apply_if_finite / schedules,
against torch.optim (+ lr_scheduler, clip_grad_norm_) on one process, and N ranks (1-D and
2-D meshes) against one process; the state through fs.checkpoint with an exact resume."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import funshard as fs
from funshard import optim
from funshard.testing import mesh

SHAPES = {"w": (5, 3), "b": (7,), "s": (), "norm.weight": (4,), "lora_A": (3, 2)}
STEPS = 6


def _make(seed=0, dtype=torch.float32, nan_at=None):
    g = torch.Generator().manual_seed(seed)
    init = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=g, dtype=dtype) for k, s in SHAPES.items()}
             for _ in range(STEPS)]
    if nan_at is not None:
        grads[nan_at]["w"][4, 2] = float("nan")  # on the last rank's shard only
    return init, grads


def _ours(opt, init, grads, steps=STEPS):
    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    state = opt.init(params)
    for step in range(steps):
        params, state = opt.update(grads[step], state, params, step=step)
    return {k: v.detach() for k, v in params.items()}, state


def _torch(make_opt, init, grads, groups=None, sched=None, clip=None, steps=STEPS):
    ref = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    pg = ([{"params": [ref[k] for k in ks], **kw} for ks, kw in groups] if groups
          else list(ref.values()))
    topt = make_opt(pg)
    s = sched(topt) if sched else None
    for step in range(steps):
        for k, p in ref.items():
            p.grad = grads[step][k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), clip, foreach=True)
        topt.step()
        if s is not None:
            s.step()
    return {k: v.detach() for k, v in ref.items()}


def _equal(ours, ref, tol=None):
    for k in ref:
        if tol is None:
            assert torch.equal(ours[k], ref[k]), (k, (ours[k] - ref[k]).abs().max())
        else:
            torch.testing.assert_close(ours[k], ref[k], rtol=tol, atol=tol)


NO_DECAY = ("b", "s", "norm.weight")
DECAY_GROUPS = lambda wd: [([k for k in SHAPES if k not in NO_DECAY], {"weight_decay": wd}),
                           (list(NO_DECAY), {"weight_decay": 0.0})]
decays = lambda fqn: fqn not in NO_DECAY


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_l2_is_torch_adam(dtype):
    init, grads = _make(1, dtype)
    ours, _ = _ours(optim.adam(1e-2, weight_decay=0.1), init, grads)
    _equal(ours, _torch(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=True),
                        init, grads))


@pytest.mark.parametrize("which", ["adamw", "sgd"])
def test_decay_mask_is_torch_param_groups(which):
    init, grads = _make(2)
    if which == "adamw":
        ours, state = _ours(optim.adamw(1e-2, weight_decay=0.3, mask=decays), init, grads)
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)
        assert isinstance(state, optim.AdamWState)
    else:
        ours, state = _ours(optim.sgd(0.05, 0.9, 0.3, mask=decays), init, grads)
        make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True)
        assert isinstance(state, optim.SGDState)
    _equal(ours, _torch(make, init, grads, groups=DECAY_GROUPS(0.3)))


def test_lr_per_label_is_torch_param_groups():
    init, grads = _make(3)
    label = lambda fqn: "lora" if fqn.startswith("lora") else "base"
    opt = optim.chain(optim.multi_transform({"lora": optim.adamw(1e-2, weight_decay=0.0),
                                             "base": optim.adamw(1e-3, weight_decay=0.0)}, label))
    ours, state = _ours(opt, init, grads)
    assert set(state.inner_states) == {"lora", "base"}
    assert state.inner_states["lora"].exp_avg["w"] is None  # only the label's leaves
    groups = [(["lora_A"], {"lr": 1e-2}), ([k for k in SHAPES if k != "lora_A"], {"lr": 1e-3})]
    _equal(ours, _torch(lambda ps: torch.optim.AdamW(ps, lr=1.0, weight_decay=0.0, foreach=True),
                        init, grads, groups=groups))


def test_lora_only_leaves_the_rest_bit_identical():
    init, grads = _make(4)
    label = lambda fqn: "lora" if fqn.startswith("lora") else "frozen"
    opt = optim.chain(optim.multi_transform({"lora": optim.sgd(0.1), "frozen": optim.set_to_zero()},
                                            label))
    ours, _ = _ours(opt, init, grads)
    assert all(torch.equal(ours[k], init[k]) for k in SHAPES if k != "lora_A")
    hand = init["lora_A"].clone()
    for g in grads:
        hand.add_(g["lora_A"], alpha=-0.1)
    assert torch.equal(ours["lora_A"], hand)


def test_schedules_match_torch_lr_scheduler():
    base = 0.1
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    lin = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, end_factor=1.0, total_iters=4)
    ours = optim.linear(0.025, 0.1, 4)
    for step in range(8):
        assert math.isclose(opt.param_groups[0]["lr"], ours(step), rel_tol=1e-12), step
        opt.step(), lin.step()
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.01)
    ours = optim.cosine(0.1, 0.01, 10)
    for step in range(10):
        assert math.isclose(opt.param_groups[0]["lr"], ours(step), rel_tol=1e-9), step
        opt.step(), cos.step()
    wc = optim.warmup_cosine(1.0, 4, 12, init=0.2, end=0.1)
    hand = [0.2, 0.4, 0.6, 0.8] + [0.1 + 0.9 * (1 + math.cos(math.pi * k / 8)) / 2
                                   for k in range(9)]
    assert [round(wc(s), 12) for s in range(13)] == [round(h, 12) for h in hand]
    assert wc(100) == 0.1 and optim.constant(0.3)(7) == 0.3


def test_adamw_with_warmup_cosine_is_torch_with_scheduler():
    init, grads = _make(5)
    lr = optim.warmup_cosine(1e-2, 2, STEPS)
    ours, _ = _ours(optim.adamw(lr, weight_decay=0.1), init, grads)
    ref = _torch(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True), init,
                 grads,
                 sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr(s) / 1e-2))
    _equal(ours, ref, tol=1e-7)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_is_torch_clip_grad_norm(max_norm):
    init, grads = _make(6)
    opt = optim.chain(optim.clip_by_global_norm(max_norm), optim.sgd(0.1, 0.9, 0.01))
    ours, state = _ours(opt, init, grads)
    assert isinstance(state, optim.SGDState)  # the clip is stateless: the chain's state is sgd's
    ref = _torch(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01,
                                            foreach=True), init, grads, clip=max_norm)
    _equal(ours, ref, tol=None if max_norm == 100.0 else 1e-6)


def test_apply_if_finite_skips_the_step_and_keeps_the_state():
    init, grads = _make(7, nan_at=2)
    opt = optim.chain(optim.apply_if_finite(), optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    before, s_before = _ours(opt, init, grads, steps=2)
    after, s_after = _ours(opt, init, grads, steps=3)
    _equal(after, before)
    _equal(s_after.exp_avg, s_before.exp_avg)
    with pytest.raises(FloatingPointError,
                       match=r"global gradient norm is nan at step 2.*apply_if_finite"):
        _ours(optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)), init, grads, steps=3)


def test_chain_state_structure_and_nesting():
    params = {"a": torch.randn(3, requires_grad=True)}
    assert (optim.chain(optim.clip_by_global_norm(1.0), optim.scale(2.0)).init(params)
            == optim.EmptyState())
    two = optim.chain(optim.trace(0.9), optim.scale_by_adam(), optim.scale_by_learning_rate(0.1))
    st = two.init(params)
    assert (isinstance(st, tuple) and isinstance(st[0], optim.TraceState)
            and isinstance(st[1], optim.AdamState))
    nested = optim.chain(optim.chain(optim.scale_by_adam()), optim.scale_by_learning_rate(0.1))
    assert isinstance(nested.init(params), optim.AdamState)
    with pytest.raises(TypeError, match=r"chain: argument 0.*got function"):
        optim.chain(lambda g: g)


def test_bad_masks_labels_and_schedules():
    params = {"a": torch.randn(3, requires_grad=True), "b": torch.randn(2, requires_grad=True)}
    with pytest.raises(TypeError, match=r"mask at a is 1; use True or False"):
        opt = optim.chain(optim.masked(optim.scale(2.0), lambda f: 1))
        opt.update({"a": torch.ones(3), "b": None}, opt.init(params), params, step=0)
    with pytest.raises(ValueError, match=r"leaf b has label 'x', which has no transformation"):
        optim.multi_transform({"y": optim.scale(1.0)}, {"a": "y", "b": "x"}).init(params)
    with pytest.raises(ValueError, match=r"join: 2 schedules need 1 boundaries, got 2"):
        optim.join([optim.constant(1.0)] * 2, [1, 2])
    with pytest.raises(ValueError, match=r"total_steps: 3 .*warmup_steps=5"):
        optim.warmup_cosine(1.0, 5, 3)
    with pytest.raises(ValueError, match=r"max_norm: 0"):
        optim.clip_by_global_norm(0)


# -- N ranks against one process -----------------------------------------------------------


def _stack(spec):
    """The chain every distributed test runs: skip, clip, AdamW with a schedule and a mask,
    and a different rule for the LoRA leaf."""
    label = lambda fqn: "lora" if fqn.startswith("lora") else "base"
    return optim.chain(
        optim.apply_if_finite(), optim.clip_by_global_norm(0.5),
        optim.multi_transform({"base": optim.adamw(optim.warmup_cosine(1e-2, 2, STEPS),
                                                   mask=decays),
                               "lora": optim.sgd(0.1, momentum=0.9)}, label))


def ranks_vs_one(spec, seed):
    m = mesh(spec)
    init, grads = _make(seed, nan_at=3)
    one, _ = _ours(_stack(spec), init, grads)
    params = fs.shard({k: v.clone() for k, v in init.items()}, m)
    for p in fs.pytree.leaves(params):
        p.requires_grad_(True)
    opt = _stack(spec)
    state = opt.init(params)
    for step in range(STEPS):
        params, state = opt.update(fs.reshard(grads[step], like=params), state, params, step=step)
    full = fs.unshard(params)
    err = max((full[k] - one[k]).abs().max().item() for k in SHAPES)
    sharded_like = all(s.placements == params[k].placements
                       for k, s in state.inner_states["base"].exp_avg.items() if s is not None)
    return err, sharded_like


@pytest.mark.parametrize("spec", [2, "2x2"])
def test_ranks_match_one_process(pools, spec):
    for err, sharded_like in pools.run(spec, ranks_vs_one, 11):
        assert err < 1e-6, err
        assert sharded_like


def resume(spec, path):
    m = mesh(spec)
    init, grads = _make(12)

    def fresh():
        params = fs.shard({k: v.clone() for k, v in init.items()}, m)
        for p in fs.pytree.leaves(params):
            p.requires_grad_(True)
        return fs.TrainState(params, _stack(spec).init(params), 0)

    def run(state, upto):
        opt = _stack(spec)
        params, opt_state = state.params, state.opt_state
        for step in range(state.step, upto):
            params, opt_state = opt.update(fs.reshard(grads[step], like=params), opt_state, params,
                                           step=step)
        return fs.TrainState(params, opt_state, upto)

    state = run(fresh(), 3)
    fs.checkpoint.save(path, state)
    straight = fs.state_dict(run(state, STEPS), "full")
    loaded = fs.checkpoint.load(path, like=fresh())
    resumed = fs.state_dict(run(loaded, STEPS), "full")
    keys = list(straight)
    same = keys == list(resumed) and all(
        torch.equal(straight[k], resumed[k]) if torch.is_tensor(straight[k])
        else straight[k] == resumed[k]
        for k in keys)
    return same, keys


def test_chain_state_checkpoints_and_resumes_exactly(pools, tmp_path):
    for same, keys in pools.run(2, resume, str(tmp_path / "step_3")):
        assert same
        assert "opt_state.inner_states.base.exp_avg_sq.w" in keys
        assert "opt_state.inner_states.lora.momentum_buffer.lora_A" in keys
        assert "opt_state.inner_states.base.exp_avg.w" in keys


@pytest.mark.parametrize("name", ["adamw", "clip+adamw", "clip+sgd"])
def test_update_transient_at_most_the_largest_leaf(name):
    """[Note: lean updates]: the update's live-tensor peak over what lives before it is at most
    the largest leaf or the chunk floor (plus small scalars), not the sum of the leaves as a
    foreach over all of them (Adam's denominators, clipped gradients) would make; the numbers
    stay torch's."""
    from funshard.optim.base import CHUNK_FLOOR
    from funshard.testing import LivePeak, tensor_bytes

    opts = {"adamw": lambda: optim.adamw(1e-3),
            "clip+adamw": lambda: optim.chain(optim.clip_by_global_norm(1e-3), optim.adamw(1e-3)),
            "clip+sgd": lambda: optim.chain(optim.clip_by_global_norm(1e-3),
                                            optim.sgd(1e-3, momentum=0.9, weight_decay=0.1))}
    torch.manual_seed(0)
    shapes = [(1024, 512)] * 6 + [(1024, 1024), (64,)]  # the largest leaf is the floor
    params = {f"p{i}": torch.randn(s, requires_grad=True) for i, s in enumerate(shapes)}
    grads = {k: torch.randn(v.shape) for k, v in params.items()}
    opt = opts[name]()
    state = opt.init(params)
    cpu = torch.device("cpu")
    for step in range(2):
        before = tensor_bytes(cpu)
        with LivePeak(cpu) as live:
            params, state = opt.update(grads, state, params, step=step)
        largest = 1024 * 1024 * 4
        assert largest == CHUNK_FLOOR * 4
        total = sum(g.nbytes for g in grads.values())
        assert live.peak - before <= largest + 4096, (name, step, live.peak - before, largest)
        assert total > 4 * largest


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 3 << 20), min_size=1, max_size=40))
def test_chunks_partition_the_leaves_within_the_bound(sizes):
    """Every leaf in exactly one run; a run holds at most max(largest leaf, CHUNK_FLOOR)
    elements; leaves that fit under the floor together make one run (one foreach call)."""
    from funshard.optim.base import CHUNK_FLOOR, _packed

    runs = _packed(tuple(sizes))
    assert sorted(j for r in runs for j in r) == list(range(len(sizes)))
    limit = max(max(sizes), CHUNK_FLOOR)
    assert all(sum(sizes[j] for j in r) <= limit for r in runs)
    if sum(sizes) <= CHUNK_FLOOR:
        assert len(runs) == 1
