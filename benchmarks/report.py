"""The benchmark's report: every figure and ratio as JSON (:func:`summarize`), the
targets (:func:`targets`) and the markdown table (:func:`table`).

    >>> out = summarize(cfg, timing, memory, overhead)
    >>> print(table(out))
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Any

import torch

from .modes import EXTRA_TRANSPORTS, TWIN, Config, bound_for, plan_for

SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


def _rounds(per_rank: list[dict[str, list[float]]], mode: str) -> list[float]:
    """Seconds per step in each round, the slowest rank's."""
    return [max(r[mode][i] for r in per_rank) for i in range(len(per_rank[0][mode]))]


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """``a / b``: median of the per-round ratios (paired: the two ran seconds apart, under the
    same load), and the ratio of the fastest rounds (the least disturbed)."""
    return {"paired": statistics.median(x / y for x, y in zip(a, b)), "best": min(a) / min(b)}


def summarize(cfg: Config, timing: dict, memory: dict, overhead: dict | None,
              host: dict | None = None) -> dict:
    """Every figure and ratio, JSON-ready."""
    modes: dict[str, dict] = {}
    rounds = {m: _rounds(timing["times"], m) for m in cfg.modes}
    for m in cfg.modes:
        row: dict[str, Any] = {"step_ms": statistics.median(rounds[m]) * 1e3,
                               "best_ms": min(rounds[m]) * 1e3,
                               "rounds_ms": [x * 1e3 for x in rounds[m]]}
        for key, other in (("twin", TWIN.get(m)), ("floor", "floor")):
            if other in rounds and other != m:
                r = _ratio(rounds[m], rounds[other])
                row[f"x_{key}"], row[f"x_{key}_best"] = r["paired"], r["best"]
        traffic = timing["traffic"][0][m]
        row["collectives"] = traffic
        bound = row["bound"] = bound_for(m, cfg)
        if bound:
            got = {k: traffic.get(k, {"count": 0, "bytes": 0}) for k in bound}
            row["count_vs_bound"] = {k: got[k]["count"] / bound[k]["count"] for k in bound}
            row["bytes_vs_bound"] = (sum(g["bytes"] for g in got.values())
                                     / sum(b["bytes"] for b in bound.values()))
        if m.startswith("funshard"):
            p = plan_for(m, cfg)
            row["plan"] = {"comms": {k: t._asdict() for k, t in p.comms.items()},
                           "memory": p.memory}
            row.update(timing["info"].get(m, {}))
        if m in memory:
            ranks = memory[m]
            row["os_peak_mb"] = max(r["os_peak"] for r in ranks) / 2**20
            row["os_over_idle_mb"] = max(r["os_peak"] - r["idle"] for r in ranks) / 2**20
            row["live_peak_mb"] = max(r["live_peak"] for r in ranks) / 2**20
            # the step's own transient memory: the peak over what lives between steps
            row["step_peak_mb"] = max(r["step_peak"] for r in ranks) / 2**20
            row["live_at_step_start_mb"] = max(r["persistent"] for r in ranks) / 2**20
            row["live_growth_mb_per_step"] = max(r["growth_per_step"] for r in ranks) / 2**20
            # a forward only (fs.eval_step; FSDP2/DDP/floor: the module under no_grad)
            row["eval_peak_mb"] = max(r.get("eval_peak", 0) for r in ranks) / 2**20
        modes[m] = row
    for m, row in modes.items():
        twin = modes.get(TWIN.get(m, ""), {})
        for key in ("live_peak_mb", "step_peak_mb", "os_over_idle_mb", "os_peak_mb"):
            if key in row and key in twin:
                row[f"x_twin_{key[:-3]}"] = row[key] / twin[key]
    out = {"config": dataclasses.asdict(cfg), "machine": _machine(cfg), "modes": modes}
    one = overhead["times"] if overhead is not None else timing["times"] if cfg.world == 1 else None
    if one is not None and {"funshard_full", "floor"} <= set(one[0]):
        a, b = _rounds(one, "funshard_full"), _rounds(one, "floor")
        r = _ratio(a, b)
        out["world1"] = {"funshard_full_ms": statistics.median(a) * 1e3,
                         "plain_ms": statistics.median(b) * 1e3,
                         "ratio": r["paired"], "ratio_best": r["best"]}
    if host is not None:
        a, b = _rounds(host["times"], "funshard_full"), _rounds(host["times"], "floor")
        r = _ratio(a, b)
        out["host"] = {"funshard_full_ms": statistics.median(a) * 1e3,
                       "plain_ms": statistics.median(b) * 1e3, "blocks": cfg.blocks,
                       "ratio": r["paired"], "ratio_best": r["best"]}
    out["rounds"] = {m: [x for x in v] for m, v in rounds.items()}
    if timing.get("bookkeeping_us"):
        out["bookkeeping_us"] = max(timing["bookkeeping_us"])
    out["targets"] = targets(out)
    out["profiles"] = timing.get("profiles", {})
    return out


