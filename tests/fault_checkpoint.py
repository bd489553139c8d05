"""Checkpoint faults that need their own processes: run by tests/test_checkpoint_edges.py as
``python fault_checkpoint.py MODE PORT RANK DIR`` on 2 ranks, with make_mesh(timeout=2).

Modes (each rank prints one line ``RAISED <seconds> <type>: <message>`` or ``NO ERROR``):

- ``async_stuck``: an async save whose writing thread hangs on rank 1 (a stuck disk): rank
  0's future must fail within about the 2 s timeout, not torch's default of 30 minutes.
- ``stopped``: after one save, rank 1 stops answering (it sleeps): rank 0's next save and
  load each fail within about the 2 s timeout.
- ``locked``: ``DIR/ckpt``'s save lock is held by a live process (the test's): the save waits
  about half the timeout, then raises on both ranks and writes nothing.
- ``unreadable``: rank 1 runs as ``nobody`` and cannot read one file: the load raises on both
  ranks, naming the file and rank 1, with ``verify`` (its CRC32 share) and without (the read).
"""

import json
import os
import sys
import time

import torch

import funshard as fs
from funshard.checkpoint import lock

mode, port, rank, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
mesh = fs.make_mesh(timeout=2)
path = f"{base}/ckpt"
state = fs.shard({"w": torch.arange(4096.0).view(64, 64), "b": torch.ones(7)}, mesh)


def attempt(fn):
    t = time.monotonic()
    try:
        fn()
        print("NO ERROR", flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"RAISED {time.monotonic() - t:.1f} {type(e).__name__}: {e}".replace("\n", " | "),
              flush=True)


if mode == "async_stuck":
    if rank == 1:  # its writer never returns; the test kills it
        fs.checkpoint.saving._write_shards = lambda *args: time.sleep(3600)
    fut = fs.checkpoint.save(path, state, async_save=True)
    attempt(lambda: fut.result(timeout=120))
    os._exit(0)
elif mode == "stopped":
    fs.checkpoint.save(path, state)
    if rank == 1:
        time.sleep(60)  # stuck; the test kills it
    attempt(lambda: fs.checkpoint.save(path, state))
    attempt(lambda: fs.checkpoint.load(path, like=state))
    os._exit(0)
elif mode == "locked":
    if rank == 0:  # held by the test process: alive, on this machine
        holder = dict(lock._me("0123456789ab"), pid=os.getppid(),
                      start=lock._start_time(os.getppid()))
        with open(lock.lock_path(path), "w") as f:
            json.dump(holder, f)
    attempt(lambda: fs.checkpoint.save(path, state))
    torch.distributed.barrier()
    if rank == 0:
        print("LEFT", sorted(os.listdir(base)), flush=True)
elif mode == "unreadable":
    fs.checkpoint.save(path, state)
    if rank == 0:  # rank 1 checks the CRC32 of __0_0 and reads its shards from __1_0
        os.chmod(f"{path}/__0_0.distcp", 0o600)
    torch.distributed.barrier()
    if rank == 1 and os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)  # nobody: permission bits apply from here on
    attempt(lambda: fs.checkpoint.load(path, like=state))
    torch.distributed.barrier()
    if rank == 0:
        os.chmod(f"{path}/__0_0.distcp", 0o644)
        os.chmod(f"{path}/__1_0.distcp", 0o600)
    torch.distributed.barrier()
    attempt(lambda: fs.checkpoint.load(path, like=state, verify=False))
    torch.distributed.barrier()
os._exit(0)
