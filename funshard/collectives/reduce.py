"""Bucketed gradient reduction: one reduce-scatter on ``"shard"`` (and one all-reduce of
replicated leaves) per reduce dtype, then one all-reduce on ``"replicate"`` (2-D meshes).

A :class:`GradBucket` is filled one gradient at a time as autograd produces them and
launched once; :class:`Reducing` is the reduction in flight.

    >>> (g_local,) = reduce_scatter(layouts, [grad_full], mesh)     # (3, 3) on rank 0 of 3
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import _compat
from ..layout import Layout
from ..mesh import REPLICATE, SHARD, data_size, mesh_device, mesh_str, process_groups
from .base import skips, watch
from .gather import choose
from .parts import Part, flush


def reduce_scatter(
    layouts: Sequence[Layout],
    grads: Sequence[torch.Tensor | None],
    mesh: DeviceMesh,
    *,
    reduce_dtype: torch.dtype | None = None,
    op: str = "mean",
    copy: bool = True,
    async_op: bool = False,
    transport: str = "c10d",
    spreads: Sequence[tuple[str, ...]] | None = None,
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
        transport: ``"c10d"`` (default), ``"p2p"`` or ``"cma"`` (see
            :mod:`funshard.collectives.base`).
        spreads: per gradient, the model's own mesh dimensions whose ranks computed on
            other rows (``"ep"``) and hold the same leaf: its result is all-reduced over them
            too (one such spread, or none, per call); default: none.
    Returns:
        local gradient shards (``layout.local_shape``), ``layouts`` order.
    """
    dtypes = [reduce_dtype or (g.dtype if g is not None else lay.dtype)
              for lay, g in zip(layouts, grads)]
    device = next((g.device for g in grads if g is not None), None)
    bucket = GradBucket(layouts, mesh, dtypes, op=op, alias=not copy, transport=transport,
                        device=device, spreads=spreads)
    for k, g in enumerate(grads):
        if g is not None:
            bucket.put(k, g)
    pending = bucket.launch()
    return pending if async_op else pending.wait()


