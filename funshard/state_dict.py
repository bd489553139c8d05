"""State dicts: a tree as a flat ``{key: value}`` dict, in three kinds, and back.

``state_dict(tree, kind)`` flattens a params tree, an optimizer state or a whole
:class:`~funshard.step.TrainState` into a flat ``{key: value}`` dict (keys are FQNs;
NamedTuple fields by name: ``params.<fqn>``, ``opt_state.exp_avg.<fqn>``, ``step``;
``None`` leaves are skipped) and ``load_state_dict(sd, like)`` is its inverse:

- ``"sharded"``: DTensors, as they are (no communication);
- ``"local"``: each rank's :class:`LocalShard` pieces with global shape, offset and mesh
  (no communication);
- ``"full"``: plain full tensors, as ``nn.Module.state_dict()`` gives, gathered one group
  at a time (the step's default groups) so rank 0 peaks at the full dict plus one group.

A full dict loaded with ``rank0_only`` is read on rank 0 alone, which scatters each
group's shards to the others (:mod:`funshard._scatter`).

    >>> sd = state_dict(sparams, "full")                # {"w": tensor (7, 3)} on every rank
    >>> sparams = load_state_dict(sd, like=sparams)     # DTensor shards again
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from . import _compat, collectives, pytree
from .layout import as_dtensor, as_model, layout_of, local_slice, model_box, model_slice
from ._ranks import _broadcast_obj, _rank, _world
from ._scatter import _broadcast_full, _scatter_group
from .mesh import mesh_str, model_dims
from .state_keys import _flat, later_fields, with_later_fields
from .step.schedule import default_group

Tree = Any
KINDS = ("full", "sharded", "local")


class LocalShard(NamedTuple):
    """One rank's piece of a leaf in a ``kind="local"`` state dict.

    ``tensor`` sits at ``offset`` in a global tensor of ``shape``; ``mesh`` is
    ``(("replicate", 2), ("shard", 2))``-like and ``placements`` their reprs.
    """

    tensor: torch.Tensor
    shape: tuple
    offset: tuple
    mesh: tuple
    placements: tuple


# -- keys --------------------------------------------------------------------------------


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _describe_value(v: Any) -> str:
    """``'shape (7, 3), float32'`` for tensors and local shards, ``'a int'`` otherwise."""
    t = v.tensor if isinstance(v, LocalShard) else v
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(v.shape)}, {_dtype_name(t.dtype)}"
    return f"a {type(v).__name__}"


# -- state_dict ----------------------------------------------------------------------------


def state_dict(tree: Tree, kind: str = "full", *, rank0_only: bool = False,
               cpu_offload: bool = False) -> dict[str, Any]:
    """A flat ``{key: value}`` state dict of a params tree, optimizer state or TrainState.

    Args:
        tree: pytree of DTensors (plain tensors and Python scalars such as ``step`` pass
            through); ``None`` leaves are skipped.
        kind: ``"sharded"`` (the DTensors, sharing storage), ``"local"`` (:class:`LocalShard`
            per key, sharing storage) or ``"full"`` (fresh full tensors; every rank takes
            part in one all-gather per group, groups as ``fs.step.default_group``).
        rank0_only: full only; ranks other than 0 drop what they gather and return ``{}``.
        cpu_offload: full only; move each group's full tensors to the CPU as it arrives.
    Returns:
        dict in the tree's order; for a params dict the keys are ``named_parameters()``'s.

    Example: ``state_dict(fs.shard({"w": x}, mesh))["w"]`` equals ``x`` (7, 3) on every rank.
    """
    collectives.failures.in_step()  # see [Note: a rank out of step]
    if kind not in KINDS:
        raise ValueError(f"state_dict: kind={kind!r}; use one of {KINDS}")
    if kind != "full" and (rank0_only or cpu_offload):
        raise ValueError(f"state_dict: rank0_only / cpu_offload apply to kind='full', not "
                         f"kind={kind!r}")
    keys, leaves, _ = _flat(tree)
    for k, v in zip(keys, leaves):
        if isinstance(v, DTensor):
            layout_of(k, v, what="state_dict", model=True)  # placements it gathers, or an error
    if kind == "sharded":
        return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in zip(keys, leaves)}
    if kind == "local":
        return {k: _local_shard(k, v) for k, v in zip(keys, leaves)}
    return _full(keys, leaves, rank0_only=rank0_only, cpu_offload=cpu_offload)


def _local_shard(key: str, v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if not isinstance(v, DTensor):
        return LocalShard(v.detach(), tuple(v.shape), (0,) * v.ndim, (), ())
    lay = layout_of(key, v, model=True)
    mesh = v.device_mesh
    at = model_box(v.shape, lay.model)[1] if lay.model else (0,) * v.ndim
    offset = (at[0] + lay.start, *at[1:]) if v.ndim else ()
    return LocalShard(_compat.local_tensor(v).detach(), tuple(v.shape), offset,
                      tuple(zip(mesh.mesh_dim_names, mesh.shape)),
                      tuple(repr(p) for p in v.placements))


def _groups(keys: list[str], leaves: list[Any]) -> list[list[int]]:
    """Leaf indices bucketed by (default group, mesh), in order of first appearance."""
    out: dict[tuple, list[int]] = {}
    for i, (k, v) in enumerate(zip(keys, leaves)):
        mesh = v.device_mesh if isinstance(v, DTensor) else None
        out.setdefault((default_group(k), id(mesh)), []).append(i)
    return list(out.values())


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` owning exactly its bytes (a gathered view of a padded buffer is cloned)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def _full(keys, leaves, *, rank0_only: bool, cpu_offload: bool) -> dict[str, Any]:
    keep = not rank0_only or _rank() == 0
    out: dict[str, Any] = dict.fromkeys(keys)
    for idx in _groups(keys, leaves):
        lays = {i: layout_of(keys[i], leaves[i], model=True) for i in idx
                if isinstance(leaves[i], DTensor)}
        sharded = [i for i in lays if lays[i].sharded]
        got: dict[int, torch.Tensor] = {}
        if sharded:
            mesh = leaves[sharded[0]].device_mesh
            shards = [_compat.local_tensor(leaves[i]).detach() for i in sharded]
            full = collectives.all_gather([lays[i] for i in sharded], shards, mesh).wait()
            got = dict(zip(sharded, full))  # one collective
            del full, shards
        for i in lays:  # the model's parts, gathered over its own dimensions (every rank)
            if lays[i].model is not None:
                part = got.get(i, _compat.local_tensor(leaves[i]).detach())
                got[i] = as_model(part, lays[i]).full_tensor()
        if not keep:
            continue
        for i in idx:
            v = leaves[i]
            if i in got:
                t = _compact(got.pop(i))
            elif isinstance(v, DTensor):
                t = _compat.local_tensor(v).detach().clone()
            elif isinstance(v, torch.Tensor):
                t = v.detach().clone()
            else:
                out[keys[i]] = v
                continue
            out[keys[i]] = t.cpu() if cpu_offload else t
    return out if keep else {}


# -- load_state_dict -------------------------------------------------------------------------


def load_state_dict(sd: dict[str, Any] | None, like: Tree, *, rank0_only: bool = False,
                    strict: bool = True) -> Tree:
    """The inverse of :func:`state_dict` for every kind: a new tree shaped and placed like ``like``.

    Each value's type says its kind: a DTensor (sharded), a :class:`LocalShard` (local) or a
    plain tensor (full: e.g. ``model.state_dict()`` or a ``torch.load``-ed file; each rank
    copies only its slice). Everything is checked before anything is built: missing and
    unexpected keys, shape, dtype and layout mismatches are reported together in one
    ``ValueError``. For a TrainState, what :func:`fs.checkpoint.load` fills in is filled in
    here too (:func:`later_fields`): ``skipped`` as 0, a loss scale ``sd`` lacks as ``like``'s.

    Args:
        sd: a state dict; with ``rank0_only`` only rank 0's is read (others may pass None).
        like: the tree (params, optimizer state or TrainState) whose structure, meshes,
            placements and requires_grad the result takes; its values are not used.
        rank0_only: full dicts only: rank 0 scatters each group's shards to the others.
        strict: False ignores unexpected keys (tied aliases, buffers); missing keys are
            always an error.
    Returns:
        a tree like ``like`` with fresh tensors (None leaves stay None).

    Example: ``load_state_dict(model.state_dict(), like=sparams)["w"]`` -> DTensor (7, 3).
    """
    collectives.failures.in_step()  # see [Note: a rank out of step]
    keys, likes, spec = _flat(like)
    for k, v in zip(keys, likes):  # placements funshard lays out, or an error
        if isinstance(v, DTensor):
            layout_of(k, v, what="load_state_dict", model=True)
    unknown: set = set()  # keys of fields sd predates whose None means "not known"
    if isinstance(sd, dict):
        like_sd = dict(zip(keys, likes))
        unknown = {k for k, v in later_fields(like, like_sd).items() if v is None and k not in sd}
        sd = with_later_fields(sd, like, like_sd)
    if rank0_only and _world() > 1:
        values = _load_rank0(sd, keys, likes, strict=strict, unknown=unknown)
    else:
        if not isinstance(sd, dict):
            raise TypeError(f"load_state_dict: sd must be a dict, got {type(sd).__name__}")
        problems = _problems(sd, keys, likes, strict=strict, unknown=unknown)
        if problems:
            raise ValueError(_report(problems))
        values = [_build(k, sd[k], v) for k, v in zip(keys, likes)]
    return pytree.unflatten(spec, values)


def _problems(sd: dict, keys: list[str], likes: list[Any], *, strict: bool,
              unknown: set = frozenset()) -> list[str]:
    """Every difference between ``sd`` and ``like``, one line each, naming key and shapes
    (``unknown``: keys of a field ``sd`` predates, None there)."""
    out = []
    wanted = set(keys)
    for k, want in zip(keys, likes):
        if k not in sd:
            out.append(f"missing key {k!r} (like: {_describe_value(want)})")
            continue
        got = sd[k]
        if k in unknown:
            continue
        if not isinstance(want, torch.Tensor):
            if isinstance(got, torch.Tensor) and got.numel() == 1 and not isinstance(got, DTensor):
                got = got.item()
            if type(got) is not type(want):
                out.append(f"type mismatch at {k!r}: state dict has {_describe_value(got)}, "
                           f"like has {_describe_value(want)}")
            continue
        t = got.tensor if isinstance(got, LocalShard) else got
        if not isinstance(t, torch.Tensor):
            out.append(f"type mismatch at {k!r}: state dict has {_describe_value(got)}, "
                       f"like has a tensor of {_describe_value(want)}")
            continue
        shape = tuple(got.shape)
        if shape != tuple(want.shape):
            out.append(f"shape mismatch at {k!r}: state dict {shape}, like {tuple(want.shape)}")
        elif t.dtype != want.dtype:
            out.append(f"dtype mismatch at {k!r} (shape {shape}): state dict "
                       f"{_dtype_name(t.dtype)}, like {_dtype_name(want.dtype)}")
        else:
            why = _layout_problem(k, got, want)
            if why:
                out.append(why)
    if strict:
        for k in sd:
            if k not in wanted:
                out.append(f"unexpected key {k!r} ({_describe_value(sd[k])})")
    return out


def _layout_problem(k: str, got: Any, want: Any) -> str | None:
    """Why a sharded / local value cannot be placed like ``want`` without resharding."""
    if isinstance(got, DTensor):
        if not isinstance(want, DTensor):
            return (f"layout mismatch at {k!r}: state dict has a DTensor on "
                    f"{mesh_str(got.device_mesh)}, like has a plain tensor")
        if got.device_mesh != want.device_mesh:
            return (f"layout mismatch at {k!r} (shape {tuple(want.shape)}): state dict on "
                    f"{mesh_str(got.device_mesh)}, like on {mesh_str(want.device_mesh)}; a sharded "
                    "state dict loads on its own mesh (use kind='full' or fs.checkpoint.save / "
                    "load to reshard)")
        return None
    if isinstance(got, LocalShard):
        exp = _local_shard(k, want)
        if (got.offset, tuple(got.tensor.shape), got.mesh) != (
                exp.offset, tuple(exp.tensor.shape), exp.mesh):
            return (f"layout mismatch at {k!r} (shape {tuple(want.shape)}): local shard "
                    f"{tuple(got.tensor.shape)} at offset {got.offset} on mesh {got.mesh}, like "
                    f"expects {tuple(exp.tensor.shape)} at {exp.offset} on {exp.mesh}; a local "
                    "state dict loads on its own mesh and rank (use kind='full' or "
                    "fs.checkpoint.save / load to reshard)")
    return None


def _report(problems: list[str]) -> str:
    lines = "\n  ".join(problems)
    return (f"load_state_dict: {len(problems)} problem(s) between the state dict and like; "
            f"nothing was loaded:\n  {lines}\nFix: load a state dict of the same tree "
            "(keys as fs.state_dict(like) gives them); strict=False ignores unexpected keys "
            "(e.g. tied aliases or buffers from model.state_dict()).")


def _build(key: str, got: Any, want: Any) -> Any:
    """One validated value -> a fresh leaf placed like ``want`` (no communication)."""
    if not isinstance(want, torch.Tensor):
        return got.item() if isinstance(got, torch.Tensor) else got
    if isinstance(got, LocalShard):
        got = got.tensor
        local = got.detach().to(want.device, copy=True)
    elif isinstance(got, DTensor):
        if tuple(got.placements) != tuple(want.placements):
            got = got.redistribute(want.device_mesh, want.placements)
        local = _compat.local_tensor(got).detach().to(want.device, copy=True)
    elif isinstance(want, DTensor):
        lay = layout_of(key, want, model=True)
        local = local_slice(model_slice(got.detach(), lay), lay).to(want.device, copy=True)
    else:
        local = got.detach().to(want.device, copy=True)
    return _like(local.contiguous(), want)


def _like(local: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    if isinstance(want, DTensor):
        return as_dtensor(local, want, requires_grad=want.requires_grad)
    return local.requires_grad_(want.requires_grad) if want.requires_grad else local


def _load_rank0(sd, keys, likes, *, strict: bool, unknown: set) -> list[Any]:
    """rank0_only: rank 0 validates, then scatters each group's shards (one scatter per group)."""
    rank = _rank()
    msg, scalars = None, {}
    if rank == 0:
        if not isinstance(sd, dict):
            msg = f"load_state_dict: sd must be a dict on rank 0, got {type(sd).__name__}"
        else:
            problems = _problems(sd, keys, likes, strict=strict, unknown=unknown)
            if any(isinstance(sd[k], (DTensor, LocalShard)) for k in keys if k in sd):
                problems.append("rank0_only=True takes a full state dict (plain tensors); this "
                                "one has DTensors or LocalShards: pass rank0_only=False")
            msg = _report(problems) if problems else None
            scalars = {k: _build(k, sd[k], v) for k, v in zip(keys, likes)
                       if not isinstance(v, torch.Tensor)}
    msg, scalars = _broadcast_obj((msg, scalars))
    if msg:
        raise ValueError(msg)
    values: list[Any] = [scalars.get(k) for k in keys]
    if any(isinstance(v, DTensor) and model_dims(v.device_mesh) for v in likes):
        for i, (k, v) in enumerate(zip(keys, likes)):  # the model's dims: see _broadcast_full
            if isinstance(v, torch.Tensor):
                values[i] = _build(k, _broadcast_full(sd[k] if rank == 0 else None, v), v)
        return values
    for idx in _groups(keys, likes):
        tensors = [i for i in idx if isinstance(likes[i], torch.Tensor)]
        if tensors:
            full = [sd[keys[i]] for i in tensors] if rank == 0 else None
            for i, local in zip(tensors, _scatter_group([keys[i] for i in tensors],
                                                        [likes[i] for i in tensors], full)):
                values[i] = _like(local, likes[i])
    return values

