"""Two candidates for a whole-step compiled FSDP step, small and outside the library, measured
on gloo ranks: graphs, recompiles, compile time, step time, peak memory, collective order.

    leaf       each parameter a DTensor Shard(0) leaf, gathered by ``full_tensor`` with
               ``grad_placements=[Partial()]``: autograd makes its reduce-scatter
    flat       a group's shards one flat buffer: one functional all-gather per group, split
               and viewed into the leaves; autograd makes one reduce-scatter per group
    flat_keep  ``flat`` without the recompute policy (gathered parameters kept for backward)

The step (gathers, loss, ``torch.autograd.grad`` over the shards, reduce-scatters, norm, clip,
AdamW on the shards, metrics) is one ``torch.compile(fullgraph=True)`` function; each block's
gather and forward run under ``torch.utils.checkpoint`` with a selective policy (collectives
and views MUST_RECOMPUTE, the rest MUST_SAVE): each group is gathered again in backward.

    python -m benchmarks.compiled_candidates --world 2 --shape A --steps 10 --check
    python -m benchmarks.compiled_candidates --shape tiny --candidates flat --passes none,reorder
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import re
import statistics
import time

import torch
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache, run_and_get_code
from torch.distributed.tensor import DTensor, Partial
from torch.func import functional_call
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import funshard as fs

from . import shapes
from .launch import launch
from .modes import Config, build_mode, meshes_for

CANDIDATES = ("flat", "leaf", "flat_keep")
_ADAM = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, max_norm=1.0)
_DIST, _PEAK = "aten_distributed_optimizations.", ["reorder_communication_preserving_peak_memory"]
# inductor option sets (torch._inductor.config names) tried on each candidate
PASSES = {
    "none": {},
    "bucket": {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"},
    "reorder": {"reorder_for_compute_comm_overlap": True,  # config.py's recommended passes:
                "reorder_for_compute_comm_overlap_passes": [*_PEAK, "sink_waits_iterative",
                                                            *_PEAK]},
    "overlap": {_DIST + "enable_overlap_scheduling": True, _DIST + "collective_bucketing": True,
                _DIST + "compute_estimator": "analytical"},
}
SHAPES = {"A": shapes.SHAPES["A"], "tiny": dict(kind="encoder", blocks=2, dim=32, batch=2, seq=8)}

_C10D = torch.ops._c10d_functional
_COMMS = (_C10D.all_gather_into_tensor.default, _C10D.wait_tensor.default)


def _gather_policy(ctx, op, *args, **kwargs):
    """Gathers (and the views of them the forward binds) are recomputed, the rest saved."""
    recompute = op in _COMMS or op.is_view
    return CheckpointPolicy.MUST_RECOMPUTE if recompute else CheckpointPolicy.MUST_SAVE


_RECOMPUTE = functools.partial(create_selective_checkpoint_contexts, _gather_policy)


class Flat:
    """A group's leaves as one flat buffer padded to a multiple of the world; a rank keeps
    one chunk: one leaf per group (``leaves[spans[i]]`` are group i's, in both layouts)."""

    def __init__(self, groups: list[dict[str, torch.Tensor]], mesh):
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group().group_name
        self.names = [list(g) for g in groups]
        self.shapes = [[t.shape for t in g.values()] for g in groups]
        self.sizes = [[s.numel() for s in g] for g in self.shapes]
        self.per = [-(-sum(s) // self.world) for s in self.sizes]
        self.spans = [slice(i, i + 1) for i in range(len(groups))]

    def shard(self, groups) -> list[torch.Tensor]:
        flats = (torch.cat([t.detach().reshape(-1) for t in g.values()]) for g in groups)
        return [F.pad(f, (0, per * self.world - f.numel())).view(self.world, per)[self.rank]
                .clone() for f, per in zip(flats, self.per)]  # each (per,)

    def gather(self, i, leaves) -> dict[str, torch.Tensor]:
        full = fc.all_gather_single(leaves[0], 0, self.group)  # (world * per,)
        if not torch.compiler.is_compiling():
            full = fc.wait_tensor(full)
        parts = full[:sum(self.sizes[i])].split(self.sizes[i])
        return {n: p.view(s) for n, p, s in zip(self.names[i], parts, self.shapes[i])}

    local = staticmethod(lambda x: x)


class Leaf:
    """Every leaf a DTensor Shard(0) (``fs.shard``), gathered one by one to Replicate."""

    def __init__(self, groups, mesh):
        self.mesh, self.names = mesh, [list(g) for g in groups]
        ends = [0, *(sum(len(g) for g in groups[:i + 1]) for i in range(len(groups)))]
        self.spans = [slice(a, b) for a, b in zip(ends, ends[1:])]

    def shard(self, groups) -> list[DTensor]:
        sharded = [fs.shard({k: t.detach() for k, t in g.items()}, self.mesh) for g in groups]
        return [s[k] for s, g in zip(sharded, groups) for k in g]

    def gather(self, i, leaves) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor(grad_placements=[Partial()])
                for n, p in zip(self.names[i], leaves)}

    local = staticmethod(lambda x: x.to_local())


def adamw(ps, gs, ms, vs, t, scale):
    """AdamW with the gradients times ``scale`` (the clip): new (params, m, v) lists."""
    a, t1 = _ADAM, t + 1
    c1, c2 = 1 - a["b1"] ** t1, 1 - a["b2"] ** t1
    ms = [a["b1"] * m + (1 - a["b1"]) * g * scale for m, g in zip(ms, gs)]
    vs = [a["b2"] * v + (1 - a["b2"]) * (g * scale) ** 2 for v, g in zip(vs, gs)]
    ps = [p * (1 - a["lr"] * a["wd"]) - a["lr"] * (m / c1) / ((v / c2).sqrt() + a["eps"])
          for p, m, v in zip(ps, ms, vs)]
    return ps, ms, vs


def sgd(ps, gs, ms, vs, t, scale):
    """SGD (lr 0.1), the checks' update (AdamW's first step divides by ``|g|``)."""
    return [p - 0.1 * scale * g for p, g in zip(ps, gs)], ms, vs


OPTIMS = {"adamw": adamw, "sgd": sgd}


def make_step(layout, blocks: list[nn.Module], group: str, world: int, *, recompute=True,
              update=adamw):
    """``step(params, m, v, t, x, y) -> (params, m, v, t, metrics, grads)`` over flat lists,
    the state updated in place (donated); ``grads`` (local sums over ranks) for the checks."""

    def step(params, m, v, t, x, y):
        leaves = [p.detach().requires_grad_(True) for p in params]
        for i, block in enumerate(blocks):  # x: (batch, seq, dim) through the blocks
            def run(ls, x, i=i, block=block):
                return functional_call(block, layout.gather(i, ls), (x,))
            own = leaves[layout.spans[i]]
            x = (checkpoint(run, own, x, use_reentrant=False, context_fn=_RECOMPUTE)
                 if recompute else run(own, x))
        loss = F.mse_loss(x, y)
        grads = [layout.local(g) for g in torch.autograd.grad(loss, leaves)]  # sums over ranks
        sums = torch.stack([loss.detach(), sum(g.pow(2).sum() for g in grads)])
        sums = fc.all_reduce(sums, "sum", group)  # (loss, squared norm): one all-reduce
        if not torch.compiler.is_compiling():
            sums = fc.wait_tensor(sums)
        norm = sums[1].sqrt() / world  # of the mean gradient; the mean is folded into scale
        scale = (_ADAM["max_norm"] / (norm + 1e-6)).clamp(max=1.0) / world
        local = [layout.local(p.detach()) for p in params]
        new = update(local, grads, m, v, t, scale)
        with torch.no_grad():  # the state is donated: updated in place
            for dst, src in zip(local + m + v, [x for xs in new for x in xs]):
                dst.copy_(src)
        return params, m, v, t + 1, {"loss": sums[0] / world, "grad_norm": norm}, grads

    return step


def no_dropout(model: nn.Module) -> nn.Module:
    """Every dropout off (compiled and eager must draw the same numbers)."""
    for mod in model.modules():
        if isinstance(mod, (nn.Dropout, nn.MultiheadAttention)):
            setattr(mod, "p" if isinstance(mod, nn.Dropout) else "dropout", 0.0)
    return model


def setup(cfg: Config, mesh, candidate: str, optim: str = "adamw"):
    """(model, layout, state, step, batches) of a candidate on this rank; a group per block."""
    torch.manual_seed(cfg.seed)
    model = no_dropout(shapes.model_of(cfg))
    groups = [dict(b.named_parameters()) for b in model.layers]
    layout = (Leaf if candidate == "leaf" else Flat)(groups, mesh)
    params = layout.shard(groups)
    m = [torch.zeros_like(layout.local(p)) for p in params]  # AdamW's moments: local tensors
    state = (params, m, [x.clone() for x in m], torch.zeros(()))
    step = make_step(layout, list(model.layers), mesh.get_group().group_name, mesh.size(),
                     recompute=candidate != "flat_keep", update=OPTIMS[optim])
    return model, layout, state, step, shapes.batches(cfg, mesh.get_local_rank(), "cpu", 4)


def reference(cfg: Config, model: nn.Module, world: int, optim: str):
    """One process on the ranks' concatenated first batches: (grads, new params) by FQN."""
    params = {k: p.detach().clone().requires_grad_(True) for k, p in model.named_parameters()}
    xs, ys = zip(*(shapes.batches(cfg, r, "cpu", 1)[0] for r in range(world)))
    out = functional_call(model, params, (torch.cat(xs),))
    grads = torch.autograd.grad(F.mse_loss(out, torch.cat(ys)), list(params.values()))
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    scale = (_ADAM["max_norm"] / (norm + 1e-6)).clamp(max=1.0)
    zeros = [torch.zeros_like(g) for g in grads]
    new, _, _ = OPTIMS[optim]([p.detach() for p in params.values()], grads, zeros, zeros,
                              torch.zeros(()), scale)
    return dict(zip(params, grads)), dict(zip(params, new))


def _as_local(layout, model, tree: dict) -> list[torch.Tensor]:
    """A full-shape tree by FQN as the layout's local shards."""
    groups = [{n: tree[f"layers.{i}.{n}"] for n, _ in b.named_parameters()}
              for i, b in enumerate(model.layers)]
    return [layout.local(p) for p in layout.shard(groups)]


def _copy(state):
    """A copy of a state (a step updates its own in place)."""
    return tuple([x.clone() for x in s] if isinstance(s, list) else s.clone() for s in state)


def _max_err(xs, ys) -> float:
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(xs, ys))


def check(cfg: Config, mesh, candidate: str, steps: int = 3, optim: str = "sgd") -> dict:
    """Compiled against its eager twin and one process on this rank's shards: the first step's
    max errors, graph breaks, graphs after each step (a recompile adds one), collectives."""
    model, layout, state, step, data = setup(cfg, mesh, candidate, optim)
    eager = step(*_copy(state), *data[0])
    ref_g, ref_p = reference(cfg, model, mesh.size(), optim)
    counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        cstep = torch.compile(step, fullgraph=True, backend="inductor")
        first, codes = run_and_get_code(cstep, *state, *data[0])  # resets dynamo first
        got = [layout.local(p).clone() for p in first[0]]  # before the next steps update it
        state, graphs = first[:4], [counters["stats"]["unique_graphs"]]
        for k in range(1, steps):
            state = cstep(*state, *data[k % len(data)])[:4]
            graphs.append(counters["stats"]["unique_graphs"])
    twin = [layout.local(p) for p in eager[0]]
    return {"grad_vs_eager": _max_err(first[5], eager[5]), "param_vs_eager": _max_err(got, twin),
            "grad_vs_one": _max_err([g / mesh.size() for g in first[5]],
                                    _as_local(layout, model, ref_g)),
            "param_vs_one": _max_err(got, _as_local(layout, model, ref_p)),
            "grad_scale": max(g.abs().max().item() for g in ref_g.values()),  # beside the errors
            "breaks": sum(counters["graph_break"].values()), "graphs": graphs,
            "collectives": {k: n for k, (n, _) in collective_order(codes[0])[1].items()}}


_KINDS = {"all_gather_into_tensor": "AG", "all_gather_into_tensor_out": "AG",
          "reduce_scatter_tensor": "RS", "all_reduce_": "AR"}
_COLL = re.compile(r"(?:(\w+) = )?torch\.ops\._c10d_functional\.(\w+)\.default\((\w+)")
_KERNEL = re.compile(r"(\w+ = )?(cpp_fused_|extern_kernels\.|torch\.ops\.aten\.)")


def collective_order(code: str) -> tuple[str, dict]:
    """The program's collectives in order (``AG``/``RS``/``AR`` issued, ``w`` waited, ``n`` that
    many kernels); per kind the count and mean kernels between issue and wait (overlap)."""
    toks, run, pending, stats = [], 0, {}, {}
    for line in code[code.index("def call(self, args)"):].splitlines():
        m = _COLL.match(line.strip())
        if not m:
            if _KERNEL.match(line.strip()):
                run += 1
                for p in pending.values():
                    p[1] += 1
            continue
        toks, run = toks + [str(run)] * bool(run), 0
        if m[2] == "wait_tensor":
            kind, between = pending.pop(m[3], ("?", 0))
            n, total = stats.get(kind, (0, 0))
            stats[kind] = (n + 1, total + between)
            toks.append("w")
        else:
            key = (re.search(r"out=(\w+)", line) or m)[1] or m[3]  # the buffer waited on
            pending[key] = [_KINDS.get(m[2], m[2]), 0]
            toks.append(pending[key][0])
    text = " ".join(toks + [str(run)] * bool(run)) + " "  # "AG w AG w " -> "2x(AG w) "
    text = re.sub(r"((AG w |RS w )\2+)", lambda g: f"{len(g[1]) // 5}x({g[2][:4]}) ", text)
    return text.strip(), {k: (n, t / n) for k, (n, t) in stats.items()}


def _status(key: str) -> int:  # bytes
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status")
                if ln.startswith(key + ":"))


