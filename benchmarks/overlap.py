"""How much of the collectives' device time overlaps compute, from a GPU profile.

From a ``torch.profiler`` trace with CUDA activity, the kernels on the device timeline: the
collectives (NCCL's kernels, on the process group's streams) and everything else (compute,
on the step's stream). The summary gives each set's busy time (the union of its kernels'
intervals), the part of the collectives' busy time during which some compute kernel ran,
and which streams each set used. Memory copies and memsets are neither.

    >>> with torch.profiler.profile(activities=[CPU, CUDA]) as prof: ...
    >>> print(overlap_text(overlap_of(kernels_of(prof))))
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import NamedTuple


class Kernel(NamedTuple):
    name: str
    stream: int
    start: float  # microseconds
    end: float


def kernels_of(prof) -> list[Kernel]:
    """The device kernels of a finished profile (its Chrome trace's ``kernel`` events)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return [Kernel(e.get("name", ""), int(e.get("args", {}).get("stream", -1)), float(e["ts"]),
                   float(e["ts"]) + float(e.get("dur", 0.0)))
            for e in events if e.get("cat") == "kernel" and "ts" in e]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _busy(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted unions of intervals."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_of(kernels: list[Kernel]) -> dict:
    """Busy times (us) of the collectives and of compute, their overlap, and their streams."""
    comm = [k for k in kernels if "nccl" in k.name.lower()]
    compute = [k for k in kernels if "nccl" not in k.name.lower()]
    cu = _union([(k.start, k.end) for k in comm])
    pu = _union([(k.start, k.end) for k in compute])
    both = _intersect(cu, pu)
    return {"kernels": len(kernels), "collective_kernels": len(comm),
            "collective_us": _busy(cu), "compute_us": _busy(pu), "overlap_us": both,
            "overlap_share": both / _busy(cu) if cu else 0.0,
            "collective_streams": sorted({k.stream for k in comm}),
            "compute_streams": sorted({k.stream for k in compute})}


def overlap_text(s: dict) -> str:
    if not s["kernels"]:
        return "overlap: no device kernels in the trace (a CPU run): overlap is measured on GPUs"
    return (f"overlap: {s['collective_kernels']} collective kernels busy "
            f"{s['collective_us'] / 1e3:.3f} ms on streams {s['collective_streams']}, compute "
            f"busy {s['compute_us'] / 1e3:.3f} ms on streams {s['compute_streams']}; "
            f"{s['overlap_us'] / 1e3:.3f} ms of the collectives' time "
            f"({100 * s['overlap_share']:.1f}%) ran while compute ran")
