"""funshard on a tensor-parallel mesh against FSDP2 + TP: the same model, mesh, rows, optimizer
and transport (gloo, CPU), in the same processes, rounds alternated.

- ``funshard``: the functional loop of docs/model-parallel.md: ``fs.unshard`` of the whole
  tree (one all-gather over ``"shard"``), ``functional_call``, backward (one reduce-scatter),
  funshard's AdamW on the shards;
- ``step``: ``fs.train_step`` (default Policy: a group per block, gathered at its module and
  freed after it, FULL_SHARD) with the same AdamW;
- ``fsdp2``: torch's ``fully_shard`` per block and on the root over ``mesh["shard"]`` of the
  same parallelized model, ``torch.optim.AdamW(foreach=True)``.

Per mode: the median step time over the rounds, and one step's peak of live tensor bytes
above what lives between steps (:class:`funshard.testing.LivePeak`, measured apart from the
timed steps). torch's test Transformer (``common_dtensor``) with its own tensor-parallel plan
and sequence parallel.

    python -m benchmarks.model_parallel [--dim 256] [--layers 4] [--rounds 5] [--world 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .launch import launch
from .modes import Config

MODES = ("funshard", "step", "fsdp2")


def _model(cfg: Config, tp_mesh):
    from torch.testing._internal.distributed._tensor.common_dtensor import (ModelArgs,
                                                                            Transformer)
    torch.manual_seed(cfg.seed)
    args = ModelArgs(n_layers=cfg.blocks, vocab_size=cfg.vocab, max_seq_len=cfg.seq,
                     dim=cfg.dim, n_heads=max(4, cfg.heads), dropout_p=0.0,
                     weight_tying=False)
    return Transformer.parallelize(Transformer(args), tp_mesh, True, local_output_for_attn=True)


def _funshard(cfg: Config, mesh):
    import funshard as fs

    model = _model(cfg, mesh["tp"])
    params = {k: v.detach().requires_grad_() for k, v in fs.shard(fs.params(model), mesh).items()}
    opt = fs.optim.adamw(cfg.lr)
    state = [opt.init(params), params, 0]

    def step(x, y):
        opt_state, ps, n = state
        out = torch.func.functional_call(model, fs.unshard(ps), (x,))
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        grads = {k: v.grad for k, v in ps.items()}
        for v in ps.values():
            v.grad = None
        state[1], state[0] = opt.update(grads, opt_state, ps, step=n)
        state[2] = n + 1
    return step, lambda: fs.state_dict(state[1], "full")


def _step(cfg: Config, mesh):
    import funshard as fs

    model = _model(cfg, mesh["tp"])

    def loss_fn(p, b):
        out = fs.call(model, p, b[0])
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), b[1].reshape(-1))

    train = fs.train_step(loss_fn, fs.optim.adamw(cfg.lr))
    state = [train.init(fs.shard(fs.params(model), mesh))]

    def step(x, y):
        state[0], _ = train(state[0], (x, y))
    return step, lambda: fs.state_dict(state[0].params, "full")


def _fsdp2(cfg: Config, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _model(cfg, mesh["tp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True)

    def step(x, y):
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return step, lambda: {k: v.full_tensor() for k, v in model.named_parameters()}


def run_rank(cfg: Config, tp: int) -> dict:
    import logging
    import warnings

    import funshard as fs
    from funshard.testing import LivePeak, tensor_bytes

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the root's view output
    # reading FSDP2's strided weights whole (the check below) logs a warning per leaf
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = fs.make_mesh(tp=tp, device_type="cpu")
    dp = dist.get_rank() // tp
    g = torch.Generator().manual_seed(cfg.seed + dp)  # this data-parallel rank's rows
    toks = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    x, y = toks[:, :-1], toks[:, 1:]
    made = {"funshard": _funshard(cfg, mesh), "step": _step(cfg, mesh),
            "fsdp2": _fsdp2(cfg, mesh)}
    steps = {m: made[m][0] for m in MODES}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for m in MODES:  # warm-up
        for _ in range(cfg.warmup):
            steps[m](x, y)
    for r in range(cfg.rounds):
        for m in (MODES[r % len(MODES):] + MODES[:r % len(MODES)]):  # each first in turn
            dist.barrier()
            t = time.perf_counter()
            for _ in range(cfg.steps):
                steps[m](x, y)
            dist.barrier()
            times[m].append((time.perf_counter() - t) / cfg.steps * 1e3)
    peaks = {}
    for m in MODES:
        base = tensor_bytes(torch.device("cpu"))  # what lives between steps
        with LivePeak(torch.device("cpu")) as live:
            steps[m](x, y)
        peaks[m] = live.peak - base
    theirs = made["fsdp2"][1]()  # as many steps each
    diff = {m: max((made[m][1]()[k] - theirs[k]).abs().max().item() for k in theirs)
            for m in MODES[:-1]}
    return {"diff": diff, **{m: (statistics.median(times[m]), peaks[m]) for m in MODES}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.model_parallel",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per mode per round")
    a = ap.parse_args(argv)
    cfg = dataclasses.replace(Config(), world=a.world, dim=a.dim, blocks=a.layers, seq=a.seq,
                              batch=a.batch, rounds=a.rounds, steps=a.steps, vocab=1024,
                              threads=1)
    print(f"torch {torch.__version__}, gloo CPU, {a.world} ranks as shard "
          f"{a.world // a.tp} x tp {a.tp}; Transformer {a.layers} x {a.dim}, seq {a.seq}, "
          f"{a.batch} sequences per data-parallel rank; {a.rounds} rounds of {a.steps} "
          "steps, modes alternated\n")
    res = launch(run_rank, cfg, a.tp)
    steps = cfg.warmup + cfg.rounds * cfg.steps + 1
    for m, d in res["diff"].items():
        print(f"{m} vs fsdp2 after {steps} steps: max weight difference {d:.3g}")
    print()
    base_ms, base_peak = res["fsdp2"]
    print("| mode | ms per step | x FSDP2 + TP | peak live MiB above the state | x FSDP2 + TP |\n"
          "|---|---:|---:|---:|---:|")
    for m in MODES:
        ms, peak = res[m]
        print(f"| {m} | {ms:.1f} | {ms / base_ms:.2f} | {peak / 2**20:.1f} | "
              f"{peak / base_peak:.2f} |")


if __name__ == "__main__":
    main()
