"""A law of ``fs.reduce_grads``: given each rank's full-shape gradients, every shard it returns
is that shard of the mean over the ranks, for any tree on any mesh up to 2 x 2 (on a 2-D
mesh every rank is data-parallel: a reduce-scatter on "shard", an all-reduce on "replicate").

    pytest examples/property/test_reduce_grads.py
"""

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import funshard as fs
from funshard.testing import mesh
from funshard.testing.strategies import meshes, pool_settings, trees

FLOATS = st.sampled_from([torch.float32, torch.float64])  # bfloat16's mean is looser


def gradient_of(x: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s gradient for leaf ``x``, the same wherever it is computed."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)


def mean_law(spec, tree, seed):
    """(On every rank.) reduce_grads of this rank's gradients == the mean over all ranks."""
    like = fs.shard(tree, mesh(spec))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = fs.pytree.tree_map(lambda x: gradient_of(x, rank, seed), tree)
    reduced = fs.pytree.fqn_dict(fs.reduce_grads(mine, like=like))
    shards = fs.pytree.fqn_dict(like)
    for key, x in fs.pytree.fqn_dict(tree).items():
        mean = sum(gradient_of(x, r, seed).double() for r in range(world)) / world
        got = reduced[key]
        assert got.placements == shards[key].placements, (key, got.placements)
        full = got.full_tensor().double()
        assert full.shape == x.shape and got.dtype == x.dtype, (key, full.shape, got.dtype)
        assert torch.allclose(full, mean, atol=1e-6, rtol=1e-6), (key, (full - mean).abs().max())


@settings(pool_settings, max_examples=50)
@given(tree=trees(dtypes=FLOATS), spec=meshes(max_world=4), seed=st.integers(0, 2**16))
def test_reduce_grads_is_the_mean_over_ranks(funshard_pool, tree, spec, seed):
    funshard_pool.run(spec, mean_law, tree, seed)
