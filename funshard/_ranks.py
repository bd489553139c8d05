"""This process's rank and world size, and small Python objects exchanged between ranks.

The state-dict and checkpoint code agree on errors, tokens and file lists through these
(pickled, with the ``*_object`` collectives); tensors move through
:mod:`funshard.collectives`. Without an initialized process group each helper acts as a
world of one. ``pg=None`` is the default group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from . import _compat


def _rank(pg=None) -> int:
    return dist.get_rank(pg) if dist.is_initialized() else 0


def _world(pg=None) -> int:
    return dist.get_world_size(pg) if dist.is_initialized() else 1


def _broadcast_obj(obj: Any, pg=None) -> Any:
    if _world(pg) == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    dist.broadcast_object_list(box, src=src, group=pg)
    return box[0]


def _all_gather_obj(obj: Any, pg=None) -> list[Any]:
    if _world(pg) == 1:
        return [obj]
    out = [None] * _world(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def _timeout(pg=None) -> float | None:
    """Seconds a collective on ``pg`` (default: the default group) may wait, or None.

    ``make_mesh(timeout=)`` sets it when it initialises the process group; read back from
    the group's backend options (feature-detected: None when this torch does not expose it).
    """
    if not dist.is_initialized():
        return None
    return _compat.pg_timeout(pg if pg is not None else dist.group.WORLD)
