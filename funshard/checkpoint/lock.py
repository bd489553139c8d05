"""The save lock: one save at a time writes a given checkpoint path.

Rank 0 claims ``<parent>/.<name>.lock`` before it touches anything of ``path`` and releases it
after the commit (an async save, when its thread has committed). A second save to the same
path -- an async save of this job still in flight, or another job -- waits for the claim, so
two saves never mix and the second's clean-up never deletes the first's files in flight.

The claim is atomic (``O_CREAT | O_EXCL``) and names its holder: host, boot, pid namespace,
pid and the process's start time. A claim whose holder is gone is taken over: on the holder's
own machine (and pid namespace) its process is looked up; from elsewhere, the holder
refreshes the file's mtime every :data:`HEARTBEAT_S` seconds and a claim left unrefreshed for
:data:`STALE_S` seconds (by the waiter's clock) is stale. A crash mid-save therefore never
blocks the next save for long.

    >>> claim = acquire("/ckpt/step_000100", wait=60.0)   # blocks while another save runs
    >>> ...                                              # recover, write, commit
    >>> claim.release()
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from .errors import CheckpointError

HEARTBEAT_S = 5.0
STALE_S = 30.0


def lock_path(path: str) -> str:
    """``/ckpt/.step_000100.lock`` for ``/ckpt/step_000100``."""
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}.lock")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc is absent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _pid_ns() -> str:
    """This process's pid namespace (containers on one host share its name, not its pids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _me(token: str) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "ns": _pid_ns(), "pid": pid,
            "start": _start_time(pid), "time": time.time(), "token": token}


def _alive(holder: dict | None) -> bool | None:
    """Whether the holder's process runs; None when this machine cannot tell."""
    if (holder is None or holder.get("host") != socket.gethostname()
            or holder.get("ns") != _pid_ns()):
        return None  # another machine, or another container's pids
    if holder.get("boot") != _boot_id():
        return False  # this machine rebooted since
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    start = _start_time(pid)
    return not (start and holder.get("start") and start != holder["start"])  # pid reused


def _read(lock: str) -> dict | None:
    try:
        with open(lock) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class Claim:
    """A held save lock: refreshed by a heartbeat thread until :meth:`release`."""

    def __init__(self, lock: str, token: str):
        self.lock, self.token = lock, token
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name=f"funshard-lock-{token}")
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.lock)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lock file if it is still this claim's (idempotent)."""
        self._stop.set()
        holder = _read(self.lock)
        if holder is not None and holder.get("token") == self.token:
            try:
                os.unlink(self.lock)
            except FileNotFoundError:
                pass


def _try_claim(lock: str, token: str) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(_me(token), f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _break(lock: str, holder: dict | None) -> None:
    """Remove a stale claim -- unless it changed hands since it was judged stale."""
    aside = f"{lock}.stale-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    if _read(aside) != holder:  # a fresh claim was taken meanwhile: put it back
        try:
            os.link(aside, lock)
        except OSError:
            pass
    os.unlink(aside)


def acquire(path: str, *, wait: float) -> Claim:
    """Claim ``path`` for one save, waiting up to ``wait`` seconds for another to finish.

    Raises:
        CheckpointError: the claim is still held by a live save after ``wait`` seconds.
    """
    lock, token = lock_path(path), uuid.uuid4().hex[:12]
    start = time.monotonic()
    seen, pause = None, 0.02
    while True:
        if _try_claim(lock, token):
            return Claim(lock, token)
        holder = _read(lock)
        try:
            mtime = os.stat(lock).st_mtime
        except FileNotFoundError:
            continue  # released just now
        now = time.monotonic()
        if seen is None or seen[0] != mtime:
            seen = (mtime, now)
        alive = _alive(holder)
        if alive is False or (alive is None and now - seen[1] > STALE_S):
            _break(lock, holder)
            continue
        if now - start > wait:
            who = ("pid {pid} on {host}, since {when}".format(
                when=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0))),
                **holder) if holder and "pid" in holder and "host" in holder else "unknown")
            raise CheckpointError(
                f"save: another save to {path!r} is still in progress after {wait:.0f} s "
                f"({lock!r} is held by {who}); wait for it (an async save: its future's "
                f"result()), or remove {lock!r} if no save is running")
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
