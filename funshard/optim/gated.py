"""The eager step's update of ``adam``, ``adamw`` and ``sgd`` without a host read: the chains'
own foreach ops, gated on the device's verdict of the step (:func:`eager_update`); the
host's part (:func:`funshard.optim.traced.prepare`) is the compiled update's.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .. import _compat
from .base import chunks, lr_at
from .traced import Prepared, Traced


# [Note: an update gated on the device] The eager step that reads nothing on the host runs the
# chains' own foreach ops, in place, a chunk of leaves at a time ([Note: lean updates] in
# :mod:`.base`), with the host's Python scalars (the step's rows: one case, the verdict of
# the step before read) and two device values: the clip factor, and ``ok``, whether the step
# applies. Where it applies, each op is the chain's, with the same operands, so the numbers
# are the chain's bit for bit (but SGD without momentum under a clip: the chain folds the
# clip factor into the learning rate, a host scalar, where here it scales the gradients: one
# rounding apart). Where it does not, each tensor keeps its value exactly, with no
# copy of the state: a refused step's gradients may be NaN, and NaN survives any arithmetic,
# so each gradient is first chosen against a finite tensor (one ``where`` per leaf: the one
# cost per leaf over the chain); the rest is gated by device scalars that make each op the
# identity: Adam's ``lerp(m, g, w)`` with ``g := m``; ``v * b2 + c * g * (g * ok)`` with
# ``b2 := 1``; the decay's ``p * shrink`` with ``shrink := 1``; the step ``p + s * m / den``
# with ``den / ok = inf``; SGD's buffer ``buf * momentum + c * g`` with ``momentum := 1`` and
# ``g := 0``, and ``p + lr * (d * ok)``. Each of these is exact at both ends (``x * 1``,
# ``x + 0``, ``x / inf = 0`` for finite ``x``). With ``eps == 0`` Adam's denominator may be
# 0: its step is ``p + s * (m * ok) / (den + 1 - ok)`` instead. ``adamw(fused=True)`` runs
# torch's fused kernel as the chain does, the verdict its ``found_inf`` (the kernel then
# writes nothing). Three forms were timed side by side (AdamW over the host-bound GPT's 100
# leaves, CPU, ``python -m benchmarks.update_candidates``;
# benchmarks/results/2026-11-27-cpu-eager-no-read.md): the compiled step's function run op
# by op (a ``where`` per tensor) at 2.6x torch's foreach update, the chain's ops out of
# place with each old tensor then chosen by a lerp at 2.1x, and this one, in place, at
# 1.13x, as the chain itself (1.15x); it was kept.


class _Gate(NamedTuple):
    """The step's verdict on the device, in the forms the gated ops take, made once per
    update: the clip factor (None: no clip), ``ok`` (1.0 or 0.0), and as booleans."""

    gain: Optional[torch.Tensor]
    ok: Any  # a 0-d tensor, or one per leaf of a chunk (a list: foreach ops take either)
    keep: Any
    drop: Any
    each: bool = False  # the leaves carry a flag of their own, last in each leaf's tuple

    @staticmethod
    def of(dev: torch.Tensor, clip: bool, each: bool = False) -> "_Gate":
        keep = dev[1] > 0
        return _Gate(dev[0] if clip else None, dev[1], keep, ~keep, each)

    def unless(self, x: float) -> Any:
        """``x`` where the step applies, else 1 (device float32: one, or one per leaf)."""
        if isinstance(self.keep, list):
            return list(torch.where(torch.stack(self.keep), x, 1.0).float().unbind())
        return torch.where(self.keep, x, 1.0).float()

    def off(self) -> Any:
        """``1 - ok``."""
        return [1 - o for o in self.ok] if isinstance(self.ok, list) else 1 - self.ok


def _chunk(leaves: tuple, run: list, gate: _Gate) -> tuple:
    """A chunk's tensors, per kind (gradients, params, state...), its gradients in the params'
    dtypes times the clip factor (in place: the step's own gradients, not needed after), and
    its gate: ``gate``, or, where each leaf carries a flag, one per leaf ([Note: a leaf in
    doubt] in :mod:`funshard.step.update_program`)."""
    cols = tuple(zip(*(leaves[j] for j in run)))
    gs = [g.to(p.dtype) for g, p in zip(cols[0], cols[1])]
    if gate.gain is not None:
        _compat.foreach_mul_(gs, gate.gain)
    if gate.each:
        oks = (gate.ok * torch.stack(cols[-1])).float()
        keep = oks > 0
        gate = gate._replace(ok=list(oks.unbind()), keep=list(keep.unbind()),
                             drop=list((~keep).unbind()))
        cols = cols[:-1]
    return cols, gs, gate


def _chosen(gs: list, gate: _Gate, other) -> list:
    """Each gradient (in place) where the step applies, else ``other``'s tensor (or 0)."""
    keep, drop = gate.keep, gate.drop
    if not isinstance(keep, list):
        keep, drop = [keep] * len(gs), [drop] * len(gs)
    if other is None:
        for g, d in zip(gs, drop):
            g.masked_fill_(d, 0.0)
        return gs
    for g, o, k in zip(gs, other, keep):
        torch.where(k, g, o, out=g)
    return gs


def adam_eager(hyper: tuple, static: tuple, groups: tuple, rows: list, gate: _Gate) -> None:
    """:func:`adam_update`'s update as the chain's foreach ops, in place, gated on ``gate``
    ([Note: an update gated on the device]); ``rows``: the host's scalars per group."""
    b1, b2, eps = hyper
    b2_ok, ok = gate.unless(b2), gate.ok
    for (l2, decay), leaves, (_, s, bc2, shrink) in zip(static, groups, rows):
        shrink_ok = gate.unless(shrink) if decay else None
        for run in chunks([leaf[1] for leaf in leaves]):
            (_, ps, ms, vs), gs, each = _chunk(leaves, run, gate)
            if gate.each:  # a gate per leaf
                b2_ok, ok = each.unless(b2), each.ok
                shrink_ok = each.unless(shrink) if decay else None
            if l2:
                gs = _compat.foreach_add(gs, list(ps), alpha=l2)
            gs = _chosen(gs, each, ms)  # m where the step does not apply: lerp(m, m) = m
            _compat.foreach_lerp_(ms, gs, 1 - b1)
            _compat.foreach_mul_(vs, b2_ok)
            _compat.foreach_addcmul_(vs, gs, _compat.foreach_mul(gs, ok), 1 - b2)
            del gs
            den = _compat.foreach_sqrt(vs)
            _compat.foreach_div_(den, bc2)
            _compat.foreach_add_(den, eps)
            if decay:
                _compat.foreach_mul_(ps, shrink_ok)
            if eps > 0.0:
                _compat.foreach_div_(den, ok)  # inf where the step does not apply
                _compat.foreach_addcdiv_(ps, ms, den, s)
            else:  # den may be 0: (m * 0) / (den + 1) = 0 where the step does not apply
                _compat.foreach_add_(den, each.off())
                _compat.foreach_addcdiv_(ps, _compat.foreach_mul(ms, ok), den, s)
            del den


def sgd_eager(hyper: tuple, static: tuple, groups: tuple, rows: list, gate: _Gate) -> None:
    """:func:`sgd_update`'s update as the chain's foreach ops, in place, gated on ``gate``."""
    momentum, dampening, nesterov = hyper
    mom_ok, ok = gate.unless(momentum), gate.ok
    for (l2, first), leaves, (_, lr) in zip(static, groups, rows):
        for run in chunks([leaf[1] for leaf in leaves]):
            (_, ps, *bufs), gs, each = _chunk(leaves, run, gate)
            if gate.each:  # a gate per leaf
                mom_ok, ok = each.unless(momentum), each.ok
            if l2:
                gs = _compat.foreach_add(gs, list(ps), alpha=l2)
            if not bufs:  # no momentum: p + lr * 0 = p where the step does not apply
                _compat.foreach_add_(ps, _chosen(gs, each, None), alpha=lr)
                continue
            if first:  # a leaf's first update: its buffer is its gradient (or stays)
                gs = _chosen(gs, each, bufs[0])
                _compat.foreach_copy_(bufs[0], gs)
            else:
                gs = _chosen(gs, each, None)
                _compat.foreach_mul_(bufs[0], mom_ok)
                _compat.foreach_add_(bufs[0], gs, alpha=1 - dampening)
            res = _compat.foreach_add(gs, bufs[0], alpha=momentum) if nesterov else bufs[0]
            _compat.foreach_add_(ps, _compat.foreach_mul(res, ok), alpha=lr)


def adam_fused_eager(t: Traced, prep: Prepared, groups: tuple, step: int,
                     gate: _Gate) -> None:
    """``adamw(fused=True)``'s update: the chain's own fused kernel call ([Note: fused Adam]
    in :mod:`.apply`), one per group, device and dtype, with the device's verdict as its
    ``found_inf``: where the step does not apply the kernel writes nothing."""
    b1, b2, eps = t.hyper
    lr, skip = lr_at(t.lr, step), 1 - gate.ok
    for (_, decay), leaves, n in zip(prep.static, groups, prep.counts):
        kinds: dict = {}
        for leaf in leaves:
            kinds.setdefault((leaf[1].device, leaf[1].dtype), []).append(leaf)
        for (device, _), run in kinds.items():
            gs, ps, ms, vs = (list(c) for c in zip(*run))
            gs = [g.to(p.dtype) for g, p in zip(gs, ps)]  # (a reduce dtype's: the params')
            if gate.gain is not None:
                _compat.foreach_mul_(gs, gate.gain)
            steps = [torch.full((), float(n + 1), dtype=torch.float32, device=device)] * len(ps)
            _compat.fused_adamw_(ps, gs, ms, vs, [], steps, lr=lr, beta1=b1, beta2=b2,
                                weight_decay=t.weight_decay if decay else 0.0, eps=eps,
                                amsgrad=False, maximize=False, found_inf=skip)


EAGER = {"adam": adam_eager, "sgd": sgd_eager}


def eager_update(t: Traced, prep: Prepared, groups: tuple, step: int,
                 dev: torch.Tensor, each: bool = False) -> None:
    """The eager step's update of ``groups`` (:func:`leaves_of`), gated on ``dev`` (the clip
    factor, whether the step applies); ``prep`` made with no doubt (one case). ``each``:
    every leaf's tuple ends in a flag of its own (1 or 0 on the device) that gates it too
    (not for the fused kernel, whose verdict is one per call)."""
    gate = _Gate.of(dev, t.clip is not None, each)
    if t.fused:
        adam_fused_eager(t, prep, groups, step, gate)
    else:
        EAGER[t.kind](t.hyper, prep.static, groups, prep.scal[0], gate)
