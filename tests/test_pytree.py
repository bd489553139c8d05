"""funshard.pytree: FQN flattening, structure checks with path-named errors, prefix specs."""

from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funshard as fs
from funshard import pytree

Pair = namedtuple("Pair", "left right")

CORPUS = [
    {"w": torch.zeros(2)},
    {"layers": [{"w": torch.ones(3), "b": None}, {"w": torch.ones(1)}], "head": (torch.ones(2),)},
    [torch.zeros(1), (torch.zeros(2), [torch.zeros(3)])],
    Pair(left={"x": torch.zeros(1)}, right=[torch.zeros(2), None]),
    OrderedDict(z=torch.zeros(1), a=torch.zeros(2)),
    {"empty": [], "none": None, "t": torch.zeros(())},
]


@pytest.mark.parametrize("tree", CORPUS, ids=range(len(CORPUS)))
def test_flatten_roundtrip(tree):
    leaves, spec = pytree.flatten(tree)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert pytree.flatten(pytree.unflatten(spec, leaves))[1] == spec
    flat = pytree.fqn_dict(tree)
    assert list(flat.values()) == leaves
    back = pytree.from_fqn_dict(flat, like=tree)
    assert pytree.flatten(back)[1] == spec


def test_fqn_strings_keep_insertion_order():
    tree = {"layers": [{"attn": {"wq": torch.zeros(1)}} for _ in range(12)], "a": torch.zeros(1)}
    keys = list(pytree.fqn_dict(tree))
    assert keys[:3] == ["layers.0.attn.wq", "layers.1.attn.wq", "layers.2.attn.wq"]
    assert keys[10:] == ["layers.10.attn.wq", "layers.11.attn.wq", "a"]


@given(st.recursive(
    st.just(torch.zeros(1)),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.text("abcxyz", min_size=1, max_size=3), kids, max_size=3),
    max_leaves=10,
))
def test_fqn_dict_law(tree):
    """from_fqn_dict(fqn_dict(t), like=t) rebuilds t's structure and leaves."""
    flat = pytree.fqn_dict(tree)
    back = pytree.from_fqn_dict(flat, like=tree)
    assert pytree.flatten(back)[1] == pytree.flatten(tree)[1]
    assert all(a is b for a, b in zip(pytree.leaves(back), pytree.leaves(tree)))


def test_params_of_module_ties_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    p = fs.params(Tied())
    assert list(p) == ["emb.weight", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                       "blocks.1.bias"]
    with pytest.raises(TypeError, match="nn.Module"):
        fs.params({"w": torch.zeros(1)})


@pytest.mark.parametrize(
    "a, b, where, how",
    [
        ({"x": [torch.zeros(1)]}, {"x": (torch.zeros(1),)}, "a['x'] vs b['x']",
         "a has a list, b has a tuple"),
        ({"x": {"y": torch.zeros(1)}}, {"x": {"z": torch.zeros(1)}}, "a['x'] vs b['x']",
         "keys only in a: ['y']; keys only in b: ['z']"),
        ({"l": [torch.zeros(1), torch.zeros(1)]}, {"l": [torch.zeros(1)]}, "a['l'] vs b['l']",
         "a has 2 children, b has 1"),
        ({"x": torch.zeros(1)}, {"x": [torch.zeros(1)]}, "a['x'] vs b['x']",
         "a has a leaf, b has a list node"),
    ],
)
def test_mismatch_names_path_on_both_sides(a, b, where, how):
    with pytest.raises(pytree.TreeMismatchError) as e:
        pytree.check_same_structure(a, b, names=("a", "b"))
    assert where in str(e.value) and how in str(e.value)


def test_leaves_like_allows_none():
    like = {"a": torch.zeros(1), "b": [torch.zeros(2)]}
    assert pytree.leaves_like({"a": None, "b": [torch.ones(2)]}, like)[0] is None
    with pytest.raises(pytree.TreeMismatchError, match=r"keys only in like: \['b'\]"):
        pytree.leaves_like({"a": None}, like, names=("grads", "like"))


def test_broadcast_prefix():
    tree = {"emb": torch.zeros(2), "blocks": [torch.zeros(1), torch.zeros(1)]}
    assert pytree.broadcast_prefix("shard", tree) == ["shard"] * 3
    assert pytree.broadcast_prefix({"emb": "replicate", "blocks": "shard"}, tree) == [
        "replicate", "shard", "shard"]
    assert pytree.broadcast_prefix(lambda name, t: name, tree) == ["emb", "blocks.0", "blocks.1"]
    with pytest.raises(pytree.TreeMismatchError, match="spec is not a prefix"):
        pytree.broadcast_prefix({"emb": "shard"}, tree)


def test_from_fqn_dict_reports_missing_and_unexpected():
    with pytest.raises(pytree.TreeMismatchError,
                       match=r"missing keys \['b'\].*unexpected keys \['c'\]"):
        pytree.from_fqn_dict({"a": 1, "c": 2}, like={"a": torch.zeros(1), "b": torch.zeros(1)})
