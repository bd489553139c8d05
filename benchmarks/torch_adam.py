"""torch's AdamW through ``fs.optim.from_torch`` inside ``fs.train_step``: gated on the device
(its foreach step as funshard's own ops, no host read) against the same optimizer run after
the step's read of its metrics (torch's own step), on the host-bound GPT (world 1, bfloat16
compute, float32 masters), interleaved rounds; it checks that both trained the same
parameters bit for bit. On a CPU the read waits for nothing, so the two times are alike;
on a GPU the read is the step's one wait for the device. ``--optimizer rmsprop`` (or
``sgd``): torch's own step selected on the device (``select=True``: run, then kept or undone
by the verdict) against the same after the read.
``python -m benchmarks.torch_adam [--rounds 8] [--steps 20] [--blocks 8] [--optimizer adamw]``.
"""

from __future__ import annotations

import argparse

import torch

import funshard as fs

from .bench import host_config
from .host_floor import interleaved, paired_table
from .modes import Config, batches, build_model, meshes_for, mixed, shapes


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1, "foreach": True}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.9, "foreach": True,
                                      "select": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "foreach": True, "select": True}),
}


def _step(cfg: Config, base: torch.nn.Module, mesh, gated: bool, optimizer: str):
    params = fs.shard(dict(base.named_parameters()), mesh)
    with torch.device("meta"):
        template = shapes.model_of(cfg)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = fs.optim.from_torch(cls, **kwargs)
    step = fs.train_step(shapes.loss_of(cfg, template),
                         opt if gated else opt._replace(traced=None),
                         policy=fs.Policy(**mixed(cfg)))
    box = [step.init(params)]

    def run(batch) -> None:
        box[0], _ = step(box[0], batch)

    return run, box


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.torch_adam",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    ap.add_argument("--blocks", type=int, default=Config().blocks)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = host_config(Config(precision="bf16", blocks=args.blocks))
    base, bs = build_model(cfg), batches(cfg, 0)
    mesh = meshes_for(cfg, ("funshard_full",))["1d"]
    runs = {"gated": _step(cfg, base, mesh, True, args.optimizer),
            "read": _step(cfg, base, mesh, False, args.optimizer)}
    times = interleaved({k: run for k, (run, _) in runs.items()}, bs, args.rounds, args.steps)
    a, b = (fs.unshard(runs[k][1][0].params) for k in ("gated", "read"))
    same = all(torch.equal(a[k], b[k]) for k in a)
    print(f"gated and read trained the same parameters bit for bit: {same}")
    if not same:
        raise SystemExit("torch_adam: the gated step and torch's own disagree")
    print(f"\n{OPTIMIZERS[args.optimizer][0].__name__}, host-bound GPT {cfg.blocks} x "
          f"{cfg.dim}, world 1, bfloat16, median of "
          f"{args.rounds} rounds of {args.steps} steps\n")
    return paired_table(times, "update", "read")


if __name__ == "__main__":
    main()
