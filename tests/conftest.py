"""Shared fixtures: one pool of spawned gloo ranks per world size for the whole session."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from funshard.testing import DEVICE, Pool, devices_for, world_of

# The repository root, where `benchmarks` and `examples` live outside the library. Under
# pytest's default import mode only tests/ is on sys.path; spawned ranks inherit sys.path.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Examples per property per mesh; FUNSHARD_EXAMPLES raises it (see README).
EXAMPLES = int(os.environ.get("FUNSHARD_EXAMPLES", "25"))
settings.register_profile(
    "funshard",
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=os.environ.get("CI") is not None,
)
settings.load_profile("funshard")

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


class Pools:
    """Lazily started pools, one per world size; ``pools.run(spec, fn, *args)``."""

    def __init__(self):
        self._pools: dict[int, Pool] = {}

    def get(self, spec) -> Pool:
        world = world_of(spec)
        why = devices_for(world)
        if why:
            pytest.skip(f"{DEVICE} lane: {why}")
        if world not in self._pools:
            self._pools[world] = Pool(world, timeout=120.0)
        return self._pools[world]

    def run(self, spec, fn, *args, **kwargs):
        return self.get(spec).run(fn, spec, *args, **kwargs)

    def close(self):
        for p in self._pools.values():
            p.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


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
