"""What the step measured of its gradients (their global norm, whether they and the loss are
finite), for the transformations in front of the optimizer to take instead of measuring
again: [Note: the step's norm] in :mod:`funshard.optim.clip`.

    >>> with measured(grad_tree, norm, finite) as seen:
    ...     params, state = optimizer.update(grad_tree, state, params, step=n)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional

from .base import Delta, Tree, flatten


@dataclasses.dataclass
class Measured:
    """What the step measured (see [Note: the step's norm]): its gradient tensors by leaf
    position, their global norm, whether they and the loss are finite; ``dropped`` records
    whether :func:`apply_if_finite` dropped them."""

    grads: list  # per leaf: the step's local gradient tensor, or None
    norm: float
    finite: bool
    dropped: bool = False


_MEASURED: contextvars.ContextVar[Optional[Measured]] = contextvars.ContextVar(
    "funshard_optim_measured", default=None)


@contextlib.contextmanager
def measured(grads: Tree, norm: float, finite: bool) -> Iterator[Measured]:
    """While inside, updates that are exactly the tree ``grads`` have global norm ``norm`` and
    are finite iff ``finite`` (the step's own all-reduce; no second one)."""
    m = Measured(flatten(grads)[1], norm, finite)
    token = _MEASURED.set(m)
    try:
        yield m
    finally:
        _MEASURED.reset(token)


def rebind(grads: list, deltas: list) -> None:
    """``deltas[i]`` is the step's ``grads[i]`` converted to its parameter's dtype: the step's
    measurement holds for it too (called by :func:`funshard.optim.apply.deltas_of`)."""
    m = _MEASURED.get()
    if m is None or len(m.grads) != len(grads):
        return
    for i, (g, d) in enumerate(zip(grads, deltas)):
        if d is not None and g is not None and m.grads[i] is g and d.num is not g:
            m.grads[i] = d.num


def known(u_leaves: list) -> Optional[Measured]:
    """The step's measurement, when ``u_leaves`` are exactly its gradients."""
    m = _MEASURED.get()
    if m is None or len(m.grads) != len(u_leaves):
        return None
    for u, g in zip(u_leaves, m.grads):
        if u is None and g is None:
            continue
        d = u if isinstance(u, Delta) else None
        if g is None or d is None or not d.plain or d.num is not g:
            return None
    return m
