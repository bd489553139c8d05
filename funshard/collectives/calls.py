"""Which funshard call each rank is in; a checkpoint call made on some ranks only.

A checkpoint call (``checkpoint.save`` / ``checkpoint.load``) must be made on every rank:
each rank writes or reads its own shards, in collectives over the whole world. Made on some
ranks only -- the ``torch.save`` habit, ``if rank == 0: fs.checkpoint.save(path, state)`` --
its first collective would pair with whatever the other ranks run next (a step's all-gather):
a hang until the timeout, or gloo ending the process on a size mismatch. So before its first
collective every rank announces its entry through the process group's store (:func:`enter`):

- each rank posts ``funshard/entered/<rank>`` (an id, the call, its number, the time);
- every other rank waits for rank 0's entry into the same call and adds itself to its count
  (``funshard/arrived/<id>``); rank 0 waits for the count to reach the world size, then
  posts ``funshard/go/<id>``, which the others wait for. No collective runs meanwhile.

A rank missing after the process group's timeout (``make_mesh(timeout=)``) ends the wait:
rank 0 posts why under ``go/<id>`` (and marks its entry failed, so that no rank joins it
later) and the ranks that entered raise :class:`.CollectiveTimeout` naming the call, the
missing ranks and where they are. The missing ranks' own collective then times out (or
fails as a waiting rank exits), and :func:`differ`, reading the entries, names the
checkpoint call the others are in. On the success path this costs rank 0 one
counter read per poll and every other rank two key reads (1 ms apart, doubling to 50 ms).

:func:`differ` is what a collective that failed without a posted error says: which rank was
in which call, from the ranks' posted positions (``funshard/stuck/<rank>``) and entries.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid

import torch.distributed as dist

from .._ranks import _timeout
from . import failures
from .failures import PREFIX, CollectiveTimeout, _key, _store

GRACE = 5.0  # seconds past the timeout a rank that entered waits for rank 0's verdict
FRESH = 60.0  # an entry older than the timeout by more is an earlier incident's


def _limit() -> float:
    """The process group's timeout in seconds (torch's default for gloo where unknown)."""
    return _timeout() or 1800.0


def enter(op: str, what: str) -> None:
    """Wait, without a collective, until every rank has entered ``op`` (``"checkpoint.save"``)
    as this rank's current funshard call; else raise :class:`.CollectiveTimeout` on the ranks
    that did, naming the ranks that did not and their calls. ``what`` opens the message
    (``"save to '/ckpt/step_3'"``). A world of one, or no process group: returns at once."""
    store = _store()
    if store is None:
        return
    c, me = failures.CALLS, dist.get_rank()
    limit = _limit()
    mine = {"id": uuid.uuid4().hex[:12], "op": op, "what": c.what, "seq": c.seq,
            "at": time.time(), "text": what}
    end = time.monotonic() + limit
    try:
        store.set(_key("entered", me), json.dumps(mine))
        if me == 0:
            _lead(store, mine, end, limit)
        else:
            _follow(store, mine, end, limit)
    except failures.BACKEND_ERRORS as e:  # the store failed: its host is gone, or its disk
        raise failures.PeerLost(
            f"{what} failed on rank {me}: the process group's store failed while the ranks "
            "entered it: its host (rank 0 under a plain launch) ended or is unreachable, or "
            "this rank cannot write to it (a file store on a full disk); see rank 0's "
            f"output. Store said: {str(e).strip()[:300]}") from e


def _lead(store, mine: dict, end: float, limit: float) -> None:
    """Rank 0: wait for every other rank's arrival; post the verdict under ``go/<id>``."""
    c, world = failures.CALLS, dist.get_world_size()
    count = f"{PREFIX}arrived/{mine['id']}"
    pause = 0.001
    while _count(store, count) < world - 1:
        if time.monotonic() > end:
            text = _refusal(store, mine, limit)
            store.set(f"{PREFIX}go/{mine['id']}", text)  # for the ranks that joined it
            store.set(_key("entered", 0), json.dumps({**mine, "failed": True}))  # no others
            raise CollectiveTimeout(text)
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    store.set(f"{PREFIX}go/{mine['id']}", "")
    before = c.joined.get(0)  # every rank has passed that entry: its collectives ran since
    c.joined[0] = mine["id"]
    delete = getattr(store, "delete_key", None)
    if before is not None and delete is not None:
        with contextlib.suppress(Exception):
            delete(f"{PREFIX}arrived/{before}")
            delete(f"{PREFIX}go/{before}")


def _follow(store, mine: dict, end: float, limit: float) -> None:
    """Another rank: join rank 0's entry into the same call and wait for its verdict."""
    c, me = failures.CALLS, dist.get_rank()
    target, pause = None, 0.001
    while True:
        lead = _entry(store, 0)
        if (lead is not None and lead["op"] == mine["op"] and not lead.get("failed")
                and lead["id"] not in (c.joined.get(0), target)):  # newer than a stale one
            target = lead["id"]
            store.add(f"{PREFIX}arrived/{target}", 1)
        if target is not None and store.check([f"{PREFIX}go/{target}"]):
            text = store.get(f"{PREFIX}go/{target}").decode()
            c.joined[0] = target
            if text:
                raise CollectiveTimeout(f"{text} (rank 0 found it; rank {me} had entered too)")
            return
        if time.monotonic() > end + (GRACE if target is not None else 0.0):
            raise CollectiveTimeout(_refusal(store, mine, limit))
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _count(store, key: str) -> int:
    """A counter's value, read without writing (a file store appends on every add)."""
    return int(store.get(key)) if store.check([key]) else 0


