"""Shared fixtures: the plugin's pool of spawned gloo ranks (one per world size, for the
whole session), the suite's hypothesis profile, and helpers of parity tests."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from funshard.testing import DEVICE
from funshard.testing.strategies import pool_settings

# The repository root, where `benchmarks` and `examples` live outside the library. Under
# pytest's default import mode only tests/ is on sys.path; spawned ranks inherit sys.path.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The funshard_pool fixture comes from funshard's pytest plugin, which pytest loads (before
# this file) where funshard is installed (an entry point); an interpreter that runs the
# checkout without installing it (a GPU machine's, on PYTHONPATH) loads the plugin here.
if "funshard.testing.plugin" not in sys.modules:
    pytest_plugins = ["funshard.testing.plugin"]

# Examples per property per mesh; FUNSHARD_EXAMPLES raises it (see README). The profile
# extends the plugin's ("funshard": no deadline, since a first call spawns ranks).
EXAMPLES = int(os.environ.get("FUNSHARD_EXAMPLES", "25"))
settings.register_profile(
    "funshard-suite",
    pool_settings,
    max_examples=EXAMPLES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=os.environ.get("CI") is not None,
)
settings.load_profile("funshard-suite")

MESHES = [1, 2, 3, 4, "2x2"]


def fsdp2_twin(model, mesh, **kwargs):
    """A copy of ``model`` (a GPT or MLP: its ``layers``) under FSDP2, as parity tests set it
    up: ``fully_shard`` on each layer and on the root, with ``kwargs`` (mp_policy=...)."""
    import copy

    from torch.distributed.fsdp import fully_shard

    twin = copy.deepcopy(model)
    for layer in twin.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(twin, mesh=mesh, **kwargs)
    return twin


def torch_step(opt, loss) -> float:
    """One plain torch step on ``loss`` (the FSDP2 side of a parity test): zero_grad,
    backward, step; returns the loss's mean over the ranks."""
    import torch.distributed as dist

    opt.zero_grad()
    loss.backward()
    opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@pytest.fixture(scope="session")
def pools(funshard_pool):
    """The plugin's ``funshard_pool``: ``pools.run(spec, fn, *args)`` runs ``fn(spec, *args)``
    on the ranks of mesh ``spec``. The suite's worlds go up to 8 (a checkpoint resharded to 8
    ranks, under FUNSHARD_SLOW)."""
    funshard_pool.max_world = max(funshard_pool.max_world, 8)
    return funshard_pool


def pytest_collection_modifyitems(config, items):
    """The CUDA lane (``bash scripts/test.sh --device cuda``) runs the tests marked ``lane``;
    the others build their tensors on the CPU for gloo ranks, and say so as they skip."""
    if DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason=f"CPU-only test (CPU tensors on gloo ranks): not in the "
                                   f"{DEVICE} lane, which runs the tests marked lane")
    for item in items:
        if "lane" not in item.keywords:
            item.add_marker(skip)
