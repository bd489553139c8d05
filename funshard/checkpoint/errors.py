"""The checkpoint errors: the first failing rank's, raised on every rank; a peer gone.

:func:`_first_error` raises the first rank's ``(type, message)`` on every rank (after the
ranks exchanged them); :func:`peers` turns a collective that timed out or lost its peer into
one clear error at once (:class:`~funshard.CollectiveTimeout` naming the limit, or
:class:`CheckpointError`), instead of waiting out the timeout once more per later collective.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Any

try:
    import resource
except ImportError:  # not on Windows
    resource = None

from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from .._ranks import _timeout
from ..collectives import CollectiveTimeout, calls, failures


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; nothing was loaded."""


_ERRNO = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
          errno.EFBIG: "a file size limit is reached"}


def _first_error(errors: list[Any]) -> None:
    """Raise the first rank's ``(type, message)`` on every rank."""
    for e in errors:
        if e is not None:
            kind, msg = e
            raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, CheckpointError)(msg)


def _cause(e: BaseException, rank: int) -> tuple[int, BaseException]:
    """``(rank, exception)`` that caused ``e``: DCP wraps each failing rank's exception."""
    if isinstance(e, CheckpointException) and e.failures:
        r = min(e.failures)
        f = e.failures[r]
        return r, f[0] if isinstance(f, tuple) else f
    return rank, e


def _describe(e: BaseException) -> str:
    """``OSError: [Errno 28] No space left on device (the disk is full)``: one line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
    hint = _ERRNO.get(getattr(e, "errno", None))
    return f"{text} ({hint})" if hint else text


def _space(directory: str) -> str:
    """What a failed write should say of the disk: its free space and the file size limit
    (torch's writer reports a full disk as 'unexpected pos', without the errno)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    note = f"{free / 2**20:.0f} MiB free on its filesystem"
    if free < 64 * 2**20:
        note = f"the disk is full: {note}"
    if resource is not None:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            note += f"; this process may write files of at most {soft} bytes (ulimit -f)"
    return note


def _is_comm_failure(e: BaseException) -> bool:
    """A collective's failure inside a save or load (DCP wraps every other error of a rank
    in a ``CheckpointException``): by its type, as :func:`failures.is_comm_failure`."""
    return not isinstance(e, CheckpointError) and failures.is_comm_failure(e)


@contextlib.contextmanager
def peers(what: str, op: str, rank: int, pg=None):
    """Around a save's or load's collectives: a stuck or dead peer is one clear error (a
    timeout: one that waited about the process group's timeout, :func:`failures.timed_out`)."""
    since = time.monotonic()
    try:
        yield
    except BaseException as e:
        if not _is_comm_failure(e):
            raise
        failed = failures.explain(e, f"{op}'s collectives")
        if failed is not None:  # another rank's exception: raise that
            raise failed from e
        late = failures.timed_out(since)
        seen = calls.positions(f"{op}'s collectives", wait=1.5 if late else 1.0)
        text, differ = str(e).strip()[:300], calls.differ("", seen=seen)
        if not late and calls.all_failed_here(seen):
            raise CheckpointError(failures.refused(what, len(seen), text)) from e
        if not late:
            raise CheckpointError(f"{what} failed on rank {rank}: another rank is gone (it died "
                                  f"or left the process group).{differ} Backend said: {text}"
                                  ) from e
        t = _timeout(pg)
        raise CollectiveTimeout(
            f"{what} failed on rank {rank}: another rank did not answer within the process "
            f"group's timeout ({'%g s' % t if t else 'torch default'}; make_mesh(timeout=...)): "
            f"it is stuck, died, or did not call {op}."
            f"{differ} Backend said: {text}") from e
