"""The demo training run: ``funshard train`` (or ``python -m funshard train``).

Trains a small byte-level GPT (token embedding, pre-norm blocks, tied head) on a text corpus
shipped with the package. Without a launcher it starts ``--nproc`` local processes itself
with torch's elastic launcher (gloo on CPU) on a ``--mesh`` replicate x shard mesh (default
4 processes, 2x2). Under ``torchrun`` it uses the environment (NCCL on GPUs) and the mesh
given by ``--mesh``. Rank 0 shows progress, writes metrics (JSON lines), a loss curve,
checkpoints and a text sample under ``--out``.

    funshard train                          # 4 local CPU processes, 2x2 mesh
    funshard train --nproc 2 --mesh 1x2 --steps 50
    torchrun --nproc-per-node 8 -m funshard train --mesh 2x4 --dim 512 --layers 12
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import uuid
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist

POLICIES = ("full", "grad-op", "no-shard")


class UsageError(Exception):
    """A bad flag: reported as one line, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="funshard", description="funshard demo training run")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a small GPT on a shipped text corpus")
    t.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    t.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    t.add_argument("--seq", type=int, default=64, help="sequence length (bytes)")
    t.add_argument("--dim", type=int, default=96, help="model width")
    t.add_argument("--layers", type=int, default=4, help="transformer blocks")
    t.add_argument("--heads", type=int, default=4, help="attention heads")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
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
    t.add_argument("--out", default="runs/demo", help="output directory")
    t.add_argument("--ckpt-dir", default=None,
                   help="checkpoint directory (default: OUT/checkpoints)")
    t.add_argument("--ckpt-every", type=int, default=100,
                   help="checkpoint interval in steps (0: no checkpoints)")
    t.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart the local processes this many times after a failure; a "
                   "restarted run resumes from the latest checkpoint (as under torchrun)")
    t.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection: the last rank kills itself before this step, on the "
                   "first attempt only")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--sample", type=int, default=300, help="bytes of text to sample at the end")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


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
    if args.ckpt_every < 0:
        raise UsageError(f"--ckpt-every must be >= 0, got {args.ckpt_every}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
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
    if args.resume:
        from funshard import checkpoint

        if checkpoint.latest(ckpt_dir_of(args)) is None:
            raise UsageError(f"--resume: no complete checkpoint under {ckpt_dir_of(args)}")
    corpus = load_corpus(args.corpus)
    if len(corpus) < 2 * (args.seq + 1):
        raise UsageError(f"--corpus has {len(corpus)} bytes; it needs at least {2 * args.seq + 2}")


def ckpt_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.ckpt_dir) if args.ckpt_dir else Path(args.out) / "checkpoints"


def load_corpus(path: str | None) -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes."""
    if path is None:
        data = resources.files("funshard").joinpath("data/kjv.txt").read_bytes()
    else:
        data = Path(path).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(data: torch.Tensor, step: int, dp_rank: int, batch: int, seq: int, seed: int):
    """Random windows keyed by (seed, step, data-parallel rank): resumable and deterministic."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + dp_rank)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()  # (B, T+1)
    return rows[:, :-1], rows[:, 1:]


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), or CUDA's peak allocation."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(args: argparse.Namespace) -> dict:
    """One rank's training run (the process group comes from the environment)."""
    import funshard as fs
    from funshard.testing.models import GPT, gpt_loss
    from funshard.testing import CountCollectives

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    world = int(os.environ["WORLD_SIZE"])
    rep, sh = parse_mesh(args.mesh, world, args.policy)
    mesh = fs.make_mesh(shard=sh, replicate=rep, device_type=device_type)
    rank = dist.get_rank()
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    torch.manual_seed(args.seed)
    model = GPT(vocab=256, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq)
    model.to(device)
    policy = fs.Policy(
        reshard_after_forward=args.policy == "full",
        param_dtype=torch.bfloat16 if args.mixed_precision else None,
        reduce_dtype=torch.float32 if args.mixed_precision else None,
        accumulate=args.accumulate,
        clip_norm=args.clip or None,
    )
    warmup = max(1, args.steps // 20)

    def lr(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    step_fn = fs.train_step(gpt_loss(model), fs.optim.adamw(lr, weight_decay=0.1), policy=policy)
    state = step_fn.init(fs.shard(fs.params(model), mesh))
    out = Path(args.out)
    ckpt_dir = ckpt_dir_of(args)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    resumed_from = None
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if args.resume or (restarted and fs.checkpoint.latest(ckpt_dir) is not None):
        path = fs.checkpoint.latest(ckpt_dir)
        state = fs.checkpoint.load(path, like=state)
        resumed_from = (str(path), state.step)
    data = load_corpus(args.corpus)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    dp_rank = rank  # every rank is a data-parallel rank (HSDP: replicate x shard)
    tokens_per_step = args.batch * args.seq * world
    metrics_file = open(out / "metrics.jsonl", "a") if rank == 0 else None
    bar = _progress(args.steps, state.step) if rank == 0 and not args.no_progress else None
    collectives = None
    losses = []
    t_start = time.perf_counter()
    first_step = state.step
    while state.step < args.steps:
        if args.fail_at_step == state.step and not restarted and rank == world - 1:
            os.kill(os.getpid(), 9)  # a crash: no clean-up, no exception
        x, y = get_batch(train_data, state.step, dp_rank, args.batch, args.seq, args.seed)
        t0 = time.perf_counter()
        if collectives is None and state.step > first_step:  # count one steady-state step
            with CountCollectives() as cc:
                state, m = step_fn(state, (x.to(device), y.to(device)))
            collectives = dict(cc.counts)
        else:
            state, m = step_fn(state, (x.to(device), y.to(device)))
        dt = time.perf_counter() - t0
        losses.append(m["loss"])
        if rank == 0:
            rec = {"step": state.step, "loss": m["loss"], "grad_norm": m["grad_norm"],
                   "lr": lr(state.step - 1), "step_s": dt, "tokens_per_s": tokens_per_step / dt,
                   "peak_mem_mb": peak_rss_mb(), "world": world, "mesh": f"{rep}x{sh}"}
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                                mem=f"{rec['peak_mem_mb']:.0f}MB")
                bar.update(1)
        if args.ckpt_every and (state.step % args.ckpt_every == 0 or state.step == args.steps):
            fs.checkpoint.save(ckpt_dir / f"step_{state.step:06d}", state)
            if rank == 0:
                fs.checkpoint.prune(ckpt_dir, keep=args.keep)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start
    steps_run = state.step - first_step
    with torch.no_grad():
        full = fs.unshard(state.params)  # one gather serves evaluation and sampling
    val = _eval(model, full, val_data, args, device)
    sample = _sample(model, full, args, device)
    del full
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_rss_mb())
    summary = {
        "final_loss": losses[-1] if losses else None,
        "val_loss": val,
        "steps": state.step,
        "steps_this_run": steps_run,
        "tokens_per_s": tokens_per_step * steps_run / wall if steps_run else None,
        "wall_s": wall,
        "peak_mem_mb_per_rank": [round(p, 1) for p in peaks],
        "collectives_per_step": collectives,
        "world": world,
        "mesh": f"{rep}x{sh}",
        "policy": args.policy,
        "resumed_from": resumed_from,
    }
    if rank == 0:
        metrics_file.close()
        (out / "sample.txt").write_text(sample)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _plot(out / "metrics.jsonl", out / "loss.png")
        _print_summary(summary, sample, out)
    return summary


