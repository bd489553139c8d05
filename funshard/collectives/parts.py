"""The pieces of a :class:`funshard.collectives.reduce.GradBucket`, one per reduce dtype:
:class:`Part` lays out and fills the collectives' inputs (a ``(world, seg)`` reduce-scatter
input for the sharded leaves, a flat all-reduce buffer for the replicated ones) and
:class:`ReduceOne` is their collectives in flight.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .. import _compat
from ..layout import Layout
from ..mesh import SHARD
from .base import skips, watch


def flush(even: dict) -> None:
    """The copies ``GradBucket.put_all`` holds, done: one foreach copy per part."""
    for dsts, srcs in even.values():
        _compat.foreach_copy_(dsts, srcs)  # casts to the reduce dtype, as copy_ does
    even.clear()


class Part:
    """One reduce dtype of a ``GradBucket``: a (world, seg) reduce-scatter input for the
    sharded leaves (each rank's rows of every leaf, padded as ``torch.chunk`` pads) and a flat
    all-reduce buffer for the replicated ones."""

    def __init__(self, rdt: torch.dtype, device: torch.device, borrow: bool = False):
        self.rdt, self.device = rdt, device
        # borrowed: each sharded leaf's (rows, row_numel) gradient itself, sent from there
        self.kept: list[torch.Tensor | None] | None = [] if borrow else None
        self.layouts: list[Layout] = []
        self.offsets: list[int] = []  # in the (world, seg) rows, or in the flat buffer
        self.seg = self.flat_numel = 0
        self.inp = self.flat = None
        self.cols: list | None = None  # per leaf, its (world, padded chunk) columns of inp
        self.filled: list[bool] = []
        # the leaves added first with a spread, and how far they reach in each buffer
        self.spread: tuple[str, ...] = ()
        self.spread_seg = self.spread_flat = self.spread_count = 0

    def add(self, lay: Layout, spread: tuple[str, ...] = ()) -> int:
        if spread:
            if spread != (self.spread or spread) or len(self.layouts) > self.spread_count:
                raise ValueError(f"funshard bug: gradient bucket leaf {lay.path!r} with spread "
                                 f"{spread} after others without it, or after {self.spread}")
            self.spread, self.spread_count = spread, self.spread_count + 1
        self.layouts.append(lay)
        self.filled.append(False)
        if self.kept is not None:
            self.kept.append(None)
        if lay.sharded:
            self.offsets.append(self.seg)
            self.seg += lay.padded_numel
        else:
            self.offsets.append(self.flat_numel)
            self.flat_numel += math.prod(lay.shape)
        if spread:
            self.spread_seg, self.spread_flat = self.seg, self.flat_numel
        return len(self.layouts) - 1

    def columns(self) -> list:
        """Per leaf, a sharded leaf's ``(world, padded chunk)`` columns of the input (None
        for a replicated one): one split of the input, made on first use."""
        if self.cols is None:
            sharded = [lay for lay in self.layouts if lay.sharded]
            self.inp = torch.empty(sharded[0].world, self.seg, dtype=self.rdt,
                                   device=self.device)
            pieces = iter(self.inp.split([lay.padded_numel for lay in sharded], dim=1))
            self.cols = [next(pieces) if lay.sharded else None for lay in self.layouts]
        return self.cols

    def _region(self, j: int) -> torch.Tensor:
        """Leaf ``j``'s place: (world, chunk, row_numel) of the input, or its flat slice."""
        lay, off = self.layouts[j], self.offsets[j]
        if lay.sharded:
            return self.columns()[j].view(lay.world, lay.chunk, lay.row_numel)
        if self.flat is None:
            self.flat = torch.empty(self.flat_numel, dtype=self.rdt, device=self.device)
        return self.flat[off : off + math.prod(lay.shape)]

    def put(self, j: int, grad: torch.Tensor, first: bool) -> None:
        lay = self.layouts[j]
        if self.kept is not None and lay.sharded:
            g = grad.to(self.rdt).reshape(lay.rows, lay.row_numel)
            kept = self.kept[j]
            self.kept[j] = g if first or kept is None else kept + g  # never in place: borrowed
            self.filled[j] = True
            return
        dst = self._region(j)
        self.filled[j] = True
        if not lay.sharded:
            src = grad.reshape(-1)
            dst.copy_(src) if first else dst.add_(src)
            return
        if dst.numel():
            put_rows(dst, grad, lay, first)

    def launch(self, shard_pg, reps, spread, divide, transport) -> ReduceOne:
        for j, lay in enumerate(self.layouts):
            if lay.sharded and self.kept is not None:
                continue  # a leaf never put sends zeros
            if not self.filled[j] and (self.seg if lay.sharded else self.flat_numel):
                self._region(j).zero_()  # never put: zeros (every rank takes part)
        return ReduceOne(self, shard_pg, reps, spread, divide, transport)


