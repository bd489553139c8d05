"""The benchmark's modes: one model (:mod:`benchmarks.shapes`), the same batches, and each
mode's training step over a copy.

    funshard_full / funshard_grad_op   fs.train_step, reshard_after_forward True / False, on
                                       the backend's collectives (the default transport)
    funshard_full_cma / _p2p           funshard_full on an opt-in one-host CPU transport: an
                                       extra row, labelled as such, never the comparison
    funshard_full_ac / fsdp2_full_ac   activation checkpointing per block (not by default)
    funshard_full_compile / fsdp2_full_compile   torch.compile on (not by default)
    funshard_full_compiled / _grad_op_compiled   fs.train_step(compile=True): the step as one
                                       compiled program (not by default); _cudagraphs:
                                       with torch.compile's mode="reduce-overhead"; _scatter:
                                       the reductions of CPU tensors kept reduce-scatters
                                       (the GPU's collectives)
    floor_compile                      the floor with ``model.compile()`` (not by default)
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
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from funshard import Policy, eval_step, make_mesh, shard, train_step
from funshard import call as fs_call
from funshard import plan as planlib
from funshard.optim import adamw, muon

from . import shapes

MODES = ("funshard_full", "funshard_grad_op", "funshard_hsdp",
         "fsdp2_full", "fsdp2_grad_op", "fsdp2_hsdp", "ddp", "floor",
         "funshard_full_noprefetch",  # a diagnostic, not run by default
         "funshard_full_muon",  # fs.optim.muon instead of AdamW (shape A)
         # funshard_full on the opt-in one-host CPU transports (Policy(transport=)): extra rows
         "funshard_full_cma", "funshard_full_p2p",
         # activation checkpointing per block: Policy(checkpoint=True) / FSDP2 with each
         # block in checkpoint_wrapper (non-reentrant) before fully_shard
         "funshard_full_ac", "fsdp2_full_ac",
         # torch.compile: funshard's loss_fn / FSDP2's blocks (block.compile() before
         # fully_shard), with Config.compile_backend
         "funshard_full_compile", "fsdp2_full_compile",
         # train_step(compile=True) (Config.compile_backend); the floor with model.compile()
         "funshard_full_compiled", "funshard_grad_op_compiled", "floor_compile",
         # the same with torch.compile(mode="reduce-overhead"): CUDA graphs (GPU)
         "funshard_full_compiled_cudagraphs",
         # the reductions of CPU tensors kept reduce-scatters (funshard.step.overlap)
         "funshard_full_compiled_scatter")
TWIN = {"funshard_full": "fsdp2_full", "funshard_grad_op": "fsdp2_grad_op",
        "funshard_hsdp": "fsdp2_hsdp", "funshard_full_noprefetch": "fsdp2_full",
        "funshard_full_muon": "fsdp2_full", "funshard_full_ac": "fsdp2_full_ac",
        "funshard_full_compile": "fsdp2_full_compile", "funshard_full_cma": "fsdp2_full",
        "funshard_full_p2p": "fsdp2_full", "funshard_full_compiled": "fsdp2_full_compile",
        "funshard_grad_op_compiled": "fsdp2_full_compile",
        "funshard_full_compiled_scatter": "fsdp2_full_compile"}
# the transport each mode's fs.train_step uses: the backend's collectives unless named
EXTRA_TRANSPORTS = {"funshard_full_cma": "cma", "funshard_full_p2p": "p2p"}


def compiled_options(name: str, cfg) -> dict | bool:
    """``train_step``'s ``compile=`` for a funshard mode: off, the backend, or CUDA graphs."""
    if name.endswith("_cudagraphs"):
        return {"mode": "reduce-overhead"}
    if name.endswith("_scatter"):
        from funshard.step.overlap import FxPass

        return {"backend": cfg.compile_backend,
                "options": {"post_grad_custom_post_pass": FxPass(scatter_on_cpu=True)}}
    return {"backend": cfg.compile_backend} if name.endswith("_compiled") else False


