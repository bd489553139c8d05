"""State dicts (full / sharded / local) and checkpoints: round trips, resharding, exact resume,
crash safety (SIGKILL mid-save), corruption, errors, rank-0 peak memory, plain-torch export."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import optree
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import funshard as fs
from funshard.testing import make_tensor
from funshard import checkpoint as ck
from funshard.checkpoint.atomic import _leftovers, _marker
from funshard.state_dict import _flat, _groups
from funshard.step import LossScale
from funshard.testing.models import GPT, MLP, gpt_loss, mse_loss
from funshard.testing import CountCollectives, LiveMemory, mesh
from funshard.testing.strategies import shapes
from conftest import MESHES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "bool": torch.bool}
SHAPES = shapes(max_dims=3, max_side=7)
LEAVES = st.lists(st.tuples(SHAPES, st.sampled_from(sorted(DTYPES))), min_size=1, max_size=4)


def make(shape, dtype, seed):
    return make_tensor(shape, dtype, seed)


def train_state(m, leaves, seed, step=5):
    """A TrainState over {'layers': [...], 'head': ...}: floats train, the rest are frozen."""
    ts = [make(s, d, seed + i) for i, (s, d) in enumerate(leaves)]
    tree = {"layers": [{"w": t} for t in ts[:-1]], "head": ts[-1]}
    params = fs.shard(tree, m)
    for p in fs.pytree.leaves(params):
        p.requires_grad_(p.is_floating_point())
    opt = fs.optim.adamw(1e-2).init(params)  # None state for the frozen (non-float) leaves
    for t in fs.pytree.leaves(opt.exp_avg) + fs.pytree.leaves(opt.exp_avg_sq):
        t._local_tensor.normal_(generator=torch.Generator().manual_seed(seed + 99))
    count = fs.pytree.tree_map(lambda c: c + seed % 7, opt.count)  # the updates each had
    return fs.TrainState(params, opt._replace(count=count), step)


def zeros_like_state(state, step=0):
    z = fs.pytree.tree_map(lambda d: fs.layout.as_dtensor(
        torch.zeros_like(d._local_tensor), d, requires_grad=d.requires_grad), state.params)
    return fs.TrainState(z, fs.pytree.tree_map(lambda d: fs.layout.as_dtensor(
        torch.zeros_like(d._local_tensor), d) if torch.is_tensor(d) else 0, state.opt_state),
        step)


def same(a, b):
    """Bitwise-equal flat dicts of tensors / scalars: the list of keys that differ."""
    bad = [k for k in a if k not in b or type(a[k]) is not type(b[k])
           or (torch.is_tensor(a[k]) and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])))
           or (not torch.is_tensor(a[k]) and a[k] != b[k])]
    return bad + [k for k in b if k not in a]


# -- state_dict / load_state_dict round trips ---------------------------------------------


def roundtrip(spec, leaves, seed):
    m = mesh(spec)
    state = train_state(m, leaves, seed)
    like = zeros_like_state(state)
    rank = dist.get_rank()
    ref = {k: v.full_tensor() if isinstance(v, DTensor) else v
           for k, v in ck.state_dict(state, "sharded").items()}
    ks, vs, _ = _flat(state)  # expected all-gathers: groups holding a non-empty shard
    gathers = sum(any(isinstance(vs[i], DTensor) and _gathered(ks[i], vs[i]) for i in idx)
                  for idx in _groups(ks, vs))
    out = {}
    for kind, kw, lkw in [("sharded", {}, {}), ("local", {}, {}), ("full", {}, {}),
                          ("full", {"rank0_only": True, "cpu_offload": True},
                           {"rank0_only": True})]:
        with CountCollectives() as cc:
            sd = ck.state_dict(state, kind, **kw)
        counts = dict(cc.counts)
        back = ck.load_state_dict(sd if rank == 0 or not kw else None, like, **lkw)
        full = ck.state_dict(back, "full")
        req = [p.requires_grad for p in fs.pytree.leaves(back.params)]
        out[f"{kind}{'-rank0' if kw else ''}"] = dict(
            diff=same(ref, full), counts=counts, keys=list(sd), groups=gathers,
            back_none=_none_paths(back) == _none_paths(state),
            requires_grad=req == [p.requires_grad for p in fs.pytree.leaves(state.params)],
            empty_off_rank0=(sd == {}) if (kw and rank) else None)
    return out


def _gathered(key, d):
    lay = fs.layout.layout_of(key, d)
    return lay.sharded and lay.padded_numel > 0 and lay.world > 1


def _none_paths(state):
    paths, leaves, _ = optree.tree_flatten_with_path(state.opt_state, none_is_leaf=True,
                                                     namespace="funshard")
    return [p for p, v in zip(paths, leaves) if v is None]


@settings(max_examples=6)
@given(spec=st.sampled_from(MESHES), leaves=LEAVES, seed=st.integers(0, 2**16))
def test_state_dict_roundtrip_property(pools, spec, leaves, seed):
    """load_state_dict(state_dict(s, kind), like) == s for every kind, on every mesh."""
    world = fs.testing.world_of(spec)
    for rank, res in enumerate(pools.run(spec, roundtrip, leaves, seed)):
        for kind, r in res.items():
            assert r["diff"] == [], (rank, kind, r["diff"])
            assert r["back_none"] and r["requires_grad"], (rank, kind)
            if kind in ("sharded", "local") or world == 1:
                assert r["counts"] == {}, (kind, r["counts"])  # no communication
            else:
                want = {"all_gather": r["groups"]} if r["groups"] else {}
                assert r["counts"] == want, r["counts"]  # one per group with shards
            if r["empty_off_rank0"] is not None:
                assert r["empty_off_rank0"]
        keys = res["full"]["keys"]
        assert keys[0] == ("params.layers.0.w" if len(leaves) > 1 else "params.head")
        assert keys[-2:] == ["step", "skipped"]
        assert all(k.startswith(("params.", "opt_state.exp_avg.", "opt_state.exp_avg_sq.",
                                 "opt_state.count.")) for k in keys[:-2])


def gpt_kinds(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    model = GPT(vocab=37, dim=12, heads=2, layers=3, seq=8)
    sp = fs.shard(fs.params(model), m)
    stock = model.state_dict()  # has the tied alias head.weight too
    back = ck.load_state_dict(stock, like=sp, strict=False)
    full = ck.state_dict(back, "full")
    ok = same({k: v for k, v in stock.items() if k in full}, full) == []
    with CountCollectives() as cc:
        ck.state_dict(sp, "full")
    try:
        ck.load_state_dict(stock, like=sp)
        strict_err = None
    except ValueError as e:
        strict_err = str(e)
    return ok, list(full) == list(fs.params(model)), dict(cc.counts), strict_err


@pytest.mark.parametrize("spec", MESHES, ids=str)
def test_full_state_dict_is_module_state_dict(pools, spec):
    """A stock model.state_dict() loads (each rank its slice); full gives it back, in order,
    with one all-gather per group (root + 3 blocks)."""
    for ok, ordered, counts, strict_err in pools.run(spec, gpt_kinds):
        assert ok and ordered
        assert counts == ({} if spec == 1 else {"all_gather": 4}), counts
        assert "unexpected key 'head.weight' (shape (37, 12), float32)" in strict_err


# -- errors ---------------------------------------------------------------------------------


def load_errors(spec):
    m = mesh(spec)
    like = fs.shard({"a": torch.zeros(7, 3), "b": torch.zeros(4), "c": torch.zeros(2),
                     "d": torch.zeros(5)}, m)
    bad = {"a": torch.zeros(7, 3), "b": torch.zeros(3), "c": torch.zeros(2, dtype=torch.float16),
           "e": torch.zeros(1, 2)}
    msgs = []
    for rank0_only in (False, True):
        try:
            sd = bad if dist.get_rank() == 0 or not rank0_only else None
            ck.load_state_dict(sd, like, rank0_only=rank0_only)
        except ValueError as e:
            msgs.append(str(e))
    if spec == 4:  # a sharded dict from another mesh cannot be placed without resharding
        sd = ck.state_dict(fs.shard({"a": torch.zeros(7, 3)}, mesh("2x2")), "sharded")
        try:
            ck.load_state_dict(sd, fs.shard({"a": torch.zeros(7, 3)}, m))
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_load_state_dict_lists_every_problem(pools):
    for msgs in pools.run(4, load_errors):
        assert len(msgs) == 3
        for msg in msgs[:2]:  # the same report with or without rank0_only, on every rank
            assert "4 problem(s)" in msg and "nothing was loaded" in msg
            assert "missing key 'd' (like: shape (5,), float32)" in msg
            assert "unexpected key 'e' (shape (1, 2), float32)" in msg
            assert "shape mismatch at 'b': state dict (3,), like (4,)" in msg
            assert "dtype mismatch at 'c' (shape (2,)): state dict float16, like float32" in msg
        assert "layout mismatch at 'a'" in msgs[2] and "reshard" in msgs[2]


def test_bad_kind():
    with pytest.raises(ValueError, match="kind='fulll'; use one of"):
        ck.state_dict({}, "fulll")
    with pytest.raises(ValueError, match="rank0_only / cpu_offload apply to kind='full'"):
        ck.state_dict({}, "sharded", rank0_only=True)


# -- save / load: resharding matrix ----------------------------------------------------------


def small_state(m, seed=0):
    """A TrainState whose contents depend on ``seed`` only, not on the mesh."""
    torch.manual_seed(seed)
    model = MLP(dim=5, hidden=7, layers=2, out=3)  # uneven rows everywhere
    full = fs.params(model)
    g = torch.Generator().manual_seed(seed + 1)
    moments = [{k: torch.randn(v.shape, generator=g) for k, v in full.items()} for _ in range(2)]
    opt = fs.optim.AdamWState(*(fs.shard(x, m) for x in moments))
    return fs.TrainState(fs.shard(full, m), opt, 11)


def save_small(spec, path):
    state = small_state(mesh(spec))
    ck.save(path, state)
    return ck.state_dict(state, "full")


def load_small(spec, path):
    like = small_state(mesh(spec), seed=5)._replace(step=0)
    return ck.state_dict(ck.load(path, like=like), "full")


@pytest.mark.parametrize("src", MESHES, ids=str)
def test_reshard_matrix(pools, tmp_path, src):
    """Saved on src, loaded on each of 1, 2, 3, 4, 2x2: the same full state and step."""
    path = str(tmp_path / "ckpt")
    ref = pools.run(src, save_small, path)[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary left behind
    marker = json.load(open(os.path.join(path, ck.MARKER)))
    assert marker["world_size"] == fs.testing.world_of(src) and marker["step"] == 11
    for dst in MESHES:
        for rank, got in enumerate(pools.run(dst, load_small, path)):
            assert got["step"] == 11
            assert same(ref, got) == [], f"{src} -> {dst}, rank {rank}"


def skipped_counts(spec, path):
    """``TrainState.skipped`` round-trips; a checkpoint written before it existed (a state
    with no such field) loads with 0, whatever the like holds, and the rest as saved."""
    from typing import NamedTuple

    class TrainState(NamedTuple):  # the fields of a TrainState before ``skipped``
        params: dict
        opt_state: object
        step: int
        buffers: object = None

    m = mesh(spec)
    state = small_state(m)._replace(skipped=3)
    ck.save(os.path.join(path, "new"), state)
    ck.save(os.path.join(path, "old"), TrainState(state.params, state.opt_state, 11))
    like = small_state(m, seed=5)._replace(step=0, skipped=7)
    new, old = (ck.load(os.path.join(path, d), like=like) for d in ("new", "old"))
    keys = json.load(open(os.path.join(path, "old", ck.MARKER)))["keys"]
    # in memory (fs.load_state_dict) as from a checkpoint: the old state dict loads with 0;
    # a loss scale the dict lacks is like's, and one like has none of is left out
    sd = ck.state_dict(TrainState(state.params, state.opt_state, 11), "full")
    mem = ck.load_state_dict(sd, like)
    scaled = like._replace(loss_scale=LossScale(8.0, 3))
    ls_in = ck.load_state_dict(sd, scaled).loss_scale
    ls_out = ck.load_state_dict(ck.state_dict(scaled, "full"), like).loss_scale
    return ((new.step, new.skipped), (old.step, old.skipped), "skipped" in keys,
            same(ck.state_dict(state._replace(skipped=0), "full"), ck.state_dict(old, "full")),
            (mem.step, mem.skipped), same(ck.state_dict(old, "full"), ck.state_dict(mem, "full")),
            ls_in, ls_out)


def test_skipped_count_in_checkpoints(pools, tmp_path):
    for r in pools.run(2, skipped_counts, str(tmp_path)):
        assert r == ((11, 3), (11, 0), False, [], (11, 0), [], LossScale(8.0, 3), None), r


@pytest.mark.skipif(not os.environ.get("FUNSHARD_SLOW"), reason="8 ranks: set FUNSHARD_SLOW=1")
def test_reshard_2x2_to_8_ranks(pools, tmp_path):
    """Written on 4 ranks (2x2), read on 8 (1-D and 2x4) and back on 1."""
    path = str(tmp_path / "ckpt")
    ref = pools.run("2x2", save_small, path)[0]
    for dst in (8, "2x4", 1):
        for rank, got in enumerate(pools.run(dst, load_small, path)):
            assert same(ref, got) == [], f"2x2 -> {dst}, rank {rank}"


# -- exact resume ---------------------------------------------------------------------------


def train(spec, model_name, steps, load_from=None, save_to=None):
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if model_name == "gpt":
        model = GPT(vocab=37, dim=12, heads=2, layers=3, seq=8)
        loss_fn = gpt_loss(model)
    else:
        model = MLP(dim=5, hidden=7, layers=3, out=3)
        loss_fn = mse_loss(model)
    step = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2, weight_decay=0.1))
    state = step.init(fs.shard(fs.params(model), m))
    if load_from:
        state = ck.load(load_from, like=state)
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(100 + state.step)  # batch i is the same everywhere
        if model_name == "gpt":
            x, y = (torch.randint(0, 37, (12, 8), generator=g) for _ in range(2))
        else:
            x, y = torch.randn(12, 5, generator=g), torch.randn(12, 3, generator=g)
        per = 12 // world
        state, metrics = step(state, (x[rank * per:(rank + 1) * per],
                                      y[rank * per:(rank + 1) * per]))
        losses.append(metrics["loss"])
    if save_to:
        ck.save(save_to, state)
    return losses, ck.state_dict(state, "full")


@pytest.mark.parametrize("src, dst, model", [("2x2", "2x2", "gpt"), (2, 2, "mlp"),
                                             ("2x2", 3, "mlp"), (1, 4, "mlp")], ids=str)
def test_exact_resume(pools, tmp_path, src, dst, model):
    """4 steps == 2 steps + save + load + 2 steps, AdamW: bitwise on the same mesh; on another
    mesh to float32 round-off (the GPT's key biases have zero gradients, whose round-off
    noise AdamW normalises to +-lr, so across meshes the MLP is compared)."""
    path = str(tmp_path / "step_000002")
    first, _ = pools.run(src, train, model, 2, None, path)[0]
    second, resumed = pools.run(dst, train, model, 2, path)[0]
    straight, ref = pools.run(src, train, model, 4)[0]
    assert resumed["step"] == ref["step"] == 4 and resumed["skipped"] == ref["skipped"] == 0
    if src == dst:
        assert first + second == straight and same(ref, resumed) == []
        return
    assert max(abs(a - b) for a, b in zip(first + second, straight)) < 1e-6
    assert all(ref[k] == resumed[k] for k in ref if not torch.is_tensor(ref[k]))  # counts
    err = max((ref[k] - resumed[k]).abs().max().item() for k in ref if torch.is_tensor(ref[k]))
    assert err < 1e-5, err


# -- atomicity: SIGKILL mid-save ---------------------------------------------------------------

ZYGOTE = r"""
import json, os, sys, time, traceback
sys.path[:0] = [{root!r}, {tests!r}]
import torch, torch.distributed as dist
import torch._dynamo  # imported lazily by the first DTensor: once here, not per fork
torch.set_num_threads(1)
import funshard as fs
from funshard import checkpoint as ck
from test_checkpoint import kill_state

