"""Where a leaf's shard sits in its global tensor, and how buckets of leaves are laid out.

This is the one place for shapes, ``torch.chunk`` padding, compute dtypes and the 16-byte
alignment of flat buffers: the step, the transports, ``fs.plan`` and the state dicts all
read them from here.

    >>> lay = Layout("w", torch.Size([7, 3]), torch.float32, True, world=3, rank=2)
    >>> lay.chunk, lay.start, lay.local_rows, lay.padded_numel   # (3, 6, 1, 9)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import _compat, pytree
from .mesh import SHARD, mesh_str, shard_dim

ALIGN = 16  # bytes; every rank's segment of a flat byte buffer is a multiple of this


class _Fields(NamedTuple):
    path: str
    shape: torch.Size  # global shape
    dtype: torch.dtype
    sharded: bool  # Shard(0) on "shard"; else replicated everywhere
    world: int  # size of the "shard" mesh dimension
    rank: int  # this rank's coordinate on "shard"


class Layout(_Fields):
    """Where one leaf's local shard sits in its global tensor (uneven dim 0 included).

    A tuple of its six fields; what follows from them is computed once per layout and kept
    (the step and the transports read these thousands of times per step)."""

    @functools.cached_property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @functools.cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @functools.cached_property
    def chunk(self) -> int:
        """Rows per rank, padded: ``ceil(rows / world)``, as ``torch.chunk`` splits."""
        return -(-self.rows // self.world) if self.sharded else self.rows

    @functools.cached_property
    def start(self) -> int:
        return min(self.rows, self.rank * self.chunk) if self.sharded else 0

    @functools.cached_property
    def local_rows(self) -> int:
        if not self.sharded:
            return self.rows
        return min(self.rows, (self.rank + 1) * self.chunk) - self.start

    @functools.cached_property
    def local_shape(self) -> torch.Size:
        if not self.shape:
            return self.shape
        return torch.Size((self.local_rows, *self.shape[1:]))

    @functools.cached_property
    def padded_numel(self) -> int:
        """Elements of one rank's (padded) chunk."""
        return self.chunk * self.row_numel

    @functools.cached_property
    def padded_shape(self) -> tuple[int, ...]:
        """Shape of the padded full tensor a gather writes: ``(world * chunk, *shape[1:])``."""
        return (self.world * self.chunk, *self.shape[1:])

    def rows_on(self, rank: int) -> int:
        """Rows that rank ``rank`` of ``"shard"`` holds."""
        return max(0, min(self.rows, (rank + 1) * self.chunk) - rank * self.chunk)

    def full_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the padded full tensor in ``dtype``."""
        return self.world * self.padded_numel * dtype.itemsize


def compute_dtype(dtype: torch.dtype, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a leaf of ``dtype`` computes in: ``param_dtype`` for floating leaves."""
    return param_dtype if (param_dtype is not None and dtype.is_floating_point) else dtype


def check_float_dtype(dt, where: str) -> None:
    """A compute or reduce dtype must be a floating torch.dtype (or None): casting parameters
    or gradients to an integer dtype would truncate them silently."""
    if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
        raise ValueError(f"{where}={dt!r} must be a floating torch.dtype (e.g. torch.bfloat16) "
                         "or None")


class BytePlan(NamedTuple):
    """One rank's segment of a flat all-gather buffer: leaves widest dtype first (so every
    leaf is aligned), their padded byte sizes, and the segment padded to :data:`ALIGN`."""

    order: list[int]  # leaves with elements, widest dtype first
    sizes: list[int]  # their padded chunk bytes
    total: int  # sum of sizes
    pad: int  # bytes after total, to the alignment

    @property
    def segment(self) -> int:
        return self.total + self.pad


def byte_plan(layouts: Sequence[Layout], dtypes: Sequence[torch.dtype]) -> BytePlan:
    order = sorted((i for i, lay in enumerate(layouts) if lay.padded_numel > 0),
                   key=lambda i: -dtypes[i].itemsize)
    sizes = [layouts[i].padded_numel * dtypes[i].itemsize for i in order]
    total = sum(sizes)
    return BytePlan(order, sizes, total, -total % ALIGN)


def gather_bytes(layouts: Sequence[Layout], dtypes: Sequence[torch.dtype]) -> int:
    """Output bytes of one bucketed all-gather of ``layouts`` (0 when nothing moves)."""
    bp = byte_plan(layouts, dtypes)
    return layouts[bp.order[0]].world * bp.segment if bp.order else 0


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


def as_dtensor(local: torch.Tensor, like: DTensor, *, requires_grad: bool = False) -> DTensor:
    """Wrap a local shard with ``like``'s mesh, placements and global shape (no comms)."""
    out = DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
        stride=like.stride(),
    )
    return out.requires_grad_(requires_grad) if requires_grad else out


def _functorch_wrapped(t: torch.Tensor) -> bool:
    """``t`` is a torch.func transform's wrapper (of a shard, here)."""
    check = _compat.functorch_wrapped
    return bool(check is not None and check(t))


def transforms_active() -> bool:
    """A torch.func transform (vmap, grad, jvp, ...) is running around this call."""
    peek = _compat.peek_interpreter_stack
    return peek is not None and peek() is not None


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
        if isinstance(leaf, torch.Tensor) and _functorch_wrapped(leaf):
            raise NotImplementedError(
                f"{what}: leaf {name!r} (shape {tuple(leaf.shape)}) is a sharded parameter "
                "inside a torch.func transform over it (grad, vjp, jvp, vmap, jacrev, ...): "
                "the transforms do not reach through DTensor shards and collectives. Transform "
                "a function of the full parameters instead: full = fs.unshard(sparams); "
                "grads = torch.func.grad(f)(full); then fs.reduce_grads(grads, like=sparams) "
                "gives the sharded mean gradient."
            )
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
