"""Where a leaf's shard sits in its global tensor, and how buckets of leaves are laid out.

This is the one place for shapes, ``torch.chunk`` padding, compute dtypes and the 16-byte
alignment of flat buffers: the step, the transports, ``fs.plan`` and the state dicts all
read them from here.

    >>> lay = Layout("w", torch.Size([7, 3]), torch.float32, True, world=3, rank=2)
    >>> lay.chunk, lay.start, lay.local_rows, lay.padded_numel   # (3, 6, 1, 9)

A leaf the model places on its own mesh dimensions too is laid out over its part there
(:class:`Model`; [Note: the model's own dimensions] in :mod:`funshard.mesh`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import _compat, pytree
from .mesh import REPLICATE, SHARD, SPLITS, mesh_str, model_dims, shard_dim, submesh

ALIGN = 16  # bytes; every rank's segment of a flat byte buffer is a multiple of this


class Model(NamedTuple):
    """How the model places a leaf on its own mesh dimensions (tensor parallel): what the
    model is given in place of a gathered plain tensor."""

    mesh: DeviceMesh  # the model's dimensions of the leaf's mesh (``mesh["tp"]``)
    placements: tuple  # the leaf's placements on it: Shard(d) or Replicate()
    shape: torch.Size  # the leaf's global shape
    stride: tuple  # its global stride
    pieces: int  # how many distinct parts the model's placements cut the leaf into


class _Fields(NamedTuple):
    path: str
    shape: torch.Size  # the shape gathered over "shard": global, or the model's local part
    dtype: torch.dtype
    sharded: bool  # Shard(0) on "shard"; else replicated everywhere
    world: int  # size of the "shard" mesh dimension
    rank: int  # this rank's coordinate on "shard"
    model: Model | None = None  # placed by the model on its own dimensions too


class Layout(_Fields):
    """Where one leaf's local shard sits in its global tensor (uneven dim 0 included).

    A tuple of its fields; what follows from them is computed once per layout and kept
    (the step and the transports read these thousands of times per step). A leaf the model
    places on its own mesh dimensions too (:class:`Model`) is laid out over this rank's part
    of it: ``shape`` is that part's, and the gathered tensor is that part."""

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


def placements_for(mesh: DeviceMesh, ndim: int, how: str, model: tuple = ()) -> tuple:
    """Placements for a leaf of ``ndim`` dims: ``how`` is ``"shard"`` or ``"replicate"``;
    ``model``: the leaf's placements on the mesh's own dimensions, in their order."""
    sdim = shard_dim(mesh, model=True)  # the callers checked the mesh for their use
    out = [Replicate()] * (mesh.ndim - len(model)) + list(model)
    if how == SHARD and ndim > 0:
        out[sdim] = _rows(mesh, model)
    return tuple(out)


def _rows(mesh: DeviceMesh, model: tuple):
    """The placement of a leaf's rows on ``"shard"``: ``Shard(0)``, or, where the model
    shards dim 0 too, the model's split first, then funshard's (as FSDP2 places it)."""
    split = math.prod(mesh.size(mesh.ndim - len(model) + i) for i, p in enumerate(model)
                      if isinstance(p, Shard) and p.dim == 0)
    if split == 1:
        return Shard(0)
    _compat.require_strided("sharding a leaf the model shards on dim 0")
    return _compat.StridedShard(0, split_factor=split)


def model_of(mesh: DeviceMesh, placements: Sequence, shape: torch.Size, stride: tuple,
             where: str) -> Model:
    """The :class:`Model` of a leaf the model places on its own mesh (``mesh["tp"]``) as
    ``placements``; ValueError for placements funshard cannot shard further."""
    for name, p in zip(mesh.mesh_dim_names or (), placements):
        strided = _compat.StridedShard is not None and isinstance(p, _compat.StridedShard)
        if strided or not isinstance(p, (Shard, Replicate)):
            kind = "a pending reduction" if isinstance(p, Partial) else "a layout"
            raise ValueError(
                f"{where}of shape {tuple(shape)} has placement {p!r} on the model's mesh "
                f"dimension {name!r} of {mesh_str(mesh)}: {kind} funshard cannot shard further; "
                "it shards leaves the model places as Shard(d) or Replicate()."
            )
    pieces = math.prod(mesh.size(i) for i, p in enumerate(placements) if isinstance(p, Shard))
    return Model(mesh, tuple(placements), torch.Size(shape), tuple(stride), pieces)


