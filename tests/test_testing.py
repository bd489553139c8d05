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


def abort_on_rank_1():
    if dist.get_rank() == 1:
        os.abort()  # as a backend's thread aborts: no Python exception, SIGABRT
    dist.barrier()


def exchange_on_rank_1_only():
    """Rank 1 starts a cross-memory exchange rank 0 never starts, and both return: the
    next call on these ranks would pair rank 0's first exchange with it."""
    from funshard.collectives import cma_link

    link = cma_link.link_of(dist.group.WORLD)  # collective (a handshake)
    if link is None:
        return "no cross-memory exchange here"
    if dist.get_rank() == 1:
        link.post("all-gather", 0, [], lambda peer, words: ([], []))
    return "returned"


def mismatched_exchanges():
    """Both ranks start an exchange, of different sizes: each raises on the other's, which
    stays unconsumed; a next call on these ranks would queue behind it."""
    from funshard.collectives import cma_link

    link = cma_link.link_of(dist.group.WORLD)
    if link is None:
        return "no cross-memory exchange here"
    link.post("all-gather", 8 * (1 + dist.get_rank()), [], lambda peer, words: ([], []))
    link.finish(link.pending[-1]) if link.pending else None
    return "returned"


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


def test_a_crashing_rank_is_reported_with_where_it_crashed(pool):
    with pytest.raises(RankError, match="rank 1 died") as err:
        pool.run(abort_on_rank_1)
    assert "exit code -6" in str(err.value) and "Fatal Python error: Aborted" in str(err.value)
    assert "in abort_on_rank_1" in str(err.value)  # the crashing thread's Python stack
    assert pool.run(rank_and_sum)[0] == (0, 1.0)


def test_unpicklable_function_is_refused(pool):
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: 1)


def test_a_call_that_leaves_ranks_out_of_step_fails_by_name(pool):
    try:
        got = pool.run(exchange_on_rank_1_only)
    except RankError as e:
        msg = str(e)
    else:
        assert got[0] == "no cross-memory exchange here", f"out of step, not seen: {got}"
        pytest.skip(got[0])
    assert "exchange_on_rank_1_only" in msg and "out of step" in msg, msg
    assert "rank 0: ok" in msg and "rank 1: ok" in msg, msg
    assert pool.run(rank_and_sum) == [(0, 1.0), (1, 1.0)]  # restarted and usable


def test_a_call_that_parts_the_ranks_collectives_restarts_the_pool(pool):
    with pytest.raises(RankError) as e:
        got = pool.run(mismatched_exchanges)
        assert got[0] == "no cross-memory exchange here", f"parted, not seen: {got}"
        pytest.skip(got[0])
    msg = str(e.value)
    assert "ranks started different collectives" in msg and "out of step" in msg, msg
    assert pool.run(rank_and_sum) == [(0, 1.0), (1, 1.0)]  # restarted and usable


# -- Pools and the pytest plugin ---------------------------------------------------------


def spec_and_world(spec):
    return spec, dist.get_world_size(), dist.get_rank()


def test_pools_pick_the_world_per_call():
    from funshard.testing import Pools

    pools = Pools(max_world=4)
    try:
        assert pools.run("1x2", spec_and_world) == [("1x2", 2, 0), ("1x2", 2, 1)]
        assert [r[1:] for r in pools.run(3, spec_and_world)] == [(3, 0), (3, 1), (3, 2)]
        with pytest.raises(ValueError, match=r"mesh '2x4' needs 8 ranks; this pool runs at most "
                                             r"4 \(pytest: --funshard-max-world=8\)"):
            pools.run("2x4", spec_and_world)
        with pytest.raises(ValueError, match=r"mesh spec '2x': a 2-D spec is 'RxS'"):
            pools.run("2x", spec_and_world)
        with pytest.raises(TypeError, match=r"mesh spec 2.0: use an int"):
            pools.run(2.0, spec_and_world)
    finally:
        pools.close()


