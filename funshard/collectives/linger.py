"""A failed rank that hosts the store keeps serving it as its process ends.

Rank 0 of a plain ``MASTER_ADDR`` launch serves the TCPStore its peers read; a rank posts
its error there (:mod:`funshard.collectives.failures`) before the error leaves the call.
Once it has, its process keeps the store up at exit until every peer has read the record,
or for up to 3 s, so its peers name its error instead of a lost connection. The exit hook
holds its own reference to the store and the world size: a script that ends as torch asks
(``finally: dist.destroy_process_group()``) has dropped the default process group by then,
and the hook neither needs it nor raises without it.

A peer blocked in a gloo collective reads nothing while the host lingers: gloo closes the
host's connections only when its process group is freed, and a live ``DeviceMesh`` (a
script's global) holds the group past ``destroy_process_group()``, until Python's own
teardown. Only then does the peer's collective fail and the peer read the record. So the
hook ends by parking the store in a daemon thread, where teardown never frees it: the
store then outlives the group until the process itself ends. Measured on 2 gloo CPU
ranks, rank 0 raising in a step under ``finally: dist.destroy_process_group()`` (the peer
reading the store in a loop from the moment its collective failed): the store served the
peer 17-19 ms when freed with the group, 0.32-0.33 s when parked. A peer that read just
too late printed the store's C++ connection error (1 run in 36 here).
"""

from __future__ import annotations

import atexit
import os
import threading
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
    _park(store)


def _park(store) -> None:
    """Keep ``store`` served until the process ends: a daemon thread holds it, and Python's
    teardown frees no daemon thread's locals (see the module's note)."""
    try:
        threading.Thread(target=_hold, args=(store,), daemon=True,
                         name="funshard-store").start()
    except Exception:  # noqa: BLE001 - no thread at exit: the store goes with its group
        return


def _hold(store) -> None:
    threading.Event().wait()  # forever, with ``store`` in this frame
