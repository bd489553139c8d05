"""Atomic commit of a checkpoint directory, crash recovery and integrity checks.

A save writes into a temporary sibling ``<path>.tmp-<id>``; after every rank has finished,
rank 0 writes a marker (:data:`MARKER`: keys, shapes, file sizes and CRC32s) and renames the
directory to ``path`` (:func:`_commit`). An existing checkpoint at ``path`` is renamed to
``<path>.old-<id>`` first and removed after. :func:`_resolve` finds the complete directory
after a crash between the two renames (load and latest use it), and :func:`_recover`, run
by rank 0 before the next save, rolls such a commit forward and cleans up the leftovers.
A directory without a valid marker is never a checkpoint.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import zlib

MARKER = "funshard.json"  # written last: a directory without it is not a checkpoint
FORMAT = "funshard-checkpoint/1"
_LEFTOVER = re.compile(r"^(?P<base>.+)\.(?P<kind>tmp|old)-(?P<id>[0-9a-f]{12})$")


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


def _write_marker(tmp: str, marker: dict) -> None:
    """Write the finished ``tmp``'s marker durably (the file and the directory fsync-ed)."""
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


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
        try:
            if j % world == rank and _crc32(f) != want["crc32"]:
                return f"file {name!r} fails its CRC32 check"
        except OSError as e:
            return f"file {name!r} cannot be read: {e.strerror or e}"
    return None
