"""The compiled step's checks and metrics wait on the device until read: the metrics are a
dict whose values are the eager step's; a refusal comes at the caller's read, or at the next
step's start when the caller never read; the state passed into a refused step trains on as
the eager step's does; the state the refused step returned refuses to be read, saved or
stepped."""

import json
import math
import pickle

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
import torch.distributed as dist

import funshard as fs
from funshard.testing import mesh
from test_compiled_rules import AOT, _scaled_loss, _scales, scaled_step
from test_compiled_step import LR, _batches, _gpt


def _local(x, y, s, rank, per=2):
    rows = slice(rank * per, (rank + 1) * per)
    return x[rows], y[rows], s


def metrics_as_dicts(spec, steps=3):
    """The eager and compiled steps' metrics, as the caller would take them."""
    out = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, compile in (("eager", False), ("compiled", AOT)):
        torch._dynamo.reset()
        model = _gpt()
        step = fs.train_step(_scaled_loss(model), fs.optim.adamw(LR),
                             policy=fs.Policy(clip_norm=0.5), compile=compile)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        seen = []
        for (x, y), s in zip(_batches(steps, world), _scales(steps, -1)):
            state, metrics = step(state, _local(x, y, s, rank))
            kind = type(metrics).__name__
            keys = "loss" in metrics and sorted(metrics.keys())
            loss = metrics.pop("loss")  # the first access: read, then taken out
            assert isinstance(loss, float) and "loss" not in metrics, (loss, metrics)
            metrics["loss"] = loss
            seen.append((kind, keys, json.loads(json.dumps(metrics)), {**metrics},
                         pickle.loads(pickle.dumps(metrics)), metrics == dict(metrics)))
        out[name] = seen
    return out


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_the_metrics_are_a_dict_of_the_eager_steps_values(pools, spec):
    for out in pools.run(spec, metrics_as_dicts, timeout=600):
        for (ek, ekeys, ej, es, ep, eq), (ck, ckeys, cj, cs, cp, cq) in zip(out["eager"],
                                                                            out["compiled"]):
            assert ek == ck == "Metrics" and eq and cq, (ek, ck)
            assert ekeys == ckeys and cj.keys() == ej.keys() and cs.keys() == es.keys()
            assert type(cp) is dict and cp == cs == cj, (cp, cs, cj)
            for key in ("loss", "grad_norm"):
                assert isinstance(cj[key], float) and abs(cj[key] - ej[key]) <= 1e-5, key
            assert cj["skipped"] == 0


def refused_unread(spec, compile, steps=6, bad=2, read=False):
    """Train, the ``bad``-th batch NaN, reading each step's metrics (``read``) or not. At
    the refusal, go on from the state passed into the refused step, with the batch after
    it. What was raised at which batch, what the states returned since raised when saved
    and stepped, the counts and the final parameters."""
    step, state = scaled_step(spec, compile)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = list(zip(_batches(steps, world), _scales(steps, bad)))
    raised, inputs, returned, new, i = [], {}, [], None, 0
    while i < steps:
        (x, y), s = data[i]
        inputs[i] = state
        try:
            new, metrics = step(state, _local(x, y, s, rank))
            if read:
                float(metrics["loss"])
        except FloatingPointError as e:
            raised.append((i, "skipped on the device" in str(e)))
            if "skipped on the device" in str(e):  # the states since the refused step
                returned = [new] if read else [inputs[j] for j in range(bad + 1, i + 1)]
            state, i = inputs[bad], bad + 1
            continue
        state, i = new, i + 1
    for k, r in enumerate(returned):
        for what, act in (("state_dict", lambda: fs.state_dict(r, "full")),
                          ("step", lambda: step(r, _local(x, y, torch.tensor(1.0), rank)))):
            try:
                act()
                raised.append((k, what, "nothing"))
            except (FloatingPointError, ValueError) as e:
                raised.append((k, what, type(e).__name__))
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    return raised, (state.step, state.skipped), full


