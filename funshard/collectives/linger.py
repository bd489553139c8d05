"""A failed rank that hosts the store keeps serving it as its process ends.

Rank 0 of a plain ``MASTER_ADDR`` launch serves the TCPStore its peers read; a rank posts
its error there (:mod:`funshard.collectives.failures`) before the error leaves the call.
Once it has, its process keeps the store up at exit until every peer has read the record,
or for up to 3 s, so its peers name its error instead of a lost connection. The exit hook
holds its own reference to the store and the world size: a script that ends as torch asks
(``finally: dist.destroy_process_group()``) has dropped the default process group by then,
and the hook neither needs it nor raises without it.
"""

from __future__ import annotations

import atexit
import os
import time

import torch.distributed as dist


def hosts_store() -> bool:
    """This process serves the TCPStore its peers read (rank 0 of a MASTER_ADDR launch)."""
    return (dist.get_rank() == 0 and "MASTER_ADDR" in os.environ
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")


def at_exit(store, read_key: str) -> None:
    """Serve ``store`` at exit until the other ranks have each counted a read under
    ``read_key`` (see :func:`linger`); the world size is taken now, while the group lives."""
    atexit.register(linger, store, read_key, dist.get_world_size())


def linger(store, read_key: str, world: int, limit: float = 3.0) -> None:
    """Serve ``store`` until ``world - 1`` peers counted a read under ``read_key``, or
    ``limit`` s (gloo closes this process's connections only as it ends, after this).
    Never raises: it runs at exit."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if int(store.add(read_key, 0)) >= world - 1:
                return
        except Exception:  # noqa: BLE001 - a store that is gone: nothing to serve
            return
        time.sleep(0.05)