def rss_peak(fn) -> int:
    """Peak resident bytes over those before ``fn``: the kernel's high-water mark, reset by
    ``/proc/self/clear_refs``. With ``MALLOC_MMAP_THRESHOLD_`` set (main does) glibc unmaps
    every freed buffer over it: resident memory follows the live tensors, inductor's too."""
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return _status("VmHWM") - before


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def _stepper(fn, state):
    """``run(batch)``: one step of ``fn`` on the state it keeps."""
    box = [state]
    return lambda batch: box.__setitem__(0, fn(*box[0], *batch)[:4])


def eager_runners(cfg: Config, mesh) -> dict:
    """funshard's eager step (c10d, clip 1.0) and FSDP2 (per block + root) on this rank."""
    torch.manual_seed(cfg.seed)
    base = no_dropout(shapes.model_of(cfg))
    template = no_dropout(shapes.model_of(cfg)).to("meta")  # fs.call needs the structure
    step = fs.train_step(shapes.loss_of(cfg, template), fs.optim.adamw(_ADAM["lr"]),
                         policy=fs.Policy(transport="c10d", clip_norm=_ADAM["max_norm"]))
    box = [step.init(fs.shard(dict(base.named_parameters()), mesh))]
    # the library's compiled step (train_step(compile=True)): its eager first step and its
    # compiling second step run here, before the timed rounds
    cstep = fs.train_step(shapes.loss_of(cfg, template), fs.optim.adamw(_ADAM["lr"]),
                          policy=fs.Policy(clip_norm=_ADAM["max_norm"]), compile=True)
    cbox = [cstep.init(fs.shard(dict(base.named_parameters()), mesh))]
    for batch in shapes.batches(cfg, mesh.get_local_rank(), "cpu", 2):
        cbox[0] = cstep(cbox[0], batch)[0]
    return {"funshard": lambda batch: box.__setitem__(0, step(box[0], batch)[0]),
            "fs_compiled": lambda batch: cbox.__setitem__(0, cstep(cbox[0], batch)[0]),
            "fsdp2": build_mode("fsdp2_full", base, cfg, {"1d": mesh}).step}


