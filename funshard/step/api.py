"""The training-step combinator: ``train_step(loss_fn, optimizer, policy=Policy())``.

``loss_fn(params, batch)`` sees every parameter with its full shape; the step gathers each
communication group when ``loss_fn`` first touches it, frees it after use, prefetches the
next, and reduces each group's gradients as soon as backward is done with it (see
[Note: a group's life] in :mod:`funshard.step.group`). Then the gradient norm, clipping and
the optimizer run on the local shards. On one rank with no cast there is nothing to gather:
``loss_fn`` then gets the parameters themselves ([Note: the direct path] in
:mod:`funshard.step.direct`).

Why this mechanism (measured in tests/test_step.py): module hooks are out by design;
activation checkpointing would recompute the forward; a per-op DTensor redistribute issues
one collective per tensor. The lazy stand-in gives one collective per group and direction
and needs nothing from the model but ``torch.func.functional_call``.

Caveat: a custom ``autograd.Function`` that stashes a parameter on ``ctx`` (not through
``save_for_backward``) bypasses the hooks and would read freed storage; use
``save_for_backward``. Every rank must use the same groups in the same order.

    >>> step = train_step(loss_fn, fs.optim.adamw(lr=3e-4), policy=Policy(clip_norm=1.0))
    >>> state = step.init(fs.shard(fs.params(model), mesh))
    >>> state, metrics = step(state, (x, y))     # metrics["loss"], metrics["grad_norm"]
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .. import _compat, collectives, pytree
from ..optim.with_policy import with_policy
from . import agree, batches, call, deferred, donation, lazy, recompute, scaling, update
from . import buffers as buffers_
from . import loss as loss_
from . import direct as direct_
from .donation import Donations
from .policy import Policy
from .params import ParamGroups
from .run import Run
from .update_program import UpdateProgram

Tree = Any


class _TrainStateFields(NamedTuple):
    params: Tree
    opt_state: Tree
    step: int
    buffers: Tree = None
    skipped: int = 0
    loss_scale: Any = None


class TrainState(donation.Donatable, _TrainStateFields):
    """Sharded parameters, optimizer state, the number of steps taken, the buffers
    (replicated; None when the model has none given), and how many of the steps were skipped
    (their update dropped: a non-finite gradient under ``Policy(skip_nonfinite=True)``).

    The optimizer counts the updates it applied, ``step - skipped``: Adam's bias
    correction, SGD's first momentum step and the schedules read that count, as torch's
    optimizers do when a GradScaler skips their ``step()`` (and as optax's counts do under
    ``apply_if_finite``). A checkpoint written before ``skipped`` existed loads with 0.
    ``loss_scale``: a :class:`~funshard.step.scaling.LossScale` under
    ``Policy(loss_scale=)``, else None.

    ``step(state, batch)`` donates ``state``: reading a donated state's ``params``,
    ``opt_state``, ``buffers`` or ``loss_scale``, indexing or iterating it raises, naming
    the step (see :mod:`funshard.step.donation`).
    """

    params = donation.field(0, "params")
    opt_state = donation.field(1, "opt_state")
    buffers = donation.field(3, "buffers")
    skipped = donation.field(4, "skipped", donated=True)
    loss_scale = donation.field(5, "loss_scale")


class TrainStep(NamedTuple):
    """``init(params) -> TrainState`` and ``apply(state, batch) -> (state, metrics)``.

    Calling the object is ``apply``. Donation rule: ``apply`` updates the parameters and
    optimizer state in place (their local shards), as JAX does with donated buffers; the
    returned state is the one to use; the old one refuses to be read after the call.
    """

    init: Callable[[Tree], TrainState]
    apply: Callable[[TrainState, Any], tuple[TrainState, dict]]

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        return self.apply(state, batch)


def _micro_batches(loss_fn, params: ParamGroups, shards: list, policy: Policy,
                   batch: Any, bufs: Any, direct: bool, scale=None) -> update.Grads:
    """Forward and backward of every micro-batch; the reduced gradients of the last.
    ``direct``: ``shards`` are the leaves ``loss_fn`` gets (see [Note: the direct path]);
    ``scale``: the state's :class:`~.scaling.LossScale` (None: none)."""
    micro = batches.split(batch, policy.accumulate)
    k = len(micro)
    buckets: dict = {}  # gradients summed over micro-batches, per group
    used: set[int] = set()  # leaves given a gradient on this rank (see update.metrics_of)
    record = params.schedule is None
    loss_sum = torch.zeros((), dtype=torch.float64, device=params.device)
    count = None  # fs.Mean's counts, summed (see [Note: a mean over every rank's items])
    aux_all, runs, first = [], [], None
    for j, mb in enumerate(micro):
        run = Run(params, shards, policy, buckets, accumulating=k > 1, sync=(j == k - 1),
                  record=record and j == 0 and not direct, direct=direct, used=used)
        loss, aux = _micro_batch(loss_fn, params, run, shards, bufs, mb, first, j, k, scale)
        first = loss if first is None else first
        loss_sum += loss_.value(loss).detach().double()
        if isinstance(loss, loss_.Mean):
            c = loss_.count_of(loss, params.device)
            count = c if count is None else count + c
        aux_all.append(aux)
        runs.append(run)
    grads = _reduced_grads(runs[-1], len(params.layouts))
    peaks = tuple(max(p) for p in zip(*(r.peaks() for r in runs)))
    order = tuple(r.order_seen() for r in runs)
    params.linted = True
    if not isinstance(first, loss_.Mean):
        batches.check_even(batch)
    for r in runs:
        r.release()
    return update.Grads(grads, loss_sum, aux_all, peaks, order, count, used)


