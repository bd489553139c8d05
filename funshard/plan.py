"""Scaling on paper: per-rank memory and bytes communicated per step, from shapes alone.

``plan`` does the arithmetic of :func:`fs.train_step` (groups, ``torch.chunk`` padding,
one flat bucket per group and direction, the 16-byte alignment of all-gather buffers)
without a process group, so a 7B-parameter model on 1024 ranks costs nothing to size:

    >>> with torch.device("meta"):
    ...     model = GPT(vocab=32000, dim=4096, heads=32, layers=32, seq=2048)
    >>> p = plan(model, shard=128, replicate=8, policy=Policy(param_dtype=torch.bfloat16),
    ...          **gpt_order(32))
    >>> p.memory["params"] / 2**20      # MiB of fp32 master shards on the largest rank
    >>> p.comms["all_gather"].count     # 65: the root twice, every block twice but the last

Byte conventions, per kind and step: ``bytes`` is the logical buffer (all-gather output,
reduce-scatter input, all-reduce tensor), the quantity the lower bound "2 all-gathers + 1
reduce-scatter of the parameter bytes" speaks of; ``counted`` is what
:class:`funshard.testing.CountCollectives` records (the c10d op's first argument: the
all-gather output, the reduce-scatter *output*); ``wire`` is what each rank sends with
ring algorithms. Memory excludes activations (they depend on the batch, not the mesh).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from .layout import Layout, gather_bytes
from .step import Policy
from .step.schedule import Schedule, group_names, make_schedule, partition

def _metrics_bytes(leaves: int) -> int:
    """The step's one all-reduce, float64: loss, squared grad norm, fs.Mean's count and kind,
    the local batch's rows and their square, the gather order's check, and per trainable
    leaf its squared norm and whether this rank reached it (the optimizers ``plan`` knows
    are gated on the device, which names a non-finite leaf and drops an unreached one from
    these: [Note: a step that reads nothing] in funshard.step.deferred)."""
    return 8 * (8 + 2 * leaves)


class Traffic(NamedTuple):
    """One kind of collective in one step."""

    count: int
    bytes: int  # logical: all-gather output, reduce-scatter input, all-reduce tensor
    counted: int  # CountCollectives' convention: the c10d op's first argument
    wire: int  # sent per rank, ring algorithms


class Plan(NamedTuple):
    """What one training step costs each rank: memory by kind and traffic by collective
    (funshard's; a tensor-parallel model's own collectives on "tp" are not counted)."""

    mesh: tuple[int, int]  # (replicate, shard)
    numel: int  # parameters, a tied one once
    param_bytes: int  # in the compute dtype: what one gather of every group moves
    groups: tuple[str, ...]
    group_bytes: tuple[int, ...]  # full (padded) bytes of each group, compute dtype
    memory: dict[str, int]  # per rank (the largest rank), bytes
    comms: dict[str, Traffic]  # per step, by kind ("all_gather", "reduce_scatter", "all_reduce")
    bound: dict[str, Traffic]  # the lower bound: 2 (or 1) gathers + 1 reduction of every group
    tp: int = 1  # the mesh's "tp" size


def gpt_order(layers: int, root: str = "", prefix: str = "layers") -> dict[str, list[str]]:
    """Group use order of :class:`funshard.testing.models.GPT` (``forward=``, ``backward=`` of
    plan).

    Forward uses the root group (embeddings), every block, the root again (final norm and
    tied head); backward starts with the root still gathered, regathers every block in
    reverse and never needs the root again (embedding backward saves no weights).
    """
    blocks = [f"{prefix}.{i}" for i in range(layers)]
    return {"forward": [root, *blocks, root], "backward": blocks[::-1]}


def gpt_dims(params: float, *, vocab: int = 32000, seq: int = 2048) -> dict[str, int]:
    """GPT dims of about ``params`` parameters: width / depth = 128, width a multiple of 256."""
    if params <= 0:
        raise ValueError(f"gpt_dims: params={params!r} must be > 0")
    dim = max(256, 256 * round((params * 128 / 12) ** (1 / 3) / 256))
    per_block = 12 * dim * dim + 13 * dim
    layers = max(1, round((params - (vocab + seq) * dim) / per_block))
    return {"vocab": vocab, "dim": dim, "heads": max(1, dim // 128), "layers": layers, "seq": seq}


def tp_dims(model: nn.Module, tp_plan: Mapping[str, Any]) -> dict[str, int]:
    """The dimension each parameter is split on over ``"tp"`` by ``tp_plan`` (what
    ``parallelize_module(model, mesh["tp"], tp_plan)`` takes: module paths, ``*`` for one
    path atom, to torch's parallel styles), for :func:`plan`'s ``tp_dims``.
    ``ColwiseParallel`` splits a Linear's weight and bias on dim 0 and an Embedding's weight
    on dim 1; ``RowwiseParallel`` a Linear's weight on dim 1 (its bias stays whole) and an
    Embedding's on dim 0; ``SequenceParallel`` and the ``PrepareModule*`` styles split none."""
    from torch.distributed.tensor import parallel as tp

    split = {(tp.ColwiseParallel, nn.Linear): {"weight": 0, "bias": 0},
             (tp.ColwiseParallel, nn.Embedding): {"weight": 1},
             (tp.RowwiseParallel, nn.Linear): {"weight": 1},
             (tp.RowwiseParallel, nn.Embedding): {"weight": 0}}
    whole = (tp.SequenceParallel, tp.PrepareModuleInput, tp.PrepareModuleOutput,
             tp.PrepareModuleInputOutput)
    out: dict[str, int] = {}
    modules = dict(model.named_modules())
    canonical = {id(v): k for k, v in reversed(list(model.named_parameters()))}  # tied: first
    for pattern, style in tp_plan.items():
        atoms = pattern.split(".")
        found = [n for n in modules if len(n.split(".")) == len(atoms) and all(
            fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), atoms))]
        if not found:
            raise ValueError(f"tp_dims: {pattern!r} names no module of the "
                             f"{type(model).__name__}")
        for name in found:
            if isinstance(style, whole):
                continue
            kind = next((k for k in split if isinstance(style, k[0])
                         and isinstance(modules[name], k[1])), None)
            if kind is None:
                raise ValueError(
                    f"tp_dims: {type(style).__name__} on {name!r} (a "
                    f"{type(modules[name]).__name__}) splits parameters in a way plan does "
                    "not know; give plan(tp_dims=) the dimension of each parameter yourself.")
            for leaf, dim in split[kind].items():
                t = getattr(modules[name], leaf, None)
                if t is None:
                    continue
                key = canonical.get(id(t), f"{name}.{leaf}")
                if out.setdefault(key, dim) != dim:
                    raise ValueError(f"tp_dims: {key!r} is split on dim {out[key]} and, as "
                                     f"{name}.{leaf}, on dim {dim}")
    return out


