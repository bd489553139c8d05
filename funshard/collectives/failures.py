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
read only once a collective has already failed. Only records of this rank's current or
previous call are read.

[Note: a rank out of step] A rank whose call raised may not go on alone: its peers can
still wait inside that call's collectives (a rank that raised in forward never joins the
rest of the step's gathers), or have updated their shards where it did not. A caller who
catches the error (an out-of-memory error caught to skip a batch) and calls again would
pair this rank's next collectives with their old ones: wrong values or a hang. So after an
exception leaves a call on a world of several ranks, this rank's next call (a counted one,
or one that checks :func:`in_step`: ``unshard``, ``reduce_grads``, the state dicts, an eval
step) settles it first (:func:`_settle`). It goes on only if every rank posted an error
(numbered alike: the n-th since the ranks were last in step) in the same call at the same
point in it (each process group's sequence number and each direct link's exchanges,
counted from the call's start; about 6 us per call): the same refusal on every rank.
Otherwise, and after a :class:`RankFailed`, a timeout, a lost peer or an interrupt, every
later call raises :class:`OutOfStep`, naming the first error. A rank waits up to
``SETTLE_WAIT`` seconds for its peers' records; each rank keeps its last four posted.

Ranks that make different calls (a step on one, a save on the other) block each other until
the process-group timeout; then each posts where it was
(:func:`funshard.collectives.calls.differ`) and the timeout error names every rank's call.
A checkpoint call waits for every rank to enter it
before its first collective (:mod:`funshard.collectives.calls`), so one made on some ranks
only fails by name on every rank instead of pairing its collectives with a step's. A step
also compares its gather order in the metrics all-reduce it makes anyway
(:func:`funshard.step.agree.check_order`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import sys
import time

import torch.distributed as dist

from .. import _compat
from .._ranks import _timeout
from . import linger

PREFIX = "funshard/"
# the process group's own failures (feature-detected): a peer timed out, died or hung up
BACKEND_ERRORS = tuple(getattr(dist, n) for n in ("DistBackendError", "DistNetworkError",
                                                  "DistStoreError") if hasattr(dist, n))


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within the process group's timeout."""


class RankFailed(RuntimeError):
    """Another rank raised inside a funshard call; ``rank`` is it, the message is its."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class OutOfStep(RuntimeError):
    """An earlier funshard call raised on this rank where its peers did not raise alike:
    they may still wait inside that call's collectives, so no further call can pair up."""


class PeerLost(RuntimeError):
    """A collective failed because another rank's process ended or closed its connection
    without posting an error (it was killed, or exited early)."""


class CollectiveRefused(RuntimeError):
    """A collective failed on every rank at once, at the same place of the same call: no rank
    is gone or stuck; the backend refused it (a dtype, an operation or a device it does not
    support, or a bad argument)."""


def refused(what: str, world: int, said: str) -> str:
    """The words of a collective every rank failed alike (:class:`CollectiveRefused`)."""
    return (f"{what} failed on every rank ({world} of {world}, at the same collective of the "
            "same call): the backend refused it, so no rank is gone or stuck (a dtype, an "
            "operation or a device this backend does not support, or a bad argument). "
            f"Backend said: {said}")


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
        self.spoilt: dict | None = None  # a call that raised here, until settled
        self.start: dict | None = None  # position() as the current call began
        self.history: list[dict] = []  # this rank's last posted records, newest last
        self.errors = 0  # errors posted (numbered alike on ranks in step)
        self.joined: dict[int, str] = {}  # rank 0's checkpoint-call entries joined (.calls)


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
    """The default process group's store, or None (a world of one; see funshard._compat)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return _compat.default_store()


@contextlib.contextmanager
def call(what: str):
    """Around one collective public call: count it; post an exception leaving it."""
    c = CALLS
    outer = c.depth == 0
    if outer:
        if c.spoilt is not None:  # see [Note: a rank out of step]
            _settle(c)
        c.seq += 1
        c.what = what
        # where this call starts (about 6 us): a record's position counts from here, since
        # ranks' counts between calls need not agree (point-to-point sends, a rank-0 load)
        c.start = position() if dist.is_initialized() and dist.get_world_size() > 1 else None
    c.depth += 1
    try:
        yield c.seq
    except BaseException as e:
        store = _store() if outer else None
        if store is not None:
            alike = not _peer_caused(e)  # else the run cannot go on: never settled
            now = position()  # where this rank stopped in the call: peers' must match
            rec = _record(e, {k: v - (c.start or {}).get(k, 0) for k, v in now.items()})
            if alike:
                _post_record(store, rec)
            if c.spoilt is None:  # ``unposted``: the store refused it (posted when settling)
                c.spoilt = {"rec": rec, "alike": alike, "unposted": alike and not c.posted}
        raise
    finally:
        c.depth -= 1


def in_step() -> None:
    """Before a collective call that is not counted: settle as a counted call would."""
    if CALLS.spoilt is not None and CALLS.depth == 0:
        _settle(CALLS)


def forget() -> None:
    """Drop this process's errors (the test pool, between tasks on the ranks it keeps)."""
    CALLS.spoilt, CALLS.posted, CALLS.history, CALLS.errors = None, False, [], 0


def _peer_caused(e: BaseException) -> bool:
    """Another rank's failure, a failed collective, an interrupt: never raised alike."""
    return isinstance(e, (RankFailed, OutOfStep, PeerLost, CollectiveTimeout,
                          KeyboardInterrupt, *BACKEND_ERRORS))


SETTLE_WAIT = 5.0  # seconds a rank waits for its peers' records of a call that raised


def _settle(c: _Calls, wait: float | None = None) -> None:
    """Go on if every rank raised alike (its record marked settled), else OutOfStep."""
    bad, store = c.spoilt, _store()
    rec = bad["rec"]
    if bad["unposted"] and store is not None:  # a full disk under a FileStore: once more
        _post_record(store, rec)
        bad["unposted"], bad["alike"] = False, c.posted
    apart = "" if store is None else _every_rank_alike(store, rec, wait) if bad[
        "alike"] else "that error was another rank's failure, a collective's or an interrupt"
    if not apart:
        with contextlib.suppress(Exception):
            if store is not None:
                store.set(_key("settled", dist.get_rank()), str(rec["seq"]))
        c.spoilt, c.posted = None, False
        return
    raise OutOfStep(
        f"funshard: rank {dist.get_rank()} cannot make another funshard call: its call "
        f"{rec['seq']}, {rec['what']}, raised {rec['type']}: {rec['message'][:300]}; the "
        "other ranks did not raise "
        f"alike there ({apart}), so they may still wait inside its collectives (or have "
        "updated where this rank did not), and another call would pair this rank's "
        "collectives with theirs. The run cannot go on: end every process, fix the cause "
        "and resume from the last checkpoint.")


def _every_rank_alike(store, mine: dict, wait: float | None) -> str:
    """'' when every other rank posted its ``n``-th error where this rank raised ``mine``
    (its record): as many collectives into the call on every process group both use (where
    torch gives no counts, in the same call); else which ranks did not, and where they
    stood."""
    me, world = dist.get_rank(), dist.get_world_size()
    here, seq, todo, seen = mine["position"], mine["seq"], set(range(world)) - {me}, {}
    end = time.monotonic() + (SETTLE_WAIT if wait is None else wait)
    while True:
        for r in sorted(todo):
            try:
                recs = _history(store, r)
            except Exception:  # noqa: BLE001 - a dead store: not settled
                return "the store is gone"
            rec = next((x for x in recs if x.get("n") == mine["n"]), None)
            theirs = (rec or {}).get("position", {})
            shared = [k for k in here if k in theirs]
            if rec is not None and (all(theirs[k] == here[k] for k in shared) if shared
                                    else rec.get("seq") == seq):
                todo.discard(r)  # else not posted yet, or another error's record
            seen[r] = {k: theirs[k] for k in shared}
        if not todo:
            return ""
        if time.monotonic() > end:
            return "; ".join(f"rank {r} " + (f"raised at {seen[r]}" if seen.get(r) else
                                             "posted no error there") for r in sorted(todo)) + (
                f"; this rank at {here}")
        time.sleep(0.02)


def _history(store, r: int) -> list[dict]:
    """Rank ``r``'s posted records, newest last (none: [])."""
    if not store.check([_key("failed", r)]):
        return []
    got = json.loads(store.get(_key("failed", r)))
    return got if isinstance(got, list) else [got]


def position() -> dict[str, int]:
    """The collectives this rank has issued, per process group (c10d's sequence numbers,
    feature-detected) and direct link; a call adds alike to every rank's counts."""
    out = _compat.group_positions()  # c10d's, per process group and backend
    for more in POSITIONS:  # the direct transports' links (cma_link adds its own)
        out.update(more())
    return out


# functions giving more positions ``{name: exchanges issued}`` for :func:`position`: a
# transport with counts of its own adds one when it is imported
POSITIONS: list = []


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


def _record(e: BaseException, where: dict) -> dict:
    """A posted error, with no reference to it (its frames may hold memory an OOM's
    catcher wants back)."""
    return {"rank": dist.get_rank(), "seq": CALLS.seq, "what": CALLS.what,
            "type": type(e).__name__, "message": " ".join(str(e).split())[:1500],
            "position": where, "n": CALLS.errors + 1}


def _post_record(store, rec: dict) -> None:
    """Post ``rec`` with this rank's last three (a fast rank's next error must not hide
    this one from a slow peer still settling it)."""
    history = [*CALLS.history[-3:], rec]
    try:
        store.set(_key("failed", rec["rank"]), json.dumps(history))
    except Exception:  # noqa: BLE001 - a dead store: peers fall back to the backend's words
        return
    CALLS.history, CALLS.errors = history, rec["n"]
    CALLS.posted, CALLS.failed_seq = True, rec["seq"]
    if linger.hosts_store() and not CALLS.lingering:
        CALLS.lingering = True
        linger.at_exit(store, _key("read", 0))  # peers count their reads there (records)


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
            recs = _history(store, r)
            if not recs:
                continue
            rec = recs[-1]
        except Exception:  # noqa: BLE001 - the store is gone with its host
            continue
        if not shared and rec.get("seq") == CALLS.failed_seq:
            continue
        with contextlib.suppress(Exception):  # an error every rank raised alike, settled
            if store.check([_key("settled", r)]) and \
                    int(store.get(_key("settled", r))) == rec.get("seq"):
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
    """A backend error of a collective (a peer gone, a closed connection, a timeout): one of
    torch.distributed's error types, or the plain ``RuntimeError`` its backends raise (gloo
    raises it for a timeout and for a lost peer alike). Read by its type only, never by
    its words; funshard's own errors and every narrower type are not such."""
    return isinstance(e, BACKEND_ERRORS) or type(e) is RuntimeError


def timed_out(since: float) -> bool:
    """Whether a collective that failed, waiting since ``since`` (``time.monotonic()``),
    failed at the process group's timeout rather than when a peer left (which the backend
    reports at once): it waited at least 0.8 of the default group's timeout (what
    ``make_mesh(timeout=)`` sets; a subgroup's is never shorter)."""
    limit = _timeout()
    return limit is not None and time.monotonic() - since >= 0.8 * limit

