"""After backward, for an optimizer the device cannot gate (a chain that is not ``adam``,
``adamw`` or ``sgd``, ``from_torch`` but for torch's Adam and AdamW; ``adam``,
``adamw``, ``sgd``, ``muon`` and those read nothing: :mod:`funshard.step.deferred`): the
step's metrics, its non-finite rule, and the optimizer.

The loss and the global gradient norm take one all-reduce and one read on the host (the
step's one wait for the device); a leaf no rank's loss reached gets no gradient ([Note: a
parameter no rank reached]); a non-finite loss or gradient refuses the step by name (or
skips it, with ``Policy(skip_nonfinite=True)``), the parameters and optimizer state
unchanged; then the optimizer (with the Policy's clipping in front) updates the local
shards in place.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .. import collectives, pytree
from ..mesh import mesh_str
from ..optim.measured import measured
from ..reduce import first_nonfinite, local_sq_norm
from . import agree, batches, scaling
from . import loss as loss_
from .params import ParamGroups


class Grads(NamedTuple):
    """What the micro-batches of one step produced."""

    grads: list  # per leaf: its reduced gradient shard, or None
    loss_sum: torch.Tensor
    aux: list
    peaks: tuple[int, int]
    order: tuple  # per micro-batch, the groups in the order forward and backward used them
    count: torch.Tensor | None  # fs.Mean's counts summed over micro-batches (None: none)
    used: set  # leaves given a gradient on this rank (an empty default would drop them all)


def owned(out: Grads) -> Grads:
    """``out`` with each gradient a tensor of its own: the update scales and gates them in
    place, and a tensor that two leaves' gradients shared (an op handing one gradient to
    two inputs) would be scaled twice. A repeated one is copied."""
    seen: set = set()
    grads = list(out.grads)
    for i, g in enumerate(grads):
        if g is not None:
            if id(g) in seen:
                grads[i] = g.clone()
            seen.add(id(g))
    return out._replace(grads=grads)


def check_trained(params: ParamGroups, grads: list) -> None:
    """Some trainable parameter must get a gradient, or the step would be a silent no-op."""
    if any(params.trainable) and all(g is None for g in grads):
        raise untrained_error(params)


def untrained_error(params: ParamGroups) -> ValueError:
    return ValueError(
        "train_step: no trainable parameter received a gradient: the loss does not depend "
        f"on any of the {sum(params.trainable)} trainable parameters (only on frozen ones, "
        "or on none). Compute the loss from the params loss_fn is given.")


def empty_batch(batch: Any) -> str:
    """'' or a note naming this rank's first empty batch leaf."""
    if isinstance(batch, batches.MicroBatches):
        batch = list(batch.parts)
    paths, leaves, _ = pytree.flatten_with_path(batch)
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == 0:
            return (f"; this rank's batch[{pytree.fqn(p)!r}] is empty (shape "
                    f"{tuple(x.shape)}): the mean of no samples is NaN")
    return ""


HEAD = 8  # the sums every step all-reduces: loss, squared norm, count, means, rows, rows^2,
# the gather order's two sums (then the eager step's idle leaves, the compiled step's per leaf)


def sums_head(params: ParamGroups, out: Grads, k: int, rows: int,
              sq: torch.Tensor) -> torch.Tensor:
    """This rank's first :data:`HEAD` sums, float64: the loss (an ``fs.Mean``'s total, else
    the mean over the ``k`` micro-batches), ``sq`` (the gradients' weighted squared norm),
    ``fs.Mean``'s count and kind or a plain loss's local batch ``rows`` (to see that every
    rank averaged over as many: :func:`~funshard.step.loss.check_rows`), and the gather
    order's sums. The step's constant tensors (the order's sums) are made once."""
    order = params.on_device(("order", out.order), torch.float64,
                             lambda: agree.order_sums(out.order))
    if out.count is not None:  # fs.Mean: its count, 1 (each rank says its kind)
        c = out.count.double()
        zero = torch.zeros_like(c)
        kind, loss = torch.stack([c, torch.ones_like(c), zero, zero]), out.loss_sum.double()
    else:  # no copy from the host per step (rows may change from step to step)
        at_rows, at_sq = params.on_device("rows", torch.float64,
                                          lambda: [[0, 0, 1, 0], [0, 0, 0, 1]])
        kind = at_rows * float(rows) + at_sq * float(rows * rows)
        loss = (out.loss_sum / k).double()
    return torch.cat([torch.stack([loss, sq.double()]), kind, order])


