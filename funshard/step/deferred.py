"""The step's update without a read on the host: its checks and metrics stay on the device
until the caller reads them.

[Note: a step that reads nothing] A step that read its metrics on the host before the update
(the loss and the global norm: the non-finite rule, the clip factor, the checks that the
ranks agree) would make the host wait, on a GPU, for backward to finish, and the device idle
while the update is issued (:mod:`funshard.step.update` does so still, for the optimizers
the device cannot gate). Here, for an update an
:class:`~funshard.step.update_program.UpdateProgram` holds (``adam``, ``adamw``, ``sgd``:
the compiled step's program, or the eager step's foreach ops gated on the device, [Note: an
update gated on the device] in :mod:`funshard.optim.gated`; ``muon``; and torch's Adam and
AdamW through ``from_torch``: fused, its kernel skips where its ``found_inf`` says; else its
step as ``adamw``'s gated ops), the same
all-reduce carries the same sums, and the device works out what the host did: ``ok`` (the
loss and norm finite, the ranks' gather orders and kinds of loss alike, and no earlier step
refused and unread) and the clip factor. The update program applies the update where ``ok``
holds and keeps every tensor where it does not. The sums come to the host (from pinned
memory on a GPU, without a wait) and are read at the first of: the caller reading
``metrics`` (any key), ``fs.state_dict`` or a checkpoint of the returned state, and the
start of the step after next (the step after next, so that the host waits there for a
backward the device finished long before: the host stays a step ahead). A check that failed
raises there, with the message a step that reads gives, on every rank at the same step; the
state passed into the refused step is then usable again (its tensors kept their values on
the device, the steps issued since skipped their updates too) and the states returned since
refuse to be read. A leaf this rank's loss did not reach, which another rank's may have, is
updated under the flag that says whether some rank did ([Note: a leaf in doubt] in
:mod:`funshard.step.update_program`). The buffers (``state.buffers``) take the step's
working copies where ``ok`` holds, on the device too. A dynamic loss scale lives on the
device as well ([Note: a loss scale on the device] in :mod:`funshard.step.scaling`).

[Note: two counts in doubt] Under ``Policy(skip_nonfinite=True)`` (or a dynamic loss scale,
for an overflow) a non-finite step is skipped, not refused, and the optimizer does not
count it (``step - skipped``, each leaf's count: Adam's bias corrections, SGD's first step,
the schedule's step). The host, a step ahead of the device, builds each step's state as if
the step before it applied, while that step's verdict is unread; the update then carries
its scalars both ways (the second as if the step before was skipped: each leaf it counted
one update fewer, the schedule a step back) and the device takes the case its last verdict
says (``applied``), so the update is the one a step that reads would make, either way,
with no read. The eager step's update takes its scalars from the host, so it reads the
verdict of the step before at its start instead (the host stays a step ahead). When a
verdict reads as skipped, the states built on it are corrected where they are read (their
fields, what ``fs.state_dict`` and a checkpoint read): ``skipped`` one more, the counts of
the leaves that step counted one fewer, and after an overflow the loss scale as the rule
moves it. SGD's first update of a leaf is fixed in the program's trace, so the step after a
leaf's first update reads the verdict before it (a leaf's first two steps only). The
device's own state (``applied``, the scale, the health) moves only once a step's update
ran, so a step that raises leaves it as the verdict still unread left it; and a state
handed to another step (another ``train_step``, compiled or not) with a verdict unread has
it read first, since that step's device state never saw it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import _compat
from .. import collectives, pytree
from ..reduce import norms
from ..optim import traced as traced_
from . import batches, donation, scaling
from .metrics import Metrics
from .params import ParamGroups
from .update import HEAD, Grads, check_trained, empty_batch, owned, reader, sums_head


def usable(program, optimizer) -> bool:
    """Whether this step goes without the host read: the same on every rank."""
    return program is not None and program.covers(optimizer)


def loss_scale(policy, state, program, pending: "Verdict | None", device):
    """The loss scale this step uses: the state's, or a dynamic one's device copy
    ([Note: a loss scale on the device] in :mod:`funshard.step.scaling`)."""
    if not scaling.dynamic(policy):
        return state.loss_scale
    return scaling.on_device(state.loss_scale, program.loss_scale(device),
                             pending is None or not pending.open())


class Verdict:
    """One step's all-reduced sums, on their way to the host, and how to read them; the
    verdict of the step before it, while unread (``prior``). :meth:`settle` reads them
    once and returns the metrics, or raises the step's refusal (or an earlier step's: this
    one's update was then skipped too), every time it is called."""

    def __init__(self, read: Callable[[list], tuple], vec: torch.Tensor,
                 prior: "Verdict | None", delta: tuple = (), given=None, program=None,
                 maybe: tuple = ()):
        self.read, self.prior, self.event = read, prior, None
        self.program = program  # the update program whose device state it moved
        self.delta = delta  # the leaves whose counts this step advanced
        self.maybe = maybe  # of the leaves it counted, those no rank may have reached
        self.given = given  # the state the step was given
        self.built: list = []  # the states built as if it applied (until read)
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

    def open(self) -> bool:
        """Whether it is still unread."""
        return self.values is None and self.error is None

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
            self.values, rescale, gone = self.read(self.host.tolist())  # the one read
            if self.values.get("skipped"):  # the states built as if it applied: corrected
                before, finite = self.given, False  # (its gradients' overflow: the scale)
                for state in self.built:
                    _uncount(state, self.delta, (before, finite) if rescale else None)
                    before, finite = state, True
            elif gone:  # leaves no rank reached, counted as updated ([Note: a leaf in doubt])
                for state in self.built:
                    _uncount(state, gone, None, skipped=False)
            self.built = self.given = None
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


