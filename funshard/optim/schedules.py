"""Learning-rate schedules: plain functions ``step -> value`` (``step`` = updates already
applied, the first update is step 0), for :func:`~funshard.optim.scale_by_learning_rate`.

    >>> lr = warmup_cosine(3e-4, warmup_steps=100, total_steps=10_000)
    >>> lr(0), lr(100), lr(10_000)
    (0.0, 0.0003, 0.0)
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .base import check

Schedule = Callable[[int], float]


def _steps(name: str, n: int, *, positive: bool = True) -> None:
    ok = isinstance(n, int) and not isinstance(n, bool) and (n > 0 if positive else n >= 0)
    check(name, n, ok, "int > 0" if positive else "int >= 0")


def constant(value: float) -> Schedule:
    """``value`` at every step."""
    return lambda step: value


def linear(start: float, end: float, steps: int) -> Schedule:
    """From ``start`` at step 0 to ``end`` at ``steps``, then ``end``
    (``torch.optim.lr_scheduler.LinearLR`` with ``start_factor=start/lr, end_factor=end/lr``)."""
    _steps("steps", steps)
    return lambda step: start + (end - start) * min(step, steps) / steps


def cosine(start: float, end: float, steps: int) -> Schedule:
    """Half a cosine from ``start`` at step 0 to ``end`` at ``steps``, then ``end``
    (``torch.optim.lr_scheduler.CosineAnnealingLR`` with ``T_max=steps, eta_min=end``)."""
    _steps("steps", steps)
    return lambda step: end + (start - end) * (1 + math.cos(math.pi * min(step, steps) / steps)) / 2


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[0]`` before ``boundaries[0]``, then ``schedules[1]`` (its step counted from
    the boundary), and so on; ``len(schedules) == len(boundaries) + 1``."""
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(f"join: {len(schedules)} schedules need {len(schedules) - 1} boundaries, "
                         f"got {len(boundaries)}")
    for i, b in enumerate(boundaries):
        _steps(f"boundaries[{i}]", b, positive=False)
    if list(boundaries) != sorted(boundaries):
        raise ValueError(f"join: boundaries {list(boundaries)} must be increasing")

    def at(step: int) -> float:
        start = 0
        for s, b in zip(schedules, boundaries):
            if step < b:
                return s(step - start)
            start = b
        return schedules[-1](step - start)

    return at


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, *, init: float = 0.0,
                  end: float = 0.0) -> Schedule:
    """Linear warm-up from ``init`` to ``peak`` over ``warmup_steps``, then a cosine down to
    ``end`` at ``total_steps`` (and ``end`` after)."""
    _steps("warmup_steps", warmup_steps, positive=False)
    _steps("total_steps", total_steps)
    if total_steps <= warmup_steps:
        raise ValueError(f"Invalid total_steps: {total_steps!r} (valid range: > warmup_steps="
                         f"{warmup_steps})")
    decay = cosine(peak, end, total_steps - warmup_steps)
    if warmup_steps == 0:
        return decay
    return join([linear(init, peak, warmup_steps), decay], [warmup_steps])
