"""``fs.call(module, params, *args)``: ``torch.func.functional_call`` for a training step,
whose parameters stay in the module until backward is done.

Inside ``train_step`` a module called through ``torch.func.functional_call`` gets its own
weights back the moment the call returns. Backward never reads them, except where activation
checkpointing recomputes a forward: then the recompute would run on the module's own (stale)
weights. ``fs.call`` installs the step's parameters (and buffers) the same way and undoes the
installation when the micro-batch's backward has finished, so a recompute runs on the step's
parameters: the model's own checkpointing (``torch.utils.checkpoint`` either way, Hugging
Face ``gradient_checkpointing_enable()``, selective checkpointing) trains as one process
would. Outside a step it is ``torch.func.functional_call``. A step whose recompute reads a
module's own parameter is refused by name (:class:`funshard.step.recompute.RecomputeGuard`).

    >>> loss_fn = lambda p, b: F.cross_entropy(fs.call(model, p, b[0]), b[1])
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any

import torch
import torch.utils.checkpoint
from .. import pytree
from . import lazy, recompute
from .install import install
from .run import Run


def _merged(params: Any) -> dict:
    """A dict of tensors, or a tuple of them (params, buffers) without repeated keys, as
    ``torch.func.functional_call`` takes them."""
    if isinstance(params, dict):
        return params
    if isinstance(params, (tuple, list)) and all(isinstance(d, dict) for d in params):
        out: dict = {}
        for d in params:
            for key in d:
                if key in out:
                    raise ValueError(f"fs.call: {key!r} appears in more than one dict")
            out.update(d)
        return out
    raise TypeError(f"fs.call: params must be a dict of tensors or a tuple of such dicts, got "
                    f"{type(params).__name__}")


def call(module: torch.nn.Module, params: Any, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with ``params`` (a dict ``{fqn: tensor}``, or a tuple of
    dicts such as ``(params, buffers)``) in place of its own parameters and buffers.

    Inside ``train_step``'s ``loss_fn`` they stay installed until the micro-batch's backward
    has finished (activation checkpointing recomputes with them), and under a Policy with
    ``param_dtype`` floating-point inputs are cast to it (``Policy(cast_inputs=)``, as
    FSDP2's ``cast_forward_inputs``); elsewhere this is
    ``torch.func.functional_call(module, params, args, kwargs)``. Tied weights stay tied;
    parameters ``params`` does not name stay the module's own.
    """
    program = _PROGRAM[0]
    if program is not None:  # inside the compiled step's program (see in_program)
        if program[0] is not None:
            args, kwargs = pytree.plain_map(functools.partial(_cast, program[0]), (args, kwargs))
        return torch.func.functional_call(module, params, args, kwargs)
    run = Run.current()
    # Policy(param_dtype=, cast_inputs=True): FSDP2's cast_forward_inputs. A step's run says
    # it (a recompute casts as its forward did); eval_step sets _CAST. (One context variable
    # read per call: under torch 2.11 each is a graph break of a compiled loss_fn.)
    dt = _CAST.get() if run is None else (run.policy.param_dtype if run.policy.cast_inputs
                                          else None)
    if dt is not None:
        args, kwargs = pytree.tree_map(functools.partial(_cast, dt), (args, kwargs))
    seen = _SEEN.get()  # a compiled step's (or eval_step's) first call: the modules
    if seen is not None and not any(m is module for m in seen):
        seen.append(module)
    if run is None or run.in_backward():
        return torch.func.functional_call(module, params, args, kwargs)
    merged = _merged(params)
    # undone by Run.finish, after backward; a stand-in a recompute reads is refused as it is
    # read (lazy._recomputed), so only plain tensors are watched for a second installation
    calls = run.installations()
    stack = calls.add(module, merged, lazy.LazyParam)
    if run.has_stand_ins():
        _enter_groups(run, module, merged, stack)
    if run.policy.checkpoint:
        _checkpoint_groups(run, module, stack)
    calls.calling(1)
    try:
        return module(*args, **kwargs)
    finally:
        calls.calling(-1)


# the dtype fs.call casts floating-point inputs to while an eval_step's fn runs
# (Policy(param_dtype=, cast_inputs=True)); None: no cast. A training step's run says it.
_CAST: contextvars.ContextVar = contextvars.ContextVar("funshard_cast_inputs", default=None)


# (the cast dtype or None,) while the compiled step's program runs, else None: a plain
# global, which dynamo reads as a constant, where a context variable breaks its graph
_PROGRAM: list = [None]


@contextlib.contextmanager
def in_program(policy):
    """While inside, :func:`call` is ``functional_call`` with the policy's input cast: the
    compiled step's program gathers at the module boundaries itself."""
    before = _PROGRAM[0]
    _PROGRAM[0] = (policy.param_dtype if policy.cast_inputs else None,)
    try:
        yield
    finally:
        _PROGRAM[0] = before