def read_head(params: ParamGroups, order: tuple, vals: list) -> tuple:
    """The host's reading of :func:`sums_head` summed over ranks: the ranks' gather orders,
    kinds of loss and rows checked, then (loss, squared norm, count, fs.Mean's gradient
    factor or None) as the metrics report them (the mean over ranks of their means, or
    fs.Mean's total over its count)."""
    loss, sq, count, means, n, n2, h, h2 = vals[:HEAD]
    agree.check_order([h, h2], params, order)
    factor = loss_.check_kind(means, count, params.world) if means else None
    if not means:
        loss_.check_rows(n, n2, params.world)
    if factor is None:
        loss /= params.world
    else:  # the gradients are world / count times the reduced ones
        loss = loss / count if count > 0 else math.nan
        sq *= factor * factor
    return loss, sq, count, factor


def norm_of(sq: float) -> float:
    return math.sqrt(sq) if sq > 0 else 0.0 if sq <= 0 else math.nan


def metrics_of(params: ParamGroups, out: Grads, k: int, rows: int = 0) -> tuple[dict, list]:
    """Loss and global gradient norm: one all-reduce of the step's sums
    (:func:`sums_head`) and this rank's count of idle leaves, one read on the host."""
    present = [i for i, g in enumerate(out.grads) if g is not None]
    weights = params.on_device(("norm weights", tuple(present)), torch.float64,
                               lambda: [params.norm_weight[i] for i in present])
    sq = local_sq_norm([out.grads[i] for i in present], weights, params.device)
    # the leaves this rank gave no gradient, counted (a scalar multiply: no host copy)
    idle = params.on_device("unit", torch.float64, lambda: [1.0]) * float(
        sum(i not in out.used for i in present))
    both = torch.cat([sums_head(params, out, k, rows, sq), idle])
    if not collectives.skips(params.world):
        with collectives.watch("all-reduce of the step's metrics", params.mesh):
            dist.all_reduce(both)
    vals = both.tolist()  # the one device wait
    loss, sq_norm, count, factor = read_head(params, out.order, vals)
    if vals[HEAD]:
        present = _drop_unreached(params, out.grads, present, out.used)
    metrics = {
        "loss": loss,
        "grad_norm": norm_of(sq_norm),
        "unsharded_groups_peak": out.peaks[0],
        "unsharded_bytes_peak": out.peaks[1],
        "skipped": 0,
    }
    if any(a is not None for a in out.aux):
        metrics["aux"] = out.aux[0] if k == 1 else out.aux
    if factor is not None:
        metrics["count"] = count
        if math.isfinite(factor):
            loss_.normalize(out.grads, factor)
    return metrics, present


# [Note: a parameter no rank reached] A trainable leaf that the loss reached on no rank and
# in no micro-batch (a branch not taken this step, a layer dropped, an expert no token chose)
# has no gradient, as in one process: torch leaves its ``.grad`` None and torch.optim skips
# it (no weight decay, no moment decay), and so does FSDP2. Its group's reduction still
# carries zeros for it (every rank takes part), so the step drops those zeros here: the leaf
# gets None, whichever group holds it, and the optimizer leaves it and its state alone
# (Adam's bias corrections then count the leaf's own updates, fs.optim's as torch.optim's:
# :class:`funshard.optim.AdamState`'s ``count``). A leaf some rank reached keeps the mean over
# ranks, zeros from the others, as one process on the whole batch computes it. Each rank's
# count of such leaves rides on the metrics all-reduce; only when some rank has one do the
# ranks add a second all-reduce, of a flag per leaf with a gradient.