def _leaves(shapes: Any) -> list[tuple[str, torch.Size, torch.dtype, bool]]:
    if isinstance(shapes, nn.Module):
        shapes = dict(shapes.named_parameters())
    if not isinstance(shapes, Mapping):
        raise TypeError(
            f"plan: shapes must be an nn.Module or a dict fqn -> tensor | shape, got "
            f"{type(shapes).__name__}; e.g. fs.params(model) or {{'w': (1024, 1024)}}."
        )
    out = []
    for name, v in shapes.items():
        if isinstance(v, torch.Tensor):
            out.append((name, v.shape, v.dtype, bool(v.requires_grad)))
        elif isinstance(v, Sequence) and all(isinstance(s, int) and s >= 0 for s in v):
            out.append((name, torch.Size(v), torch.float32, True))
        else:
            raise TypeError(
                f"plan: shapes[{name!r}] is {v!r:.60}; give a tensor (meta is fine) or a "
                "sequence of non-negative ints."
            )
    return out


def _pairs(seq: list[int], nbytes: Sequence[int]) -> int:
    """Largest bytes of two consecutive distinct groups in a use order (or one group)."""
    best = max((nbytes[g] for g in seq), default=0)
    for a, b in zip(seq, seq[1:]):
        if a != b:
            best = max(best, nbytes[a] + nbytes[b])
    return best