@pytest.mark.parametrize("read", [False, True], ids=["unread", "read"])
@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_a_refusal_read_late_trains_on_as_the_eager_step(pools, spec, read):
    """The NaN step's refusal raises at the metrics' read or, unread, at the start of the
    step after next (the step between skipped its update on the device too), eager and
    compiled alike. Going on from the state passed into the refused step trains as the
    eager step does; the states returned since raise the refusal when saved or stepped."""
    for (er, ec, ep), (cr, cc, cp) in zip(
            pools.run(spec, refused_unread, False, read=read, timeout=600),
            pools.run(spec, refused_unread, AOT, read=read, timeout=600)):
        returned = [(0, "state_dict", "FloatingPointError"), (0, "step", "FloatingPointError")]
        if not read:  # the refused step's: donated to the next; the next step's: refused
            returned = [(0, "state_dict", "ValueError"), (0, "step", "ValueError"),
                        (1, "state_dict", "FloatingPointError"),
                        (1, "step", "FloatingPointError")]
        assert cr == er == [(2 if read else 4, True)] + returned, (cr, er)
        assert ec == cc == (5, 0), (ec, cc)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5
        assert all(math.isfinite(v.abs().max().item()) for v in cp.values())


def through_refusals(spec, compile, steps, bads, reads):
    """Train on ``steps`` batches, NaN at ``bads``, reading the metrics after the steps in
    ``reads``; at each refusal go on from the state passed into the refused step, with the
    batch after it. Per refusal (the batch whose step raised it, the refused batch); the
    counts; the final parameters."""
    step, state = scaled_step(spec, compile)
    rank, world = dist.get_rank(), dist.get_world_size()
    scales = [torch.tensor(math.nan if i in bads else 1.0) for i in range(steps)]
    data = list(zip(_batches(steps, world), scales))
    refusals, left, inputs, i = [], sorted(bads), {}, 0
    while True:
        try:
            if i == steps:  # the last steps' checks: read at the caller's save
                fs.state_dict(state, "sharded")
                break
            (x, y), s = data[i]
            inputs[i] = state
            new, metrics = step(state, _local(x, y, s, rank))
            if i in reads:
                float(metrics["grad_norm"])
        except FloatingPointError:
            b = left.pop(0)  # the first bad batch not yet refused
            refusals.append((i, b))
            state, i = inputs[b], b + 1
            continue
        state, i = new, i + 1
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    return refusals, (state.step, state.skipped), full


@settings(max_examples=6, deadline=None)
@given(bads=st.sets(st.integers(1, 5), max_size=2), reads=st.sets(st.integers(0, 5)))
def test_refusals_read_late_train_as_the_eager_step(pools, bads, reads):
    """A law over where the NaN batches fall and which steps' metrics the caller reads:
    every refusal names the refused batch, at that step's read or at most two steps later
    (at the caller's next read or the start of the step after next), eager and compiled
    alike, and going on from the state passed into it trains as the eager step does."""
    steps = 6
    for (er, ec, ep), (cr, cc, cp) in zip(
            pools.run(2, through_refusals, False, steps, bads, reads, timeout=600),
            pools.run(2, through_refusals, AOT, steps, bads, reads, timeout=600)):
        assert er == cr and [b for _, b in cr] == sorted(bads), (er, cr, bads, reads)
        for i, b in cr:
            assert i == b if b in reads else b < i <= b + 2, (cr, bads, reads)
        assert ec == cc == (steps - len(bads), 0), (ec, cc)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5


