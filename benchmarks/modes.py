"""The benchmark's modes: one GPT, the same batches, and each mode's training step over a copy.

    funshard_full / funshard_grad_op   fs.train_step, reshard_after_forward True / False
    funshard_hsdp                      the same on a (2, world/2) ("replicate", "shard") mesh
    fsdp2_full / fsdp2_grad_op / fsdp2_hsdp   fully_shard per block and the root, twins of ^
    ddp                                DistributedDataParallel
    floor                              the same per-rank step with no communication at all

    >>> runner = build_mode("funshard_full", build_model(cfg), cfg, meshes_for(cfg, modes))
    >>> runner.step(batches(cfg, rank)[0])
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from funshard import Policy, make_mesh, shard, train_step
from funshard import plan as planlib
from funshard.optim import adamw
from funshard.testing.models import GPT, gpt_loss

MODES = ("funshard_full", "funshard_grad_op", "funshard_hsdp",
         "fsdp2_full", "fsdp2_grad_op", "fsdp2_hsdp", "ddp", "floor",
         "funshard_full_noprefetch")  # the last: a diagnostic, not run by default
TWIN = {"funshard_full": "fsdp2_full", "funshard_grad_op": "fsdp2_grad_op",
        "funshard_hsdp": "fsdp2_hsdp", "funshard_full_noprefetch": "fsdp2_full"}


@dataclasses.dataclass(frozen=True)
class Config:
    """One run: model shape, batch, schedule, modes and device (the command line's flags)."""

    world: int = 2
    blocks: int = 8
    dim: int = 512
    vocab: int = 256
    seq: int = 64
    batch: int = 8  # sequences per rank
    rounds: int = 10
    warmup: int = 2
    steps: int = 1  # steps per mode per round
    mem_steps: int = 2
    modes: tuple[str, ...] = ()
    device: str = "cpu"
    threads: int = 1  # torch threads per rank (CPU)
    seed: int = 0
    lr: float = 1e-3
    profile: tuple[str, ...] = ()

    @property
    def heads(self) -> int:
        return max(1, self.dim // 64)


def default_modes(world: int) -> tuple[str, ...]:
    """The modes a run compares when ``--modes`` is not given."""
    if world == 1:
        return ("funshard_full", "funshard_grad_op", "floor")
    hsdp = ("funshard_hsdp", "fsdp2_hsdp") if hsdp_ok(world) else ()
    return ("funshard_full", "funshard_grad_op", *hsdp[:1], "fsdp2_full", "fsdp2_grad_op",
            *hsdp[1:], "ddp", "floor")


def hsdp_ok(world: int) -> bool:
    """Whether the world makes a 2 x world/2 ("replicate", "shard") mesh."""
    return world >= 4 and world % 2 == 0


# -- per-rank set-up ----------------------------------------------------------------------


def device_of(cfg: Config) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` or the CPU."""
    if cfg.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(cfg.device)


def meshes_for(cfg: Config, modes) -> dict:
    """``{"1d": ("shard",) over the world}``, and ``"2d"`` (2 x world/2) when a mode is HSDP."""
    dev = device_of(cfg)
    out = {"1d": make_mesh(device_type=dev.type)}
    if any(m.endswith("hsdp") for m in modes):
        out["2d"] = make_mesh(shard=cfg.world // 2, replicate=2, device_type=dev.type)
    return out


def _gpt(cfg: Config) -> GPT:
    return GPT(vocab=cfg.vocab, dim=cfg.dim, heads=cfg.heads, layers=cfg.blocks, seq=cfg.seq)


def build_model(cfg: Config) -> GPT:
    torch.manual_seed(cfg.seed)  # the same weights on every rank and in every mode
    return _gpt(cfg).to(device_of(cfg))


def batches(cfg: Config, rank: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` per-rank batches of (tokens, targets), each (batch, seq); the same in every mode."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    dev = device_of(cfg)
    return [tuple(torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g).to(dev)
                  for _ in range(2)) for _ in range(n)]


class Runner(NamedTuple):
    step: Callable[[tuple], None]
    info: dict  # e.g. funshard's last metrics


def build_mode(name: str, base: GPT, cfg: Config, meshes: dict) -> Runner:
    """One mode's training step over a private copy of ``base``."""
    if name.startswith("funshard"):
        raf = not name.endswith("grad_op")
        mesh = meshes["2d" if name.endswith("hsdp") else "1d"]
        params = shard(dict(base.named_parameters()), mesh)  # local shards are copies
        with torch.device("meta"):  # functional_call needs only the structure
            template = _gpt(cfg)
        step = train_step(gpt_loss(template), adamw(cfg.lr),
                          policy=Policy(reshard_after_forward=raf,
                                        prefetch=not name.endswith("noprefetch")))
        box, info = [step.init(params)], {}

        def run(batch):
            box[0], metrics = step(box[0], batch)
            info.update(metrics)

        return Runner(run, info)
    model = copy.deepcopy(base)
    if name.startswith("fsdp2"):
        raf = not name.endswith("grad_op")
        mesh = meshes["2d" if name.endswith("hsdp") else "1d"]
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    elif name == "ddp":
        dev = device_of(cfg)
        model = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda"
                                        else None, gradient_as_bucket_view=True)
    elif name != "floor":
        raise ValueError(f"bench: unknown mode {name!r}; choose from {', '.join(MODES)}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True)

    def run(batch):
        x, y = batch
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=name != "ddp")  # DDP's grads are views of its buckets

    return Runner(run, {})


# -- what a mode's step must at least move -------------------------------------------------


def bound_for(name: str, cfg: Config) -> dict[str, dict[str, int]]:
    """The lower bound of a mode's traffic per step, from :func:`funshard.plan.plan`."""
    if name == "floor" or cfg.world == 1:
        return {}
    with torch.device("meta"):
        model = _gpt(cfg)
    if name == "ddp":
        p = planlib.plan(model, shard=1)
        return {"all_reduce": {"count": 1, "bytes": p.param_bytes}}
    return {k: {"count": t.count, "bytes": t.bytes} for k, t in plan_for(name, cfg).bound.items()}


def plan_for(name: str, cfg: Config) -> planlib.Plan:
    """funshard's plan of a funshard or FSDP2 mode (same mesh and resharding)."""
    world = cfg.world
    with torch.device("meta"):
        model = _gpt(cfg)
    rep = 2 if name.endswith("hsdp") else 1
    return planlib.plan(model, shard=world // rep, replicate=rep,
                        policy=Policy(reshard_after_forward=not name.endswith("grad_op"),
                                      prefetch=not name.endswith("noprefetch")),
                        **planlib.gpt_order(cfg.blocks))
