"""Gradient reductions over the data-parallel ranks: ``reduce_grads`` and global norms.

    >>> grads = reduce_grads({"w": g}, like=sparams)   # g: (7, 3) per rank -> DTensor shards
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from . import _compat
from . import collectives, pytree
from .layout import (Layout, as_dtensor, check_float_dtype, describe, from_model, norm_weight,
                     spread_of)
from .mesh import mesh_str


def reduce_grads(local_grads, like, *, op: str = "mean", reduce_dtype: torch.dtype | None = None,
                 transport: str = "c10d"):
    """Per-rank full-shape gradients -> shards of their mean (or sum) over all mesh ranks.

    Args:
        local_grads: tree of full-shape tensors (or None), ``like``'s structure; on a mesh
            with the model's own dimensions, a leaf the model places there has its gradient
            as the model holds it: a DTensor on ``mesh["tp"]`` (a pending reduction there is
            reduced first).
        like: the sharded tree (DTensors) whose placements the result takes.
        op: ``"mean"`` (default) or ``"sum"`` over data-parallel ranks.
        reduce_dtype: reduce in this dtype (e.g. float32 for bf16 grads).
        transport: how the bytes move: ``"c10d"`` (default: the backend's collectives),
            ``"p2p"`` or ``"cma"`` (opt-in, one host's gloo CPU ranks; see
            :mod:`funshard.collectives.base`).
    Returns:
        tree of DTensor gradient shards (None where the gradient was None).

    Example: on 2 ranks, ``g`` of shape (7, 3) -> DTensor (7, 3), local (4, 3) / (3, 3).
    """
    collectives.failures.in_step()  # see [Note: a rank out of step]
    collectives.check_transport(transport, where="reduce_grads")
    check_float_dtype(reduce_dtype, "reduce_grads: reduce_dtype")
    if op not in ("mean", "sum"):
        raise ValueError(f"reduce_grads: op={op!r}; use 'mean' or 'sum'")
    mesh, paths, likes, layouts, spec = describe(like, what="reduce_grads", model=True)
    gl = pytree.leaves_like(local_grads, like, names=("local_grads", "like"))
    gl = [None if g is None else from_model(g.detach(), lay, "reduce_grads")
          for g, lay in zip(gl, layouts)]
    for lay, g in zip(layouts, gl):
        if g is not None and tuple(g.shape) != tuple(lay.shape):
            raise ValueError(
                f"reduce_grads: gradient {lay.path!r} has shape {tuple(g.shape)} but the "
                f"parameter has global shape {tuple(lay.shape)} on {mesh_str(mesh)}; pass "
                "full-shape per-rank gradients (not local shards)."
            )
    gl = [g.detach() if g is not None else None for g in gl]  # not differentiable
    present = [k for k, g in enumerate(gl) if g is not None]
    out = [None] * len(gl)
    got = collectives.reduce_scatter(  # "ep": the model's dimensions averaged over too
        [layouts[k] for k in present], [gl[k] for k in present], mesh,
        reduce_dtype=reduce_dtype, op=op, transport=transport,
        spreads=[spread_of(likes[k]) for k in present])
    for k, g in zip(present, got):
        out[k] = as_dtensor(g, likes[k])
    return pytree.unflatten(spec, out)


def norm_weights(layouts: Sequence[Layout], mesh) -> list[float]:
    """Weight of each leaf's local squared norm in the all-ranks sum, so that every element
    counts once: a sharded leaf is held once per replica, a replicated one by every rank."""
    return [norm_weight(lay, mesh.size()) for lay in layouts]


def norms(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, float32: a complex gradient's is its modulus's (the imaginary
    part counts, as in ``torch.nn.utils.clip_grad_norm_``; a ``.float()`` would drop it);
    float64 and the half precisions are rounded to float32 first."""
    return _compat.foreach_norm([g if g.dtype in (torch.float32, torch.complex64) else
                                 real(g).float() for g in grads])


def real(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a complex ``t`` as the real pairs it is made of (a view), where a real
    tensor is needed that loses nothing of it (a ``.float()`` drops the imaginary part)."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def local_sq_norm(grads: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor,
                  device: torch.device) -> torch.Tensor:
    """This rank's weighted share of the global squared norm (float64, on ``device``, the
    gradients' device); all-reduced (summed) over the mesh it is the squared global norm.
    ``weights``: one per gradient, or already a float64 tensor of them on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    per = norms(grads)
    w = (weights if isinstance(weights, torch.Tensor)
         else torch.tensor(list(weights), dtype=torch.float64, device=device))
    return (torch.stack(per).double() ** 2 * w).sum()


def first_nonfinite(grads: Sequence[torch.Tensor], mesh) -> list[int]:
    """Positions (over all ranks) of the gradients that are not finite somewhere."""
    if not grads:
        return []
    bad = torch.stack([(~g.isfinite()).any() for g in grads]).float()  # on the grads' device
    if mesh.size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return [j for j, b in enumerate(bad.tolist()) if b > 0]
