"""Ranks agree before they compute: one small collective when a step is initialised.

Every rank describes what it was given (the mesh, the Policy, each parameter's path, shape,
dtype, trainability and group) and a checksum of each local shard; ranks compare the
descriptions with rank 0's, and the checksums of ranks that must hold the same values (the
same shard on every replica; replicated leaves everywhere). A mismatch is the same
ValueError on every rank, naming the first difference and both values, before any step
could read memory of the wrong size or let replicas drift apart silently.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import collectives
from ..mesh import SHARD, mesh_str
from ..reduce import real


def fingerprint(params, policy) -> list[tuple[str, str]]:
    """``(what, value)`` pairs every rank must have alike."""
    out = [("the mesh", mesh_str(params.mesh))]
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if f.name in ("groups", "keep_dtype"):  # compared per parameter below
            continue
        if f.name == "checkpoint" and callable(value):  # compared as the groups it selects
            value = [n for n in params.names if value(n)]
        out.append((f"Policy.{f.name}", repr(value)))
    out.append(("the number of parameters", str(len(params.layouts))))
    for i, lay in enumerate(params.layouts):
        out.append((f"parameter {lay.path!r}",
                    f"shape {tuple(lay.shape)}, {lay.dtype}, "
                    f"{'trainable' if params.trainable[i] else 'frozen'}, "
                    f"group {params.names[params.group_of[i]]!r}, "
                    f"computes in {params.dtypes[i]}"))
    return out


def checksums(shards: list[torch.Tensor]) -> list[str]:
    """A cheap fingerprint of each local shard's values (sum and sum of squares, float64; a
    complex shard's as its pairs of reals), computed on its device with one host sync for
    all of them."""
    if not shards:
        return []
    sums = torch.stack([torch.stack([x.sum(), (x * x).sum()]) for x in
                        (real(s.detach()).reshape(-1).double() for s in shards)])
    return [f"{a!r}/{b!r}" for a, b in sums.tolist()]


def check(params, policy, shards: list[torch.Tensor], *, where: str,
          buffers: list[tuple[str, torch.Tensor]] = ()) -> None:
    """Raise the same ValueError on every rank unless all ranks were given the same tree,
    Policy, mesh and buffers (``(path, local tensor)``, replicated), and ranks that hold the
    same values do."""
    if collectives.skips(params.world):
        return
    desc = fingerprint(params, policy) + [("the number of buffers", str(len(buffers)))] + [
        (f"buffer {path!r}", f"shape {tuple(b.shape)}, {b.dtype}") for path, b in buffers]
    mine = (desc, checksums(shards) + checksums([b for _, b in buffers]),
            dict(zip(params.mesh.mesh_dim_names, params.mesh.get_coordinate())))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    _compare_descriptions(every, where)
    _compare_values(every, params, where)
    _compare_buffers(every, [path for path, _ in buffers], len(params.layouts), params, where)


def _compare_buffers(every: list, paths: list[str], first: int, params, where: str) -> None:
    for j, path in enumerate(paths):
        for rank, (_, sums, _) in enumerate(every):
            if sums[first + j] != every[0][1][first + j]:
                raise ValueError(
                    f"{where}: buffer {path!r} differs between rank 0 and rank {rank} (buffers "
                    f"are replicated on {mesh_str(params.mesh)}): the ranks start from "
                    "different values. Build the model alike on every rank (seeded) or load "
                    "the same state."
                )


def _compare_descriptions(every: list, where: str) -> None:
    first = every[0][0]
    for rank, (desc, _, _) in enumerate(every):
        for j in range(max(len(first), len(desc))):
            a = first[j] if j < len(first) else ("nothing", "-")
            b = desc[j] if j < len(desc) else ("nothing", "-")
            if a != b:
                what = a[0] if a[0] == b[0] else f"{a[0]} / {b[0]}"
                raise ValueError(
                    f"{where}: ranks disagree on {what}: rank 0 has {a[1]}, rank {rank} has "
                    f"{b[1]}. Every rank must build the same model and Policy on the same mesh."
                )


def _compare_values(every: list, params, where: str) -> None:
    for i, lay in enumerate(params.layouts):
        seen: dict[tuple, tuple[int, str]] = {}  # part (_part) -> (rank, checksum)
        for rank, (_, sums, coord) in enumerate(every):
            key = _part(lay, coord)
            if key not in seen:
                seen[key] = (rank, sums[i])
            elif seen[key][1] != sums[i]:
                whom = ("the same shard on two replicas" if lay.sharded
                        else "a replicated parameter")
                raise ValueError(
                    f"{where}: parameter {lay.path!r} (shape {tuple(lay.shape)}) differs "
                    f"between rank {seen[key][0]} and rank {rank} ({whom} of "
                    f"{mesh_str(params.mesh)}): the ranks start from different values and "
                    "would drift apart. Seed the initialisation alike on every rank "
                    "(torch.manual_seed before building the model) or load the same weights."
                )


def _part(lay, coord: dict) -> tuple:
    """Which part of a leaf a rank at mesh coordinate ``coord`` holds: its place on "shard"
    (a sharded leaf) and on each of the model's dimensions that split it; ranks with the
    same part hold the same values."""
    dims = [SHARD] if lay.sharded else []
    if lay.model is not None:
        dims += [n for n, pl in zip(lay.model.mesh.mesh_dim_names, lay.model.placements)
                 if not pl.is_replicate()]
    return tuple(coord[n] for n in dims)


def order_sums(order: tuple) -> list[float]:
    """The order a step gathered its groups in (per micro-batch, forward and backward), as
    ``[h, h^2]`` with h in [1, 2^20]: summed over ranks (exact in float64, in the step's
    metrics all-reduce), ``sum(h)^2 == world * sum(h^2)`` iff every rank has the same h
    (Cauchy-Schwarz). Python hashes tuples of ints alike in every process."""
    h = float(hash(order) % 2**20 + 1)
    return [h, h * h]


def check_order(sums: list[float], params, order: tuple) -> None:
    """Ranks whose ``loss_fn`` gathered the groups in different orders paired different
    groups in their collectives: the same error on every rank, before any update."""
    if sums[0] ** 2 != params.world * sums[1]:
        fwd = [params.names[g] for g in order[0][0]]
        raise ValueError(
            "train_step: the ranks gathered the parameter groups in different orders (loss_fn "
            "took another branch on some rank, e.g. on its own data); their collectives "
            "paired different groups, so the step is refused before any update. This "
            f"rank's forward order: {fwd}. Every rank must use the same groups in the same "
            "order.")
