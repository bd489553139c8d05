"""Loading checkpoints: checked on every rank before reading, resharded to ``like``'s mesh.

``load(path, like)`` checks its arguments and compares them across ranks, resolves a
directory of ``step_<n>`` checkpoints to its newest one, checks the marker, the keys and
shapes against ``like`` and every file (sizes; CRC32s split over the ranks) -- one rank's
failure is every rank's error, naming the file -- and only then reads with
``torch.distributed.checkpoint``, whose pickles are read through allowlists (:mod:`.trust`:
a checkpoint from elsewhere cannot run code).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.tensor import DTensor

from ..collectives import calls, failures
from .. import _compat, pytree
from ..layout import as_dtensor, layout_of
from .._ranks import _rank, _world
from ..state_dict import Tree, _describe_value, _like
from ..state_keys import SCALE, _flat, later_fields
from .atomic import _LEFTOVER, MARKER, _check_files, _marker, _resolve
from .checks import agree, check_flag, check_path, digest, key_info
from .dirs import latest
from .errors import CheckpointError, _cause, _describe, _is_comm_failure, peers
from .trust import Planner, Reader, read_metadata

SHOWN = 3  # problems of each kind listed in a mismatch message; the rest are counted


@failures.counted("checkpoint.load")
def load(path: str | os.PathLike | None, like: Tree, *, verify: bool = True) -> Tree:
    """Read a checkpoint written by :func:`save` into a new tree placed like ``like``.

    Call on every rank, with the same arguments. Any world size or mesh works: each rank
    reads the pieces of its own shards (``torch.distributed.checkpoint`` reshards). Before
    reading, the marker, the keys, shapes and dtypes and every file's size (and, with
    ``verify``, CRC32, each rank checking a share) are checked; a failure on any rank
    raises on every rank and loads nothing.

    Args:
        path: a checkpoint directory (e.g. from :func:`latest`), or a directory of
            ``step_<n>`` checkpoints, whose newest complete one is loaded. ``None`` (what
            ``latest`` returns for a directory without one) raises "no checkpoint".
        like: a tree of the same structure (e.g. ``step.init(params)``); its values are
            neither used nor modified.
        verify: check CRC32s (reads every file once more, split over the ranks).
    Returns:
        a new tree like ``like`` (the saved ``step`` included).
    Raises:
        CheckpointError: no checkpoint, or a missing, incomplete, corrupted or unreadable one.
        ValueError: keys, shapes or dtypes differ from ``like``'s, or the ranks' arguments do.
        CollectiveTimeout: another rank did not call load (``if rank == 0:``) or answer
            within the process group's timeout; the message names the ranks and their calls.

    Example: ``state = load("ckpt/step_000100", like=step.init(fs.shard(params, mesh)))``.
    """
    keys, likes, spec = _flat(like)
    for k, v in zip(keys, likes):  # the same on every rank: before any collective
        if isinstance(v, DTensor):
            layout_of(k, v, what="checkpoint.load", model=True)  # what it lays out, or an error
    like_sd = dict(zip(keys, likes))
    later = later_fields(like, like_sd)
    real, err = check_path("load", path)
    # every rank, before any collective: a load on some ranks only is a clear error
    calls.enter("checkpoint.load", f"load from {real or path!r}")
    err = err or check_flag("load", "verify", verify)
    where, meta = None, None
    if err is None:
        real, err = _newest_in(real)
    if err is None:
        where, err = _prepare_load(real, like_sd, _rank(), _world(), verify, later)
    if err is None:  # DCP's metadata pickle, read through an allowlist (.trust)
        try:
            meta = read_metadata(os.path.join(where, ".metadata"))
        except CheckpointError as e:
            err = ("CheckpointError", str(e))
    info = key_info(like_sd)
    target = {k: _empty_like(v) for k, v in like_sd.items()}
    with peers(f"load from {real or path!r}", "load", _rank()):
        agree("load", err, {"path": real, "verify": verify,
                            "like": digest(sorted(info.items()))}, full={"like": info})
        _read(target, where, real, meta)
    values = []
    for k, v in zip(keys, likes):
        if k not in target:  # a field the checkpoint predates: what it meant there
            values.append(later[k])
            continue
        t = target[k]
        if isinstance(v, torch.Tensor):
            local = _compat.local_tensor(t) if isinstance(t, DTensor) else t
            t = _like(local, v)
        values.append(t)
    return pytree.unflatten(spec, values)


def _read(target: dict, where: str, path: str, meta) -> None:
    """dcp.load into ``target``, no pickle read but through an allowlist (:mod:`.trust`);
    DCP raises a rank's read error on every rank."""
    try:
        dcp.load(target, storage_reader=Reader(where, meta), planner=Planner(path),
                 no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank
        if _is_comm_failure(e):
            raise
        r, cause = _cause(e, _rank())
        if isinstance(cause, CheckpointError):  # a refusal of .trust: its own words
            raise CheckpointError(f"{cause} (found by rank {r})") from e
        raise CheckpointError(f"incomplete or corrupted checkpoint at {path!r}: reading it "
                              f"failed on rank {r}: {_describe(cause)}") from e


def _newest_in(path: str) -> tuple[str | None, tuple | None]:
    """A directory of checkpoints (no checkpoint files of its own) -> its newest one."""
    if (not os.path.isdir(path) or _marker(path) is not None
            or _LEFTOVER.match(os.path.basename(path))):  # a save's own temporary

        return path, None
    try:
        names = os.listdir(path)
    except OSError:
        return path, None  # _prepare_load says why
    if any(n in (".metadata", MARKER) or n.endswith(".distcp") for n in names):
        return path, None
    found = latest(path)
    if found is None:
        return None, ("CheckpointError", f"load: no checkpoint under {path!r}: it holds no "
                      "complete step_<n> checkpoint (saves that did not finish never count)")
    return os.path.realpath(found), None


def _prepare_load(path: str, like_sd: dict, rank: int, world: int, verify: bool,
                  later: dict | None = None):
    """Resolve, read the marker, check keys and files; -> (dir, None) or (None, (type, msg)).
    A key of ``later`` the checkpoint lacks is dropped from ``like_sd`` (see
    funshard.state_keys.later_fields)."""
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
    for k in later or {}:
        if k not in saved:
            like_sd.pop(k, None)
    if later:  # a TrainState without loss scaling resumes a run saved with it: not read
        saved = {k: v for k, v in saved.items() if k in like_sd or not k.startswith(SCALE)}
    problems = _key_problems(saved, like_sd)
    if problems:
        text = "\n  ".join(_shorten(problems))
        return None, ("ValueError", f"load: the checkpoint at {path!r} does not match like "
                      f"({len(problems)} problem(s)); nothing was loaded:\n  {text}\nFix: pass "
                      "like= a state of the same model and optimizer as the saved one.")
    bad = _check_files(where, marker, rank, world) if verify else None
    if bad:
        return None, ("CheckpointError", f"incomplete or corrupted checkpoint at {path!r}: {bad}"
                                         + (f" (found by rank {rank})" if world > 1 else ""))
    return where, None


def _shorten(problems: list[str]) -> list[str]:
    """At most :data:`SHOWN` lines of each kind (missing, shape, dtype, ...); the rest counted."""
    kinds: dict[str, list[str]] = {}
    for p in problems:
        kinds.setdefault(p.split(" key ")[0].split(" mismatch ")[0], []).append(p)
    out = []
    for kind, ps in kinds.items():
        what = f"{kind} keys" if kind in ("missing", "unexpected") else f"{kind} mismatches"
        out += ps[:SHOWN] + ([f"... and {len(ps) - SHOWN} more {what}"] if len(ps) > SHOWN else [])
    return out


def _key_problems(saved: dict, like_sd: dict) -> list[str]:
    """Every difference between the marker's keys and ``like``'s, one line each."""
    problems = []
    for k, v in like_sd.items():
        want = key_info({k: v})[k]
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


def _empty_like(v: Any) -> Any:
    if isinstance(v, DTensor):
        local = torch.empty_like(_compat.local_tensor(v), requires_grad=False)
        return as_dtensor(local, v)
    if isinstance(v, torch.Tensor):
        return torch.empty_like(v, requires_grad=False)
    return v
