"""Misuse a user meets early, refused in a few words that name the cause and the fix: groups
that name paths the tree lacks, a tree of plain tensors, and a script whose failed rank 0
destroys the process group on its way out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import funshard as fs
from funshard.testing import capture, free_port, mesh

HERE = Path(__file__).resolve().parent


def _tree():
    return {"emb": torch.randn(6, 4),
            "layers": [{"w": torch.randn(4, 4), "b": torch.randn(4)} for _ in range(2)],
            "head": torch.randn(3, 4)}


@pytest.mark.parametrize("groups, says", [
    ({"emb": "e", "layers": "blocks", "head": "h", "lm_head": "h"},
     ["paths it names that the tree lacks: 'lm_head'"]),
    ({"emb": "e", "layers": "blocks"}, ["paths of the tree it gives no value for: 'head'"]),
    ({"emb": "e", "layers": ["a", "b", "c"], "head": "h"},
     ["paths it names that the tree lacks: 'layers.2'"]),
    ({"emb": "e", "layers": [{"w": "a", "v": "a"}, "b"], "head": ("h",)},
     ["lacks: 'layers.0.v'", "no value for: 'layers.0.b'",
      "at 'head' it has a tuple, the tree a tensor of shape (3, 4)"]),
])
def test_groups_that_do_not_fit_the_tree_name_the_paths(groups, says):
    with pytest.raises(ValueError) as e:
        fs.list_groups(_tree(), fs.Policy(groups=groups))
    msg = str(e.value)
    assert msg.startswith("Policy.groups is not a prefix of the tree:"), msg
    for words in says:
        assert words in msg, msg
    assert "tensor(" not in msg and len(msg.splitlines()) <= 10 and len(msg) < 600, msg


def groups_at_init(spec):
    sparams = fs.shard({k: v.requires_grad_() for k, v in fs.pytree.fqn_dict(_tree()).items()},
                       mesh(spec))
    step = fs.train_step(lambda p, b: p["emb"].sum(), fs.optim.sgd(lr=0.1),
                         policy=fs.Policy(groups={**dict.fromkeys(sparams, "g"), "wte": "g"}))
    return capture(lambda: step.init(sparams))


def test_groups_naming_a_missing_parameter_at_init(pools):
    for t, msg in pools.run(2, groups_at_init):
        assert t == "TreeMismatchError" and "that the tree lacks: 'wte'" in msg, msg
        assert "tensor(" not in msg and len(msg.splitlines()) <= 10, msg


def plain_tensors(spec):
    """A tree of torch.randn leaves (no requires_grad), then the same made trainable."""
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4), "b": torch.randn(4), "c": torch.randn(2)}

    def loss_fn(p, x):
        return ((x @ p["w"] + p["b"]) ** 2).mean() + p["c"].sum()

    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1))
    x = torch.randn(2, 3)
    plain = capture(lambda: step(step.init(fs.shard(params, mesh(spec))), x))
    trainable = {k: v.requires_grad_() for k, v in params.items()}
    state, _ = step(step.init(fs.shard(trainable, mesh(spec))), x)
    return plain, state.step


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_a_tree_of_plain_tensors_is_named(pools, spec):
    for (t, msg), n in pools.run(spec, plain_tensors):
        assert t == "ValueError" and n == 1, (t, msg)
        assert "no leaf of the parameter tree requires grad ('w', 'b', ...: 3 leaves)" in msg
        assert "requires_grad_()" in msg and "before fs.shard" in msg, msg
        assert "fs.params(module)" in msg and "detached" not in msg, msg


@pytest.mark.parametrize("late", [0.0, 0.1], ids=["prompt", "late"])
def test_rank0_error_reaches_its_peer_after_destroy_process_group(late):
    """Rank 0 hosts the store, raises, and its script's ``finally`` destroys the process
    group: the peer names rank 0's error; no exception at exit, no store's C++ frames.
    The script's mesh keeps gloo's connections open until rank 0's teardown, so the peer
    reads only then: ``late``, it reads 0.1 s after its collective failed, while rank 0
    is ending (the store must outlive the group)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "fault_destroy.py"), str(port),
                               str(r), str(late)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
             for r in (0, 1)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert "KeyError: 'boom on rank 0'" in errs[0], errs[0][-2000:]
    last = errs[1].strip().splitlines()[-2]
    assert "RankFailed: funshard: rank 0 failed in train_step (step 1): KeyError: 'boom on " \
           "rank 0'" in last, errs[1][-3000:]
    for err in errs:
        assert "Exception ignored" not in err and "TCPStore" not in err, err[-3000:]
        assert "PeerLost" not in err, err[-3000:]


def tensor_parallel_leaves(spec):
    """A model parallelized with torch's own tensor-parallel API, handed to fs.shard."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return capture(fs.shard, fs.params(model), mesh(spec))


def test_tensor_parallel_leaves_are_refused_by_name(pools):
    """Not a funshard DTensor: the message names the leaf, its mesh and placements and says
    that it composes on a mesh with the model's own dimension (not "fs.unshard them")."""
    for kind, msg in pools.run(2, tensor_parallel_leaves):
        assert kind == "TypeError", (kind, msg)
        for part in ("'0.weight'", "(8, 4)", "'tp': 2", "Shard(dim=0)",
                     "tensor or expert parallel"):
            assert part in msg, (part, msg)
        assert "fs.unshard" not in msg, msg
