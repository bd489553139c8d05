"""Multi-process test harness: run a function on N gloo ranks and collect every result.

A :class:`Pool` starts ``world`` worker processes once (each with the default process group
initialised on gloo; on the CPU they fork from a server that imported torch once) and runs
many functions on them, so a test suite, or hypothesis with hundreds of examples, pays the
start-up once per world size; :class:`Pools` holds one per world size, which a mesh spec
picks per call (the pytest fixture ``funshard_pool``). A rank that raises fails the
call with every rank's traceback within seconds; a rank that crashes (a signal, an abort in
a C++ thread) fails it with the Python stacks its threads were in; a rank that hangs fails
it at ``timeout`` and the pool restarts itself for the next call (when every rank raised,
the workers are healthy and are kept). A call after which the ranks' cross-memory
exchanges do not stand level (one rank started an exchange its peers never did) fails by
name, and the pool restarts: else the next call would pair one rank's exchange with
another's.

    >>> with Pool(2) as pool:
    ...     pool.run(my_module.check_roundtrip, (7, 3))   # -> [result_rank0, result_rank1]

``fn`` must be importable (a module-level function); arguments and results are pickled.
Inside ``fn``, :func:`funshard.testing.lane.mesh` returns a cached mesh: ``mesh(4)`` is 1-D,
``mesh("2x2")`` is ("replicate", "shard").

The device (:mod:`.lane`): on ``cuda`` each rank takes GPU ``rank % device_count`` and the
process group is NCCL for CUDA tensors beside gloo for CPU ones (``bash scripts/test.sh
--device cuda``, the CUDA lane).
"""

from __future__ import annotations

import multiprocessing as mp
import faulthandler
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as _wait
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..collectives import cma_link, failures
from .lane import DEVICE, devices_for, world_of

class RankError(RuntimeError):
    """One or more ranks raised, hung or died; the message holds every rank's report."""


# -- worker side -------------------------------------------------------------------------

def _worker(rank: int, world: int, init_file: str, conn, pg_timeout: float) -> None:
    # A rank that crashes (a signal, an abort in a backend's thread) writes every thread's
    # Python stack to a file the parent reads into its report: its stderr may belong to a
    # capture that ended long ago (a pytest test that started the pool).
    crash = open(_crash_file(os.path.dirname(init_file), rank), "w")
    faulthandler.enable(file=crash, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = "gloo"
    if DEVICE == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=pg_timeout),
    )
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not msg:
            break
        failures.forget()  # each task starts with no unsettled call of an earlier one
        try:
            fn, args, kwargs = pickle.loads(msg)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            reply = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        reply += (cma_link.positions(),)
        try:
            data = pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001
            data = pickle.dumps(("err", f"result of {fn!r} cannot be pickled: {e}"))
        conn.send_bytes(data)
    dist.destroy_process_group()


def _crash_file(folder: str, rank: int) -> str:
    """Where rank ``rank`` of the pool whose files are in ``folder`` writes as it crashes."""
    return os.path.join(folder, f"crash{rank}")


# -- parent side -------------------------------------------------------------------------


def _out_of_step(replies: dict) -> str:
    """'' when every rank's cross-memory links stand where their peers' do, every exchange
    consumed; else where not. A call that raised on one rank after an exchange its peers
    never started (and was caught, or raised on them before it) leaves its link one exchange
    ahead; one that raised on a mismatched exchange leaves it unconsumed on every rank (the
    next call's exchanges would queue behind it and fail the same way)."""
    by_group: dict[str, dict[int, tuple]] = {}
    for r, rep in replies.items():
        for name, pos in (rep[2] if len(rep) > 2 else {}).items():
            by_group.setdefault(name, {})[r] = pos
    for name, pos in sorted(by_group.items()):
        if len({p[0] for p in pos.values()}) > 1 or any(p[1] for p in pos.values()):
            return f"process group {name!r}, (posted, unfinished) by rank: {pos}"
    return ""


def _context():
    """How ranks start. On the CPU, from a fork server that imported torch and funshard once
    (each rank then starts in milliseconds, not the seconds an import of torch takes: on a
    small machine, a session that starts worlds 1 to 4 waits for 10 imports otherwise); on
    CUDA, spawned, so that no rank inherits a process that touched the driver. A forked
    rank's environment is the server's, taken from this process when its first pool
    started: set environment variables the ranks read before then."""
    if DEVICE == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts (once per process)
    return ctx


