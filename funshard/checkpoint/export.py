"""Trained shards back to plain PyTorch: one ``torch.save`` file of full tensors and back
(:func:`export_full`, :func:`import_full`), or the parameters of an ``nn.Module``
(:func:`export_module`, e.g. before Hugging Face's ``save_pretrained``)."""

from __future__ import annotations

import os
import uuid
import zipfile

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _compat
from .._ranks import _all_gather_obj, _broadcast_obj, _rank, _world
from ..state_dict import Tree, load_state_dict, state_dict
from .atomic import _fsync_dir
from .errors import _first_error


def export_full(path: str | os.PathLike, tree: Tree) -> str:
    """Write ``tree``'s full state dict as one ``torch.save`` file (rank 0 writes).

    Call on every rank; groups are gathered one at a time to rank 0's CPU. The file is
    plain PyTorch: ``model.load_state_dict(torch.load(path))`` for a params tree. Written
    to a temporary sibling and renamed, so ``path`` is never a partial file.

    Returns:
        ``path`` as a str.

    Example: ``export_full("model.pt", state.params)``; ``torch.load("model.pt")["w"]`` (7, 3).
    """
    path = os.path.abspath(os.fspath(path))
    sd = state_dict(tree, kind="full", rank0_only=True, cpu_offload=True)
    err = None
    if _rank() == 0:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
        except OSError as e:
            err = ("CheckpointError", f"export_full: writing {path!r} failed: {e}")
            if os.path.exists(tmp):
                os.unlink(tmp)
    del sd
    _first_error([_broadcast_obj(err)])
    return path


def import_full(path: str | os.PathLike, like: Tree, *, rank0_only: bool = True,
                strict: bool = True) -> Tree:
    """Read a full single-file state dict (:func:`export_full`, ``torch.save(model.state_dict())``).

    Args:
        path: the file; with ``rank0_only`` only rank 0 reads it (memory-mapped) and
            scatters each group's shards, else every rank maps it and keeps its slice.
        like: the tree whose structure and placements the result takes.
        strict: False ignores unexpected keys (e.g. tied aliases, buffers).
    Returns:
        a new tree like ``like``.

    Example: ``params = import_full("model.pt", like=sparams)``.
    """
    path = os.fspath(path)
    sd, err = None, None
    if not rank0_only or _rank() == 0:
        try:
            sd = _torch_load(path)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            err = ("CheckpointError", f"import_full: cannot read {path!r}: {type(e).__name__}: "
                                      f"{e}")
    if rank0_only:
        _first_error([_broadcast_obj(err)])
    else:
        _first_error(_all_gather_obj(err))
    return load_state_dict(sd, like, rank0_only=rank0_only, strict=strict)


def _torch_load(path: str) -> dict:
    """``torch.load`` memory-mapped (zip format), else read (legacy format, which torch
    cannot map); tensors only."""
    return torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path),
                      weights_only=True)


def export_module(module: nn.Module, params: Tree, *, buffers: Tree = None,
                  rank0_only: bool = True) -> nn.Module | None:
    """Put a params tree's full values (and buffers) into ``module`` (every rank calls).

    Every parameter of ``module`` (``named_parameters()``, tied ones once, as
    :func:`funshard.params` gives them) must be in ``params`` with its shape and dtype, and
    nothing else may be; otherwise every rank raises the same ``ValueError`` before anything
    is gathered. Groups are gathered one at a time to the CPU. A parameter on a real device
    is copied into (its storage, device and ties are kept); a ``meta`` parameter is swapped
    for a CPU tensor (``torch.utils.swap_tensors``: the same object, so ties and references
    are kept), so a module built under ``torch.device("meta")`` holds one copy. ``buffers``
    (e.g. ``state.buffers``: replicated, each rank's own copy, no communication) are copied
    into the module's buffers of those names the same way; buffers not given are left as
    they are, and a ``meta`` one of those is refused by name.

    Args:
        module: the architecture the params were trained for (the training model is fine).
        params: a tree of DTensors, e.g. ``state.params``; or a whole ``TrainState`` (its
            params and buffers).
        buffers: ``{fqn: tensor}`` of module buffers, e.g. ``state.buffers``.
        rank0_only: fill the module on rank 0 only; the other ranks take part in the
            gathers and get ``None`` back (their module is not touched).
    Returns:
        ``module`` (only its parameter values change), or ``None`` on ranks other than 0
        with ``rank0_only``.

    Example: ``export_module(model, state.params).save_pretrained("out/hf")`` on rank 0.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"export_module: module must be an nn.Module, got {type(module).__name__}")
    if hasattr(params, "_fields") and "params" in params._fields:  # a TrainState
        params, buffers = params.params, params.buffers if buffers is None else buffers
    targets = dict(module.named_parameters())
    if not isinstance(params, dict):
        raise TypeError(f"export_module: params must be a dict {{fqn: DTensor}} such as "
                        f"state.params, got {type(params).__name__}")
    problems = _module_problems(module, targets, params, buffers or {})
    if problems:
        raise ValueError("export_module: the params tree does not fit the module; nothing was "
                         "gathered:\n  " + "\n  ".join(problems))
    sd = state_dict(params, kind="full", rank0_only=rank0_only, cpu_offload=True)
    if rank0_only and _rank() != 0:
        return None
    with torch.no_grad():
        for name, p in targets.items():
            value = sd.pop(name)
            if p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
            else:
                p.copy_(value)
        own = dict(module.named_buffers())
        for name, b in (buffers or {}).items():
            value = (b.to_local() if isinstance(b, DTensor) else b).detach()
            if own[name].is_meta:
                owner, _, leaf = name.rpartition(".")
                _compat.own_buffers(module.get_submodule(owner))[leaf] = value.to("cpu", copy=True)
            else:
                own[name].copy_(value)
    return module


def _module_problems(module: nn.Module, targets: dict, params: dict,
                     buffers: dict) -> list[str]:
    """Every mismatch between the module's parameters (and buffers) and the trees."""
    out = []
    own = dict(module.named_buffers())
    for name, b in buffers.items():
        if name not in own:
            out.append(f"buffers[{name!r}] is not a buffer of the module")
        elif tuple(b.shape) != tuple(own[name].shape) or b.dtype != own[name].dtype:
            out.append(f"buffers[{name!r}] is {tuple(b.shape)} {b.dtype}, the module's buffer "
                       f"is {tuple(own[name].shape)} {own[name].dtype}")
    for name, p in targets.items():
        if name not in params:
            out.append(f"module parameter {name!r} {tuple(p.shape)} is not in params")
            continue
        v = params[name]
        if not isinstance(v, torch.Tensor):
            out.append(f"params[{name!r}] is a {type(v).__name__}, expected a DTensor")
        elif tuple(v.shape) != tuple(p.shape) or v.dtype != p.dtype:
            out.append(f"params[{name!r}] is {tuple(v.shape)} {v.dtype}, the module's parameter "
                       f"is {tuple(p.shape)} {p.dtype}")
        elif not isinstance(v, DTensor) and _world() > 1:
            out.append(f"params[{name!r}] {tuple(v.shape)} is a plain tensor; pass the sharded "
                       "tree (state.params)")
    out += [f"params[{k!r}] is not a parameter of the module (tied aliases appear once, under "
            "the first name)" for k in params if k not in targets]
    out += [f"buffer {name!r} {tuple(b.shape)} is on the meta device and was not given: pass "
            "buffers=state.buffers (fs.buffers at init), build the module on a real device, or "
            "initialise its buffers first" for name, b in own.items()
            if b.is_meta and name not in buffers]
    return out
