"""The demo's command line: its flags and their checks, made before any process starts.

    >>> args = build_parser().parse_args(["--nproc", "2", "--mesh", "1x2"])
    >>> validate(args, world=2)               # raises UsageError: one line, no traceback
    >>> parse_mesh("2x2", 4, "full")          # (replicate, shard) == (2, 2)

A used ``--out`` is refused unless ``--resume`` (continue it) or ``--force`` (delete its
outputs and checkpoints, then start over); a torch elastic restart resumes by itself.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from funshard import checkpoint

from corpus import load_corpus

POLICIES = ("full", "grad-op", "no-shard")
DEFAULT_OUT = "runs/demo"


class UsageError(Exception):
    """A bad flag: reported as one line, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags (``bash scripts/demo.sh --help``)."""
    t = argparse.ArgumentParser(
        prog="funshard train",
        description="funshard demo training run: train a small GPT on a shipped text corpus "
        "(bash scripts/demo.sh or python examples/gpt/train.py)",
    )
    t.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    t.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    t.add_argument("--seq", type=int, default=64, help="sequence length (bytes)")
    t.add_argument("--dim", type=int, default=96, help="model width")
    t.add_argument("--layers", type=int, default=4, help="transformer blocks")
    t.add_argument("--heads", type=int, default=4, help="attention heads")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    t.add_argument("--warmup", type=int, default=50,
                   help="linear warm-up steps (at most half of --steps); a short warm-up at "
                   "--lr 3e-3 gives a loss spike (README)")
    t.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    t.add_argument("--policy", choices=POLICIES, default="full",
                   help="full: FULL_SHARD, grad-op: SHARD_GRAD_OP, no-shard: DDP-like")
    t.add_argument("--mixed-precision", action="store_true", help="bf16 compute, fp32 reduce")
    t.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    t.add_argument("--mesh", default=None,
                   help="RxS: replicate x shard (default: 2x2 for 4 processes, else 1xN)")
    t.add_argument("--nproc", type=int, default=4,
                   help="local processes to start when not under torchrun")
    t.add_argument("--corpus", default=None, help="a UTF-8 text file (default: shipped KJV)")
    t.add_argument("--out", default=None,
                   help=f"output directory (default: {DEFAULT_OUT}, or the next free "
                   f"{DEFAULT_OUT}-N when it holds a run; with --resume, the newest of them)")
    t.add_argument("--ckpt-dir", default=None,
                   help="checkpoint directory (default: OUT/checkpoints)")
    t.add_argument("--ckpt-every", type=int, default=100,
                   help="checkpoint interval in steps (0: no checkpoints)")
    t.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint")
    t.add_argument("--force", action="store_true",
                   help="start over in a used --out: delete its metrics, plot, summary, sample "
                   "and checkpoints first")
    t.add_argument("--eval-every", type=int, default=50,
                   help="validation loss every this many steps (0: only at the end)")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart the local processes this many times after a failure; a "
                   "restarted run resumes from the latest checkpoint (as under torchrun)")
    t.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection: the last rank kills itself before this step, on the "
                   "first attempt only")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train: auto is CUDA (NCCL) when a GPU is there, else the CPU "
                   "(gloo)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--sample", type=int, default=300, help="bytes of text to sample at the end")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    return t


def parse_mesh(text: str | None, world: int, policy: str) -> tuple[int, int]:
    """``"2x2"`` -> (replicate, shard), checked against the world size."""
    if policy == "no-shard":
        if text is not None and parse_mesh(text, world, "full")[1] != 1:
            raise UsageError(f"--policy no-shard replicates everything; use --mesh {world}x1")
        return world, 1
    if text is None:
        return (2, world // 2) if world == 4 else (1, world)
    try:
        rep, sh = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--mesh {text!r} is not RxS (e.g. 2x2)") from None
    if rep < 1 or sh < 1 or rep * sh != world:
        raise UsageError(
            f"--mesh {text} needs {rep * sh} processes but the world has {world}; "
            f"use --nproc {rep * sh} or a mesh whose product is {world}"
        )
    return rep, sh


def validate(args: argparse.Namespace, world: int) -> None:
    """Refuse bad flags with a :class:`UsageError` before any process starts (and choose
    ``--out`` when it was not given)."""
    if args.out is None:
        args.out = default_out(args)
    if args.ckpt_every < 0:
        raise UsageError(f"--ckpt-every must be >= 0, got {args.ckpt_every}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    for name in ("warmup", "eval_every"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("steps", "batch", "seq", "dim", "layers", "heads", "accumulate", "nproc",
                 "keep"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.sample < 0:
        raise UsageError(f"--sample must be >= 0, got {args.sample}")
    if args.dim % args.heads:
        raise UsageError(f"--dim {args.dim} is not divisible by --heads {args.heads}")
    if args.batch % args.accumulate:
        raise UsageError(
            f"--batch {args.batch} does not split into --accumulate {args.accumulate} "
            "micro-batches; use a batch divisible by it"
        )
    if args.lr <= 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    if args.corpus is not None and not Path(args.corpus).is_file():
        raise UsageError(f"--corpus {args.corpus}: no such file")
    parse_mesh(args.mesh, world, args.policy)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # this node's processes
    if device_of(args) == "cuda" and local > torch.cuda.device_count():
        raise UsageError(
            f"--device cuda with {local} processes here needs {local} GPUs, this machine has "
            f"{torch.cuda.device_count()} (NCCL ranks cannot share one); use --nproc "
            f"{torch.cuda.device_count()} or --device cpu"
        )
    if args.resume and args.force:
        raise UsageError("--resume continues the run in --out, --force deletes it; pick one")
    if args.resume:
        if checkpoint.latest(ckpt_dir_of(args)) is None:
            raise UsageError(f"--resume: no complete checkpoint under {ckpt_dir_of(args)}")
    elif not args.force and not restarted():
        used = previous_run(args)
        if used:
            raise UsageError(
                f"--out {args.out} already holds a run ({', '.join(used)}); pass --resume to "
                "continue it, --force to delete it and start over, or another --out"
            )
    corpus = load_corpus(args.corpus)
    if len(corpus) < 2 * (args.seq + 1):
        raise UsageError(f"--corpus has {len(corpus)} bytes; it needs at least {2 * args.seq + 2}")


def device_of(args: argparse.Namespace) -> str:
    """``"cuda"`` or ``"cpu"``: what ``--device`` resolves to on this machine."""
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def ckpt_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.ckpt_dir) if args.ckpt_dir else Path(args.out) / "checkpoints"


OUTPUTS = ("metrics.jsonl", "loss.png", "summary.json", "sample.txt")  # what a run writes


def previous_run(args: argparse.Namespace) -> list[str]:
    """What a run before this one left in ``--out`` (outputs, checkpoints)."""
    out, ckpt = Path(args.out), ckpt_dir_of(args)
    used = [name for name in OUTPUTS if (out / name).exists()]
    if ckpt.is_dir() and any(ckpt.iterdir()):
        used.append(f"{ckpt}/")
    return used


def default_out(args: argparse.Namespace) -> str:
    """``runs/demo`` when unused, else the next free ``runs/demo-N`` (so the README command
    runs again as written); with ``--resume``, the newest used one. It is always
    ``runs/demo`` with ``--force`` or ``--ckpt-dir``, and under torchrun (where every process
    would choose on its own)."""
    if args.force or args.ckpt_dir or "RANK" in os.environ:  # --force: start over in it
        return DEFAULT_OUT
    names = [DEFAULT_OUT] + [f"{DEFAULT_OUT}-{n}" for n in range(2, 10_000)]
    used = []
    for name in names:
        args.out = name
        if not previous_run(args):
            break
        used.append(name)
    args.out = None
    if args.resume:
        return used[-1] if used else DEFAULT_OUT
    if used:
        print(f"{used[-1]} holds an earlier run: this one writes to {name} "
              "(--resume continues the newest, --force starts over in one)", flush=True)
    return name


def restarted() -> bool:
    """A torch elastic restart after a failure: it resumes by itself (never --force)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
