"""``train_step(..., compile=True)``: the loss and its reduced gradients as one compiled
program (see [Note: the step as one program] in :mod:`funshard.step.program`).

[Note: the compiled step's first step] The first step of each batch signature (the tree
of the batch's shapes and dtypes) runs eagerly: it trains exactly as the eager step does,
makes its checks (unreached leaves, the ranks' order, the loss's kind), and shows which
modules ``loss_fn`` enters through ``fs.call`` and which leaves the loss reaches. The
second compiles the program for that signature, with ``fullgraph=True``; from the third on
it runs, and a step that would compile it again (a guard failed: something the program
read from Python changed) is refused, naming dynamo's reason, where compiling again would
hide the change. A leaf the eager step found unreached stays without a gradient in the
program for that signature (the program is the same function of the same inputs).

A ``loss_fn`` that dynamo cannot trace whole is refused at its first compiled step with
dynamo's reason and the user's line, the state unchanged; ``compile={"fallback":
"eager"}`` runs such a signature eagerly instead, with a warning.

The update (the metrics, the non-finite rule, clipping and the optimizer) runs after the
program, as the eager step runs it: the state, metrics, checkpoints and state dicts are the
eager step's, and a run may switch between the two at any checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
import warnings
from typing import Any, Callable, NamedTuple

import torch

from .. import _compat, pytree
from . import update
from .call import _NONE, _restore, in_program, recording
from .params import ParamGroups
from .program import Program

_OPTIONS = ("backend", "mode", "dynamic", "options", "fallback")
_ids = itertools.count()


def options_of(compile: Any) -> dict:
    """``train_step``'s ``compile=`` as ``torch.compile`` keywords plus ``fallback``."""
    if compile is True:
        return {}
    if not isinstance(compile, dict) or any(k not in _OPTIONS for k in compile):
        raise TypeError(
            f"train_step: compile must be False, True or a dict with keys from {_OPTIONS} "
            f"(torch.compile's backend, mode, dynamic, options; fallback='eager'), got "
            f"{compile!r}")
    if compile.get("fallback", None) not in (None, "eager"):
        raise ValueError(f"train_step: compile's fallback is 'eager' or absent, got "
                         f"{compile['fallback']!r}")
    return dict(compile)


def check_policy(policy) -> None:
    """What the compiled step does not do yet is refused by name."""
    unsupported = [(policy.accumulate != 1, f"accumulate={policy.accumulate}"),
                   (policy.loss_scale is not None, f"loss_scale={policy.loss_scale!r}"),
                   (policy.transport != "c10d", f"transport={policy.transport!r}")]
    named = [what for bad, what in unsupported if bad]
    if named:
        raise NotImplementedError(
            f"train_step(compile=True) does not support Policy({', '.join(named)}) yet (its "
            "collectives are torch's functional ones, one micro-batch per program); use "
            "compile=False for this policy.")


class _Entry(NamedTuple):
    program: Program | None  # None: this signature runs eagerly (fallback)
    fn: Callable | None
    used: frozenset  # leaves the eager step gave a gradient
    order: tuple  # the eager step's group order (every rank's program follows it)
    patches: list  # (module, forward) put in front of each group module during the call
    ran: list  # [bool]: compiled once already


def _signature(tree: Any) -> tuple:
    """What a program is specialised on: the tree's structure, its tensors' shapes, dtypes
    and devices, and its other leaves' values."""
    leaves, spec = pytree.flatten(tree)
    return (spec, tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad)
                        if isinstance(x, torch.Tensor) else (type(x), repr(x))
                        for x in leaves))


def _fresh(name: str) -> Callable:
    """A function of its own code object: dynamo's cache is per code object, so each
    signature's program is compiled and guarded on its own."""
    code = _call_program.__code__.replace(co_name=name)
    return types.FunctionType(code, _call_program.__globals__, name)


def _call_program(program, shards, bufs, batch):
    return program(shards, bufs, batch)


@contextlib.contextmanager
def _patched(patches: list):
    """Each group module's forward replaced for the duration of the call, then restored as
    ``Policy(checkpoint=)``'s wrappers are (:func:`funshard.step.call._restore`)."""
    done = []
    try:
        for module, forward in patches:
            before = vars(module).get("forward", _NONE)
            module.forward = forward
            done.append((module, before))
        yield
    finally:
        for module, before in reversed(done):
            _restore(module, before)


