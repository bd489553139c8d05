"""The loss must reach only the parameters the step was given: a module's own nn.Parameter
that it reaches would take its gradient in .grad and never train, so the first step refuses
it by name, before backward, the state unchanged."""

import pytest
import torch
import torch.nn.functional as F

import funshard as fs
from funshard.testing import capture, mesh
from test_misuse import _locals, _unchanged


def foreign_parameters(spec, what):
    """loss_fn reaches a module's own nn.Parameter that the step was not given."""
    from torch import nn

    m = mesh(spec)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    first = {k: v for k, v in fs.params(model).items() if k.startswith("0.")}
    losses = {  # each leaves the last layer's weights out of what the step trains
        "partial_dict": lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
        "outside_call": lambda p, b: F.mse_loss(
            model[2](F.relu(fs.call(model[0], {k[2:]: v for k, v in p.items()}, b[0]))), b[1]),
        "functional_call": lambda p, b: F.mse_loss(
            torch.func.functional_call(model, p, (b[0],)), b[1]),
    }
    step = fs.train_step(losses[what], fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(first, m))
    before = _locals(state)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g))
    t, msg = capture(lambda: step(state, batch))
    untouched = all(p.grad is None for p in model.parameters())  # refused before backward
    x = torch.randn(4, 4, generator=g).requires_grad_()  # an input that requires grad: fine
    frozen = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]), b[1]),
                           fs.optim.sgd(lr=0.1))
    model[2].requires_grad_(False)  # frozen, it is no one's to train
    s2 = frozen.init(fs.shard(first, m))
    s2, met = frozen(s2, (x, batch[1]))
    return t, msg, _unchanged(before, state) and untouched, met["loss"] > 0


FOREIGN = {"partial_dict": "parameter '2.weight' (shape (2, 8), torch.float32) of a module "
                           "given to fs.call",
           "outside_call": "an nn.Parameter of shape (2, 8), torch.float32",
           "functional_call": "an nn.Parameter of shape (2, 8), torch.float32"}


@pytest.mark.parametrize("what", list(FOREIGN))
@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_a_parameter_the_step_was_not_given_is_refused_by_name(pools, spec, what):
    """A module's own parameter reached by the loss would get a .grad and never train: the
    first step refuses it by name, before backward; a frozen one, or an input that requires
    grad, is fine."""
    for t, msg, unchanged, trained in pools.run(spec, foreign_parameters, what):
        assert t == "ValueError" and FOREIGN[what] in msg and "(2 such)" in msg, msg
        assert unchanged and trained
