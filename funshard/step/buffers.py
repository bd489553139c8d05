"""Buffers in the step: BatchNorm's running statistics and their like.

A module's persistent buffers (``fs.buffers(module)``) travel in ``TrainState.buffers``,
replicated on the params' mesh (not sharded, not differentiated). ``loss_fn`` receives
``(params, buffers)`` as its first argument (a pair ``torch.func.functional_call`` takes as
it is) with the buffers as plain tensors: copies, so a step that raises leaves the state's
buffers as they were. What ``loss_fn`` writes into them in place (BatchNorm in training
mode) is kept: after the update, the policy's rule makes the ranks agree, and the state's
buffers take the result.

Rules (``Policy(buffers=...)``), over all ranks of the mesh (every rank is data-parallel):

- ``"mean"`` (default): floating (and complex) buffers become their mean over ranks;
  others (BatchNorm's ``num_batches_tracked``) take rank 0's value. A running mean then
  equals the one a single process would keep on the whole batch (the running average is
  linear in the batch mean; with equal local batch sizes). A running *variance* is the
  mean of the ranks' variances, which lacks the spread between ranks' means: exact parity
  needs SyncBatchNorm.
- ``"broadcast"``: every rank takes rank 0's buffers (DDP's ``broadcast_buffers``).
- ``"own"``: each rank keeps its own (FSDP's behaviour); no collective; replicas drift apart
  and a checkpoint keeps rank 0's.

Cost: one collective per step and dtype of buffers ("mean": an all-reduce of the floating
buffers in float64 and a broadcast of the rest; "broadcast": broadcasts), none for "own".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import _compat, collectives, pytree
from ..reduce import real
from ..shard import shard

RULES = ("mean", "broadcast", "own")
STATS = ("running_mean", "running_var")  # F.batch_norm's, beside the module's weight and bias


def prepare(buffers: Any, mesh: DeviceMesh, *, where: str) -> Any:
    """A tree of tensors -> the same tree replicated on ``mesh`` (copies, no grad)."""
    paths, leaves, spec = pytree.flatten_with_path(buffers)
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: buffer {pytree.fqn(p)!r} is a {type(x).__name__}, not a "
                            "tensor; pass fs.buffers(model).")
        if isinstance(x, DTensor) and x.device_mesh != mesh:
            raise ValueError(f"{where}: buffer {pytree.fqn(p)!r} lives on another mesh than the "
                             "parameters.")
    if all(isinstance(x, DTensor) for x in leaves):
        return buffers
    plain = pytree.unflatten(spec, [x.full_tensor() if isinstance(x, DTensor) else x.detach()
                                    for x in leaves])
    return shard(plain, mesh, spec="replicate")


def check_dtypes(params, buffers: Any, *, where: str) -> None:
    """A module's weight and bias compute in the dtype of its running statistics, or the step
    is refused by name: ``F.batch_norm`` takes float32 statistics with a float32 weight (a
    bfloat16 input is fine), not with a bfloat16 one. ``params``: a ``ParamGroups``."""
    computes = {lay.path: (dt, lay.dtype) for lay, dt in zip(params.layouts, params.dtypes)}
    for p, b in zip(*pytree.flatten_with_path(buffers)[:2]):
        path = pytree.fqn(p)
        module, _, name = path.rpartition(".")
        if name not in STATS or not b.is_floating_point():
            continue
        for leaf in (f"{module}.weight" if module else "weight",
                     f"{module}.bias" if module else "bias"):
            dt, own = computes.get(leaf, (b.dtype, b.dtype))
            if dt != b.dtype:
                fix = (f"Keep the module's leaves in their own dtype: Policy(keep_dtype=lambda "
                       f"fqn: fqn.startswith({module + '.'!r})), or a predicate selecting "
                       "every such module" if own == b.dtype else
                       "Give the statistics the weight's dtype, or the weight theirs")
                raise TypeError(
                    f"{where}: parameter {leaf!r} computes in {dt}, but its module's running "
                    f"statistic {path!r} (in the buffers) is {b.dtype}; F.batch_norm takes "
                    f"the weight and bias in the statistics' dtype only, so the step would "
                    f"fail. {fix}.")


def locals_of(buffers: Any) -> tuple[list[DTensor], list[torch.Tensor], Any]:
    """The state's buffer DTensors, working copies of their local tensors, and the tree of
    those copies that ``loss_fn`` receives."""
    leaves, spec = pytree.flatten(buffers)
    work = [_compat.local_tensor(d).clone() for d in leaves]
    return leaves, work, pytree.unflatten(spec, work)


def sync(rule: str, work: list[torch.Tensor], mesh: DeviceMesh) -> None:
    """Make the ranks' working copies agree, in place, by ``rule``."""
    if rule == "own" or collectives.skips(mesh.size()) or not work:
        return
    averaged = [t.is_floating_point() or t.is_complex() for t in work]
    floats = [real(t) for t, a in zip(work, averaged) if a] if rule == "mean" else []
    rest = [t for t, a in zip(work, averaged) if not (rule == "mean" and a)]
    with collectives.watch(f"the buffers' {rule}", mesh):
        if floats:  # (a complex buffer's as its real pairs: a view, written through)
            flat = torch.cat([t.reshape(-1).double() for t in floats])
            dist.all_reduce(flat)
            flat /= mesh.size()
            for t, c in zip(floats, flat.split([t.numel() for t in floats])):
                t.copy_(c.view(t.shape))  # rounded once to the buffer's dtype
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in rest:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in ts])
            dist.broadcast(flat, src=0)
            for t, c in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(c.view(t.shape))


def write_back(leaves: list[DTensor], work: list[torch.Tensor],
               keep: torch.Tensor | None = None) -> None:
    """The step succeeded: the state's buffers take the working copies (in place: donated).
    ``keep``: a bool on the device, whether it succeeded (the compiled step that reads
    nothing: [Note: a step that reads nothing] in :mod:`funshard.step.deferred`); where
    false, each buffer keeps its value."""
    if not leaves:
        return
    if keep is None:
        _compat.foreach_copy_([_compat.local_tensor(d) for d in leaves], work)
        return
    for d, w in zip(leaves, work):
        _compat.local_tensor(d).copy_(torch.where(keep, w, _compat.local_tensor(d)))