def job(path, step, world, store):
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                dist.init_process_group("gloo", init_method="file://" + store, rank=r,
                                        world_size=world)
                state = kill_state(fs.make_mesh(shard=world), step)
                dist.barrier()
                if r == 0:
                    print(json.dumps({{"saving": step}}), flush=True)
                t0 = time.perf_counter()
                ck.save(path, state)
                if r == 0:
                    print(json.dumps({{"saved": time.perf_counter() - t0}}), flush=True)
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        pids.append(pid)
    os._exit(max(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) != 0 for p in pids))

for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        os.setsid()
        job(**json.loads(line))
    print(json.dumps({{"pid": pid}}), flush=True)
    print(json.dumps({{"done": pid, "code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}}),
          flush=True)
"""


def kill_state(m, step):
    """Contents that depend on ``step``: about 6 MB with AdamW state."""
    g = torch.Generator().manual_seed(step)
    params = fs.shard({f"layers.{i}.w": torch.randn(256, 512, generator=g).requires_grad_()
                       for i in range(4)}, m)
    opt = fs.optim.adamw(1e-2).init(params)
    for t in fs.pytree.leaves(opt.exp_avg) + fs.pytree.leaves(opt.exp_avg_sq):
        t._local_tensor.fill_(float(step))
    return fs.TrainState(params, opt._replace(count=fs.pytree.tree_map(lambda c: step, opt.count)),
                         step)


def verify_after_kill(spec, path, steps):
    """Load ``path`` on this mesh: it must be exactly one of ``steps``; partials must refuse."""
    m = mesh(spec)
    got = ck.state_dict(ck.load(path, like=kill_state(m, 0)), "full")
    match = [s for s in steps if same(ck.state_dict(kill_state(m, s), "full"), got) == []]
    refused = []
    for kind, d in _leftovers(path):
        if _marker(d) is None:
            try:
                ck.load(d, like=kill_state(m, 0))
                refused.append(False)
            except ck.CheckpointError as e:
                refused.append("incomplete or corrupted checkpoint" in str(e))
    return match, refused, ck.latest(os.path.dirname(path))


def test_sigkill_mid_save_never_breaks_the_previous_checkpoint(pools, tmp_path):
    """20 saves killed (SIGKILL, both ranks) at random points: the previous checkpoint stays
    loadable, a partial one is never visible as complete, and loading a partial refuses."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ZYGOTE.format(root=root, tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    zyg = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env)
    path = str(tmp_path / "ckpts" / "step_000001")
    rng = random.Random(0)

    def run(step, kill_after=None):
        """One 2-rank save of ``step``; -> (seconds the save took or None, killed)."""
        zyg.stdin.write(json.dumps({"path": path, "step": step, "world": 2,
                                    "store": str(tmp_path / f"store{step}")}) + "\n")
        zyg.stdin.flush()
        pid, took = None, None
        while True:
            msg = json.loads(zyg.stdout.readline())
            pid = msg.get("pid", pid)
            took = msg.get("saved", took)
            if "saving" in msg and kill_after is not None:
                time.sleep(kill_after)
                try:
                    os.killpg(pid, signal.SIGKILL)  # both ranks, as a machine crash would
                except ProcessLookupError:  # it had finished
                    pass
            if "done" in msg:
                return took, msg["code"] == -signal.SIGKILL

    try:
        took, killed = run(1)  # the first, complete checkpoint; how long a save takes
        assert took is not None and not killed
        committed, kills, partials, outcomes = 1, 0, 0, {"old": 0, "new": 0}
        for step in range(2, 100):
            done, killed = run(step, kill_after=rng.uniform(0, took))
            if done is not None:  # a save that beat its kill: aim by the fastest seen
                took = min(took, done)
            match, refused, newest = pools.run(2, verify_after_kill, path, [committed, step])[0]
            assert match in ([committed], [step]), (step, match)  # exactly old or exactly new
            assert all(refused), refused
            assert newest == path
            partials += len(refused)
            if killed:
                kills += 1
                outcomes["new" if match == [step] else "old"] += 1
            committed = match[0]
            if kills == 20:
                break
        print(f"{kills} kills: previous checkpoint intact after {outcomes['old']}, killed after "
              f"the commit {outcomes['new']}; {partials} partial directories refused to load; "
              f"a save takes {took * 1e3:.0f} ms")
        assert kills == 20 and outcomes["old"] >= 10  # most kills land inside the save
    finally:
        zyg.stdin.close()
        zyg.kill()
        zyg.wait()


# -- a crash between the two renames of a commit, corruption, directories --------------------


def save_step(spec, path, seed, keep=None):
    ck.save(path, small_state(mesh(spec), seed), keep=keep)
    return ck.latest(os.path.dirname(path))


def load_or_error(spec, path, seed=None):
    like = small_state(mesh(spec), seed=99)
    try:
        got = ck.state_dict(ck.load(path, like=like), "full")
    except (ck.CheckpointError, ValueError) as e:
        return type(e).__name__, str(e)
    want = ck.state_dict(small_state(mesh(spec), seed), "full")
    return "ok", same(want, got)


def test_crash_between_renames_is_resolved(pools, tmp_path):
    d = str(tmp_path)
    path = os.path.join(d, "step_000010")
    pools.run(2, save_step, path, 1)
    pools.run(2, save_step, os.path.join(d, "step_000020"), 2)
    # as if the next save of step_000020 died after moving the old one aside
    os.rename(os.path.join(d, "step_000020"), os.path.join(d, "step_000020.old-0123456789ab"))
    assert ck.latest(d) == os.path.join(d, "step_000020")
    assert pools.run(3, load_or_error, os.path.join(d, "step_000020"), 2)[0] == ("ok", [])
    # the next save there rolls it forward, then replaces it; nothing is left behind
    pools.run(2, save_step, os.path.join(d, "step_000020"), 3)
    assert sorted(os.listdir(d)) == ["step_000010", "step_000020"]
    assert pools.run(1, load_or_error, os.path.join(d, "step_000020"), 3)[0] == ("ok", [])


def test_corrupted_or_incomplete_checkpoint_refuses(pools, tmp_path):
    cases = {
        "truncated shard": lambda p: os.truncate(os.path.join(p, "__1_0.distcp"), 100),
        "deleted shard": lambda p: os.unlink(os.path.join(p, "__0_0.distcp")),
        "deleted metadata": lambda p: os.unlink(os.path.join(p, ".metadata")),
        "no marker": lambda p: os.unlink(os.path.join(p, ck.MARKER)),
        "flipped byte": lambda p: _flip(os.path.join(p, "__1_0.distcp")),
    }
    reasons = {}
    for name, damage in cases.items():
        path = str(tmp_path / name.replace(" ", "_") / "step_000001")
        pools.run(2, save_step, path, 1)
        damage(path)
        kind, msg = pools.run(2, load_or_error, path)[0]
        assert kind == "CheckpointError", (name, msg)
        assert f"incomplete or corrupted checkpoint at {path!r}" in msg, msg
        reasons[name] = msg.split(": ", 1)[1]
        if name == "no marker":
            assert ck.latest(os.path.dirname(path)) is None
    assert "CRC32" in reasons["flipped byte"] and "100 bytes" in reasons["truncated shard"]
    kind, msg = pools.run(2, load_or_error, str(tmp_path / "nothing"))[0]
    assert kind == "CheckpointError" and "no checkpoint at" in msg


def _flip(f):
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


def mismatched_like(spec, path):
    m = mesh(spec)
    torch.manual_seed(0)
    params = fs.shard(fs.params(MLP(dim=5, hidden=8, layers=1, out=3)), m)
    try:
        ck.load(path, like=fs.TrainState(params, fs.optim.adamw(1e-2).init(params), 0))
    except ValueError as e:
        return str(e)


def test_load_with_another_model_lists_problems(pools, tmp_path):
    path = str(tmp_path / "c")
    pools.run(2, save_step, path, 1)
    msg = pools.run(2, mismatched_like, path)[1]
    assert "nothing was loaded" in msg
    assert "shape mismatch at 'params.inp.weight': checkpoint (7, 5), like (8, 5)" in msg
    assert "unexpected key 'params.layers.1.0.weight'" in msg


def test_latest_and_keep(pools, tmp_path):
    d = str(tmp_path / "run")
    assert ck.latest(d) is None  # no directory yet
    for step in (5, 10, 15, 20):
        newest = pools.run(2, save_step, os.path.join(d, f"step_{step:06d}"), step, 2)[0]
        assert newest == os.path.join(d, f"step_{step:06d}")
    assert sorted(os.listdir(d)) == ["step_000015", "step_000020"]
    os.makedirs(os.path.join(d, "step_000099"))  # not a checkpoint: ignored, never deleted
    os.makedirs(os.path.join(d, ".step_000001.deleting-0123456789ab"))  # a crashed prune
    assert ck.latest(d) == os.path.join(d, "step_000020")
    assert ck.prune(d, keep=1) == [os.path.join(d, "step_000015")]
    assert sorted(os.listdir(d)) == ["step_000020", "step_000099"]
    open(os.path.join(d, "step_000099", "notes.txt"), "w").close()
    with pytest.raises(fs.testing.RankError, match="is not a funshard checkpoint"):
        pools.run(1, save_step, os.path.join(d, "step_000099"), 1)  # never overwrites it
    assert os.listdir(os.path.join(d, "step_000099")) == ["notes.txt"]


# -- async save ------------------------------------------------------------------------------


def async_then_train(spec, path):
    m = mesh(spec)
    torch.manual_seed(0)
    model = GPT(vocab=37, dim=12, heads=2, layers=3, seq=8)
    step = fs.train_step(gpt_loss(model), fs.optim.adamw(lr=1e-2))
    state = step.init(fs.shard(fs.params(model), m))
    snapshot = ck.state_dict(state, "full")
    fut = ck.save(path, state, async_save=True)
    for _ in range(2):  # updates the shards in place while the save runs
        x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        state, _ = step(state, (x, x))
    done = fut.result(timeout=60)
    got = ck.state_dict(ck.load(path, like=state), "full")
    return done == path, same(snapshot, got), got["step"]


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_async_save_snapshots_and_overlaps(pools, tmp_path, spec):
    path = str(tmp_path / "async")
    for ok, diff, step in pools.run(spec, async_then_train, path):
        assert ok and diff == [] and step == 0


# -- full state dict memory, export / import -------------------------------------------------


def full_peak(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    model = MLP(dim=64, hidden=256, layers=8, out=8)  # 9 groups: root + 8 blocks
    params = fs.shard(fs.params(model), m)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    group_bytes = max(sum(p.numel() * 4 for n, p in model.named_parameters()
                          if n.startswith(f"layers.{i}.")) for i in range(8))
    with LiveMemory() as mem:
        sd = ck.state_dict(params, "full", rank0_only=True, cpu_offload=True)
    ok = same({k: p.detach() for k, p in model.named_parameters()}, sd) == []
    with LiveMemory() as naive:  # everything at once, then copies: the whole model twice
        {k: v.clone() for k, v in fs.unshard(params).items()}
    return mem.peak, naive.peak, model_bytes, group_bytes, ok or dist.get_rank() != 0, len(sd)


def test_full_state_dict_rank0_peak_memory(pools):
    """Rank 0 peaks near the model size (one group on top), the others near one group."""
    res = pools.run(2, full_peak)
    peak, naive, model_bytes, group_bytes, ok, n = res[0]
    print(f"full state dict, rank 0 peak {peak / 2**20:.2f} MiB for a {model_bytes / 2**20:.2f} "
          f"MiB model (max group {group_bytes / 2**20:.2f} MiB; unshard-all {naive / 2**20:.2f} "
          f"MiB); rank 1 peak {res[1][0] / 2**20:.2f} MiB")
    assert ok and n == 20
    assert model_bytes <= peak <= model_bytes + 2 * group_bytes, (peak, model_bytes, group_bytes)
    assert naive > 1.8 * model_bytes
    assert res[1][0] <= 3 * group_bytes and res[1][5] == 0


def export_then_import(spec, path, stock_path):
    m = mesh(spec)
    torch.manual_seed(0)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    sp = fs.shard(fs.params(model), m)
    ck.export_full(path, sp)
    like = fs.pytree.tree_map(lambda d: fs.layout.as_dtensor(
        torch.zeros_like(d._local_tensor), d, requires_grad=True), sp)
    out = []
    for rank0_only in (True, False):
        back = ck.import_full(stock_path, like, rank0_only=rank0_only)
        out.append(same(ck.state_dict(sp, "full"), ck.state_dict(back, "full")))
    return out


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy_format"])
@pytest.mark.parametrize("spec", [1, 3, "2x2"], ids=str)
def test_export_for_plain_torch_and_import(pools, tmp_path, spec, legacy):
    """A stock file of either torch.save format imports (the zip one memory-mapped)."""
    torch.manual_seed(0)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    stock = str(tmp_path / "stock.pt")
    torch.save(model.state_dict(), stock, _use_new_zipfile_serialization=not legacy)
    path = str(tmp_path / "exported.pt")
    for diffs in pools.run(spec, export_then_import, path, stock):
        assert diffs == [[], []]
    fresh = MLP(dim=5, hidden=7, layers=2, out=3)
    fresh.load_state_dict(torch.load(path, weights_only=True))  # strict, plain PyTorch
    x = torch.randn(4, 5)
    assert torch.equal(fresh(x), model(x))
    assert sorted(os.listdir(tmp_path)) == ["exported.pt", "stock.pt"]  # no temporary left
