"""Where a rank stands in its collectives (funshard.collectives.failures.position), which OutOfStep
compares across ranks ([Note: a rank out of step] in funshard.collectives.failures)."""

import torch
import torch.distributed as dist

from funshard.collectives import failures


def counts_of_a_group_of_two_backends(spec):
    """A group of several device types (as "cpu:gloo,cuda:nccl" on a GPU): each backend's
    collectives counted once, under its own key; here one gloo backend serves both."""
    pg = dist.new_group(backend="cpu:gloo,cuda:gloo")
    try:
        name = dist.distributed_c10d._world.pg_names[pg]
        before = failures.position()
        dist.all_reduce(torch.ones(1), group=pg)
        dist.all_reduce(torch.ones(1), group=pg)
        after = failures.position()
    finally:
        dist.destroy_process_group(pg)
    return {k[len(f"pg {name}"):]: after[k] - before.get(k, 0)
            for k in after if k.startswith(f"pg {name}")}


def test_each_backend_of_a_group_counts_its_own_collectives(pools):
    for got in pools.run(2, counts_of_a_group_of_two_backends):
        assert sum(got.values()) == 2 and len(got) == 1, got
