"""The compiled step's two copies around a group's all-gather, as opaque operators.

``pack`` lays a group's local shards end to end (each padded to its ``torch.chunk`` rows)
in the dtype they move in: the all-gather's input. ``unpack`` cuts each leaf's full tensor
out of the gathered ``(world, group)`` buffer, in its compute dtype. Their gradients are
each other's transposes: the reduce-scatter's output cut into the leaves' shard gradients,
the leaves' full gradients laid into one ``(world, group)`` buffer. ``pack``'s backward
finishes the reduction as the eager step does, once per group on the reduce-scatter's
output before the cut: on a 2-D mesh the all-reduce over the replicate ranks, then the
mean (one division); so the program's gradients are those buffers, not a concatenation or
a second copy of every gradient at its end.
``pack_into`` is the pack that :mod:`funshard.step.overlap` puts in its place, to gather in
place: the copy into this rank's segment of the gathered buffer.

[Note: why the copies are operators] Written as ``torch.cat``, ``F.pad`` and slices, the
compiler fused them with their neighbours, and two things went wrong, both measured on
shape B (4 blocks of two 8M-element matrices, 2 ranks): the pack of every group's
backward regather read the same shards as its forward gather, so inductor fused all of them
into one kernel at the program's start and kept each packed copy alive until its group's
backward (+256 MiB of in-step memory, 384 MiB against the eager step's 257); and the cut's
gradient became one masked kernel choosing, per element, which leaf it came from (0.4 ms a
group at world 1 on the host-bound GPT). As custom operators (``torch.library``) they are
copies the compiler schedules where the graph puts them and does not fuse: each pack runs
just before its gather, each gradient buffer is filled by plain copies.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _compat


def _fill(out: torch.Tensor, shards: list[torch.Tensor], numels: list[int]) -> torch.Tensor:
    at = 0
    for s, n in zip(shards, numels):
        k = s.numel()
        out[at:at + k].copy_(s.reshape(-1))
        if k < n:
            out[at + k:at + n].zero_()
        at += n
    return out


@torch.library.custom_op("funshard::pack", mutates_args=())
def pack(shards: list[torch.Tensor], numels: list[int], dtype: torch.dtype, divide: int,
         rank: int, across: Optional[str]) -> torch.Tensor:
    """The shards end to end, shard ``i`` padded to ``numels[i]`` elements, as ``dtype``;
    in backward, the gradient (the reduce-scatter's sum) all-reduced over the process group
    named ``across`` (a 2-D mesh's replicate dim; None: none) and divided by ``divide``
    before it is cut. ``rank``: this rank's place among the gather's (for
    :func:`pack_into`)."""
    return _fill(torch.empty(sum(numels), dtype=dtype, device=shards[0].device), shards,
                 numels)


@pack.register_fake
def _(shards, numels, dtype, divide, rank, across):
    return shards[0].new_empty(sum(numels), dtype=dtype)


@torch.library.custom_op("funshard::pack_into", mutates_args=())
def pack_into(shards: list[torch.Tensor], numels: list[int], dtype: torch.dtype, world: int,
              rank: int) -> torch.Tensor:
    """``pack`` into segment ``rank`` of a ``world`` times longer buffer, the rest unset:
    an all-gather's output that is, in place, its input (:mod:`funshard.step.overlap`)."""
    n = sum(numels)
    out = torch.empty(world * n, dtype=dtype, device=shards[0].device)
    _fill(out[rank * n:(rank + 1) * n], shards, numels)
    return out


@pack_into.register_fake
def _(shards, numels, dtype, world, rank):
    return shards[0].new_empty(world * sum(numels), dtype=dtype)


def _pack_context(ctx, inputs, output) -> None:
    shards, numels, _, divide, _, across = inputs
    ctx.layout = [(tuple(s.shape), s.numel(), s.dtype) for s in shards]
    ctx.numels, ctx.divide, ctx.across = numels, divide, across


def _pack_backward(ctx, grad):
    if ctx.across is not None:  # the replicate ranks' sum, one all-reduce a group
        grad = _compat.wait_tensor(_compat.all_reduce(grad, "sum", ctx.across))
    if ctx.divide != 1:
        grad = grad / ctx.divide
    out, at = [], 0
    for (shape, k, dt), n in zip(ctx.layout, ctx.numels):
        out.append(grad[at:at + k].view(shape).to(dt))
        at += n
    return out, None, None, None, None, None


pack.register_autograd(_pack_backward, setup_context=_pack_context)


@torch.library.custom_op("funshard::unpack", mutates_args=())
def unpack(gathered: torch.Tensor, world: int, numels: list[int], dims: list[int],
           ndims: list[int], rows: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Leaf ``i`` of ``gathered`` (``world`` rank segments of ``sum(numels)`` elements each):
    its columns of every segment, as its padded shape (``shapes_of(dims, ndims)[i]``), its
    first ``rows[i]`` rows, a contiguous copy in ``dtype``."""
    seg = gathered.view(world, -1)
    out, at = [], 0
    for n, shape, r in zip(numels, shapes_of(dims, ndims), rows):
        full = torch.empty(shape, dtype=dtype, device=gathered.device)
        full.view(world, n).copy_(seg[:, at:at + n])
        out.append(full[:r])  # the leading rows of a new tensor: contiguous, no alias
        at += n
    return out


@unpack.register_fake
def _(gathered, world, numels, dims, ndims, rows, dtype):
    return [gathered.new_empty([r, *shape[1:]], dtype=dtype)
            for shape, r in zip(shapes_of(dims, ndims), rows)]


def shapes_of(dims: list[int], ndims: list[int]) -> list[list[int]]:
    """``dims`` (shapes end to end) cut into shapes of ``ndims`` dimensions each."""
    out, at = [], 0
    for k in ndims:
        out.append(list(dims[at:at + k]))
        at += k
    return out


def _unpack_context(ctx, inputs, output) -> None:
    gathered, world, numels, dims, ndims, rows, dtype = inputs
    ctx.world, ctx.numels, ctx.dims, ctx.ndims, ctx.rows = world, numels, dims, ndims, rows
    ctx.moved, ctx.dtype, ctx.device = gathered.dtype, dtype, gathered.device


def _unpack_backward(ctx, grads):
    grads = [g if g is not None else  # a leaf the loss did not reach: zeros
             torch.zeros([r, *shape[1:]], dtype=ctx.dtype, device=ctx.device)
             for g, shape, r in zip(grads, shapes_of(ctx.dims, ctx.ndims), ctx.rows)]
    return (lay(grads, ctx.world, ctx.numels, ctx.dims, ctx.ndims, ctx.rows, ctx.moved),
            None, None, None, None, None, None)


@torch.library.custom_op("funshard::lay", mutates_args=())
def lay(grads: list[torch.Tensor], world: int, numels: list[int], dims: list[int],
        ndims: list[int], rows: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``unpack``'s transpose: the leaves' full gradients in one ``(world * sum(numels))``
    buffer of ``dtype``, padding rows zero."""
    total = sum(numels)
    out = torch.empty(world, total, dtype=dtype, device=grads[0].device)
    at = 0
    for g, n, shape, r in zip(grads, numels, shapes_of(dims, ndims), rows):
        flat = g.reshape(-1)
        if r < shape[0]:  # the padding rows' gradient: zero
            flat = torch.cat([flat, flat.new_zeros(world * n - flat.numel())])
        out[:, at:at + n].copy_(flat.view(world, n))
        at += n
    return out.view(-1)


@lay.register_fake
def _(grads, world, numels, dims, ndims, rows, dtype):
    return grads[0].new_empty(world * sum(numels), dtype=dtype)


unpack.register_autograd(_unpack_backward, setup_context=_unpack_context)

# what a group region's selective-checkpoint policy recomputes in backward
OPS = (torch.ops.funshard.pack.default, torch.ops.funshard.unpack.default)
LAY = torch.ops.funshard.lay.default  # a gradient buffer laid out (funshard.step.overlap)
PACK, PACK_INTO = torch.ops.funshard.pack.default, torch.ops.funshard.pack_into.default
