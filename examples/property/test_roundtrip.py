"""A round-trip law of sharding, for any tree on any mesh up to 2 x 2: ``unshard(shard(t))``
is ``t`` (values, dtypes, None slots) and ``reshard(unshard(s), like=s)`` is ``s``.

    pytest examples/property/test_roundtrip.py

The law runs on the ranks of ``funshard_pool`` (the pytest plugin's fixture: gloo ranks spawned
once per world size and reused by every example). A rank's failed assertion fails the test
with that rank's traceback, and hypothesis shrinks the tree and the mesh to a small example.
"""

import torch
from hypothesis import given, settings

import funshard as fs
from funshard.testing import mesh
from funshard.testing.strategies import meshes, pool_settings, trees


def roundtrip(spec, tree):
    """(On every rank: module-level, so the ranks can import it.) The law, asserted."""
    sharded = fs.shard(tree, mesh(spec))
    full = fs.unshard(sharded)
    back = fs.reshard(full, like=sharded)
    want, got, shards, again = (fs.pytree.fqn_dict(t) for t in (tree, full, sharded, back))
    assert list(got) == list(want), (list(got), list(want))
    for key, x in want.items():
        assert got[key].dtype == x.dtype and torch.equal(got[key], x), key
        assert again[key].placements == shards[key].placements, key
        assert torch.equal(again[key].to_local(), shards[key].to_local()), key


@settings(pool_settings, max_examples=100)
@given(tree=trees(integers=True, none=True), spec=meshes(max_world=4))
def test_shard_roundtrip(funshard_pool, tree, spec):
    funshard_pool.run(spec, roundtrip, tree)
