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
import torch.distributed as dist

import funshard as fs
from funshard.testing import mesh
from test_compiled_rules import AOT, _scaled_loss, _scales
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
            seen.append((kind, keys, json.loads(json.dumps(metrics)), {**metrics},
                         pickle.loads(pickle.dumps(metrics)), metrics == dict(metrics)))
        out[name] = seen
    return out


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_the_metrics_are_a_dict_of_the_eager_steps_values(pools, spec):
    for out in pools.run(spec, metrics_as_dicts, timeout=600):
        for (ek, ekeys, ej, es, ep, eq), (ck, ckeys, cj, cs, cp, cq) in zip(out["eager"],
                                                                            out["compiled"]):
            assert ek == "dict" and ck == "Metrics" and eq and cq, (ek, ck)
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
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _gpt()
    step = fs.train_step(_scaled_loss(model), fs.optim.adamw(LR, weight_decay=0.1),
                         policy=fs.Policy(clip_norm=1.0), compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
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
    """Eager, the NaN step raises in the step; compiled, at the metrics' read or, unread,
    at the start of the step after next (the step between skipped its update on the
    device too). Going on from the state passed into the refused step trains as the eager
    step does; the states returned since raise the refusal when saved or stepped."""
    for (er, ec, ep), (cr, cc, cp) in zip(
            pools.run(spec, refused_unread, False, read=read, timeout=600),
            pools.run(spec, refused_unread, AOT, read=read, timeout=600)):
        assert er == [(2, False)], er
        returned = [(0, "state_dict", "FloatingPointError"), (0, "step", "FloatingPointError")]
        if not read:  # the refused step's: donated to the next; the next step's: refused
            returned = [(0, "state_dict", "ValueError"), (0, "step", "ValueError"),
                        (1, "state_dict", "FloatingPointError"),
                        (1, "step", "FloatingPointError")]
        assert cr == [(2 if read else 4, True)] + returned, cr
        assert ec == cc == (5, 0), (ec, cc)
        assert max((cp[k] - ep[k]).abs().max().item() for k in ep) <= 1e-5
        assert all(math.isfinite(v.abs().max().item()) for v in cp.values())
