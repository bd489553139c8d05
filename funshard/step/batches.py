"""How a step's batch becomes its micro-batches (``Policy(accumulate=k)``): split along dim
0 in ``k`` equal parts, or given one by one as :class:`MicroBatches`, each of its own shapes
(packed sequences of different lengths, batches of a token budget).

With micro-batches of different sizes a plain loss (each micro-batch's mean, averaged over
the ``k``) weighs a small micro-batch's items as much as a large one's; ``fs.Mean(total,
count)`` from ``loss_fn`` weighs every item alike (see :mod:`funshard.step.loss`), and a
plain loss over unequal micro-batches is warned about.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from .. import pytree


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """A step's ``k`` micro-batches, given one by one: ``step(state, fs.MicroBatches([b0,
    b1]))`` under ``Policy(accumulate=2)``. Each is what ``loss_fn`` gets as its batch; they
    may differ in shape. Every rank gives ``k`` (the Policy's, which ranks agree on)."""

    parts: tuple

    def __init__(self, parts):
        if not isinstance(parts, (list, tuple)) or not parts:
            raise TypeError(f"fs.MicroBatches takes a non-empty list of micro-batches, got "
                            f"{type(parts).__name__}")
        object.__setattr__(self, "parts", tuple(parts))


def split(batch: Any, k: int) -> list[Any]:
    """``batch`` as ``k`` micro-batches: each leaf chunked along dim 0, or the parts of a
    :class:`MicroBatches`."""
    if isinstance(batch, MicroBatches):
        if len(batch.parts) != k:
            raise ValueError(
                f"train_step: fs.MicroBatches holds {len(batch.parts)} micro-batches and "
                f"Policy(accumulate={k}) takes {k}; give {k} (every rank as many: each "
                "micro-batch gathers the groups again).")
        return list(batch.parts)
    if k == 1:
        return [batch]
    paths, leaves, spec = pytree.flatten_with_path(batch)
    parts = []
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] % k:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"train_step: batch[{pytree.fqn(p)!r}] of shape {shape} does not split into "
                f"accumulate={k} micro-batches along dim 0; use a batch size divisible by {k}."
            )
        parts.append(x.chunk(k))
    return [pytree.unflatten(spec, [c[j] for c in parts]) for j in range(k)]


def rows(batch: Any) -> int:
    """The rows of a step's batch: dim 0 of its first tensor with one (0 when none has);
    of :class:`MicroBatches`, their sum."""
    if isinstance(batch, MicroBatches):
        return sum(rows(p) for p in batch.parts)
    for x in pytree.flatten(batch)[0]:
        if isinstance(x, torch.Tensor) and x.ndim:
            return x.shape[0]
    return 0


def check_even(batch: Any) -> None:
    """A plain loss over :class:`MicroBatches` of different rows: warn (each micro-batch's
    mean counts 1/k, whatever its size)."""
    if isinstance(batch, MicroBatches) and len({rows(p) for p in batch.parts}) > 1:
        warnings.warn(
            f"train_step: the micro-batches differ in size along dim 0 "
            f"({[rows(p) for p in batch.parts]} rows) and loss_fn returned a plain mean: the "
            "step's gradient is the mean of the micro-batches' means, which weighs a small "
            "one's items as much as a large one's. Return fs.Mean(total, count) from loss_fn "
            "for the mean over every item.")
