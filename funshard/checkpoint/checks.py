"""Arguments of save and load: checked on every rank, compared across ranks, before any I/O.

Each rank checks its own arguments without raising (:func:`check_path`, :func:`check_keep`,
:func:`check_flag` return an error or None); :func:`agree` then exchanges every rank's first
error and a fingerprint of its arguments in one small collective and raises on every rank:
the first failing rank's error, or a ``ValueError`` naming the argument that differs and its
value on two ranks. Nothing has been written or read when it raises.

    >>> err = check_keep("save", keep) or check_flag("save", "async_save", async_save)
    >>> agree("save", err, {"path": path, "keep": keep, "keys": keys})
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from .._ranks import _all_gather_obj
from ..state_dict import _dtype_name
from .errors import _first_error

# A save also writes ``<name>.tmp-<12 hex>``, ``<name>.old-<12 hex>`` and ``.<name>.lock``.
SUFFIX = len(".tmp-") + 12
_PATH_MAX = 4096


def _name_max(directory: str) -> int:
    """The filesystem's limit on one name's bytes (255 where it cannot be asked)."""
    while directory and not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    try:
        return os.pathconf(directory or "/", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def check_path(op: str, path: Any) -> tuple[str | None, tuple | None]:
    """``(real path, None)`` or ``(None, (type, message))``; symlinks are followed."""
    if path is None and op == "load":
        return None, ("CheckpointError", f"{op}: no checkpoint: path is None. "
                      "fs.checkpoint.latest(dir) returns None when dir holds no complete "
                      "checkpoint: check its result, or pass the directory itself "
                      f"({op}(dir, ...) loads its newest checkpoint and says when there is none)")
    if not isinstance(path, (str, os.PathLike)):
        return None, ("TypeError", f"{op}: path must be a str or os.PathLike, got "
                                   f"{type(path).__name__} {path!r}")
    real = os.path.realpath(os.fspath(path))
    limit = _name_max(os.path.dirname(real))
    base = os.path.basename(real)
    for part in real.split(os.sep)[1:-1]:
        if len(os.fsencode(part)) > limit:
            return None, ("ValueError", f"{op}: the directory name {part[:40]!r}... in {path!r} "
                          f"is {len(os.fsencode(part))} bytes, over this filesystem's limit of "
                          f"{limit} bytes per name; choose a shorter path")
    n = len(os.fsencode(base))
    if n + SUFFIX > limit:
        return None, ("ValueError", f"{op}: the checkpoint name {base[:40]!r}... is {n} bytes; "
                      f"checkpoint names are at most {limit - SUFFIX} bytes (a save also "
                      f"writes '<name>.tmp-<12 hex digits>', and this filesystem allows "
                      f"{limit} bytes per name); choose a shorter name")
    if len(os.fsencode(real)) + SUFFIX + 64 > _PATH_MAX:
        return None, ("ValueError", f"{op}: the path {real[:60]!r}... is "
                      f"{len(os.fsencode(real))} bytes; with the files a checkpoint holds it "
                      f"would exceed the {_PATH_MAX}-byte path limit; choose a shorter path")
    return real, None


def check_keep(op: str, keep: Any) -> tuple | None:
    if keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1):
        return None
    return ("ValueError", f"{op}: keep={keep!r} must be an int >= 1 (or None)")


def check_flag(op: str, name: str, value: Any) -> tuple | None:
    if isinstance(value, bool):
        return None
    return ("TypeError", f"{op}: {name}={value!r} must be True or False")


def key_info(sd: dict[str, Any]) -> dict[str, dict]:
    """``{key: {"shape", "dtype"}}`` of a flat state dict (``{"type"}`` for scalars)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)}
        else:
            out[k] = {"type": type(v).__name__}
    return out


def digest(obj: Any) -> str:
    """A short stable fingerprint of a picklable-by-repr value (key lists, shapes)."""
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def agree(op: str, err: tuple | None, args: dict[str, Any], pg=None, *,
          full: dict[str, dict] | None = None) -> None:
    """One collective: raise on every rank if any rank failed its checks or ranks differ.

    ``args`` are small (paths, flags, digests); a rank that failed sends its error and the
    first failing rank's is raised. Otherwise the first argument whose value differs between
    rank 0 and another rank raises a ValueError naming both. For an argument that is the
    digest of a dict in ``full`` (e.g. the tree's keys and shapes), the dicts are exchanged
    then (a second collective, on every rank) and the first differing key is named.
    """
    gathered = _all_gather_obj((err, args), pg)
    _first_error([e for e, _ in gathered])
    for name, mine in gathered[0][1].items():
        r = next((r for r, (_, a) in enumerate(gathered) if a.get(name) != mine), None)
        if r is None:
            continue
        what = f"{name} is {mine!r} on rank 0 and {gathered[r][1].get(name)!r} on rank {r}"
        if full is not None and name in full:
            dicts = _all_gather_obj(full[name], pg)
            what = _first_difference(name, dicts[0], dicts[r], r)
        raise ValueError(f"{op}: ranks were given different arguments: {what}; every rank must "
                         f"call {op} with the same path, options and tree (the same model and "
                         "optimizer)")


def _first_difference(name: str, a: dict, b: dict, r: int) -> str:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return (f"in the {name}, {k!r} is {a.get(k, 'absent')} on rank 0 and "
                    f"{b.get(k, 'absent')} on rank {r}")
    return f"{name} differ between rank 0 and rank {r}"
