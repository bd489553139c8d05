"""One rank's error is every rank's error; ranks make the same calls.

Every collective public call (a step, ``init``, ``checkpoint.save`` / ``load``) runs inside
:func:`call`, which counts it (ranks make the same calls, so call ``n`` on one rank is call
``n`` on every rank). When an exception leaves a call on one rank, that rank posts it
(rank, call, type, message) to the process group's store under ``funshard/failed/<rank>``
and re-raises it. Its peers are then blocked in a collective that rank will never join;
when its process ends (as an uncaught exception ends it, under torchrun too) their
collective fails at once with a backend error ("Connection closed by peer"), and
:func:`explain` turns that into :class:`RankFailed` naming the failing rank, its call and
its message, instead of the backend's words or a wait for the process-group timeout.

A rank whose process hosts the store (rank 0 of a plain ``MASTER_ADDR`` launch; not under
torchrun's agent store) keeps it up for up to 3 s as it exits, so its peers can read why
(measured: they raise about 5 s after its error, against 0.3-2 s otherwise).

Nothing of this runs on the success path: a call costs two integer updates; the store is
read only once a collective has already failed. A record is dropped when its rank starts
its next call (the error was everyone's, e.g. the same ValueError on every rank), and only
records of this rank's current or previous call are read.

Ranks that make different calls (a step on one, a save on the other) block each other until
the process-group timeout; then each posts where it was (:func:`calls_differ`) and the
timeout error names every rank's call. A step also compares its gather order in the
metrics all-reduce it makes anyway (:func:`funshard.step.agree.check_order`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import time

import torch.distributed as dist

PREFIX = "funshard/"


class RankFailed(RuntimeError):
    """Another rank raised inside a funshard call; ``rank`` is it, the message is its."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class PeerLost(RuntimeError):
    """A collective failed because another rank's process ended or closed its connection
    without posting an error (it was killed, or exited early)."""


class _Calls:
    """This process's funshard calls: how many it started, the current one, and whether
    it posted a failure (the one piece of process state: ranks agree through it)."""

    def __init__(self):
        self.seq = 0
        self.what = ""
        self.depth = 0
        self.posted = False
        self.failed_seq = None  # the call this rank last raised in (and posted)
        self.lingering = False


CALLS = _Calls()


def _end_failed() -> None:
    """Last at exit (registered when this module loads) of a process that ends with an
    uncaught error it posted: destroy the process group while Python still runs. Left to
    C++ static destruction, its teardown sometimes aborted the process (SIGABRT, about 1 in
    7 on 2 gloo ranks) after the error was printed."""
    if CALLS.posted and getattr(sys, "last_value", None) is not None:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


atexit.register(_end_failed)


def _store():
    """The default process group's store, or None (feature-detected; a world of one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def call(what: str):
    """Around one collective public call: count it; post an exception leaving it."""
    c = CALLS
    outer = c.depth == 0
    if outer:
        if c.posted:  # this rank's last failure was not waited on: its record goes
            _drop()
        c.seq += 1
        c.what = what
    c.depth += 1
    try:
        yield c.seq
    except BaseException as e:
        if outer and not isinstance(e, (RankFailed, KeyboardInterrupt)):
            post(e)
        raise
    finally:
        c.depth -= 1


def counted(name: str):
    """Decorate a collective public call ``name(path, ...)``: run it in :func:`call`."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with call(f"{name}({str(args[0])[:200]!r})" if args else name):
                return fn(*args, **kwargs)
        return run
    return wrap


def _key(kind: str, rank: int) -> str:
    return f"{PREFIX}{kind}/{rank}"


def post(e: BaseException) -> None:
    """Post this rank's exception for its peers (never raises)."""
    store = _store()
    if store is None:
        return
    rank = dist.get_rank()
    text = " ".join(str(e).split())[:1500]
    try:
        store.set(_key("failed", rank), json.dumps(
            {"rank": rank, "seq": CALLS.seq, "what": CALLS.what, "type": type(e).__name__,
             "message": text}))
    except Exception:  # noqa: BLE001 - a dead store: peers fall back to the backend's words
        return
    CALLS.posted, CALLS.failed_seq = True, CALLS.seq
    if _hosts_store() and not CALLS.lingering:
        CALLS.lingering = True
        atexit.register(_linger, store)


def _drop() -> None:
    store = _store()
    CALLS.posted = False
    if store is not None:
        with contextlib.suppress(Exception):
            store.delete_key(_key("failed", dist.get_rank()))