# the modules a training step's loss_fn entered through fs.call, while a compiled step's
# first (eager) step records them (see [Note: the compiled step's first step])
_SEEN: contextvars.ContextVar = contextvars.ContextVar("funshard_seen", default=None)


@contextlib.contextmanager
def recording():
    """While inside, :func:`call` lists the modules it enters (yielded)."""
    seen: list = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


@contextlib.contextmanager
def casting(policy):
    """While inside, :func:`call` casts inputs as ``policy`` says (see ``cast_inputs``)."""
    token = _CAST.set(policy.param_dtype if policy.cast_inputs else None)
    try:
        yield
    finally:
        _CAST.reset(token)


def _cast(dt: torch.dtype, x: Any) -> Any:
    """A floating-point tensor in the compute dtype; anything else as it is."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dt:
        return x.to(dt)
    return x


# [Note: groups entered at their module]
#
# Inside ``fs.call`` each group that is a submodule of the module called (``layers.3``, the
# default groups' blocks) is gathered when its module is entered, before its first op, and
# stays resident until the module returns (FULL_SHARD then frees it as the next group is
# gathered, or keeps it into backward when it is the last); the module's forward is
# replaced for the call only, as Policy(checkpoint=) replaces it, and put back when the
# micro-batch's backward is done; the group's full tensors are installed in the module
# for its forward (running statistics stay stand-ins: batch_norm's in-place update must be
# seen) and the module's own stand-ins are back when it returns (an in-place write into
# the gathered tensors is refused when the group is freed: ``Group.check_unwritten``). Every op
# inside, a custom autograd Function's included, so computes on plain gathered tensors at
# a plain op's cost. A parameter used outside its group's module (the rest group '',
# loss_fn's own use) stays its stand-in ([Note: stand-ins] in .lazy); a Function given one
# as it is (a fused linear cross-entropy over ``lm_head.weight``) trains through it. In backward
# the replaced forward runs only when a checkpoint region around the module's call
# recomputes it: the module then computes with the group's gathered leaves, installed for
# the call (:func:`recomputed`), those the recompute owns ([Note: recomputation]); a region
# opened inside the module's own forward recomputes past the replaced forward, on the
# stand-ins. Measured 2026-11-27 (benchmark shapes A, B, C, 2 gloo ranks, two runs each
# against the step before): the same collectives per step (15, 7, 10 all-gathers), the same
# live-tensor peaks, step times within the runs' spread; freeing each group as its module
# returned instead cost one more all-gather on A and B (the last block, gathered again for
# backward), and on B 0.92-0.95x FSDP2's step against 0.84-0.85x
# (benchmarks/results/2026-11-27-cpu-module-entry.md).


class _Entered:
    """A group module's forward for one run: the group gathered on entry, kept till return;
    in backward (a recompute), the module computes with the group's gathered leaves."""

    __slots__ = ("run", "gi", "forward", "module", "leaves")

    def __init__(self, run: Run, gi: int, forward, module: torch.nn.Module, leaves: list):
        self.run, self.gi, self.forward = run, gi, forward
        self.module, self.leaves = module, leaves  # leaves: (name in module, leaf of group)

    # under a compiled loss_fn: this frame runs eagerly, the module's forward is compiled
    @functools.partial(torch.compiler.disable, recursive=False)
    def __call__(self, *args, **kwargs):
        run = self.run
        if run.in_backward():
            with install(self.module, recomputed(run, self.gi, self.leaves)):
                return self.forward(*args, **kwargs)
        fulls = enter_module(run, self.gi, self.leaves)
        try:
            with install(self.module, fulls, over=True):
                return self.forward(*args, **kwargs)
        finally:
            leave_module(run, self.gi)


@lazy.eager
def enter_module(run, gi: int, leaves: list) -> dict:
    """Group ``gi``'s module is entered in forward (see [Note: groups entered at their
    module] in :mod:`.call`): the group is gathered now, before the module's first op, and
    stays resident until the module returns. Returns its full tensors by name in the
    module."""
    run.installations().enter(gi)
    group = run.group(gi)
    if group.resident:
        run.use([gi], new_op=True)
    else:
        lazy.gather_first(run, [group.stands[k] for _, k in leaves], [gi])
    stats = run.params.running_stats[gi]  # stay stand-ins (see lazy._refuse_running_stats)
    return {name: run.model_view(gi, k, group.fulls[k]) for name, k in leaves if k not in stats}


