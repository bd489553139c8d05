"""The checkpoint error, raised on every rank with the first failing rank's message."""

from __future__ import annotations

from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; nothing was loaded."""


def _first_error(errors: list[Any]) -> None:
    """Raise the first rank's ``(type, message)`` on every rank."""
    for e in errors:
        if e is not None:
            kind, msg = e
            raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, CheckpointError)(msg)
