"""A directory of ``step_<n>`` checkpoints: the newest complete one; pruning the rest."""

from __future__ import annotations

import os
import re
import shutil
import uuid

from .atomic import _LEFTOVER, _leftovers, _marker, _resolve

_STEP = re.compile(r"^step_(\d+)$")
_DELETING = re.compile(r"^\..+\.deleting-[0-9a-f]{12}$")


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


def _hidden(directory: str, path: str) -> str:
    return os.path.join(directory, f".{os.path.basename(path)}.deleting-{uuid.uuid4().hex[:12]}")


def _delete(target: str) -> None:
    """Hide ``target`` (a rename in its own directory), then remove it."""
    if os.path.isdir(target):
        hidden = _hidden(os.path.dirname(target), target)
        os.rename(target, hidden)
        shutil.rmtree(hidden, ignore_errors=True)


def prune(directory: str | os.PathLike, *, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete ``step_<n>`` checkpoints in ``directory``.

    Call it on one process (``save(..., keep=k)`` does, on rank 0). Each victim is first
    renamed to a hidden ``.<name>.deleting-<id>`` (gone from view at once), then removed; a
    crash mid-delete leaves only such a directory, which the next prune removes. A victim
    that is a symlink goes with its target. Nothing else in ``directory`` is touched.

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
        if where is not None and os.path.islink(where):  # a link to elsewhere: both go
            _delete(os.path.realpath(where))
            os.unlink(where)
        elif where is not None:
            os.rename(where, _hidden(directory, path))
        for _, d in _leftovers(path):
            shutil.rmtree(d, ignore_errors=True)
    names = os.listdir(directory) if os.path.isdir(directory) else []
    for name in names:  # this prune's victims and any left by a crash in an earlier one
        if _DELETING.match(name):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return victims