def put_rows(dst: torch.Tensor, grad: torch.Tensor, lay: Layout, first: bool) -> None:
    """Copy (or add) a full gradient into its (world, chunk, row_numel) region, rank by
    rank as ``torch.chunk`` splits it; padding rows reduce as zeros."""
    rows, c = lay.rows, lay.chunk
    src = grad.reshape(rows, lay.row_numel)
    whole, rem = divmod(rows, c)  # ranks with a full chunk; rows of the next one
    parts = [(dst[:whole], src[: whole * c].view(whole, c, lay.row_numel))]
    if rem:
        parts.append((dst[whole, :rem], src[whole * c :]))
    for d, s in parts:
        d.copy_(s) if first else d.add_(s)
    if first and rows < lay.world * c:  # padding rows reduce as zeros
        if rem:
            dst[whole, rem:].zero_()
        dst[whole + (1 if rem else 0) :].zero_()


class ReduceOne:
    """One reduce dtype's collectives: launched on construction, finished by ``wait``."""

    def __init__(self, part: Part, shard_pg, reps, spread, divide, transport):
        layouts, offsets, inp, flat = part.layouts, part.offsets, part.inp, part.flat
        self.layouts, self.reps, self.rdt, self.device = layouts, reps, part.rdt, part.device
        # the leaves with a spread: a prefix of each piece, all-reduced over ``spread`` too
        self.spread, self.prefix = spread, []
        self.divide = divide
        self.works, self.pieces = [], []
        self.results: list[torch.Tensor] = [None] * len(layouts)  # type: ignore[list-item]
        kept = part.kept if part.seg else None
        if kept is not None or (inp is not None and inp.numel()):
            rs = self._launch_shard(part, kept, shard_pg, transport)
            for k, lay in enumerate(layouts):
                if lay.sharded and lay.local_rows * lay.row_numel:
                    n = lay.local_rows * lay.row_numel
                    self.results[k] = rs[offsets[k] : offsets[k] + n].view(lay.local_shape)
            self.pieces.append(rs)
            self.prefix.append(rs[: part.spread_seg])
        if flat is not None and flat.numel():
            if not skips(dist.get_world_size(shard_pg)):
                with watch("all-reduce", None, SHARD):
                    self.works.append(("all-reduce", dist.all_reduce(flat, group=shard_pg,
                                                                     async_op=True),
                                       time.monotonic()))
            for k, lay in enumerate(layouts):
                if not lay.sharded and math.prod(lay.shape):
                    n = math.prod(lay.shape)
                    self.results[k] = flat[offsets[k] : offsets[k] + n].view(lay.shape)
            self.pieces.append(flat)
            self.prefix.append(flat[: part.spread_flat])

    def _launch_shard(self, part: Part, kept, shard_pg, transport) -> torch.Tensor:
        """Start the reduce-scatter of the sharded leaves; return its output (seg,)."""
        inp = part.inp
        if kept is not None:  # borrowed gradients: a direct exchange from them
            rs = torch.empty(part.seg, dtype=self.rdt, device=self.device)
            with watch("reduce-scatter", None, SHARD):
                self.works.append(("reduce-scatter", transport.reduce_scatter_leaves(
                    rs, kept, part.layouts, part.offsets, shard_pg), time.monotonic()))
        elif not skips(inp.shape[0]):
            rs = torch.empty(inp.shape[1], dtype=self.rdt, device=self.device)
            with watch("reduce-scatter", None, SHARD):
                self.works.append(("reduce-scatter", transport.reduce_scatter(rs, inp, shard_pg),
                                   time.monotonic()))
        else:
            rs = inp.view(-1)
        return rs

    def finish_reduce_scatter(self) -> None:
        if self.works is None:  # advanced before
            return
        for kind, work, since in self.works:  # (issued at since: see watch)
            with watch(kind, None, SHARD, since=since):
                work.wait()
        self.works = None
        pieces = self.pieces
        self.both = None
        if self.reps and pieces:
            # one all-reduce for both kinds: a concatenation, copied back when done
            self.both = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            with watch("all-reduce", None, self.reps[0][0]):
                self.rep_work = dist.all_reduce(self.both, group=self.reps[0][1], async_op=True)
                self.rep_since = time.monotonic()

    def wait(self) -> list[torch.Tensor]:
        self.finish_reduce_scatter()
        pieces = self.pieces
        if self.both is not None:
            with watch("all-reduce", None, self.reps[0][0], since=self.rep_since):
                self.rep_work.wait()
            if len(pieces) > 1:
                _compat.foreach_copy_(pieces, list(self.both.split([p.numel() for p in pieces])))
            self.both = self.rep_work = None
        prefix = [p for p in self.prefix if p.numel()]
        for name, pg in self.spread if prefix else ():  # "ep": ranks that computed other rows
            both = prefix[0] if len(prefix) == 1 else torch.cat(prefix)
            with watch("all-reduce", None, name):
                dist.all_reduce(both, group=pg)
            if len(prefix) > 1:
                _compat.foreach_copy_(prefix, list(both.split([p.numel() for p in prefix])))
        if self.divide != 1 and pieces:  # the mean: one division per flat buffer, not per leaf
            _compat.foreach_div_(pieces, self.divide)
        for k, lay in enumerate(self.layouts):
            if self.results[k] is None:  # no elements
                self.results[k] = torch.zeros(lay.local_shape, dtype=self.rdt, device=self.device)
        return self.results
