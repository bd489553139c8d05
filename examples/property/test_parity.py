"""Your model trains on N ranks as in one process on the concatenated batch: a parity test
of a user's model with ``funshard.testing.assert_parity``, then the same under any policy.

    pytest examples/property/test_parity.py

``assert_parity`` trains ``fs.train_step`` on each mesh of ``funshard_pool`` and, in this
process, the same loss and optimizer on plain tensors over the whole batch; it fails naming
the mesh, the step, the leaf and the difference beyond the tolerance.
"""

import functools

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

import funshard as fs
from funshard.testing import assert_parity
from funshard.testing.strategies import meshes, policies, pool_settings


class TinyClassifier(nn.Module):
    """Your model: defined at module level, so the ranks can unpickle it."""

    def __init__(self, features: int = 6, hidden: int = 10, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(features, hidden)  # weight (10, 6): uneven over 3 or 4 ranks
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
                                    for _ in range(2))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):  # (B, features) -> (B, classes)
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def batches(steps: int = 3, rows: int = 24, seed: int = 0) -> list:
    """Global batches: 24 rows split evenly over 1, 2, 3 or 4 ranks, and in 2 micro-batches."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 5, (rows,), generator=g))
            for _ in range(steps)]


def test_model_trains_as_one_process(funshard_pool):
    torch.manual_seed(0)
    assert_parity(funshard_pool, TinyClassifier(), functools.partial(fs.optim.adamw, lr=1e-2),
                  batches(), criterion=F.cross_entropy, meshes=[2, 3, "2x2"],
                  policy=fs.Policy(clip_norm=1.0))


@settings(pool_settings, max_examples=8)
@given(policy=policies(accumulate=(1, 2)), spec=meshes(max_world=4))
def test_model_trains_as_one_process_under_any_policy(funshard_pool, policy, spec):
    torch.manual_seed(0)
    assert_parity(funshard_pool, TinyClassifier(), functools.partial(fs.optim.sgd, lr=0.1),
                  batches(steps=2), criterion=F.cross_entropy, meshes=[spec], policy=policy)
