"""From a transformation to an :class:`~funshard.optim.base.Optimizer`: check the trees, run
the transformation on the local shards, write each leaf's pending update into its parameter.

    >>> opt = as_optimizer(chain(scale_by_adam(), scale_by_learning_rate(1e-3)).transform)
    >>> params, state = opt.update(grads, state, params, step=0)     # params updated in place
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _compat
from .measured import rebind
from .base import (Delta, FusedAdam, GradientTransformation, Optimizer, Tree, as_delta, chunks,
                   dens, flatten, group_by, locals_of, path_str, unflatten)


def as_optimizer(transform: GradientTransformation) -> Optimizer:
    """The :class:`Optimizer` that applies ``transform``'s updates to the params (donating)."""

    def update(grads: Tree, state: Tree, params: Tree, *, step: int) -> tuple[Tree, Tree]:
        spec, paths, p_leaves, deltas = deltas_of(grads, params, step)
        out, new_state = transform.update(unflatten(spec, deltas), state, params, step=step)
        o_paths, o_leaves, _ = flatten(out)
        if o_paths != paths:
            raise ValueError("the transformation returned updates whose tree differs from the "
                             f"params tree ({len(o_leaves)} leaves vs {len(paths)})")
        with torch.no_grad():
            _write([as_delta(u) for u in o_leaves], p_leaves)
        return unflatten(spec, p_leaves), new_state

    return Optimizer(transform.init, update, transform)


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"Invalid step: {step!r} (valid range: int >= 0)")


def deltas_of(grads: Tree, params: Tree, step: int):
    """Align grads with params; one plain :class:`Delta` (local, params' dtype) per grad."""
    _check_step(step)
    p_paths, p_leaves, spec = flatten(params)
    g_paths, g_leaves, g_spec = flatten(grads)
    if p_paths != g_paths:
        a, b = next((a, b) for a, b in zip(p_paths + [None], g_paths + [None]) if a != b)
        raise ValueError(
            "grads and params trees differ: first differing path is "
            f"{path_str(a) if a is not None else '<missing>'} in params vs "
            f"{path_str(b) if b is not None else '<missing>'} in grads")
    if g_spec != spec:
        raise ValueError(f"grads and params trees have different node types: {g_spec} vs {spec}")
    deltas = []
    for path, p, g in zip(p_paths, p_leaves, g_leaves):
        deltas.append(None if g is None or p is None else Delta(_grad_local(path, p, g)))
    rebind(g_leaves, deltas)  # the step's measured norm holds for dtype-converted grads
    return spec, p_paths, p_leaves, deltas


