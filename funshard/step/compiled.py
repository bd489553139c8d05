"""``train_step(..., compile=True)``: the loss and its reduced gradients as one compiled
program (see [Note: the step as one program] in :mod:`funshard.step.program`).

[Note: the compiled step's first step] The first step of each batch signature (the tree
of the batch's shapes and dtypes) computes its gradients eagerly: it trains exactly as the
eager step does, makes its checks (unreached leaves, the ranks' order, the loss's kind),
and shows which modules ``loss_fn`` enters through ``fs.call`` and which leaves the loss
reaches. Before its update, the same step compiles the program for that signature
(``fullgraph=True``) and runs it once on the same micro-batch, its result set aside (and
the buffers it would write, copies): a ``loss_fn`` that dynamo cannot trace whole is
refused there, at the first step, with dynamo's reason and the user's line and the state
unchanged; ``compile={"fallback": "eager"}`` runs such a signature eagerly instead, with a
warning. From the second step the program runs, and a step that would compile it again (a
guard failed: something the program read from Python changed) is refused, naming dynamo's
reason, where compiling again would hide the change. The leaves this rank's eager step
reached are those the program reaches (the same function of the same inputs): the step's
rule for a leaf no rank reached ([Note: a parameter no rank reached] in
:mod:`funshard.step.update`) takes them each step, so a leaf some other rank reached keeps
the mean over ranks here too.

``eval_step(fn, compile=True)`` is the same machinery without gradients: its first call
per signature of the arguments runs eagerly, shows the modules and tries the program,
later ones run ``fn``'s program under ``torch.no_grad()``.

The update follows the program: the metrics and the non-finite rule as the eager step
makes them, then the optimizer, which for ``adam``, ``adamw`` and ``sgd`` with momentum
(the Policy's clip in front) is the step's second program, from the first step on
(:mod:`funshard.step.update_program`). The state, metrics, checkpoints and state dicts are
the eager step's, and a run may switch between the two at any checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import warnings
from typing import Any, Callable, NamedTuple

import torch

from .. import _compat, collectives, pytree
from . import backend, batches, overlap, scaling, update
from .call import _NONE, _restore, in_program, recording
from .params import ParamGroups
from .program import Program
from .update_program import UpdateProgram

_OPTIONS = ("backend", "mode", "dynamic", "options", "fallback")
_EAGER = object()  # what Compiled._traced gives where a signature runs eagerly
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
    """What the compiled step does not do is refused by name."""
    if policy.transport != "c10d":
        raise NotImplementedError(
            f"train_step(compile=True) does not support Policy(transport="
            f"{policy.transport!r}) (its collectives are torch's functional ones); use "
            "compile=False for this policy.")


class _Entry(NamedTuple):
    program: Program | None  # None: this signature runs eagerly (fallback)
    fn: Callable | None
    used: frozenset  # leaves the eager step gave a gradient
    order: tuple  # the eager step's group order (every rank's program follows it)
    patches: list  # (module, forward) put in front of each group module during the call
    ran: list  # [bool]: compiled once already


# inductor's options for the program, under the caller's: its post-grad pass that moves
# each op's producers next to it put every group's backward pack and gather at the program's
# start, holding each packed copy until its group's backward (measured on shape B: 384 MiB
# in the step against 368 without the pass; the eager step's 257)
_INDUCTOR = {"reorder_for_locality": False}


def _inductor_options(options: dict) -> dict:
    """``options`` with :data:`_INDUCTOR` under the caller's own, for inductor."""
    if options.get("backend", "inductor") != "inductor" or "mode" in options:
        return options
    return {**options, "options": {**_INDUCTOR, **options.get("options", {})}}


def _signature(tree: Any) -> tuple:
    """What a program is specialised on: the tree's structure, its tensors' shapes, strides
    (dynamo guards the layout: a contiguous copy of a sliced batch is another program),
    dtypes, devices and whether they are inference tensors, and its other leaves'
    values."""
    leaves, spec = pytree.flatten(tree)
    return (spec, tuple((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad,
                         x.is_inference())
                        if isinstance(x, torch.Tensor) else (type(x), repr(x))
                        for x in leaves))