def _progress(total: int, initial: int):
    try:
        from tqdm import tqdm
    except ImportError:  # the demo extra is not installed: plain lines instead
        return None
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


@torch.no_grad()
def _eval(model, full, data, args, device) -> float:
    """Mean validation loss over a few fixed batches, with the full parameters."""
    from funshard.testing.models import gpt_loss

    loss_fn = gpt_loss(model)
    losses = [loss_fn(full, tuple(t.to(device) for t in
                                  get_batch(data, i, 0, args.batch, args.seq, args.seed + 1)))
              .item() for i in range(4)]
    return sum(losses) / len(losses)


@torch.no_grad()
def _sample(model, full, args, device) -> str:
    """Greedy-ish sampling (temperature 0.8) from the trained model, same on every rank."""
    g = torch.Generator().manual_seed(args.seed)
    idx = torch.tensor([list(b"And ")], device=device)
    for _ in range(args.sample):
        logits = torch.func.functional_call(model, full, (idx[:, -args.seq:],))[0, -1].float()
        probs = torch.softmax(logits.cpu() / 0.8, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=g).to(device)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def _plot(metrics: Path, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"funshard demo: {recs[-1]['world']} ranks, mesh {recs[-1]['mesh']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _print_summary(summary: dict, sample: str, out: Path) -> None:
    print(f"\nfunshard demo: {summary['world']} ranks, mesh {summary['mesh']}, "
          f"policy {summary['policy']}", flush=True)
    if summary["resumed_from"]:
        print(f"  resumed from     {summary['resumed_from'][0]} (step {summary['resumed_from'][1]})")
    print(f"  steps            {summary['steps']} ({summary['steps_this_run']} this run, "
          f"{summary['wall_s']:.1f} s)")
    if summary["final_loss"] is not None:
        print(f"  final loss       {summary['final_loss']:.4f} (validation {summary['val_loss']:.4f})")
    if summary["tokens_per_s"]:
        print(f"  tokens/s         {summary['tokens_per_s']:,.0f}")
    print(f"  peak memory/rank {summary['peak_mem_mb_per_rank']} MB")
    print(f"  collectives/step {summary['collectives_per_step']}")
    print(f"  outputs          {out}/ (metrics.jsonl, loss.png, summary.json, sample.txt, "
          "checkpoints/)")
    print("  sample:\n    " + sample.replace("\n", "\n    "), flush=True)


def _worker(args: argparse.Namespace) -> dict:
    """Entry point of each launched process."""
    try:
        return train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` processes with torch's elastic launcher (gloo on CPU)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"funshard-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=args.max_restarts,
        monitor_interval=0.5, start_method="spawn",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    elastic_launch(config, _worker)(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_launcher else args.nproc
    try:
        validate(args, world)
        if under_launcher:
            _worker(args)
            return 0
        return launch_local(args)
    except UsageError as e:
        print(f"funshard train: error: {e}", file=sys.stderr)
        return 2
