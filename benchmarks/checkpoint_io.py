"""Checkpoint throughput and full-state-dict memory: funshard.checkpoint vs plain DCP.

Spawns ``--world`` gloo ranks (2 by default), builds a sharded ``TrainState`` of about
``--mb`` MB (an MLP of 1024-wide blocks and its AdamW state) and measures, median of
``--reps`` runs, slowest rank, between barriers:

- save: ``fs.checkpoint.save`` (temporary sibling, fsync, CRC32s, marker, rename) against
  ``dcp.save`` of the same DTensor state dict with ``FileSystemWriter`` (fsync on too);
- async save: time until ``save(..., async_save=True)`` returns, and until it is durable;
- load: ``fs.checkpoint.load`` with and without CRC verification against ``dcp.load`` into
  fresh DTensors (the files are in the page cache: this measures the software, not a disk);
- the live-tensor peak on rank 0 of ``state_dict(kind="full", rank0_only=True,
  cpu_offload=True)`` against the model size and against gathering everything at once.

    python benchmarks/checkpoint_io.py              # 2 ranks, ~150 MB, into a temp dir
    python benchmarks/checkpoint_io.py --world 4 --mb 300 --dir /scratch/bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import funshard as fs
from funshard import checkpoint as ck
from funshard.testing.models import MLP
from funshard.testing import LiveMemory, Pool, mesh


def build_state(m, mb: float):
    """An MLP of 1024-wide blocks sized so params + AdamW state are about ``mb`` MB."""
    layers = max(1, round(mb * 1e6 / 3 / 4 / (1024 * 1025)) - 2)
    torch.manual_seed(0)
    model = MLP(dim=1024, hidden=1024, layers=layers, out=1024)
    params = fs.shard(fs.params(model), m)
    opt = fs.optim.adamw(1e-3).init(params)
    for t in fs.pytree.leaves(opt):
        t._local_tensor.normal_()
    return model, fs.TrainState(params, opt, 7)


def _timed(fn) -> float:
    """Seconds of ``fn()`` on the slowest rank (barriers on both sides)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    took = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _fresh(state):
    """Empty DTensors placed like ``state`` (targets for plain dcp.load)."""
    return {k: (fs.layout.as_dtensor(torch.empty_like(v._local_tensor), v)
                if isinstance(v, DTensor) else v)
            for k, v in ck.state_dict(state, "sharded").items()}


def _rm(path: str) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def bench(spec, root: str, mb: float, reps: int) -> dict:
    m = mesh(spec)
    model, state = build_state(m, mb)
    sd = ck.state_dict(state, "sharded")
    nbytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, DTensor))
    like = state  # load reads like's structure and placements only
    times: dict[str, list[float]] = {k: [] for k in (
        "funshard save", "dcp save", "funshard async (returns)", "funshard async (durable)",
        "funshard load", "funshard load (verify=False)", "dcp load")}
    for r in range(reps):
        ours, theirs = os.path.join(root, f"ours{r}"), os.path.join(root, f"dcp{r}")
        order = [("ours", ours), ("dcp", theirs)]
        for which, path in (order if r % 2 == 0 else order[::-1]):  # alternate who goes first
            if which == "ours":
                times["funshard save"].append(_timed(lambda: ck.save(path, state)))
            else:
                times["dcp save"].append(_timed(lambda: dcp.save(
                    sd, storage_writer=dcp.FileSystemWriter(path))))
        box = {}
        times["funshard async (returns)"].append(_timed(
            lambda: box.setdefault("f", ck.save(os.path.join(root, f"async{r}"), state,
                                                async_save=True))))
        times["funshard async (durable)"].append(
            times["funshard async (returns)"][-1] + _timed(lambda: box["f"].result()))
        times["funshard load"].append(_timed(lambda: ck.load(ours, like=like)))
        times["funshard load (verify=False)"].append(
            _timed(lambda: ck.load(ours, like=like, verify=False)))
        times["dcp load"].append(_timed(lambda: dcp.load(
            _fresh(state), storage_reader=dcp.FileSystemReader(theirs))))
        for p in (ours, theirs, os.path.join(root, f"async{r}")):
            _rm(p)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    groups = {}
    for n, p in model.named_parameters():
        g = fs.step.default_group(n)
        groups[g] = groups.get(g, 0) + p.numel() * p.element_size()
    with LiveMemory() as mem:
        full = ck.state_dict(state.params, "full", rank0_only=True, cpu_offload=True)
    del full
    with LiveMemory() as naive:
        full = {k: v.clone() for k, v in fs.unshard(state.params).items()}
    del full
    return dict(times={k: statistics.median(v) for k, v in times.items()}, nbytes=nbytes,
                model_bytes=model_bytes, group_bytes=max(groups.values()),
                groups=len(groups), peak=mem.peak, naive_peak=naive.peak)


def table(res: dict, world: int) -> str:
    mb = res["nbytes"] / 1e6
    t = res["times"]
    rows = [f"TrainState of {mb:.0f} MB (params + AdamW state) on {world} gloo ranks, CPU; "
            "median of the runs, slowest rank.", "",
            "| operation | seconds | MB/s | vs plain DCP |", "|---|---:|---:|---:|"]
    base = {"save": t["dcp save"], "load": t["dcp load"]}
    for name, secs in t.items():
        ref = base["save" if "save" in name or "async" in name else "load"]
        rows.append(f"| {name} | {secs:.3f} | {mb / secs:,.0f} | {ref / secs:.2f}x |")
    mib = 2 ** 20
    rows += ["", "| full state dict (rank0_only, cpu_offload) | MiB |", "|---|---:|",
             f"| model (params) | {res['model_bytes'] / mib:.1f} |",
             f"| largest of {res['groups']} groups | {res['group_bytes'] / mib:.1f} |",
             f"| rank-0 live-tensor peak, funshard | {res['peak'] / mib:.1f} |",
             f"| rank-0 live-tensor peak, unshard everything then copy | "
             f"{res['naive_peak'] / mib:.1f} |"]
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mb", type=float, default=150.0, help="approximate TrainState size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="funshard-ckpt-bench-", dir=args.dir)
    try:
        with Pool(args.world, timeout=1800) as pool:
            res = pool.run(bench, args.world, root, args.mb, args.reps)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(res, args.world))


if __name__ == "__main__":
    main()