def _inputs(program, leaves: list) -> list:
    """The program's shard inputs: the trainable ones fresh leaves that require grad
    (dynamo on torch 2.11 cannot make a graph's own tensor require grad)."""
    if not program.train:
        return [_compat.local_tensor(d) for d in leaves]
    return [_compat.local_tensor(d).detach().requires_grad_(t)
            for d, t in zip(leaves, program.params.trainable)]


# [Note: the program's own guards] dynamo guards every Python value a trace reads. Most of
# what the program reads is its own: the layouts, groups, buckets and tree template the step
# worked out before tracing, read through ``program`` (1,768 of the 4,184 guard entries on
# the host-bound GPT, each checked before every call; measured 2026-11-26). They are fixed
# when the Program is made, and a new signature is a new Program, so those guards are
# dropped. What the program reads of the caller's is kept: ``loss_fn`` and its closure, the
# group modules (``blocks``), the Policy, the tensors passed in, and the globals.
_OWN = tuple(f"program.{a}" for a in (
    "params", "like", "template", "trainable", "buckets", "regions", "shard_group",
    "replicate_group", "shard_mesh", "world", "alone", "train", "leaves", "place"))


def _own_guards(entries: list) -> list[bool]:
    """Which of dynamo's guards a program keeps: all but those on its own constants."""
    return [not e.name.startswith(_OWN) for e in entries]


def _guard_options() -> dict:
    return {"options": {"guard_filter_fn": _own_guards}} if _compat.GUARD_FILTER else {}