def _field(state, name: str):
    """``state``'s field ``name`` as corrected, read without settling or refusing."""
    return donation.values(state)[type(state)._fields.index(name)]


def _uncount(state, delta: tuple, rescale: tuple | None, skipped: bool = True) -> None:
    """``state``, built as if a step applied that was skipped: ``skipped`` one more, the
    counts of ``delta`` one fewer ([Note: two counts in doubt]); where the step's gradients
    overflowed, ``rescale``: (the state ``state`` was built from, corrected, whether the
    step between had finite gradients), the loss scale moved on from that state's. Not
    ``skipped``: a step that applied, but not to the leaves ``delta`` no rank reached."""
    vals = list(donation.values(state))
    at = type(state)._fields.index
    vals[at("skipped")] += int(skipped)
    opt = vals[at("opt_state")]
    vals[at("opt_state")] = traced_.recount(opt, delta)
    if rescale is not None:
        before, finite = rescale
        vals[at("loss_scale")] = scaling.following(_field(before, "loss_scale"), finite)
    state._fixed = tuple(vals)


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
    for v in (verdict, verdict.prior):  # those this state's counts take as applied
        if v is not None and v.open():
            v.built.append(new)


def _sums(params: ParamGroups, out: Grads, present: list, k: int, rows: int) -> torch.Tensor:
    """This rank's part of the step's sums: what a reading step's metrics all-reduce
    carries, and per leaf its weighted squared norm and whether this rank reached it."""
    weights = params.on_device(("norm weights", tuple(present)), torch.float64,
                               lambda: [params.norm_weight[i] for i in present])
    grads = [out.grads[i] for i in present]
    per = torch.stack(norms(grads)).double() ** 2 * weights
    reached = params.on_device(("reached", tuple(i in out.used for i in present)),
                               torch.float64, lambda: [float(i in out.used) for i in present])
    return torch.cat([sums_head(params, out, k, rows, per.sum()), per, reached])


def _on_device(params: ParamGroups, vec: torch.Tensor, mean: bool, clip, program,
               skip: bool, mirror: tuple | None, reached=None) -> tuple:
    """From the all-reduced sums: the gradients' factor (fs.Mean; else None) and ``(clip
    factor, ok, the step before applied)`` as float32, as the host would work them out.
    ``program``'s health (no step refused and unread before this one) goes into ``ok``.
    And what moves the device's state, once the update ran (a step that raises before
    leaves it): the health takes ``ok``, or the checks but the finite ones where a
    non-finite step is skipped, not refused (``skip``, or an overflow a dynamic scale,
    ``mirror``, cures; the scale moves too); ``applied`` takes ``ok``. ``reached``: whether
    some rank reached some leaf, where this rank reached none for sure (else None)."""
    world = params.world
    health, applied = program.health(params.device), program.applied(params.device)
    loss, sq, count, means = vec[0], vec[1], vec[2], vec[3]
    h, h2 = vec[6], vec[7]
    agree = (h * h == world * h2) & (means == (world if mean else 0)) & health
    if reached is not None:  # (a step that trains nothing is refused, as a reading one)
        agree = agree & reached
    factor, loss_ok = None, None
    if mean:
        factor = world / count
        loss, sq = loss / count, sq * (factor * factor)
        loss_ok = count > 0
    else:
        loss = loss / world
    grads_ok = sq.isfinite()
    loss_ok = loss.isfinite() if loss_ok is None else loss.isfinite() & loss_ok
    ok = agree & grads_ok & loss_ok
    if skip:
        keep = agree
    elif mirror is not None:  # an overflow the scale cures (above 1) is skipped
        keep = agree & (grads_ok | ~grads_ok & (mirror[0] > 1.0)) & loss_ok
    else:
        keep = ok
    gain = (torch.ones_like(sq) if clip is None
            else (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0))
    dev = torch.stack([gain, ok.double(), applied.double()]).float()

    def commit() -> None:
        health.copy_(keep)
        applied.copy_(ok)
        if mirror is not None:
            scaling.step_on_device(mirror, grads_ok)

    return factor, dev, commit