def _micro_batch(loss_fn, params: ParamGroups, run: Run, shards: list, bufs: Any, mb: Any,
                 first, j: int, k: int, scale) -> tuple:
    """Forward and backward of micro-batch ``j`` of ``k`` under ``run``: (loss, aux).
    ``first``: micro-batch 0's loss (None for micro-batch 0 itself)."""
    if run.is_direct():
        tree, hooks = pytree.unflatten(params.spec, run.start_direct()), contextlib.nullcontext()
    else:
        tree = pytree.unflatten(params.spec, lazy.stand_ins(run, params, shards))
        hooks = run.hooks()  # over the caller's, if theirs are on top
    if bufs is not None:  # loss_fn((params, buffers), batch): see .buffers
        tree = (tree, bufs)
    try:
        # a training step computes gradients, under torch.no_grad() too
        with torch.enable_grad(), hooks, run.running():
            loss, aux = loss_.loss_of(loss_fn(tree, mb))
        loss_.same_kind(loss if first is None else first, loss, j)
        call.check_found(run)
        loss_.check_differentiable(loss_.value(loss), params)
        if not params.linted:  # the first step of this tree: once
            loss_.check_reaches_only_params(run, loss_.value(loss))
        run.end_forward()
        with torch.enable_grad():
            recompute.backward(run, scaling.scaled(loss_.value(loss),
                                                   loss_.share(loss, k), scale))
        if run.is_direct():
            params.leaves.check_unwritten(params)
        else:
            lazy.check_untaken(run)
    finally:
        run.finish()
    return loss, aux


def _reduced_grads(run: Run, n: int) -> list:
    """The ``n`` leaves' reduced gradients, from the last micro-batch's ``run``."""
    grads: list = [None] * n
    for g in run.all_groups():
        if g.grads is not None:
            for k, i in enumerate(g.idx):
                grads[i] = g.grads[k]
    return grads


def _check_counts(state: TrainState) -> None:
    n, s = state.step, state.skipped
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (n, s)) or not 0 <= s <= n:
        raise ValueError(f"train_step: TrainState has step={n!r}, skipped={s!r}; they count "
                         "steps taken and skipped: ints with 0 <= skipped <= step.")