def _drop_unreached(params: ParamGroups, grads: list, present: list[int],
                    used: set) -> list[int]:
    """Set to None the gradients of ``present`` leaves no rank reached; return the rest."""
    flags = [1.0 if i in used else 0.0 for i in present]
    if not collectives.skips(params.world):
        reached = torch.tensor(flags, dtype=torch.float64, device=params.device)
        with collectives.watch("all-reduce of the leaves the ranks reached", params.mesh):
            dist.all_reduce(reached)
        flags = reached.tolist()
    for i, f in zip(present, flags):
        if not f:
            grads[i] = None
    check_trained(params, grads)
    return [i for i, f in zip(present, flags) if f]


def update(optimizer, policy, params: ParamGroups, state, out: Grads, batch: Any,
           program=None) -> tuple[Any, dict]:
    """Metrics, the non-finite rule, and the optimizer (with the Policy's apply_if_finite and
    clip_by_global_norm in front) on the local shards; ``program``: the compiled step's
    :class:`~funshard.step.update_program.UpdateProgram`, for the optimizers it covers."""
    check_trained(params, out.grads)
    out = owned(out)
    ls = state.loss_scale  # the gradients' scale: divided out first ([Note: loss scaling])
    if ls is not None:
        out = out._replace(grads=scaling.unscale(out.grads,
                                                 [lay.dtype for lay in params.layouts], ls))
    metrics, present = metrics_of(params, out, policy.accumulate, batches.rows(batch))
    grads, norm = out.grads, metrics["grad_norm"]
    grads_finite, loss_finite = math.isfinite(norm), math.isfinite(metrics["loss"])
    finite = grads_finite and loss_finite
    if ls is not None:
        metrics["loss_scale"] = ls.scale
    overflow = scaling.overflowed(policy, ls, grads_finite, loss_finite)
    if not finite and not policy.skip_nonfinite and not overflow:
        if "count" in metrics and not metrics["count"] > 0:
            raise count_error(metrics["count"], state.step)
        if not grads_finite:
            _raise_nonfinite(params, grads, present, state.step, empty_batch(batch))
        raise loss_error(metrics["loss"], state.step, empty_batch(batch))
    grad_tree = pytree.unflatten(params.spec, grads)  # None for frozen/unused leaves
    # the transforms take the norm and the finite check the metrics' all-reduce measured
    # ([Note: the step's norm] in funshard.optim.clip); every rank sees the same values
    with measured(grad_tree, norm, finite) as seen:
        # the optimizer counts the updates it applied (see TrainState)
        if program is not None and finite and program.covers(optimizer):
            new_params, opt_state = program(optimizer, grad_tree, state.opt_state, state.params,
                                            step=state.step - state.skipped, norm=norm,
                                            device=params.device)
        else:
            new_params, opt_state = optimizer.update(grad_tree, state.opt_state, state.params,
                                                     step=state.step - state.skipped)
    metrics["skipped"] = int(seen.dropped)
    return state._replace(params=new_params, opt_state=opt_state, step=state.step + 1,
                          skipped=state.skipped + int(seen.dropped), buffers=None,
                          loss_scale=scaling.after(policy, ls, grads_finite)), metrics


def _raise_nonfinite(params: ParamGroups, grads: list, present: list[int], step: int,
                     note: str) -> None:
    """Name the first parameter (in tree order, over all ranks) whose gradient is not finite."""
    hits = [present[j] for j in first_nonfinite([grads[i] for i in present], params.mesh)]
    raise nonfinite_error(params, hits, step, note)


