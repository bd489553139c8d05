"""What ``loss_fn`` returns: a floating scalar loss (the mean over the local batch), or
``fs.Mean(total, count)`` (a mean over every rank's items), either alone or as
``(loss, aux)``. The loss must reach a trainable parameter, and no ``nn.Parameter`` the
step was not given; ranks whose plain means averaged over batches of different sizes are
warned.

[Note: a mean over every rank's items]

A plain loss is the mean over the local batch, and the step's gradient the mean over ranks
and micro-batches of those means: one process on the whole batch, when every local batch
counts the same. Where the items a loss averages over differ between ranks or
micro-batches (tokens whose label is masked, sequences of different lengths), the mean of
means weighs a rank's few items as much as another's many: not what one process computes
on the whole batch. ``fs.Mean(total, count)`` says what to average: backward starts from
each micro-batch's ``total`` (summed, not averaged, over micro-batches), the counts ride
on the metrics' all-reduce (no extra collective), and the reduced gradients are then
multiplied by ``world / count`` (the reduction took the mean over ranks): the gradient of
``sum(total) / sum(count)`` over every rank and micro-batch, as one process on the whole
batch. The norm, clipping, non-finite rule and optimizer see that gradient. Every rank
returns the same kind, or the step is refused on every rank.

In float16 the totals' gradients are ``count`` times a mean's: a dynamic loss scale finds
its level about log2(count) skipped steps lower (measured: 9 skipped steps for 512 tokens,
then the plain mean's losses). ``fs.Mean(total / n, count / n)``, with ``n`` the nominal
items per micro-batch (one number on every rank), is the same mean with mean-sized
gradients. bfloat16 and float32 have the range.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch

from .. import pytree
from . import scaling


@dataclasses.dataclass(frozen=True)
class Mean:
    """A loss that is ``total / count`` over every rank's and micro-batch's items: return
    ``fs.Mean(total, count)`` from ``loss_fn`` (or ``(fs.Mean(...), aux)``), ``total`` the
    sum of the items' losses (a floating scalar tensor), ``count`` how many items (a scalar
    tensor or a number; on the device, no host sync). See [Note: a mean over every rank's
    items] in :mod:`funshard.step.loss`.

        >>> total = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        >>> return fs.Mean(total, (labels != -100).sum())
    """

    total: torch.Tensor
    count: Any


def loss_of(out: Any) -> tuple[torch.Tensor | Mean, Any]:
    """``loss_fn``'s output as (loss or :class:`Mean`, aux), checked."""
    if isinstance(out, Mean):
        loss, aux = out, None
    else:
        loss, aux = (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out, None)
    value = loss.total if isinstance(loss, Mean) else loss
    if not isinstance(value, torch.Tensor) or value.ndim != 0 or not value.is_floating_point():
        what = (f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
                if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
        raise ValueError(
            f"train_step: loss_fn must return a floating scalar tensor (or (loss, aux), or "
            f"fs.Mean(total, count) with a floating scalar total), got {what}; reduce it, "
            "e.g. with .mean() (or .sum() for a Mean's total)."
        )
    if isinstance(loss, Mean):
        _check_count(loss.count)
    return loss, aux


def _check_count(count: Any) -> None:
    if isinstance(count, torch.Tensor):
        ok = count.ndim == 0 and not count.is_complex()
    else:
        ok = (isinstance(count, (int, float)) and not isinstance(count, bool)
              and math.isfinite(count) and count >= 0)
    if not ok:
        what = (f"a tensor of shape {tuple(count.shape)} and dtype {count.dtype}"
                if isinstance(count, torch.Tensor) else repr(count))
        raise ValueError(f"train_step: fs.Mean's count must be a scalar tensor or a number "
                         f">= 0 (how many items the total sums over), got {what}.")


def value(loss: torch.Tensor | Mean) -> torch.Tensor:
    """What backward starts from (before the micro-batch share and the loss scale)."""
    return loss.total if isinstance(loss, Mean) else loss


def share(loss: torch.Tensor | Mean, k: int) -> int:
    """A micro-batch's divisor: a plain loss is averaged over the ``k`` micro-batches, a
    :class:`Mean`'s total summed."""
    return 1 if isinstance(loss, Mean) else k


def count_of(loss: Mean, device: torch.device) -> torch.Tensor:
    """The count as a float64 scalar on ``device``, with no host sync (a number is filled
    in on the device: a copy from pageable host memory would wait for the GPU's stream)."""
    c = loss.count
    if isinstance(c, torch.Tensor):
        return c.detach().to(device=device, dtype=torch.float64)
    return torch.full((), float(c), dtype=torch.float64, device=device)


def same_kind(first: torch.Tensor | Mean, loss: torch.Tensor | Mean, j: int) -> None:
    """Every micro-batch returns the same kind of loss."""
    if isinstance(first, Mean) != isinstance(loss, Mean):
        kinds = ["fs.Mean" if isinstance(x, Mean) else "a plain loss" for x in (first, loss)]
        raise ValueError(
            f"train_step: loss_fn returned {kinds[0]} for micro-batch 0 and {kinds[1]} for "
            f"micro-batch {j}; return one kind for every micro-batch (and on every rank).")


def check_kind(means: float, count: float, world: int) -> float:
    """After the metrics' all-reduce (every rank sees the same sums): ``means`` ranks
    returned a :class:`Mean`, all or none of them, or the step is refused on every rank.
    Returns the gradients' factor ``world / count`` (NaN when no item was counted)."""
    if round(means) != world:
        raise ValueError(
            f"train_step: loss_fn returned fs.Mean on {round(means)} of {world} ranks and a "
            "plain loss on the others; every rank must return the same kind (a plain loss "
            "is a mean over the local batch, fs.Mean a mean over every rank's items).")
    return world / count if count > 0 else math.nan


def check_rows(rows: float, rows_sq: float, world: int) -> None:
    """After the metrics' all-reduce of each rank's rows and their square: warn (on every
    rank) when the ranks' plain-mean losses averaged over batches of different sizes."""
    if world > 1 and rows_sq * world != rows * rows:  # integers: exact in float64
        warnings.warn(
            f"train_step: the ranks' local batches differ in size along dim 0 ({rows:.0f} rows "
            f"over {world} ranks): the step's gradient is then the mean of the ranks' "
            "per-batch means, not the mean over the whole batch that one process computes. "
            "Give every rank as many rows (drop_last=True), or return fs.Mean(total, count) "
            "from loss_fn for the mean over every rank's items.")


def normalize(grads: list, factor: float) -> None:
    """The reduced gradients (the mean over ranks of the totals' gradients) times
    ``world / count``: the gradient of the mean over every item, in place."""
    scaling.multiply(grads, factor)


def check_reaches_only_params(run, loss: torch.Tensor) -> None:
    """The first step of a tree (and mesh): the loss's graph reaches no ``nn.Parameter`` but
    the step's own parameters. Any other (a module's own parameter that ``params`` does not
    name, a submodule called outside ``fs.call``, another model's) would take its gradient
    in ``.grad`` and never train, silently: refused by name before backward, the state
    unchanged. Other leaves that require grad (an input made to, as reentrant checkpointing
    and Hugging Face's ``enable_input_require_grads`` do) are the caller's business. One walk
    of the graph (about 1 us per node)."""
    owned = run.shard_ids()  # the leaves Gather takes, or the direct path's
    for g in run.all_groups():  # an ALIASED group's leaves
        owned.update(id(t) for t in g.fulls or ())
    seen, stack, foreign = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's
        if leaf is not None:
            if id(leaf) not in owned and isinstance(leaf, torch.nn.Parameter):
                foreign.append(leaf)
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    if foreign:
        t = foreign[0]
        name = run.installations().name_of(t)
        what = (f"parameter {name!r} (shape {tuple(t.shape)}, {t.dtype}) of a module given "
                f"to fs.call" if name else
                f"an nn.Parameter of shape {tuple(t.shape)}, {t.dtype}")
        raise ValueError(
            f"train_step: the loss reaches {what}, which requires grad but is not a parameter "
            f"the step was given{f' ({len(foreign)} such)' if len(foreign) > 1 else ''}"
            ": it would take its gradient in .grad and never train. Put it in the tree given "
            "to fs.shard (fs.params(model) lists every parameter; call the model whole "
            "through fs.call), or freeze it (requires_grad_(False)) or detach it. The "
            "parameters and optimizer state are unchanged.")


def check_differentiable(loss: torch.Tensor, params=None) -> None:
    """The loss requires grad; ``params`` (a ``ParamGroups``) tells a tree none of whose
    leaves requires grad (plain ``torch.randn`` tensors) from a detached loss."""
    if not loss.requires_grad:
        if params is not None and params.trainable and not any(params.trainable):
            names = [pytree.fqn(p) for p in params.spec.paths()]
            shown = ", ".join(map(repr, names[:2])) + (", ..." if len(names) > 2 else "")
            raise ValueError(
                f"train_step: no leaf of the parameter tree requires grad ({shown}: "
                f"{len(names)} leaves), so there is nothing to train. Tensors made with "
                "torch.randn or torch.zeros do not require grad; make the leaves trainable "
                "before fs.shard: params = {k: v.requires_grad_() for k, v in params.items()}, "
                "or take a module's parameters with fs.params(module), which do.")
        raise ValueError(
            "train_step: the loss does not require grad, so the step would change nothing: "
            "loss_fn returned a detached loss (loss.detach(), .item(), a new tensor) or one "
            "that no trainable parameter reaches. Return the loss as computed from params."
        )