def test_the_suite_pool_is_the_plugin_fixture(pools, funshard_pool):
    assert pools is funshard_pool and pools.max_world >= 8


PLAIN = '''
import multiprocessing
import os
import sys


def test_no_rank_is_spawned():
    assert "funshard.testing.plugin" in sys.modules  # loaded, by its entry point
    assert multiprocessing.active_children() == []
    with open(f"/proc/self/task/{os.getpid()}/children") as f:
        assert f.read().split() == [], "the plugin started processes"
'''

USER = '''
import torch.distributed as dist
from hypothesis import given, settings

import funshard as fs
from funshard.testing.strategies import meshes, pool_settings, trees

CALLS = []


def law(spec, tree):
    """Fails on rank 1 for a matrix of 3 rows or more."""
    if dist.get_rank() == 1:
        for x in fs.pytree.leaves(tree):
            assert not (x.ndim == 2 and x.shape[0] >= 3), f"a matrix of {x.shape[0]} rows"
    return dist.get_rank()


@settings(pool_settings, max_examples=60, database=None, derandomize=True)
@given(tree=trees(), spec=meshes(max_world=2, dims=(1,)))
def test_law(funshard_pool, tree, spec):
    CALLS.append(spec)
    funshard_pool.run(spec, law, tree)


def test_the_pool_kept_serving(funshard_pool):
    assert len(CALLS) > 10  # hypothesis shrank on the pool after the failure
    assert funshard_pool.run(2, law, {"w": __import__("torch").zeros(2, 3)}) == [0, 1]


def test_a_world_past_the_bound(funshard_pool):
    try:
        funshard_pool.run(4, law, {})
    except ValueError as e:
        assert "needs 4 ranks; this pool runs at most 2" in str(e)
    else:
        raise AssertionError("a world of 4 ran")
'''


def run_pytest(path, *args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(path), *args], capture_output=True, text=True, timeout=300,
                          cwd=path.parent)


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/children"),
                    reason="reads a process's children from Linux's /proc")
def test_the_plugin_spawns_nothing_unless_asked(tmp_path):
    (tmp_path / "test_plain.py").write_text(PLAIN)
    out = run_pytest(tmp_path / "test_plain.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout


def test_a_rank_failure_is_the_test_failure_and_shrinks(tmp_path):
    (tmp_path / "test_user.py").write_text(USER)
    out = run_pytest(tmp_path / "test_user.py", "--funshard-max-world=2")
    text = out.stdout
    assert out.returncode == 1 and "1 failed, 2 passed" in text, text + out.stderr
    assert "RankError: law failed on 2 ranks:" in text, text
    assert "--- rank 0: ok" in text and "--- rank 1: AssertionError: a matrix of 3 rows" in text
    assert 'test_user.py", line' in text and "in law" in text  # the rank's traceback
    # shrunk to a small failing example: one (3, 0) leaf, on the world that fails
    case = text[text.index("Failing test case: test_law("):]
    case = case[:case.index(")\n")]
    assert case.count("tensor(") == 1 and "tensor([], size=(3, 0))" in case, case
    assert "spec=2," in case, case


def test_the_memory_meter_leaves_a_compilers_fake_tensors_out():
    """fs.testing's meter counts real storages only: a compiler's fake tensor says it is on
    the CPU, and holds no memory (its storage is on "meta")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from funshard.testing.memory import tensor_bytes

    cpu = torch.device("cpu")
    before = tensor_bytes(cpu)
    with FakeTensorMode():
        fakes = [torch.empty(1 << 20) for _ in range(4)]  # 16 MiB, were they counted
    real = torch.empty(1 << 18)  # 1 MiB
    grown = tensor_bytes(cpu) - before
    assert all(f.device == cpu for f in fakes)
    assert real.untyped_storage().nbytes() <= grown < 2 * real.untyped_storage().nbytes()
