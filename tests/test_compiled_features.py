"""``train_step(..., compile=True)`` with the Policy's features and models beyond the GPT:
micro-batches (a plain loss and ``fs.Mean``), activation checkpointing, BatchNorm buffers,
a Hugging Face T5 (tied embeddings, an encoder and a decoder), and a world of one with and
without its collectives forced. Each trains as the eager step and as one process, in one
graph with no graph break (``aot_eager``: AOTAutograd's graphs run op by op); the Policy's
features also through inductor's program, with the step's pass over it, as the eager step."""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.collectives import force_collectives
from funshard.testing import mesh
from test_compiled_step import (LR, _batches, _gpt, _loss, _max_diff, _train,
                                compiled_collectives, hf_runs)

AOT = {"backend": "aot_eager"}


def _mean_loss(model):
    def loss_fn(params, batch):
        x, y = batch
        logits = fs.call(model, params, x).flatten(0, 1)
        return fs.Mean(F.cross_entropy(logits, y.flatten(), reduction="sum"), y.numel())
    return loss_fn


def _run(spec, loss_of, policy, compile, batches):
    """Losses and full parameters after AdamW on this rank's rows of ``batches``; dynamo's
    graph count and graph breaks."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    step = fs.train_step(loss_of(model), fs.optim.adamw(LR, weight_decay=0.1), policy=policy,
                         compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    losses, per = [], batches[0][0].shape[0] // world
    for x, y in batches:
        rows = slice(rank * per, (rank + 1) * per)
        state, metrics = step(state, (x[rows], y[rows]))
        losses.append(float(metrics["loss"]))
    out = (losses, {k: v.detach().clone() for k, v in fs.unshard(state.params).items()},
           counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    torch._dynamo.reset()
    gc.collect()
    return out


def _one_process(batches):
    """torch.optim.AdamW with torch's clip on the whole batch."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = _loss(model)(dict(model.named_parameters()), (x, y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach() for k, p in model.named_parameters()}


VARIANTS = {
    "accumulate": (_loss, dict(accumulate=2)),
    "mean_accumulate": (_mean_loss, dict(accumulate=2)),
    "checkpoint": (_loss, dict(checkpoint=True)),
    "accumulate_grad_op": (_loss, dict(accumulate=2, reshard_after_forward=False)),
}


def variant_parity(spec, variant, steps=4, compile=AOT):
    loss_of, kwargs = VARIANTS[variant]
    policy = fs.Policy(clip_norm=1.0, **kwargs)
    batches = _batches(steps, dist.get_world_size(), per_rank=4)
    return {"eager": _run(spec, loss_of, policy, False, batches),
            "compiled": _run(spec, loss_of, policy, compile, batches),
            "one": _one_process(batches)}


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_policy_features_compiled_train_as_eager_and_one_process(pools, spec, variant):
    for rank, r in enumerate(pools.run(spec, variant_parity, variant, timeout=600)):
        (el, ep, _, _), (cl, cp, graphs, breaks), (ol, op) = r["eager"], r["compiled"], r["one"]
        assert breaks == 0 and graphs == 2, (rank, graphs, breaks)
        assert max(abs(a - b) for a, b in zip(cl, el)) <= 1e-5, (rank, cl, el)
        assert max(abs(a - b) for a, b in zip(cl, ol)) <= 1e-5, (rank, cl, ol)
        assert _max_diff(cp, ep) <= 1e-5, (rank, _max_diff(cp, ep))
        assert _max_diff(cp, op) <= 1e-5, (rank, _max_diff(cp, op))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_policy_features_in_inductors_program_train_as_the_eager_step(pools, variant):
    """The same features compiled by inductor, with the step's pass over its program (the
    gathers moved ahead, the reductions made all-reduces in place, their waits moved later):
    the numbers are the eager step's."""
    for rank, r in enumerate(pools.run(2, variant_parity, variant, 3, True, timeout=900)):
        (el, ep, _, _), (cl, cp, graphs, breaks) = r["eager"], r["compiled"]
        assert breaks == 0 and graphs == 2, (rank, graphs, breaks)
        assert max(abs(a - b) for a, b in zip(cl, el)) <= 1e-5, (rank, cl, el)
        assert _max_diff(cp, ep) <= 1e-5, (rank, _max_diff(cp, ep))


