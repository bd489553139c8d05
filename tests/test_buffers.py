"""Buffers are first-class: BatchNorm statistics travel replicated in TrainState.buffers,
loss_fn's in-place updates are kept, the ranks agree by the policy's rule, and state dicts,
checkpoints and evaluation carry them. Each law is checked against one process that runs
every rank's micro-batch itself."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funshard as fs
from funshard.testing import DEVICE, CountCollectives, capture, device, mesh

B = 4  # rows per rank


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * B, 5, generator=g), torch.randn(world * B, 3, generator=g)


def _loss(model):
    def loss_fn(pb, batch):
        x, y = batch
        return F.mse_loss(torch.func.functional_call(model, pb, (x,)), y)
    return loss_fn


def _reference(rule, world, steps, lr=0.1):
    """One process: every rank's micro-batch with its own copy of the buffers; the mean
    loss; SGD; then the buffers by ``rule`` (each rank's copy, for "own")."""
    model = _model()
    params = {k: v.detach().clone().requires_grad_() for k, v in fs.params(model).items()}
    bufs = [{k: v.clone() for k, v in fs.buffers(model).items()} for _ in range(world)]
    for step in range(steps):
        x, y = _batch(step, world)
        copies = [{k: v.clone() for k, v in b.items()} for b in bufs]
        loss = sum(_loss(model)((params, copies[r]), (x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]))
                   for r in range(world)) / world
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= lr * g
        if rule == "own":
            bufs = copies
        elif rule == "broadcast":
            bufs = [copies[0]] * world
        else:
            mean = {k: (torch.stack([c[k].double() for c in copies]).mean(0).to(v.dtype)
                        if v.is_floating_point() else copies[0][k])
                    for k, v in copies[0].items()}
            bufs = [mean] * world
    return {k: v.detach() for k, v in params.items()}, bufs


def train_with_buffers(spec, rule, steps=3):
    m = mesh(spec)
    model = _model()
    step = fs.train_step(_loss(model), fs.optim.sgd(lr=0.1), policy=fs.Policy(buffers=rule))
    state = step.init(fs.shard(fs.params(model), m), fs.buffers(model))
    world, rank = dist.get_world_size(), dist.get_rank()
    counts = None
    for s in range(steps):
        x, y = _batch(s, world)
        with CountCollectives() as cc:
            state, _ = step(state, (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]))
        counts = {k: v for k, v in cc.counts.items() if k in ("all_reduce", "broadcast")}
    ref_p, ref_b = _reference(rule, world, steps)
    p_err = max((state.params[k].full_tensor() - v).abs().max().item() for k, v in ref_p.items())
    mine = {k: v.to_local() for k, v in state.buffers.items()}
    b_err = max((mine[k].double() - v.double()).abs().max().item()
                for k, v in ref_b[rank].items())
    return p_err, b_err, counts, int(mine["1.num_batches_tracked"])


def every_rule(spec):
    return {rule: train_with_buffers(spec, rule) for rule in ("mean", "broadcast", "own")}


@pytest.mark.parametrize("spec", [2, "2x2"])
def test_buffers_follow_the_rule_and_params_equal_one_process(pools, spec):
    for r in pools.run(spec, every_rule):
        for rule, (p_err, b_err, _, tracked) in r.items():
            assert p_err < 1e-6 and b_err < 1e-6 and tracked == 3, (rule, p_err, b_err)
        # beyond the step's own collectives ("own" adds none): "mean" one all-reduce of the
        # floating buffers and one broadcast of the integer one; "broadcast" one per dtype
        own = r["own"][2]
        assert r["mean"][2] == {**own, "all_reduce": own["all_reduce"] + 1, "broadcast": 1}
        assert r["broadcast"][2] == {**own, "broadcast": 2}, r


