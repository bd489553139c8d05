"""The elementwise transformations: Adam's moments, SGD's momentum (``trace``), scaling by a
number or a learning-rate schedule, weight decay. Each is ``GradientTransformation(init,
update)``; their math is torch.optim's (foreach), op for op.

    >>> adamw = chain(scale_by_adam(0.9, 0.999, 1e-8), add_decayed_weights(0.01),
    ...               scale_by_learning_rate(warmup_cosine(3e-4, 100, 10_000)))
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _compat
from ..reduce import real
from .base import (Delta, EmptyState, FusedAdam, GradientTransformation, RootDen,
                   ScalarOrSchedule, Tree, advance_counts, as_delta, check, check_held,
                   check_lr, chunks, counts_tree, flatten, group_by, locals_of, lr_at,
                   materialize, path_str, unflatten, zeros_tree)


class AdamState(NamedTuple):
    """Adam's first and second moment estimates, each mirroring params (DTensors), and
    ``count``: per leaf, the updates its moments have had (an int; torch.optim's per-parameter
    ``step``), which its bias corrections use. A leaf given no gradient in a step (no rank
    reached it) is skipped, moments and count alike, as torch.optim skips a ``None`` grad."""

    exp_avg: Tree
    exp_avg_sq: Tree
    count: Tree = None  # None: a state made before counts were kept (the step's count)


AdamWState = AdamState  # the name fs.optim.adamw's state always had


class TraceState(NamedTuple):
    """SGD's momentum: ``momentum_buffer`` mirrors params (``None`` leaves when momentum == 0),
    and ``count``: per leaf, the updates its buffer has had (an int; ``None`` leaves when
    momentum == 0). A leaf's buffer starts at its first gradient, whichever step that comes
    at, as torch.optim.SGD starts a parameter's buffer at its first non-None grad."""

    momentum_buffer: Tree
    count: Tree = None  # None: a state made before counts were kept (the step's count)


SGDState = TraceState  # the name fs.optim.sgd's state always had


def active(updates: Tree, params: Tree, *states: Tree, lazy: bool = False):
    """Flatten; the positions with an update, their materialized local updates, params and
    local state tensors. Returns ``(spec, leaves, idx, grads, params, [state lists])``;
    ``lazy=True``: ``grads`` are the updates themselves, to :func:`materialize` a chunk at a
    time ([Note: lean updates])."""
    _, u_leaves, spec = flatten(updates)
    paths, p_leaves, _ = flatten(params)
    s_leaves = [flatten(s)[1] for s in states]
    idx = [i for i, u in enumerate(u_leaves) if u is not None]
    for s in s_leaves:
        check_held(paths, idx, s)
    grads = [u_leaves[i] if lazy else materialize(u_leaves[i], p_leaves[i]) for i in idx]
    return (spec, u_leaves, idx, grads, locals_of([p_leaves[i] for i in idx]),
            [locals_of([s[i] for i in idx]) for s in s_leaves])


def runs_of(updates: list, like: list) -> list[list[int]]:
    """The runs of leaves to update together: all at once when no update has to be
    materialized (nothing pending: no transient is made), else :func:`chunks` ([Note: lean
    updates]). One foreach call per run and op: on a GPU each is a kernel launch."""
    if all(u is None or as_delta(u).plain for u in updates):
        return [list(range(len(like)))]
    return chunks(like)