def _entry(store, r: int) -> dict | None:
    """Rank ``r``'s last posted entry, or None."""
    if not store.check([_key("entered", r)]):
        return None
    return json.loads(store.get(_key("entered", r)))


def _refusal(store, mine: dict, limit: float) -> str:
    """Why the entry failed: which ranks did not enter ``mine``'s call, where they are, and
    the fix."""
    me, world = dist.get_rank(), dist.get_world_size()
    missing = []
    for r in range(world):
        with contextlib.suppress(Exception):
            rec = _entry(store, r) if r != me else mine
            if rec is not None and rec["op"] == mine["op"] and rec["seq"] == mine["seq"] \
                    and abs(rec["at"] - mine["at"]) < limit + FRESH:
                continue
        missing.append(r)
    where = differ("waiting for every rank to enter it", wait=1.5, store=store)
    who = _ranks(missing) + (" is" if len(missing) == 1 else " are") if missing else "it is"
    return (f"{mine['text']} failed on rank {me}: another rank did not answer within the "
            f"process group's timeout ({limit:g} s; make_mesh(timeout=...)): {who} stuck, "
            f"died, or did not call {mine['op']}."
            + (where or _why(mine["op"])))


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _why(op: str) -> str:
    verb = "writes" if op.endswith("save") else "reads"
    return (f" {op} is collective: every rank must call it, with the same arguments (each "
            f"rank {verb} its own shards); calling it on some ranks only (as torch.save is "
            f"called under `if rank == 0:`) cannot work: call fs.{op}(...) on every rank.")


def positions(where: str, wait: float = 1.5, store=None) -> dict[int, dict]:
    """A collective failed here without a posted error (a timeout, a peer gone, a refusal):
    post this rank's call and read the other ranks' (theirs fails too, at their timeout, when
    this one's gives up, or at once), or their entry into a checkpoint call, for up to
    ``wait`` seconds: ``{rank: position}``; this rank's alone where there is no store."""
    store = store or _store()
    c, me = failures.CALLS, dist.get_rank()
    mine = {"seq": c.seq, "what": c.what, "where": where, "at": time.time()}
    seen = {me: mine}
    if store is None:
        return seen
    world = dist.get_world_size()
    with contextlib.suppress(Exception):
        store.set(_key("stuck", me), json.dumps(mine))
    end = time.monotonic() + wait
    # a rank whose post differs from this one's is read again until the wait ends: what it
    # posted may be an earlier incident's, its post for this one still to come
    while time.monotonic() < end:
        for r in range(world):
            if r not in seen or not _alike(seen[r], mine):
                got = None
                with contextlib.suppress(Exception):
                    got = _posted(store, r, mine)
                if got is not None:
                    seen[r] = got
        if all_failed_here(seen):
            break
        time.sleep(0.05)
    return seen


def _alike(a: dict, b: dict) -> bool:
    """Two posted positions at the same collective of the same call."""
    return (a["seq"], a["what"], a["where"]) == (b["seq"], b["what"], b["where"])


def all_failed_here(seen: dict[int, dict]) -> bool:
    """Whether every rank posted that it failed in this rank's collective (same call, same
    place, :func:`positions`): no rank is gone and none is elsewhere, so the backend refused
    the collective itself."""
    mine = seen[dist.get_rank()]
    return len(seen) == dist.get_world_size() and all(_alike(s, mine) for s in seen.values())


def differ(where: str, wait: float = 1.5, store=None,
           seen: dict[int, dict] | None = None) -> str:
    """If the ranks' calls differ (:func:`positions`, or ``seen``), the sentence that says
    which rank was in which call (and, where some ranks are in a checkpoint call, that every
    rank must make it); else ""."""
    seen = positions(where, wait, store) if seen is None else seen
    mine, world = seen[dist.get_rank()], dist.get_world_size()
    if all((s["seq"], s["what"]) == (mine["seq"], mine["what"]) for s in seen.values()):
        return ""
    lines = "; ".join(f"rank {r} in its call {s['seq']}, {s['what']} ({s['where']})"
                      for r, s in sorted(seen.items()))
    text = (f" Ranks made different calls: {lines}. Every rank must make the same funshard "
            "calls (steps, saves, loads) in the same order.")
    for op in ("checkpoint.save", "checkpoint.load"):
        inside = [r for r, s in seen.items() if s["what"].startswith(f"{op}(")]
        if inside and len(inside) < world:
            text += (f" {op} was called on some ranks only ({_ranks(sorted(inside))}):"
                     + _why(op))
    return text


def _posted(store, r: int, mine: dict) -> dict | None:
    """Where rank ``r`` is, as it posted: its position when a collective of its failed, or
    its entry into a checkpoint call this rank is not in (same call number, another call)."""
    if store.check([_key("stuck", r)]):
        rec = json.loads(store.get(_key("stuck", r)))
        if abs(rec["at"] - mine["at"]) < FRESH:  # not an earlier incident's
            return rec
    entry = _entry(store, r)
    if (entry is not None and entry["seq"] == mine["seq"] and entry["what"] != mine["what"]
            and abs(entry["at"] - mine["at"]) < _limit() + FRESH):
        return {**entry, "where": "waiting for every rank to enter it"}
    return None
