"""Donation, as ``jax.jit(donate_argnums=)``: the state given to ``step(state, batch)`` is used
up; reading it, saving it or giving it to the step again raises, naming the step and the fix.
The returned state, ``eval_step`` and a step that raised leave states usable."""

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard.testing import capture, mesh
from funshard.testing.models import MLP, mse_loss

FIX = "state, metrics = step(state, batch)"


def buffered(model):
    """``loss_fn((params, buffers), batch)``: the MLP's mean squared error."""

    def buffered_loss(tree, batch):
        return mse_loss(model)(tree[0], batch)

    return buffered_loss


def _setup(spec):
    torch.manual_seed(0)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    step = fs.train_step(buffered(model), fs.optim.adamw(lr=1e-2),
                         policy=fs.Policy(loss_scale=2.0))
    state = step.init(fs.shard(fs.params(model), mesh(spec)), {"b": torch.zeros(3)})
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    return model, step, state, (torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g))


def donated_reads(spec, path):
    """Every way of reading a donated state: (type, message) each."""
    _, step, state, batch = _setup(spec)
    new, _ = step(state, batch)

    def unpack():
        _params, *_ = state

    probes = {
        "params": lambda: state.params, "opt_state": lambda: state.opt_state,
        "buffers": lambda: state.buffers, "loss_scale": lambda: state.loss_scale,
        "index": lambda: state[0], "iter": lambda: list(state), "unpack": unpack,
        "replace": lambda: state._replace(step=5), "asdict": lambda: state._asdict(),
        "pickle": lambda: pickle.dumps(state), "copy": lambda: copy.copy(state),
        "step_again": lambda: step(state, batch),
        "state_dict": lambda: fs.state_dict(state, kind="sharded"),
        "save": lambda: fs.checkpoint.save(path, state),
        "eval": lambda: fs.eval_step(lambda p, x: x)(state, 1),
    }
    out = {k: capture(fn) for k, fn in probes.items()}
    out["counts"] = (state.step, state.skipped, new.step)
    out["repr"] = repr(state)
    out["saved"] = os.path.exists(path)
    newer, _ = step(new, batch)  # the returned state goes on training
    out["newer"] = newer.step
    return out


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_a_donated_state_refuses_every_read(pools, spec, tmp_path):
    for rank, r in enumerate(pools.run(spec, donated_reads, str(tmp_path / "ckpt"))):
        for k in ("params", "opt_state", "buffers", "loss_scale", "index", "iter", "unpack",
                  "replace", "asdict", "pickle", "copy", "step_again", "state_dict", "save",
                  "eval"):
            t, msg = r[k]
            assert t == "ValueError", (rank, k, t, msg)
            assert "TrainState (step 0) was donated to train_step(buffered" in msg, (k, msg)
            assert "returned the state at step 1" in msg and FIX in msg, (k, msg)
        assert "reading its .opt_state" in r["opt_state"][1]
        assert "indexing it ([0]" in r["index"][1]
        assert r["counts"] == (0, 0, 1)  # the counts are plain ints: still readable
        assert r["repr"].startswith("TrainState(<donated to train_step(buffered")
        assert not r["saved"] and r["newer"] == 2


def live_states(spec):
    """What does not donate: init, eval_step, a step that raised; and a live state's
    NamedTuple behaviour (unpacking, _replace, pickling, equality)."""
    model, step, state, batch = _setup(spec)
    evaluate = fs.eval_step(  # a state gives (params, buffers), its params alone params
        lambda p, x: fs.call(model, p[0] if isinstance(p, tuple) else p, x))
    evaluate(state, batch[0])
    evaluate(state.params, batch[0])
    bad = (batch[0][:, :4], batch[1])  # the model raises: the step does not donate
    out = {"failed": capture(lambda: step(state, bad))[0]}
    state1, _ = step(state, batch)
    params, _, n, *_ = state1
    plain = fs.TrainState({"w": torch.ones(2)}, (), 3)
    back = pickle.loads(pickle.dumps(plain))
    out.update(step=n, same=params is state1.params, replace=state1._replace(step=7).step,
               pickled=(type(back).__name__, back.step, torch.equal(back.params["w"],
                                                                    plain.params["w"])),
               equal=(state1 == copy.copy(state1), plain == fs.TrainState(plain.params, (), 3),
                      plain == fs.TrainState(plain.params, (), 4)),
               fields=fs.TrainState._fields, repr=repr(plain)[:20])
    old = copy.copy(state1)  # a copy taken before the call is caught by its step count
    step(state1, batch)
    out["copy_again"] = capture(lambda: step(old, batch))
    return out


def test_live_states_stay_namedtuples(pools):
    for r in pools.run(2, live_states):
        assert r["failed"] is not None and r["step"] == 1 and r["same"], r
        assert r["replace"] == 7 and r["pickled"] == ("TrainState", 3, True), r
        assert r["equal"] == (True, True, False), r
        assert r["fields"] == ("params", "opt_state", "step", "buffers", "skipped",
                               "loss_scale")
        assert r["repr"] == "TrainState(params={'"
        t, msg = r["copy_again"]
        assert t == "ValueError" and "was donated" in msg and FIX in msg, msg
