"""Loss scaling for float16 compute: ``Policy(loss_scale="dynamic")``, torch's GradScaler.

[Note: loss scaling] float16 holds nothing below 6e-8 (2^-24): a gradient smaller than that
rounds to zero, silently, and the step trains on zeros. The loss is multiplied by a scale
before backward, so the gradients float16 carries are that much larger; after the
reduction (float32 with ``reduce_dtype``) they are converted to the master weights' dtype
and divided by it again, before the metrics, the clipping and the optimizer see them, which
therefore see the true gradients. As ``torch.amp.GradScaler`` does, with its defaults:

- the scale starts at 2^16; the loss is scaled as GradScaler's ``scale(loss)`` scales it
  (times a float32 scalar tensor, so a float16 loss is promoted, not overflowed);
- a step whose gradients are not finite (an overflow) is skipped on every rank (they agree:
  the norm is all-reduced), the scale halves and ``metrics["skipped"]`` is 1; the skipped
  step is not in the optimizer's count (``TrainState.skipped``);
- after 2000 finite steps in a row the scale doubles.

Where GradScaler would halve forever, the step refuses by name: a non-finite gradient with
the scale at 1 or below is no overflow the scale can cure (a NaN from the model, an
infinite true gradient), and raises as without scaling (or is skipped, with
``skip_nonfinite=True``). A non-finite *loss* is never an overflow: the loss is measured
before it is scaled. ``loss_scale=<number>`` is a static scale: the same conversion, no
change of scale, and a non-finite gradient follows the non-finite rule. The scale and its
count are ``TrainState.loss_scale``, which checkpoints carry.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import _compat

INIT, GROWTH, BACKOFF, INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000  # torch.amp.GradScaler's defaults


class LossScale(NamedTuple):
    """The loss scale and the finite steps since it last changed (``TrainState.loss_scale``)."""

    scale: float
    good_steps: int = 0


def check(value) -> None:
    """``None``, ``"dynamic"`` or a finite number > 0."""
    if value is None or value == "dynamic":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value < math.inf):
        raise ValueError(f"Policy: loss_scale={value!r} must be None, 'dynamic' or a number "
                         "> 0 (a static scale)")


def check_state(policy, ls) -> None:
    """The state's loss scale fits the policy: one where it scales, a valid one, else None."""
    if policy.loss_scale is None:
        if ls is not None:
            raise ValueError(f"train_step: the TrainState has loss_scale={ls!r} but the Policy "
                             "has no loss_scale; make the state with this step's init, or "
                             "state._replace(loss_scale=None)")
        return
    if not isinstance(ls, LossScale) or isinstance(ls.good_steps, bool) or not (
            isinstance(ls.scale, (int, float)) and not isinstance(ls.scale, bool)
            and 0 < ls.scale < math.inf
            and isinstance(ls.good_steps, int) and ls.good_steps >= 0):
        raise ValueError(f"train_step: Policy(loss_scale={policy.loss_scale!r}) needs the "
                         f"TrainState's loss_scale to be an fs.LossScale(scale > 0, "
                         f"good_steps >= 0), got {ls!r}; make the state with this step's init")


def dynamic(policy) -> bool:
    return policy.loss_scale == "dynamic"


def initial(policy) -> LossScale | None:
    """A new state's loss scale under ``policy`` (None: no scaling)."""
    if policy.loss_scale is None:
        return None
    return LossScale(INIT if dynamic(policy) else float(policy.loss_scale), 0)


def scaled(loss: torch.Tensor, k: int, ls: LossScale | None) -> torch.Tensor:
    """What backward starts from: the micro-batch's share of the loss, times the scale as
    GradScaler multiplies it (a float32 scalar: a float16 loss is promoted; or the
    device's own, :func:`on_device`)."""
    if ls is None:
        return loss / k
    return loss / k * factor(ls, loss.device)


def factor(ls: LossScale, device: torch.device) -> torch.Tensor:
    """The scale as the float32 scalar the loss is multiplied by."""
    if isinstance(ls.scale, torch.Tensor):
        return ls.scale
    return torch.full((), ls.scale, dtype=torch.float32, device=device)


def unscale(grads: list, dtypes: list[torch.dtype], ls: LossScale) -> list:
    """The reduced gradients in their masters' ``dtypes``, divided by the scale (in place
    where already so; a power of two divides exactly); a scale on the device
    (:func:`on_device`) without reading it."""
    out = [g if g is None or g.dtype == dt else g.to(dt) for g, dt in zip(grads, dtypes)]
    if isinstance(ls.scale, torch.Tensor):
        multiply(out, ls.scale.reciprocal())
    elif ls.scale != 1.0:
        multiply(out, 1.0 / ls.scale)  # as GradScaler: times the reciprocal
    return out


def multiply(grads: list, factor: float | torch.Tensor) -> None:
    """Every gradient of ``grads`` (None: none) times ``factor`` (a number, or a scalar tensor
    on their device), in place: one foreach call per dtype."""
    present = [g for g in grads if g is not None]
    with torch.no_grad():
        for dt in {g.dtype for g in present}:
            f = factor.to(dt) if isinstance(factor, torch.Tensor) else factor
            _compat.foreach_mul_([g for g in present if g.dtype == dt], f)


def overflowed(policy, ls: LossScale | None, grads_finite: bool, loss_finite: bool) -> bool:
    """A non-finite gradient the dynamic scale cures: the step is skipped, not refused."""
    return (dynamic(policy) and ls is not None and not grads_finite and loss_finite
            and ls.scale > 1.0)


def after(policy, ls: LossScale | None, grads_finite: bool) -> LossScale | None:
    """The scale for the next step (GradScaler's ``update()``)."""
    if ls is None or not dynamic(policy):
        return ls
    return following(ls, grads_finite)


def following(ls: LossScale, grads_finite: bool) -> LossScale:
    """The dynamic scale after a step whose gradients were finite or not."""
    if not grads_finite:
        return LossScale(max(ls.scale * BACKOFF, 1.0), 0)
    if ls.good_steps + 1 >= INTERVAL:
        return LossScale(ls.scale * GROWTH, 0)
    return LossScale(ls.scale, ls.good_steps + 1)


# [Note: a loss scale on the device] The compiled step that reads nothing (step.deferred)
# keeps the dynamic scale on the device too: a float32 scale and its count of finite
# steps, which the program multiplies the loss by, the gradients are divided by (times the
# reciprocal, as GradScaler), and each step moves by :func:`following`'s rule where the
# gradients' finiteness is known, on the device, with no read. The host's state holds the
# scale as if every unread step's gradients were finite, corrected when a verdict reads
# otherwise; whenever no verdict is unread, the device's copy is set from the state's.


def on_device(ls: LossScale, mirror: tuple, fresh: bool) -> LossScale:
    """The scale a step uses: ``mirror``, the device's (scale, finite steps), set from
    ``ls`` first where ``fresh`` (no unread step could have moved it)."""
    scale, good = mirror
    if fresh:
        scale.fill_(ls.scale)
        good.fill_(ls.good_steps)
    return LossScale(scale, good)


def step_on_device(mirror: tuple, grads_finite: torch.Tensor) -> None:
    """Move the device's (scale, finite steps) as :func:`following` moves the state's."""
    scale, good = mirror
    grow = good + 1 >= INTERVAL
    scale.copy_(torch.where(grads_finite, torch.where(grow, scale * GROWTH, scale),
                            (scale * BACKOFF).clamp(min=1.0)))
    good.copy_(torch.where(grads_finite & ~grow, good + 1, torch.zeros_like(good)))
