"""Rank 0's full tensors -> every rank's local shards, one ``dist.scatter`` per group.

``load_state_dict(sd, like, rank0_only=True)`` reads the full state dict on rank 0 only.
For each group, rank 0 packs every shard coordinate's pieces into one byte buffer (each
leaf a padded, 16-byte aligned segment, as :func:`_segments` lays them out) and scatters
the buffers; each rank cuts its own leaves out of what it receives. On a mesh with the
model's own dimensions (tensor or expert parallel) rank 0 broadcasts each full tensor in
turn instead (:func:`_broadcast_full`): every rank holds one full tensor at a time and keeps
its piece, the model's part then its rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._ranks import _world
from .layout import Layout, layout_of, local_slice
from .mesh import mesh_str, shard_dim


def _segments(lays: list[Layout]) -> tuple[list[int], int]:
    """Byte offset of each leaf's (padded, 16-byte aligned) segment and the total size."""
    offs, total = [], 0
    for lay in lays:
        offs.append(total)
        total += -(-lay.padded_numel * lay.dtype.itemsize // 16) * 16
    return offs, total


def _scatter_group(keys, likes, full) -> list[torch.Tensor]:
    """Rank 0's full tensors -> every rank's local shards, with one ``dist.scatter``."""
    world = _world()
    lays, coord = [], [0] * world
    for k, v in zip(keys, likes):
        if isinstance(v, DTensor):
            mesh = v.device_mesh
            if mesh.size() != world:
                raise ValueError(f"load_state_dict(rank0_only=True): {k!r} is on {mesh_str(mesh)} "
                                 f"of {mesh.size()} ranks but the world has {world}; use a mesh "
                                 "over every rank or rank0_only=False")
            sdim = shard_dim(mesh)
            for idx in torch.nonzero(mesh.mesh >= 0).tolist():  # global rank -> shard coordinate
                coord[int(mesh.mesh[tuple(idx)])] = idx[sdim]
            lays.append(layout_of(k, v))
        else:
            lays.append(Layout(k, v.shape, v.dtype, False, 1, 0))
    offs, total = _segments(lays)
    device = likes[0].device
    recv = torch.empty(total, dtype=torch.uint8, device=device)
    send = None
    if full is not None:
        bufs = {}
        for c in sorted(set(coord)):
            buf = torch.zeros(total, dtype=torch.uint8, device=device)
            for lay, off, t in zip(lays, offs, full):
                piece = local_slice(t.detach(), lay._replace(rank=c) if lay.sharded
                                                else lay)
                n = piece.numel() * lay.dtype.itemsize
                buf[off:off + n].view(lay.dtype).copy_(piece.reshape(-1))
            bufs[c] = buf
        send = [bufs[coord[r]] for r in range(world)]
    dist.scatter(recv, send, src=0)
    out = []
    for lay, off in zip(lays, offs):
        n = lay.local_rows * lay.row_numel if lay.shape else 1
        out.append(recv[off:off + n * lay.dtype.itemsize].view(lay.dtype).view(lay.local_shape)
                   .clone())
    return out


def _broadcast_full(full: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Rank 0's full tensor (``full``; None elsewhere), shaped like ``like``, on every rank."""
    t = (full.detach().to(like.device, copy=True).contiguous() if full is not None
         else torch.empty(like.shape, dtype=like.dtype, device=like.device))
    dist.broadcast(t, src=0)
    return t
