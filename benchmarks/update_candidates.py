"""What the optimizer update costs the host, and what compiling it saves: five ways to run
AdamW over the host-bound GPT's parameters (100 leaves, world 1), timed per update.

- ``fs_optim``: ``fs.optim.adamw`` on the shards, as a step that reads its metrics first
  runs it (eager; its scalars, the bias corrections and the learning rate, are Python
  floats);
- ``fs_gated``: the eager step's update that reads nothing: the same foreach ops, gated
  on the device's verdict ([Note: an update gated on the device] in
  :mod:`funshard.optim.gated`);
- ``torch_foreach``: ``torch.optim.AdamW(foreach=True)``, eager, what the plain step runs;
- ``torch_compiled``: the same optimizer's ``step()`` under ``torch.compile``, with
  ``capturable=True`` and the learning rate a tensor (so a new step count or rate is not a
  new program): its scalars live on the device and the update is one program.

- ``fs_program``: the compiled step's update (:mod:`funshard.step.update_program`): the
  chain's own ops over the shards, its scalars worked out on the host and handed over as
  one tensor per step, compiled once.

The last two are the two candidates for the compiled step's update: torch's capturable
AdamW keeps the step counts on the device and computes the bias corrections there; the
update program keeps fs.optim's counts and state (and its numbers, op for op) and computes
them on the host.

    python -m benchmarks.update_candidates [--rounds 15] [--steps 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import funshard as fs
from funshard.step.update_program import UpdateProgram

from .bench import host_config
from .launch import launch
from .modes import Config, build_model


def run_rank(cfg: Config, rounds: int, steps: int) -> dict:
    base = build_model(cfg)
    named = dict(base.named_parameters())
    mesh = fs.make_mesh(shard=1)
    params = fs.shard(named, mesh)
    opt = fs.optim.adamw(1e-3)
    state = [opt.init(params), params]
    grads = {k: torch.randn_like(v.to_local()) for k, v in params.items()}

    def fs_optim(i):
        new, s = opt.update(grads, state[0], state[1], step=i)
        state[1], state[0] = new, s

    def torch_like(compiled: bool):
        ps = [p.detach().clone().requires_grad_() for p in named.values()]
        for p, g in zip(ps, grads.values()):
            p.grad = g.clone()
        lr = torch.tensor(1e-3) if compiled else 1e-3
        # compiled: the step counts and the learning rate tensors (capturable), so a new
        # value is not a new program
        o = torch.optim.AdamW(ps, lr=lr, foreach=True, capturable=compiled)
        step = torch.compile(o.step) if compiled else o.step
        return lambda i: step()

    program = UpdateProgram({})
    held = [None, fs.shard({k: v.detach().clone().requires_grad_(v.requires_grad)
                            for k, v in named.items()}, mesh)]
    held[0] = opt.init(held[1])

    def fs_program(i):
        held[1], held[0] = program(opt, grads, held[0], held[1], step=i, norm=1.0,
                                   device=torch.device("cpu"))

    eager = UpdateProgram(None)
    held2 = [None, fs.shard({k: v.detach().clone().requires_grad_(v.requires_grad)
                             for k, v in named.items()}, mesh)]
    held2[0] = opt.init(held2[1])
    dev = torch.ones(3)

    def fs_gated(i):
        held2[1], held2[0] = eager(opt, grads, held2[0], held2[1], step=i, norm=None,
                                   device=torch.device("cpu"), dev=dev)

    runs = {"fs_gated": fs_gated, "fs_optim": fs_optim, "torch_foreach": torch_like(False),
            "torch_compiled": torch_like(True), "fs_program": fs_program}
    for run in runs.values():  # warm-up (compiles the last two)
        for i in range(3):
            run(i + 1)
    times: dict[str, list[float]] = {m: [] for m in runs}
    n = 4
    for _ in range(rounds):
        for m, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                n += 1
                run(n)
            times[m].append((time.perf_counter() - t0) / steps * 1e3)
    from torch._dynamo.utils import counters
    return {"times": times, "leaves": len(named), "graphs": counters["stats"]["unique_graphs"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.update_candidates",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50, help="updates per mode per round")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(host_config(Config()), world=1)
    res = launch(run_rank, cfg, args.rounds, args.steps)
    base = statistics.median(res["times"]["torch_foreach"])
    print(f"\nAdamW over the host-bound GPT's {res['leaves']} leaves (float32), world 1, CPU; "
          f"median of {args.rounds} interleaved rounds of {args.steps} updates; dynamo "
          f"graphs: {res['graphs']}\n")
    print("| update | ms | x torch_foreach |")
    print("|---|---:|---:|")
    for m, ts in res["times"].items():
        med = statistics.median(ts)
        print(f"| {m} | {med:.3f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