def dense(grad: torch.Tensor) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) made dense: the reductions and the
    optimizers are dense, so it trains as ``sparse=False`` does."""
    return grad.to_dense() if grad.layout != torch.strided else grad


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
        borrow: where the transport can (``"p2p"``, ``"cma"``), keep each sharded leaf's gradient
            itself (no copy into a flat buffer) and send its rows from it; the caller must
            not change a gradient after putting it.
        transport: ``"c10d"`` (default), ``"p2p"`` or ``"cma"``.
        device: where the buffers and results live: the gradients' device (default: this
            rank's device of the mesh).
        spreads: as :func:`reduce_scatter`'s (experts and the rest in one bucket): the
            leaves with a spread come first in each reduction, whose result's prefix is then
            all-reduced over it.
    """

    def __init__(self, layouts: Sequence[Layout], mesh: DeviceMesh,
                 dtypes: Sequence[torch.dtype], *, op: str = "mean", alias: bool = False,
                 borrow: bool = False, transport: str = "c10d",
                 device: torch.device | None = None,
                 spreads: Sequence[tuple[str, ...]] | None = None):
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        self.layouts, self.mesh, self.dtypes = list(layouts), mesh, list(dtypes)
        self.spreads = list(spreads) if spreads is not None else [()] * len(self.layouts)
        self.device = device if device is not None else mesh_device(mesh)
        self.world = data_size(mesh)  # the model's own dimensions hold other parts
        self.divide = self.world if op == "mean" else 1
        self.alias = alias
        self.skip = skips(self.world)
        if self.skip:  # nothing to reduce: keep each gradient as it comes
            self.direct: list[torch.Tensor | None] = [None] * len(self.layouts)
            return
        shard_pg, _ = process_groups(mesh)
        with watch("reduce-scatter", mesh, SHARD):  # the first choice is a handshake
            self.transport = choose(transport, shard_pg, self.device)
        borrow = borrow and self.transport.borrows
        self.parts: dict[torch.dtype, Part] = {}
        self.where: list[tuple[Part, int] | None] = [None] * len(self.layouts)
        # leaves with a spread first: their part of each reduction is a prefix, all-reduced
        # over the spread's dimensions after the one reduce-scatter of them all
        for k in sorted(range(len(self.layouts)), key=lambda k: not self.spreads[k]):
            rdt = self.dtypes[k]
            part = (self.parts.get(rdt)
                    or self.parts.setdefault(rdt, Part(rdt, self.device, borrow)))
            self.where[k] = (part, part.add(self.layouts[k], self.spreads[k]))

    def _checked(self, k: int, grad: torch.Tensor) -> torch.Tensor:
        """Leaf ``k``'s gradient, dense, refused unless in the leaf's shape."""
        lay = self.layouts[k]
        grad = dense(grad)
        if grad.shape != lay.shape:  # a torch.Size is a tuple
            raise ValueError(f"gradient of {lay.path!r} has shape {tuple(grad.shape)}, expected "
                             f"{tuple(lay.shape)} on {mesh_str(self.mesh)}")
        return grad

    def put_all(self, grads: Sequence[tuple[int, torch.Tensor]], *, add: bool = False) -> None:
        """:meth:`put` of each ``(k, grad)``. The first gradients of sharded leaves whose rows
        split evenly over the ranks go into place in one ``foreach`` copy per reduce dtype (a
        leaf's rows are its ranks' chunks in order: one reshape), not one copy each."""
        if self.skip:
            for k, grad in grads:
                self.put(k, grad, add=add)
            return
        even: dict[Part, tuple[list, list]] = {}
        for k, grad in grads:
            grad = self._checked(k, grad)
            part, j = self.where[k]
            lay, first = self.layouts[k], not (add and part.filled[j])
            if (first and part.kept is None and lay.sharded and lay.padded_numel
                    and lay.rows == lay.world * lay.chunk):
                part.filled[j] = True
                dsts, srcs = even.setdefault(part, ([], []))
                dsts.append(part.columns()[j])
                srcs.append(grad.reshape(lay.world, -1))
            else:
                flush(even)  # (a leaf twice in one call: its copy before its sum)
                part.put(j, grad, first)
        flush(even)

    def put(self, k: int, grad: torch.Tensor, *, add: bool = False) -> None:
        """Leaf ``k``'s full gradient; ``add`` sums it with one put before (else: replace).
        A sparse one is made dense (:func:`dense`)."""
        grad = self._checked(k, grad)
        if self.skip:
            d = self.direct[k]
            if add and d is not None:  # rounded once, as a reduce buffer adds (see Part.put)
                d.add_(grad)
            else:
                self.direct[k] = grad.to(self.dtypes[k], copy=not self.alias)
            return
        part, j = self.where[k]
        part.put(j, grad, first=not (add and part.filled[j]))

    def launch(self) -> Reducing:
        """Start the reduction of everything put (zeros for the rest)."""
        if self.skip:
            out = [torch.zeros(lay.shape, dtype=lay.dtype, device=self.device) if g is None
                   else g.to(lay.dtype) for lay, g in zip(self.layouts, self.direct)]
            return Reducing([], out, self.layouts)
        shard_pg, rep_pg = process_groups(self.mesh)
        parts = []
        reps = ([(REPLICATE, rep_pg)] if rep_pg is not None
                and not skips(dist.get_world_size(rep_pg)) else [])
        for part in self.parts.values():
            spread = [(n, pg) for n, pg in ((n, self.mesh.get_group(n)) for n in part.spread)
                      if not skips(dist.get_world_size(pg))]
            idx = [k for _, k in sorted((j, k) for k, (p, j) in enumerate(self.where)
                                        if p is part)]
            parts.append((idx, part.launch(shard_pg, reps, spread, self.divide,
                                           self.transport)))
        self.parts = {}
        return Reducing(parts, None, self.layouts)


class Reducing:
    """An in-flight bucketed gradient reduction; :meth:`wait` returns the local shards.

    On a 2-D mesh it has two stages: the reduce-scatter on ``"shard"``, then the all-reduce on
    ``"replicate"`` of its result. :meth:`finish_reduce_scatter` finishes the first and
    launches the second without waiting for it, so a caller can overlap both with compute.
    """

    def __init__(self, parts, done, layouts):
        self._parts, self._done, self._layouts = parts, done, layouts

    def finish_reduce_scatter(self) -> None:
        """Finish the reduce-scatter; start the "replicate" all-reduce (if any), async."""
        for _, part in self._parts:
            part.finish_reduce_scatter()

    def wait(self) -> list[torch.Tensor | None]:
        if self._done is None:
            out: list[torch.Tensor | None] = [None] * len(self._layouts)
            cast: tuple[list, list] = ([], [])  # (new tensors, results) in other dtypes
            for idx, part in self._parts:
                for i, p in zip(idx, part.wait()):
                    dt = self._layouts[i].dtype
                    if p.dtype == dt:
                        out[i] = p
                    else:  # into the leaf's dtype: one foreach copy for them all
                        out[i] = torch.empty_like(p, dtype=dt)
                        cast[0].append(out[i])
                        cast[1].append(p)
            if cast[0]:
                _compat.foreach_copy_(*cast)
            self._done, self._parts = out, []
        return self._done