def _grad_local(path: tuple, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g``'s local tensor in ``p``'s dtype: a DTensor like ``p``, or a plain tensor of
    ``p``'s global or local shape."""
    p_dt, g_dt = isinstance(p, DTensor), isinstance(g, DTensor)
    pl = _compat.local_tensor(p) if p_dt else p
    gl = _compat.local_tensor(g) if g_dt else g
    ok = g.shape == p.shape or (p_dt and not g_dt and g.shape == pl.shape)
    if not ok:
        raise ValueError(f"grad shape mismatch at {path_str(path)}: param {tuple(p.shape)} vs grad "
                         f"{tuple(g.shape)}")
    if p_dt and g_dt and tuple(g.placements) != tuple(p.placements):
        raise ValueError(f"grad placements at {path_str(path)} are {g.placements}, param has "
                         f"{p.placements}")
    if not p.requires_grad:
        raise ValueError(f"grad given for {path_str(path)} which has no optimizer state "
                         "(requires_grad=False at init)")
    return gl if gl.dtype == pl.dtype else gl.to(pl.dtype)


def _write(deltas: list, params: list) -> None:
    """``p <- p + delta`` for every leaf with a delta, with torch's foreach ops: in place
    over all leaves of a kind at once, what must be made (Adam's denominators, SGD's penalty)
    a chunk of leaves at a time ([Note: lean updates]); fused Adam in one kernel."""
    idx = [i for i, d in enumerate(deltas) if d is not None]
    ds, ps = [deltas[i] for i in idx], locals_of([params[i] for i in idx])
    if any(isinstance(d.den, FusedAdam) for d in ds):
        ds, ps = _write_fused(ds, ps)
    keys = [(p.device, p.dtype, d.den is None, d.coupled and d.wd != 0.0, d.numer / d.divisor,
             d.wd * (d.wd_numer / d.wd_divisor) if not d.coupled else d.wd) for d, p in zip(ds, ps)]
    for (_, _, no_den, coupled, s, wd), (dg, pg) in group_by(keys, ds, ps):
        nums = [d.num for d in dg]
        if coupled:  # SGD's L2 penalty, as torch.optim.SGD adds it (g + wd * p: a transient)
            for run in chunks(pg):
                p_run = [pg[j] for j in run]
                _compat.foreach_add_(p_run, _compat.foreach_add([nums[j] for j in run], p_run,
                                                              alpha=wd), alpha=s)
            continue
        # in place over every leaf at once; only the denominators are made, a chunk at a time
        if wd != 0.0:  # decoupled (AdamW): p *= 1 - lr * wd first
            _compat.foreach_mul_(pg, 1 + wd)
        if no_den:
            _compat.foreach_add_(pg, nums, alpha=s)
            continue
        for run in chunks(pg):
            _compat.foreach_addcdiv_([pg[j] for j in run], [nums[j] for j in run],
                                    dens([dg[j].den for j in run]), s)


# [Note: fused Adam] ``adamw(..., fused=True)`` (``scale_by_adam(fused=True)``) leaves each
# leaf's whole Adam update pending (:class:`~.base.FusedAdam`): the chain's later scalars
# (learning rate, decoupled weight decay) are folded in as they come, and here one
# ``torch._fused_adamw_`` call per device and dtype updates the moments and the parameters
# of every leaf at once, as ``torch.optim.AdamW(fused=True)`` does: one kernel instead of
# about ten foreach calls per chunk of leaves, no temporary at all, each element read and
# written once. A gradient that still owes a scale (a clip's) is multiplied first, a chunk
# of leaves at a time, as torch's clip does it (the kernel's own ``grad_scale`` would divide
# the caller's gradients in place). Anything the kernel cannot express (an L2
# penalty, an ascent, a transform that reads the update) takes the foreach path for that
# leaf (:meth:`~.base.FusedAdam.realize`).


def _write_fused(ds: list, ps: list) -> tuple[list, list]:
    """Write the fusable Adam deltas; return the rest (realized) for the foreach path."""
    rest_d, rest_p, keys, fused = [], [], [], []
    for d, p in zip(ds, ps):
        f = d.den if isinstance(d.den, FusedAdam) else None
        lr = -d.numer / d.divisor
        if f is not None and f.done is None and lr >= 0.0 and not d.final and (
                d.wd == 0.0 or d.wd_numer / d.wd_divisor == d.numer / d.divisor):
            fused.append((d, p))
            keys.append((p.device, p.dtype, lr, d.wd, f.b1, f.b2, f.eps, f.step, f.scale))
            continue
        rest_d.append(f.realize(d) if f is not None else d)
        rest_p.append(p)
    for (dev, _, lr, wd, b1, b2, eps, step, scale), (dg, pg) in group_by(
            keys, [d for d, _ in fused], [p for _, p in fused]):
        steps = [torch.full((), float(step + 1), dtype=torch.float32, device=dev)] * len(pg)
        gs = [d.num for d in dg]
        # a gradient that owes a scale (a clip's) is scaled first, a chunk of leaves at a
        # time, as torch's clip multiplies it (the kernel would unscale it in place)
        for run in ([list(range(len(pg)))] if scale == 1.0 else chunks(pg)):
            g_run = [gs[j] for j in run]
            _compat.fused_adamw_([pg[j] for j in run],
                                g_run if scale == 1.0 else _compat.foreach_mul(g_run, scale),
                                [dg[j].den.m for j in run], [dg[j].den.v for j in run], [],
                                [steps[j] for j in run], lr=lr, beta1=b1, beta2=b2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
        for d in dg:
            d.den.done = (0.0, 0.0)  # written: nothing may realize it again
    return rest_d, rest_p
