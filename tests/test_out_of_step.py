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


def a_collective_the_backend_refuses(spec):
    """Every rank issues an all-gather gloo refuses at once (int16, a dtype it lacks), inside
    funshard's watch: what each rank raises."""
    from funshard.collectives import watch

    x, out = torch.zeros(4, dtype=torch.int16), torch.empty(8, dtype=torch.int16)
    try:
        with watch("all-gather", None):
            dist.all_gather_into_tensor(out, x)
    except Exception as e:  # noqa: BLE001 (what the caller sees is the point)
        return type(e).__name__, str(e)
    return None, ""


def test_a_collective_every_rank_failed_alike_is_not_a_lost_peer(pools):
    """No rank is gone when every rank failed the same collective at once: the error says the
    backend refused it (not "another rank is gone"), and keeps the backend's words."""
    for kind, msg in pools.run(2, a_collective_the_backend_refuses):
        assert kind == "CollectiveRefused", (kind, msg)
        assert "all-gather failed on every rank (2 of 2" in msg, msg
        assert "the backend refused it" in msg and "Backend said: " in msg, msg
        assert "another rank is gone" not in msg, msg


def a_checkpoint_collective_the_backend_refuses(spec):
    """The same refusal inside a checkpoint call's collectives, rank 1 reaching it 0.3 s
    after rank 0, which then finds rank 1's post of the refusal before (a watch's) and must
    wait for its post of this one: what each rank raises."""
    import time

    from funshard.checkpoint import errors

    a_collective_the_backend_refuses(spec)  # an earlier refusal's posts
    if dist.get_rank() == 1:
        time.sleep(0.3)
    x, out = torch.zeros(4, dtype=torch.int16), torch.empty(8, dtype=torch.int16)
    try:
        with errors.peers("checkpoint.save('ckpt')", "checkpoint.save", dist.get_rank()):
            dist.all_gather_into_tensor(out, x)
    except Exception as e:  # noqa: BLE001 (what the caller sees is the point)
        return type(e).__name__, str(e)
    return None, ""


def test_a_checkpoint_collective_every_rank_failed_alike_is_not_a_lost_peer(pools):
    for kind, msg in pools.run(2, a_checkpoint_collective_the_backend_refuses):
        assert kind == "CheckpointError", (kind, msg)
        assert msg.startswith("checkpoint.save('ckpt') failed on every rank (2 of 2"), msg
        assert "the backend refused it" in msg and "another rank is gone" not in msg, msg
