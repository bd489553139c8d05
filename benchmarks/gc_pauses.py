"""What Python's cyclic garbage collector costs a training loop: mean step time over many
steps, with the collector's own time and its full collections, per step mode.

After ``torch.compile`` a process holds hundreds of thousands of Python objects (dynamo's
and inductor's). A full collection walks all of them (about half a second on the
host-bound GPT here); it runs when enough objects have been promoted to the oldest
generation, which a step that leaves reference cycles behind, or holds many objects when a
young collection runs, brings about. A median over rounds hides such pauses; this takes
the mean over ``--steps`` steps per mode, interleaved in rounds of 50, after one full
collection (the one every process pays once after compiling).

    python -m benchmarks.gc_pauses [--steps 2000] [--modes floor_compile,funshard_full_compiled]

World 1, the host-bound GPT (:func:`benchmarks.bench.host_config`), bfloat16 compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

from .bench import host_config
from .launch import launch
from .modes import Config, batches, build_mode, build_model, meshes_for

ROUND = 50


class _Collector:
    """Time in the cyclic collector and full collections, from ``gc.callbacks``."""

    def __init__(self):
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._t0
        self.full += info["generation"] == 2


def run_rank(cfg: Config, steps: int) -> dict:
    meshes = meshes_for(cfg, cfg.modes)
    base, data = build_model(cfg), batches(cfg, 0)
    runners = {m: build_mode(m, base, cfg, meshes) for m in cfg.modes}
    for run in runners.values():  # warm-up: the compiled step's first (eager) and second
        for i in range(4):
            run.step(data[i % len(data)])
    gc.collect()
    seen = _Collector()
    gc.callbacks.append(seen)
    out = {m: [0.0, 0.0, 0] for m in cfg.modes}  # step seconds, collector seconds, full
    try:
        for _ in range(steps // ROUND):
            for m, run in runners.items():
                s0, f0 = seen.seconds, seen.full
                t0 = time.perf_counter()
                for i in range(ROUND):
                    run.step(data[i % len(data)])
                out[m][0] += time.perf_counter() - t0
                out[m][1] += seen.seconds - s0
                out[m][2] += seen.full - f0
    finally:
        gc.callbacks.remove(seen)
    return {"out": out, "steps": steps // ROUND * ROUND, "objects": len(gc.get_objects())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gc_pauses",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps per mode")
    ap.add_argument("--modes", default="floor_compile,funshard_full_compiled,funshard_full")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(host_config(Config(device=args.device)), precision="bf16",
                              modes=tuple(args.modes.split(",")))
    res = launch(run_rank, cfg, args.steps)
    n = res["steps"]
    print(f"\nhost-bound GPT, world 1, bfloat16, {args.device}: {n} steps per mode; "
          f"{res['objects']:,} objects tracked by the collector at the end\n")
    print("| mode | mean ms per step | collector ms per step | full collections |")
    print("|---|---:|---:|---:|")
    for m, (t, g, full) in res["out"].items():
        print(f"| {m} | {t / n * 1e3:.2f} | {g / n * 1e3:.3f} | {full} |")


if __name__ == "__main__":
    main()