def buffers_everywhere(spec, tmp):
    """state_dict loads into the module strictly, a checkpoint carries the buffers across
    meshes, evaluation reads them."""
    m = mesh(spec)
    model = _model()
    step = fs.train_step(_loss(model), fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), m), fs.buffers(model))
    x, y = _batch(0, dist.get_world_size())
    state, _ = step(state, (x, y))
    out = {}
    sd = fs.state_dict({**state.params, **state.buffers}, kind="full")
    fresh = _model()
    fresh.load_state_dict(sd, strict=True)  # raises on a missing or unexpected key
    out["strict"] = torch.equal(fresh[1].running_mean, state.buffers["1.running_mean"].to_local())
    fs.checkpoint.save(f"{tmp}/step_1", state)
    other = mesh(4) if spec == "2x2" else m  # 2x2 saves, 1-D 4 ranks loads
    like = fs.train_step(_loss(model), fs.optim.sgd(lr=0.1)).init(
        fs.shard(fs.params(_model()), other), fs.buffers(_model()))
    loaded = fs.checkpoint.load(f"{tmp}/step_1", like=like)
    out["ckpt"] = all(torch.equal(loaded.buffers[k].to_local(), v.to_local())
                      for k, v in state.buffers.items())
    fresh.eval()
    ev = fs.eval_step(lambda pb, x: torch.func.functional_call(fresh, pb, (x,)))
    with torch.no_grad():
        out["eval"] = torch.equal(ev(state, x), fresh(x))  # running statistics, eval mode
    return out


@pytest.mark.parametrize("spec", [2, "2x2"])
def test_state_dict_checkpoint_and_eval_carry_buffers(pools, tmp_path_factory, spec):
    tmp = str(tmp_path_factory.mktemp("bufs"))
    for r in pools.run(spec, buffers_everywhere, tmp):
        assert r == {"strict": True, "ckpt": True, "eval": True}, r


def disagreeing_buffers(spec):
    m = mesh(spec)
    model = _model()
    bufs = fs.buffers(model)
    if dist.get_rank() == 1:
        bufs["1.running_mean"] += 1
    step = fs.train_step(_loss(model), fs.optim.sgd(lr=0.1))
    return capture(lambda: step.init(fs.shard(fs.params(model), m), bufs))


def test_ranks_must_start_with_equal_buffers(pools):
    for t, msg in pools.run(2, disagreeing_buffers):
        assert t == "ValueError" and "buffer '1.running_mean'" in msg, msg


def test_policy_buffers_is_validated():
    with pytest.raises(ValueError, match="buffers='sum' must be one of"):
        fs.Policy(buffers="sum")


def test_fs_buffers_lists_persistent_buffers():
    m = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3))
    m.register_buffer("scratch", torch.zeros(2), persistent=False)
    assert set(fs.buffers(m)) == {"0.running_mean", "0.running_var", "0.num_batches_tracked"}
    assert "scratch" in fs.buffers(m, persistent=False)
    assert copy.deepcopy(m) is not None


LOW = torch.bfloat16
KEEP_BN = fs.Policy(param_dtype=LOW, reduce_dtype=torch.float32,
                    keep_dtype=lambda fqn: fqn.startswith("1."))


def _mixed_loss(model):
    def loss_fn(pb, batch):
        x, y = batch
        return F.mse_loss(fs.call(model, pb, x).float(), y)
    return loss_fn


def _mixed_reference(world, steps, lr=0.1):
    """One process, as the step computes: each rank's micro-batch on bfloat16 copies of the
    Linear weights and the float32 BatchNorm ones (the input cast to bfloat16, as fs.call
    casts it), its gradient in float32, their mean; SGD on float32 masters; buffers' mean."""
    model = _model().to(device())
    params = {k: v.detach().clone() for k, v in fs.params(model).items()}
    bufs = {k: v.clone() for k, v in fs.buffers(model).items()}
    for step in range(steps):
        x, y = (t.to(device()) for t in _batch(step, world))
        grads, copies = {k: torch.zeros_like(v) for k, v in params.items()}, []
        for r in range(world):
            full = {k: (v if k.startswith("1.") else v.to(LOW)).requires_grad_()
                    for k, v in params.items()}
            copies.append({k: v.clone() for k, v in bufs.items()})
            out = torch.func.functional_call(model, (full, copies[-1]),
                                             (x[r * B:(r + 1) * B].to(LOW),))
            loss = F.mse_loss(out.float(), y[r * B:(r + 1) * B])
            for k, g in zip(full, torch.autograd.grad(loss, list(full.values()))):
                grads[k] += g.float()
        for k in params:
            params[k] = params[k] - lr * (grads[k] / world)
        bufs = {k: (torch.stack([c[k].double() for c in copies]).mean(0).to(v.dtype)
                    if v.is_floating_point() else copies[0][k]) for k, v in bufs.items()}
    return params, bufs


