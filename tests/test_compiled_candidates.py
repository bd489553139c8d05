"""The whole-step compiled candidate the benchmark recommends (``flat``: one functional
all-gather per group, recomputed in backward, ``torch.autograd.grad`` traced into the same
program) on 2 gloo ranks at a tiny shape: one graph, no break, no recompile over 3 steps, the
gradients and the updated shards of its eager twin and of one process, and FULL_SHARD's
collectives (2 all-gathers and 1 reduce-scatter per group, 1 all-reduce for loss and norm).
Compiled with inductor (C++ kernels on the CPU)."""

import dataclasses

import torch

from funshard.testing import mesh


def _tiny():
    from benchmarks import compiled_candidates as cc
    from benchmarks.modes import Config

    return dataclasses.replace(Config(world=2), **cc.SHAPES["tiny"])


def compiled_flat(spec):
    from benchmarks.compiled_candidates import check

    try:
        return check(_tiny(), mesh(spec), "flat", steps=3)
    finally:
        torch._dynamo.reset()  # the worker serves other tests next


def test_flat_candidate_is_one_graph_that_trains_as_eager_and_one_process(pools):
    blocks = _tiny().blocks
    for rank, r in enumerate(pools.run(2, compiled_flat)):
        assert r["breaks"] == 0, (rank, r)
        assert r["graphs"] == [1, 1, 1], f"rank {rank}: recompiled or more than one graph: {r}"
        for key in ("grad_vs_eager", "param_vs_eager", "grad_vs_one", "param_vs_one"):
            assert r[key] < 1e-5, (rank, key, r)
        assert r["collectives"] == {"AG": 2 * blocks, "RS": blocks, "AR": 1}, (rank, r)

