"""The eager step's update gated on the device (funshard.optim.gated's adam_eager and
sgd_eager): where the step applies it is the fs.optim chain's, bit for bit; where it does
not, every tensor keeps its value exactly, whatever the gradients hold (NaN, inf)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funshard as fs
from funshard.optim import gated
from funshard.optim import traced as tr
from funshard.optim.base import flatten, locals_of
from funshard.optim.measured import measured
from funshard.optim.with_policy import with_policy

OPTIMIZERS = {
    "adamw": lambda: fs.optim.adamw(1e-2, weight_decay=0.1),
    "adamw_fused": lambda: fs.optim.adamw(1e-2, weight_decay=0.1, fused=True,
                                          mask=lambda n: not n.endswith("b")),
    "adam_l2": lambda: fs.optim.adam(1e-2, weight_decay=0.1),
    "adam_eps0": lambda: fs.optim.adam(1e-2, eps=0.0),
    "adamw_masked": lambda: fs.optim.adamw(1e-2, weight_decay=0.1,
                                           mask=lambda n: not n.endswith("b")),
    "sgd": lambda: fs.optim.sgd(1e-1),
    "sgd_momentum_l2": lambda: fs.optim.sgd(1e-1, momentum=0.9, weight_decay=0.1),
    "sgd_nesterov": lambda: fs.optim.sgd(1e-1, momentum=0.9, nesterov=True),
}

shapes = st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
                  min_size=1, max_size=4)


def _tree(shapes: list, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}.{'b' if len(s) == 1 else 'w'}": torch.randn(s, generator=g)
            .requires_grad_() for i, s in enumerate(shapes)}


def _gated(opt, grads: dict, state, params: dict, step: int, gain: float, ok: bool):
    """One gated update of ``params`` (in place); the state with its counts advanced."""
    t, gl = opt.traced, flatten(grads)[1]
    prep = tr.prepare(t, gl, state, params, step=step, norm=None)
    leaves = tr.leaves_of(prep, t, locals_of(gl), prep.state, params)
    dev = torch.tensor([gain, float(ok), 1.0])
    with torch.no_grad():
        gated.eager_update(t, prep, leaves, step, dev)
    return prep.state


def _tensors(params: dict, state) -> list:
    return [x.detach() for x in flatten(params)[1] + flatten(state)[1]
            if isinstance(x, torch.Tensor)]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), shapes=shapes,
       clip=st.sampled_from([None, 0.3, 100.0]), steps=st.integers(1, 4),
       seed=st.integers(0, 2**16), grad_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_where_the_step_applies_it_is_the_chain_bit_for_bit(name, shapes, clip, steps, seed,
                                                            grad_dtype):
    """Gradients in the parameters' dtype, or in a reduce dtype (bfloat16) the update
    converts first, as the chain does."""
    opt = with_policy(OPTIMIZERS[name](), clip_norm=clip, skip_nonfinite=False)
    chain_p, gated_p = _tree(shapes, seed), _tree(shapes, seed)
    chain_s, gated_s = opt.init(chain_p), opt.init(gated_p)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        grads = {k: torch.randn(v.shape, generator=g).to(grad_dtype)
                 for k, v in chain_p.items()}
        norm = math.sqrt(sum(float((x.double() ** 2).sum()) for x in grads.values()))
        with measured(grads, norm, True):
            chain_p, chain_s = opt.update(grads, chain_s, chain_p, step=step)
        gain = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
        gated_s = _gated(opt, grads, gated_s, gated_p, step, gain, True)
    # SGD without momentum under a clip: the chain folds the clip factor into the learning
    # rate (one scalar, ``p + (c * -lr) * g``), the gated update scales the gradient (the
    # factor is on the device): one rounding apart
    exact = not (name == "sgd" and clip is not None)
    for a, b in zip(_tensors(chain_p, chain_s), _tensors(gated_p, gated_s)):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-6, atol=1e-7), \
            (name, (a - b).abs().max())


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), shapes=shapes,
       clip=st.sampled_from([None, 0.3]), before=st.integers(0, 2),
       bad=st.sampled_from([math.nan, math.inf, -math.inf, 1.0]), seed=st.integers(0, 2**16))
def test_where_it_does_not_nothing_changes(name, shapes, clip, before, bad, seed):
    """After ``before`` applied steps (a leaf's first update differs for SGD), a step the
    device refuses changes no parameter or state tensor, its gradients NaN, inf or finite."""
    opt = with_policy(OPTIMIZERS[name](), clip_norm=clip, skip_nonfinite=False)
    params = _tree(shapes, seed)
    state = opt.init(params)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(before):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        state = _gated(opt, grads, state, params, step, 1.0, True)
    kept = [x.clone() for x in _tensors(params, state)]
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    first = next(iter(grads.values()))
    first.view(-1)[0] = bad
    _gated(opt, grads, state, params, before, math.nan if bad != 1.0 else 0.5, False)
    for a, b in zip(kept, _tensors(params, state)):
        assert torch.equal(a, b), name


def test_a_gradient_two_leaves_share_is_their_own_before_the_update():
    """The update scales and gates gradients in place: a tensor two leaves' gradients share
    (an op may hand one gradient to two inputs) is copied first, so each is scaled once."""
    from funshard.step.update import Grads, owned

    g, h = torch.ones(3), torch.full((2,), 2.0)
    out = owned(Grads([g, None, g, h], torch.zeros(()), [], (0, 0), (), None, set()))
    assert out.grads[0] is g and out.grads[2] is not g and out.grads[3] is h
    torch._foreach_mul_([x for x in out.grads if x is not None], 0.5)
    assert all(torch.equal(x, torch.full((3,), 0.5)) for x in (out.grads[0], out.grads[2]))


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), shapes=shapes,
       clip=st.sampled_from([None, 0.3]), steps=st.integers(1, 3),
       data=st.data(), seed=st.integers(0, 2**16))
def test_leaves_gated_each_on_their_own_flag_update_as_the_chain_without_the_others(
        name, shapes, clip, steps, data, seed):
    """The eager step's update with leaves in doubt (no rank of this one's loss reached
    them; [Note: a leaf in doubt] in funshard.step.update_program): a leaf whose flag says
    some rank reached it is updated as the chain updates it, bit for bit; a leaf no rank
    reached keeps every tensor, as the chain given no gradient for it."""
    from funshard.step.update_program import _parts

    opt = with_policy(OPTIMIZERS[name](), clip_norm=clip, skip_nonfinite=False)
    chain_p, gated_p = _tree(shapes, seed), _tree(shapes, seed)
    chain_s, gated_s = opt.init(chain_p), opt.init(gated_p)
    names = list(chain_p)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        doubt = data.draw(st.sets(st.sampled_from(names)), label="in doubt")
        reached = data.draw(st.sets(st.sampled_from(names)), label="reached elsewhere")
        grads = {k: torch.randn(v.shape, generator=g) for k, v in chain_p.items()}
        for k in doubt - reached:  # a leaf no rank reached: zeros from the reduction
            grads[k].zero_()
        norm = math.sqrt(sum(float((x.double() ** 2).sum()) for x in grads.values()))
        some = {k: (None if k in doubt - reached else v) for k, v in grads.items()}
        with measured(some, norm, True):
            chain_p, chain_s = opt.update(some, chain_s, chain_p, step=step)
        t, gl = opt.traced, flatten(grads)[1]
        prep = tr.prepare(t, gl, gated_s, gated_p, step=step, norm=None)
        leaves = tr.leaves_of(prep, t, locals_of(gl), prep.state, gated_p)
        gain = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
        order = flatten(gated_p)[0]
        reach = {order.index((k,)): torch.tensor(k in reached) for k in doubt}
        with torch.no_grad():
            for part, part_leaves, gate, each in _parts(
                    prep, leaves, torch.tensor([gain, 1.0, 1.0]), reach, t.fused):
                gated.eager_update(t, part, part_leaves, step, gate, each)
        gated_s = prep.state._replace(count=tr.uncount(
            prep.state.count, [order.index((k,)) for k in doubt - reached]))
    exact = not (name == "sgd" and clip is not None)  # (as above)
    for a, b in zip(_tensors(chain_p, chain_s), _tensors(gated_p, gated_s)):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-6, atol=1e-7), \
            (name, (a - b).abs().max())
