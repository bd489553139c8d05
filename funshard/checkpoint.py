"""Checkpoints: atomic, resharding, every rank writing its own shards.

``save(path, state)`` writes every rank's own shards with ``torch.distributed.checkpoint``
into a temporary sibling ``<path>.tmp-<id>``; after every rank has finished, rank 0 writes a
marker (:data:`MARKER`: keys, shapes, file sizes and CRC32s) and renames the directory to
``path``. An existing checkpoint at ``path`` is renamed to ``<path>.old-<id>`` first and
removed after; :func:`load` and :func:`latest` resolve the leftovers of a crash between the
two renames, and the next save cleans them up. ``load(path, like)`` checks the marker and
the files before reading anything and reshards to ``like``'s mesh.

    >>> save("ckpt/step_000100", state)                # every rank; returns the path
    >>> state = load(latest("ckpt"), like=state)       # any world size or mesh
    >>> export_full("model.pt", state.params)          # one torch.save file of full tensors

The state dicts (``state_dict`` / ``load_state_dict``) live in :mod:`funshard.state_dict`
and are re-exported here.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import threading
import time
import uuid
import zlib
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.tensor import DTensor

from . import collectives, pytree
from ._ranks import _all_gather_obj, _broadcast_obj, _rank, _world
from .state_dict import (KINDS, LocalShard, Tree, _describe_value, _dtype_name, _flat, _like,
                         load_state_dict, state_dict)

MARKER = "funshard.json"  # written last: a directory without it is not a checkpoint
FORMAT = "funshard-checkpoint/1"
_LEFTOVER = re.compile(r"^(?P<base>.+)\.(?P<kind>tmp|old)-(?P<id>[0-9a-f]{12})$")
_STEP = re.compile(r"^step_(\d+)$")
_DELETING = re.compile(r"^\..+\.deleting-[0-9a-f]{12}$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; nothing was loaded."""


def _first_error(errors: list[Any]) -> None:
    """Raise the first rank's ``(type, message)`` on every rank."""
    for e in errors:
        if e is not None:
            kind, msg = e
            raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, CheckpointError)(msg)


# -- files ------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: str) -> int:
    """CRC32 of a file's bytes (memory-mapped: no copy, the GIL released)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return zlib.crc32(m)


def _marker(path: str) -> dict | None:
    """The parsed marker of a checkpoint directory, or None when absent or unreadable."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


def _leftovers(path: str) -> list[tuple[str, str]]:
    """``(kind, dir)`` of ``<path>.tmp-<id>`` / ``<path>.old-<id>`` siblings."""
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return []
    out = []
    for name in names:
        m = _LEFTOVER.match(name)
        if m and m["base"] == base:
            out.append((m["kind"], os.path.join(parent, name)))
    return out


def _resolve(path: str) -> str | None:
    """The complete directory that holds ``path``'s checkpoint, or None.

    ``path`` itself when it exists; after a crash between the two renames of a commit (no
    ``path``), the newest complete ``<path>.tmp-*`` / ``<path>.old-*`` leftover.
    """
    if os.path.lexists(path):
        return path
    best, best_t = None, None
    for _, d in _leftovers(path):
        m = _marker(d)
        if m is not None and (best_t is None or m.get("time", 0) > best_t):
            best, best_t = d, m.get("time", 0)
    return best


def _recover(path: str) -> None:
    """Rank 0 before a save: roll a crashed commit forward, remove stale leftovers."""
    found = _resolve(path)
    if found is not None and found != path:
        os.rename(found, path)
        _fsync_dir(os.path.dirname(path) or ".")
    for _, d in _leftovers(path):
        shutil.rmtree(d, ignore_errors=True)
    if os.path.lexists(path) and _marker(path) is None:
        names = os.listdir(path) if os.path.isdir(path) else [path]
        foreign = [n for n in names if n != ".metadata" and not n.endswith(".distcp")]
        if foreign:
            raise ValueError(f"save: {path!r} exists and is not a funshard checkpoint (it holds "
                             f"{sorted(foreign)[:5]}); remove it or save to another path")


