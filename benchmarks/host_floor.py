"""What the parameter stand-in costs by itself: the host overhead, split in two.

On a GPT whose compute is negligible (:func:`benchmarks.bench.host_config`: world 1,
bfloat16 compute, float32 masters, FULL_SHARD), the step time is host time. This runs six
steps over the same model and batches, interleaved, and prints each one's median against
the plain step:

- ``floor``: the plain step under autocast, ``torch.optim.AdamW`` (foreach);
- ``hooks``: the same work as FULL_SHARD with module hooks, FSDP2's mechanism at its
  leanest: each block's bfloat16 copy is cast in a forward pre-hook and freed (storage
  resized to 0) after its forward, recast when backward unpacks it;
- ``stand_ins``: the same with no module hook, the stand-ins funshard bound until it
  installed groups at their modules, at their leanest: a stand-in per parameter whose
  first op casts its group through one autograd Function and binds it (swaps the stand-in
  with the full tensor), the previous group freed and unbound; the same saved-tensor hooks;
  ``torch.optim.AdamW``;
- ``funshard``: ``fs.train_step`` (``Policy(param_dtype=bfloat16)``, ``fs.optim.adamw``);
- ``funshard_forced``: the same with its collectives forced
  (:func:`funshard.collectives.force_collectives`): each group's all-gather and
  reduce-scatter run on the backend, as on more ranks;
- ``fsdp2``: ``fully_shard`` per block and the root, bfloat16 ``MixedPrecisionPolicy``,
  ``torch.optim.AdamW`` (foreach): FSDP2 runs its collectives at world 1 too, so it is the
  twin of ``funshard_forced`` on the same transport.

``hooks`` and ``stand_ins`` must agree bit for bit (checked first); the gap between
``stand_ins`` and ``funshard`` is the step's own bookkeeping and optimizer, not the
mechanism; the gap between ``funshard`` and ``funshard_forced`` is the collective path's
(the backend's own cost per collective included: gloo's world-1 all-gather alone is a
few hundred microseconds on a CPU core). ``python -m benchmarks.host_floor [--rounds 10] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from funshard.collectives import force_collectives
from funshard.step.install import install

from .bench import host_config
from .modes import Config, batches, build_mode, build_model, meshes_for

LOW = torch.bfloat16


class _Reference:
    """float32 masters and AdamW; the bfloat16 copies in groups (a block each, the rest)."""

    def __init__(self, base: torch.nn.Module):
        self.model = copy.deepcopy(base).to(LOW)  # Hooks computes with these; StandIns not
        self.names = [n for n, _ in base.named_parameters()]
        self.master = [p.detach().clone().requires_grad_() for p in base.parameters()]
        self.opt = torch.optim.AdamW(self.master, lr=1e-3, foreach=True)
        groups: dict[str, list[int]] = {}
        for i, n in enumerate(self.names):
            groups.setdefault(".".join(n.split(".")[:2]) if n.startswith("layers.") else "",
                              []).append(i)
        self.members = list(groups.values())
        self.block_groups = [list(groups).index(f"layers.{j}") for j in range(len(base.layers))]
        self.root = list(groups).index("")
        self.group_of = {i: g for g, idx in enumerate(self.members) for i in idx}
        self.where: dict[int, tuple[int, int]] = {}  # storage data_ptr -> (group, leaf)

    def cast_into(self, gi: int, outs: list[torch.Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_(outs, [self.master[i] for i in self.members[gi]])
        for k, t in enumerate(outs):
            self.where[t.untyped_storage().data_ptr()] = (gi, k)

    def drop(self, outs: list[torch.Tensor]) -> None:
        for t in outs:
            self.where.pop(t.untyped_storage().data_ptr(), None)
            t.untyped_storage().resize_(0)

    def refill(self, gi: int, outs: list[torch.Tensor]) -> None:
        """Cast group ``gi`` again into its freed tensors (autograd saved them: their
        version counters are kept)."""
        for t in outs:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
            self.cast_into(gi, outs)

    def pack(self, t: torch.Tensor):
        hit = self.where.get(t.untyped_storage().data_ptr())
        return t if hit is None else (hit, t.detach())

    def unpack(self, x):
        if type(x) is not tuple:
            return x
        (gi, _), t = x
        self.use(gi)  # resident again
        return t

    def update(self, grads: list[torch.Tensor]) -> None:
        for m, g in zip(self.master, grads):
            m.grad = g.float()
        self.opt.step()
        self.opt.zero_grad()


class Hooks(_Reference):
    """FULL_SHARD by module hooks (pre-hook casts, post-hook frees)."""

    def __init__(self, base: torch.nn.Module):
        super().__init__(base)
        params = dict(self.model.named_parameters())
        self.low = [[params[self.names[i]] for i in idx] for idx in self.members]
        self.resident = [True] * len(self.members)
        for gi in range(len(self.members)):
            self.free(gi)
        for gi, block in zip(self.block_groups, self.model.layers):
            block.register_forward_pre_hook(lambda *_, gi=gi: self.use(gi))
            block.register_forward_hook(lambda *_, gi=gi: self.free(gi))

    def use(self, gi: int) -> None:
        if not self.resident[gi]:
            self.refill(gi, self.low[gi])
            self.resident[gi] = True

    def free(self, gi: int) -> None:
        self.drop(self.low[gi])
        self.resident[gi] = False

    def step(self, batch) -> None:
        x, y = batch
        self.use(self.root)  # the rest: resident all step, as FSDP2's root
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten()).backward()
        for gi in range(len(self.members)):
            self.free(gi)
        self.update([p.grad for p in self.model.parameters()])
        self.model.zero_grad(set_to_none=True)


class _Stand(torch.Tensor):
    """A parameter before its group's first op: shape and dtype, no storage."""

    @staticmethod
    def __new__(cls, owner, gi: int, shape):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=LOW, requires_grad=True,
                                                device=owner.master[0].device)
        t._owner, t._gi = owner, gi
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            for x in (*args, *kwargs.values()):
                if isinstance(x, _Stand):
                    x._owner.use(x._gi)
                    break
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"host_floor: {func} reached an unbound stand-in")


