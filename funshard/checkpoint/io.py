"""Saving and loading checkpoints: every rank its own shards, atomically; async saving.

``save(path, state)`` writes every rank's own shards with ``torch.distributed.checkpoint``
and commits them atomically (:mod:`funshard.checkpoint.atomic`); with ``async_save`` it
snapshots the shards to CPU memory and writes in a background thread. ``load(path, like)``
checks the marker and the files before reading anything and reshards to ``like``'s mesh.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.tensor import DTensor

from .. import pytree
from ..layout import as_dtensor
from .._ranks import _all_gather_obj, _broadcast_obj, _rank, _world
from ..state_dict import Tree, _describe_value, _dtype_name, _flat, _like, state_dict
from .atomic import (FORMAT, MARKER, _check_files, _commit, _crc32, _marker, _recover,
                     _resolve, _write_marker)
from .dirs import prune
from .errors import CheckpointError, _first_error


# -- save --------------------------------------------------------------------------------------


def _key_info(sd: dict[str, Any]) -> dict[str, dict]:
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)}
        else:
            out[k] = {"type": type(v).__name__}
    return out


def _mesh_info(sd: dict[str, Any]) -> list | None:
    for v in sd.values():
        if isinstance(v, DTensor):
            return [[n, s] for n, s in zip(v.device_mesh.mesh_dim_names, v.device_mesh.shape)]
    return None


def save(path: str | os.PathLike, state: Tree, *, async_save: bool = False,
         keep: int | None = None) -> str | Future:
    """Write ``state`` as a checkpoint directory: every rank its own shards, atomically.

    Call on every rank. The directory appears under ``path`` only once every rank's files
    are durable (``fsync``-ed) and rank 0 has written the marker; a crash at any point
    leaves the previous checkpoint at ``path`` loadable.

    Args:
        path: the checkpoint directory, e.g. ``ckpt/step_000100``; replaced if it exists.
        state: a TrainState, params tree or optimizer state (DTensors, tensors, scalars).
        async_save: snapshot the local shards to CPU memory, return at once and write in a
            background thread (its own gloo group), overlapping the next steps.
        keep: after the commit, rank 0 keeps only the newest ``keep`` complete ``step_<n>``
            checkpoints next to ``path`` (see :func:`prune`).
    Returns:
        ``path`` as a str; with ``async_save`` a ``concurrent.futures.Future`` whose
        ``result()`` is the path once the checkpoint is durable and visible (it raises if
        the save failed).

    Example: ``save(f"ckpt/step_{state.step:06d}", state, keep=3)``.
    """
    path = os.path.abspath(os.fspath(path))
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"save: keep={keep!r} must be an int >= 1 (or None)")
    sd = state_dict(state, kind="sharded")
    info = _info(sd)
    token = _make_tmp(path)
    if not async_save:
        _write(sd, path, token, info, keep=keep, pg=None)
        return path
    return _write_async(sd, path, token, info, keep=keep)


def _info(sd: dict[str, Any]) -> dict:
    """What the marker says of ``sd`` (keys, mesh, step); a value no checkpoint holds raises."""
    for k, v in sd.items():
        if not isinstance(v, (torch.Tensor, int, float, bool, str, type(None))):
            raise TypeError(f"save: {k!r} is a {type(v).__name__}; checkpoints hold tensors and "
                            "Python scalars (int, float, bool, str)")
    return {"keys": _key_info(sd), "mesh": _mesh_info(sd),
            "step": sd.get("step") if isinstance(sd.get("step"), int) else None}


def _make_tmp(path: str) -> str:
    """Rank 0 recovers ``path`` and makes the temporary sibling; every rank gets its token."""
    err, token = None, None
    if _rank() == 0:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _recover(path)
            token = uuid.uuid4().hex[:12]
            os.makedirs(f"{path}.tmp-{token}")
        except (OSError, ValueError) as e:
            err = (type(e).__name__ if isinstance(e, ValueError) else "CheckpointError",
                   f"save: cannot prepare {path!r}: {e}" if isinstance(e, OSError) else str(e))
    err, token = _broadcast_obj((err, token))
    _first_error([err])
    return token


def _write_async(sd, path: str, token: str, info: dict, *, keep: int | None) -> Future:
    """Snapshot ``sd`` to CPU, then :func:`_write` it in a thread over its own gloo group."""
    staged = {k: _stage(v) for k, v in sd.items()}
    pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
    fut: Future = Future()

    def run():
        try:
            _write(staged, path, token, info, keep=keep, pg=pg)
            fut.set_result(path)
        except BaseException as e:  # noqa: BLE001 - reported through the future
            fut.set_exception(e)

    threading.Thread(target=run, name=f"funshard-save-{token}").start()
    return fut


def _stage(v: Any) -> Any:
    """A CPU snapshot of one value (the optimizer updates shards in place)."""
    if isinstance(v, DTensor):
        local = v._local_tensor.detach().to("cpu", copy=True)
        return DTensor.from_local(local, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    return v


def _write(sd, path: str, token: str, info: dict, *, keep: int | None, pg) -> None:
    """dcp.save into the temporary sibling, checksums, marker, rename (rank 0), barrier."""
    tmp = f"{path}.tmp-{token}"
    rank = _rank(pg)
    gathered = _all_gather_obj(_write_shards(sd, tmp, path, rank, pg), pg)
    errors = [e for _, e in gathered]
    if rank == 0:
        try:
            if any(errors):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                _write_marker(tmp, {"format": FORMAT, "time": time.time(),
                                    "world_size": _world(pg), **info,
                                    "files": {n: f for fs_, _ in gathered for n, f in fs_.items()}})
                _commit(tmp, path, token)
                if keep is not None:
                    prune(os.path.dirname(path), keep=keep)
        except OSError as e:
            errors.append(("CheckpointError", f"save: committing {path!r} failed: {e}"))
    errors = _broadcast_obj([e for e in errors if e], pg)  # also the final barrier
    if pg is not None and dist.is_initialized():
        dist.destroy_process_group(pg)
    _first_error(errors)


def _write_shards(sd, tmp: str, path: str, rank: int, pg) -> tuple[dict, tuple | None]:
    """This rank's dcp.save into ``tmp``: ``({file: {bytes, crc32}}, None)`` or ``({}, error)``."""
    files, err = {}, None
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 process_group=pg, no_dist=not dist.is_initialized())
        names = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
        if rank == 0:
            names.append(".metadata")
        files = {n: {"bytes": os.path.getsize(os.path.join(tmp, n)),
                     "crc32": _crc32(os.path.join(tmp, n))} for n in names}
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else ""  # DCP wraps per-rank tracebacks: keep the cause
        err = ("CheckpointError", f"save to {path!r} failed on rank {rank}: "
                                  f"{type(e).__name__}: {why}")
    return files, err


