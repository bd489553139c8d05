"""The cross-memory link: how ranks on one host read each other's tensors directly (CPU),
one link per process group (the protocol, the handshake); :mod:`.cma` is the transport.

[Note: cross-memory exchange] On one machine a gloo message crosses the kernel's TCP
loopback: a copy into a socket, a copy out, and the stack in between. Here each rank
publishes where its part of an exchange lies, and each peer copies it straight from that
rank's memory into its own tensors with ``process_vm_readv`` (Linux's cross-memory attach,
which MPI's on-node transports use): one copy per byte, no socket, nothing mapped.

Measured (2026-11-23, this 2-core x86-64 machine, 2 processes, 6.3 MB each way, 50 times):
gloo isend/irecv 3.84 ms; a shared-memory segment (copy in, flag, copy out) 1.03 ms; a
cross-memory read 0.54 ms (a memcpy in one process: 0.45 ms). Cross-memory kept over shared
memory: half the copies, and no pages of a peer become resident in a reader (a segment big
enough for the buckets in flight would count in every rank's peak RSS).

Protocol, per process group. A rank's control block (its own memory; peers read it) holds a
ring of slots and, per peer, the number of that peer's exchanges it has consumed. Every
exchange on the group is numbered, in the order all ranks start them:

- posting exchange ``s``: this rank's part is in place (its own rows of a gather, its
  reduce input); a descriptor lists their addresses; ring slot ``s % RING`` says (kind,
  logical bytes, descriptor, a seal over these and ``s``), its number ``s`` written last;
- consuming a peer's ``s``: once its slot says ``s`` and the seal matches, check it is the
  same collective (a different one, or other sizes, is an error naming both), read the
  descriptor, read the bytes this rank needs, then record ``consumed[peer] = s``;
- ``wait``: consume every earlier exchange in order (nothing hangs on which call a rank is
  in), then wait until every peer consumed this rank's ``s``: until then its tensors stay
  untouched (the caller may free or reuse them after ``wait``).

x86-64 keeps stores in order, so a later read that follows one seeing ``s`` sees the bytes
written before it (the descriptor, the tensors); other machines use ``"p2p"``. Within one
read, though, the kernel's copy (``rep movsb``, a fast-string operation) may load the
slot's words in any order: a slot read while its writer fills it can show ``s`` beside
fields of the exchange that had the slot ``RING`` earlier: matching collectives would be
named as different, and a stale descriptor address would read old tensors' bytes silently.
So each slot carries a seal over its number and fields: a slot whose seal does not match is
not posted yet, and is read again.

Failures: a peer process that is gone ends the read (``ESRCH``: a lost peer); a peer's
posted error is read from the store while waiting
(:class:`~funshard.collectives.failures.RankFailed` at once); past the process group's timeout the
wait times out. A group uses this transport only if every rank passes a handshake through
the store (same host, each can read each peer: ``FUNSHARD_CMA=0`` opts a rank out, and then
``transport="cma"`` raises on every rank of that group). Reading a process takes the
permission to trace it: the same user, and under Yama's ``ptrace_scope`` 1 a rank that
offers this transport lets its user's processes read it (``PR_SET_PTRACER_ANY``). That
permission is the price of the transport: it is taken only where a caller named ``"cma"``
(the handshake is its first use on a group), never by default, and never undone; where it is
not wanted, use ``"c10d"`` (the default) or ``"p2p"``, or set ``FUNSHARD_CMA=0``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import os
import platform
import random
import socket
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from .. import _compat
from . import failures

RING = 64  # exchanges in flight per group before a post waits for peers to consume
_SLOT = 6  # seq, kind, logical bytes, descriptor address, descriptor words, seal
_HEAD = 2  # token, (unused)
_IOV_MAX = 1024
_CALL_BYTES = 1 << 30
_KINDS = {"all-gather": 1, "reduce-scatter": 2, "reduce-scatter from leaves": 3,
          "all-to-all": 4}
_NAMES = {v: k for k, v in _KINDS.items()}


def _seal(seq: int, kind: int, nbytes: int, desc: int, words: int) -> int:
    """A slot's seal, as a signed int64: its number and fields, each times an odd 64-bit
    constant, summed mod 2^64 (a change in any one of them changes it; 0.3 us)."""
    h = (seq * 0x9E3779B97F4A7C15 + kind * 0xC2B2AE3D27D4EB4F + nbytes * 0x165667B19E3779F9
         + desc * 0xD6E8FEB86659FD93 + words * 0xFF51AFD7ED558CCD) & 0xFFFFFFFFFFFFFFFF
    return h - (1 << 64) if h >> 63 else h


class _Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_readv():
    """libc's ``process_vm_readv`` where this transport can work (x86-64 Linux), else None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iov), ctypes.c_ulong, ctypes.POINTER(_Iov),
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV = _load_readv()


