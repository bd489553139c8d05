"""``fs.Policy(skip_nonfinite=, clip_norm=)`` as transformations in front of the optimizer:
``apply_if_finite()`` and ``clip_by_global_norm(clip_norm)`` ([Note: the step's norm] in
:mod:`funshard.optim.clip`).

    >>> optimizer = with_policy(adamw(3e-4), clip_norm=1.0, skip_nonfinite=True)
"""

from __future__ import annotations

from typing import Optional

from .apply import deltas_of
from .base import EmptyState, Optimizer, Tree, flatten, materialize, unflatten
from .clip import apply_if_finite, clip_by_global_norm
from .combine import chain


def with_policy(optimizer: Optimizer, *, clip_norm: Optional[float] = None,
                skip_nonfinite: bool = False) -> Optimizer:
    """``optimizer`` behind ``apply_if_finite()`` and ``clip_by_global_norm(clip_norm)``, in that
    order (what ``fs.Policy(skip_nonfinite=, clip_norm=)`` mean); its state is unchanged.

    An fs.optim optimizer (a chain) takes them into its chain, so the clipping factor stays
    pending; another one (``from_torch``) gets the clipped gradients materialized, one leaf
    at a time, and is not called on a dropped step.
    """
    front = ([apply_if_finite()] if skip_nonfinite else []) + (
        [clip_by_global_norm(clip_norm)] if clip_norm is not None else [])
    if not front:
        return optimizer
    t = optimizer.traced  # (a second clip has no traced form)
    traced = (None if t is None or (t.clip is not None and clip_norm is not None)
              else t._replace(clip=clip_norm if clip_norm is not None else t.clip))
    if optimizer.transform is not None:
        return chain(*front, optimizer.transform)._replace(traced=traced)

    def update(grads: Tree, state: Tree, params: Tree, *, step: int):
        spec, _, p_leaves, deltas = deltas_of(grads, params, step)
        out = unflatten(spec, deltas)
        for t in front:
            out, _ = t.update(out, EmptyState(), params, step=step)
        leaves = flatten(out)[1]
        if all(u is None for u in leaves) and any(d is not None for d in deltas):
            return params, state  # dropped: the optimizer does not run
        clipped = [None if u is None else materialize(u, p) for u, p in zip(leaves, p_leaves)]
        return optimizer.update(unflatten(spec, clipped), state, params, step=step)

    return Optimizer(optimizer.init, update, traced=traced)
