"""``python -m benchmarks.bench``: funshard vs FSDP2, DDP and the compute-only floor, one run.

Every mode trains a copy of the same :class:`funshard.testing.models.GPT` (same seed, same
per-rank batches, AdamW) on the same ranks:

    funshard_full / funshard_grad_op   fs.train_step, reshard_after_forward True / False
    funshard_full_cma                  the same on the opt-in one-host CPU transport (CPU only):
                                       a labelled extra row; every other row moves its bytes
                                       on the backend's collectives (gloo, NCCL)
    funshard_hsdp                      the same on a (2, world/2) ("replicate", "shard") mesh
    fsdp2_full / fsdp2_grad_op / fsdp2_hsdp   fully_shard per block and the root, twins of ^
    ddp                                DistributedDataParallel
    floor                              the same per-rank step with no communication at all

Step time: all modes live in the same processes and run interleaved (A B C, B C A, ...)
after a warm-up; per round the slowest rank counts; a ratio is the median of per-round
ratios (the two modes ran seconds apart, under the same load), the fastest-round ratio is
given beside it. Memory: one launch per mode; OS high-water mark (VmHWM after a reset;
``max_memory_allocated`` on CUDA) and the exact live-tensor peak over one step
(:class:`funshard.testing.LivePeak`: every storage alive at step start or created in the
step, at its size after each op, so storages regrown with ``resize_`` count), the in-step
peak (that peak less what lives between steps: the step's own transient memory), and whether
live tensors grow between steps (a leak). Collectives: counted per step by kind with
:class:`funshard.testing.CountCollectives`, against the lower bound from
:func:`funshard.plan.plan`. World size 1: funshard against the plain single-process step.

    python -m benchmarks.bench                        # 2 gloo ranks on CPU, 8 blocks of 512
    python -m benchmarks.bench --world 4 --blocks 4   # adds the 2x2 hybrid mesh
    torchrun --nproc-per-node 8 -m benchmarks.bench --device cuda
    python -m benchmarks.bench --shapes A,B,C --rounds 4   # the three shapes (and Muon on A)
    python -m benchmarks.bench --single small,large --device cuda   # one GPU, world 1
    python -m benchmarks.bench --simulate 1024 --mesh 8x128 --params 7e9 --vocab 32000 \\
        --seq 2048 --param-dtype bfloat16            # scaling on paper, no collectives

The modes are built in :mod:`benchmarks.modes`, measured in :mod:`benchmarks.measure` on
ranks started by :mod:`benchmarks.launch`, and reported by :mod:`benchmarks.report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from funshard.testing import under_torchrun

from .launch import launch
from .measure import measure_memory, time_modes
from .modes import MODES, Config, default_modes, hsdp_ok
from .shapes import LABELS, SHAPES
from .report import shapes_table, summarize, table
from .simulate import simulate
from .single import single_configs, single_table


def run(cfg: Config, *, memory: bool = True, overhead: bool = True) -> dict:
    """All phases: timing + collectives, memory per mode, world-1 overhead."""
    timing = launch(time_modes, cfg)
    mem = {}
    if memory:
        for m in cfg.modes:
            mem[m] = launch(measure_memory, cfg, m)
    ov = None
    if overhead and cfg.world > 1 and not under_torchrun():
        # the 3% target is below the round-to-round noise: twice the rounds (they are cheap)
        cfg1 = dataclasses.replace(cfg, world=1, modes=("funshard_full", "floor"), profile=(),
                                   rounds=2 * cfg.rounds)
        ov = launch(time_modes, cfg1)
    host = None
    if overhead and not under_torchrun():
        host = launch(time_modes, host_config(cfg))
    return summarize(cfg, timing, mem, ov, host)


def host_config(cfg: Config) -> Config:
    """World 1 on a GPT whose compute is negligible (``blocks`` x 64, seq 8, batch 1): the
    step time is host time, what a GPU waits on (the host overhead, on any device)."""
    return dataclasses.replace(cfg, world=1, kind="gpt", dim=64, hidden=0, vocab=64, seq=8,
                               batch=1, modes=("funshard_full", "floor"), profile=(),
                               rounds=2 * cfg.rounds, steps=max(cfg.steps, 20))


# -- command line ---------------------------------------------------------------------------


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench",
                                 description=__doc__.split("\n")[0])
    d = Config()
    ap.add_argument("--world", type=int, default=None,
                    help=f"local ranks to spawn (default {d.world}; on cuda at most the GPUs "
                         "there are: NCCL ranks cannot share one)")
    ap.add_argument("--shape", default="gpt", choices=tuple(SHAPES),
                    help="the model: gpt (the flags below) or the fixed shapes A, B, C")
    ap.add_argument("--shapes", default="", metavar="A,B,C",
                    help="run these shapes one after another (funshard FULL_SHARD, FSDP2, the "
                         "floor, Muon on A, and on CPU funshard on the cross-memory transport "
                         "as an extra row) and print one table over them")
    ap.add_argument("--blocks", type=int, default=d.blocks)
    ap.add_argument("--dim", type=int, default=d.dim)
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--seq", type=int, default=d.seq)
    ap.add_argument("--batch", type=int, default=d.batch, help="sequences per rank")
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--steps", type=int, default=d.steps, help="steps per mode per round")
    ap.add_argument("--modes", default="", help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (CPU)")
    ap.add_argument("--json", default="", help="write every figure here")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-mode memory launches")
    ap.add_argument("--no-overhead", action="store_true", help="skip the world-size-1 run")
    ap.add_argument("--profile", default="", help="modes to profile on rank 0 (torch.profiler)")
    ap.add_argument("--fused", action="store_true",
                    help="AdamW as one fused kernel in every mode (torch.optim.AdamW(fused=True), "
                         "fs.optim.adamw(fused=True)) instead of foreach")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="bf16: compute in bfloat16, reduce and keep master weights in float32 "
                         "(funshard's Policy, FSDP2's MixedPrecisionPolicy, autocast elsewhere);"
                         " fp16: the same in float16, each mode with dynamic loss scaling "
                         "(Policy(loss_scale='dynamic'), ShardedGradScaler, GradScaler)")
    ap.add_argument("--single", default="", metavar="small,large",
                    help="world 1 on --device: the plain step, FSDP2 and "
                         "funshard on these GPT shapes in float32 and bfloat16")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the *_compile modes")
    ap.add_argument("--simulate", type=int, default=0, metavar="WORLD",
                    help="no collectives: per-rank memory and traffic on WORLD ranks")
    ap.add_argument("--mesh", default="", help="--simulate mesh RxS (replicate x shard)")
    ap.add_argument("--replicate", type=int, default=1)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--params", type=float, default=0, help="--simulate: model size (e.g. 7e9)")
    ap.add_argument("--param-dtype", default="", help="--simulate: e.g. bfloat16")
    return ap.parse_args(argv)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def config_of(args) -> Config:
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world
    if args.device == "cuda" and not _gpus():
        raise SystemExit("bench: --device cuda, but torch sees no CUDA GPU here")
    if world is None:
        world = Config.world if args.device != "cuda" else min(Config.world, _gpus())
    if world < 1:
        raise SystemExit(f"bench: --world {world} must be >= 1")
    if args.device == "cuda" and not under_torchrun() and world > _gpus():
        raise SystemExit(f"bench: --world {world} on cuda needs {world} GPUs (one per rank: "
                         f"NCCL ranks cannot share one); this machine has {_gpus()}")
    modes = tuple(m for m in args.modes.split(",") if m) or default_modes(world, args.device)
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"bench: unknown mode {m!r}; choose from {', '.join(MODES)}")
        if m.endswith("hsdp") and not hsdp_ok(world):
            raise SystemExit(f"bench: mode {m!r} needs an even world >= 4 (2 x world/2 mesh), "
                             f"got {world}")
    if args.dim % max(1, args.dim // 64):
        raise SystemExit(f"bench: --dim {args.dim} must be a multiple of 64 (heads of 64)")
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    cfg = Config(world=world, blocks=args.blocks, dim=args.dim, vocab=args.vocab, seq=args.seq,
                 batch=args.batch, rounds=args.rounds, warmup=max(2, args.warmup),
                 steps=args.steps, modes=modes, device=args.device, threads=threads,
                 profile=tuple(m for m in args.profile.split(",") if m),
                 compile_backend=args.compile_backend, fused=args.fused,
                 precision=args.precision)
    return dataclasses.replace(cfg, **SHAPES[args.shape])


def run_shapes(args) -> dict:
    """The shapes' comparison: each shape in its own launches, one table over them."""
    outs = {}
    for name in args.shapes.split(","):
        if name not in LABELS:
            raise SystemExit(f"bench: --shapes takes {', '.join(LABELS)}, got {name!r}")
        extra = ("funshard_full_cma",) if args.device == "cpu" else ()
        modes = ("funshard_full", "fsdp2_full", "floor") + extra + {
            "A": ("funshard_full_muon",),
            # activation checkpointing and compile, on and off
            "C": ("funshard_full_ac", "fsdp2_full_ac", "funshard_full_compile",
                  "fsdp2_full_compile")}.get(name, ())
        args.shape, args.modes = name, ",".join(modes)
        out = run(config_of(args), memory=not args.no_memory, overhead=False)
        print(f"\n## {LABELS[name]}\n\n{table(out)}", flush=True)
        outs[LABELS[name]] = out
    print(f"\n## funshard FULL_SHARD vs FSDP2 (fully_shard per block), same transport, "
          f"{next(iter(outs.values()))['config']['world']} ranks, AdamW\n\n"
          f"{shapes_table(outs)}")
    return {"shapes": outs}


def run_single(args) -> dict:
    """The one-device comparison: each shape and precision in its own launches."""
    outs = {}
    for label, cfg in single_configs(config_of(args), args.single):
        out = run(cfg, memory=not args.no_memory, overhead=False)
        print(f"\n## {label}\n\n{table(out)}", flush=True)
        outs[label] = out
    print(f"\n## one {args.device} device, world 1, AdamW"
          f"{' (fused)' if args.fused else ''}\n\n{single_table(outs)}")
    return {"single": outs}


def main(argv=None) -> int:
    args = parse(argv)
    if args.shapes:
        out = run_shapes(args)
    elif args.single:
        out = run_single(args)
    elif args.simulate:
        out = simulate(args)
    else:
        cfg = config_of(args)
        out = run(cfg, memory=not args.no_memory, overhead=not args.no_overhead)
        if under_torchrun() and dist.get_rank() != 0:
            return 0
        print(table(out))
        for m, text in out.get("profiles", {}).items():
            print(f"\n## profile: {m} (rank 0, 2 steps, sorted by self CPU time)\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
