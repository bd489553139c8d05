"""What the demo shows and writes on rank 0: progress, memory, the loss curve, the summary.

    >>> bar = progress(total=300, initial=0)         # a tqdm bar, or None without tqdm
    >>> plot(out / "metrics.jsonl", out / "loss.png")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def peak_rss_mb(device: torch.device) -> float:
    """This process's peak on ``device``: CUDA's peak allocation on a GPU, else the peak
    resident memory (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def progress(total: int, initial: int):
    try:
        from tqdm import tqdm
    except ImportError:  # the demo extra is not installed: plain lines instead
        return None
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def plot(metrics: Path, png: Path) -> None:
    """Four panels by step: train and validation loss, learning rate, gradient norm (before
    clipping), tokens/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in recs]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    (loss, lr), (gnorm, speed) = axes
    loss.plot(steps, [r["loss"] for r in recs], lw=1, label="train")
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if val:
        loss.plot(*zip(*val), "o-", ms=3, lw=1.5, label="validation")
    loss.set_ylabel("loss (nats/byte)")
    loss.legend()
    lr.plot(steps, [r["lr"] for r in recs], lw=1, color="tab:green")
    lr.set_ylabel("learning rate")
    gnorm.plot(steps, [r["grad_norm"] for r in recs], lw=1, color="tab:red")
    gnorm.set_ylabel("gradient norm (before clipping)")
    gnorm.set_yscale("log")
    speed.plot(steps, [r["tokens_per_s"] for r in recs], lw=1, color="tab:purple")
    speed.set_ylabel("tokens/s")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(f"funshard demo: {recs[-1]['world']} ranks, mesh {recs[-1]['mesh']}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def print_summary(summary: dict, sample: str, out: Path) -> None:
    print(f"\nfunshard demo: {summary['world']} ranks, mesh {summary['mesh']}, "
          f"policy {summary['policy']}", flush=True)
    if summary["resumed_from"]:
        print(f"  resumed from     {summary['resumed_from'][0]} "
              f"(step {summary['resumed_from'][1]})")
    print(f"  steps            {summary['steps']} ({summary['steps_this_run']} this run, "
          f"{summary['wall_s']:.1f} s)")
    if summary["final_loss"] is not None:
        print(f"  final loss       {summary['final_loss']:.4f} "
              f"(validation {summary['val_loss']:.4f})")
    if summary["tokens_per_s"]:
        print(f"  tokens/s         {summary['tokens_per_s']:,.0f}")
    print(f"  peak memory/rank {summary['peak_mem_mb_per_rank']} MB")
    print(f"  collectives/step {summary['collectives_per_step']}")
    print(f"  outputs          {out}/ (metrics.jsonl, loss.png, summary.json, sample.txt, "
          "checkpoints/)")
    print("  sample:\n    " + sample.replace("\n", "\n    "), flush=True)