def _commit(tmp: str, path: str, token: str) -> None:
    """Rename the finished ``tmp`` to ``path``; an old checkpoint goes aside, then away."""
    parent = os.path.dirname(path) or "."
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- save / load -------------------------------------------------------------------------------


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
    for k, v in sd.items():
        if not isinstance(v, (torch.Tensor, int, float, bool, str, type(None))):
            raise TypeError(f"save: {k!r} is a {type(v).__name__}; checkpoints hold tensors and "
                            "Python scalars (int, float, bool, str)")
    info = {"keys": _key_info(sd), "mesh": _mesh_info(sd),
            "step": sd.get("step") if isinstance(sd.get("step"), int) else None}
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
    if not async_save:
        _write(sd, path, token, info, keep=keep, pg=None)
        return path
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
    gathered = _all_gather_obj((files, err), pg)
    errors = [e for _, e in gathered]
    if rank == 0:
        try:
            if any(errors):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                marker = {"format": FORMAT, "time": time.time(), "world_size": _world(pg),
                          **info, "files": {n: f for fs_, _ in gathered for n, f in fs_.items()}}
                with open(os.path.join(tmp, MARKER), "w") as f:
                    json.dump(marker, f)
                    f.flush()
                    os.fsync(f.fileno())
                _fsync_dir(tmp)
                _commit(tmp, path, token)
                if keep is not None:
                    prune(os.path.dirname(path), keep=keep)
        except OSError as e:
            errors.append(("CheckpointError", f"save: committing {path!r} failed: {e}"))
    errors = _broadcast_obj([e for e in errors if e], pg)  # also the final barrier
    if pg is not None and dist.is_initialized():
        dist.destroy_process_group(pg)
    _first_error(errors)


def _check_files(path: str, marker: dict, rank: int, world: int) -> str | None:
    """Sizes of every file; CRC32 of this rank's share (every ``world``-th file)."""
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "the marker lists no files"
    for j, (name, want) in enumerate(sorted(files.items())):
        f = os.path.join(path, name)
        try:
            size = os.path.getsize(f)
        except OSError:
            return f"file {name!r} is missing"
        if size != want["bytes"]:
            return f"file {name!r} has {size} bytes, the marker says {want['bytes']}"
        if j % world == rank and _crc32(f) != want["crc32"]:
            return f"file {name!r} fails its CRC32 check"
    return None


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
    if problems:
        text = "\n  ".join(problems)
        return None, ("ValueError", f"load: the checkpoint at {path!r} does not match like "
                      f"({len(problems)} problem(s)); nothing was loaded:\n  {text}\nFix: pass "
                      "like= a state of the same model and optimizer as the saved one.")
    bad = _check_files(where, marker, rank, world) if verify else None
    if bad:
        return None, ("CheckpointError", f"incomplete or corrupted checkpoint at {path!r}: {bad}")
    return where, None


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
        return collectives.as_dtensor(local, v)
    if isinstance(v, torch.Tensor):
        return torch.empty_like(v, requires_grad=False)
    return v


# -- directories of checkpoints ----------------------------------------------------------------


def _step_dirs(directory: str) -> dict[int, str]:
    """``{step: path}`` of the complete ``step_<n>`` checkpoints in ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    out = {}
    for base in {(_LEFTOVER.match(n)["base"] if _LEFTOVER.match(n) else n) for n in names}:
        m = _STEP.match(base)
        if m:
            path = os.path.join(directory, base)
            where = _resolve(path)
            if where is not None and _marker(where) is not None:
                out[int(m[1])] = path
    return out


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete ``step_<n>`` checkpoint in ``directory``, or None.

    Incomplete saves (no marker) are never returned; a checkpoint whose commit crashed
    between its two renames is returned under its own name (:func:`load` resolves it).

    Example: ``latest("ckpt")`` -> ``'/abs/ckpt/step_000200'`` (step_000100 is older).
    """
    found = _step_dirs(os.path.abspath(os.fspath(directory)))
    return found[max(found)] if found else None


def prune(directory: str | os.PathLike, *, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete ``step_<n>`` checkpoints in ``directory``.

    Call it on one process (``save(..., keep=k)`` does, on rank 0). Each victim is first
    renamed to a hidden ``.<name>.deleting-<id>`` (gone from view at once), then removed; a
    crash mid-delete leaves only such a directory, which the next prune removes. Nothing
    else in ``directory`` is touched.

    Returns:
        the removed checkpoint paths, oldest first.

    Example: with step_000100..step_000400 and ``keep=2`` -> removes 100 and 200.
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"prune: keep={keep!r} must be an int >= 1")
    directory = os.path.abspath(os.fspath(directory))
    found = _step_dirs(directory)
    victims = [found[s] for s in sorted(found)[:-keep]]
    for path in victims:
        where = _resolve(path)
        if where is not None:
            os.rename(where, os.path.join(directory, f".{os.path.basename(path)}.deleting-"
                                                     f"{uuid.uuid4().hex[:12]}"))
        for _, d in _leftovers(path):
            shutil.rmtree(d, ignore_errors=True)
    names = os.listdir(directory) if os.path.isdir(directory) else []
    for name in names:  # this prune's victims and any left by a crash in an earlier one
        if _DELETING.match(name):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return victims


# -- single-file export --------------------------------------------------------------------------


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
