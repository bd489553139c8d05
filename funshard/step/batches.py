"""How a step's batch becomes its micro-batches (``Policy(accumulate=k)``)."""

from __future__ import annotations

from typing import Any

import torch

from .. import pytree


def split(batch: Any, k: int) -> list[Any]:
    """``batch`` as ``k`` micro-batches: each leaf chunked along dim 0."""
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