_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
             torch.Tensor.device.__get__, torch.Tensor.ndim.__get__, torch.Tensor.size,
             torch.Tensor.dim, torch.Tensor.requires_grad.__get__}


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    torch._C._swap_tensor_impl(a, b)
    a.__class__, b.__class__ = b.__class__, a.__class__
    a.__dict__, b.__dict__ = b.__dict__, a.__dict__


class _Cast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, gi, *masters):
        ctx.owner, ctx.gi = owner, gi
        outs = [torch.empty_like(m, dtype=LOW) for m in masters]
        owner.cast_into(gi, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner.grads[ctx.gi] = grads
        return (None, None, *[None] * len(grads))


class StandIns(_Reference):
    """FULL_SHARD by stand-ins bound on first use, no module hook."""

    def use(self, gi: int) -> None:
        if gi == self.active:
            return
        if self.active is not None:
            self.free(self.active)
        self.active = gi
        if self.fulls[gi] is None:
            idx = self.members[gi]
            self.fulls[gi] = list(_Cast.apply(self, gi, *[self.master[i] for i in idx]))
        elif not self.resident[gi]:
            self.refill(gi, self.fulls[gi])
        self.resident[gi] = True
        if not self.backward:
            self.bind(gi, True)

    def bind(self, gi: int, on: bool) -> None:
        if self.bound[gi] != on:
            for k, i in enumerate(self.members[gi]):
                _swap(self.stands[i], self.fulls[gi][k])
            self.bound[gi] = on

    def free(self, gi: int) -> None:
        self.bind(gi, False)
        if self.resident[gi]:
            self.drop(self.fulls[gi])
            self.resident[gi] = False

    def step(self, batch) -> None:
        x, y = batch
        n = len(self.members)
        self.fulls, self.grads = [None] * n, [None] * n
        self.resident, self.bound = [False] * n, [False] * n
        self.active, self.backward = None, False
        self.stands = [_Stand(self, self.group_of[i], m.shape) for i, m in enumerate(self.master)]
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), \
                install(self.model, dict(zip(self.names, self.stands))):
            loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
            for gi in range(n):
                self.bind(gi, False)
            self.backward = True
            loss.backward()
        for gi in range(n):
            self.free(gi)
        self.update([self.grads[self.group_of[i]][self.members[self.group_of[i]].index(i)]
                     for i in range(len(self.master))])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_floor",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    ap.add_argument("--blocks", type=int, default=Config().blocks)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = host_config(Config(precision="bf16", blocks=args.blocks, device=args.device))
    base, bs = build_model(cfg), batches(cfg, 0)
    hooks, stands = Hooks(base), StandIns(base)
    for b in bs[:3]:
        hooks.step(b)
        stands.step(b)
    diff = max((a - b).abs().max().item() for a, b in zip(hooks.master, stands.master))
    print(f"hooks vs stand_ins after 3 steps: max difference {diff}")
    if diff != 0.0:
        raise SystemExit("host_floor: the two references disagree; their timings mean nothing")
    modes = dataclasses.replace(cfg, modes=("funshard_full", "floor", "fsdp2_full"))
    meshes = meshes_for(modes, modes.modes)
    forced = build_mode("funshard_full", base, modes, meshes).step

    def funshard_forced(batch) -> None:
        with force_collectives():
            forced(batch)

    runs = {"floor": build_mode("floor", base, modes, meshes).step,
            "hooks": Hooks(base).step, "stand_ins": StandIns(base).step,
            "funshard": build_mode("funshard_full", base, modes, meshes).step,
            "funshard_forced": funshard_forced,
            "fsdp2": build_mode("fsdp2_full", base, modes, meshes).step}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = interleaved(runs, bs, args.rounds, args.steps, sync)
    print(f"\nhost-bound GPT {cfg.blocks} x {cfg.dim}, world 1, bfloat16, {args.device}, "
          f"median of {args.rounds} rounds of {args.steps} steps\n")
    return paired_table(times, "step", "floor")


def interleaved(runs: dict, bs: list, rounds: int, steps: int, sync=lambda: None) -> dict:
    """Each of ``runs`` (name -> a step of one batch) for ``steps`` batches in turn, ``rounds``
    times after a first round that warms up: per name, its ms per step in each round."""
    times: dict[str, list[float]] = {m: [] for m in runs}
    for rnd in range(rounds + 1):
        for m, step in runs.items():
            sync()
            t0 = time.perf_counter()
            for i in range(steps):
                step(bs[i % len(bs)])
            sync()
            if rnd:
                times[m].append((time.perf_counter() - t0) / steps * 1e3)
    return times


def paired_table(times: dict, what: str, base: str) -> dict:
    """Print each run's median ms per step and its time against ``base``'s, the median of
    the rounds' ratios (paired); return the medians."""
    out = {m: statistics.median(t) for m, t in times.items()}
    print(f"| {what} | ms | x {base} (paired) |\n|---|---:|---:|")
    for m, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times[base]))
        print(f"| {m} | {out[m]:.2f} | {ratio:.3f} |")
    return out

if __name__ == "__main__":
    main()
