"""The bad-input catalogue: one row per invalid input across the public API.

Every row runs on 2 real ranks and asserts the exception type and the words of its message
(the path or key, the shape, the mesh and what to do). Rows that could corrupt state also
check that the state is unchanged afterwards.
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import funshard as fs
from funshard.testing.models import MLP, mse_loss
from funshard.testing import mesh


def _setup():
    m = mesh(2)
    torch.manual_seed(0)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    params = fs.shard(fs.params(model), m)
    step = fs.train_step(mse_loss(model), fs.optim.sgd(lr=0.1))
    state = step.init(params)
    return m, model, params, step, state


def _x():
    return torch.randn(4, 5), torch.randn(4, 3)


# name -> (function of the fixture tuple, exception type name, words the message must have)
CASES = {
    "mesh_product": (lambda m, mo, p, st, s: fs.make_mesh(shard=3, replicate=1),
                     "ValueError", ["shard=3", "world has 2", "shard=2"]),
    "mesh_nonpositive": (lambda *a: fs.make_mesh(shard=0), "ValueError", ["shard=0", "positive"]),
    "mesh_replicate": (lambda *a: fs.make_mesh(replicate=3), "ValueError",
                       ["replicate=3", "world size 2", "divisors"]),
    "mesh_timeout": (lambda *a: fs.make_mesh(timeout=-1), "ValueError", ["timeout=-1"]),
    "shard_non_tensor": (lambda m, *a: fs.shard({"w": torch.ones(2), "n": [1.5]}, m), "TypeError",
                         ["'n.0'", "float", "torch.Tensor"]),
    "shard_not_a_mesh": (lambda m, *a: fs.shard({"w": torch.ones(2)}, "mesh"), "TypeError",
                         ["DeviceMesh", "str"]),
    "shard_no_shard_dim": (
        lambda m, *a: fs.shard({"w": torch.ones(2)},
                               init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))),
        "ValueError", ["'dp': 2", "no 'shard' dimension", "fs.make_mesh"]),
    "shard_foreign_dim": (
        lambda m, *a: fs.shard({"w": torch.ones(2)}, init_device_mesh(
            "cpu", (1, 2), mesh_dim_names=("tp", "shard"))),
        "ValueError", ["dimension 'tp'", "'replicate'", "fs.make_mesh"]),
    "shard_twice": (lambda m, mo, p, *a: fs.shard(p, m), "TypeError",
                    ["'inp.weight'", "(7, 5)", "already a DTensor", "fs.unshard"]),
    "shard_spec_value": (lambda m, *a: fs.shard({"w": torch.ones(3, 2)}, m, spec="rows"),
                         "ValueError", ["'w'", "(3, 2)", "'rows'", "'replicate'"]),
    "shard_spec_prefix": (lambda m, *a: fs.shard({"a": torch.ones(1), "b": torch.ones(1)}, m,
                                                 spec={"a": "shard"}),
                          "TreeMismatchError", ["spec is not a prefix", "callable"]),
    "unshard_plain": (lambda *a: fs.unshard({"w": torch.ones(3)}), "TypeError",
                      ["'w'", "(3,)", "fs.shard"]),
    "unshard_two_meshes": (
        lambda m, mo, p, *a: fs.unshard({"a": p["inp.weight"],
                                         "b": fs.shard(torch.ones(4), mesh("2x1"))}),
        "ValueError", ["'a'", "'b'", "different meshes", "'shard': 2", "'replicate': 2"]),
    "unshard_shard1": (
        lambda m, *a: fs.unshard({"layers.0.w": distribute_tensor(torch.ones(4, 6), m,
                                                                  [Shard(1)])}),
        "ValueError", ["'layers.0.w'", "(4, 6)", "Shard(dim=1)", "'shard': 2", "redistribute"]),
    "unshard_partial": (
        lambda m, *a: fs.unshard({"g": DTensor.from_local(torch.ones(4), m, [Partial()])}),
        "ValueError", ["'g'", "pending reduction"]),
    "reshard_tree": (lambda m, mo, p, *a: fs.reshard({"x": torch.ones(1)}, like=p),
                     "TreeMismatchError", ["keys only in full: ['x']", "like"]),
    "reshard_shape": (lambda m, mo, p, *a: fs.reshard(
        {k: torch.ones(2, 2) if k == "inp.weight" else v.full_tensor() for k, v in p.items()},
        like=p), "ValueError", ["'inp.weight'", "(2, 2)", "(7, 5)"]),
    "reduce_grads_shape": (lambda m, mo, p, *a: fs.reduce_grads(
        {k: torch.ones(v.to_local().shape) for k, v in p.items()}, like=p),
        "ValueError", ["'inp.weight'", "(7, 5)", "full-shape", "not local shards"]),
    "reduce_grads_op": (lambda m, mo, p, *a: fs.reduce_grads(
        {k: torch.ones(v.shape) for k, v in p.items()}, like=p, op="max"),
        "ValueError", ["'mean' or 'sum'", "'max'"]),
    "loss_not_scalar": (lambda m, mo, p, st, s: fs.train_step(
        lambda q, b: torch.func.functional_call(mo, q, (b[0],)), fs.optim.sgd(lr=0.1))(
        s, _x()), "ValueError", ["scalar", "(4, 3)", ".mean()"]),
    "batch_split": (lambda m, mo, p, st, s: fs.train_step(
        mse_loss(mo), fs.optim.sgd(lr=0.1), policy=fs.Policy(accumulate=3))(s, _x()),
        "ValueError", ["batch['0']", "(4, 5)", "accumulate=3", "divisible by 3"]),
    "policy_accumulate": (lambda *a: fs.Policy(accumulate=0), "ValueError", ["accumulate=0"]),
    "policy_clip": (lambda *a: fs.Policy(clip_norm=0.0), "ValueError", ["clip_norm=0.0", "> 0"]),
    "policy_dtype": (lambda *a: fs.Policy(reduce_dtype=torch.int8), "ValueError",
                     ["reduce_dtype=torch.int8", "floating"]),
    "policy_type": (lambda m, mo, *a: fs.train_step(mse_loss(mo), fs.optim.sgd(lr=0.1),
                                                    policy={"accumulate": 2}),
                    "TypeError", ["fs.Policy", "dict"]),
    "step_unsharded": (lambda m, mo, p, st, s: st.init(fs.params(mo)), "TypeError",
                       ["'inp.weight'", "(7, 5)", "fs.shard"]),
    "adamw_betas": (lambda *a: fs.optim.adamw(lr=1e-3, betas=(0.9, 1.0)), "ValueError",
                    ["betas[1]", "1.0"]),
    "sgd_lr": (lambda *a: fs.optim.sgd(lr=-1.0), "ValueError", ["lr", "-1.0"]),
    "state_dict_kind": (lambda m, mo, p, *a: fs.state_dict(p, kind="dense"), "ValueError",
                        ["kind='dense'", "'full'"]),
    "load_missing_unexpected_shape": (lambda m, mo, p, *a: fs.load_state_dict(
        {"inp.weight": torch.ones(2, 2), "extra": torch.ones(1)}, like=p),
        "ValueError", ["inp.weight", "(2, 2)", "(7, 5)", "extra", "head.bias"]),
    "load_dtype": (lambda m, mo, p, *a: fs.load_state_dict(
        {k: v.full_tensor().double() for k, v in p.items()}, like=p),
        "ValueError", ["inp.weight", "float64", "float32"]),
    "checkpoint_missing": (lambda m, mo, p, st, s: fs.checkpoint.load("/nonexistent/ckpt", like=s),
                           "CheckpointError", ["/nonexistent/ckpt"]),
}


def run_case(spec, name, tmp):
    m, model, params, step, state = _setup()
    before = {k: v.to_local().clone() for k, v in params.items()}
    fn, _, _ = CASES[name]
    try:
        fn(m, model, params, step, state)
        result = (None, "no error")
    except Exception as e:  # noqa: BLE001
        result = (type(e).__name__, str(e))
    unchanged = all(torch.equal(before[k], v.to_local()) for k, v in params.items())
    dist.barrier()
    return result, unchanged


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(pools, name, tmp_path):
    _, kind, words = CASES[name]
    for rank, ((got, msg), unchanged) in enumerate(pools.run(2, run_case, name, str(tmp_path))):
        assert got == kind, f"rank {rank}: {got}: {msg}"
        missing = [w for w in words if w not in msg]
        assert not missing, f"rank {rank}: {missing} not in: {msg}"
        assert unchanged, f"rank {rank}: {name} changed the parameters"


def test_catalogue_size():
    assert len(CASES) >= 25


# checkpoint-from-another-model and corrupted-file cases need files on disk


def other_model_checkpoint(spec, path):
    m, model, params, step, state = _setup()
    fs.checkpoint.save(path, state)
    other = MLP(dim=5, hidden=9, layers=3, out=3)
    ostate = fs.train_step(mse_loss(other), fs.optim.sgd(lr=0.1)).init(
        fs.shard(fs.params(other), m))
    out = {}
    try:
        fs.checkpoint.load(path, like=ostate)
        out["other_model"] = (None, "no error")
    except Exception as e:  # noqa: BLE001
        out["other_model"] = (type(e).__name__, str(e))
    dist.barrier()
    if dist.get_rank() == 0:  # corrupt one shard file
        victim = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
        with open(os.path.join(path, victim), "r+b") as f:
            f.seek(0)
            f.write(b"\x00garbage\x00")
    dist.barrier()
    try:
        fs.checkpoint.load(path, like=state)
        out["corrupted"] = (None, "no error")
    except Exception as e:  # noqa: BLE001
        out["corrupted"] = (type(e).__name__, str(e))
    return out


def test_checkpoint_of_another_model_and_corrupted_file(pools, tmp_path):
    for out in pools.run(2, other_model_checkpoint, str(tmp_path / "ck")):
        kind, msg = out["other_model"]
        assert kind in ("ValueError", "CheckpointError") and "layers.2" in msg, msg
        kind, msg = out["corrupted"]
        assert kind == "CheckpointError" and "incomplete or corrupted checkpoint" in msg, msg


def everyones_error_then_a_slow_peer(spec):
    """A step refused on every rank alike (a NaN loss), caught by the caller, is no reason
    for a later collective to fail when a peer is slow to join it: a direct exchange that
    waits checks its peers' failure records, and a record of an error this rank raised
    too says nothing about the exchange."""
    import time

    from funshard.collectives import cma_link
    from funshard.mesh import process_groups

    m, model, params, step, state = _setup()
    if not cma_link.available(process_groups(m)[0]):
        return "no cross-memory exchange here", None
    nan = fs.train_step(lambda p, b: mse_loss(model)(p, b) * float("nan"), fs.optim.sgd(lr=0.1))
    try:
        float(nan(nan.init(params), _x())[1]["loss"])  # the refusal: at the read
        caught = None
    except FloatingPointError as e:
        caught = type(e).__name__
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 waits for it, checking records every 0.25 s
    full = fs.unshard(params, transport="cma")
    return caught, sorted(full) == sorted(fs.params(model))


def test_an_error_every_rank_raised_does_not_fail_a_later_collective(pools):
    for r in pools.run(2, everyones_error_then_a_slow_peer):
        if r[1] is None:
            pytest.skip(r[0])
        assert r == ("FloatingPointError", True), r