def _groups_for(cache: dict, policy: Policy, params: Tree) -> tuple[ParamGroups, list]:
    """``params``' :class:`ParamGroups` (cached per tree structure, mesh and which leaves
    require grad, like a jit cache: a leaf frozen since ``init`` gets no gradient and the
    optimizer leaves it and its state alone, as torch.optim skips a ``None`` grad) and its
    leaves."""
    leaves, spec = pytree.flatten(params)
    key = (spec, getattr(leaves[0], "device_mesh", None) if leaves else None,
           tuple(getattr(x, "requires_grad", False) for x in leaves))
    got = cache.get(key)  # (none trainable: the tree may have been made trainable since)
    if got is None or not any(got.trainable) or not all(isinstance(x, DTensor) for x in leaves):
        cache[key] = got = ParamGroups(params, policy)  # validates: DTensors, one mesh, ...
    return got, leaves


def _apply(loss_fn, optimizer, policy: Policy, groups_for, donations: Donations,
           state: TrainState, batch: Any, compiled=None, pending=None,
           updates=None) -> tuple[TrainState, dict]:
    """One step of :func:`train_step` (``groups_for``: its per-tree cache; ``compiled``: its
    :class:`~funshard.step.compiled.Compiled`, or None; ``pending``: the unread verdicts of
    the steps before it, :func:`~funshard.step.deferred.take`; ``updates``: the update
    program, compiled or not, that gates the update on the device)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("train_step: called under torch.inference_mode(), where no "
                           "gradient can be computed; call it outside.")
    no_read = deferred.usable(updates, optimizer)
    if pending is not None and not (no_read and pending.program is updates):
        pending.settle()  # this step reads, or another step's device state: theirs first
    params, leaves = groups_for(state.params)
    if compiled is not None:
        params.refuse_compiled("train_step")
    donations.check(state, leaves)
    _check_counts(state)
    scaling.check_state(policy, state.loss_scale)
    scale = (deferred.loss_scale(policy, state, updates, pending, params.device)
             if no_read else state.loss_scale)
    direct = direct_.usable(params)  # see [Note: the direct path]
    shards = (params.leaves.of(params, leaves) if direct else
              [_compat.local_tensor(d).detach().requires_grad_(t)
               for d, t in zip(leaves, params.trainable)])
    bleaves, work, bufs = (buffers_.locals_of(state.buffers) if state.buffers is not None
                           else ([], [], None))
    if bufs is not None and params.schedule is None and not direct:  # not init's state?
        buffers_.check_dtypes(params, state.buffers, where="train_step")

    def eager() -> update.Grads:
        return _micro_batches(loss_fn, params, shards, policy, batch, bufs, direct, scale)

    out = (eager() if compiled is None else
           compiled.grads(params, leaves, bufs, batch, eager, scale))
    if no_read:
        new_state, metrics = deferred.update(optimizer, policy, params, state, out, batch,
                                             updates, pending)
    else:
        new_state, metrics = update.update(optimizer, policy, params, state, out, batch,
                                           None if compiled is None else compiled.updates)
    if bufs is not None:
        if no_read:  # where the device's verdict says so (a refused step keeps them)
            buffers_.sync(policy.buffers, work, params.mesh)
            buffers_.write_back(bleaves, work, metrics.ok)
        elif not metrics["skipped"]:  # a skipped step keeps the buffers too
            buffers_.sync(policy.buffers, work, params.mesh)
            buffers_.write_back(bleaves, work)
        new_state = new_state._replace(buffers=state.buffers)
    # the optimizer updates the leaves in place: the new state holds the same tensors
    donations.donate(state)
    new_state = donations.remember(new_state, leaves)
    deferred.attach(metrics, state, new_state, donations, leaves, updates)
    return new_state, metrics


def train_step(loss_fn: Callable, optimizer, *, policy: Policy = Policy(),
               compile: Any = False) -> TrainStep:
    """Compose ``loss_fn`` and ``optimizer`` into one sharded training step.

    Args:
        loss_fn: ``(params, batch) -> loss`` or ``(loss, aux)``; ``params`` has full shapes
            (the loss is the mean over the local batch; or ``fs.Mean(total, count)``, a mean
            over every rank's items: [Note: a mean over every rank's items] in
            :mod:`funshard.step.loss`).
        optimizer: an ``fs.optim`` optimizer (``init``, ``update``).
        policy: :class:`Policy`.
        compile: True (or a dict of ``torch.compile``'s ``backend``, ``mode``, ``dynamic``,
            ``options``, and ``fallback="eager"``) traces the loss, backward and every
            group's collectives into one compiled program per batch signature, after one
            eager step that learns the model (see :mod:`funshard.step.compiled`). Not with
            a transport other than ``"c10d"``.
    Returns:
        :class:`TrainStep`; ``state, metrics = step(state, batch)`` with ``metrics["loss"]``
        (mean over all data-parallel ranks) and ``metrics["grad_norm"]`` (before clipping).
        With ``adam``, ``adamw`` or ``sgd`` the step makes no host read: ``metrics`` is a
        dict read from the device at its first access, where a refused step's error
        raises (or at the start of the step after next; [Note: a step that reads nothing]
        in :mod:`funshard.step.deferred`).

    Example: N ranks with batch B each match one process on the N*B batch.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"train_step: policy must be an fs.Policy, got {type(policy).__name__}")
    cache: dict[Any, ParamGroups] = {}  # per tree structure and mesh, like a jit cache
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
    donations = Donations(f"train_step({name})")  # the step a state is donated to
    # the Policy's clipping and non-finite skip are the fs.optim transforms, in front
    optimizer = with_policy(
        optimizer, clip_norm=policy.clip_norm,
        skip_nonfinite=policy.skip_nonfinite or scaling.dynamic(policy))  # overflows skip
    if policy.param_dtype == torch.float16 and policy.loss_scale is None:
        warnings.warn("train_step: Policy(param_dtype=torch.float16) without loss_scale: "
                      "gradients below 6e-8 round to zero in float16, silently; pass "
                      "loss_scale='dynamic' (torch's GradScaler's rule)", stacklevel=2)

    _compat.require_eager("train_step")  # its first step is eager even when compiled
    compiled = None
    if compile is not False:
        from .compiled import Compiled  # torch.compile's machinery only when asked for

        compiled = Compiled(loss_fn, policy, compile)
    updates = compiled.updates if compiled is not None else UpdateProgram(None)

    def groups_for(params: Tree) -> tuple[ParamGroups, list]:
        return _groups_for(cache, policy, params)

    def init(params: Tree, buffers: Tree = None) -> TrainState:
        with collectives.failures.call("train_step.init"):
            groups, leaves = groups_for(params)
            if buffers is not None:
                buffers = buffers_.prepare(buffers, groups.mesh, where="train_step.init")
                buffers_.check_dtypes(groups, buffers, where="train_step.init")
            bpaths, bleaves, _ = pytree.flatten_with_path(buffers)
            agree.check(groups, policy, [_compat.local_tensor(d) for d in leaves],
                        where="train_step.init",
                        buffers=[(pytree.fqn(p), _compat.local_tensor(b))
                                 for p, b in zip(bpaths, bleaves)])
            return donations.remember(TrainState(params, optimizer.init(params), 0, buffers,
                                                 0, scaling.initial(policy)), leaves)

    def apply(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        # counted and, on an exception, posted for the other ranks (collectives.failures)
        with collectives.failures.call(f"train_step (step {getattr(state, 'step', '?')})"):
            pending = deferred.take(state)  # the checks of the steps before, read late
            try:
                return _apply(loss_fn, optimizer, policy, groups_for, donations, state,
                              batch, compiled, pending, updates)
            except BaseException:
                deferred.give_back(state, pending)
                raise

    return TrainStep(init, apply)