def _call_program(program, shards, bufs, inputs):
    return program(shards, bufs, inputs)


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
    """The compiled programs of one ``train_step`` (or ``eval_step``: ``train=False``), one
    per signature of its inputs."""

    def __init__(self, fn: Callable, policy, compile: Any, train: bool = True):
        self.where, self.what = (("train_step", "loss_fn") if train else ("eval_step", "fn"))
        _compat.require(f"{self.where}(compile=True)")
        if train:
            check_policy(policy)
        self.fn, self.policy, self.train = fn, policy, train
        options = options_of(compile)
        self.fallback = options.pop("fallback", None) == "eager"
        self.options = options
        self.graphs = _cuda_graphs(options)
        self.entries: dict[tuple, _Entry] = {}
        # the update, the step's second program (for the optimizers it covers), from the
        # first step on: every step of a run takes the same update, whichever computed its
        # gradients
        self.updates = UpdateProgram(_inductor_options(options)) if train else None

    def grads(self, params: ParamGroups, leaves: list, bufs: Any, batch: Any,
              eager: Callable[[], update.Grads], scale=None) -> update.Grads:
        """The step's reduced gradients: ``eager()`` on a signature's first step (which
        then compiles the program and tries it once: [Note: the compiled step's first
        step]), then the program of each micro-batch's signature, once per micro-batch,
        their sums. (One program per micro-batch: AOTAutograd's pass that gathers again in
        backward takes one backward region per graph.) ``scale``: the state's loss scale
        (None: none)."""
        parts = batches.split(batch, self.policy.accumulate)
        keys = [self._key(params, [mb], bufs) for mb in parts]
        factor = None if scale is None else scaling.factor(scale, params.device)
        if any(k not in self.entries for k in keys):
            new = {k: mb for k, mb in zip(keys, parts) if k not in self.entries}
            out = self._first(params, leaves, keys, eager)
            for key, mb in new.items():  # compiled now: refused at the first step
                with _random_kept(params.device):
                    self._traced(key, leaves, pytree.tree_map(_copy, bufs), ([mb], factor))
            return out
        if any(self.entries[k].program is None for k in keys):  # before any part runs
            return eager()
        total = count = summed = None
        auxes: list = []
        graphs = self.graphs and params.device.type == "cuda"
        for j, (key, mb) in enumerate(zip(keys, parts)):
            out = self._traced(key, leaves, bufs, ([mb], factor), first_part=j == 0)
            if out is _EAGER:
                return eager()
            value, c, aux, reduced = _owned(out, len(parts) > 1) if graphs else out
            total = value if total is None else total + value
            count = c if count is None or c is None else count + c
            summed = reduced if summed is None else [
                b if a is None else a if b is None else a + b for a, b in zip(summed, reduced)]
            auxes += aux
        entry = self.entries[keys[0]]
        grads: list = [None] * len(leaves)
        for i, g in zip(entry.program.trainable, summed):
            grads[i] = g  # (a leaf no rank reached: dropped by the update's rule)
        return update.Grads(grads, total, auxes, (None, None), entry.order, count,
                            set(entry.used))

    def evaluate(self, params: ParamGroups, leaves: list, bufs: Any, args: tuple,
                 kwargs: dict, eager: Callable[[], Any]) -> Any:
        """An ``eval_step``'s result: ``eager()`` on a signature's first call, its program
        after."""
        key = self._key(params, (args, kwargs), bufs)
        if key not in self.entries:
            out = self._first(params, leaves, [key], eager)
            with _random_kept(params.device):  # tried
                self._traced(key, leaves, pytree.tree_map(_copy, bufs), (args, kwargs))
            return out
        out = self._traced(key, leaves, bufs, (args, kwargs))
        return eager() if out is _EAGER else out

    @staticmethod
    def _key(params: ParamGroups, inputs: Any, bufs: Any) -> tuple:
        # (a world of one forced to run its collectives is another program)
        return (params, _signature(inputs), _signature(bufs), collectives.skips(1))

    def _first(self, params: ParamGroups, leaves: list, keys: list, eager: Callable) -> Any:
        """``eager()``, which shows the modules ``fs.call`` enters; the programs of ``keys``
        made from what it saw."""
        with recording() as modules:
            out = eager()
        for key in keys:
            if key not in self.entries:
                self.entries[key] = self._entry(params, leaves, modules, out)
        return out

    def _traced(self, key: tuple, leaves: list, bufs: Any, inputs: Any,
                first_part: bool = True) -> Any:
        """The program of ``key`` on ``inputs``, or :data:`_EAGER` where it runs eagerly."""
        entry = self.entries[key]
        if entry.program is None:
            return _EAGER
        try:
            return self._run(entry, leaves, bufs, inputs)
        except _compat.DynamoError as e:
            ours = overlap.failure_in(e)  # the step's own pass failed: funshard's bug, said so
            why = f"{self.what} cannot be traced as one program" if ours is None else ours.why
            if not self.fallback or not first_part:  # (a part ran: eager would run it again)
                hint = (f"Make {self.what} traceable, pass compile=False, or compile="
                        "{'fallback': 'eager'}." if ours is None else ours.hint)
                raise (TypeError if ours is None else RuntimeError)(
                    f"{self.where}(compile=True): {why}; the parameters and optimizer state "
                    f"are unchanged. torch.compile says: {e}\n{hint}") from e
            warnings.warn(f"{self.where}(compile=True): {why}; these inputs' signature runs "
                          f"eagerly. torch.compile says: {e}", stacklevel=5)
            self.entries[key] = entry._replace(program=None, fn=None)
            return _EAGER

    def _entry(self, params: ParamGroups, leaves: list, modules: list, out: Any) -> _Entry:
        blocks = {}
        for gi, name in enumerate(params.names):
            sub = _module_of(params, gi, name, modules)
            if sub is not None:
                blocks[gi] = (sub, sub.forward)
        program = Program(self.fn, params, self.policy, blocks, leaves, train=self.train)
        # (each signature's program under a code object of its own: guarded on its own)
        fn = torch.compile(backend.fresh(_call_program, f"funshard_{self.where}_{next(_ids)}"),
                           fullgraph=True,
                           **backend.compile_options(_inductor_options(self.options)),
                           **_guard_options())
        patches = [(sub, functools.partial(program.block, gi))
                   for gi, (sub, _) in blocks.items()]
        if not self.train:
            return _Entry(program, fn, frozenset(), (), patches, [False])
        return _Entry(program, fn, frozenset(out.used), out.order, patches, [False])

    def _run(self, entry: _Entry, leaves: list, bufs: Any, inputs: Any) -> Any:
        # a second compile of the same signature is refused (RecompileError, below)
        stance = _compat.refusing_recompiles() if entry.ran[0] else contextlib.nullcontext()
        grad = _compat.tracing_autograd() if self.train else torch.no_grad()
        logs = (contextlib.nullcontext() if entry.ran[0]  # traced at its first run only
                else _compat.tracing_without_logs(_logger_methods()))
        with _patched(entry.patches), in_program(self.policy), grad, logs, stance:
            try:
                out = entry.fn(entry.program, _inputs(entry.program, leaves), bufs, inputs)
            except _compat.RecompileError as e:
                raise RuntimeError(
                    f"{self.where}(compile=True): the program would be compiled again for "
                    "inputs of the same shapes: something it read from Python changed "
                    f"since it was traced. torch.compile says: {e}") from e
            except _compat.DynamoError:
                raise  # not traceable: see _traced
            except Exception as e:
                if entry.ran[0]:
                    raise
                raise RuntimeError(  # nothing of the state was written: the update is after
                    f"{self.where}(compile=True): the program failed on its first run; the "
                    "parameters and optimizer state are unchanged (a parameter of a group "
                    "module read outside that module is a DTensor there: see "
                    f"funshard.step.program). {type(e).__name__}: {e}") from e
        entry.ran[0] = True
        return out