def measure(cfg: Config, mesh, candidate: str, passes: str, steps: int, others: dict) -> dict:
    """One candidate under one inductor option set (no cache): ``steps`` rounds timed beside
    its eager twin and ``others``, graphs, peak memory, collective order."""
    _, _, state, step, data = setup(cfg, mesh, candidate)
    counters.clear()
    with (torch._dynamo.config.patch(trace_autograd_ops=True),
          torch._inductor.config.patch(PASSES[passes]), fresh_cache()):  # a cold compile
        cstep = torch.compile(step, fullgraph=True, backend="inductor")
        twin = _copy(state)
        (out, codes), compile_s = _timed(run_and_get_code, cstep, *state, *data[0])  # resets
        runs = {"compiled": _stepper(cstep, out[:4]), "eager": _stepper(step, twin), **others}
        times, graphs = {k: [] for k in runs}, []
        for r in range(steps):
            for name, run in runs.items():
                times[name].append(_timed(run, data[r % len(data)])[1])
            graphs.append(counters["stats"]["unique_graphs"])
        mem = {k: rss_peak(functools.partial(run, data[0])) for k, run in runs.items()}
    order, kinds = collective_order(codes[0]) if codes else ("", {})
    return {"candidate": candidate, "passes": passes, "compile_s": compile_s, "graphs": graphs,
            "breaks": sum(counters["graph_break"].values()),
            "ms": {k: statistics.median(v[1:] or v) * 1e3 for k, v in times.items()},
            "mem": mem, "order": order, "kinds": kinds}


