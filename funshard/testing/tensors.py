"""Inputs and error capture for tests that run on worker ranks.

    >>> t = make_tensor((7, 3), "bfloat16", seed=1)      # the same (7, 3) tensor on every rank
    >>> capture(fs.shard, {"w": t}, "not a mesh")        # ("TypeError", "...") for the parent
"""

from __future__ import annotations

from typing import Any, Callable

import torch

TEST_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "bool": torch.bool,
}


def make_tensor(shape: tuple, dtype: str, seed: int) -> torch.Tensor:
    """The same tensor on every rank for a ``(shape, dtype name, seed)``: parity inputs."""
    g = torch.Generator().manual_seed(seed)
    dt = TEST_DTYPES[dtype]
    if dt == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dt == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dt)


def capture(fn: Callable, *args: Any, **kwargs: Any) -> tuple[str | None, str]:
    """``(exception type name, message)`` of ``fn(*args)``, or ``(None, "no error")``.

    For error tests that run on worker ranks and assert on the text in the parent.
    """
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the caller asserts on what it was
        return type(e).__name__, str(e)
    return None, "no error"


def stepped(step: Callable, state: Any, batch: Any) -> tuple[Any, dict]:
    """``step(state, batch)`` with its metrics read: where the step's checks that wait on
    the device raise (a non-finite step's refusal, ranks that gathered in different
    orders), as they would at a training loop's log line."""
    state, metrics = step(state, batch)
    dict(metrics)
    return state, metrics

