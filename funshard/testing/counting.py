"""The one collective counter: :func:`classify` names an op as a collective,
:class:`CountCollectives` counts them while active (tests, the demo and the benchmark).

    >>> with CountCollectives() as cc:
    ...     state, _ = step(state, batch)
    >>> cc.counts        # Counter({'all_gather': 18, 'reduce_scatter': 9, 'all_reduce': 1})
"""

from __future__ import annotations

from collections import Counter

import torch

from .. import _compat
from ..collectives import is_direct_message

_compat.require_testing("funshard.testing")

_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "scatter_": "scatter",
    "gather_": "gather",
    "alltoall_base_": "all_to_all",
    "barrier": "barrier",
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _dtype(x) -> torch.dtype | None:
    if isinstance(x, torch.Tensor):
        return x.dtype
    if isinstance(x, (list, tuple)) and x:
        return _dtype(x[0])
    return None


def classify(func, args) -> tuple[str, int, int] | None:
    """One op as a collective: (kind, logical bytes, counted bytes), or None for what is not
    one (barriers, other ops, and the messages of a funshard direct exchange, which its
    ``funshard::collective`` marker stands for: see :mod:`funshard.collectives`).

    Logical bytes are the whole buffer: the all-gather output, the reduce-scatter input, the
    all-reduce tensor. Counted bytes are the c10d op's first argument (for a reduce-scatter,
    its output), the convention of :class:`funshard.plan.Traffic`'s ``counted``.
    """
    name = func.overloadpacket.__name__
    if func.namespace == "funshard" and name == "collective":
        return args[1], args[2], args[3]
    if func.namespace != "c10d" or not args or name == "barrier":
        return None
    if is_direct_message(name, args):
        return None
    kind = _KINDS.get(name, name)
    counted = _nbytes(args[0])
    logical = _nbytes(args[1]) if kind == "reduce_scatter" and len(args) > 1 else counted
    return kind, logical, counted


class CountCollectives(_compat.TorchDispatchMode):
    """Counts c10d collectives (and their output bytes) issued on this thread while active.

    ``counts`` and ``bytes`` (counted bytes) are by kind; ``ops`` lists every collective in
    issue order as :func:`classify` gives it, with its dtype (None for a direct exchange's
    marker), ``(kind, logical bytes, counted bytes, dtype)``, for callers that split a kind
    further (the benchmark tells the step's metrics all-reduce apart: float64).

        >>> with CountCollectives() as cc:
        ...     fs.unshard(sparams)
        >>> cc.counts   # Counter({'all_gather': 1})
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self.ops: list[tuple[str, int, int, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = classify(func, args)
        if op is not None:
            kind, _, counted = op
            self.counts[kind] += 1
            self.bytes[kind] += counted
            self.ops.append((*op, _dtype(args[0]) if func.namespace == "c10d" else None))
        return func(*args, **(kwargs or {}))