def by_device(idx: list, grads: list, *lists: list) -> list[list[list]]:
    """``[positions, grads, *lists]`` per (device, dtype) of the grads: one foreach call each."""
    return [g for _, g in group_by([(t.device, t.dtype) for t in grads], idx, grads, *lists)]


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                  fused: bool = False) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)``; each leaf's bias corrections use its
    own count of updates, this one included (torch.optim's per-parameter ``step``).

    State :class:`AdamState` (``exp_avg``, ``exp_avg_sq``: zeros sharded like params;
    ``count``).
    ``fused=True``: the whole update waits for the parameter write, where one fused kernel
    does it (``torch.optim.AdamW(fused=True)``'s; [Note: fused Adam] in :mod:`.apply`).
    """
    check("betas[0]", b1, 0.0 <= b1 < 1.0, "0 <= beta1 < 1")
    check("betas[1]", b2, 0.0 <= b2 < 1.0, "0 <= beta2 < 1")
    check("eps", eps, eps >= 0.0, "eps >= 0")

    def init(params: Tree) -> AdamState:
        return AdamState(zeros_tree(params), zeros_tree(params), counts_tree(params))

    def update(updates: Tree, state: AdamState, params: Tree, *, step: int):
        spec, leaves, idx, us, ps, (m, v) = active(updates, params, state.exp_avg,
                                                   state.exp_avg_sq, lazy=True)
        prior, count = advance_counts(state.count, len(leaves), idx, step)
        state = state._replace(count=count)
        done = [prior[i] for i in idx]  # each active leaf's updates before this one
        out = list(leaves)
        if fused:
            _refuse_complex(params, idx, ps)
            for j, i in enumerate(idx):
                u, g = as_delta(us[j]), None
                if u.den is None and u.wd == 0.0 and not u.final:  # a pending scale only
                    g, scale = u.num, u.numer / u.divisor
                else:  # something else pending: its values (rare; a transient per leaf)
                    g, scale = materialize(u, ps[j]), 1.0
                out[i] = Delta(g, FusedAdam(m[j], v[j], b1, b2, eps, done[j], scale))
            return unflatten(spec, out), state
        corrections = {n: (1 - b1 ** float(n + 1), (1 - b2 ** float(n + 1)) ** 0.5)
                       for n in set(done)}
        with torch.no_grad():
            # torch.optim's foreach Adam, a chunk of leaves at a time; the denominator stays
            # pending (RootDen) until the parameter is written ([Note: lean updates])
            for pos, ms, vs, us_, ps_ in by_device(idx, m, v, us, ps):
                for run in runs_of(us_, ms):  # (a complex leaf as its real pairs: below)
                    gs = [real(materialize(us_[j], ps_[j])) for j in run]
                    m_run, v_run = [real(ms[j]) for j in run], [real(vs[j]) for j in run]
                    _compat.foreach_lerp_(m_run, gs, 1 - b1)
                    _compat.foreach_mul_(v_run, b2)
                    _compat.foreach_addcmul_(v_run, gs, gs, 1 - b2)
                    del gs
                for i, mm, vv in zip(pos, ms, vs):
                    bc1, bc2_sqrt = corrections[prior[i]]
                    out[i] = (_complex_direction(mm, vv, bc2_sqrt, eps, bc1) if mm.is_complex()
                              else Delta(mm, RootDen(vv, bc2_sqrt, eps), divisor=bc1))
        return unflatten(spec, out), state

    return GradientTransformation(init, update, form=("adam", b1, b2, eps, fused))


def _complex_direction(m: torch.Tensor, v: torch.Tensor, bc2_sqrt: float, eps: float,
                       bc1: float) -> Delta:
    """Adam's direction for a complex leaf, made now: torch.optim.Adam steps a complex
    parameter as its real pairs, each part with its own second moment (kept in ``v``'s
    parts), which a pending complex denominator cannot say."""
    den = real(v).sqrt().div_(bc2_sqrt).add_(eps)
    return Delta(torch.view_as_complex(real(m) / den), divisor=bc1)


def _refuse_complex(params: Tree, idx: list, ps: list) -> None:
    """``fused=True`` outside the step's own update: torch's fused kernel has no complex
    form."""
    for i, p in zip(idx, ps):
        if p.is_complex():
            paths = flatten(params)[0]
            raise ValueError(
                f"adamw(fused=True): parameter {path_str(paths[i])!r} is {p.dtype}, which "
                "torch's fused Adam kernel does not take outside fs.train_step; use "
                "fused=False here (inside fs.train_step the update steps it as real pairs).")


def trace(momentum: float, *, dampening: float = 0.0,
          nesterov: bool = False) -> GradientTransformation:
    """SGD's momentum buffer ``buf = momentum * buf + (1 - dampening) * g``; ``buf = g`` at a
    leaf's first update (its ``count`` is 0), as torch.optim.SGD's.

    State :class:`TraceState`; with ``momentum == 0`` it holds ``None`` leaves and passes the
    updates through.
    """
    check("momentum", momentum, momentum >= 0.0, "momentum >= 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"Invalid nesterov=True with momentum={momentum!r}, "
                         f"dampening={dampening!r} "
                         "(valid range: momentum > 0 and dampening == 0)")

    def init(params: Tree) -> TraceState:
        if momentum == 0:
            _, leaves, spec = flatten(params)
            return TraceState(unflatten(spec, [None] * len(leaves)),
                              unflatten(spec, [None] * len(leaves)))
        return TraceState(zeros_tree(params), counts_tree(params))

    def update(updates: Tree, state: TraceState, params: Tree, *, step: int):
        if momentum == 0:
            return updates, state
        spec, leaves, idx, us, ps, (bufs,) = active(updates, params, state.momentum_buffer,
                                                    lazy=True)
        prior, count = advance_counts(state.count, len(leaves), idx, step)
        state = state._replace(count=count)
        first = {i: prior[i] == 0 for i in idx}  # a leaf's first update: buf = g
        out = list(leaves)
        with torch.no_grad():
            # a chunk of leaves at a time ([Note: lean updates]); Nesterov's update is a new
            # tensor per leaf, alive until written
            for pos, bs, us_, ps_ in by_device(idx, bufs, us, ps):
                for run in (chunks(bs) if nesterov else runs_of(us_, bs)):
                    gs = [materialize(us_[j], ps_[j]) for j in run]
                    b_run = [bs[j] for j in run]
                    new = [j for j, g in enumerate(run) if first[pos[g]]]
                    if new:  # a leaf's first update: its buffer is its gradient
                        _compat.foreach_copy_([b_run[j] for j in new], [gs[j] for j in new])
                    old = [j for j, g in enumerate(run) if not first[pos[g]]]
                    if old:
                        b_old = [b_run[j] for j in old]
                        _compat.foreach_mul_(b_old, momentum)
                        _compat.foreach_add_(b_old, [gs[j] for j in old], alpha=1 - dampening)
                    res = _compat.foreach_add(gs, b_run, alpha=momentum) if nesterov else b_run
                    for j, r in zip(run, res):
                        out[pos[j]] = Delta(r)
                    del gs, res  # before the next chunk's are made
        return unflatten(spec, out), state

    return GradientTransformation(init, update, form=("trace", momentum, dampening, nesterov))


def _scale_all(updates: Tree, factor: float) -> Tree:
    _, leaves, spec = flatten(updates)
    return unflatten(spec, [u.scaled(factor) if type(u) is Delta else
                            None if u is None else as_delta(u).scaled(factor) for u in leaves])


def scale(factor: float) -> GradientTransformation:
    """Multiply the updates by ``factor`` (no tensor is touched: the factor stays pending)."""
    return GradientTransformation(lambda params: EmptyState(),
                                  lambda u, s, p, *, step: (_scale_all(u, factor), s), True)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """Multiply the updates by ``-lr`` (descent); ``lr`` a number or a schedule ``step -> lr``."""
    check_lr(lr)
    return GradientTransformation(lambda params: EmptyState(),
                                  lambda u, s, p, *, step: (_scale_all(u, -lr_at(lr, step)), s),
                                  True, ("lr", lr))


def add_decayed_weights(weight_decay: float = 0.0, mask=None) -> GradientTransformation:
    """Add ``weight_decay * param`` to the updates: before Adam's scaling it is an L2 penalty
    (Adam, SGD), after it decoupled decay (AdamW). ``mask``: see :func:`masked`."""
    check("weight_decay", weight_decay, weight_decay >= 0.0, "weight_decay >= 0")

    def update(updates: Tree, state: Tree, params: Tree, *, step: int):
        if weight_decay == 0.0:
            return updates, state
        _, leaves, spec = flatten(updates)
        p_leaves = flatten(params)[1]
        out = []
        for u, p in zip(leaves, p_leaves):
            d = as_delta(u)
            if d is not None and d.wd != 0.0:  # a second decay: fold the first one in
                d = Delta(materialize(d, p))
            out.append(None if d is None else d.replace(wd=weight_decay, wd_numer=1.0,
                                                       wd_divisor=1.0))
        return unflatten(spec, out), state

    form = ("decay", weight_decay, mask)
    t = GradientTransformation(lambda params: EmptyState(), update, True, form)
    if mask is None:
        return t
    from .combine import masked
    return masked(t, mask)._replace(form=form)
