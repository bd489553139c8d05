"""``python -m benchmarks.bench --single small,large``: world 1 on one device.

A world of one on this machine's device (``--device cuda``: one GPU, NCCL) compares three
steps of the same GPT, AdamW, same batches, interleaved rounds:

    plain      the model called directly, ``torch.optim.AdamW``; bfloat16 under autocast
    FSDP2      ``fully_shard`` per block and the root; bfloat16: ``MixedPrecisionPolicy``
    funshard   ``fs.train_step`` FULL_SHARD; bfloat16: ``Policy(param_dtype, reduce_dtype)``

on two shapes, each in float32 and in bfloat16 (compute in bfloat16, reduce and master
weights in float32):

    small   4 x 256, vocab 256, seq 128, batch 8: on a GPU the step is host time
    large   12 x 1024, vocab 32000, seq 1024, batch 8

and prints step time, peak memory (``max_memory_allocated`` on CUDA; on the CPU the
live-tensor peak) and the targets: funshard at most 1.3x the plain step on the
small shape, on the large one in bfloat16 at most 1.10x plain and 0.8x FSDP2, and peak
memory at most FSDP2's on every row. On the CPU (no GPU at hand) only the small shape is
practical; its figures say nothing about a GPU's.
"""

from __future__ import annotations

import dataclasses

from .modes import Config
from .report import targets_lines

SINGLE = {
    "small": dict(kind="gpt", blocks=4, dim=256, vocab=256, seq=128, batch=8),
    "large": dict(kind="gpt", blocks=12, dim=1024, vocab=32000, seq=1024, batch=8),
}
MODES = ("floor", "fsdp2_full", "funshard_full")


def single_configs(base: Config, names: str) -> list[tuple[str, Config]]:
    """``(label, config)`` per shape and precision (both, unless ``base`` asks for bf16):
    world 1, the three modes."""
    out = []
    for name in names.split(","):
        if name not in SINGLE:
            raise SystemExit(f"bench: --single takes {', '.join(SINGLE)}, got {name!r}")
        for precision in ("fp32", "bf16") if base.precision == "fp32" else (base.precision,):
            cfg = dataclasses.replace(base, world=1, modes=MODES, precision=precision,
                                      **SINGLE[name])
            out.append((f"{name} {precision}", cfg))
    return out


def _peak(row: dict, device: str) -> float | None:
    """Peak memory, MiB: the allocator's on CUDA, the live tensors' on the CPU."""
    return row.get("os_peak_mb" if device == "cuda" else "live_peak_mb")


def single_table(outs: dict[str, dict]) -> str:
    """The table over ``{label: summarize(...)}`` and the targets it meets or not."""
    lines = ["| shape | plain ms | FSDP2 ms | funshard ms | funshard x plain | "
             "funshard x FSDP2 | peak MiB plain / FSDP2 / funshard | funshard mem x FSDP2 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    checks = []
    for label, out in outs.items():
        m, dev = out["modes"], out["config"]["device"]
        fs, twin, plain = m["funshard_full"], m["fsdp2_full"], m["floor"]
        peaks = [_peak(r, dev) for r in (plain, twin, fs)]
        mem = peaks[2] / peaks[1] if None not in peaks[1:] else None
        peak_text = " / ".join("-" if p is None else f"{p:.0f}" for p in peaks)
        lines.append(
            f"| {label} | {plain['step_ms']:.2f} | {twin['step_ms']:.2f} | "
            f"{fs['step_ms']:.2f} | {fs['x_floor']:.3f} | {fs['x_twin']:.3f} | {peak_text} | "
            f"{'-' if mem is None else f'{mem:.3f}'} |")
        shape, precision = label.split()
        if shape == "small" and precision == "fp32":
            checks.append((f"{label}: funshard / plain", fs["x_floor"], 1.3))
        if shape == "large" and precision == "bf16":
            checks.append((f"{label}: funshard / plain", fs["x_floor"], 1.10))
            checks.append((f"{label}: funshard / FSDP2", fs["x_twin"], 0.8))
        if mem is not None:
            checks.append((f"{label}: peak memory funshard / FSDP2", mem, 1.0))
    return "\n".join(lines + targets_lines(checks))
