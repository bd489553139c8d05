"""Bucketed collectives over a mesh: one all-gather, one reduce-scatter per bucket.

A bucket is a list of sharded leaves on one mesh. Gathering copies every local shard into
one flat byte buffer (each shard padded to ``ceil(rows / world)`` rows, as
``distribute_tensor`` pads), all-gathers it once on the mesh's ``"shard"`` dimension and
splits it back into full tensors. Reducing chunks every full gradient into the same
layout, reduce-scatters it once on ``"shard"``, all-reduces the result once on
``"replicate"`` (2-D meshes) and divides by the number of data-parallel ranks.

    >>> layouts = [layout_of("w", w_dt)]                 # w_dt: DTensor (7, 3), Shard(0)
    >>> (full,) = all_gather(layouts, [w_dt._local_tensor]).wait()   # (7, 3)
    >>> (g_local,) = reduce_scatter(layouts, [grad_full])            # (3, 3) on rank 0 of 3
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import pytree

SHARD = "shard"
REPLICATE = "replicate"
_ALIGN = 16  # bytes; every rank's segment of a byte buffer is a multiple of this


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within the process group's timeout."""


@contextlib.contextmanager
def watch(kind: str, mesh: DeviceMesh | None, dim: str | None = None):
    """Turn a backend's timeout into a :class:`CollectiveTimeout` that says what to do."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            raise
        where = kind + (f" on mesh dimension {dim!r}" if dim else "") + (
            f" of {mesh_str(mesh)}" if mesh is not None else "")
        raise CollectiveTimeout(
            f"funshard: {where} did not complete in time on rank {dist.get_rank()}: another "
            "rank is stuck, died, or issued a different collective (every rank must run the "
            "same ops on the same groups in the same order). The limit is make_mesh(timeout=...)."
            f" Backend said: {text.strip()[:300]}"
        ) from e


def mesh_str(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = ", ".join(f"{n!r}: {s}" for n, s in zip(names, mesh.shape))
    return f"DeviceMesh({dims}; {mesh.device_type})"


def shard_dim(mesh: DeviceMesh, *, where: str = "") -> int:
    """Index of the mesh's ``"shard"`` dimension; ValueError naming the mesh if absent."""
    names = mesh.mesh_dim_names or ()
    if SHARD not in names:
        raise ValueError(
            f"{where}mesh {mesh_str(mesh)} has no {SHARD!r} dimension; funshard shards over a "
            f"mesh dimension named {SHARD!r} (and replicates over {REPLICATE!r}). Build the mesh "
            "with fs.make_mesh(shard=..., replicate=...)."
        )
    for name in names:
        if name not in (SHARD, REPLICATE):
            raise ValueError(
                f"{where}mesh {mesh_str(mesh)} has a dimension {name!r}; funshard meshes have only "
                f"{REPLICATE!r} and {SHARD!r} dimensions. Build the mesh with fs.make_mesh(...)."
            )
    return names.index(SHARD)