def run_rank(cfg: Config, candidates, passes, steps: int, check_too: bool) -> dict:
    """Everything on one rank (launched by :func:`benchmarks.launch.launch`)."""
    mesh = meshes_for(cfg, ())["1d"]  # ("shard",) over the world
    out = {"checks": {c: check(cfg, mesh, c) for c in candidates if check_too}, "rows": []}
    others = eager_runners(cfg, mesh)
    for cand in candidates:
        for p in passes:
            try:
                out["rows"].append(measure(cfg, mesh, cand, p, steps, others))
            except Exception as e:  # an option set that fails on this backend is a finding
                out["rows"].append({"candidate": cand, "passes": p, "error": repr(e)[:300]})
            torch._dynamo.reset()
    return out


def report(res: dict) -> str:
    """The checks, a table of the rows, and each row's collective order."""
    out = [f"check {c}: " + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in r.items()) for c, r in res["checks"].items()]
    keys = ("compiled", "eager", "funshard", "fs_compiled", "fsdp2")
    out += ["| candidate | passes | graphs after each step | breaks | compile s | ms per step:"
            " compiled / eager twin / funshard / funshard compile=True / fsdp2 |"
            " peak MiB over step start: same |"
            " collectives: count (kernels between issue and wait) |", "|---" * 8 + "|"]
    for r in res["rows"]:
        cells = [r["candidate"], r["passes"], r.get("error", "")]
        if "error" not in r:
            cells[2:] = [r["graphs"], r["breaks"], f"{r['compile_s']:.0f}",
                         " / ".join(f"{r['ms'][k]:.0f}" for k in keys),
                         " / ".join(f"{r['mem'][k] / 2**20:.0f}" for k in keys),
                         ", ".join(f"{k} {n} ({o:.1f})" for k, (n, o) in r["kinds"].items())]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out + [f"{r['candidate']}/{r['passes']}: {r['order']}"
                            for r in res["rows"] if "order" in r])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="A")
    ap.add_argument("--steps", type=int, default=10, help="timed rounds per candidate")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--passes", default="none", help=f"comma-separated, from {list(PASSES)}")
    ap.add_argument("--check", action="store_true", help="first compare with eager, one process")
    a = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # see rss_peak
    cfg = dataclasses.replace(Config(world=a.world), **SHAPES[a.shape])
    res = launch(run_rank, cfg, a.candidates.split(","), a.passes.split(","), a.steps, a.check)
    print(f"torch {torch.__version__}, world {a.world}, shape {a.shape}, steps {a.steps}\n"
          + report(res))


if __name__ == "__main__":
    main()
