"""Local launching: a free TCP port for a rendezvous, and whether torchrun started us.

    >>> endpoint = f"127.0.0.1:{free_port()}"
    >>> world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else nproc
"""

from __future__ import annotations

import socket

from ..mesh import under_torchrun

__all__ = ["free_port", "under_torchrun"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
