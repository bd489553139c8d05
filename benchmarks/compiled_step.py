"""``train_step(compile=True)`` measured against the eager step and FSDP2, on the same ranks.

Two runs, each on fresh local ranks (gloo on CPU):

- ``--shapes A,B,C`` (world 2): per shape, funshard's eager FULL_SHARD step, the compiled
  step, FSDP2 (``fully_shard`` per block and root) and FSDP2 with ``block.compile()`` per
  block, in one process per rank, interleaved round by round. Step time: per round the
  slowest rank, then the median; ratios are medians of per-round ratios. Memory: each
  step's resident high-water mark over the resident size at its start
  (``/proc/self/clear_refs`` + ``VmHWM``, glibc told to unmap every freed buffer over
  128 KiB so resident memory follows live buffers, the compiled program's too: a dispatch
  mode, :class:`funshard.testing.LivePeak`, does not see inside a compiled program), and
  that plus the state every mode keeps (parameter shards and AdamW's two moments, float32).
- ``--host`` (world 1): the host-bound GPT of :func:`benchmarks.bench.host_config` in
  bfloat16, the plain step with ``model.compile()`` against the compiled step, and the eager
  step and the plain step for scale.

Every mode moves its bytes on the backend's collectives. Graphs and graph breaks are
dynamo's counters after the warm-up and after the timed rounds (equal: no recompile).

On the CPU the times and the memory come from two launches: the timed ranks keep freed
memory mapped for reuse, as a GPU's caching allocator does (glibc's
``MALLOC_MMAP_THRESHOLD_`` and trim threshold at 1 GiB), and the probed ones unmap every
freed buffer over 128 KiB, so resident memory follows the live tensors. Timed with the
probe's setting, or glibc's default (which maps each buffer over 32 MiB afresh), a step
page-faults every large buffer it makes, and a mode whose buffers are larger (the compiled
step's one gather buffer per group, 64 MiB on shape B, against the eager step's 32 MiB per
leaf) paid for the page faults, not for its own work
(``benchmarks/results/2026-11-28-cpu-host-time.md``).

    python -m benchmarks.compiled_step --shapes A,B,C --rounds 6
    python -m benchmarks.compiled_step --host --rounds 10 [--device cuda --cudagraphs]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from . import shapes
from .bench import host_config
from .compiled_candidates import rss_peak
from .launch import launch, under_torchrun
from .measure import _gather
from .modes import Config, batches, build_mode, build_model, meshes_for

SHAPE_MODES = ("funshard_full", "funshard_full_compiled", "fsdp2_full", "fsdp2_full_compile")
HOST_MODES = ("floor", "floor_compile", "funshard_full", "funshard_full_compiled")


def _probe(cfg: Config, fn) -> int:
    """Bytes a step adds at its peak: the GPU allocator's peak over what is allocated at
    its start, or the CPU's resident high-water mark
    (:func:`benchmarks.compiled_candidates.rss_peak`)."""
    if cfg.device != "cuda":
        return rss_peak(fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


# glibc's handling of freed memory: kept for reuse (timing), or unmapped (the memory probe)
_KEPT = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
_UNMAPPED = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # see rss_peak


def _launched(cfg: Config, rounds: int) -> dict:
    """:func:`run_rank` on fresh ranks: on the CPU timed and probed in two launches, each
    with its own handling of freed memory (the module's note)."""
    if cfg.device != "cpu" or under_torchrun():  # (under torchrun: as the caller set it)
        for k, v in _UNMAPPED.items():
            os.environ.setdefault(k, v)
        return launch(run_rank, cfg, rounds, True)
    with _environ(_KEPT):
        res = launch(run_rank, cfg, rounds, False)
    with _environ(_UNMAPPED):
        res["mem"] = launch(run_rank, cfg, 0, True)["mem"]
    return res


@contextlib.contextmanager
def _environ(settings: dict):
    """``settings`` in the environment that ranks launched within inherit; the keys as
    they were afterwards."""
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_rank(cfg: Config, rounds: int, probe: bool = True) -> dict:
    """Every mode of ``cfg`` on this rank: warm-up (the compiled step's eager first step and
    its compiling second), ``rounds`` interleaved timed rounds of ``cfg.steps`` steps, then
    (``probe``) one step of each under the resident-memory probe."""
    meshes = meshes_for(cfg, cfg.modes)
    rank = dist.get_rank()
    base, data = build_model(cfg), batches(cfg, rank)
    counters.clear()
    runners, warm_s = {}, {}
    for m in cfg.modes:
        runners[m] = build_mode(m, base, cfg, meshes)
        t0 = time.perf_counter()
        for i in range(cfg.warmup):
            runners[m].step(data[i % len(data)])
        warm_s[m] = time.perf_counter() - t0
    graphs = [counters["stats"]["unique_graphs"]]
    times: dict[str, list[float]] = {m: [] for m in cfg.modes}
    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
    for r in range(rounds):
        for m, run in runners.items():
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(cfg.steps):
                run.step(data[(r + i) % len(data)])
            sync()
            times[m].append((time.perf_counter() - t0) / cfg.steps * 1e3)
    graphs.append(counters["stats"]["unique_graphs"])
    mem = {}
    for m, run in runners.items() if probe else ():
        dist.barrier()
        mem[m] = _probe(cfg, lambda: run.step(data[0]))
    state = sum(p.numel() for p in base.parameters()) * 4 * 3 // cfg.world
    return {"times": _gather(times), "mem": _gather(mem), "warm_s": warm_s, "graphs": graphs,
            "breaks": sum(counters["graph_break"].values()), "state": state}


def summary(res: dict, modes: tuple, base: str) -> dict:
    """Per mode: median ms (slowest rank per round), median ratio to ``base``, in-step MiB
    (largest rank), and state + in-step against ``base``'s."""
    per_round = {m: [max(t[m][r] for t in res["times"]) for r in range(len(res["times"][0][m]))]
                 for m in modes}
    mem = {m: max(x[m] for x in res["mem"]) for m in modes}
    return {m: {"ms": statistics.median(per_round[m]),
                "ratio": statistics.median(a / b for a, b in zip(per_round[m], per_round[base])),
                "in_step_mib": mem[m] / 2**20,
                "peak_ratio": (res["state"] + mem[m]) / (res["state"] + mem[base])}
            for m in modes}


def table(res: dict, modes: tuple, base: str) -> str:
    rows = summary(res, modes, base)
    out = [f"| mode | ms median | x {base} | in-step MiB | (state + in-step) x {base} "
           "| warm-up s |",
           "|---|---:|---:|---:|---:|---:|"]
    for m, r in rows.items():
        out.append(f"| {m} | {r['ms']:.1f} | {r['ratio']:.3f} | {r['in_step_mib']:.1f} | "
                   f"{r['peak_ratio']:.3f} | {res['warm_s'][m]:.1f} |")
    out.append(f"\ndynamo graphs after warm-up / after the rounds: {res['graphs'][0]} / "
               f"{res['graphs'][1]}; graph breaks: {res['breaks']}; state (shards + AdamW "
               f"moments) per rank: {res['state'] / 2**20:.1f} MiB")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compiled_step",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="", metavar="A,B,C")
    ap.add_argument("--host", action="store_true", help="world 1, the host-bound GPT")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=1, help="steps per mode per round")
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: memory is the allocator's peak; --shapes needs 2 GPUs")
    ap.add_argument("--modes", default="",
                    help="--shapes: these modes instead (comma-separated; the first is the "
                         "ratios' base), e.g. funshard_grad_op,funshard_grad_op_compiled")
    ap.add_argument("--cudagraphs", action="store_true",
                    help="--host also runs the compiled step with mode='reduce-overhead'")
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, backend {a.backend}")
    modes = tuple(filter(None, a.modes.split(","))) or SHAPE_MODES
    for name in filter(None, a.shapes.split(",")):
        cfg = dataclasses.replace(Config(world=2, threads=1, warmup=3, steps=a.steps,
                                         modes=modes, compile_backend=a.backend,
                                         device=a.device),
                                  **shapes.SHAPES[name])
        res = _launched(cfg, a.rounds)
        print(f"\n## {shapes.LABELS[name]}, 2 ranks, AdamW\n\n"
              f"{table(res, modes, modes[0])}", flush=True)
    if a.host:
        modes = HOST_MODES + (("funshard_full_compiled_cudagraphs",) if a.cudagraphs else ())
        cfg = dataclasses.replace(
            host_config(Config(precision="bf16", threads=1, compile_backend=a.backend,
                               device=a.device)),
            modes=modes, warmup=3, steps=max(a.steps, 20))
        res = _launched(cfg, a.rounds)
        print(f"\n## host-bound GPT {cfg.blocks} x {cfg.dim}, world 1, bfloat16, {a.device}"
              f"\n\n{table(res, modes, 'floor_compile')}", flush=True)


if __name__ == "__main__":
    main()