def _dedupe(seq: list[int]) -> list[int]:
    return [g for j, g in enumerate(seq) if j == 0 or seq[j - 1] != g]


def plan(
    shapes: Any,
    *,
    shard: int,
    replicate: int = 1,
    tp: int = 1,
    tp_dims: Mapping[str, int] | None = None,
    policy: Policy = Policy(),
    optimizer: str = "adamw",
    forward: Sequence[str] | None = None,
    backward: Sequence[str] | None = None,
) -> Plan:
    """Per-rank memory and per-step traffic of ``fs.train_step`` on a (replicate, shard)
    mesh, or a (replicate, shard, tp) one with a tensor-parallel model.

    Args:
        shapes: an ``nn.Module`` (meta is fine) or a dict fqn -> tensor | shape (float32,
            trainable); every leaf of ndim >= 1 is sharded on dim 0, 0-d leaves replicated,
            as ``fs.shard``'s default spec does.
        shard: the mesh's ``"shard"`` size.
        replicate: the mesh's ``"replicate"`` size.
        tp: the mesh's ``"tp"`` size; ``tp_dims``: the dimension the model splits each
            parameter on over it (:func:`tp_dims` reads a ``parallelize_module`` plan);
            the others are whole on every ``"tp"`` rank. funshard shards each rank's part.
        policy: groups, ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``,
            ``prefetch`` as the step would use them.
        optimizer: ``"adamw"`` (2 state tensors per parameter), ``"sgd_momentum"`` (1),
            ``"sgd"`` (0).
        forward: group names in the order the loss uses them (a group may repeat); default:
            groups in parameter order. :func:`gpt_order` gives the GPT's.
        backward: the groups backward gathers again, in its order; default: ``forward``
            reversed with the last forward group still gathered. As the step does, a
            backward that starts with one of the last two forward groups keeps that group
            gathered from forward on.
    Returns:
        :class:`Plan`. ``memory`` (bytes, on the rank with the largest shards): ``params``,
        ``grads`` (reduced shards, until the optimizer runs), ``optimizer``,
        ``unsharded_peak`` (what the step reports as ``metrics["unsharded_bytes_peak"]``
        once the order is learned), ``reduce_buffers`` (estimate: one group's full
        gradients and the flat buffer they are reduced from) and ``total``.
    """
    for name, v in (("shard", shard), ("replicate", replicate), ("tp", tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"plan: {name}={v!r} must be a positive int")
    n_state = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}.get(optimizer)
    if n_state is None:
        raise ValueError(f"plan: optimizer={optimizer!r}; use 'adamw', 'sgd_momentum' or 'sgd'")
    t = _tree(shapes, shard, policy, tp, dict(tp_dims or {}))
    sched = _schedule(t, policy, forward, backward, gathers=shard * replicate > 1)
    comms = _gather_traffic(t, sched, policy, shard)
    comms.update(_reduce_traffic(t, policy, shard, replicate, tp))
    comms = {k: v for k, v in comms.items() if v.count}
    return Plan((replicate, shard), t.numel, t.pbytes, tuple(t.groups), tuple(t.group_bytes),
                _memory(t, sched, policy, n_state), comms, _bound(t, policy, shard, replicate),
                tp)


class _Tree(NamedTuple):
    """The leaves as the step would see them on rank 0 of ``"shard"`` (and of ``"tp"``: the
    model's part of each leaf)."""

    lays: list[Layout]
    trainable: list[bool]
    dtypes: list[torch.dtype]  # compute dtypes
    groups: list[str]
    members: list[list[int]]
    group_bytes: list[int]  # full (padded) bytes per group, compute dtype
    pbytes: int  # parameter bytes (this rank's parts) in the compute dtype, no padding
    numel: int  # the whole parameters' elements

    def rdt(self, i: int, policy: Policy) -> torch.dtype:
        return policy.reduce_dtype or self.dtypes[i]


