"""Running a measurement on fresh local ranks: ``launch(fn, cfg)`` spawns ``cfg.world``
processes (gloo on CPU), runs ``fn(cfg)`` on each and returns rank 0's result; under
torchrun it runs ``fn`` in place.

    >>> timing = launch(time_modes, cfg)
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from funshard.testing import free_port, under_torchrun

from .modes import Config


def _entry(rank: int, world: int, port: int, out: str, fn, cfg: Config, args: tuple) -> None:
    """One spawned rank: the process group from the environment, ``fn``, rank 0 writes."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    result = fn(cfg, *args)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: with FSDP2's modules alive, gloo's threads were sometimes
    # destroyed while joinable ("terminate called without an active exception", SIGABRT)
    # after the result was already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable, cfg: Config, *args) -> Any:
    """``fn(cfg, *args)`` on ``cfg.world`` fresh local ranks (or in place under torchrun);
    rank 0's result."""
    if under_torchrun():
        return fn(cfg, *args)
    with tempfile.TemporaryDirectory(prefix="funshard-bench-") as d:
        out = os.path.join(d, "result.pkl")
        mp.start_processes(_entry, args=(cfg.world, free_port(), out, fn, cfg, args),
                           nprocs=cfg.world, join=True, start_method="spawn")
        with open(out, "rb") as f:
            return pickle.load(f)
