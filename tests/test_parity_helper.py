"""funshard.testing.assert_parity: passes where N ranks match one process, and fails naming the
mesh, step, leaf and difference where they do not."""

import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import Pool, assert_parity
from funshard.testing.models import MLP

SGD = functools.partial(fs.optim.sgd, lr=0.1)


def params():
    """A tree with a frozen float leaf and an integer leaf beside the trained ones."""
    g = torch.Generator().manual_seed(0)
    return {"layers": [{"w": torch.randn(7, 5, generator=g).requires_grad_(),
                        "b": torch.randn(7, generator=g).requires_grad_()}],
            "head": torch.randn(3, 7, generator=g).requires_grad_(),
            "frozen": torch.randn(4, generator=g), "count": torch.arange(3)}


def batches(steps=3, rows=8, sentinel_at=None):
    """(x, y) batches; ``sentinel_at=(step, row)`` marks one row (x[row, 0] = 100) of a step."""
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g))
           for _ in range(steps)]
    if sentinel_at is not None:
        out[sentinel_at[0]][0][sentinel_at[1], 0] = 100.0
    return out


def loss_fn(p, batch):
    x, y = batch  # (B, 5), (B, 3)
    layer = p["layers"][0]
    h = torch.tanh(x @ layer["w"].T + layer["b"] + p["frozen"].sum())  # (B, 7)
    return F.mse_loss(h @ p["head"].T, y)


def skewed_gradient(p, batch):
    """loss_fn, whose gradient of layers.0.b is off on rank 1 for a batch with the sentinel
    row (its value is not: the loss matches)."""
    loss = loss_fn(p, batch)
    if dist.is_initialized() and dist.get_rank() == 1 and bool((batch[0][:, 0] > 99).any()):
        b = p["layers"][0]["b"]
        loss = loss + 0.1 * (b - b.detach()).sum()
    return loss


def skewed_loss(p, batch):
    """loss_fn plus 1 on rank 1 from the second step on (the batch with the sentinel)."""
    loss = loss_fn(p, batch)
    if dist.is_initialized() and dist.get_rank() == 1 and bool((batch[0][:, 0] > 99).any()):
        loss = loss + 1.0
    return loss


def test_a_loss_fn_and_tree_train_as_one_process(pools):
    assert_parity(pools, loss_fn, SGD, batches(rows=24), params=params(),
                  meshes=[1, 2, 3, "2x2"], policy=fs.Policy(clip_norm=0.5, accumulate=2),
                  atol=1e-6)


def test_a_model_trains_as_one_process(pools):
    torch.manual_seed(0)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    before = {k: v.detach().clone() for k, v in fs.params(model).items()}
    assert_parity(pools, model, functools.partial(fs.optim.adamw, lr=1e-2, weight_decay=0.1),
                  batches(), criterion=F.mse_loss, meshes=["2x2", 4],
                  policy=fs.Policy(reshard_after_forward=False))
    assert all(torch.equal(v, before[k]) for k, v in fs.params(model).items())  # untouched


def test_a_plain_pool_serves_meshes_of_its_world():
    with Pool(2) as pool:
        assert_parity(pool, loss_fn, SGD, batches(steps=2), params=params(), meshes=[2, "1x2"])
        with pytest.raises(ValueError, match=r"mesh '2x2' needs 4 ranks; the Pool has 2"):
            assert_parity(pool, loss_fn, SGD, batches(), params=params(), meshes=["2x2"])


def test_a_skewed_gradient_fails_naming_the_step_and_leaf(pools):
    with pytest.raises(AssertionError) as e:
        assert_parity(pools, skewed_gradient, SGD, batches(sentinel_at=(1, 5)),
                      params=params(), meshes=[2])
    msg = str(e.value)
    # (the skew is the same on every element: where the largest lands is the rounding's)
    assert re.match(r"assert_parity: mesh 2, step 2 of 3, rank 0: leaf 'layers.0.b' "
                    r"differs by 0\.005 \(max abs diff, at \(\d+,\): ", msg), msg
    assert "beyond atol=1e-05 + rtol=1e-05 * |one process|" in msg, msg
    assert "N ranks vs one process on the concatenated batch" in msg


def test_a_skewed_loss_fails_naming_the_step(pools):
    with pytest.raises(AssertionError) as e:
        assert_parity(pools, skewed_loss, SGD, batches(sentinel_at=(2, 3)), params=params(),
                      meshes=["2x2"])
    msg = str(e.value)
    assert msg.startswith("assert_parity: mesh '2x2', step 3 of 3, rank 0: the loss differs: "), msg
    assert "(diff 0.25)" in msg, msg  # rank 1's +1, one of 4 ranks' mean


def test_a_tolerance_wide_enough_passes_the_skew(pools):
    assert_parity(pools, skewed_gradient, SGD, batches(sentinel_at=(1, 5)), params=params(),
                  meshes=[2], atol=1e-2)


def test_bad_arguments_are_refused_by_name(pools):
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    with pytest.raises(TypeError, match=r"picklable factory.*functools.partial"):
        assert_parity(pools, loss_fn, fs.optim.sgd(lr=0.1), batches(), params=params())
    with pytest.raises(TypeError, match="criterion="):
        assert_parity(pools, model, SGD, batches())
    with pytest.raises(TypeError, match="params=, the tree it trains"):
        assert_parity(pools, loss_fn, SGD, batches())
    with pytest.raises(TypeError, match="not with a model"):
        assert_parity(pools, model, SGD, batches(), params=params(), criterion=F.mse_loss)
    with pytest.raises(ValueError, match=r"batches\[0\] leaf '0' has 6 rows: mesh 4 splits dim "
                                         r"0 over 4 ranks x 1 micro-batches; give a multiple of 4"):
        assert_parity(pools, loss_fn, SGD, batches(rows=6), params=params(), meshes=[4])
    with pytest.raises(ValueError, match="non-empty list"):
        assert_parity(pools, loss_fn, SGD, [], params=params())
    with pytest.raises(ValueError, match=r"'2by2': a 2-D spec is 'RxS'"):
        assert_parity(pools, loss_fn, SGD, batches(), params=params(), meshes=["2by2"])
    with pytest.raises(TypeError, match="policy must be an fs.Policy"):
        assert_parity(pools, loss_fn, SGD, batches(), params=params(), policy={"accumulate": 2})
