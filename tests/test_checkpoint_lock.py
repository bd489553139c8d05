"""The save lock on its own (one process): a claim from another machine is judged by its
heartbeat; see tests/test_checkpoint_edges.py for saves that wait on it across ranks."""

import json
import os
import threading
import time

import pytest

from funshard.checkpoint import CheckpointError, lock


def claim_from_another_machine(path):
    with open(lock.lock_path(path), "w") as f:
        json.dump(dict(lock._me("0123456789ab"), host="elsewhere", pid=1), f)


def test_a_claim_from_another_machine_is_stale_once_its_heartbeat_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "STALE_S", 1.0)
    path = str(tmp_path / "ckpt")
    claim_from_another_machine(path)
    stop = threading.Event()

    def heartbeat():  # the other machine's save, alive for 2.5 s
        end = time.monotonic() + 2.5
        while time.monotonic() < end and not stop.wait(0.2):
            os.utime(lock.lock_path(path))

    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        with pytest.raises(CheckpointError, match=r"is held by pid 1 on elsewhere, since "):
            lock.acquire(path, wait=1.5)  # alive: waited for, then refused
        claim = lock.acquire(path, wait=30.0)  # the heartbeat stops: taken over
        assert not beat.is_alive()  # only once the other save had stopped refreshing it
    finally:
        stop.set()
        beat.join()
    assert json.load(open(lock.lock_path(path)))["token"] == claim.token
    claim.release()
    assert os.listdir(tmp_path) == []