def _hosts_store() -> bool:
    """This process serves the TCPStore its peers read (rank 0 of a MASTER_ADDR launch)."""
    return (dist.get_rank() == 0 and "MASTER_ADDR" in os.environ
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")


def _linger(store, limit: float = 3.0) -> None:
    """At exit of a failed store host: serve the store until every peer read the record, or
    ``limit`` s (gloo closes this process's connections only as it ends, after this)."""
    world = dist.get_world_size()
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if int(store.add(_key("read", 0), 0)) >= world - 1:
                return
        except Exception:  # noqa: BLE001
            return
        time.sleep(0.05)


def records(store=None, *, shared: bool = True) -> list[dict]:
    """Failure records of other ranks for this rank's current or previous call.
    ``shared=False`` leaves out those of a call this rank raised in too: there the error
    was (also) this rank's, its caller has it, and a peer's record of it says nothing
    about a later collective (a peer that caught it too may just be slow to join)."""
    store = store or _store()
    if store is None:
        return []
    me, out = dist.get_rank(), []
    for r in range(dist.get_world_size()):
        if r == me:
            continue
        try:
            if not store.check([_key("failed", r)]):
                continue
            rec = json.loads(store.get(_key("failed", r)))
        except Exception:  # noqa: BLE001 - the store is gone with its host
            continue
        if not shared and rec.get("seq") == CALLS.failed_seq:
            continue
        if rec.get("seq") in (CALLS.seq, CALLS.seq - 1):
            out.append(rec)
            with contextlib.suppress(Exception):
                store.add(_key("read", r), 1)
    return out


def explain(e: BaseException | None, where: str, *, waiting: bool = False) -> RankFailed | None:
    """A collective failed under ``where`` on this rank: the RankFailed naming the rank
    whose exception caused it, if one posted one. ``waiting``: no collective failed, this
    rank is only waiting for its peers (a direct exchange checks while it waits): a record
    of an error this rank raised too is no reason to stop (see :func:`records`)."""
    found = records(shared=not waiting)
    if not found:
        return None
    rec = min(found, key=lambda r: r["rank"])
    me = dist.get_rank()
    return RankFailed(
        f"funshard: rank {rec['rank']} failed in {rec['what']}: {rec['type']}: "
        f"{rec['message']}\n(rank {me} was in {where} of {CALLS.what}, waiting for it; the "
        "run cannot go on: end every process, fix the cause shown above and resume from the "
        "last checkpoint.)", rank=rec["rank"])


def is_comm_failure(e: BaseException) -> bool:
    """A backend error of a collective: a peer gone, a closed connection, a timeout."""
    errs = tuple(getattr(dist, n) for n in ("DistBackendError", "DistNetworkError",
                                            "DistStoreError") if hasattr(dist, n))
    if isinstance(e, errs):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(
        w in text for w in ("timed out", "timeout", "connection closed", "connection reset",
                            "broken pipe", "gloo"))


def calls_differ(where: str, wait: float = 1.5) -> str:
    """A collective failed here without a posted error (a timeout, a peer gone): post this
    rank's call and read the other ranks' (theirs fails too, at their timeout or when this
    one's gives up); if they differ, the sentence that says which rank was in which call."""
    store = _store()
    if store is None:
        return ""
    me, world = dist.get_rank(), dist.get_world_size()
    mine = {"seq": CALLS.seq, "what": CALLS.what, "where": where, "at": time.time()}
    with contextlib.suppress(Exception):
        store.set(_key("stuck", me), json.dumps(mine))
    seen = {me: mine}
    end = time.monotonic() + wait
    while len(seen) < world and time.monotonic() < end:
        for r in range(world):
            if r not in seen:
                with contextlib.suppress(Exception):
                    if store.check([_key("stuck", r)]):
                        rec = json.loads(store.get(_key("stuck", r)))
                        if abs(rec["at"] - mine["at"]) < 60:  # not an earlier incident's
                            seen[r] = rec
        time.sleep(0.05)
    if all((s["seq"], s["what"]) == (mine["seq"], mine["what"]) for s in seen.values()):
        return ""
    lines = "; ".join(f"rank {r} in its call {s['seq']}, {s['what']} ({s['where']})"
                      for r, s in sorted(seen.items()))
    return (f" Ranks made different calls: {lines}. Every rank must make the same funshard "
            "calls (steps, saves, loads) in the same order.")