def transport_of(mode: str) -> str:
    """``Policy(transport=)`` of a funshard mode: ``"c10d"`` but for the labelled extras."""
    return EXTRA_TRANSPORTS.get(mode, "c10d")


@dataclasses.dataclass(frozen=True)
class Config:
    """One run: model shape, batch, schedule, modes and device (the command line's flags)."""

    world: int = 2
    kind: str = "gpt"  # the model: gpt, encoder or mlp (benchmarks.shapes)
    blocks: int = 8
    dim: int = 512
    vocab: int = 256
    seq: int = 64
    hidden: int = 0  # mlp blocks' hidden width
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
    compile_backend: str = "inductor"  # the *_compile modes' torch.compile backend
    fused: bool = False  # AdamW as one fused kernel (every mode) instead of foreach
    # "bf16": compute in bfloat16, reduce and keep master weights in float32 (funshard's
    # Policy(param_dtype, reduce_dtype), FSDP2's MixedPrecisionPolicy, autocast elsewhere)
    precision: str = "fp32"

    @property
    def heads(self) -> int:
        return max(1, self.dim // 64)


def mixed(cfg: Config) -> dict:
    """The mixed-precision policy's dtypes (``param_dtype``, ``reduce_dtype``), or {}."""
    if cfg.precision == "fp32":
        return {}
    if cfg.precision in LOW:
        return {"param_dtype": LOW[cfg.precision], "reduce_dtype": torch.float32}
    raise ValueError(f"bench: precision {cfg.precision!r}: use fp32, bf16 or fp16")


LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp16: every mode scales its loss


def default_modes(world: int, device: str = "cpu") -> tuple[str, ...]:
    """The modes a run compares when ``--modes`` is not given: every mode on the backend's
    collectives, then (on CPU ranks) funshard on the cross-memory transport as an extra row."""
    if world == 1:
        return ("funshard_full", "funshard_grad_op", "floor")
    hsdp = ("funshard_hsdp", "fsdp2_hsdp") if hsdp_ok(world) else ()
    extra = ("funshard_full_cma",) if device == "cpu" else ()
    return ("funshard_full", "funshard_grad_op", *hsdp[:1], "fsdp2_full", "fsdp2_grad_op",
            *hsdp[1:], "ddp", "floor", *extra)


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


def build_model(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)  # the same weights on every rank and in every mode
    return shapes.model_of(cfg).to(device_of(cfg))


def batches(cfg: Config, rank: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` per-rank batches (inputs, targets); the same in every mode."""
    return shapes.batches(cfg, rank, device_of(cfg), n)


class Runner(NamedTuple):
    step: Callable[[tuple], None]
    info: dict  # e.g. funshard's last metrics
    evaluate: Callable[[tuple], None] | None = None  # a forward only, no gradients


def build_mode(name: str, base: torch.nn.Module, cfg: Config, meshes: dict) -> Runner:
    """One mode's training step over a private copy of ``base``."""
    scaled = cfg.precision == "fp16"  # each mode with its own GradScaler's rule
    if name.startswith("funshard"):
        raf = not name.removesuffix("_cudagraphs").removesuffix("_scatter").removesuffix(
            "_compiled").endswith(
            "grad_op")
        mesh = meshes["2d" if name.endswith("hsdp") else "1d"]
        params = shard(dict(base.named_parameters()), mesh)  # local shards are copies
        with torch.device("meta"):  # fs.call needs only the structure
            template = shapes.model_of(cfg)
        opt = (muon(lr=cfg.lr, other=adamw(cfg.lr, fused=cfg.fused)) if name.endswith("muon")
               else adamw(cfg.lr, fused=cfg.fused))
        loss_fn = shapes.loss_of(cfg, template)
        if name.endswith("_compile"):
            loss_fn = torch.compile(loss_fn, backend=cfg.compile_backend)
        step = train_step(loss_fn, opt,
                          policy=Policy(reshard_after_forward=raf,
                                        prefetch=not name.endswith("noprefetch"),
                                        checkpoint=name.endswith("_ac"), **mixed(cfg),
                                        transport=transport_of(name),
                                        loss_scale="dynamic" if scaled else None),
                          compile=compiled_options(name, cfg))
        box, info = [step.init(params)], {}

        def run(batch):
            box[0], metrics = step(box[0], batch)
            info.update(metrics)

        forward = eval_step(lambda p, x: fs_call(template, p, x),
                            policy=Policy(reshard_after_forward=raf,
                                          transport=transport_of(name)))
        return Runner(run, info, lambda batch: forward(box[0].params, batch[0]))
    model = copy.deepcopy(base)
    if name.startswith("fsdp2"):
        raf = not name.endswith("grad_op")
        mesh = meshes["2d" if name.endswith("hsdp") else "1d"]
        if name.endswith("_ac"):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper)
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        if name.endswith("_compile"):
            for block in model.layers:
                block.compile(backend=cfg.compile_backend)
        mp = {}
        if mixed(cfg):
            mp["mp_policy"] = MixedPrecisionPolicy(**mixed(cfg))
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=raf, **mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=raf, **mp)
    elif name == "ddp":
        dev = device_of(cfg)
        model = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda"
                                        else None, gradient_as_bucket_view=True)
    elif name == "floor_compile":
        model.compile(backend=cfg.compile_backend)
    elif name != "floor":
        raise ValueError(f"bench: unknown mode {name!r}; choose from {', '.join(MODES)}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                            **({"fused": True} if cfg.fused else {"foreach": True}))

    # FSDP2 casts by its policy
    autocast = name in ("floor", "floor_compile", "ddp") and bool(mixed(cfg))
    dev_type = device_of(cfg).type
    low = LOW.get(cfg.precision, torch.bfloat16)
    scaler = None
    if scaled:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = (ShardedGradScaler(device=dev_type) if name.startswith("fsdp2")
                  else torch.amp.GradScaler(dev_type))

    def run(batch):
        with torch.autocast(dev_type, dtype=low, enabled=autocast):
            loss = shapes.plain_loss(cfg, model, batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=name != "ddp")  # DDP's grads are views of its buckets

    def evaluate(batch):
        with torch.no_grad():
            model(batch[0])

    return Runner(run, {}, evaluate)


# -- what a mode's step must at least move -------------------------------------------------


def bound_for(name: str, cfg: Config) -> dict[str, dict[str, int]]:
    """The lower bound of a mode's traffic per step, from :func:`funshard.plan.plan`."""
    if name == "floor" or cfg.world == 1:
        return {}
    with torch.device("meta"):
        model = shapes.model_of(cfg)
    if name == "ddp":
        p = planlib.plan(model, shard=1)
        return {"all_reduce": {"count": 1, "bytes": p.param_bytes}}
    return {k: {"count": t.count, "bytes": t.bytes} for k, t in plan_for(name, cfg).bound.items()}


def plan_for(name: str, cfg: Config) -> planlib.Plan:
    """funshard's plan of a funshard or FSDP2 mode (same mesh and resharding)."""
    world = cfg.world
    with torch.device("meta"):
        model = shapes.model_of(cfg)
    rep = 2 if name.endswith("hsdp") else 1
    return planlib.plan(model, shard=world // rep, replicate=rep,
                        policy=Policy(reshard_after_forward=not name.endswith("grad_op"),
                                      prefetch=not name.endswith("noprefetch")),
                        **order_of(cfg))


def order_of(cfg: Config) -> dict[str, list[str]]:
    """The groups' use order: GPT's (the root around the blocks), or the blocks alone."""
    if cfg.kind == "gpt":
        return planlib.gpt_order(cfg.blocks)
    blocks = [f"layers.{i}" for i in range(cfg.blocks)]
    return {"forward": blocks, "backward": blocks[::-1]}