class Layout(NamedTuple):
    """Where one leaf's local shard sits in its global tensor (uneven dim 0 included)."""

    path: str
    shape: torch.Size  # global shape
    dtype: torch.dtype
    sharded: bool  # Shard(0) on "shard"; else replicated everywhere
    world: int  # size of the "shard" mesh dimension
    rank: int  # this rank's coordinate on "shard"

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def chunk(self) -> int:
        """Rows per rank, padded: ``ceil(rows / world)``, as ``torch.chunk`` splits."""
        return -(-self.rows // self.world) if self.sharded else self.rows

    @property
    def start(self) -> int:
        return min(self.rows, self.rank * self.chunk) if self.sharded else 0

    @property
    def local_rows(self) -> int:
        if not self.sharded:
            return self.rows
        return min(self.rows, (self.rank + 1) * self.chunk) - self.start

    @property
    def local_shape(self) -> torch.Size:
        if not self.shape:
            return self.shape
        return torch.Size((self.local_rows, *self.shape[1:]))

    @property
    def padded_numel(self) -> int:
        """Elements of one rank's (padded) chunk."""
        return self.chunk * self.row_numel


def placements_for(mesh: DeviceMesh, ndim: int, how: str) -> tuple:
    """Placements for a leaf of ``ndim`` dims: ``how`` is ``"shard"`` or ``"replicate"``."""
    sdim = shard_dim(mesh)
    out = [Replicate()] * mesh.ndim
    if how == SHARD and ndim > 0:
        out[sdim] = Shard(0)
    return tuple(out)


def layout_of(path: str, t: DTensor) -> Layout:
    """The :class:`Layout` of a DTensor leaf; ValueError for placements funshard can't gather."""
    mesh = t.device_mesh
    sdim = shard_dim(mesh, where=f"leaf {path!r}: ")
    sharded = False
    for i, p in enumerate(t.placements):
        name = mesh.mesh_dim_names[i]
        if i == sdim and isinstance(p, Shard) and p.dim == 0 and t.ndim > 0:
            sharded = True
        elif not isinstance(p, Replicate):
            kind = "a pending reduction" if isinstance(p, Partial) else "a layout"
            raise ValueError(
                f"leaf {path!r} of shape {tuple(t.shape)} has placement {p!r} on mesh dimension "
                f"{name!r} of {mesh_str(mesh)}: {kind} funshard cannot gather. funshard gathers "
                f"Shard(0) on {SHARD!r} and Replicate() elsewhere; redistribute it first, e.g. "
                f"t.redistribute(mesh, {list(placements_for(mesh, t.ndim, SHARD))})."
            )
    return Layout(path, t.shape, t.dtype, sharded, mesh.size(sdim), mesh.get_local_rank(sdim))


def local_slice(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """This rank's slice of a full tensor (a view; no copy, no communication)."""
    return x.narrow(0, lay.start, lay.local_rows) if lay.sharded else x


def _groups(mesh: DeviceMesh):
    names = mesh.mesh_dim_names
    shard_pg = mesh.get_group(SHARD)
    rep_pg = mesh.get_group(REPLICATE) if REPLICATE in names else None
    return shard_pg, rep_pg


def _byte_plan(layouts: Sequence[Layout], dtypes: Sequence[torch.dtype]):
    """Order (widest dtype first, so every segment is aligned), byte sizes and row bytes."""
    order = sorted(
        (i for i, lay in enumerate(layouts) if lay.padded_numel > 0),
        key=lambda i: -dtypes[i].itemsize,
    )
    sizes = [layouts[i].padded_numel * dtypes[i].itemsize for i in order]
    total = sum(sizes)
    pad = -total % _ALIGN
    return order, sizes, total, pad


# -- how a bucket moves ---------------------------------------------------------------------
#
# gloo's own all-gather and reduce-scatter cost 2-3x a plain exchange of the same bytes on
# one machine: for a 12.6 MB bucket on 2 ranks, all_gather_single took 9-11 ms,
# reduce_scatter_single 15-17 ms, and isend/irecv of the 6.3 MB halves 4.7-5.1 ms. So on
# gloo a bucket moves by a direct exchange of point-to-point messages, all posted at once:
# - all-gather: each leaf's rows go from their rank straight into every other rank's full
#   (padded) tensor, so there is no flat buffer to copy out of, and no second copy of the
#   group alive while it is copied;
# - reduce-scatter: each rank sends every peer that peer's segment of the flat reduce
#   input (or, borrowed, that peer's rows straight from each gradient) and sums what
#   arrives into its own.
# A message's buffer is held until ``wait``: gloo's point-to-point works cannot tell when
# they are done. Messages between two ranks match in the order both post them.
# Each rank sends (world - 1) / world of the bytes, as a ring does. Every exchange is one
# logical collective: it is announced by one ``funshard::collective`` marker op, which the
# counters (:class:`funshard.testing.CountCollectives`, the bench) count instead of its
# messages. Other backends (NCCL) use their own collectives. ``FUNSHARD_COLLECTIVES=native``
# turns the exchange off (for A/B runs).

DIRECT_TAGS = {"all_gather": 0x6653_0001, "reduce_scatter": 0x6653_0002}
_TAGS = frozenset(DIRECT_TAGS.values())

_LIB = torch.library.Library("funshard", "DEF")
_LIB.define("collective(Tensor anchor, str kind, int logical, int counted) -> ()")
_LIB.impl("collective", lambda anchor, kind, logical, counted: None, "CompositeExplicitAutograd")


def _direct(pg, t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and "gloo" in str(dist.get_backend(pg))
            and os.environ.get("FUNSHARD_COLLECTIVES", "direct") != "native")


def is_direct_message(opname: str, args) -> bool:
    """A c10d ``send`` / ``recv_`` that belongs to a direct exchange (counted by its marker)."""
    return opname in ("send", "recv_") and len(args) > 3 and args[3] in _TAGS


def _announce(kind: str, anchor: torch.Tensor, logical: int, counted: int) -> None:
    """One logical collective, for counters: ``logical`` bytes (all-gather output,
    reduce-scatter input) and ``counted`` (the c10d op's first argument: for a
    reduce-scatter, its output)."""
    torch.ops.funshard.collective(anchor, kind, logical, counted)


class _Exchange:
    """The messages of one direct exchange: ``wait`` finishes them, then runs ``then`` (the
    reduce-scatter's sum). Holds its buffers until then."""

    def __init__(self, works, then=None, keep=()):
        self.works, self.then, self.keep = works, then, keep

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()
        self.works, self.then, self.keep = [], None, ()


def _rows_on(lay: Layout, rank: int) -> int:
    """Rows of ``lay`` that rank ``rank`` holds."""
    return max(0, min(lay.rows, (rank + 1) * lay.chunk) - rank * lay.chunk)


def _start_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, pg):
    """Sum of every rank's ``inp`` row ``rank`` (``inp``: (world, seg)) into ``out`` (seg),
    async; the work's ``wait`` finishes it."""
    if not _direct(pg, inp):
        return dist.reduce_scatter_single(out, inp.view(-1), group=pg, async_op=True)
    world, rank = pg.size(), pg.rank()
    nbytes = inp.numel() * inp.element_size()
    _announce("reduce_scatter", out, nbytes, nbytes // world)
    # 2 ranks receive straight into ``out``; more need one landing row per peer
    land = out.unsqueeze(0) if world == 2 else inp.new_empty(world - 1, inp.shape[1])
    tag, works = DIRECT_TAGS["reduce_scatter"], []
    for i, peer in enumerate(p for p in range(world) if p != rank):
        works.append(pg.send([inp[peer]], peer, tag))
        works.append(pg.recv([land[i]], peer, tag))

    def then():
        if world > 2:
            torch.sum(land, 0, out=out)
        out.add_(inp[rank])

    return _Exchange(works, then, keep=(inp, land))


def _start_reduce_scatter_leaves(out, grads, layouts, offsets, pg):
    """:func:`_start_reduce_scatter` from each sharded leaf's gradient ((rows, row_numel),
    or None for zeros) instead of a flat input: every peer gets its rows of each leaf;
    ``out`` (seg, each leaf's padded chunk at its offset) gets the sum of this rank's."""
    world, rank = pg.size(), pg.rank()
    seg = out.numel()
    nbytes = world * seg * out.element_size()
    _announce("reduce_scatter", out, nbytes, nbytes // world)
    land = out.unsqueeze(0) if world == 2 else out.new_empty(world - 1, seg)
    leaves = [j for j, lay in enumerate(layouts) if lay.sharded and lay.padded_numel]
    need = max((_rows_on(layouts[j], p) * layouts[j].row_numel for j in leaves
                for p in range(world) if grads[j] is None), default=0)
    zeros = out.new_zeros(need) if need else None  # what a leaf never put sends
    tag, works = DIRECT_TAGS["reduce_scatter"], []
    for i, peer in enumerate(p for p in range(world) if p != rank):
        for j in leaves:
            lay, g, off = layouts[j], grads[j], offsets[j]
            n = _rows_on(lay, peer)
            if n:
                src = (g[peer * lay.chunk : peer * lay.chunk + n] if g is not None
                       else zeros[: n * lay.row_numel])
                works.append(pg.send([src], peer, tag))
            n = _rows_on(lay, rank)
            if n:
                works.append(pg.recv([land[i, off : off + n * lay.row_numel]], peer, tag))

    def then():
        if world > 2:
            torch.sum(land, 0, out=out)
        for j in leaves:
            lay, g, off = layouts[j], grads[j], offsets[j]
            n = _rows_on(lay, rank)
            mine = out[off : off + n * lay.row_numel].view(n, lay.row_numel)
            if n and g is not None:
                mine.add_(g[rank * lay.chunk : rank * lay.chunk + n])
            if n < lay.chunk:  # padding rows
                out[off + n * lay.row_numel : off + lay.padded_numel].zero_()

    return _Exchange(works, then, keep=(grads, land, zeros))


class Gathered:
    """An in-flight bucketed all-gather; :meth:`wait` returns the full tensors.

    Either a collective into one flat byte buffer, copied out into the full tensors when
    done, or (gloo) a direct exchange that already writes into them.
    """

    def __init__(self, work, buf, layouts, dtypes, plan, device, into=None, fulls=None):
        self._work, self._buf, self._layouts = work, buf, layouts
        self._dtypes, self._plan, self._device = dtypes, plan, device
        self._into, self._fulls = into, fulls

    def wait(self) -> list[torch.Tensor]:
        """Finish the gather; return full tensors in ``layouts`` order (views ``[:rows]`` of
        the padded tensors ``into`` gave, if it was given)."""
        if self._work is not None:
            with watch("all-gather", None):
                self._work.wait()
            self._work = None
        layouts, dtypes = self._layouts, self._dtypes
        padded = self._fulls
        if padded is None:  # a flat buffer: copy out
            padded = self._into() if self._into is not None else [
                torch.empty((lay.world * lay.chunk, *lay.shape[1:]), dtype=dt,
                            device=self._device) for lay, dt in zip(layouts, dtypes)]
            order, sizes, total, pad = self._plan
            if order:
                views = [padded[i].view(layouts[i].world, -1).view(torch.uint8) for i in order]
                src = self._buf.view(layouts[order[0]].world, total + pad)[:, :total]
                torch.split_with_sizes_copy(src, sizes, dim=1, out=views)
        self._buf = self._fulls = self._into = None
        return [p if p.shape[0] == lay.rows else p[: lay.rows]
                for p, lay in zip(padded, layouts)]


def all_gather(
    layouts: Sequence[Layout],
    shards: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    async_op: bool = False,
    into: Callable[[], Sequence[torch.Tensor]] | None = None,
) -> Gathered:
    """One all-gather on ``"shard"`` for all ``shards`` (sharded leaves only).

    Args:
        layouts: one :class:`Layout` per shard, all ``sharded``.
        shards: the local shards (``layout.local_shape``).
        mesh: their mesh.
        dtypes: gather dtype per leaf (mixed precision casts before the gather).
        async_op: return before the collective completes; ``wait()`` finishes it.
        into: returns the padded full tensors (``(world * chunk, *shape[1:])``) to fill
            instead of new ones; called when they are first written: at once for a direct
            exchange, at ``wait()`` for a collective.
    Returns:
        a :class:`Gathered`; ``.wait()`` -> full tensors in ``layouts`` order.
    """
    dtypes = list(dtypes) if dtypes is not None else [s.dtype for s in shards]
    device = shards[0].device if shards else torch.device(mesh.device_type)
    plan = _byte_plan(layouts, dtypes)
    order, sizes, total, pad = plan
    if not order:
        return Gathered(None, None, layouts, dtypes, plan, device, into)
    world, rank = layouts[order[0]].world, layouts[order[0]].rank
    shard_pg = _groups(mesh)[0] if world > 1 else None
    if world > 1 and _direct(shard_pg, shards[order[0]]):
        with watch("all-gather", mesh, SHARD):
            work, fulls = _exchange_gather(layouts, shards, dtypes, plan, shard_pg, into, device)
        if not async_op:
            with watch("all-gather", mesh, SHARD):
                work.wait()
        return Gathered(work if async_op else None, None, layouts, dtypes, plan, device,
                        fulls=fulls)
    # In place: this rank's input is its own segment of the output, so no separate input
    # buffer lives while the gather is in flight.
    out = torch.empty(world * (total + pad), dtype=torch.uint8, device=device)
    inp = out.view(world, -1)[rank]
    dst, src = [], []
    offset = 0
    for i, size in zip(order, sizes):
        lay, s = layouts[i], shards[i]
        n = lay.local_rows * lay.row_numel
        if n:
            dst.append(inp[offset : offset + n * dtypes[i].itemsize].view(dtypes[i]))
            src.append(s.reshape(-1))
        offset += size
    if dst:
        torch._foreach_copy_(dst, src)  # casts to the gather dtype on the way in
    if world == 1:  # nothing to gather
        return Gathered(None, out, layouts, dtypes, plan, device, into)
    with watch("all-gather", mesh, SHARD):
        work = dist.all_gather_single(out, inp, group=shard_pg, async_op=async_op)
    return Gathered(work if async_op else None, out, layouts, dtypes, plan, device, into)


def _exchange_gather(layouts, shards, dtypes, plan, pg, into, device):
    """Post a direct all-gather: this rank's rows into its own full tensors, then every
    leaf's rows to and from every peer. -> (the exchange, the padded full tensors)."""
    world, rank = pg.size(), pg.rank()
    order, _, total, pad = plan
    padded = list(into()) if into is not None else [
        torch.empty((lay.world * lay.chunk, *lay.shape[1:]), dtype=dt, device=device)
        for lay, dt in zip(layouts, dtypes)]
    own = [p[lay.start : lay.start + lay.local_rows] for p, lay in zip(padded, layouts)]
    have = [i for i in order if layouts[i].local_rows]
    if have:  # casts to the gather dtype on the way in
        torch._foreach_copy_([own[i] for i in have], [shards[i] for i in have])
    nbytes = world * (total + pad)
    _announce("all_gather", padded[order[0]], nbytes, nbytes)
    tag, works = DIRECT_TAGS["all_gather"], []
    for peer in range(world):
        if peer == rank:
            continue
        for i in order:
            lay = layouts[i]
            if lay.local_rows:
                works.append(pg.send([own[i]], peer, tag))
            n = _rows_on(lay, peer)
            if n:
                works.append(pg.recv([padded[i][peer * lay.chunk : peer * lay.chunk + n]],
                                     peer, tag))
    return _Exchange(works, keep=(padded,)), padded


def reduce_scatter(
    layouts: Sequence[Layout],
    grads: Sequence[torch.Tensor | None],
    mesh: DeviceMesh,
    *,
    reduce_dtype: torch.dtype | None = None,
    op: str = "mean",
    copy: bool = True,
    async_op: bool = False,
) -> list[torch.Tensor | None] | Reducing:
    """Full per-rank gradients -> local shards of their mean (or sum) over all mesh ranks.

    Sharded leaves are reduce-scattered on ``"shard"``, replicated ones all-reduced on
    ``"shard"``; on a 2-D mesh all results are then all-reduced once on ``"replicate"``.
    One collective of each kind per reduce dtype. A ``None`` gradient counts as zeros
    (every rank must take part in the collective); its leaf's result is still returned.

    Args:
        layouts: one :class:`Layout` per gradient.
        grads: full-shape gradients, same order (they may be freed once this returns).
        mesh: the mesh of the leaves.
        reduce_dtype: dtype to reduce in (default: each gradient's own); results come back
            in the leaf's dtype.
        op: ``"mean"`` (divide by the number of mesh ranks) or ``"sum"``.
        copy: False lets a world of one return ``grads`` themselves (no communication and
            no copy); results may then alias the inputs.
        async_op: return a :class:`Reducing` once the reduce-scatter is launched;
            ``wait()`` finishes it (and the "replicate" all-reduce of a 2-D mesh).
    Returns:
        local gradient shards (``layout.local_shape``), ``layouts`` order.
    """
    dtypes = [reduce_dtype or (g.dtype if g is not None else lay.dtype)
              for lay, g in zip(layouts, grads)]
    bucket = GradBucket(layouts, mesh, dtypes, op=op, alias=not copy)
    for k, g in enumerate(grads):
        if g is not None:
            bucket.put(k, g)
    pending = bucket.launch()
    return pending if async_op else pending.wait()


class GradBucket:
    """Full-size gradients of some leaves, laid out for one reduction, filled one at a time.

    ``put(k, grad)`` copies (or adds) leaf ``k``'s gradient into place as soon as autograd
    has it, so the gradient itself can be freed at once; ``launch()`` starts one
    reduce-scatter on ``"shard"`` for the sharded leaves and one all-reduce for the
    replicated ones, per reduce dtype. A leaf never put counts as zeros. Buffers are
    allocated on the first ``put``.

    Args:
        layouts: one :class:`Layout` per leaf.
        mesh: their mesh.
        dtypes: the dtype each leaf is reduced in.
        op: ``"mean"`` or ``"sum"`` over all mesh ranks.
        alias: on a world of one (nothing to reduce) keep the first gradient put itself
            instead of a copy; results may then alias it.
        borrow: where the bucket moves by a direct exchange (gloo), keep each sharded
            leaf's gradient itself (no copy into a flat buffer) and send its rows from it;
            the caller must not change a gradient after putting it.
    """

    def __init__(self, layouts: Sequence[Layout], mesh: DeviceMesh,
                 dtypes: Sequence[torch.dtype], *, op: str = "mean", alias: bool = False,
                 borrow: bool = False):
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        self.layouts, self.mesh, self.dtypes = list(layouts), mesh, list(dtypes)
        self.device = torch.device(mesh.device_type)
        self.world = mesh.size()
        self.divide = self.world if op == "mean" else 1
        self.alias = alias
        if self.world == 1:  # nothing to reduce: keep each gradient as it comes
            self.direct: list[torch.Tensor | None] = [None] * len(self.layouts)
            return
        self.parts: dict[torch.dtype, _Part] = {}
        self.where: list[tuple[_Part, int]] = []
        borrow = borrow and _direct(_groups(mesh)[0], torch.empty(0, device=self.device))
        for k, (lay, rdt) in enumerate(zip(self.layouts, self.dtypes)):
            part = (self.parts.get(rdt)
                    or self.parts.setdefault(rdt, _Part(rdt, self.device, borrow)))
            self.where.append((part, part.add(lay)))

    def put(self, k: int, grad: torch.Tensor, *, add: bool = False) -> None:
        """Leaf ``k``'s full gradient; ``add`` sums it with one put before (else: replace)."""
        lay = self.layouts[k]
        if tuple(grad.shape) != tuple(lay.shape):
            raise ValueError(f"gradient of {lay.path!r} has shape {tuple(grad.shape)}, expected "
                             f"{tuple(lay.shape)} on {mesh_str(self.mesh)}")
        if self.world == 1:
            g = grad.to(self.dtypes[k], copy=not self.alias)
            d = self.direct[k]
            self.direct[k] = d.add_(g) if add and d is not None else g
            return
        part, j = self.where[k]
        part.put(j, grad, first=not (add and part.filled[j]))

    def launch(self) -> Reducing:
        """Start the reduction of everything put (zeros for the rest)."""
        if self.world == 1:
            out = [torch.zeros(lay.shape, dtype=lay.dtype, device=self.device) if g is None
                   else g.to(lay.dtype) for lay, g in zip(self.layouts, self.direct)]
            return Reducing([], out, self.layouts)
        shard_pg, rep_pg = _groups(self.mesh)
        parts = []
        for part in self.parts.values():
            idx = [k for k, (p, _) in enumerate(self.where) if p is part]
            parts.append((idx, part.launch(shard_pg, rep_pg, self.divide)))
        self.parts = {}
        return Reducing(parts, None, self.layouts)


class _Part:
    """One reduce dtype of a :class:`GradBucket`: a (world, seg) reduce-scatter input for the
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
        self.filled: list[bool] = []

    def add(self, lay: Layout) -> int:
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
        return len(self.layouts) - 1

    def _region(self, j: int) -> torch.Tensor:
        """Leaf ``j``'s place: (world, chunk, row_numel) of the input, or its flat slice."""
        lay, off = self.layouts[j], self.offsets[j]
        if lay.sharded:
            if self.inp is None:
                self.inp = torch.empty(lay.world, self.seg, dtype=self.rdt, device=self.device)
            return self.inp[:, off : off + lay.padded_numel].view(lay.world, lay.chunk,
                                                                  lay.row_numel)
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
        rows, c = lay.rows, lay.chunk
        if not dst.numel():
            return
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

    def launch(self, shard_pg, rep_pg, divide) -> _ReduceOne:
        for j, lay in enumerate(self.layouts):
            if lay.sharded and self.kept is not None:
                continue  # a leaf never put sends zeros
            if not self.filled[j] and (self.seg if lay.sharded else self.flat_numel):
                self._region(j).zero_()  # never put: zeros (every rank takes part)
        return _ReduceOne(self.layouts, self.offsets, self.inp, self.flat, shard_pg, rep_pg,
                          self.rdt, self.device, divide, self.kept if self.seg else None)


class Reducing:
    """An in-flight bucketed gradient reduction; :meth:`wait` returns the local shards.

    On a 2-D mesh it has two stages: the reduce-scatter on ``"shard"``, then the all-reduce on
    ``"replicate"`` of its result. :meth:`advance` finishes the first and launches the second
    without waiting for it, so a caller can overlap both with compute.
    """

    def __init__(self, parts, done, layouts):
        self._parts, self._done, self._layouts = parts, done, layouts

    def advance(self) -> None:
        """Finish the reduce-scatter; start the "replicate" all-reduce (if any), async."""
        for _, part in self._parts:
            part.advance()

    def wait(self) -> list[torch.Tensor | None]:
        if self._done is None:
            out: list[torch.Tensor | None] = [None] * len(self._layouts)
            for idx, part in self._parts:
                for i, p in zip(idx, part.wait()):
                    out[i] = p.to(self._layouts[i].dtype)
            self._done, self._parts = out, []
        return self._done


class _ReduceOne:
    """One reduce dtype's collectives: launched on construction, finished by ``wait``."""

    def __init__(self, layouts, offsets, inp, flat, shard_pg, rep_pg, rdt, device, divide,
                 kept=None):
        self.layouts, self.rep_pg, self.rdt, self.device = layouts, rep_pg, rdt, device
        self.divide = divide
        self.works, self.pieces = [], []
        self.results: list[torch.Tensor] = [None] * len(layouts)  # type: ignore[list-item]
        seg = sum(lay.padded_numel for lay in layouts if lay.sharded)
        if kept is not None or (inp is not None and inp.numel()):
            if kept is not None:  # borrowed gradients: a direct exchange from them
                rs = torch.empty(seg, dtype=rdt, device=device)
                with watch("reduce-scatter", None, SHARD):
                    self.works.append(("reduce-scatter", _start_reduce_scatter_leaves(
                        rs, kept, layouts, offsets, shard_pg)))
            elif inp.shape[0] > 1:
                rs = torch.empty(inp.shape[1], dtype=rdt, device=device)
                with watch("reduce-scatter", None, SHARD):
                    self.works.append(("reduce-scatter", _start_reduce_scatter(rs, inp, shard_pg)))
            else:
                rs = inp.view(-1)
            for k, lay in enumerate(layouts):
                if lay.sharded and lay.local_rows * lay.row_numel:
                    n = lay.local_rows * lay.row_numel
                    self.results[k] = rs[offsets[k] : offsets[k] + n].view(lay.local_shape)
            self.pieces.append(rs)
        if flat is not None and flat.numel():
            if dist.get_world_size(shard_pg) > 1:
                with watch("all-reduce", None, SHARD):
                    self.works.append(("all-reduce", dist.all_reduce(flat, group=shard_pg,
                                                                     async_op=True)))
            for k, lay in enumerate(layouts):
                if not lay.sharded and math.prod(lay.shape):
                    n = math.prod(lay.shape)
                    self.results[k] = flat[offsets[k] : offsets[k] + n].view(lay.shape)
            self.pieces.append(flat)

    def advance(self) -> None:
        if self.works is None:  # advanced before
            return
        for kind, work in self.works:
            with watch(kind, None, SHARD):
                work.wait()
        self.works = None
        pieces, rep_pg = self.pieces, self.rep_pg
        self.both = None
        if rep_pg is not None and pieces and dist.get_world_size(rep_pg) > 1:
            # one all-reduce for both kinds: a concatenation, copied back when done
            self.both = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            with watch("all-reduce", None, REPLICATE):
                self.rep_work = dist.all_reduce(self.both, group=rep_pg, async_op=True)

    def wait(self) -> list[torch.Tensor]:
        self.advance()
        pieces = self.pieces
        if self.both is not None:
            with watch("all-reduce", None, REPLICATE):
                self.rep_work.wait()
            if len(pieces) > 1:
                torch._foreach_copy_(pieces, list(self.both.split([p.numel() for p in pieces])))
            self.both = self.rep_work = None
        if self.divide != 1 and pieces:  # the mean: one division per flat buffer, not per leaf
            torch._foreach_div_(pieces, self.divide)
        for k, lay in enumerate(self.layouts):
            if self.results[k] is None:  # no elements
                self.results[k] = torch.zeros(lay.local_shape, dtype=self.rdt, device=self.device)
        return self.results


class _Unshard(torch.autograd.Function):
    """Shards -> full tensors; backward: full grads -> reduced local shard grads."""

    @staticmethod
    def forward(ctx, layouts, mesh, dtypes, reduce_dtype, *shards):
        ctx.layouts, ctx.mesh, ctx.reduce_dtype = layouts, mesh, reduce_dtype
        ctx.set_materialize_grads(False)
        gathered = [k for k, lay in enumerate(layouts) if lay.sharded]
        full = list(shards)
        if gathered:
            got = all_gather(
                [layouts[k] for k in gathered],
                [shards[k] for k in gathered],
                mesh,
                dtypes=[dtypes[k] for k in gathered],
            ).wait()
            for k, g in zip(gathered, got):
                full[k] = g
        for k, lay in enumerate(layouts):
            if not lay.sharded:  # replicated: a fresh tensor, cast like the rest
                full[k] = shards[k].to(dtypes[k], copy=True)
        return tuple(full)

    @staticmethod
    def backward(ctx, *grads):
        need = [k for k, flag in enumerate(ctx.needs_input_grad[4:]) if flag]
        res = [None] * len(ctx.layouts)
        if need:
            got = reduce_scatter(
                [ctx.layouts[k] for k in need],
                [grads[k] for k in need],
                ctx.mesh,
                reduce_dtype=ctx.reduce_dtype,
            )
            for k, g in zip(need, got):
                res[k] = g
        return (None, None, None, None, *res)


def unshard_leaves(
    layouts: Sequence[Layout],
    shards: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Differentiable bucketed gather of local shards (autograd sees one node)."""
    dtypes = [
        param_dtype if (param_dtype is not None and s.is_floating_point()) else s.dtype
        for s in shards
    ]
    return list(_Unshard.apply(tuple(layouts), mesh, tuple(dtypes), reduce_dtype, *shards))


def as_dtensor(local: torch.Tensor, like: DTensor, *, requires_grad: bool = False) -> DTensor:
    """Wrap a local shard with ``like``'s mesh, placements and global shape (no comms)."""
    out = DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
        stride=like.stride(),
    )
    return out.requires_grad_(requires_grad) if requires_grad else out


def describe(tree, *, what: str):
    """Validate a tree of DTensors; return (mesh, paths, leaves, layouts, spec).

    Every leaf must be a DTensor on one mesh with funshard placements.
    """
    paths, leaves, spec = pytree.flatten_with_path(tree)
    mesh = None
    first = None
    layouts = []
    for p, leaf in zip(paths, leaves):
        name = pytree.fqn(p)
        if not isinstance(leaf, DTensor):
            shape = f" of shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else ""
            raise TypeError(
                f"{what}: leaf {name!r}{shape} is a {type(leaf).__name__}, expected a DTensor "
                f"(a sharded leaf from fs.shard). Shard the tree first: fs.shard(tree, mesh)."
            )
        if mesh is None:
            mesh, first = leaf.device_mesh, name
        elif leaf.device_mesh != mesh:
            raise ValueError(
                f"{what}: leaves {first!r} and {name!r} (shape {tuple(leaf.shape)}) are on "
                f"different meshes, {mesh_str(mesh)} and {mesh_str(leaf.device_mesh)}; one call "
                "works on one mesh. Split the tree by mesh, or shard both on the same mesh."
            )
        layouts.append(layout_of(name, leaf))
    return mesh, paths, leaves, layouts, spec


def reduce_grads(local_grads, like, *, op: str = "mean", reduce_dtype: torch.dtype | None = None):
    """Per-rank full-shape gradients -> shards of their mean (or sum) over all mesh ranks.

    Args:
        local_grads: tree of full-shape tensors (or None), ``like``'s structure.
        like: the sharded tree (DTensors) whose placements the result takes.
        op: ``"mean"`` (default) or ``"sum"`` over data-parallel ranks.
        reduce_dtype: reduce in this dtype (e.g. float32 for bf16 grads).
    Returns:
        tree of DTensor gradient shards (None where the gradient was None).

    Example: on 2 ranks, ``g`` of shape (7, 3) -> DTensor (7, 3), local (4, 3) / (3, 3).
    """
    mesh, paths, likes, layouts, spec = describe(like, what="reduce_grads")
    gl = pytree.leaves_like(local_grads, like, names=("local_grads", "like"))
    for lay, g in zip(layouts, gl):
        if g is not None and tuple(g.shape) != tuple(lay.shape):
            raise ValueError(
                f"reduce_grads: gradient {lay.path!r} has shape {tuple(g.shape)} but the "
                f"parameter has global shape {tuple(lay.shape)} on {mesh_str(mesh)}; pass "
                "full-shape per-rank gradients (not local shards)."
            )
    present = [k for k, g in enumerate(gl) if g is not None]
    got = reduce_scatter(
        [layouts[k] for k in present], [gl[k] for k in present], mesh,
        reduce_dtype=reduce_dtype, op=op,
    ) if mesh is not None else []
    out = [None] * len(gl)
    for k, g in zip(present, got):
        out[k] = as_dtensor(g, likes[k])
    return pytree.unflatten(spec, out)