def _part(name: str, shape: torch.Size, tp: int, dims: dict) -> torch.Size:
    """Rank 0's part of a leaf the model splits on dim ``dims[name]`` over ``tp`` ranks (the
    largest: ``torch.chunk``'s first)."""
    d = dims.pop(name, None)
    if d is None or tp == 1:
        return shape
    if not -len(shape) <= d < len(shape):
        raise ValueError(f"plan: tp_dims[{name!r}] = {d} is no dimension of its shape "
                         f"{tuple(shape)}")
    return torch.Size(-(-n // tp) if j == d % len(shape) else n for j, n in enumerate(shape))


def _tree(shapes: Any, shard: int, policy: Policy, tp: int, dims: dict) -> _Tree:
    leaves = _leaves(shapes)
    names = [n for n, *_ in leaves]
    numel = sum(math.prod(s) for _, s, *_ in leaves)
    leaves = [(n, _part(n, s, tp, dims), dt, tr) for n, s, dt, tr in leaves]
    if dims:
        raise ValueError(f"plan: tp_dims names {sorted(dims)}, which are no leaves of shapes")
    lays = [Layout(n, s, dt, len(s) > 0, shard, 0) for n, s, dt, _ in leaves]
    dtypes = [policy.compute_dtype(n, dt) for n, _, dt, _ in leaves]
    groups, members = partition(group_names(names, policy.groups, dict.fromkeys(names, 0),
                                            [s for _, s, *_ in leaves]))
    group_bytes = [sum(lays[i].full_bytes(dtypes[i]) for i in idx if lays[i].sharded)
                   for idx in members]
    pbytes = sum(math.prod(lay.shape) * dt.itemsize for lay, dt in zip(lays, dtypes))
    return _Tree(lays, [t for *_, t in leaves], dtypes, groups, members, group_bytes, pbytes,
                 numel)


def _schedule(t: _Tree, policy: Policy, forward, backward, gathers: bool) -> Schedule:
    """The step's :class:`Schedule` for a stated order; backward is assumed to reach a
    group's leaves in reverse parameter order (for the kept group's split)."""
    index = {g: k for k, g in enumerate(t.groups)}
    for what, seq in (("forward", forward), ("backward", backward)):
        unknown = [g for g in (seq or []) if g not in index]
        if unknown:
            raise ValueError(f"plan: {what} names groups {unknown} that no parameter is in; "
                             f"the groups are {t.groups}.")
    fwd = [index[g] for g in forward] if forward is not None else list(range(len(t.groups)))
    bwd = [index[g] for g in backward] if backward is not None else _dedupe(fwd[::-1])[1:]

    def kept_leaves(g: int):
        idx = t.members[g]
        pos = [k for k, i in enumerate(idx) if t.lays[i].sharded]
        return pos, pos[::-1], [t.lays[i].full_bytes(t.dtypes[i]) for i in idx]

    return make_schedule(_dedupe(fwd), bwd, reshard_after_forward=policy.reshard_after_forward,
                         kept_leaves=kept_leaves, gathers=gathers)


def _memory(t: _Tree, sched: Schedule, policy: Policy, n_state: int) -> dict[str, int]:
    """Per-rank bytes by kind, on the rank with the largest shards (rank 0 of "shard")."""
    local = [lay.local_rows * lay.row_numel * lay.dtype.itemsize for lay in t.lays]
    if policy.reshard_after_forward:  # the computing group and the prefetched next one
        peak = max(t.group_bytes, default=0)
        if policy.prefetch:
            peak = max(peak, _pairs(list(sched.forward), t.group_bytes),
                       _pairs(_dedupe(list(sched.backward)), t.group_bytes))
    else:
        peak = sum(t.group_bytes[g] for g in set(sched.forward))
    grad_full = [sum(t.lays[i].full_bytes(t.rdt(i, policy)) for i in idx if t.trainable[i])
                 for idx in t.members]
    memory = {
        "params": sum(local),
        "grads": sum(b for b, tr in zip(local, t.trainable) if tr),
        "optimizer": n_state * sum(b for b, tr in zip(local, t.trainable) if tr),
        "unsharded_peak": peak,
        # one group's full gradients and the flat buffer they are chunked into
        "reduce_buffers": 2 * max(grad_full, default=0),
    }
    memory["total"] = sum(memory.values())
    return memory


def _ring(n: int) -> float:
    return (n - 1) / n


def _gather_traffic(t: _Tree, sched: Schedule, policy: Policy, shard: int) -> dict:
    """One all-gather per gather of a group (the kept group's late leaves once more)."""
    def bucket(leaves: list[int]) -> int:
        sharded = [i for i in leaves if t.lays[i].sharded]
        return gather_bytes([t.lays[i] for i in sharded], [t.dtypes[i] for i in sharded])

    per_group = [bucket(idx) if shard > 1 else 0 for idx in t.members]
    gathers = (list(sched.forward) + list(sched.backward) if policy.reshard_after_forward
               else sorted(set(sched.forward)))
    ag = [per_group[g] for g in gathers if per_group[g]]
    if sched.kept is not None and shard > 1 and sched.kept_late:
        idx = t.members[sched.kept]
        ag.append(bucket([idx[k] for k in sched.kept_late]))
    return {"all_gather": Traffic(len(ag), sum(ag), sum(ag), int(sum(ag) * _ring(shard)))}


def _reduce_traffic(t: _Tree, policy: Policy, shard: int, replicate: int, tp: int) -> dict:
    """Per group and reduce dtype: one reduce-scatter (sharded leaves), one all-reduce on
    "shard" (replicated leaves), one on "replicate"; plus the step's metrics all-reduce."""
    rs_in = rs_out = ar = ar_rep = n_rs = n_ar = n_ar_rep = 0
    for idx in t.members:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in (i for i in idx if t.trainable[i]):
            by_dtype.setdefault(t.rdt(i, policy), []).append(i)
        for dt, ids in by_dtype.items():
            seg = sum(t.lays[i].padded_numel for i in ids if t.lays[i].sharded)
            rep = sum(t.lays[i].row_numel * t.lays[i].rows for i in ids if not t.lays[i].sharded)
            if seg and shard > 1:
                n_rs += 1
                rs_in += shard * seg * dt.itemsize
                rs_out += seg * dt.itemsize
            if rep and shard > 1:
                n_ar += 1
                ar += rep * dt.itemsize
            if (seg or rep) and replicate > 1:
                n_ar_rep += 1
                ar_rep += (seg + rep) * dt.itemsize
    world = shard * replicate * tp  # the metrics: over every rank
    metrics = 1 if world > 1 else 0
    sums = _metrics_bytes(sum(t.trainable))
    ar_bytes = ar + ar_rep + metrics * sums
    wire = int(2 * _ring(shard) * ar + 2 * _ring(replicate) * ar_rep
               + 2 * _ring(world) * metrics * sums)
    return {
        "reduce_scatter": Traffic(n_rs, rs_in, rs_out, int(rs_in * _ring(shard))),
        "all_reduce": Traffic(n_ar + n_ar_rep + metrics, ar_bytes, ar_bytes, wire),
    }


def _bound(t: _Tree, policy: Policy, shard: int, replicate: int) -> dict:
    """Every parameter gathered twice (once) and reduced once, no padding."""
    pbytes = t.pbytes
    G = sum(1 for idx in t.members if any(t.lays[i].sharded and t.trainable[i] for i in idx))
    k = 2 if policy.reshard_after_forward else 1
    bound = {}
    if shard > 1:
        bound["all_gather"] = Traffic(k * G, k * pbytes, k * pbytes,
                                      int(k * pbytes * _ring(shard)))
        bound["reduce_scatter"] = Traffic(G, pbytes, pbytes // shard, int(pbytes * _ring(shard)))
    if replicate > 1:
        b = pbytes // shard
        bound["all_reduce"] = Traffic(G, b, b, int(2 * b * _ring(replicate)))
    return bound
