"""The benchmark's measurements, run on every rank: step time and collectives of every mode
in the same processes (:func:`time_modes`), and one mode's memory (:func:`measure_memory`).

Collectives are counted by :class:`funshard.testing.CountCollectives`, the counter the tests
use; :func:`traffic_of` sums its ops by kind in two byte conventions.
"""

from __future__ import annotations

import ctypes
import gc
import re
import time

import torch
import torch.distributed as dist

from funshard.collectives import failures
from funshard.testing import CountCollectives, LivePeak, tensor_bytes

from .modes import Config, batches, build_mode, build_model, device_of, meshes_for
from .overlap import kernels_of, overlap_of, overlap_text



def _sync(cfg: Config) -> None:
    if cfg.device == "cuda":
        torch.cuda.synchronize()


def _barrier(cfg: Config) -> None:
    _sync(cfg)
    if dist.get_world_size() > 1:
        dist.all_reduce(torch.zeros(1, device=device_of(cfg)))


def _gather(obj):
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -- collectives ---------------------------------------------------------------------------


def traffic_of(ops: list[tuple[str, int, int]]) -> dict[str, dict[str, int]]:
    """:attr:`CountCollectives.ops` by kind: ``count``, ``bytes`` (the logical buffer:
    all-gather output, reduce-scatter input, all-reduce tensor) and ``counted`` (the op's
    first argument, as :attr:`CountCollectives.bytes` records it). The float64 all-reduce
    (the step's metrics: loss, grad norm, its checks) counts as ``"metrics"``."""
    kinds: dict[str, dict[str, int]] = {}
    for kind, logical, counted, dtype in ops:
        if kind == "all_reduce" and dtype is torch.float64:
            kind = "metrics"
        k = kinds.setdefault(kind, {"count": 0, "bytes": 0, "counted": 0})
        k["count"] += 1
        k["bytes"] += logical
        k["counted"] += counted
    return kinds


# -- phase 1: step time and collectives, every mode in the same processes -------------------


def time_modes(cfg: Config) -> dict:
    """Warm up, count one step's collectives per mode, then time interleaved rounds."""
    meshes = meshes_for(cfg, cfg.modes)
    rank = dist.get_rank()
    base = build_model(cfg)
    data = batches(cfg, rank)
    runners = {m: build_mode(m, base, cfg, meshes) for m in cfg.modes}
    del base
    seen = dict.fromkeys(cfg.modes, 0)

    def step(m):
        runners[m].step(data[seen[m] % len(data)])
        seen[m] += 1

    for _ in range(cfg.warmup):
        for m in cfg.modes:
            step(m)
    traffic = {}
    for m in cfg.modes:
        _barrier(cfg)
        with CountCollectives() as cc:
            step(m)
        _sync(cfg)
        traffic[m] = traffic_of(cc.ops)
    times: dict[str, list[float]] = {m: [] for m in cfg.modes}
    modes = list(cfg.modes)
    for r in range(cfg.rounds):
        k = r % len(modes)
        for m in modes[k:] + modes[:k]:  # rotate so no mode always follows the same one
            _barrier(cfg)
            t0 = time.perf_counter()
            for _ in range(cfg.steps):
                step(m)
            _sync(cfg)
            times[m].append((time.perf_counter() - t0) / cfg.steps)
    profiles = {}
    for m in cfg.profile:
        if m not in runners:
            continue
        _barrier(cfg)
        if rank == 0:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if cfg.device == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
                for _ in range(2):
                    step(m)
                _sync(cfg)
            profiles[m] = (prof.key_averages().table(sort_by="self_cpu_time_total",
                                                     row_limit=30)
                           + "\n" + overlap_text(overlap_of(kernels_of(prof))))
        else:
            for _ in range(2):
                step(m)
    info = {m: {k: v for k, v in r.info.items() if k.startswith("unsharded")}
            for m, r in runners.items()}
    return {"times": _gather(times), "traffic": _gather(traffic), "info": info,
            "profiles": profiles, "bookkeeping_us": _gather(_bookkeeping_us())}


def _bookkeeping_us(n: int = 20000) -> float:
    """What one step's failure bookkeeping costs (funshard.collectives.failures.call around it, on
    the success path), in microseconds: every rank runs the same calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        with failures.call("bench"):
            pass
    return (time.perf_counter() - t0) / n * 1e6


# -- phase 2: memory, one launch per mode ---------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back to the OS
    except (OSError, AttributeError):
        pass


def measure_memory(cfg: Config, mode: str) -> list[dict]:
    """Peak memory of one mode: OS high-water mark over steps, and the live-tensor peak."""
    meshes = meshes_for(cfg, (mode,))
    rank, dev = dist.get_rank(), device_of(cfg)
    cuda = dev.type == "cuda"
    _trim()
    idle = torch.cuda.memory_allocated(dev) if cuda else _status_kb("VmRSS") * 1024
    base = build_model(cfg)
    data = batches(cfg, rank)
    runner = build_mode(mode, base, cfg, meshes)
    del base
    for i in range(cfg.warmup):
        runner.step(data[i % len(data)])
    _trim()
    before = tensor_bytes(dev)  # live tensors between steps: constant unless something leaks
    _barrier(cfg)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    for i in range(cfg.mem_steps):
        runner.step(data[(cfg.warmup + i) % len(data)])
    _sync(cfg)
    peak = torch.cuda.max_memory_allocated(dev) if cuda else _status_kb("VmHWM") * 1024
    gc.collect()
    persistent = tensor_bytes(dev)
    with LivePeak(dev) as live:
        runner.step(data[0])
    _sync(cfg)
    runner.evaluate(data[0])  # funshard's eval_step learns its order on the first call
    gc.collect()
    rest = tensor_bytes(dev)
    with torch.no_grad(), LivePeak(dev) as ev:
        runner.evaluate(data[0])
    _sync(cfg)
    return _gather({"os_peak": peak, "idle": idle, "persistent": persistent,
                    "step_peak": live.peak - persistent, "live_peak": live.peak,
                    "eval_peak": ev.peak - rest,
                    "growth_per_step": (persistent - before) / cfg.mem_steps})