def targets(out: dict) -> list[dict]:
    """The targets, each with its value and whether it is met."""
    rows = []
    modes = out["modes"]

    def add(what, value, limit, ok):
        rows.append({"target": what, "value": value, "limit": limit, "met": bool(ok)})

    for m in ("funshard_full", "funshard_grad_op", "funshard_hsdp"):
        row = modes.get(m)
        if not row:
            continue
        if "x_twin" in row:
            add(f"{m} step / {TWIN[m]}", row["x_twin"], 0.9, row["x_twin"] <= 0.9)
        if "x_floor" in row:
            add(f"{m} step / floor", row["x_floor"], 1.25, row["x_floor"] <= 1.25)
        for key in ("x_twin_live_peak", "x_twin_os_over_idle"):
            if key in row:
                add(f"{m} {key[7:]} memory / {TWIN[m]}", row[key], 0.95, row[key] <= 0.95)
        if "live_growth_mb_per_step" in row:
            g = row["live_growth_mb_per_step"]
            add(f"{m} live tensors grow MB/step", g, 0, g <= 0.01)
        if "count_vs_bound" in row:
            # at most the bound: FULL_SHARD keeps the group backward starts with gathered
            # from forward on, one all-gather under "2 per group"
            at_most = all(v <= 1 for v in row["count_vs_bound"].values())
            add(f"{m} collectives / bound", row["count_vs_bound"], 1, at_most)
            add(f"{m} bytes / bound", row["bytes_vs_bound"], 1.01,
                row["bytes_vs_bound"] <= 1.01)
    if "world1" in out:
        add("world 1: funshard / plain step", out["world1"]["ratio"], 1.03,
            out["world1"]["ratio"] <= 1.03)
    if "host" in out:  # the small shape's GPU target, here on this device
        add("world 1, host-bound: funshard / plain step", out["host"]["ratio"], 1.3,
            out["host"]["ratio"] <= 1.3)
    return rows


def _machine(cfg: Config) -> dict:
    m = {"torch": torch.__version__, "cpus": os.cpu_count(), "device": cfg.device,
         "python": sys.version.split()[0]}
    if cfg.device == "cuda" and torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name()
    return m


def _fmt_traffic(t: dict) -> str:
    parts = [f"{v['count']} {SHORT.get(k, k)}" for k, v in sorted(t.items()) if k != "metrics"]
    if "metrics" in t:
        parts.append(f"+{t['metrics']['count']} metric AR")
    return ", ".join(parts) or "none"


def _ratios(row: dict, key: str) -> str:
    if f"x_{key}" not in row:
        return "-"
    return f"{row[f'x_{key}']:.2f} ({row[f'x_{key}_best']:.2f})"