def _let_peers_read() -> None:
    """Under Yama's ptrace_scope 1 only a parent may read a process: let this user's other
    processes (the peers) read this one (``PR_SET_PTRACER_ANY``). Called by a rank that
    offers this transport, not on import."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(ctypes.c_int(0x59616D61), ctypes.c_ulong(2**64 - 1),
                                ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _runs(pairs: list[tuple[int, int, int]]):
    """The triples in calls of at most ``_IOV_MAX`` pieces and ``_CALL_BYTES`` bytes (the
    kernel copies at most about 2 GiB per call); a bigger piece is split."""
    run, size = [], 0
    for a, b, n in pairs:
        while n:
            take = min(n, _CALL_BYTES - size)
            run.append((a, b, take))
            a, b, n, size = a + take, b + take, n - take, size + take
            if size == _CALL_BYTES or len(run) == _IOV_MAX:
                yield run
                run, size = [], 0
    if run:
        yield run


def _read(pid: int, rank: int, pairs: list[tuple[int, int, int]]) -> None:
    """Copy ``(local address, remote address, bytes)`` triples from process ``pid``."""
    for run in _runs(pairs):
        loc = (_Iov * len(run))(*[(a, n) for a, _, n in run])
        rem = (_Iov * len(run))(*[(b, n) for _, b, n in run])
        want = sum(n for _, _, n in run)
        got = _READV(pid, loc, len(run), rem, len(run), 0)
        if got == want:
            continue
        err = ctypes.get_errno() if got < 0 else errno.EFAULT
        if err == errno.ESRCH:
            raise RuntimeError(f"Connection closed by peer: rank {rank}'s process (pid {pid}) "
                               "has ended")
        raise RuntimeError(f"funshard: cross-memory read from rank {rank} (pid {pid}) failed: "
                           f"{os.strerror(err)} ({got} of {want} bytes); this is a funshard bug "
                           "unless that process is ending")


class _Exchange:
    """One posted exchange; ``plan(peer, words) -> (reads, zero-fills)`` says what to copy
    from ``peer`` given its descriptor words; ``then`` runs after ``wait``."""

    def __init__(self, link, seq, kind, nbytes, desc, plan, then, keep):
        self.link, self.seq, self.kind, self.nbytes = link, seq, kind, nbytes
        self.desc, self.plan, self.then, self.keep = desc, plan, then, keep
        self.words = len(desc)
        self.done: set[int] = set()

    def wait(self) -> None:
        if self.link is not None:
            self.link.finish(self)
            self.link = None
            if self.then is not None:
                self.then()
        self.desc = self.plan = self.then = self.keep = None


class _Link:
    """This rank's side of one process group: its control block, its peers', the queue."""

    def __init__(self, world: int, rank: int, timeout: float):
        self.world, self.rank, self.timeout = world, rank, timeout
        self.peers = [p for p in range(world) if p != rank]
        self.ctl = (ctypes.c_int64 * (_HEAD + world + RING * _SLOT))()
        self.token = random.getrandbits(62) + 1
        self.ctl[0] = self.token
        self.view = {p: (ctypes.c_int64 * len(self.ctl))() for p in self.peers}
        self.pids: dict[int, int] = {}
        self.addrs: dict[int, int] = {}
        self.seq = 0
        self.pending: list[_Exchange] = []  # posted, not yet consumed from every peer
        self.recent: collections.deque = collections.deque(maxlen=6)  # for a mismatch's error
        self.lock = threading.RLock()

    @property
    def address(self) -> int:
        return ctypes.addressof(self.ctl)

    def look(self) -> None:
        """Read every peer's control block."""
        for p in self.peers:
            _read(self.pids[p], p, [(ctypes.addressof(self.view[p]), self.addrs[p],
                                     ctypes.sizeof(self.ctl))])

    def post(self, kind: str, nbytes: int, words: list[int], plan, then=None,
             keep=()) -> _Exchange:
        with self.lock:
            s = self.seq + 1
            if s > RING and self.peers:  # slot s % RING: every peer done with s - RING
                self._until(lambda: all(self.view[p][_HEAD + self.rank] >= s - RING
                                        for p in self.peers), kind)
            desc = (ctypes.c_int64 * len(words))(*words)
            ex = _Exchange(self, s, _KINDS[kind], nbytes, desc, plan, then, keep)
            at = _HEAD + self.world + (s % RING) * _SLOT
            self.ctl[at + 1], self.ctl[at + 2] = ex.kind, nbytes
            self.ctl[at + 3], self.ctl[at + 4] = ctypes.addressof(desc), ex.words
            self.ctl[at + 5] = _seal(s, ex.kind, nbytes, self.ctl[at + 3], ex.words)
            self.ctl[at] = s  # last (see [Note: cross-memory exchange] on the seal)
            self.seq = s
            self.recent.append((s, kind, nbytes, len(words)))
            if self.peers:
                self.pending.append(ex)
            return ex

    def finish(self, ex: _Exchange) -> None:
        """Consume ``ex`` (and every exchange before it) from every peer; wait until every
        peer consumed this rank's part of it."""
        if not self.peers:
            return
        with self.lock:
            self._until(lambda: ex not in self.pending and all(
                self.view[p][_HEAD + self.rank] >= ex.seq for p in self.peers),
                _NAMES[ex.kind])

    def _progress(self) -> bool:
        """Consume what peers have posted, oldest first; whether anything moved."""
        moved, blocked = False, set()
        for ex in list(self.pending):
            for p in self.peers:
                if p in ex.done or p in blocked:
                    continue
                at = _HEAD + self.world + (ex.seq % RING) * _SLOT
                v = self.view[p]
                if v[at] != ex.seq or v[at + 5] != _seal(ex.seq, *v[at + 1 : at + 5]):
                    blocked.add(p)  # not posted yet (or read half-written): later ones are
                    continue  # not either
                if (v[at + 1], v[at + 2], v[at + 4]) != (ex.kind, ex.nbytes, ex.words):
                    last = ", ".join("#%d %s of %d bytes in %d tensors" % r for r in self.recent)
                    raise RuntimeError(
                        f"funshard: ranks started different collectives on one process group: "
                        f"exchange #{ex.seq} is a {_NAMES.get(v[at + 1], '?')} of {v[at + 2]} "
                        f"bytes in {v[at + 4]} tensors on rank {p} and a {_NAMES[ex.kind]} of "
                        f"{ex.nbytes} bytes in {ex.words} tensors on rank {self.rank} (its last "
                        f"posts: {last}). Every rank must make the same funshard calls (steps, "
                        "saves, loads) in the same order.")
                words = (ctypes.c_int64 * ex.words)()
                if ex.words:
                    _read(self.pids[p], p, [(ctypes.addressof(words), v[at + 3], 8 * ex.words)])
                reads, zeros = ex.plan(p, list(words))
                if reads:
                    _read(self.pids[p], p, reads)
                for z in zeros:
                    z.zero_()
                ex.done.add(p)
                self.ctl[_HEAD + p] = ex.seq
                moved = True
            if len(ex.done) == len(self.peers):
                self.pending.remove(ex)
        return moved

    def _until(self, ready, kind: str) -> None:
        """Make progress until ``ready()``; fail on a peer's error, a lost peer, the timeout."""
        start = time.monotonic()
        check, spins = start + 0.25, 0
        while True:
            self.look()
            moved = self._progress()
            if ready():
                return
            now = time.monotonic()
            if now >= check:
                check = now + 0.25
                failed = failures.explain(None, f"{kind} (cross-memory)", waiting=True)
                if failed is not None:
                    raise failed
            if now - start > self.timeout:
                raise RuntimeError(
                    f"funshard: {kind} (cross-memory) timed out after {self.timeout:.0f} s: "
                    f"waiting for exchange #{self.seq} of peers {self.peers}")
            spins = 0 if moved else spins + 1
            if spins < 64:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 2e-5 * (spins - 63)))


