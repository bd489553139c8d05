"""One ``torch.save`` file of full tensors, and back: plain PyTorch on the other side."""

from __future__ import annotations

import os
import uuid

import torch

from .._ranks import _all_gather_obj, _broadcast_obj, _rank
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
    """``torch.load`` memory-mapped (zip format), else read (legacy format); tensors only."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
    return torch.load(path, map_location="cpu", weights_only=True)
