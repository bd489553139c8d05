"""Bucketed all-gather: one collective on ``"shard"`` for a list of sharded leaves.

    >>> layouts = [layout_of("w", w_dt)]                 # w_dt: DTensor (7, 3), Shard(0)
    >>> (full,) = all_gather(layouts, [w_dt._local_tensor], mesh).wait()   # (7, 3)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..layout import Layout, byte_plan
from ..mesh import SHARD, process_groups
from .base import TRANSPORTS, Gathered, Transport, new_padded, skips, watch
from .c10d import C10d
from .p2p import P2P

_IMPLS: dict[str, Transport] = {"c10d": C10d(), "p2p": P2P()}


def choose(name: str, pg, device: torch.device) -> Transport:
    """The transport ``name`` (``"auto"``, ``"c10d"``, ``"p2p"``) resolves to for a process
    group (None: a world of one, where nothing moves) and device."""
    check_transport(name, where="comm")
    if pg is None:
        return _IMPLS["c10d"]
    gloo_cpu = device.type == "cpu" and "gloo" in str(dist.get_backend(pg))
    if name == "auto":
        return _IMPLS["p2p" if gloo_cpu else "c10d"]
    if name == "p2p" and not gloo_cpu:
        raise ValueError(
            f"transport='p2p' moves buckets by gloo point-to-point messages on CPU; this process "
            f"group is {dist.get_backend(pg)} on {device.type}: use 'c10d' or 'auto'."
        )
    return _IMPLS[name]


def check_transport(name: str, *, where: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"{where}: transport={name!r}; use one of {TRANSPORTS}")


def all_gather(
    layouts: Sequence[Layout],
    shards: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    async_op: bool = False,
    into: Callable[[], Sequence[torch.Tensor]] | None = None,
    transport: str = "auto",
) -> Gathered:
    """One all-gather on ``"shard"`` for all ``shards`` (sharded leaves only).

    Args:
        layouts: one :class:`Layout` per shard, all ``sharded``.
        shards: the local shards (``layout.local_shape``).
        mesh: their mesh.
        dtypes: gather dtype per leaf (mixed precision casts before the gather).
        async_op: return before the collective completes; ``wait()`` finishes it.
        into: returns the padded full tensors (``layout.padded_shape``) to fill instead of
            new ones; called when they are first written: at once for a direct exchange,
            at ``wait()`` for a collective.
        transport: ``"auto"``, ``"c10d"`` or ``"p2p"`` (see :mod:`funshard.comm.base`).
    Returns:
        a :class:`Gathered`; ``.wait()`` -> full tensors in ``layouts`` order.
    """
    dtypes = list(dtypes) if dtypes is not None else [s.dtype for s in shards]
    device = shards[0].device if shards else torch.device(mesh.device_type)
    bp = byte_plan(layouts, dtypes)
    if not bp.order:  # nothing has elements: nothing moves
        return Gathered(None, lambda: (list(into()) if into is not None
                                       else new_padded(layouts, dtypes, device)), layouts)
    world = layouts[bp.order[0]].world
    pg = None if skips(world) else process_groups(mesh)[0]
    impl = choose(transport, pg, device)
    # moving bytes is never differentiated (the step's Gather node is); a gather in backward
    # runs with grad mode on and may copy from shards that require grad
    with watch("all-gather", mesh, SHARD), torch.no_grad():
        return impl.all_gather(layouts, shards, dtypes, pg, into, device, async_op)

