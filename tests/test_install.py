"""``step.install``: the tensors land where ``torch.func.functional_call`` puts them, tied names
tied, and a module changed between calls gets a new plan (never a stale one)."""

import gc
import weakref

import torch
from torch import nn

import funshard as fs
from funshard.step.install import install, plan_for
from funshard.testing.models import GPT


def _model():
    torch.manual_seed(0)
    return GPT(vocab=16, dim=8, heads=2, layers=2, seq=4)


def _tensors(model, scale=2.0):
    return {k: v.detach() * scale for k, v in fs.params(model).items()}


def _both(model, tensors, x):
    """The module's output under install and under functional_call, and whether its own
    parameters are back afterwards."""
    own = {k: v for k, v in model.named_parameters(remove_duplicate=False)}
    with install(model, tensors):
        ours = model(x)
    theirs = torch.func.functional_call(model, tensors, (x,))
    back = all(v is own[k] for k, v in model.named_parameters(remove_duplicate=False))
    return ours, theirs, back


def test_same_as_functional_call_tied_and_restored():
    model = _model()
    x = torch.randint(0, 16, (2, 4))
    tensors = _tensors(model)  # fs.params names the tied head once, as wte.weight
    assert "head.weight" not in tensors
    for _ in range(2):  # the second call uses the cached plan
        ours, theirs, back = _both(model, tensors, x)
        assert torch.equal(ours, theirs) and back


def test_a_changed_module_gets_a_new_plan():
    model = _model()
    x = torch.randint(0, 16, (2, 4))
    tensors = _tensors(model)
    _both(model, tensors, x)
    plan = plan_for(model, tuple(tensors))
    # a block replaced by a fresh one: its own weights must not be used
    model.layers[1] = type(model.layers[1])(8, 2)
    assert not plan.valid()
    ours, theirs, back = _both(model, tensors, x)
    assert torch.equal(ours, theirs) and back
    # untied: the head gets its own parameter, and its own value
    model.head.weight = nn.Parameter(model.wte.weight.detach().clone())
    tensors = _tensors(model)
    assert "head.weight" in tensors
    ours, theirs, back = _both(model, tensors, x)
    assert torch.equal(ours, theirs) and back
    # tied again through a module added beside the others
    model.extra = nn.Linear(8, 16, bias=False)
    model.extra.weight = model.head.weight
    with install(model, tensors):
        assert model.extra.weight is tensors["head.weight"]
    assert model.extra.weight is model.head.weight


class _Counter(nn.Module):
    """Rebinds its buffer in forward (functional_call writes the new one back)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + 1
        return self.lin(x)


def test_rebound_buffers_are_written_back_and_unknown_names_fall_back():
    m = _Counter()
    x = torch.randn(2, 3)
    ours = {"lin.weight": torch.ones(3, 3), "lin.bias": torch.zeros(3), "seen": torch.zeros(())}
    theirs = dict(ours)
    with install(m, ours):
        a = m(x)
    b = torch.func.functional_call(m, theirs, (x,))
    assert torch.equal(a, b) and ours["seen"].item() == theirs["seen"].item() == 1.0
    assert m.seen.item() == 0.0
    odd = {"lin.weight": torch.ones(3, 3), "not_a_parameter": torch.ones(1)}
    assert not plan_for(m, tuple(odd)).ok  # torch's own path takes it
    with install(m, odd):
        assert torch.equal(m(x), torch.func.functional_call(m, dict(odd), (x,)))


def test_a_plan_keeps_no_module_alive():
    model = _model()
    with install(model, _tensors(model)):
        pass
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