class Pool:
    """``world`` spawned gloo ranks that run functions on demand.

    Args:
        world: number of processes.
        timeout: default seconds a call may take before the pool is killed.
        grace: seconds the other ranks get to report after one rank fails.
    """

    def __init__(self, world: int, *, timeout: float = 120.0, grace: float = 3.0):
        if world < 1:
            raise ValueError(f"Pool: world={world} must be >= 1")
        self.world, self.timeout, self.grace = world, timeout, grace
        self._procs: list = []
        self._conns: list = []
        self._dir: str | None = None

    def _start(self) -> None:
        ctx = _context()
        self._dir = tempfile.mkdtemp(prefix="funshard-pool-")
        init_file = os.path.join(self._dir, "store")
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker, args=(rank, self.world, init_file, child, self.timeout),
                daemon=True, name=f"funshard-rank{rank}",
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for c in self._conns:
            try:
                c.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5.0)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        if self._dir is not None:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
            self._dir = None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            RankError: some rank raised, hung past ``timeout`` or died; the message has every
                rank's traceback or state. The pool restarts on the next call.
        """
        try:
            msg = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"Pool.run: {fn!r} or its arguments cannot be pickled ({e}); use a module-level "
                "function and picklable arguments."
            ) from e
        self._send(msg)
        timeout = self.timeout if timeout is None else timeout
        replies, failed_at = self._collect(timeout)
        apart = _out_of_step(replies) if len(replies) == self.world else ""
        if not apart and len(replies) == self.world and all(
                rep[0] == "ok" for rep in replies.values()):
            return [replies[r][1] for r in range(self.world)]
        if apart or len(replies) < self.world or any(
                rep[0] == "died" for rep in replies.values()) or any(
                not p.is_alive() for p in self._procs):
            self._kill()  # some ranks may be stuck in a collective: start afresh next time
        raise RankError(self._report(fn, replies, failed_at, apart, timeout))

    def _send(self, msg: bytes) -> None:
        """``msg`` to every rank, starting the ranks first if they are not running (or a
        rank's end of its pipe is gone: a worker killed from outside)."""
        for attempt in (0, 1):
            if not self._procs:
                self._start()
            try:
                for c in self._conns:
                    c.send_bytes(msg)
                return
            except OSError:
                if attempt:
                    raise
                self._kill()

    def _died(self, r: int) -> tuple:
        p = self._procs[r]
        p.join(1.0)  # its exit code, once the process is reaped
        return ("died", f"rank {r} died (exit code {p.exitcode}){self._crash_log(r)}")

    def _crash_log(self, r: int) -> str:
        """What rank ``r``'s fault handler wrote as it crashed (its start), or ''."""
        if self._dir is None:
            return ""
        try:
            with open(_crash_file(self._dir, r)) as f:
                text = f.read()
        except OSError:
            return ""
        return f"; its threads as it crashed:\n{text[:8000]}" if text.strip() else ""

    def _collect(self, timeout: float) -> tuple[dict, float | None]:
        """Every rank's reply (kind, value, positions) that came by ``timeout``, or by
        ``grace`` after the first failure; and when the first failure came (or None)."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        failed_at = None
        while len(replies) < self.world:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + self.grace)
            if now >= limit:
                break
            pending = {self._conns[r]: r for r in range(self.world) if r not in replies}
            for c in _wait(list(pending), timeout=min(0.5, limit - now)):
                r = pending[c]
                try:
                    replies[r] = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    replies[r] = self._died(r)
                if replies[r][0] != "ok" and failed_at is None:
                    failed_at = time.monotonic()
            for c, r in pending.items():  # a worker killed without closing its pipe
                if r not in replies and not self._procs[r].is_alive():
                    replies[r] = self._died(r)
                    failed_at = failed_at or time.monotonic()
        return replies, failed_at

    def _report(self, fn: Callable, replies: dict, failed_at: float | None, apart: str,
                timeout: float) -> str:
        """The message of a failed call: what each rank did (ok, its traceback, hung)."""
        name = getattr(fn, "__qualname__", repr(fn))
        lines = [f"{name} failed on {self.world} ranks:"]
        if apart:
            lines.append(f"it left the ranks' collectives out of step ({apart}): a later call "
                         "would pair one rank's exchange with another's. The pool restarts.")
        for r in range(self.world):
            kind, val = replies.get(r, ("hung", None))[:2]
            if kind == "ok":
                lines.append(f"--- rank {r}: ok")
            elif kind == "hung":
                why = ("timed out" if failed_at is None
                       else "did not answer after another rank failed")
                lines.append(f"--- rank {r}: {why} ({timeout:.0f}s limit)")
            else:
                lines.append(f"--- rank {r}: {val}")
        return "\n".join(lines)


class Pools:
    """One :class:`Pool` per world size up to ``max_world``, each spawned on first use and
    kept; a mesh spec picks the world per call (what the pytest fixture ``funshard_pool``
    is).

    Args:
        max_world: the most ranks a call may ask for.
        timeout: default seconds a call may take (see :class:`Pool`).
        unavailable: called with the reason when this machine cannot run a world on the
            lane's device (the pytest plugin skips the test); by default RuntimeError.

    >>> pools = Pools(max_world=4)
    >>> pools.run("2x2", my_module.check, tree)   # my_module.check("2x2", tree) on 4 ranks
    """

    def __init__(self, max_world: int = 4, *, timeout: float = 120.0,
                 unavailable: Callable[[str], Any] | None = None):
        if isinstance(max_world, bool) or not isinstance(max_world, int) or max_world < 1:
            raise ValueError(f"Pools: max_world={max_world!r} must be an int >= 1")
        self.max_world, self.timeout = max_world, timeout
        self._unavailable = unavailable
        self._pools: dict[int, Pool] = {}

    def get(self, spec) -> Pool:
        """The pool of ``spec``'s world size, spawned on first use."""
        world = world_of(spec)
        if world > self.max_world:
            raise ValueError(f"mesh {spec!r} needs {world} ranks; this pool runs at most "
                             f"{self.max_world} (pytest: --funshard-max-world={world})")
        why = devices_for(world)
        if why:
            if self._unavailable is not None:
                self._unavailable(f"{DEVICE} lane: {why}")
            raise RuntimeError(f"{DEVICE} lane: {why}")
        if world not in self._pools:
            self._pools[world] = Pool(world, timeout=self.timeout)
        return self._pools[world]

    def run(self, spec, fn: Callable, *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list:
        """``fn(spec, *args, **kwargs)`` on every rank of ``spec``'s world; the results in
        rank order. ``fn`` builds its mesh with :func:`funshard.testing.lane.mesh`.

        Raises:
            RankError: some rank raised, hung or died; the message has every rank's
                traceback. The pool keeps serving (restarted if a rank was stuck).
        """
        return self.get(spec).run(fn, spec, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        """Stop every pool's workers."""
        for p in self._pools.values():
            p.close()
        self._pools = {}