def update(optimizer, policy, params: ParamGroups, state, out: Grads, batch: Any,
           program, prior: Verdict | None) -> tuple[Any, Metrics]:
    """The metrics' sums all-reduced, ``(clip factor, ok)`` worked out from them on the
    device, and ``program``'s update applied where ``ok`` holds (and, for a leaf this rank
    left unreached, where some rank reached it: [Note: a leaf in doubt] in
    :mod:`funshard.step.update_program`): no host read."""
    check_trained(params, out.grads)
    out = owned(out)
    ls, dynamic = state.loss_scale, scaling.dynamic(policy)
    mirror = program.loss_scale(params.device) if dynamic else None
    if ls is not None:  # the gradients' scale: divided out first ([Note: loss scaling])
        dtypes = [lay.dtype for lay in params.layouts]
        out = out._replace(grads=scaling.unscale(
            out.grads, dtypes, scaling.LossScale(*mirror) if dynamic else ls))
    present = [i for i, g in enumerate(out.grads) if g is not None]
    vec = _sums(params, out, present, policy.accumulate, batches.rows(batch))
    if dynamic:  # the scale the step used, for the metrics
        vec = torch.cat([vec, mirror[0].double().reshape(1)])
    if not collectives.skips(params.world):
        with collectives.watch("all-reduce of the step's metrics", params.mesh):
            dist.all_reduce(vec)
    grads, counted = list(out.grads), present  # (counted: the leaves the update counts)
    maybe = [j for j, i in enumerate(present) if i not in out.used]  # reached elsewhere?
    reach, reached = None, None
    if maybe:  # gated per leaf ([Note: a leaf in doubt] in funshard.step.update_program)
        flags = vec[HEAD + len(present):HEAD + 2 * len(present)] > 0
        reach = {params.optim_pos[present[j]]: flags[j] for j in maybe}
        reached = flags.sum() > 0 if len(maybe) == len(present) else None
    skip = policy.skip_nonfinite
    doubt = (_doubt(optimizer.traced, state, prior, program.eager)
             if skip or dynamic or (prior is not None and prior.maybe) else None)
    factor, dev, commit = _on_device(params, vec, out.count is not None,
                                     optimizer.traced.clip, program, skip, mirror, reached)
    if factor is not None:  # fs.Mean: the gradient of the mean over every item
        kept = [g for g in grads if g is not None]
        for dt in {g.dtype for g in kept}:
            _compat.foreach_mul_([g for g in kept if g.dtype == dt], factor.to(dt))
    host = {"loss": None, "grad_norm": None, "unsharded_groups_peak": out.peaks[0],
            "unsharded_bytes_peak": out.peaks[1], "skipped": 0}  # (the first two: when read)
    if out.count is not None:
        host["count"] = None
    if ls is not None:
        host["loss_scale"] = None
    if any(a is not None for a in out.aux):
        host["aux"] = out.aux[0] if policy.accumulate == 1 else out.aux
    verdict = Verdict(reader(params, out.order, out.count is not None, present, host,
                             state.step, empty_batch(batch), skip,
                             None if ls is None else "dynamic" if dynamic else ls.scale, maybe),
                      vec, prior, _in_optim_order(params, counted) if skip or dynamic else (),
                      state, program, tuple(reach or ()))
    new_params, opt_state = program(optimizer, pytree.unflatten(params.spec, grads),
                                    state.opt_state, state.params,
                                    step=state.step - state.skipped, norm=None,
                                    device=params.device, dev=dev, doubt=doubt, reach=reach)
    commit()
    return state._replace(params=new_params, opt_state=opt_state, step=state.step + 1,
                          buffers=None, loss_scale=scaling.after(policy, ls, True)
                          ), Metrics(host, verdict, dev[1] > 0)  # (as if finite: corrected)


def _in_optim_order(params: ParamGroups, leaves: list) -> tuple:
    """The positions of ``leaves`` (the step's order) in the optimizer's, where the counts
    are that a verdict corrects."""
    return tuple(params.optim_pos[i] for i in leaves)


def _doubt(t, state, prior: Verdict | None, eager: bool) -> tuple | None:
    """The leaves the step before counted, while its verdict (skipped or not) is unread;
    where one program cannot serve both cases (the eager step's never does: its scalars are
    the host's), the verdict read now instead ([Note: two counts in doubt]; a skip read
    corrects ``state``)."""
    if prior is None or not prior.open():
        return None
    if not eager and not prior.maybe and traced_.decided(t, state.opt_state, prior.delta,
                                                         state.step - state.skipped):
        return prior.delta
    prior.settle()
    return None
