"""fs.optim.muon: equal to torch.optim.Muon (2-D leaves) + torch.optim.AdamW (the rest) on one
process, on 1 process, 2 ranks and 2x2; each matrix is orthogonalised on one owner, and the
bytes moved are exactly each matrix's non-owner rows twice, in bfloat16."""

from __future__ import annotations

import pytest
import torch

import funshard as fs
from funshard import optim
from funshard.testing import CountCollectives, mesh

SHAPES = {"w1": (6, 4), "w2": (4, 7), "w3": (5, 5), "b": (7,), "norm": (4,)}
STEPS = 3
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.9)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    init = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(STEPS)]
    return init, grads


def _torch_reference(init, grads, adjust_lr_fn=None):
    ref = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    mats = [ref[k] for k in SHAPES if len(SHAPES[k]) == 2]
    rest = [ref[k] for k in SHAPES if len(SHAPES[k]) != 2]
    o1 = torch.optim.Muon(mats, adjust_lr_fn=adjust_lr_fn, **KW)
    o2 = torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.01)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        o1.step(), o2.step()
    return {k: v.detach() for k, v in ref.items()}


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_one_process_equals_torch_muon(adjust_lr_fn):
    init, grads = _data(1)
    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = optim.muon(adjust_lr_fn=adjust_lr_fn, **KW)
    state = opt.init(params)
    for step, g in enumerate(grads):
        params, state = opt.update(g, state, params, step=step)
    ref = _torch_reference(init, grads, adjust_lr_fn)
    for k in SHAPES:
        torch.testing.assert_close(params[k].detach(), ref[k], rtol=1e-5, atol=1e-5)
    assert state.inner_states["muon"].momentum_buffer["b"] is None
    assert state.inner_states["other"].exp_avg["w1"] is None


def _expected_received(spec_world, me):
    """Bytes this rank receives per step: its owned matrices' other rows, then its own rows
    of the matrices others own (bf16)."""
    mats = [s for s in SHAPES.values() if len(s) == 2]
    own = optim.owners(mats, spec_world)
    total = 0
    for (rows, cols), o in zip(mats, own):
        chunk = -(-rows // spec_world)
        on = lambda r: max(0, min(rows, (r + 1) * chunk) - r * chunk)
        total += (rows - on(me)) * cols * 2 if o == me else on(me) * cols * 2
    return total, own


def shards(spec):
    m = mesh(spec)
    init, grads = _data(2)
    params = fs.shard({k: v.clone() for k, v in init.items()}, m)
    for p in fs.pytree.leaves(params):
        p.requires_grad_(True)
    opt = optim.muon(**KW)
    state = opt.init(params)
    with CountCollectives() as cc:
        for step, g in enumerate(grads):
            params, state = opt.update(fs.reshard(g, like=params), state, params, step=step)
    full, ref = fs.unshard(params), _torch_reference(init, grads)
    err = max((full[k] - ref[k]).abs().max().item() for k in SHAPES)
    sdim = m.mesh_dim_names.index("shard")
    want, own = _expected_received(m.size(sdim), m.get_local_rank(sdim))
    return err, dict(cc.counts), cc.bytes["all_to_all"], want * STEPS, own


@pytest.mark.parametrize("spec", [2, "2x2"])
def test_shards_equal_torch_muon_and_move_each_matrix_twice(pools, spec):
    for err, counts, got, want, own in pools.run(spec, shards):
        assert err < 1e-5, err
        assert counts == {"all_to_all": 2 * STEPS}, counts
        assert got == want, (got, want)
        assert len(set(own)) == 2  # both ranks own a matrix: nobody holds all three


def test_owners_balance_cost():
    assert optim.owners([(4, 4), (8, 8), (4, 4), (2, 2)], 2) == [1, 0, 1, 1]
    assert optim.owners([(3, 3)], 4) == [0]


def test_muon_refuses_what_is_not_a_matrix():
    params = {"b": torch.randn(3, requires_grad=True)}
    opt = optim.chain(optim.scale_by_muon())
    with pytest.raises(ValueError, match=r"muon: leaf b of shape \(3,\) .*not a real 2-D matrix"):
        opt.update({"b": torch.ones(3)}, opt.init(params), params, step=0)
    with pytest.raises(ValueError, match=r"adjust_lr_fn='cubic'"):
        optim.muon(adjust_lr_fn="cubic")
