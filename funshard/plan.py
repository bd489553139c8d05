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

import math
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from . import collectives, pytree
from .collectives import Layout
from .step import Policy, default_group, kept_into_backward, split_kept

_METRICS_BYTES = 16  # the step's one all-reduce: (loss, squared grad norm) in float64


class Traffic(NamedTuple):
    """One kind of collective in one step."""

    count: int
    bytes: int  # logical: all-gather output, reduce-scatter input, all-reduce tensor
    counted: int  # CountCollectives' convention: the c10d op's first argument
    wire: int  # sent per rank, ring algorithms


class Plan(NamedTuple):
    """What one training step costs each rank: memory by kind and traffic by collective."""

    mesh: tuple[int, int]  # (replicate, shard)
    numel: int  # parameters, a tied one once
    param_bytes: int  # in the compute dtype: what one gather of every group moves
    groups: tuple[str, ...]
    group_bytes: tuple[int, ...]  # full (padded) bytes of each group, compute dtype
    memory: dict[str, int]  # per rank (the largest rank), bytes
    comms: dict[str, Traffic]  # per step, by kind ("all_gather", "reduce_scatter", "all_reduce")
    bound: dict[str, Traffic]  # the lower bound: 2 (or 1) gathers + 1 reduction of every group


def gpt_order(layers: int, root: str = "", prefix: str = "layers") -> dict[str, list[str]]:
    """Group use order of :class:`funshard.models.GPT` (``forward=``, ``backward=`` of plan).

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


def _group_names(names: list[str], policy: Policy) -> list[str]:
    if policy.groups is None:
        return [default_group(n) for n in names]
    if callable(policy.groups):
        return [policy.groups(n) for n in names]
    tree = dict.fromkeys(names, 0)
    return pytree.broadcast_prefix(policy.groups, tree, name="Policy.groups")


def _gather_bytes(lays: list[Layout], dtypes: list[torch.dtype]) -> int:
    """Output bytes of collectives.all_gather for one bucket (0 when nothing is gathered)."""
    sizes = [lay.padded_numel * dt.itemsize for lay, dt in zip(lays, dtypes) if lay.padded_numel]
    if not sizes:
        return 0
    total = sum(sizes)
    return lays[0].world * (total + (-total % collectives._ALIGN))


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
    policy: Policy = Policy(),
    optimizer: str = "adamw",
    forward: Sequence[str] | None = None,
    backward: Sequence[str] | None = None,
) -> Plan:
    """Per-rank memory and per-step traffic of ``fs.train_step`` on a (replicate, shard) mesh.

    Args:
        shapes: an ``nn.Module`` (meta is fine) or a dict fqn -> tensor | shape (float32,
            trainable); every leaf of ndim >= 1 is sharded on dim 0, 0-d leaves replicated,
            as ``fs.shard``'s default spec does.
        shard, replicate: the mesh.
        policy: groups, ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``,
            ``prefetch`` as the step would use them.
        optimizer: ``"adamw"`` (2 state tensors per parameter), ``"sgd_momentum"`` (1),
            ``"sgd"`` (0).
        forward, backward: group names in the order the loss uses them (a group may repeat),
            backward listing the groups it gathers again; default: groups in parameter
            order, backward in reverse with the last forward group still gathered.
            :func:`gpt_order` gives the GPT's. As the step does, a backward that starts with
            one of the last two forward groups keeps that group gathered from forward on.
    Returns:
        :class:`Plan`. ``memory`` (bytes, on the rank with the largest shards): ``params``,
        ``grads`` (reduced shards, until the optimizer runs), ``optimizer``,
        ``unsharded_peak`` (what the step reports as ``metrics["unsharded_bytes_peak"]``
        once the order is learned), ``reduce_buffers`` (estimate: one group's full
        gradients and the flat buffer they are reduced from) and ``total``.
    """
    for name, v in (("shard", shard), ("replicate", replicate)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"plan: {name}={v!r} must be a positive int")
    n_state = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}.get(optimizer)
    if n_state is None:
        raise ValueError(f"plan: optimizer={optimizer!r}; use 'adamw', 'sgd_momentum' or 'sgd'")
    leaves = _leaves(shapes)
    names = [n for n, *_ in leaves]
    lays = [Layout(n, s, dt, len(s) > 0, shard, 0) for n, s, dt, _ in leaves]
    trainable = [t for *_, t in leaves]
    dtypes = [policy.param_dtype if (policy.param_dtype is not None and dt.is_floating_point)
              else dt for _, _, dt, _ in leaves]
    gnames = _group_names(names, policy)
    order: dict[str, list[int]] = {}
    for i, g in enumerate(gnames):
        order.setdefault(g, []).append(i)
    groups, members = list(order), list(order.values())
    index = {g: k for k, g in enumerate(groups)}
    for what, seq in (("forward", forward), ("backward", backward)):
        unknown = [g for g in (seq or []) if g not in index]
        if unknown:
            raise ValueError(f"plan: {what} names groups {unknown} that no parameter is in; "
                             f"the groups are {groups}.")
    fwd = [index[g] for g in forward] if forward is not None else list(range(len(groups)))
    bwd = [index[g] for g in backward] if backward is not None else _dedupe(fwd[::-1])[1:]
    kept = kept_into_backward(_dedupe(fwd), bwd, policy)
    if kept is not None:
        bwd = bwd[1:]  # the step keeps it gathered from its forward use into backward
    world = shard * replicate

    # memory on the largest rank (rank 0 of "shard" holds ceil(rows / shard) rows)
    local = [lay.local_rows * lay.row_numel * lay.dtype.itemsize for lay in lays]
    group_bytes = [sum(lays[i].world * lays[i].padded_numel * dtypes[i].itemsize
                       for i in idx if lays[i].sharded) for idx in members]
    if policy.reshard_after_forward:  # the computing group and the prefetched next one
        peak = max(group_bytes, default=0)
        if policy.prefetch:
            peak = max(peak, _pairs(_dedupe(fwd), group_bytes), _pairs(_dedupe(bwd), group_bytes))
    else:
        peak = sum(group_bytes[g] for g in set(fwd))
    rdt = lambda i: policy.reduce_dtype or dtypes[i]  # noqa: E731
    grad_full = [sum(lays[i].world * lays[i].padded_numel * rdt(i).itemsize
                     for i in idx if trainable[i]) for idx in members]
    memory = {
        "params": sum(local),
        "grads": sum(b for b, t in zip(local, trainable) if t),
        "optimizer": n_state * sum(b for b, t in zip(local, trainable) if t),
        "unsharded_peak": peak,
        # one group's full gradients and the flat buffer they are chunked into
        "reduce_buffers": 2 * max(grad_full, default=0),
    }
    memory["total"] = sum(memory.values())

    # traffic: one all-gather per gather of a group, one reduction per group
    ag_per_group = [_gather_bytes([lays[i] for i in idx if lays[i].sharded],
                                  [dtypes[i] for i in idx if lays[i].sharded])
                    if shard > 1 else 0 for idx in members]
    gathers = _dedupe(fwd) + bwd if policy.reshard_after_forward else sorted(set(fwd))
    ag = [ag_per_group[g] for g in gathers if ag_per_group[g]]
    if kept is not None and shard > 1:
        # the kept group's leaves past the first half backward needs are gathered again;
        # backward is assumed to reach a group's leaves in reverse parameter order
        idx = members[kept]
        pos = [k for k, i in enumerate(idx) if lays[i].sharded]
        late = split_kept(pos, pos[::-1], [lays[i].world * lays[i].padded_numel
                                           * dtypes[i].itemsize for i in idx])
        if late:
            ag.append(_gather_bytes([lays[idx[k]] for k in late],
                                    [dtypes[idx[k]] for k in late]))
    rs_in = rs_out = ar = ar_rep = 0
    n_rs = n_ar = n_ar_rep = 0
    for idx in members:
        keep = [i for i in idx if trainable[i]]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in keep:
            by_dtype.setdefault(rdt(i), []).append(i)
        for dt, ids in by_dtype.items():
            seg = sum(lays[i].padded_numel for i in ids if lays[i].sharded and lays[i].padded_numel)
            rep = sum(lays[i].row_numel * lays[i].rows for i in ids if not lays[i].sharded)
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
    ring = lambda n: (n - 1) / n  # noqa: E731
    metrics = 1 if world > 1 else 0
    comms = {
        "all_gather": Traffic(len(ag), sum(ag), sum(ag), int(sum(ag) * ring(shard))),
        "reduce_scatter": Traffic(n_rs, rs_in, rs_out, int(rs_in * ring(shard))),
        "all_reduce": Traffic(
            n_ar + n_ar_rep + metrics, ar + ar_rep + metrics * _METRICS_BYTES,
            ar + ar_rep + metrics * _METRICS_BYTES,
            int(2 * ring(shard) * ar + 2 * ring(replicate) * ar_rep
                + 2 * ring(world) * metrics * _METRICS_BYTES),
        ),
    }
    comms = {k: v for k, v in comms.items() if v.count}

    # the bound: every parameter gathered twice (once) and reduced once, no padding
    pbytes = sum(math.prod(lay.shape) * dt.itemsize for lay, dt in zip(lays, dtypes))
    G = sum(1 for idx in members if any(lays[i].sharded and trainable[i] for i in idx))
    k = 2 if policy.reshard_after_forward else 1
    bound = {}
    if shard > 1:
        bound["all_gather"] = Traffic(k * G, k * pbytes, k * pbytes, int(k * pbytes * ring(shard)))
        bound["reduce_scatter"] = Traffic(G, pbytes, pbytes // shard, int(pbytes * ring(shard)))
    if replicate > 1:
        b = pbytes // shard
        bound["all_reduce"] = Traffic(G, b, b, int(2 * b * ring(replicate)))
    return Plan((replicate, shard), sum(math.prod(lay.shape) for lay in lays), pbytes,
                tuple(groups), tuple(group_bytes), memory, comms, bound)
