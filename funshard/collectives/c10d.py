"""The backend's own collectives (NCCL on GPUs, gloo on CPUs), the default transport: one
flat buffer each way.

The all-gather copies every local shard into this rank's segment of one flat buffer
(in place: the input is the output's own segment, so no separate input lives while the
gather is in flight), gathers it, and copies it out into the full tensors when done.

The buffer is in the leaves' dtype when they share one (a group's usual case): each leaf's
place in it is then one split of the segment, worked out once per list of layouts and
dtypes (:class:`_Plan`), where a byte buffer needs a slice and a dtype view per leaf and
call (about 5 us each on a CPU core: a group of 12 leaves gathered 18 times a step). Leaves
in several dtypes share a byte buffer, widest dtype first (:func:`funshard.layout.byte_plan`).
Either way the collective moves the buffer as bytes, so every dtype moves on every backend
(gloo refuses float8 and uint16 buffers).

Which c10d calls move the flat buffers is chosen here, once, by feature detection: torch
2.13 has ``all_gather_single`` / ``reduce_scatter_single``; older releases (2.11, 2.12)
have ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, with the same semantics, the
same c10d ops underneath and the same buffers (no extra copy either way).

[Note: CUDA streams] On NCCL a collective launched with ``async_op=True`` runs on the
process group's own stream after waiting (on the device, by event) for the work already
queued on the current stream; ``work.wait()`` makes the current stream wait for it the same
way, without blocking the host. So the step's prefetch (the next group's all-gather
launched before this group's ops) and its reduce-scatters (launched as a group's backward
ends, waited a group later) overlap compute on the GPU as FSDP2's separate streams do.
The copy into the flat buffer and out of it run on the compute stream. Lifetimes: the
process group keeps a collective's tensors from reuse until it is done (it holds them
until the wait, or records them on its stream, as the torch build chooses). Every
collective the step launches is waited (a prefetch nobody used too, when the run
finishes) before its buffers are dropped or resized, so the caching allocator reuses them
only after the device is done with them. Not yet measured on a GPU: a profile of the
overlap (``benchmarks/overlap.py`` sums one).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .. import _compat
from ..layout import byte_plan
from .base import Gathered, Transport, new_padded, skips


class FlatApi(NamedTuple):
    """The c10d calls for one flat all-gather and reduce-scatter (same signatures)."""

    name: str
    all_gather: Callable  # (output, input, group=, async_op=)
    reduce_scatter: Callable  # (output, input, group=, async_op=), sum


LEGACY = FlatApi("all_gather_into_tensor", dist.all_gather_into_tensor,
                 dist.reduce_scatter_tensor)
NEWEST = (FlatApi("all_gather_single", dist.all_gather_single, dist.reduce_scatter_single)
          if hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")
          else None)
API = NEWEST or LEGACY  # the newest this torch has


class _Plan(NamedTuple):
    """One all-gather of leaves in one dtype, in elements: what :meth:`C10d.all_gather` reads
    per call, worked out once per list of layouts and dtypes."""

    dtype: torch.dtype
    order: list[int]  # leaves with elements, in the buffer's order
    sizes: list[int]  # their padded chunk elements
    total: int  # sum of sizes
    seg: int  # one rank's segment: total, padded to the alignment
    slots: list[int]  # the segment split: sizes, and the padding after them if any
    # per leaf this rank holds elements of: (slot, leaf, those elements, slot size, 1-D)
    local: list[tuple[int, int, int, int, bool]]


_PLANS: dict[tuple, _Plan | None] = {}


def _plan(layouts, dtypes) -> _Plan | None:
    """The :class:`_Plan` of an all-gather (None: leaves in several dtypes), kept by the
    layouts and dtypes, which are values (the step gathers the same groups every step)."""
    key = (tuple(layouts), tuple(dtypes))
    try:
        return _PLANS[key]
    except KeyError:
        pass
    except TypeError:  # a layout holding something unhashable: worked out for this call
        key = None
    if len(_PLANS) >= 4096:  # a bound, for a process that makes many steps
        _PLANS.clear()
    plan = None
    if len(set(dtypes)) == 1:
        dt = dtypes[0]
        bp = byte_plan(layouts, dtypes)
        sizes = [s // dt.itemsize for s in bp.sizes]
        total, seg = sum(sizes), bp.segment // dt.itemsize
        local = [(j, i, layouts[i].local_rows * layouts[i].row_numel, size,
                  len(layouts[i].shape) == 1) for j, (i, size) in enumerate(zip(bp.order, sizes))]
        plan = _Plan(dt, bp.order, sizes, total, seg, sizes + [seg - total] * (seg > total),
                     [x for x in local if x[2]])
    if key is not None:
        _PLANS[key] = plan
    return plan


def _typed(plan: _Plan, shards, world: int, rank: int, device) -> tuple:
    """An all-gather of leaves in one dtype: its buffer, this rank's segment, where each
    shard goes (one split) and what goes there, and the copy out into the padded tensors."""
    out = torch.empty(world * plan.seg, dtype=plan.dtype, device=device)
    inp = out[rank * plan.seg : (rank + 1) * plan.seg]
    pieces = inp.split(plan.slots)
    dst = [pieces[j] if n == size else pieces[j][:n] for j, _, n, size, _ in plan.local]
    src = [shards[i] if flat else shards[i].reshape(-1) for _, i, _, _, flat in plan.local]

    def copy_out(padded: list) -> None:
        views = [padded[i].view(world, -1) for i in plan.order]
        torch.split_with_sizes_copy(out.view(world, plan.seg)[:, : plan.total], plan.sizes,
                                    dim=1, out=views)

    return out, inp, dst, src, copy_out


def _bytes(layouts, shards, dtypes, world: int, rank: int, device) -> tuple:
    """:func:`_typed` of leaves in several dtypes: one flat byte buffer, widest dtype first."""
    bp = byte_plan(layouts, dtypes)
    out = torch.empty(world * bp.segment, dtype=torch.uint8, device=device)
    inp = out.view(world, -1)[rank]
    dst, src, offset = [], [], 0
    for i, size in zip(bp.order, bp.sizes):
        n = layouts[i].local_rows * layouts[i].row_numel
        if n:
            dst.append(inp[offset : offset + n * dtypes[i].itemsize].view(dtypes[i]))
            src.append(shards[i].reshape(-1))
        offset += size

    def copy_out(padded: list) -> None:
        if bp.order:
            views = [padded[i].view(world, -1).view(torch.uint8) for i in bp.order]
            torch.split_with_sizes_copy(out.view(world, bp.segment)[:, : bp.total], bp.sizes,
                                        dim=1, out=views)

    return out, inp, dst, src, copy_out


class C10d(Transport):
    name = "c10d"
    borrows = False

    def __init__(self, api: FlatApi = API):
        self.api = api

    def all_gather(self, layouts, shards, dtypes, pg, into, device, async_op) -> Gathered:
        world = pg.size() if pg is not None else 1
        rank = pg.rank() if pg is not None else 0
        plan = _plan(layouts, dtypes)
        out, inp, dst, src, copy_out = (
            _typed(plan, shards, world, rank, device) if plan is not None
            else _bytes(layouts, shards, dtypes, world, rank, device))
        if dst:
            _compat.foreach_copy_(dst, src)  # casts to the gather dtype on the way in
        work = None
        if not skips(world):  # bytes move: every dtype, whatever the backend takes (gloo
            # refuses float8 and uint16 buffers)
            work = self.api.all_gather(out.view(torch.uint8), inp.view(torch.uint8), group=pg,
                                       async_op=async_op)

        def finish() -> list[torch.Tensor]:
            padded = list(into()) if into is not None else new_padded(layouts, dtypes, device)
            copy_out(padded)
            return padded

        return Gathered(work if async_op else None, finish, layouts)

    def reduce_scatter(self, out, inp, pg):
        if out.is_complex():  # NCCL has no complex type: a sum of (re, im) pairs is the same
            out, inp = torch.view_as_real(out).view(-1), torch.view_as_real(inp.view(-1))
        return self.api.reduce_scatter(out, inp.view(-1), group=pg, async_op=True)