@lazy.eager
def recomputed(run, gi: int, leaves: list) -> dict:
    """The gathered leaves a recompute of group ``gi``'s module computes with, by name: those
    its first pass computed with (:meth:`Run.recompute_leaf`), so that a custom Function in
    it receives them too, not the stand-ins (autograd would take a stand-in for a leaf of
    its own, whose gradient would bypass the step)."""
    recompute.check_reinstalled(run)
    with recompute.own_ops(False), torch.no_grad():
        run.use([gi], new_op=False)
        return {name: run.model_view(gi, k, run.recompute_leaf(gi, k)) for name, k in leaves}


@lazy.eager
def leave_module(run, gi: int) -> None:
    """Group ``gi``'s module returns: the group is the latest op's again, freed (FULL_SHARD)
    when an op gathers another group, kept into backward if none does (the last block)."""
    if not run.installations().leave(gi):
        run.hold(gi)


@lazy.eager  # under a compiled loss_fn too: dynamo cannot follow module lookups by path
def _enter_groups(run: Run, module: torch.nn.Module, merged: dict,
                  stack: contextlib.ExitStack) -> None:
    """Each group module of ``module`` whose parameters are this run's stand-ins is entered
    with its group gathered (see [Note: groups entered at their module])."""
    names = run.params.names
    found: dict[int, list] = {}
    for path, t in merged.items():
        gi, k = run.stand_in_of(t)
        if gi is not None and names[gi] and path.startswith(names[gi]) \
                and path[len(names[gi]):len(names[gi]) + 1] == ".":
            found.setdefault(gi, []).append((path[len(names[gi]) + 1:], k))
    for gi, leaves in found.items():
        try:
            sub = module.get_submodule(names[gi])
        except AttributeError:
            continue
        if isinstance(sub.forward, _Entered):  # an earlier fs.call in this run replaced it
            continue
        before = vars(sub).get("forward", _NONE)
        sub.forward = _Entered(run, gi, sub.forward, sub, leaves)
        stack.callback(_restore, sub, before)


def _checkpoint_groups(run: Run, module: torch.nn.Module, stack: contextlib.ExitStack) -> None:
    """``Policy(checkpoint=)``: the forward of each selected group's module runs under
    non-reentrant ``torch.utils.checkpoint`` until the run finishes. Its recompute comes
    when backward reaches the group, as backward gathers it (see [Note: recomputation] in
    :mod:`.recompute`): no extra all-gather."""
    select = run.policy.checkpoint
    found = 0
    for name in (n for n in run.params.names if select is True or select(n)):
        if not name:  # the rest: no one module holds it
            if select is True:
                continue
            raise ValueError(
                "train_step: Policy(checkpoint=...) selected group '' (the parameters outside "
                "the repeated blocks), which is not one module; select block groups "
                "(fs.list_groups lists them)")
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            if select is True:
                continue  # a group that is not a module (custom groups): not selected by name
            raise ValueError(
                f"train_step: Policy(checkpoint=...) selected group {name!r}, which names no "
                f"submodule of the {type(module).__name__} given to fs.call; select groups "
                "that are modules (fs.list_groups lists them)") from None
        found += 1
        if getattr(sub.forward, "func", None) is _checkpointed:
            continue  # an earlier fs.call in this run wrapped it
        before = vars(sub).get("forward", _NONE)  # an instance forward someone else set
        sub.forward = functools.partial(
            _checkpointed, functools.partial(_regathered, run, run.params.names.index(name),
                                             sub.forward))
        stack.callback(_restore, sub, before)
    if not found:
        raise ValueError(
            f"train_step: Policy(checkpoint=True) found no group naming a submodule of the "
            f"{type(module).__name__} given to fs.call (groups: {list(run.params.names)}); "
            "use the default groups, groups named by module path, or a predicate.")


_NONE = object()


def _restore(sub: torch.nn.Module, before) -> None:
    if before is _NONE:
        del sub.forward
    else:
        sub.forward = before


def _checkpointed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _regathered(run: Run, gi: int, forward, *args, **kwargs):
    """A checkpointed group's forward. Recomputed in backward, it uses its group first: every
    rank gathers the group here."""
    if run.in_backward():
        recompute.check_reinstalled(run)
        with recompute.own_ops(False), torch.no_grad():
            run.use([gi], new_op=True)
    return forward(*args, **kwargs)


def check_found(run: Run) -> None:
    """After ``loss_fn``: ``Policy(checkpoint=)`` found its modules through ``fs.call``."""
    if run.policy.checkpoint and not run.installations().any():
        raise ValueError(
            "train_step: Policy(checkpoint=...) checkpoints the modules of the groups it "
            "selects, which it finds in the module loss_fn calls through fs.call; loss_fn "
            "called none. Call the model with fs.call(model, params, *args) in place of "
            "torch.func.functional_call.")