def nonfinite_error(params: ParamGroups, hits: list[int], step: int,
                    note: str) -> FloatingPointError:
    """The refusal of a step whose gradients of leaves ``hits`` are not finite (none: the
    norm, from the loss)."""
    lay = params.layouts[hits[0]] if hits else None
    where = (f"the gradient of {lay.path!r} (shape {tuple(lay.shape)}, on "
             f"{mesh_str(params.mesh)})" if lay else "the loss")
    return FloatingPointError(
        f"train_step: {where} is not finite (NaN or inf) at step {step}"
        f"{f'; {len(hits)} parameters in all' if len(hits) > 1 else ''}{note}. The parameters and "
        "optimizer state are unchanged. Lower the learning rate or check the data, or pass "
        "fs.Policy(skip_nonfinite=True) to skip such steps."
    )


def count_error(count: float, step: int) -> FloatingPointError:
    """The refusal of a step whose ``fs.Mean`` counted no item."""
    return FloatingPointError(
        f"train_step: fs.Mean's count, summed over every rank and micro-batch, is "
        f"{count} at step {step}: there is no item to average over "
        "(every label masked?). The parameters and optimizer state are unchanged; "
        "pass fs.Policy(skip_nonfinite=True) to skip such steps.")


def loss_error(loss: float, step: int, note: str) -> FloatingPointError:
    """The refusal of a step whose loss (mean over ranks) is not finite."""
    return FloatingPointError(
        f"train_step: the loss is {loss} (mean over ranks) at step "
        f"{step}{note}. The parameters and optimizer state are "
        "unchanged. An empty local batch on any rank gives a NaN loss; otherwise check "
        "the data, or pass fs.Policy(skip_nonfinite=True) to skip such steps.")


def reader(params: ParamGroups, order: tuple, mean: bool, present: list, host: dict,
           step: int, note: str, skip: bool, scale, maybe: list) -> Callable[[list], tuple]:
    """How the host reads the sums of a step that read nothing (:mod:`funshard.step.deferred`):
    a reading step's checks, then the metrics, whether a dynamic scale moved otherwise
    than the host took it to (``skip``: a non-finite step reads as skipped; under a dynamic
    scale an overflow too; ``scale``: the loss scale, a number, ``"dynamic"`` (the one the
    step used, last in the sums) or None), and which of the ``maybe`` leaves (positions in
    ``present``) no rank reached, in the optimizer's order. (It holds no tensor of the step:
    the gradients are freed as a reading step frees them.)"""
    dynamic = scale == "dynamic"
    at = HEAD + len(present)  # the flags: whether some rank reached each leaf

    def read(vals: list) -> tuple:
        metrics, rescale = _read(vals)
        gone = [params.optim_pos[present[j]] for j in maybe if not vals[at + j]]
        return metrics, rescale, tuple(gone)

    def _read(vals: list) -> tuple:
        loss, sq, count, _ = read_head(params, order, vals)
        if maybe and not any(vals[at:at + len(present)]):
            raise untrained_error(params)
        per = vals[HEAD:HEAD + len(present)]
        norm = norm_of(sq)
        metrics = {**host, "loss": loss, "grad_norm": norm}
        if mean:
            metrics["count"] = count
        if scale is not None:  # (a power of two, summed over ranks: exact)
            metrics["loss_scale"] = vals[-1] / params.world if dynamic else scale
        grads_ok, loss_ok = math.isfinite(norm), math.isfinite(loss)
        if grads_ok and loss_ok:
            return metrics, False
        if skip or (dynamic and not grads_ok and loss_ok and metrics["loss_scale"] > 1.0):
            return {**metrics, "skipped": 1}, dynamic and not grads_ok
        if mean and not count > 0:
            raise count_error(count, step)
        if not math.isfinite(norm):
            raise nonfinite_error(params, [present[j] for j, v in enumerate(per)
                                           if not math.isfinite(v)], step, note)
        raise loss_error(loss, step, note)

    return read