class Compiled:
    """The compiled programs of one ``train_step``, one per batch signature."""

    def __init__(self, loss_fn: Callable, policy, compile: Any):
        _compat.require("train_step(compile=True)")
        check_policy(policy)
        self.loss_fn, self.policy = loss_fn, policy
        options = options_of(compile)
        self.fallback = options.pop("fallback", None) == "eager"
        self.options = options
        self.entries: dict[tuple, _Entry] = {}

    def grads(self, params: ParamGroups, leaves: list, bufs: Any, batch: Any,
              eager: Callable[[], update.Grads]) -> update.Grads:
        """The step's reduced gradients: ``eager()`` on a signature's first step, its
        program after."""
        key = (params, _signature(batch), _signature(bufs))
        entry = self.entries.get(key)
        if entry is None:
            with recording() as modules:
                out = eager()
            self.entries[key] = self._entry(params, leaves, modules, out)
            return out
        if entry.program is None:
            return eager()
        try:
            return self._run(entry, leaves, bufs, batch)
        except _compat.DynamoError as e:
            if not self.fallback:
                raise TypeError(
                    "train_step(compile=True): loss_fn cannot be traced as one program; "
                    f"the parameters and optimizer state are unchanged. torch.compile "
                    f"says: {e}\nMake loss_fn traceable, pass compile=False, or "
                    "compile={'fallback': 'eager'}.") from e
            warnings.warn(f"train_step(compile=True): loss_fn cannot be traced as one "
                          f"program; this batch signature runs eagerly. torch.compile "
                          f"says: {e}", stacklevel=4)
            self.entries[key] = entry._replace(program=None, fn=None)
            return eager()

    def _entry(self, params: ParamGroups, leaves: list, modules: list,
               out: update.Grads) -> _Entry:
        blocks = {}
        for gi, name in enumerate(params.names):
            sub = _module_of(params, gi, name, modules)
            if sub is not None:
                blocks[gi] = (sub, sub.forward)
        program = Program(self.loss_fn, params, self.policy, blocks, leaves)
        fn = torch.compile(_fresh(f"funshard_step_{next(_ids)}"), fullgraph=True,
                           **self.options)
        patches = [(sub, functools.partial(program.block, gi))
                   for gi, (sub, _) in blocks.items()]
        return _Entry(program, fn, frozenset(out.used), out.order, patches, [False])

    def _run(self, entry: _Entry, leaves: list, bufs: Any, batch: Any) -> update.Grads:
        program = entry.program
        stance = (torch.compiler.set_stance("fail_on_recompile") if entry.ran[0]
                  else contextlib.nullcontext())
        with (_patched(entry.patches), in_program(self.policy),
              _compat.tracing_autograd(), stance):
            try:
                value, count, aux, reduced = entry.fn(
                    program, [d._local_tensor for d in leaves], bufs, batch)
            except _compat.RecompileError as e:
                raise RuntimeError(
                    "train_step(compile=True): the step's program would be compiled again "
                    "for a batch of the same shapes: something it read from Python changed "
                    f"since it was traced. torch.compile says: {e}") from e
            except _compat.DynamoError:
                raise  # not traceable: see grads
            except Exception as e:
                if entry.ran[0]:
                    raise
                raise RuntimeError(  # nothing of the state was written: the update is after
                    "train_step(compile=True): the step's program failed on its first run; "
                    "the parameters and optimizer state are unchanged (a parameter of a group "
                    "module read outside that module is a DTensor there: see "
                    f"funshard.step.program). {type(e).__name__}: {e}") from e
        entry.ran[0] = True
        grads: list = [None] * len(leaves)
        for i, g in zip(program.trainable, reduced):
            if i in entry.used:
                grads[i] = g
        return update.Grads(grads, value.double(), [aux], (None, None), entry.order, count,
                            set(entry.used))


def _module_of(params: ParamGroups, gi: int, name: str, modules: list):
    """The submodule group ``gi`` names in a module ``fs.call`` entered, when every leaf of
    the group lies under it; else None (the group is gathered at the program's start)."""
    if not name:
        return None
    prefix = name + "."
    if not all(params.layouts[i].path.startswith(prefix) for i in params.members[gi]):
        return None
    for m in modules:
        try:
            return m.get_submodule(name)
        except AttributeError:
            continue
    return None