def frozen_inductor(spec, param_dtype, steps=3):
    """The GPT with frozen leaves (and its tied head) under every feature at once, eager and
    compiled by inductor: losses and full parameters of each."""
    torch._dynamo.reset()
    batches = _batches(steps, dist.get_world_size())
    policy = fs.Policy(clip_norm=1.0, param_dtype=param_dtype, accumulate=2, checkpoint=True)
    out = {name: _train(spec, _gpt(frozen=True), policy, compile, batches)
           for name, compile in (("eager", False), ("compiled", True))}
    torch._dynamo.reset()
    gc.collect()
    return out


@pytest.mark.parametrize("spec,param_dtype", [(2, None), (2, torch.bfloat16), ("2x2", None)],
                         ids=["2-fp32", "2-bf16", "2x2-fp32"])
def test_frozen_and_tied_leaves_under_every_feature_in_inductors_program(pools, spec,
                                                                         param_dtype):
    for rank, r in enumerate(pools.run(spec, frozen_inductor, param_dtype, timeout=900)):
        (el, ep), (cl, cp) = r["eager"], r["compiled"]
        # bfloat16: inductor's kernels round apart from eager ops (as in test_compiled_step)
        tol = (2e-2, 2 * LR * len(cl)) if param_dtype else (1e-5, 1e-5)
        assert max(abs(float(a) - float(b)) for a, b in zip(cl, el)) <= tol[0], (rank, cl, el)
        assert _max_diff(cp, ep) <= tol[1], (rank, _max_diff(cp, ep))
        assert torch.equal(cp["wpe.weight"], _gpt().wpe.weight.detach()), rank  # frozen


def buffers_compiled(spec, rule, steps=3):
    """BatchNorm's running statistics as state.buffers, updated inside the program."""
    from test_buffers import B, _batch, _model, _reference
    from test_buffers import _loss as bn_loss

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    step = fs.train_step(bn_loss(model), fs.optim.sgd(lr=0.1), policy=fs.Policy(buffers=rule),
                         compile=AOT)
    state = step.init(fs.shard(fs.params(model), mesh(spec)), fs.buffers(model))
    for s in range(steps):
        x, y = _batch(s, world)
        state, _ = step(state, (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]))
    ref_p, ref_b = _reference(rule, world, steps)
    p_err = max((state.params[k].full_tensor() - v).abs().max().item()
                for k, v in ref_p.items())
    mine = {k: v.to_local() for k, v in state.buffers.items()}
    b_err = max((mine[k].double() - v.double()).abs().max().item()
                for k, v in ref_b[rank].items())
    torch._dynamo.reset()
    return p_err, b_err, int(mine["1.num_batches_tracked"])


@pytest.mark.parametrize("rule", ["mean", "own"])
def test_batchnorm_buffers_compiled_follow_the_rule(pools, rule):
    for rank, (p_err, b_err, tracked) in enumerate(pools.run(2, buffers_compiled, rule,
                                                             timeout=600)):
        assert p_err < 1e-6 and b_err < 1e-6 and tracked == 3, (rank, p_err, b_err, tracked)


def t5_parity(spec, steps=3, per_rank=2):
    """T5 (tied embeddings, encoder and decoder blocks) compiled against its eager step."""
    from test_hf import _t5

    g = torch.Generator().manual_seed(1)
    world = dist.get_world_size()
    ids = [torch.randint(0, 64, (world * per_rank, 8), generator=g) for _ in range(steps)]
    out = hf_runs(spec, _t5, ids)
    gc.collect()
    return out


def test_compiled_step_trains_t5_as_its_eager_step(pools):
    pytest.importorskip("transformers")
    for rank, r in enumerate(pools.run(2, t5_parity, timeout=600)):
        (el, ep), (cl, cp) = r["eager"], r["compiled"]
        assert r["breaks"] == 0 and r["graphs"] == 2, (rank, r["graphs"], r["breaks"])
        assert max(abs(a - b) for a, b in zip(cl, el)) <= 1e-5, (rank, cl, el)
        assert _max_diff(cp, ep) <= 1e-5, (rank, _max_diff(cp, ep))