def train_mixed_with_batchnorm(spec, steps=3):
    m = mesh(spec)
    model = _model().to(device())
    step = fs.train_step(_mixed_loss(model), fs.optim.sgd(lr=0.1), policy=KEEP_BN)
    state = step.init(fs.shard(fs.params(model), m), fs.buffers(model))
    world, rank = dist.get_world_size(), dist.get_rank()
    for s in range(steps):
        x, y = (t.to(device()) for t in _batch(s, world))
        state, _ = step(state, (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]))
    ref_p, ref_b = _mixed_reference(world, steps)
    p_err = max((state.params[k].full_tensor() - v).abs().max().item() for k, v in ref_p.items())
    b_err = max((state.buffers[k].to_local().double() - v.double()).abs().max().item()
                for k, v in ref_b.items())
    moved = (state.params["0.weight"].full_tensor() - fs.params(model)["0.weight"]).abs().max()
    where = {t.device.type for t in fs.pytree.leaves(state) if isinstance(t, torch.Tensor)}
    return p_err, b_err, moved.item(), where


@pytest.mark.lane
@pytest.mark.parametrize("spec", [1, 2, "2x2"])
def test_bfloat16_compute_with_batchnorm_kept_in_float32_equals_one_process(pools, spec):
    """Policy(param_dtype=bfloat16, keep_dtype=<the BatchNorm>): the Linear layers compute
    in bfloat16, the BatchNorm in float32 beside its float32 statistics (on a GPU: the
    mixed-type batch norm kernels), as one process."""
    tol = 1e-6 if DEVICE == "cpu" else 1e-4
    for p_err, b_err, moved, where in pools.run(spec, train_mixed_with_batchnorm):
        assert p_err < tol and b_err < tol and moved > 1e-3, (p_err, b_err, moved)
        assert where == {DEVICE}, where


def batchnorm_in_bfloat16(spec):
    m = mesh(spec)
    model = _model()
    bf16 = fs.Policy(param_dtype=LOW)
    step = fs.train_step(_mixed_loss(model), fs.optim.sgd(lr=0.1), policy=bf16)
    sp = fs.shard(fs.params(model), m)
    out = {"init": capture(lambda: step.init(sp, fs.buffers(model)))}
    kept = fs.train_step(_mixed_loss(model), fs.optim.sgd(lr=0.1), policy=KEEP_BN)
    state = kept.init(sp, fs.buffers(model))  # a state another policy's step is given
    x, y = _batch(0, dist.get_world_size())
    out["apply"] = capture(lambda: step(state, (x[:B], y[:B])))
    ev = fs.eval_step(lambda pb, x: fs.call(model, pb, x), policy=bf16)
    out["eval"] = capture(lambda: ev(state, x[:B]))
    return out


def test_batchnorm_weight_cast_away_from_its_statistics_is_refused_by_name(pools):
    """A bfloat16 BatchNorm weight beside float32 running statistics would fail inside
    F.batch_norm with a message naming no parameter: init, a step and eval_step refuse it
    by name, saying how to keep it."""
    for r in pools.run(2, batchnorm_in_bfloat16):
        for where, (t, msg) in r.items():
            assert t == "TypeError", (where, msg)
            assert "'1.weight' computes in torch.bfloat16" in msg, msg
            assert "'1.running_mean'" in msg and "keep_dtype=lambda fqn: fqn.startswith('1.')" \
                in msg, msg


def test_policy_keep_dtype_is_validated_and_chooses_compute_dtypes():
    with pytest.raises(TypeError, match="keep_dtype='1.' must be None or a predicate"):
        fs.Policy(keep_dtype="1.")
    shapes = {"0.weight": torch.zeros(8, 5), "1.weight": torch.zeros(8),
              "1.num": torch.zeros(2, dtype=torch.int64)}
    one = dataclasses.replace(KEEP_BN, groups=lambda fqn: "all")
    assert [g.nbytes for g in fs.list_groups(shapes, one)] == [8 * 5 * 2 + 8 * 4 + 2 * 8]
    assert KEEP_BN.compute_dtype("0.weight", torch.float32) == LOW
    assert KEEP_BN.compute_dtype("1.weight", torch.float32) == torch.float32
    assert KEEP_BN.compute_dtype("0.num", torch.int64) == torch.int64
