"""The harness itself: failures and hangs are reported fast, and the pool recovers."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from funshard.testing import Pool, RankError


def rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for rank 1 forever: the harness must not
    return "unreachable"


def hang_on_rank_0():
    if dist.get_rank() == 0:
        time.sleep(600)
    return "ok"


def die_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


@pytest.fixture(scope="module")
def pool():
    with Pool(2, timeout=60) as p:
        yield p


def test_results_in_rank_order(pool):
    assert pool.run(rank_and_sum) == [(0, 1.0), (1, 1.0)]


def test_a_failing_rank_fails_fast_with_its_traceback(pool):
    t = time.monotonic()
    with pytest.raises(RankError) as e:
        pool.run(fail_on_rank_1)
    assert time.monotonic() - t < 15
    msg = str(e.value)
    assert "rank 1: ValueError: boom on rank 1" in msg and "fail_on_rank_1" in msg
    assert "rank 0: did not answer" in msg
    assert pool.run(rank_and_sum) == [(0, 1.0), (1, 1.0)]  # restarted and usable


def test_a_hanging_rank_times_out(pool):
    t = time.monotonic()
    with pytest.raises(RankError, match="rank 0: timed out"):
        pool.run(hang_on_rank_0, timeout=3)
    assert time.monotonic() - t < 15
    assert pool.run(rank_and_sum)[1] == (1, 1.0)


def test_a_dying_rank_is_reported(pool):
    with pytest.raises(RankError, match="rank 1 died"):
        pool.run(die_on_rank_1)
    assert pool.run(rank_and_sum)[0] == (0, 1.0)


def test_unpicklable_function_is_refused(pool):
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: 1)
