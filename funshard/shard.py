"""Meshes and the shard / unshard / reshard trio.

    >>> mesh = make_mesh(shard=2)                  # 1-D ("shard",)
    >>> s = shard({"w": torch.randn(7, 3)}, mesh)  # DTensor (7, 3), local (4, 3) / (3, 3)
    >>> unshard(s)["w"].shape                      # torch.Size([7, 3]); differentiable
    >>> reshard(unshard(s), like=s)                # back to shards, no communication
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from . import collectives, pytree
from .collectives import REPLICATE, SHARD, Layout, mesh_str

Spec = Any  # "shard" | "replicate" | prefix tree of those | callable (fqn, tensor) -> str


def _init_process_group(device_type: str, timeout: float | None) -> None:
    if dist.is_initialized():
        return
    kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun / torch elastic
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # A restarted elastic job reuses the agent's store, where the dead workers'
            # addresses still sit under the default keys: key this attempt's group apart.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=kw.get("timeout", timedelta(minutes=5)),
            )
            dist.init_process_group(
                backend, store=dist.PrefixStore(f"funshard/attempt_{attempt}", store),
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **kw,
            )
        else:
            dist.init_process_group(backend, **kw)
    else:  # a plain single process: a world of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, **kw)


def make_mesh(
    shard: int | None = None,
    replicate: int = 1,
    *,
    device_type: str | None = None,
    timeout: float | None = None,
) -> DeviceMesh:
    """A ``("shard",)`` or ``("replicate", "shard")`` DeviceMesh over all ranks.

    Initialises the default process group from torchrun's environment when needed (NCCL on
    CUDA, gloo on CPU); a single process without that environment gets a world of 1.

    Args:
        shard: ranks per shard group (default: world size // replicate).
        replicate: number of replicas (HSDP); 1 gives a 1-D mesh.
        device_type: "cuda" or "cpu" (default: cuda when available).
        timeout: seconds a collective may wait before it fails with a timeout error on
            every rank (default: torch's, 10-30 minutes); used when this call initialises
            the process group.
    Returns:
        DeviceMesh; ``make_mesh(shard=2, replicate=2)`` on 4 ranks -> 2x2.
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    for name, v in (("shard", shard), ("replicate", replicate)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"make_mesh: {name}={v!r} must be a positive int")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"make_mesh: timeout={timeout!r} must be a positive number of seconds")
    _init_process_group(device_type, timeout)
    world = dist.get_world_size()
    if world % replicate:
        raise ValueError(
            f"make_mesh: replicate={replicate} does not divide the world size {world}; "
            f"choose replicate from the divisors of {world}."
        )
    if shard is None:
        shard = world // replicate
    if shard * replicate != world:
        raise ValueError(
            f"make_mesh: shard={shard} x replicate={replicate} = {shard * replicate} ranks, but "
            f"the world has {world}; the mesh must cover every rank (e.g. shard={world // replicate})."
        )
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=(SHARD,))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=(REPLICATE, SHARD))


def _check_leaf(name: str, leaf: Any, what: str) -> torch.Tensor:
    if isinstance(leaf, DTensor):
        raise TypeError(
            f"{what}: leaf {name!r} of shape {tuple(leaf.shape)} is already a DTensor on "
            f"{mesh_str(leaf.device_mesh)}; pass full tensors (fs.unshard gives them back)."
        )
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"{what}: leaf {name!r} is a {type(leaf).__name__} ({leaf!r:.60}), expected a "
            "torch.Tensor; put only tensors in the tree (None is allowed as an empty node)."
        )
    return leaf


def shard(tree: Any, mesh: DeviceMesh, *, spec: Spec = SHARD) -> Any:
    """Full tensors -> DTensor shards: Shard(0) on ``"shard"``, Replicate() elsewhere.

    Every rank must pass the same values (as with ``distribute_tensor(src_data_rank=None)``);
    nothing is communicated. Uneven dim 0 splits as ``torch.chunk`` does (7 rows on 3 ranks:
    3, 3, 1). 0-d tensors are replicated. Each local shard is a copy, so the full input can be
    freed. A meta-device leaf materialises only its local shard (uninitialised, on the mesh's
    device); initialise it afterwards.

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
    collectives.shard_dim(mesh, where="shard: ")
    paths, leaves, tspec = pytree.flatten_with_path(tree)
    hows = pytree.broadcast_prefix(spec, tree, name="shard spec")
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for p, leaf, how in zip(paths, leaves, hows):
        name = pytree.fqn(p)
        t = _check_leaf(name, leaf, "shard")
        if how not in (SHARD, REPLICATE):
            raise ValueError(
                f"shard: spec for leaf {name!r} (shape {tuple(t.shape)}) is {how!r}; use "
                f"{SHARD!r} or {REPLICATE!r}."
            )
        placements = collectives.placements_for(mesh, t.ndim, how)
        lay = _layout(name, t, mesh, placements)
        if t.is_meta:
            local = torch.empty(lay.local_shape, dtype=t.dtype, device=device)
        else:
            local = collectives.local_slice(t.detach(), lay).to(device, copy=True)
            local = local.contiguous()
        d = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=t.shape, stride=_contiguous(t.shape)
        )
        out.append(d.requires_grad_(t.requires_grad) if t.requires_grad else d)
    return pytree.unflatten(tspec, out)


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _layout(name: str, t: torch.Tensor, mesh: DeviceMesh, placements) -> Layout:
    sdim = collectives.shard_dim(mesh)
    sharded = any(getattr(p, "dim", None) == 0 for p in placements)
    return Layout(name, t.shape, t.dtype, sharded, mesh.size(sdim), mesh.get_local_rank(sdim))


def unshard(
    tree: Any,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
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
    Returns:
        the same tree with full-shape plain tensors.

    Example: ``unshard(shard({"w": x}, mesh))["w"]`` equals ``x`` bitwise.
    """
    mesh, paths, leaves, layouts, spec = collectives.describe(tree, what="unshard")
    if not leaves:
        return pytree.unflatten(spec, [])
    shards = [d.to_local() for d in leaves]  # differentiable: grads come back as DTensors
    full = collectives.unshard_leaves(
        layouts, shards, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype
    )
    return pytree.unflatten(spec, full)


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
    mesh, paths, likes, layouts, spec = collectives.describe(like, what="reshard")
    out = []
    for leaf, d, lay in zip(pytree.flatten(full)[0], likes, layouts):
        t = _check_leaf(lay.path, leaf, "reshard")
        if tuple(t.shape) != tuple(lay.shape):
            raise ValueError(
                f"reshard: leaf {lay.path!r} has shape {tuple(t.shape)} but like's DTensor has "
                f"global shape {tuple(lay.shape)} on {mesh_str(mesh)}; pass full-shape tensors."
            )
        local = collectives.local_slice(t.detach(), lay).to(d.device, copy=True).contiguous()
        out.append(collectives.as_dtensor(local, d, requires_grad=d.requires_grad))
    return pytree.unflatten(spec, out)
