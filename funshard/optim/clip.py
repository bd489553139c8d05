"""Transformations that look at all ranks' updates: ``clip_by_global_norm`` and
``apply_if_finite``. The norm counts every element once over shards and replicas (a sharded
leaf is held once per replica, a replicated one by every rank), so it equals one process's
norm on any mesh, 1-D or 2-D. Every rank takes part in the one all-reduce, with or without
updates of its own.

    >>> opt = chain(apply_if_finite(), clip_by_global_norm(1.0), adamw(3e-4))

[Note: the step's norm] ``fs.train_step`` all-reduces the gradient norm with the loss, once,
for its metrics; ``Policy(clip_norm=, skip_nonfinite=)`` put these two transformations in
front of the optimizer (:func:`funshard.optim.with_policy.with_policy`). So that they need no
second all-reduce, the step states what it measured (:func:`funshard.optim.measured.measured`):
while that holds, a transformation given exactly the step's gradients (each leaf a plain
update of the step's own tensor) takes the norm and the finite check from it; any other
updates are measured here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import collectives
from ..layout import layout_of, norm_weight
from ..mesh import model_dims, process_groups
from ..reduce import local_sq_norm, norms
from .base import (EmptyState, GradientTransformation, Tree, as_delta, flatten, materialize,
                   path_str, unflatten)
from .measured import known as measured_for


def _mesh_of(leaves: list):
    """The leaves' mesh: the one with the model's own dimensions where some leaves are on it
    and others on its data-parallel part."""
    meshes = [p.device_mesh for p in leaves if isinstance(p, DTensor)]
    return max(meshes, key=lambda m: m.ndim, default=None)


def _all_reduce(t: torch.Tensor, mesh, op, what: str) -> torch.Tensor:
    """Sum (or max) of ``t`` over every rank of ``mesh``: over "shard", then "replicate",
    then the model's own dimensions."""
    if mesh is None or collectives.skips(mesh.size()):
        return t
    with collectives.watch(what, mesh):
        for pg in process_groups(mesh) + tuple(mesh.get_group(n) for n in model_dims(mesh)):
            if pg is not None:
                dist.all_reduce(t, op=op, group=pg)
    return t


def _device(leaves: list) -> torch.device:
    for p in leaves:
        if isinstance(p, torch.Tensor):
            return p.device
    return torch.device("cpu")


def global_norm(updates: Tree, params: Tree) -> float:
    """The L2 norm of the updates over all ranks, each element counted once (float64 sums)."""
    paths, p_leaves, _ = flatten(params)
    u_leaves = flatten(updates)[1]
    known = measured_for(u_leaves)
    if known is not None:
        return known.norm
    mesh = _mesh_of(p_leaves)
    idx = [i for i, u in enumerate(u_leaves) if u is not None]
    world = mesh.size() if mesh is not None else 1
    weights = [norm_weight(layout_of(path_str(paths[i]), p_leaves[i], model=True), world)
               if isinstance(p_leaves[i], DTensor) else 1.0 / world for i in idx]
    # one leaf materialized at a time (no transient beyond the largest leaf); then the sum
    # as reduce.local_sq_norm forms it
    per = [norms([materialize(u_leaves[i], p_leaves[i])])[0] for i in idx]
    sq = local_sq_norm(per, weights, _device(p_leaves))
    sq = _all_reduce(sq, mesh, dist.ReduceOp.SUM, "all-reduce of the gradient norm")
    return sq.clamp_min(0).sqrt().item()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates by ``min(1, max_norm / (norm + 1e-6))``
    (``torch.nn.utils.clip_grad_norm_``'s rule) with the global norm over all ranks; the factor
    stays pending (no copy).

    Raises FloatingPointError when the norm is NaN or inf (put :func:`apply_if_finite` first
    to skip such steps instead).
    """
    if (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
            or not 0 < max_norm < math.inf):
        raise ValueError(f"Invalid max_norm: {max_norm!r} (valid range: 0 < max_norm < inf)")

    def update(updates: Tree, state: Tree, params: Tree, *, step: int):
        if all(u is None for u in flatten(updates)[1]):  # dropped (apply_if_finite): no norm
            return updates, state
        norm = global_norm(updates, params)
        if not math.isfinite(norm):
            raise FloatingPointError(
                f"clip_by_global_norm: the global gradient norm is {norm} at step {step}; the "
                "parameters are unchanged. Put fs.optim.apply_if_finite() first in the chain to "
                "skip such steps, or lower the learning rate.")
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef >= 1.0:
            return updates, state
        _, leaves, spec = flatten(updates)
        return unflatten(spec, [None if u is None else as_delta(u).scaled(coef)
                                for u in leaves]), state

    return GradientTransformation(lambda params: EmptyState(), update, True, ("clip", max_norm))


def all_finite(updates: Tree, params: Tree) -> bool:
    """Whether every update on every rank is finite (one all-reduce)."""
    p_leaves = flatten(params)[1]
    u_leaves = flatten(updates)[1]
    known = measured_for(u_leaves)
    if known is not None:
        return known.finite
    bad = torch.zeros((), dtype=torch.float32, device=_device(p_leaves))
    for u, p in zip(u_leaves, p_leaves):
        if u is not None:
            bad = torch.maximum(bad, (~materialize(u, p).isfinite()).any().float())
    bad = _all_reduce(bad, _mesh_of(p_leaves), dist.ReduceOp.MAX, "all-reduce of the finite check")
    return bad.item() == 0


def apply_if_finite() -> GradientTransformation:
    """Drop the whole update, on every rank together, when any update is NaN or inf.

    Put it first in a chain: the transformations after it see no update (``None`` for every
    leaf) and leave their state unchanged, so the step is skipped. Inside ``fs.train_step`` a
    non-finite loss counts too (the step's check, [Note: the step's norm]).
    """

    def update(updates: Tree, state: Tree, params: Tree, *, step: int):
        if all_finite(updates, params):
            return updates, state
        known = measured_for(flatten(updates)[1])
        if known is not None:
            known.dropped = True
        _, leaves, spec = flatten(updates)
        return unflatten(spec, [None] * len(leaves)), state

    return GradientTransformation(lambda params: EmptyState(), update, True, ("finite",))