def model_part(shape: torch.Size, model: Model) -> torch.Size:
    """This rank's part of a leaf of global ``shape`` under the model's placements (each
    ``Shard(d)`` splits as ``torch.chunk`` does, in mesh order)."""
    return model_box(shape, model)[0]


def model_box(shape: torch.Size, model: Model) -> tuple[torch.Size, tuple[int, ...]]:
    """This rank's part of a leaf of global ``shape`` under the model's placements, and
    where it starts in the global tensor (a box: one offset per dimension)."""
    out, at = list(shape), [0] * len(shape)
    for i, p in enumerate(model.placements):
        if isinstance(p, Shard):
            n, k = out[p.dim], model.mesh.size(i)
            c, chunk = model.mesh.get_local_rank(i), -(-out[p.dim] // k)
            out[p.dim] = max(0, min(n, (c + 1) * chunk) - c * chunk)
            at[p.dim] += min(n, c * chunk)
    return torch.Size(out), tuple(at)


def model_slice(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """This rank's part of a global tensor under ``lay``'s model placements (a view), or
    ``x`` for a leaf the model keeps plain."""
    if lay.model is None:
        return x
    size, at = model_box(x.shape, lay.model)
    for d, (n, a) in enumerate(zip(size, at)):
        if n != x.shape[d]:
            x = x.narrow(d, a, n)
    return x


def layout_of(path: str, t: DTensor, *, model: bool = False, what: str = "") -> Layout:
    """The :class:`Layout` of a DTensor leaf; ValueError for placements funshard can't gather.
    ``model``: the caller composes with the model's own mesh dimensions; ``what``: the
    caller, as errors name it."""
    mesh = t.device_mesh
    sdim = shard_dim(mesh, where=f"{what}: leaf {path!r}: " if what else f"leaf {path!r}: ",
                     model=model)
    names = mesh.mesh_dim_names
    own = len(model_dims(mesh))
    found = None
    # the model's placements, on its own dimensions (the last ones) but "ep" where the leaf
    # is replicated there: a leaf only replicated on "ep" is a plain tensor to the model
    spread = spread_of(t)
    kept = [i for i in range(mesh.ndim - own, mesh.ndim) if names[i] not in spread]
    if kept:
        found = model_of(submesh(mesh, tuple(names[i] for i in kept)),
                         [t.placements[i] for i in kept], t.shape, tuple(t.stride()),
                         f"leaf {path!r} ")
    sharded = False
    for i, p in enumerate(t.placements[:mesh.ndim - own]):
        rows = _rows(mesh, found.placements if found else ()) if t.ndim > 0 else None
        if i == sdim and rows is not None and type(p) is type(rows) and p == rows:
            sharded = True
        elif not isinstance(p, Replicate):
            kind = "a pending reduction" if isinstance(p, Partial) else "a layout"
            want = list(placements_for(mesh, t.ndim, SHARD, found.placements if found else ()))
            raise ValueError(
                f"leaf {path!r} of shape {tuple(t.shape)} has placement {p!r} on mesh dimension "
                f"{names[i]!r} of {mesh_str(mesh)}: {kind} funshard cannot gather. funshard "
                f"gathers {rows or Shard(0)!r} on {SHARD!r} and Replicate() on {REPLICATE!r}; "
                f"redistribute it first, e.g. t.redistribute(mesh, {want})."
            )
    shape = model_part(t.shape, found) if found else t.shape
    return Layout(path, shape, t.dtype, sharded, mesh.size(sdim), mesh.get_local_rank(sdim),
                  found)


def spread_of(t: DTensor) -> tuple[str, ...]:
    """The model's own dimensions of ``t``'s mesh whose ranks compute on other rows and all
    hold ``t`` (``"ep"`` where ``t`` is not an expert's): its gradient is averaged over them
    too."""
    return tuple(n for n, p in zip(t.device_mesh.mesh_dim_names, t.placements)
                 if n in SPLITS and isinstance(p, Replicate))


def norm_weight(lay: Layout, ranks: int) -> float:
    """Weight of a leaf's local squared norm in the sum over ``ranks`` ranks (every rank of
    the widest mesh), so that each element counts once: ``1 / copies`` of each part."""
    parts = (lay.world if lay.sharded else 1) * (lay.model.pieces if lay.model else 1)
    return parts / ranks


def as_model(full: torch.Tensor, lay: Layout) -> torch.Tensor:
    """A gathered leaf as the model takes it: a DTensor on the model's mesh for a leaf the
    model places there (differentiable, no communication), else ``full`` itself."""
    m = lay.model
    if m is None:
        return full
    return DTensor.from_local(full, m.mesh, m.placements, run_check=False, shape=m.shape,
                              stride=m.stride)


def from_model(t, lay: Layout, what: str) -> torch.Tensor:
    """The part of ``t`` (full-shape, as the model holds it) that ``lay`` gathers: its local
    tensor on the model's mesh (a pending reduction there reduced first), or ``t``."""
    m = lay.model
    if m is None:
        if isinstance(t, DTensor):
            raise TypeError(f"{what}: leaf {lay.path!r} of shape {tuple(t.shape)} is a DTensor "
                            f"on {mesh_str(t.device_mesh)}, but its parameter is a plain tensor "
                            "to the model; pass a plain tensor.")
        return t
    if not isinstance(t, DTensor) or t.device_mesh != m.mesh:
        got = (f"a DTensor on {mesh_str(t.device_mesh)}" if isinstance(t, DTensor)
               else f"a {type(t).__name__}")
        raise TypeError(
            f"{what}: leaf {lay.path!r} of shape {tuple(t.shape)} is {got}, but the model places "
            f"its parameter on {mesh_str(m.mesh)} as {m.placements}; pass a DTensor there "
            "(what the model's parameter and its gradient are).")
    if tuple(t.shape) != tuple(m.shape):
        raise ValueError(f"{what}: leaf {lay.path!r} has shape {tuple(t.shape)} but its parameter "
                         f"has global shape {tuple(m.shape)} on {mesh_str(m.mesh)}.")
    if tuple(t.placements) != m.placements:
        t = t.redistribute(m.mesh, m.placements)
    return t.to_local()


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


def describe(tree, *, what: str, model: bool = False):
    """Validate a tree of DTensors; return (mesh, paths, leaves, layouts, spec).

    Every leaf must be a DTensor on one mesh with funshard placements. ``model``: the caller
    composes with the model's own mesh dimensions: the leaves are on a mesh with them, or on
    its slice over the data-parallel ones and some of the model's (a leaf the model keeps
    plain, or places on fewer of them); the mesh returned is the widest.
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
        here = leaf.device_mesh
        if mesh is None:
            mesh, first = here, name
        elif here != mesh:
            wider = _wider(mesh, here) if model else None
            if wider is None:
                raise ValueError(
                    f"{what}: leaves {first!r} and {name!r} (shape {tuple(leaf.shape)}) are on "
                    f"different meshes, {mesh_str(mesh)} and {mesh_str(here)}; one call works "
                    "on one mesh. Split the tree by mesh, or shard both on the same mesh.")
            mesh, first = wider, (first if wider is mesh else name)
        layouts.append(layout_of(name, leaf, model=model, what=what))
    return mesh, paths, leaves, layouts, spec


def _wider(a: DeviceMesh, b: DeviceMesh) -> DeviceMesh | None:
    """Of two meshes, the one with more dimensions, if the other is its slice over some of
    them (a leaf placed on fewer of the model's dimensions); else None."""
    for wide, narrow in ((a, b), (b, a)):
        dims = tuple(narrow.mesh_dim_names or ())
        if wide.ndim > narrow.ndim and set(dims) <= set(wide.mesh_dim_names or ()):
            if submesh(wide, tuple(n for n in wide.mesh_dim_names if n in dims)) == narrow:
                return wide
    return None