def batchnorm_refused(spec, compile, steps=4, bad=1):
    """BatchNorm's statistics as state.buffers, SGD with momentum (Adam would turn the
    rounding noise of the bias before the norm, whose gradient is zero, into steps of lr);
    the ``bad``-th batch NaN, refused (read at once), then on from the state passed in.
    Whether the refused step's input held its buffers; the final parameters and buffers."""
    from test_buffers import B, _batch, _model
    from test_buffers import _loss as bn_loss

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    step = fs.train_step(bn_loss(model), fs.optim.sgd(0.1, momentum=0.9), compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)), fs.buffers(model))
    held = None
    for i in range(steps):
        x, y = _batch(i, world)
        x = x * math.nan if i == bad else x
        before = {k: v.to_local().clone() for k, v in state.buffers.items()}
        try:
            new, metrics = step(state, (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]))
            float(metrics["loss"])
        except FloatingPointError:
            held = all(torch.equal(before[k], v.to_local()) for k, v in state.buffers.items())
            continue
        state = new
    return held, ({k: v.detach().clone() for k, v in fs.unshard(state.params).items()},
                  {k: v.to_local().clone() for k, v in state.buffers.items()})


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_a_refused_step_keeps_the_buffers_as_the_eager_step(pools, spec):
    """Compiled, the buffers are written back on the device where the step updates: a
    refused step leaves the state passed in with its buffers, and training on matches the
    eager step (which gates its write-back on the device too)."""
    for (e_held, (ep, eb)), (c_held, (cp, cb)) in zip(
            pools.run(spec, batchnorm_refused, False, timeout=600),
            pools.run(spec, batchnorm_refused, AOT, timeout=600)):
        assert e_held and c_held, (e_held, c_held)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5
        assert all(torch.allclose(cb[k].double(), eb[k].double(), atol=1e-5) for k in eb)
        assert int(cb["1.num_batches_tracked"]) == 3, cb["1.num_batches_tracked"]


SKIP_OPTIMIZERS = {  # a schedule, so that a count in doubt tells in the learning rate too
    "adamw": lambda: fs.optim.adamw(fs.optim.linear(LR, LR / 10, 8), weight_decay=0.1),
    "sgd": lambda: fs.optim.sgd(fs.optim.cosine(0.1, 0.01, 8), momentum=0.9,
                                dampening=0.1, weight_decay=0.01),  # (the first step tells)
    "sgd_plain": lambda: fs.optim.sgd(fs.optim.cosine(0.1, 0.01, 8), weight_decay=0.01),
}


