"""The shard / unshard / reshard trio.

    >>> mesh = fs.make_mesh(shard=2)               # 1-D ("shard",)
    >>> s = shard({"w": torch.randn(7, 3)}, mesh)  # DTensor (7, 3), local (4, 3) / (3, 3)
    >>> unshard(s)["w"].shape                      # torch.Size([7, 3]); differentiable
    >>> reshard(unshard(s), like=s)                # back to shards, no communication
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _compat, collectives, pytree
from .layout import (Layout, Model, as_dtensor, as_model, check_float_dtype, compute_dtype,
                     describe, from_model, local_slice, model_of, model_part, placements_for,
                     spread_of, transforms_active)
from .mesh import (DATA, REPLICATE, SHARD, SPLITS, mesh_device, mesh_str, model_dims, shard_dim,
                   submesh)

Spec = Any  # "shard" | "replicate" | prefix tree of those | callable (fqn, tensor) -> str


def _check_leaf(name: str, leaf: Any, what: str, model: DeviceMesh | None = None
                ) -> torch.Tensor:
    """``leaf`` as a full tensor: a plain one, or (``model``: the mesh's own dimensions) a
    DTensor the model placed there."""
    if isinstance(leaf, DTensor) and (model is None or leaf.device_mesh != model):
        dims = set(leaf.device_mesh.mesh_dim_names or ())
        why = ("pass full tensors (fs.unshard gives them back)" if dims <= set(DATA)
               else f"its placements {tuple(leaf.placements)} are the model's own (tensor or "
               "expert parallel, e.g. torch's parallelize_module): shard it on a mesh whose "
               "last dimensions are that mesh's, e.g. fs.make_mesh(shard=..., tp=...) with the "
               'model parallelized on mesh["tp"]')
        if model is not None:
            why = (f"the mesh's own dimensions are {mesh_str(model)}; a DTensor leaf must be "
                   "on them (the mesh the model was parallelized on)")
        raise TypeError(
            f"{what}: leaf {name!r} of shape {tuple(leaf.shape)} is already a DTensor on "
            f"{mesh_str(leaf.device_mesh)}; {why}."
        )
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"{what}: leaf {name!r} is a {type(leaf).__name__} ({leaf!r:.60}), expected a "
            "torch.Tensor; put only tensors in the tree (None is allowed as an empty node)."
        )
    return leaf


def shard(tree: Any, mesh: DeviceMesh, *, spec: Spec = SHARD) -> Any:
    """Full tensors -> DTensor shards: Shard(0) on ``"shard"``, Replicate() on ``"replicate"``.

    Every rank must pass the same values (as with ``distribute_tensor(src_data_rank=None)``);
    nothing is communicated. Uneven dim 0 splits as ``torch.chunk`` does (7 rows on 3 ranks:
    3, 3, 1). 0-d tensors are replicated. Each local shard is a copy, so the full input can be
    freed. A meta-device leaf materialises only its local shard, on the mesh's device, filled
    with NaN (floating dtypes; others uninitialised): load weights into it next
    (:func:`fs.load_state_dict`, :func:`fs.checkpoint.import_full`); a step on weights never
    loaded sees a NaN loss and refuses it.

    On a mesh with the model's own dimensions after the data-parallel ones
    (``fs.make_mesh(shard=2, tp=2)``), a leaf the model placed on them (a DTensor on
    ``mesh["tp"]``, from torch's ``parallelize_module``) keeps that placement, and its part
    on this rank is sharded over ``"shard"`` (where both split dim 0, the model's split
    first, as FSDP2 does); a plain leaf is sharded over the data-parallel dimensions alone.
    There, and only there, every rank must call it: the ranks compare each leaf's shape and
    placements (one exchange) and refuse a tree placed otherwise on some rank, by name.

    Args:
        tree: pytree of full tensors (e.g. ``fs.params(model)``).
        mesh: from :func:`make_mesh`.
        spec: ``"shard"`` / ``"replicate"`` for the whole tree, a prefix tree of them, or a
            callable ``(fqn, tensor) -> "shard" | "replicate"`` (e.g. keep norms replicated).
    Returns:
        the same tree with DTensor leaves, dtype and requires_grad kept.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    shard_dim(mesh, where="shard: ", model=True)
    own = model_dims(mesh)
    names = mesh.mesh_dim_names
    paths, leaves, tspec = pytree.flatten_with_path(tree)
    hows = pytree.broadcast_prefix(spec, tree, name="shard spec")
    if own:
        _check_agree(paths, leaves, mesh)
    device = mesh_device(mesh)
    out = []
    for p, leaf, how in zip(paths, leaves, hows):
        name = pytree.fqn(p)
        # a mesh with the model's own dimensions: a leaf the model placed on some of them
        # (a DTensor there: mesh["tp"], mesh["ep"], mesh["ep", "tp"]) goes on those and the
        # data-parallel ones; a plain one on the data-parallel ones and "ep", where it is
        # replicated (those ranks compute on other rows)
        mine = _dims_of(leaf, own)
        t = _check_leaf(name, leaf, "shard", submesh(mesh, mine) if own else None)
        if how not in (SHARD, REPLICATE):
            raise ValueError(
                f"shard: spec for leaf {name!r} (shape {tuple(t.shape)}) is {how!r}; use "
                f"{SHARD!r} or {REPLICATE!r}."
            )
        model = (model_of(t.device_mesh, t.placements, t.shape, tuple(t.stride()),
                          f"shard: leaf {name!r} ") if isinstance(t, DTensor) else None)
        keep = DATA + SPLITS + (mine if model is not None else ())
        on = submesh(mesh, tuple(n for n in names if n in keep))
        placements = placements_for(on, t.ndim, how, model.placements if model else ())
        lay = _layout(name, t, on, placements, model)
        if t.is_meta:  # only this rank's rows; NaN until loaded, so a forgotten load fails
            local = torch.empty(lay.local_shape, dtype=t.dtype, device=device)
            if local.is_floating_point() or local.is_complex():
                local.fill_(float("nan"))
        else:
            part = t.to_local() if model is not None else t
            local = local_slice(part.detach(), lay).to(device, copy=True)
            local = local.contiguous()
        d = DTensor.from_local(
            local, on, placements, run_check=False, shape=t.shape,
            stride=_global_stride(t.shape, local, on, placements),
        )
        out.append(d.requires_grad_(t.requires_grad) if t.requires_grad else d)
    return pytree.unflatten(tspec, out)


def _check_agree(paths, leaves, mesh: DeviceMesh) -> None:
    """On a mesh with the model's own dimensions, every rank must give each leaf the same
    global shape and placements (a rank that placed a leaf otherwise, or kept it plain,
    would shard another tensor than the others gather). The leaves' descriptions go round
    along each of the mesh's dimensions (which reaches every rank of the mesh and no other
    rank of the world), then whether any rank found a difference: ValueError on every rank,
    naming the first difference it saw."""
    mine = [(pytree.fqn(p), tuple(getattr(t, "shape", ())),
             (tuple(t.device_mesh.mesh_dim_names), tuple(map(repr, t.placements)))
             if isinstance(t, DTensor) else "plain") for p, t in zip(paths, leaves)]
    problem = None
    for dim in mesh.mesh_dim_names:
        group = mesh.get_group(dim)
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        for r, theirs in zip(dist.get_process_group_ranks(group), every):
            diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
            if problem is None and diff is not None:
                (a, b) = diff
                problem = (f"leaf {a[0]!r} differs between rank {dist.get_rank()} (shape "
                           f"{a[1]}, {a[2]}) and rank {r} (leaf {b[0]!r}: shape {b[1]}, {b[2]})")
            elif problem is None and len(mine) != len(theirs):
                problem = (f"rank {dist.get_rank()} passes {len(mine)} leaves, rank {r} "
                           f"{len(theirs)}")
    bad = problem is not None
    for dim in mesh.mesh_dim_names:  # an or over each dimension in turn: over the mesh
        group = mesh.get_group(dim)
        flags: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(flags, bad, group=group)
        bad = any(flags)
    if bad:
        what = problem or "another rank's tree differs from its peers'"
        raise ValueError(
            f"shard: {what} on {mesh_str(mesh)}; every rank must pass the same tree, each "
            "leaf placed alike (parallelize the model the same way on every rank).")


def _dims_of(leaf: Any, own: tuple[str, ...]) -> tuple[str, ...]:
    """The model's dimensions a DTensor leaf is placed on, if they are some of ``own`` (the
    mesh's), in the mesh's order; else all of ``own``."""
    dims = tuple(getattr(leaf, "device_mesh", None) and leaf.device_mesh.mesh_dim_names or ())
    return tuple(n for n in own if n in dims) if dims and set(dims) <= set(own) else own


def _global_stride(shape: torch.Size, local: torch.Tensor, mesh: DeviceMesh,
                   placements) -> tuple[int, ...]:
    """The global stride of a new DTensor: contiguous, as torch gives a full tensor. A leaf
    with no elements takes the stride DTensor itself derives from its (contiguous) local
    shard instead: torch 2.11's gradient accumulation re-creates a gradient whose stride
    differs from its leaf's, as Replicate(), so the leaf's gradient would lose Shard(0)."""
    if not math.prod(shape):  # the stride from_local derives (from the local one alone)
        return tuple(DTensor.from_local(local, mesh, placements, run_check=False).stride())
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _layout(name: str, t: torch.Tensor, mesh: DeviceMesh, placements,
            model: Model | None) -> Layout:
    sdim = shard_dim(mesh, model=True)  # shard checked the mesh
    sharded = t.ndim > 0 and getattr(placements[sdim], "dim", None) == 0
    shape = model_part(t.shape, model) if model is not None else t.shape
    return Layout(name, shape, t.dtype, sharded, mesh.size(sdim), mesh.get_local_rank(sdim),
                  model)


def unshard(
    tree: Any,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    transport: str = "c10d",
) -> Any:
    """DTensor shards -> plain full tensors, with one all-gather for the whole tree.

    Differentiable: the gradient w.r.t. each shard is the full gradient's mean over all mesh
    ranks, reduce-scattered on ``"shard"`` and all-reduced on ``"replicate"`` (one
    collective each for the whole tree), as :func:`fs.reduce_grads` computes.

    Args:
        tree: pytree of DTensors on one mesh (from :func:`shard`).
        param_dtype: gather floating leaves in this dtype (mixed precision, e.g. bfloat16).
        reduce_dtype: reduce gradients in this dtype (e.g. float32); grads come back in the
            shards' dtype.
        transport: how the bytes move: ``"c10d"`` (default: the backend's collectives),
            ``"p2p"`` or ``"cma"`` (opt-in, one host's gloo CPU ranks; see
            :mod:`funshard.collectives.base`).
    Returns:
        the same tree with full-shape plain tensors; on a mesh with the model's own
        dimensions (``"tp"``), a leaf the model placed there comes back as the model holds
        it: a DTensor on ``mesh["tp"]`` with the model's placements, whose local part is
        gathered over the data-parallel dimensions only.

    Example: ``unshard(shard({"w": x}, mesh))["w"]`` equals ``x`` bitwise.
    """
    collectives.failures.in_step()  # see [Note: a rank out of step]
    collectives.check_transport(transport, where="unshard")
    mesh, paths, leaves, layouts, spec = describe(tree, what="unshard", model=True)
    if not leaves:
        return pytree.unflatten(spec, [])
    # differentiable: grads come back as DTensors. Inside a torch.func transform (over other
    # inputs: describe refused transformed shards) to_local's Function is not transformable,
    # and the shards are constants there
    shards = ([_compat.local_tensor(d).detach() for d in leaves] if transforms_active()
              else [d.to_local() for d in leaves])
    check_float_dtype(param_dtype, "unshard: param_dtype")
    check_float_dtype(reduce_dtype, "unshard: reduce_dtype")
    got = unshard_leaves(layouts, shards, mesh, param_dtype=param_dtype,
                         reduce_dtype=reduce_dtype, transport=transport,
                         spreads=[spread_of(d) for d in leaves])
    return pytree.unflatten(spec, [as_model(f, lay) for f, lay in zip(got, layouts)])


def reshard(full: Any, like: Any) -> Any:
    """Full tensors -> shards placed like ``like`` (this rank's slice; no communication).

    Args:
        full: pytree of full-shape tensors, ``like``'s structure.
        like: pytree of DTensors whose mesh and placements the result takes.
    Returns:
        pytree of DTensors (fresh copies; requires_grad as in ``like``).

    Example: ``reshard(unshard(s), like=s)`` equals ``s`` shard for shard.
    """
    pytree.check_same_structure(full, like, names=("full", "like"))
    mesh, paths, likes, layouts, spec = describe(like, what="reshard", model=True)
    out = []
    for leaf, d, lay in zip(pytree.flatten(full)[0], likes, layouts):
        t = from_model(_check_leaf(lay.path, leaf, "reshard", lay.model and lay.model.mesh),
                       lay, "reshard")
        if tuple(t.shape) != tuple(lay.shape):
            raise ValueError(
                f"reshard: leaf {lay.path!r} has shape {tuple(t.shape)} but like's DTensor has "
                f"global shape {tuple(lay.shape)} on {mesh_str(mesh)}; pass full-shape tensors."
            )
        local = local_slice(t.detach(), lay).to(d.device, copy=True).contiguous()
        out.append(as_dtensor(local, d, requires_grad=d.requires_grad))
    return pytree.unflatten(spec, out)


class _Unshard(torch.autograd.Function):
    """Shards -> full tensors; backward: full grads -> reduced local shard grads."""

    @staticmethod
    def forward(layouts, where, dtypes, reduce_dtype, transport, *shards):
        mesh = where[0]
        gathered = [k for k, lay in enumerate(layouts) if lay.sharded]
        full = list(shards)
        if gathered:
            got = collectives.all_gather(
                [layouts[k] for k in gathered], [shards[k] for k in gathered], mesh,
                dtypes=[dtypes[k] for k in gathered], transport=transport,
            ).wait()
            for k, g in zip(gathered, got):
                full[k] = g
        for k, lay in enumerate(layouts):
            if not lay.sharded:  # replicated: a fresh tensor, cast like the rest
                full[k] = shards[k].to(dtypes[k], copy=True)
        return tuple(full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # forward and setup_context apart: the form torch.func transforms accept
        ctx.layouts, ctx.where, _, ctx.reduce_dtype, ctx.transport = inputs[:5]
        ctx.set_materialize_grads(False)

    @staticmethod
    def vmap(info, in_dims, layouts, where, dtypes, reduce_dtype, transport, *shards):
        """Inside torch.func.vmap over other inputs (the shards unbatched): gather once."""
        if any(d is not None for d in in_dims[5:]):
            raise NotImplementedError(
                "unshard: torch.func.vmap over the shards themselves is not supported; vmap "
                "a function of the full parameters (fs.unshard outside the vmap).")
        out = _Unshard.apply(layouts, where, dtypes, reduce_dtype, transport, *shards)
        return out, (None,) * len(out)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "unshard: forward-mode AD (torch.func.jvp, jacfwd) through the shards is not "
            "supported; take the jvp of a function of the full parameters (fs.unshard "
            "outside it).")

    @staticmethod
    def backward(ctx, *grads):
        need = [k for k, flag in enumerate(ctx.needs_input_grad[5:]) if flag]
        res = [None] * len(ctx.layouts)
        if need:
            got = collectives.reduce_scatter(
                [ctx.layouts[k] for k in need], [grads[k] for k in need], ctx.where[0],
                reduce_dtype=ctx.reduce_dtype, transport=ctx.transport,
                spreads=[ctx.where[1][k] for k in need],
            )
            for k, g in zip(need, got):
                res[k] = g
        return (None, None, None, None, None, *res)


def unshard_leaves(
    layouts: Sequence[Layout],
    shards: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    transport: str = "c10d",
    spreads: Sequence[tuple[str, ...]] | None = None,
) -> list[torch.Tensor]:
    """Differentiable bucketed gather of local shards (autograd sees one node); ``spreads``:
    per leaf, the model's dimensions its gradient is averaged over too (``"ep"``)."""
    dtypes = [compute_dtype(s.dtype, param_dtype) for s in shards]
    spreads = tuple(spreads) if spreads is not None else ((),) * len(layouts)
    return list(_Unshard.apply(tuple(layouts), (mesh, spreads), tuple(dtypes), reduce_dtype,
                               transport, *shards))
