"""Saving checkpoints: every rank its own shards, atomically; async saving.

``save(path, state)`` checks its arguments on every rank and compares them across ranks
(:mod:`.checks`), claims the path (:mod:`.lock`), writes every rank's own shards with
``torch.distributed.checkpoint`` and commits them atomically (:mod:`.atomic`); with
``async_save`` it snapshots the shards to CPU memory and writes in a background thread over
its own gloo group, with the default group's timeout.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.tensor import DTensor

from .. import _compat
from ..collectives import calls, failures
from .._ranks import _all_gather_obj, _broadcast_obj, _rank, _timeout, _world
from ..state_dict import Tree, state_dict
from .atomic import FORMAT, _commit, _crc32, _recover, _write_marker
from .checks import agree, check_flag, check_keep, check_path, digest, key_info
from .dirs import prune
from .errors import (CheckpointError, _cause, _describe, _first_error, _is_comm_failure,
                     _space, peers)
from .lock import Claim, acquire


def _mesh_info(sd: dict[str, Any]) -> list | None:
    for v in sd.values():
        if isinstance(v, DTensor):
            return [[n, s] for n, s in zip(v.device_mesh.mesh_dim_names, v.device_mesh.shape)]
    return None


@failures.counted("checkpoint.save")
def save(path: str | os.PathLike, state: Tree, *, async_save: bool = False,
         keep: int | None = None) -> str | Future:
    """Write ``state`` as a checkpoint directory: every rank its own shards, atomically.

    Call on every rank, with the same arguments: they are checked and compared across ranks
    before anything is written, and a bad or differing one raises on every rank. The
    directory appears under ``path`` only once every rank's files are durable
    (``fsync``-ed) and rank 0 has written the marker; a crash at any point leaves the
    previous checkpoint at ``path`` loadable. One save at a time writes a path: another
    one in flight there (an async save, another job) is waited for (:mod:`.lock`). A
    symlink at ``path`` is followed: its target is replaced, the link stays.

    Args:
        path: the checkpoint directory, e.g. ``ckpt/step_000100``; replaced if it exists.
        state: a TrainState, params tree or optimizer state (DTensors, tensors, scalars).
        async_save: snapshot the local shards to CPU memory, return at once and write in a
            background thread (own gloo group, default timeout) during the next steps.
        keep: after the commit, rank 0 keeps only the newest ``keep`` complete ``step_<n>``
            checkpoints next to ``path`` (see :func:`prune`).
    Returns:
        ``path`` as a str; with ``async_save`` a ``concurrent.futures.Future`` whose
        ``result()`` is the path once the checkpoint is durable and visible, or raises.
    Raises:
        ValueError, TypeError: bad or differing arguments (on every rank; nothing written).
        CheckpointError: a rank's write failed (the message names the rank, the path and the
            cause: a full disk says so); the previous checkpoint at ``path`` is intact.
        CollectiveTimeout: another rank did not call save (e.g. a save under
            ``if rank == 0:``), or did not answer, within the process group's timeout;
            the message names the ranks and their calls.

    Example: ``save(f"ckpt/step_{state.step:06d}", state, keep=3)``.
    """
    real, err = check_path("save", path)
    # every rank, before any collective: a save on some ranks only is a clear error
    calls.enter("checkpoint.save", f"save to {real or path!r}")
    err = err or check_keep("save", keep) or check_flag("save", "async_save", async_save)
    sd, info = {}, {"keys": {}}
    if err is None:
        try:
            sd = state_dict(state, kind="sharded")
            info = _info(sd)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            err = (type(e).__name__, str(e))
    with peers(f"save to {real or path!r}", "save", _rank()):
        agree("save", err, {"path": real, "keep": keep, "async_save": async_save,
                            "keys": digest(sorted(info["keys"].items()))},
              full={"keys": info["keys"]})
        claim, token = _make_tmp(real)
        keep = (keep, os.path.dirname(os.path.abspath(os.fspath(path))))  # prune the named dir
        try:
            if async_save:
                fut = _write_async(sd, real, token, info, keep=keep, claim=claim,
                                   returns=os.path.abspath(os.fspath(path)))
                claim = None  # the writing thread releases it
                return fut
            _write(sd, real, token, info, keep=keep, pg=None)
            return os.path.abspath(os.fspath(path))
        finally:
            if claim is not None:
                claim.release()


def _info(sd: dict[str, Any]) -> dict:
    """What the marker says of ``sd`` (keys, mesh, step); a value no checkpoint holds raises."""
    for k, v in sd.items():
        if not isinstance(v, (torch.Tensor, int, float, bool, str, type(None))):
            raise TypeError(f"save: {k!r} is a {type(v).__name__}; checkpoints hold tensors and "
                            "Python scalars (int, float, bool, str)")
    return {"keys": key_info(sd), "mesh": _mesh_info(sd),
            "step": sd.get("step") if isinstance(sd.get("step"), int) else None}


def _make_tmp(path: str) -> tuple[Claim | None, str]:
    """Rank 0 claims ``path`` (:mod:`.lock`), recovers it and makes the temporary sibling;
    every rank gets its token. -> ``(the claim on rank 0, else None; token)``."""
    err, token, claim = None, None, None
    if _rank() == 0:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            timeout = _timeout()  # the peers wait for this broadcast that long
            claim = acquire(path, wait=0.5 * (timeout if timeout else 1800.0))
            _recover(path)
            token = uuid.uuid4().hex[:12]
            os.makedirs(f"{path}.tmp-{token}")
        except (OSError, ValueError, CheckpointError) as e:
            if claim is not None:
                claim.release()
                claim = None
            err = (type(e).__name__ if isinstance(e, ValueError) else "CheckpointError",
                   f"save: cannot prepare {path!r}: {e}" if isinstance(e, OSError) else str(e))
    try:
        err, token = _broadcast_obj((err, token))
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    _first_error([err])
    return claim, token


def _write_async(sd, path: str, token: str, info: dict, *, keep: tuple,
                 claim: Claim | None, returns: str) -> Future:
    """Snapshot ``sd`` to CPU, then :func:`_write` it in a thread over its own gloo group."""
    devices: set = set()
    staged = {k: _stage(v, devices) for k, v in sd.items()}
    for d in devices:  # the device-to-host copies were issued without waiting: one wait here
        torch.cuda.synchronize(d)
    timeout = _timeout()
    kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    pg = dist.new_group(backend="gloo", **kw) if dist.is_initialized() else None
    fut: Future = Future()

    def run():
        try:
            _write(staged, path, token, info, keep=keep, pg=pg)
            fut.set_result(returns)
        except BaseException as e:  # noqa: BLE001 - reported through the future
            fut.set_exception(e)
        finally:
            if claim is not None:
                claim.release()

    threading.Thread(target=run, name=f"funshard-save-{token}").start()
    return fut


def _stage(v: Any, devices: set) -> Any:
    """A CPU snapshot of one value (the optimizer updates shards in place). From a GPU it is
    copied into pinned host memory without waiting; ``devices`` collects the GPUs to wait
    for before the snapshot is read."""
    if isinstance(v, DTensor):
        # the same spec around the host copy: from_local would move it back to the mesh's
        # device (a second full copy of the state on the GPU), as torch's own staging avoids
        return DTensor(_host_copy(_compat.local_tensor(v).detach(), devices),
                       _compat.dtensor_spec(v), requires_grad=False)
    if isinstance(v, torch.Tensor):
        return _host_copy(v.detach(), devices)
    return v


def _host_copy(t: torch.Tensor, devices: set) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.to("cpu", copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t, non_blocking=True)
    devices.add(t.device)
    return out


def _write(sd, path: str, token: str, info: dict, *, keep: tuple, pg) -> None:
    """dcp.save into the temporary sibling, checksums, marker, rename (rank 0), barrier.

    ``keep`` is ``(k or None, the directory to prune)``."""
    tmp = f"{path}.tmp-{token}"
    rank = _rank(pg)
    try:
        with peers(f"save to {path!r}", "save", rank, pg):
            gathered = _all_gather_obj(_write_shards(sd, tmp, path, rank, pg), pg)
            errors = [e for _, e in gathered]
            if not any(errors) and any(f is None for f, _ in gathered):
                errors.append(("CheckpointError", f"save to {path!r} failed on another rank"))
            if rank == 0:
                errors += _finish(gathered, tmp, path, token, info, keep, pg)
            errors = _broadcast_obj([e for e in errors if e], pg)  # also the final barrier
    finally:
        if pg is not None and dist.is_initialized():
            dist.destroy_process_group(pg)
    _first_error(errors)


def _finish(gathered, tmp: str, path: str, token: str, info: dict, keep, pg) -> list:
    """Rank 0: marker, commit and prune -- or remove ``tmp`` when a rank failed."""
    try:
        if any(e or f is None for f, e in gathered):
            shutil.rmtree(tmp, ignore_errors=True)
            return []
        _write_marker(tmp, {"format": FORMAT, "time": time.time(), "world_size": _world(pg),
                            **info, "files": {n: f for fs_, _ in gathered for n, f in fs_.items()}})
        _commit(tmp, path, token)
        if keep[0] is not None:
            prune(keep[1], keep=keep[0])
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        return [("CheckpointError", f"save: committing {path!r} failed: {_describe(e)}")]
    return []


def _write_shards(sd, tmp: str, path: str, rank: int, pg) -> tuple[dict, tuple | None]:
    """This rank's dcp.save into ``tmp``: ``({file: {bytes, crc32}}, None)``, ``({}, error)``,
    or ``(None, None)`` when only another rank failed."""
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
        if _is_comm_failure(e):
            raise
        if isinstance(e, CheckpointException) and rank not in e.failures:
            return None, None  # another rank's failure: that rank reports it, with its disk
        _, cause = _cause(e, rank)  # DCP wraps each rank's failure: keep the cause
        space = _space(tmp)
        err = ("CheckpointError", f"save to {path!r} failed on rank {rank}: "
                                  f"{_describe(cause)}; writing {tmp!r}"
                                  + (f" ({space})" if space else ""))
    return files, err