def through_skips(spec, compile, optimizer, steps, bads, reads):
    """Train under ``Policy(skip_nonfinite=True, clip_norm=1.0)`` on ``steps`` batches, NaN
    at ``bads``, reading the metrics after the steps in ``reads``: per read step (its index,
    skipped); the counts and the optimizer's per-leaf counts (from the fields, and the
    state dict's numbers, taken first); the final parameters."""
    torch._dynamo.reset()
    model = _gpt()
    step = fs.train_step(_scaled_loss(model), SKIP_OPTIMIZERS[optimizer](),
                         policy=fs.Policy(skip_nonfinite=True, clip_norm=1.0),
                         compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    rank, world = dist.get_rank(), dist.get_world_size()
    scales = [torch.tensor(math.nan if i in bads else 1.0) for i in range(steps)]
    seen = []
    for i, ((x, y), s) in enumerate(zip(_batches(steps, world), scales)):
        state, metrics = step(state, _local(x, y, s, rank))
        if i in reads:
            seen.append((i, metrics["skipped"]))
    saved = {k: v for k, v in fs.state_dict(state, "sharded").items()  # what a checkpoint
             if not isinstance(v, torch.Tensor)}  # takes, before any field is read
    counts = (fs.pytree.leaves(state.opt_state.count), saved)
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    return seen, (state.step, state.skipped, counts), full


@settings(max_examples=6, deadline=None)
@given(bads=st.sets(st.integers(0, 5), max_size=3), reads=st.sets(st.integers(0, 5)),
       optimizer=st.sampled_from(sorted(SKIP_OPTIMIZERS)))
@example(bads={0}, reads=set(), optimizer="sgd")  # SGD's first step in doubt: read at once
@example(bads={1, 2}, reads={4}, optimizer="adamw")  # two in a row, unread
@example(bads={1}, reads=set(), optimizer="sgd_plain")  # no state: the schedule's step
def test_skips_read_late_train_as_the_eager_step(pools, bads, reads, optimizer):
    """A law over where the NaN batches fall and which steps' metrics the caller reads,
    under ``skip_nonfinite``: the compiled step reads nothing until asked, skips the NaN
    steps on the device, and its metrics, counts (the state's and each leaf's, which the
    optimizer's bias corrections and schedule read) and parameters are the eager step's."""
    steps = 6
    for (es, ec, ep), (cs, cc, cp) in zip(
            pools.run(2, through_skips, False, optimizer, steps, bads, reads, timeout=600),
            pools.run(2, through_skips, AOT, optimizer, steps, bads, reads, timeout=600)):
        assert es == [(i, int(i in bads)) for i in sorted(reads)], es
        assert cs == es and cc == ec == (steps, len(bads), ec[2]), (cs, es, cc, ec)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5


def handed_over(spec, second, steps=5, bad=1, at=2):
    """Under ``skip_nonfinite``, batch ``bad`` NaN: a compiled step trains the batches before
    ``at``, unread, and hands its state to ``second`` (another compiled step of its own, or
    the eager step) for the rest: the counts and final parameters."""
    def make(compile):
        return fs.train_step(_scaled_loss(model), SKIP_OPTIMIZERS["adamw"](),
                             policy=fs.Policy(skip_nonfinite=True, clip_norm=1.0),
                             compile=compile)

    torch._dynamo.reset()
    model = _gpt()
    rank, world = dist.get_rank(), dist.get_world_size()
    first = make(AOT)
    then = make(second) if second is not None else first
    state = first.init(fs.shard(fs.params(model), mesh(spec)))
    scales = [torch.tensor(math.nan if i == bad else 1.0) for i in range(steps)]
    for i, ((x, y), s) in enumerate(zip(_batches(steps, world), scales)):
        state, _ = (first if i < at else then)(state, _local(x, y, s, rank))
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    return (state.step, state.skipped, fs.pytree.leaves(state.opt_state.count)), full


@pytest.mark.parametrize("second", ["compiled", "eager"], ids=str)
def test_a_state_handed_to_another_step_unread_trains_as_one_step(pools, second):
    """The verdict of the step before the hand-over is unread (skipped on the device): the
    step it is handed to reads it first (its update's case and the device's scale are the
    first step's), and trains as the one compiled step would."""
    for (rc, rp), (hc, hp) in zip(pools.run(2, handed_over, None, timeout=600),
                                  pools.run(2, handed_over,
                                            AOT if second == "compiled" else False,
                                            timeout=600)):
        assert hc == rc and rc[:2] == (5, 1), (hc, rc)
        assert max((hp[k] - rp[k]).abs().max().item() for k in rp) <= 1e-6


def mean_with_nothing(spec, compile, steps=4, masked=1):
    """fs.Mean under skip_nonfinite and AdamW: batch ``masked`` has every label masked on
    every rank (its count 0: skipped), no metrics read until the end: per step (skipped,
    count), the counts and the final parameters."""
    from test_mean import B, IGNORE, _batch, _loss, _model

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    step = fs.train_step(_loss(model, True), SKIP_OPTIMIZERS["adamw"](),
                         policy=fs.Policy(skip_nonfinite=True), compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    kept = []
    for i in range(steps):
        x, y = _batch(i, world, empty=False)
        if i == masked:
            y = torch.full_like(y, IGNORE)
        state, metrics = step(state, (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]))
        kept.append(metrics)
    seen = [(m["skipped"], m["count"]) for m in kept]
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    return seen, (state.step, state.skipped, fs.pytree.leaves(state.opt_state.count)), full


def test_a_mean_of_nothing_skipped_unread_trains_as_the_eager_step(pools):
    for (es, ec, ep), (cs, cc, cp) in zip(pools.run(2, mean_with_nothing, False, timeout=600),
                                          pools.run(2, mean_with_nothing, AOT, timeout=600)):
        assert [s for s, _ in cs] == [s for s, _ in es] == [0, 1, 0, 0], (cs, es)
        assert cs[1][1] == es[1][1] == 0.0 and cc == ec and ec[:2] == (4, 1), (cc, ec)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5
