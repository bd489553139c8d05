"""Live tensor memory: peaks of the storages tensors hold, exact to the byte, on any device.

    >>> with LiveMemory() as mem:            # storages created under the mode
    ...     state, _ = step(state, batch)
    >>> with LivePeak(torch.device("cpu")) as live:   # and those alive when it starts
    ...     state, _ = step(state, batch)
    >>> tensor_bytes(torch.device("cpu"))    # what lives between steps
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _compat

_compat.require_testing("funshard.testing")


class LiveMemory(_compat.TorchDispatchMode):
    """Peak bytes of live tensor storages created while active, sampled after every op.

    Storages are tracked by weak reference, so freed tensors leave the count, and a storage
    resized to 0 bytes (a freed unsharded parameter) counts 0. Only storages allocated by ops
    under the mode are counted: views and in-place results of existing tensors are not.

        >>> with LiveMemory() as mem:
        ...     state, _ = step(state, batch)
        >>> mem.peak   # bytes
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, Any] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_key(t) for t in _tensors((args, tuple(kwargs.values())))}
        for t in _tensors(out):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            # views and in-place results alias an input: not a new allocation
            key = _compat.storage_id(st)
            if key not in self._live and key not in inputs:
                self._live[key] = weakref.ref(st)  # the storage lives as its tensors do
        total = 0
        for key, ref in list(self._live.items()):
            st = ref()
            if st is None:
                del self._live[key]
            else:
                total += st.nbytes()
        self.peak = max(self.peak, total)
        return out


def _storage_key(t):
    try:
        return _compat.storage_id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _storages(device: torch.device) -> dict[int, torch.UntypedStorage]:
    """Every distinct storage on ``device`` that a Python tensor object holds, by ``_cdata``."""
    with warnings.catch_warnings():  # isinstance() touches deprecated torch attributes
        warnings.simplefilter("ignore")
        # a weak proxy (the compiler keeps some) whose object died raises on isinstance
        objs = [o for o in gc.get_objects()
                if not isinstance(o, weakref.ProxyTypes) and isinstance(o, torch.Tensor)]
    from ..step.lazy import LazyParam  # no storage; an op on one would gather

    out = {}
    for o in objs:
        if isinstance(o, LazyParam):
            continue
        t = _compat.local_tensor(o) if isinstance(o, DTensor) else o
        if t.device.type != device.type:
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        # a compiler's fake tensor says it is on ``device``; its storage is on "meta"
        if st.device.type == device.type and type(st.nbytes()) is int:
            out[_compat.storage_id(st)] = st
    return out


def tensor_bytes(device: torch.device) -> int:
    """Bytes of every distinct storage on ``device`` that a Python tensor object holds."""
    return sum(st.nbytes() for st in _storages(device).values())


class LivePeak(LiveMemory):
    """:class:`LiveMemory` that also tracks the storages alive when it starts, so the peak is
    of all tensor memory, and a storage regrown in place (``resize_``: FSDP2's unsharded
    parameters, funshard's regathered groups) counts at its current size."""

    def __init__(self, device: torch.device):
        super().__init__()
        for key, st in _storages(device).items():
            self._live[key] = weakref.ref(st)
