"""Bucketed all-gather: one collective on ``"shard"`` for a list of sharded leaves.

    >>> layouts = [layout_of("w", w_dt)]                 # w_dt: DTensor (7, 3), Shard(0)
    >>> (full,) = all_gather(layouts, [w_dt.to_local()], mesh).wait()   # (7, 3)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import _compat
from ..layout import Layout, byte_plan
from ..mesh import SHARD, process_groups
from .base import TRANSPORTS, Gathered, Transport, new_padded, skips, watch
from . import cma, cma_link
from .c10d import C10d
from .p2p import P2P

_IMPLS: dict[str, Transport] = {"c10d": C10d(), "p2p": P2P(), "cma": cma.CMA()}


def choose(name: str, pg, device: torch.device) -> Transport:
    """The transport named ``name`` (``"c10d"``, ``"p2p"``, ``"cma"``) for a process group
    (None: a world of one, where nothing moves) and device. The first call with ``"cma"`` on
    a group is collective (a handshake)."""
    check_transport(name, where="collectives")
    if pg is None or name == "c10d":
        return _IMPLS["c10d"]
    if device.type != "cpu" or "gloo" not in str(dist.get_backend(pg)):
        raise ValueError(
            f"transport={name!r} moves CPU tensors between gloo ranks; this process group is "
            f"{dist.get_backend(pg)} on {device.type}: use 'c10d' (the default).")
    if name == "cma" and not cma_link.available(pg):
        raise ValueError(
            "transport='cma' reads peers' memory (process_vm_readv), which some rank of this "
            "process group cannot: not x86-64 Linux, ranks on other hosts, ptrace forbidden, "
            "or FUNSHARD_CMA=0. Use 'p2p' or 'c10d' (the default).")
    return _IMPLS[name]


def check_transport(name: str, *, where: str) -> None:
    """Refuse a transport name that is not one of :data:`TRANSPORTS`."""
    if name == "auto":
        raise ValueError(
            f"{where}: transport='auto' is not a transport: the default is 'c10d' (the "
            "backend's collectives: NCCL, gloo); one host's gloo CPU ranks may name 'p2p' or "
            "'cma' (see funshard.collectives.base).")
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
    transport: str = "c10d",
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
        transport: ``"c10d"`` (default), ``"p2p"`` or ``"cma"`` (see
            :mod:`funshard.collectives.base`).
    Returns:
        a :class:`Gathered`; ``.wait()`` -> full tensors in ``layouts`` order.
    """
    dtypes = list(dtypes) if dtypes is not None else [s.dtype for s in shards]
    device = shards[0].device if shards else torch.device(mesh.device_type)
    if layouts and skips(layouts[0].world):  # one rank: each full tensor is its shard, cast
        check_transport(transport, where="collectives")
        return Gathered(None, lambda: _cast(shards, dtypes, into, layouts, device), layouts)
    bp = byte_plan(layouts, dtypes)
    if not bp.order:  # nothing has elements: nothing moves
        return Gathered(None, lambda: (list(into()) if into is not None
                                       else new_padded(layouts, dtypes, device)), layouts)
    pg = process_groups(mesh)[0]
    # moving bytes is never differentiated (the step's Gather node is); a gather in backward
    # runs with grad mode on and may copy from shards that require grad
    with watch("all-gather", mesh, SHARD), torch.no_grad():
        impl = choose(transport, pg, device)  # the first choice is a handshake
        return impl.all_gather(layouts, shards, dtypes, pg, into, device, async_op)


def _cast(shards, dtypes, into, layouts, device) -> list[torch.Tensor]:
    """A world of one's gather: the full tensors are copies of the shards (one shape, no
    padding) in the gather dtypes, with no flat buffer between: one copy, not two, and no
    per-leaf views of a byte buffer. Measured 2026-11-24 (host-bound GPT 8 x 64 on this
    CPU, bfloat16 params, world 1): 17.8 -> 14.8 ms per step against the plain autocast
    step's 8.5 (2.04x -> 1.74x)."""
    outs = list(into()) if into is not None else new_padded(layouts, dtypes, device)
    _compat.foreach_copy_(outs, list(shards))  # under Gathered.wait's no_grad
    return outs


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int],
               in_sizes: list[int], pg, *, transport: str = "c10d") -> None:
    """``dist.all_to_all_single`` (flat, element counts per rank) on ``transport``: the
    backend's collective, or cross-memory reads on one host's CPU ranks (``"cma"``)."""
    impl = choose(transport, pg, inp.device)
    if isinstance(impl, cma.CMA):
        impl.all_to_all(out, inp, out_sizes, in_sizes, pg).wait()
    else:  # p2p has no all-to-all of its own: the backend's
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=pg)