_LEVELS = ("debug", "info", "warn", "error", "exception", "critical", "fatal", "log")


def _logger_methods() -> set:
    """The ``logging.Logger`` methods that emit a record (those libraries add too, such as
    ``warning_once``): the program traces them as no-ops. They ran at the eager first step
    of each signature; in the program, as Python's side effects under ``jax.jit``, they do
    not run again (dynamo would break the graph on them)."""
    return {f for name, f in vars(logging.Logger).items()
            if name.startswith(_LEVELS) and callable(f)}


def _random_kept(device: torch.device):
    """The random state as it was before the first step's trial run, after it: its draws
    (dropout) are set aside with its result, so the next step draws what the eager step
    would (the programs that follow draw in the eager step's order under a backend that
    runs torch's random ops, such as ``aot_eager``; inductor draws its own)."""
    on = [device] if device.type not in ("cpu", "meta") else []
    return torch.random.fork_rng(devices=on, device_type=device.type if on else "cuda")


def _cuda_graphs(options: dict) -> bool:
    """Whether inductor records the gradients' program as a CUDA graph (on a GPU), whose
    outputs are its own memory, written again at its next replay."""
    if options.get("backend", "inductor") != "inductor":
        return False
    flag = (options.get("options") or {}).get("triton.cudagraphs")
    return bool(flag) if flag is not None else (
        options.get("mode") in ("reduce-overhead", "max-autotune"))


def _owned(out: tuple, every: bool) -> tuple:
    """A CUDA graph's outputs that outlive its next replay, copied: the aux (in the metrics
    until read) and, with a replay per micro-batch (``every``), the loss, count, gradients."""
    value, c, aux, reduced = out
    aux = pytree.plain_map(_copy, aux)
    if every:
        value, c, reduced = _copy(value), _copy(c), [_copy(g) for g in reduced]
    return value, c, aux, reduced


def _copy(x: Any) -> Any:
    """A tensor's copy (a buffer's for the first step's trial run: the step's own copies
    keep what the eager run wrote; an output a CUDA graph writes again)."""
    return x.clone() if isinstance(x, torch.Tensor) else x


def _module_of(params: ParamGroups, gi: int, name: str, modules: list):
    """The submodule group ``gi`` names in a module ``fs.call`` entered, when every leaf of
    the group lies under it and none is tied to a parameter outside it (a tied head reads
    it there); else None (the group is gathered at the program's start)."""
    if not name:
        return None
    prefix = name + "."
    paths = [params.layouts[i].path for i in params.members[gi]]
    if not all(path.startswith(prefix) for path in paths):
        return None
    for m in modules:
        try:
            sub = m.get_submodule(name)
        except AttributeError:
            continue
        return None if _tied_outside(m, paths, prefix) else sub
    return None


def _tied_outside(root, paths: list, prefix: str) -> bool:
    """Whether a parameter of ``root`` at one of ``paths`` is also held under a name that
    does not start with ``prefix``."""
    names: dict[int, list[str]] = {}
    for n, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for path in paths:
        try:
            p = root.get_parameter(path)
        except AttributeError:
            continue
        if any(not n.startswith(prefix) for n in names.get(id(p), ())):
            return True
    return False
