"""The compiled step's update without a read on the host: its checks and metrics stay on the
device until the caller reads them.

[Note: a step that reads nothing] The eager step reads its metrics on the host before the
update (the loss and the global norm: the non-finite rule, the clip factor, the checks that
the ranks agree); on a GPU the host then waits for backward to finish, and the device idles
while the update is issued. Here, for the compiled step with an update the compiler holds
(:mod:`funshard.step.update_program`), the Policy's default rule (a non-finite step is
refused) and no loss scale, the same all-reduce carries the same sums, and the
device works out what the host did: ``ok`` (the loss and norm finite, the ranks' gather
orders and kinds of loss alike, and no earlier step refused and unread) and the clip
factor. The update program applies the update where ``ok`` holds and keeps every tensor
where it does not. The sums come to the host (from pinned memory on a GPU, without a wait)
and are read at the first of: the caller reading ``metrics`` (any key), ``fs.state_dict``
or a checkpoint of the returned state, and the start of the step after next (the step
after next, so that the host waits there for a backward the device finished long before:
the host stays a step ahead). A check that failed raises there, with the message the eager
step gives, on every rank at the same step; the state passed into the refused step is then
usable again (its tensors kept their values on the device, the steps issued since skipped
their updates too) and the states returned since refuse to be read. A rank whose loss
reached some trainable leaf on no rank of its own reads the per-leaf flags at once (which
leaves no rank reached), as the eager step does. The buffers (``state.buffers``) take the
step's working copies where ``ok`` holds, on the device too. A float16 loss scale and
``skip_nonfinite`` keep the eager step's read: which steps the optimizer counts (its bias
corrections, on the host) would depend on the verdict.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import collectives, pytree
from . import batches
from .metrics import Metrics
from .params import ParamGroups
from .update import (HEAD, Grads, check_trained, count_error, empty_batch, loss_error,
                     nonfinite_error, norm_of, read_head, sums_head)


def usable(compiled, optimizer, policy, state) -> bool:
    """Whether this step goes without the host read: the same on every rank."""
    return (compiled is not None and compiled.updates.covers(optimizer)
            and not policy.skip_nonfinite and state.loss_scale is None)


class Verdict:
    """One step's all-reduced sums, on their way to the host, and how to read them; the
    verdict of the step before it, while unread (``prior``). :meth:`settle` reads them
    once and returns the metrics, or raises the step's refusal (or an earlier step's: this
    one's update was then skipped too), every time it is called."""

    def __init__(self, read: Callable[[list], dict], vec: torch.Tensor,
                 prior: "Verdict | None"):
        self.read, self.prior, self.event = read, prior, None
        if vec.device.type == "cuda":  # no wait: pinned memory, an event to wait on later
            self.host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            self.host.copy_(vec, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = vec
        self.values: dict | None = None
        self.error: BaseException | None = None
        self.on_refused: Callable[[], None] | None = None

    def unread(self) -> list["Verdict"]:
        """This verdict and the unread ones before it, oldest first."""
        out, v = [], self
        while v is not None and v.values is None and v.error is None:
            out.append(v)
            v = v.prior
        return out[::-1]

    def settle(self) -> dict:
        if self.error is None and self.values is None:
            try:
                if self.prior is not None:
                    self.prior.settle()
                    self.prior = None
                self._settle()
            except (ValueError, FloatingPointError) as e:
                self.error = self.error or e
            self.host = self.read = None
            if self.error is None:
                self.on_refused = None
        if self.error is not None:
            raise self.error
        return self.values

    def _settle(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        try:
            self.values = self.read(self.host.tolist())  # the step's one read, when asked
        except (ValueError, FloatingPointError) as e:
            self.error = type(e)(
                f"{e} (Read after the step returned: its update was skipped on the device, "
                "as were those of the steps issued after it; the state passed into it is "
                "usable again, and the states returned since are refused.)")
            if self.on_refused is not None:
                self.on_refused()


def take(state) -> "Verdict | None":
    """At a step's start: the unread verdicts of the steps before it, taken off ``state``
    (so that reading its fields does not read them), all but the last read (waiting: it
    is the step before last's, whose backward the device finished). A refusal raises."""
    pending = getattr(state, "_pending", None)
    if pending is None:
        return None
    unread = pending.unread()
    for v in unread[:-1] if unread else [pending]:  # (read already: a refusal raises again)
        v.settle()
    state._pending = None
    return pending if unread else None


def give_back(state, pending: Verdict | None) -> None:
    """A step that raised before it returned: ``state`` holds its verdicts again."""
    if pending is not None and state._donated_to is None:
        state._pending = pending


def attach(metrics: dict, old, new, donations, leaves: list, program) -> None:
    """``new`` (the state the step returned) reads ``metrics``' verdict before any field;
    a refusal makes ``old`` (the state passed in) usable again and lets the device update
    again (``program``'s health)."""
    if not isinstance(metrics, Metrics) or metrics.verdict is None:
        return
    verdict = metrics.verdict

    def refused() -> None:
        old._donated_to = None
        donations.remember(old, leaves)
        program.health(None).fill_(True)

    verdict.on_refused = refused
    new._pending = verdict


def _sums(params: ParamGroups, out: Grads, present: list, k: int, rows: int) -> torch.Tensor:
    """This rank's part of the step's sums: what the eager step's metrics all-reduce
    carries, and per leaf its weighted squared norm and whether this rank reached it."""
    weights = params.on_device(("norm weights", tuple(present)), torch.float64,
                               lambda: [params.norm_weight[i] for i in present])
    grads = [out.grads[i] for i in present]
    norms = torch._foreach_norm([g if g.dtype is torch.float32 else g.float() for g in grads])
    per = torch.stack(norms).double() ** 2 * weights
    reached = params.on_device(("reached", tuple(i in out.used for i in present)),
                               torch.float64, lambda: [float(i in out.used) for i in present])
    return torch.cat([sums_head(params, out, k, rows, per.sum()), per, reached])


def _on_device(params: ParamGroups, vec: torch.Tensor, mean: bool, clip,
               health: torch.Tensor) -> tuple:
    """From the all-reduced sums: the gradients' factor (fs.Mean; else None) and ``(clip
    factor, ok)`` as float32, as the host would work them out; ``health`` (no step refused
    and unread before this one) goes into ``ok`` and takes it."""
    world = params.world
    loss, sq, count, means = vec[0], vec[1], vec[2], vec[3]
    h, h2 = vec[6], vec[7]
    ok = (h * h == world * h2) & (means == (world if mean else 0))
    factor = None
    if mean:
        factor = world / count
        loss, sq = loss / count, sq * (factor * factor)
        ok = ok & (count > 0)
    else:
        loss = loss / world
    ok = ok & loss.isfinite() & sq.isfinite() & health
    health.copy_(ok)
    gain = (torch.ones_like(sq) if clip is None
            else (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0))
    return factor, torch.stack([gain, ok.double()]).float()


def _reader(params: ParamGroups, order: tuple, mean: bool, present: list, host: dict,
            step: int, note: str) -> Callable[[list], dict]:
    """How the host reads the sums: the eager step's checks, then the metrics. (It holds
    no tensor of the step: the gradients are freed as the eager step frees them.)"""

    def read(vals: list) -> dict:
        loss, sq, count, _ = read_head(params, order, vals)
        per = vals[HEAD:HEAD + len(present)]
        norm = norm_of(sq)
        metrics = {**host, "loss": loss, "grad_norm": norm}
        if mean:
            metrics["count"] = count
        if math.isfinite(norm) and math.isfinite(loss):
            return metrics
        if mean and not count > 0:
            raise count_error(count, step)
        if not math.isfinite(norm):
            raise nonfinite_error(params, [present[j] for j, v in enumerate(per)
                                           if not math.isfinite(v)], step, note)
        raise loss_error(loss, step, note)

    return read


def update(optimizer, policy, params: ParamGroups, state, out: Grads, batch: Any,
           program, prior: Verdict | None) -> tuple[Any, Metrics]:
    """The metrics' sums all-reduced, ``(clip factor, ok)`` worked out from them on the
    device, and ``program``'s update applied where ``ok`` holds: no host read (but the
    unreached-leaf rule's, on a rank that reached some leaf no rank may have)."""
    check_trained(params, out.grads)
    present = [i for i, g in enumerate(out.grads) if g is not None]
    vec = _sums(params, out, present, policy.accumulate, batches.rows(batch))
    if not collectives.skips(params.world):
        with collectives.watch("all-reduce of the step's metrics", params.mesh):
            dist.all_reduce(vec)
    grads = list(out.grads)
    if any(i not in out.used for i in present):  # did any rank reach it? (a read)
        flags = vec[HEAD + len(present):].tolist()
        for i, f in zip(present, flags):
            if not f:
                grads[i] = None
        check_trained(params, grads)
    clip = optimizer.traced.clip
    factor, dev = _on_device(params, vec, out.count is not None, clip,
                             program.health(params.device))
    if factor is not None:  # fs.Mean: the gradient of the mean over every item
        kept = [g for g in grads if g is not None]
        for dt in {g.dtype for g in kept}:
            torch._foreach_mul_([g for g in kept if g.dtype == dt], factor.to(dt))
    host = {"loss": None, "grad_norm": None, "unsharded_groups_peak": out.peaks[0],
            "unsharded_bytes_peak": out.peaks[1], "skipped": 0}  # (the first two: when read)
    if out.count is not None:
        host["count"] = None
    if any(a is not None for a in out.aux):
        host["aux"] = out.aux[0] if policy.accumulate == 1 else out.aux
    verdict = Verdict(_reader(params, out.order, out.count is not None, present, host,
                              state.step, empty_batch(batch)), vec, prior)
    new_params, opt_state = program(optimizer, pytree.unflatten(params.spec, grads),
                                    state.opt_state, state.params,
                                    step=state.step - state.skipped, norm=None,
                                    device=params.device, dev=dev)
    return state._replace(params=new_params, opt_state=opt_state, step=state.step + 1,
                          buffers=None), Metrics(host, verdict, dev[1] > 0)