def world_of_one(spec, forced):
    with force_collectives(forced):  # (and the reductions the GPU's collectives)
        return compiled_collectives(spec, True, scatter=forced)


@pytest.mark.parametrize("forced", [False, True], ids=["alone", "forced"])
def test_a_world_of_one_runs_no_collective_unless_forced(pools, forced):
    """Alone, the program gathers nothing (the shard is the whole); forced (one GPU
    standing in for many), every group's collectives are in it, as on two ranks, ordered
    to overlap the compute as there."""
    for counts, graphs, groups, programs, runs in pools.run(1, world_of_one, forced,
                                                            timeout=900):
        assert programs == 2 and graphs == [2, 2, 2, 2], (programs, graphs)
        if forced:
            assert counts.get("all_gather_into_tensor") == 1 + 2 * (groups - 1), counts
            assert counts.get("reduce_scatter_tensor") == groups, counts
            ahead = [n > 0 for k, n in runs if k == "all_gather_into_tensor"]
            later = [n > 0 for k, n in runs if k == "reduce_scatter_tensor"]
            assert sum(ahead) >= groups - 2 and sum(later) >= groups - 2, runs
        else:
            assert counts == {}, counts


def eval_compiled(spec):
    """fs.eval_step(compile=True): the forward as one program, equal to the eager
    eval_step and to the module with its full parameters."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    sp = fs.shard(fs.params(model), mesh(spec))
    x = _batches(1, world)[0][0][rank * 2:(rank + 1) * 2]
    forward = lambda p, x: fs.call(model, p, x)  # noqa: E731
    compiled = fs.eval_step(forward, compile=AOT)
    outs = [compiled(sp, x) for _ in range(3)]  # eager, compiled, the program again
    eager = fs.eval_step(forward)(sp, x)
    with torch.no_grad():
        one = _gpt()(x)
    out = {"diffs": [(o - eager).abs().max().item() for o in outs],
           "one": (outs[-1] - one).abs().max().item(),
           "graphs": counters["stats"]["unique_graphs"],
           "breaks": sum(counters["graph_break"].values()),
           "grad": any(o.requires_grad for o in outs)}
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_compiled_eval_step_equals_the_eager_one(pools, spec):
    for rank, r in enumerate(pools.run(spec, eval_compiled, timeout=600)):
        assert r["graphs"] == 1 and r["breaks"] == 0, (rank, r)
        assert max(r["diffs"]) <= 1e-6 and r["one"] <= 1e-5 and not r["grad"], (rank, r)


def uneven_parity(spec, param_dtype):
    """Leaves whose rows do not split evenly over the ranks (padded in the gather, the
    padding's gradient dropped), in float32 and bfloat16."""
    from test_compiled_step import _train

    torch._dynamo.reset()
    cfg = dict(vocab=33, dim=17, heads=1, layers=2, seq=8)
    batches = _batches(3, dist.get_world_size())
    policy = fs.Policy(param_dtype=param_dtype)

    def model():
        torch.manual_seed(0)
        from funshard.testing.models import GPT
        return GPT(**cfg)

    (el, ep), (cl, cp) = (_train(spec, model(), policy, c, batches) for c in (False, AOT))
    torch._dynamo.reset()
    return max(abs(a - b) for a, b in zip(cl, el)), _max_diff(cp, ep)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_uneven_rows_compiled_train_as_the_eager_step(pools, param_dtype):
    for rank, (dl, dp) in enumerate(pools.run(2, uneven_parity, param_dtype, timeout=600)):
        tol = (1e-5, 1e-5) if param_dtype is None else (2e-2, 2e-3)
        assert dl <= tol[0] and dp <= tol[1], (rank, dl, dp)


def switching(spec, path, steps=6):
    """A run that switches between the compiled and the eager step at a checkpoint (and
    back, within one process) trains as the run that never switches; twenty compiled
    steps of one batch shape make one graph, no break, no recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(steps, world)
    mine = [(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]) for x, y in batches]
    policy = fs.Policy(clip_norm=1.0)

    def fresh(compile):
        model = _gpt()
        step = fs.train_step(_loss(model), fs.optim.adamw(LR, weight_decay=0.1),
                             policy=policy, compile=compile)
        return step, step.init(fs.shard(fs.params(model), mesh(spec)))

    eager, state = fresh(False)
    for b in mine:
        state, _ = eager(state, b)
    ref = {k: v.clone() for k, v in fs.unshard(state.params).items()}
    compiled, state = fresh(AOT)
    for b in mine[:2]:
        state, _ = compiled(state, b)
    fs.checkpoint.save(path, state)
    eager2, like = fresh(False)
    state = fs.checkpoint.load(path, like=like)
    state, _ = eager2(state, mine[2])  # eager from the compiled run's checkpoint
    for b in mine[3:]:
        state, _ = compiled(state, b)  # and the compiled step again on the eager's state
    got = fs.unshard(state.params)
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    counters.clear()
    for _ in range(20):
        state, metrics = compiled(state, mine[0])
    out = (diff, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
           counters["recompiles"] if "recompiles" in counters else {})
    torch._dynamo.reset()
    return out


def test_switching_between_compiled_and_eager_at_a_checkpoint(pools, tmp_path):
    for rank, (diff, graphs, breaks, recompiles) in enumerate(
            pools.run(2, switching, str(tmp_path / "ckpt"), timeout=600)):
        assert diff <= 1e-5, (rank, diff)
        assert graphs == 0 and breaks == 0 and not recompiles, (rank, graphs, breaks,
                                                                  recompiles)


def mixed_reduce(spec):
    """Policy(param_dtype=bfloat16, reduce_dtype=float32) compiled: gathered in bfloat16,
    reduced in float32 (as the eager step and FSDP2's MixedPrecisionPolicy do), as the eager
    step trains; the collectives' dtypes read from the program's graph."""
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def record(gm, example_inputs):
        for n in gm.graph.nodes:
            name = getattr(n.target, "__name__", "")
            if "all_gather_into_tensor" in name or "reduce_scatter_tensor" in name:
                seen.append((name.split(".")[0], n.args[0].meta["val"].dtype))
        return gm

    torch._dynamo.reset()
    batches = _batches(4, dist.get_world_size())
    policy = fs.Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, clip_norm=1.0)
    eager = _run(spec, _loss, policy, False, batches)
    compiled = _run(spec, _loss, policy, {"backend": aot_autograd(fw_compiler=record)},
                    batches)
    return (max(abs(a - b) for a, b in zip(eager[0], compiled[0])),
            _max_diff(compiled[1], eager[1]), sorted(set(seen), key=str))


def test_mixed_precision_gathers_in_bfloat16_and_reduces_in_float32(pools):
    for rank, (dl, dp, seen) in enumerate(pools.run(2, mixed_reduce, timeout=600)):
        assert dl <= 2e-2 and dp <= 2e-3, (rank, dl, dp)
        assert seen == [("all_gather_into_tensor", torch.bfloat16),
                        ("reduce_scatter_tensor", torch.float32)], seen


def uneven_micro_batches(spec, steps=3):
    """fs.MicroBatches of two shapes (sequences of 8 and 5 tokens) under accumulate=2: a
    program per micro-batch shape, each tried at the first step; equal to the eager step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(steps, world)

    def mine(x, y):
        x, y = x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]
        return fs.MicroBatches([(x, y), (x[:, :5], y[:, :5])])

    out = {}
    for name, compile in (("eager", False), ("compiled", AOT)):
        counters.clear()
        model = _gpt()
        step = fs.train_step(_mean_loss(model), fs.optim.adamw(LR),
                             policy=fs.Policy(accumulate=2), compile=compile)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        losses = []
        for x, y in batches:
            state, m = step(state, mine(x, y))
            losses.append(float(m["loss"]))
        out[name] = (losses, {k: v.clone() for k, v in fs.unshard(state.params).items()},
                     counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    (el, ep, _), (cl, cp, graphs) = out["eager"], out["compiled"]
    return max(abs(a - b) for a, b in zip(el, cl)), _max_diff(cp, ep), graphs


def test_micro_batches_of_two_shapes_compile_one_program_each(pools):
    for rank, (dl, dp, graphs) in enumerate(pools.run(2, uneven_micro_batches, timeout=600)):
        assert dl <= 1e-5 and dp <= 1e-5 and graphs == 3, (rank, dl, dp, graphs)