# -- load --------------------------------------------------------------------------------------


def _prepare_load(path: str, like_sd: dict, rank: int, world: int, verify: bool):
    """Resolve, read the marker, check keys and files; -> (dir, None) or (None, (type, msg))."""
    where = _resolve(path)
    if where is None:
        return None, ("CheckpointError", f"load: no checkpoint at {path!r}; "
                                         "fs.checkpoint.latest(dir) finds the newest one")
    marker = _marker(where)
    if marker is None:
        return None, ("CheckpointError",
                      f"incomplete or corrupted checkpoint at {path!r}: no valid {MARKER} "
                      "marker (the save did not finish); load an earlier checkpoint "
                      "(fs.checkpoint.latest(dir) skips incomplete ones)")
    saved = marker.get("keys", {})
    problems = _key_problems(saved, like_sd)
    if problems:
        text = "\n  ".join(problems)
        return None, ("ValueError", f"load: the checkpoint at {path!r} does not match like "
                      f"({len(problems)} problem(s)); nothing was loaded:\n  {text}\nFix: pass "
                      "like= a state of the same model and optimizer as the saved one.")
    bad = _check_files(where, marker, rank, world) if verify else None
    if bad:
        return None, ("CheckpointError", f"incomplete or corrupted checkpoint at {path!r}: {bad}")
    return where, None


def _key_problems(saved: dict, like_sd: dict) -> list[str]:
    """Every difference between the marker's keys and ``like``'s, one line each."""
    problems = []
    for k, v in like_sd.items():
        want = _key_info({k: v})[k]
        got = saved.get(k)
        if got is None:
            problems.append(f"missing key {k!r} (like: {_describe_value(v)})")
        elif "type" in want or "type" in got:
            if got != want:
                problems.append(f"type mismatch at {k!r}: checkpoint has {got}, like has {want}")
        elif got["shape"] != want["shape"]:
            problems.append(f"shape mismatch at {k!r}: checkpoint {tuple(got['shape'])}, like "
                            f"{tuple(want['shape'])}")
        elif got["dtype"] != want["dtype"]:
            problems.append(f"dtype mismatch at {k!r} (shape {tuple(want['shape'])}): checkpoint "
                            f"{got['dtype']}, like {want['dtype']}")
    problems += [f"unexpected key {k!r} ({saved[k]})" for k in saved if k not in like_sd]
    return problems


def load(path: str | os.PathLike, like: Tree, *, verify: bool = True) -> Tree:
    """Read a checkpoint written by :func:`save` into a new tree placed like ``like``.

    Call on every rank. Any world size or mesh works: each rank reads the pieces of its own
    shards (``torch.distributed.checkpoint`` reshards). Before reading, the marker, the
    keys, shapes and dtypes and every file's size (and, with ``verify``, CRC32, each rank
    checking a share) are checked; a failure raises on every rank and loads nothing.

    Args:
        path: a checkpoint directory (e.g. from :func:`latest`).
        like: a tree of the same structure (e.g. ``step.init(params)``); its values are not
            used and are not modified.
        verify: check CRC32s (reads every file once more, split over the ranks).
    Returns:
        a new tree like ``like`` (the saved ``step`` included).
    Raises:
        CheckpointError: missing, incomplete or corrupted checkpoint.
        ValueError: the checkpoint's keys, shapes or dtypes differ from ``like``'s.

    Example: ``state = load("ckpt/step_000100", like=step.init(fs.shard(params, mesh)))``.
    """
    path = os.path.abspath(os.fspath(path))
    keys, likes, spec = _flat(like)
    like_sd = dict(zip(keys, likes))
    where, err = _prepare_load(path, like_sd, _rank(), _world(), verify)
    _first_error(_all_gather_obj(err))
    target = {k: _empty_like(v) for k, v in like_sd.items()}
    try:
        dcp.load(target, storage_reader=dcp.FileSystemReader(where),
                 no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank
        raise CheckpointError(f"incomplete or corrupted checkpoint at {path!r}: reading it "
                              f"failed: {type(e).__name__}: {str(e)[:2000]}") from e
    values = []
    for k, v in zip(keys, likes):
        t = target[k]
        if isinstance(v, torch.Tensor):
            local = t._local_tensor if isinstance(t, DTensor) else t
            t = _like(local, v)
        values.append(t)
    return pytree.unflatten(spec, values)


def _empty_like(v: Any) -> Any:
    if isinstance(v, DTensor):
        local = torch.empty_like(v._local_tensor, requires_grad=False)
        return as_dtensor(local, v)
    if isinstance(v, torch.Tensor):
        return torch.empty_like(v, requires_grad=False)
    return v