# -- choosing it: one handshake per process group ----------------------------------------------

_LINKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _timeout(pg) -> float:
    t = _compat.pg_timeout(pg)
    return 300.0 if t is None else t


def _host() -> str:
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


def link_of(pg) -> _Link | None:
    """This rank's link on ``pg``, or None where some rank of it cannot use cross-memory
    reads (every rank of ``pg`` gets the same answer; the first call is collective)."""
    got = _LINKS.get(pg, False)
    if got is not False:
        return got
    world, rank = pg.size(), pg.rank()
    link = _Link(world, rank, _timeout(pg))
    if world > 1:
        link = _handshake(pg, link)
    _LINKS[pg] = link
    return link


def _handshake(pg, link: _Link) -> _Link | None:
    store = failures._store()
    if store is None:
        return None
    world, rank = link.world, link.rank
    name = getattr(pg, "group_name", None) or str(dist.get_process_group_ranks(pg))
    key = f"funshard/cma/{name}"
    n = int(store.add(f"{key}/joins", 1))
    base = f"{key}/{(n - 1) // world}"
    able = _READV is not None and os.environ.get("FUNSHARD_CMA", "1") != "0"
    if able:
        _let_peers_read()
    host = _host()
    store.set(f"{base}/me/{rank}", json.dumps(
        {"pid": os.getpid(), "ctl": link.address, "token": link.token, "host": host,
         "able": able}))
    wait = timedelta(seconds=link.timeout)
    store.wait([f"{base}/me/{p}" for p in link.peers], wait)
    peers = {p: json.loads(store.get(f"{base}/me/{p}")) for p in link.peers}
    ok = able and all(q["able"] and q["host"] == host for q in peers.values())
    for p, q in peers.items():
        link.pids[p], link.addrs[p] = q["pid"], q["ctl"]
    if ok:
        try:
            link.look()  # fails where ptrace rules or a sandbox forbid the read
            ok = all(link.view[p][0] == q["token"] for p, q in peers.items())
        except RuntimeError:
            ok = False
    store.set(f"{base}/ok/{rank}", "1" if ok else "0")
    store.wait([f"{base}/ok/{p}" for p in link.peers], wait)
    every = ok and all(store.get(f"{base}/ok/{p}") == b"1" for p in link.peers)
    return link if every else None


def positions() -> dict[str, tuple[int, int]]:
    """Where this rank's links stand, by process-group name: (exchanges posted, of them not
    yet consumed from every peer). Ranks in step agree on it between calls (the test pool
    compares it after each call, so a call that leaves ranks out of step is named)."""
    return {str(getattr(pg, "group_name", "") or id(pg)): (link.seq, len(link.pending))
            for pg, link in list(_LINKS.items()) if link is not None}


# a call's position (failures.position) counts this rank's exchanges on each link
failures.POSITIONS.append(
    lambda: {f"link {name}": int(posted) for name, (posted, _) in positions().items()})


def available(pg) -> bool:
    return pg is not None and link_of(pg) is not None