def _f(x, fmt="{:.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def table(out: dict) -> str:
    """The markdown table of a :func:`summarize` result."""
    cfg = out["config"]
    model = {"encoder": "TransformerEncoderLayer", "mlp": f"MLP block (hidden {cfg['hidden']})"
             }.get(cfg.get("kind", "gpt"), "GPT")
    head = (f"funshard bench: {model} {cfg['blocks']} x {cfg['dim']} (vocab {cfg['vocab']}, seq "
            f"{cfg['seq']}), batch {cfg['batch']}/rank, "
            f"AdamW ({'fused' if cfg.get('fused') else 'foreach'}), {cfg['world']} ranks on "
            f"{cfg['device']}; {cfg['rounds']} interleaved rounds after "
            f"{cfg['warmup']} warm-up steps; per round the slowest rank; ratios: median of the "
            f"per-round ratios (in brackets: fastest round / fastest round); every mode moves "
            f"its bytes on the backend's collectives unless its row names another transport\n\n")
    lines = ["| mode | step ms median (best) | x FSDP2 twin | x floor | peak RSS MiB (over idle) | "
             "live-tensor peak MiB | mem x twin (live / in-step / RSS) | collectives / step | "
             "bytes / bound |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for m, r in out["modes"].items():
        rss = (f"{r['os_peak_mb']:.0f} ({r['os_over_idle_mb']:.0f})" if "os_peak_mb" in r
               else "-")
        mem = (f"{_f(r.get('x_twin_live_peak'))} / {_f(r.get('x_twin_step_peak'))} / "
               f"{_f(r.get('x_twin_os_over_idle'))}" if "x_twin_live_peak" in r else "-")
        name = (f"{m} (extra row: opt-in transport {EXTRA_TRANSPORTS[m]!r})"
                if m in EXTRA_TRANSPORTS else m)
        lines.append(
            f"| {name} | {r['step_ms']:.0f} ({r['best_ms']:.0f}) | {_ratios(r, 'twin')} | "
            f"{_ratios(r, 'floor')} | "
            f"{rss} | {_f(r.get('live_peak_mb'), '{:.1f}')} | {mem} | "
            f"{_fmt_traffic(r['collectives'])} | {_f(r.get('bytes_vs_bound'), '{:.4f}')} |")
    text = head + "\n".join(lines)
    leaks = {m: r["live_growth_mb_per_step"] for m, r in out["modes"].items()
             if r.get("live_growth_mb_per_step", 0) > 0.01}
    if leaks:
        text += "\n\nLive tensors grow between steps (a leak inflates the memory columns): " + \
            ", ".join(f"{m} +{v:.1f} MB/step" for m, v in leaks.items())
    if "bookkeeping_us" in out and "funshard_full" in out["modes"]:
        us, ms = out["bookkeeping_us"], out["modes"]["funshard_full"]["step_ms"]
        text += (f"\n\nOne rank's error is every rank's: the bookkeeping around a step costs "
                 f"{us:.1f} us on the success path ({us / (ms * 1e3):.4%} of funshard_full's "
                 "step)")
    evals = {m: r["eval_peak_mb"] for m, r in out["modes"].items() if "eval_peak_mb" in r}
    if evals:
        text += ("\n\nForward only (fs.eval_step; the others: the module under no_grad), "
                 "live-tensor peak over what lives between steps, MiB: " +
                 ", ".join(f"{m} {v:.1f}" for m, v in evals.items()))
    if "world1" in out:
        w = out["world1"]
        text += (f"\n\nWorld size 1: funshard FULL_SHARD {w['funshard_full_ms']:.0f} ms vs plain "
                 f"step {w['plain_ms']:.0f} ms (medians): {w['ratio']:.3f}x paired "
                 f"({w['ratio_best']:.3f}x best rounds)")
    if "host" in out:
        h = out["host"]
        text += (f"\n\nHost-bound, world 1 (GPT {h['blocks']} x 64, seq 8, batch 1: the step is "
                 f"host time): funshard {h['funshard_full_ms']:.2f} ms vs plain "
                 f"{h['plain_ms']:.2f} ms: {h['ratio']:.3f}x paired ({h['ratio_best']:.3f}x best)")
    text += "\n\n| target | value | limit | met |\n|---|---:|---:|---|\n"
    for t in out["targets"]:
        v = t["value"]
        v = (", ".join(f"{SHORT.get(k, k)} {x:.3f}" for k, x in v.items()) if isinstance(v, dict)
             else f"{v:.3f}")
        text += f"| {t['target']} | {v} | {t['limit']} | {'yes' if t['met'] else 'NO'} |\n"
    return text


def _per_round(out: dict, a: str, b: str) -> float:
    """Median over rounds of mode ``a``'s step time over mode ``b``'s."""
    rounds = out["rounds"]
    return statistics.median(x / y for x, y in zip(rounds[a], rounds[b]))


def targets_lines(checks: list[tuple[str, float, float]]) -> list[str]:
    """A markdown table of ``(target, value, limit)``, met when the value is at most the
    limit (a blank line first)."""
    return ["", "| target | value | limit | met |", "|---|---:|---:|---|"] + [
        f"| {what} | {value:.3f} | {limit} | {'yes' if value <= limit else 'NO'} |"
        for what, value, limit in checks]


def shapes_table(outs: dict[str, dict]) -> str:
    """The table over shapes, from one :func:`summarize` per shape (``{label: out}``):
    funshard FULL_SHARD against FSDP2 ``fully_shard`` per block and the floor, and Muon
    against AdamW where it ran."""
    lines = ["| shape | step x FSDP2 | step x floor | peak RSS x FSDP2 | "
             "in-step (peak - steady) x FSDP2 | Muon step x AdamW | "
             "checkpointing: live peak, step x without (x FSDP2's) | "
             "compiled: step x eager (x FSDP2's) | extra row: transport 'cma', step x FSDP2 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, out in outs.items():
        r = out["modes"].get("funshard_full", {})
        twin = out["modes"].get("fsdp2_full", {})
        mu = out["modes"].get("funshard_full_muon")
        in_step = (f"{r['x_twin_step_peak']:.2f} ({r['step_peak_mb']:.0f} vs "
                   f"{twin['step_peak_mb']:.0f} MiB)" if "x_twin_step_peak" in r else "-")
        muon = "-"
        if mu is not None:
            rounds = out["rounds"]
            x = statistics.median(a / b for a, b in zip(rounds["funshard_full_muon"],
                                                         rounds["funshard_full"]))
            muon = f"{x:.2f} ({mu['step_ms']:.0f} vs {r['step_ms']:.0f} ms)"
        ac, cc = out["modes"].get("funshard_full_ac"), out["modes"].get("funshard_full_compile")
        ac_text = cc_text = "-"
        if ac is not None and "live_peak_mb" in ac:
            ac_text = (f"{ac['live_peak_mb'] / r['live_peak_mb']:.2f} "
                       f"({_f(ac.get('x_twin_live_peak'))}), "
                       f"{_per_round(out, 'funshard_full_ac', 'funshard_full'):.2f} "
                       f"({_ratios(ac, 'twin')})")
        if cc is not None:
            cc_text = (f"{_per_round(out, 'funshard_full_compile', 'funshard_full'):.2f} "
                       f"({_ratios(cc, 'twin')})")
        cma = out["modes"].get("funshard_full_cma", {})
        lines.append(f"| {label} | {_ratios(r, 'twin')} | {_ratios(r, 'floor')} | "
                     f"{_f(r.get('x_twin_os_peak'), '{:.3f}')} | {in_step} | {muon} | "
                     f"{ac_text} | {cc_text} | {_ratios(cma, 'twin')} |")
    found = []
    for label, out in outs.items():
        r, letter = out["modes"].get("funshard_full", {}), label[:1]
        checks = {"A": (("x_twin", 0.8), ("x_floor", 1.15)),
                  "B": (("x_twin_step_peak", 0.6), ("x_floor", 1.15)),
                  "C": (("x_twin", 1.0),)}.get(letter, ()) + (("x_twin_os_peak", 1.0),)
        if letter == "A" and "funshard_full_muon" in out["rounds"]:
            rounds = out["rounds"]
            r = dict(r, x_muon=statistics.median(
                a / b for a, b in zip(rounds["funshard_full_muon"], rounds["funshard_full"])))
            checks += (("x_muon", 1.3),)
        found += [(f"{letter} {key}", r[key], limit) for key, limit in checks if key in r]
    return "\n".join(lines + targets_lines(found))
