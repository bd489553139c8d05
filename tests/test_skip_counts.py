"""A step skipped on the device (``Policy(skip_nonfinite=True)``, a dynamic loss scale's
overflow) counts no leaf's update: the counts the host advanced before it read the verdict
are taken back from the leaves the step counted, found in the optimizer's order of the tree
(a dict's keys sorted), not the step's (as inserted)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funshard as fs
from funshard.testing import mesh


class Net(nn.Module):
    """Parameters inserted in another order than their names sort in ("a", "m", "b")."""

    def __init__(self, d=6):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.m = nn.Linear(d, d)
        self.b = nn.Linear(d, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.m(torch.tanh(self.a(x)))))


def skipped_with_a_frozen_leaf(spec, compile):
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    model.a.bias.requires_grad_(False)  # not counted: every later leaf moves in the order
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)

    def loss_fn(p, batch):
        return nn.functional.mse_loss(fs.call(model, p, batch[0]), batch[1])

    step = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2),
                         policy=fs.Policy(skip_nonfinite=True), compile=compile)
    state = step.init(fs.shard(fs.params(model), m))
    g = torch.Generator().manual_seed(1)
    for k in range(4):
        x, y = torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 2, generator=g)
        if k == 1:
            y = y * float("nan")  # skipped
        else:
            opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            opt.step()
        state, metrics = step(state, (x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
    float(metrics["loss"])
    full = fs.unshard(state.params)
    err = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return dict(state.opt_state.count), state.skipped, err


@pytest.mark.parametrize("spec", [1, 2], ids=str)
@pytest.mark.parametrize("compile", [False, {"backend": "aot_eager"}], ids=["eager", "compiled"])
def test_a_skipped_step_counts_no_leaf(pools, spec, compile):
    """Four steps, the second skipped: each trainable leaf counts three updates (the frozen
    one none) and trains as torch's AdamW over the other three batches (bias corrections by
    those counts). Before the fix, ``a.weight`` counted four (the step took the count back
    from a leaf at its position in the other order)."""
    for rank, (counts, skipped, err) in enumerate(pools.run(spec, skipped_with_a_frozen_leaf,
                                                            compile)):
        assert skipped == 1, (rank, skipped)
        assert counts == {"a.weight": 3, "a.bias": None, "m.weight": 3, "m.bias": 3,
                          "b.weight": 3, "b.bias": 3}, (rank, counts)
        assert err < 1e-6, (rank, err)
