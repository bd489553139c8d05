"""The backend's collectives as the eager step calls them (``torch.distributed``'s
``all_gather_into_tensor`` / ``reduce_scatter_tensor``) against the traceable ones the
compiled step's program must use (``torch.distributed._functional_collectives``), on one
flat buffer: time per call and peak resident memory over the inputs, each variant in fresh
processes (the peak of a process only grows).

On gloo the functional ones go through the process group's ``*_coalesced`` calls: this
measures what that costs the compiled step on the CPU, apart from anything funshard does.

    python -m benchmarks.functional_collectives [--mib 32] [--world 2] [--calls 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import time

import torch
import torch.distributed as dist

from .launch import launch
from .modes import Config

VARIANTS = ("c10d all_gather", "functional all_gather", "c10d reduce_scatter",
            "functional reduce_scatter")


def _call(variant: str, x: torch.Tensor, big: torch.Tensor, world: int) -> None:
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    if variant == "c10d all_gather":
        dist.all_gather_into_tensor(torch.empty(world * x.numel()), x)
    elif variant == "functional all_gather":
        fc.wait_tensor(fc.all_gather_tensor(x, 0, group))
    elif variant == "c10d reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty(x.numel()), big)
    else:
        fc.wait_tensor(fc.reduce_scatter_tensor(big, "sum", 0, group))


def run_rank(cfg: Config, variant: str, mib: int, calls: int) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # from the environment launch sets
    world = dist.get_world_size()
    x = torch.randn(mib * 1024 * 1024 // 4)  # this rank's shard (float32)
    big = torch.randn(world * x.numel())  # a full gradient, reduce-scattered
    dist.barrier()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _call(variant, x, big, world)  # warm-up
    dist.barrier()
    t = time.perf_counter()
    for _ in range(calls):
        _call(variant, x, big, world)
    dist.barrier()
    ms = (time.perf_counter() - t) / calls * 1e3
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"ms": ms, "peak_mib": peak}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.functional_collectives",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=32, help="each rank's shard, MiB")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=6)
    a = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # freed memory returns
    cfg = dataclasses.replace(Config(), world=a.world, threads=1)
    print(f"torch {torch.__version__}, gloo, {a.world} ranks, {a.mib} MiB shard per rank "
          f"(all_gather output {a.world * a.mib} MiB), {a.calls} calls\n")
    print("| collective | ms per call | peak RSS over the inputs, MiB |\n|---|---:|---:|")
    for v in VARIANTS:
        r = launch(run_rank, cfg, v, a.mib, a.calls)
        print(f"| {v} | {r['ms']:.1f} | {r['peak_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
