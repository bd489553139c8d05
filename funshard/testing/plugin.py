"""The pytest plugin (installed with funshard): the session's ``funshard_pool`` fixture.

``funshard_pool`` is a :class:`~funshard.testing.pool.Pools`: gloo ranks spawned once per
world size, on first use, and reused by every test and every hypothesis example of the
session. ``funshard_pool.run(spec, fn, *args)`` runs ``fn(spec, *args)`` on the ranks of the
mesh ``spec`` (``2``: 1-D of 2 ranks, ``"2x2"``: replicate x shard) and returns every rank's
result; a rank's exception fails the test with that rank's traceback, and the pool keeps
serving the next example (hypothesis shrinks on it).

    # test_mine.py
    def law(spec, tree):                    # runs on every rank; module-level: pickled
        m = funshard.testing.mesh(spec)
        assert_trees_equal(fs.unshard(fs.shard(tree, m)), tree)

    def test_law(funshard_pool):
        funshard_pool.run("2x2", law, {"w": torch.randn(7, 3)})

Nothing is spawned, and nothing heavier than pytest imported, unless a test asks for the
fixture. ``--funshard-max-world`` (or the ini option ``funshard_max_world``, default 4) bounds
the worlds a session may start.
"""

from __future__ import annotations

import pytest

DEFAULT_MAX_WORLD = 4


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--funshard-max-world N`` and the ini option ``funshard_max_world``."""
    group = parser.getgroup("funshard")
    group.addoption("--funshard-max-world", type=int, default=None, metavar="N",
                    help="the most ranks funshard_pool may spawn for one call "
                         f"(default: the ini option funshard_max_world, else {DEFAULT_MAX_WORLD})")
    parser.addini("funshard_max_world", "the most ranks funshard_pool may spawn for one call",
                  default=str(DEFAULT_MAX_WORLD))


def max_world(config: pytest.Config) -> int:
    """The session's bound on a call's world: the option, else the ini value."""
    n = config.getoption("funshard_max_world", None)
    if n is None:
        raw = config.getini("funshard_max_world")
        try:
            n = int(raw)
        except ValueError:
            raise pytest.UsageError(f"funshard_max_world = {raw!r}: use a whole number of "
                                    "ranks, e.g. 4") from None
    if n < 1:
        raise pytest.UsageError(f"--funshard-max-world={n}: must be >= 1")
    return n


@pytest.fixture(scope="session")
def funshard_pool(request: pytest.FixtureRequest):
    """Spawned gloo ranks for the session: ``funshard_pool.run(spec, fn, *args)`` runs
    ``fn(spec, *args)`` on the ranks of mesh ``spec`` and returns their results in rank order
    (see :class:`funshard.testing.pool.Pools`). A world this machine cannot run on the test
    lane's device skips the test."""
    from .pool import Pools

    pools = Pools(max_world(request.config), unavailable=lambda why: pytest.skip(why))
    yield pools
    pools.close()
