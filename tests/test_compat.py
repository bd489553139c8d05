"""The private torch funshard uses is found in one place (funshard._compat): on the torch
under test nothing is missing, and where something the eager step needs is missing,
train_step and eval_step refuse to build, naming the torch version and the symbol."""

import pytest
import torch
import torch.nn.functional as F

import funshard as fs
from funshard import _compat


def test_nothing_is_missing_on_this_torch():
    assert _compat.EAGER_MISSING == [] and _compat.MISSING == []


def test_no_frame_walk():
    """funshard recognizes no torch code by its Python frames (they differ per release)."""
    import pathlib

    root = pathlib.Path(fs.__file__).parent
    walks = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if "_getframe" in p.read_text() or "f_back" in p.read_text()]
    assert walks == []


@pytest.mark.parametrize("make", ["train_step", "eval_step"])
def test_a_missing_symbol_refuses_the_step_by_name(monkeypatch, make):
    monkeypatch.setattr(_compat, "EAGER_MISSING", ["torch._C._gone"])
    with pytest.raises(RuntimeError) as e:
        if make == "train_step":
            fs.train_step(lambda p, b: F.mse_loss(p["w"], b), fs.optim.sgd(lr=0.1))
        else:
            fs.eval_step(lambda p, b: p["w"] * b)
    msg = str(e.value)
    assert f"{make} needs torch internals this torch {torch.__version__} lacks" in msg, msg
    assert "torch._C._gone" in msg, msg
