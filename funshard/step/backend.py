"""The compiled step's ``torch.compile`` backend: the caller's (inductor unless named, with
its ``mode`` and ``options``), given dynamo's graph after one pass over it.

[Note: a model's own checkpoint regions] A model that checkpoints its own activations
(``torch.utils.checkpoint`` in its forward, Hugging Face's ``gradient_checkpointing_enable``)
becomes, under dynamo, a region whose every op is recomputed in backward. In the step's one
program (the loss and its gradients in one graph), AOTAutograd's pass that recomputes
regions refuses a random op there (dropout; ``scaled_dot_product_attention``, tagged random
even without dropout): it cannot draw the same numbers twice. The step's own regions keep
random draws from forward (:func:`funshard.step.program.context_fn`); this pass gives the
model's regions that carry no rule of their own the same one: every op recomputed as
before, random draws saved. The numbers are the forward's, as an eager recompute that
restores the random state gives them; the saved draws cost their memory until backward.
A region with its own ``context_fn`` is left as it is.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import _compat
from . import overlap


def _keep_random(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """A model's own region: recompute every op but the random draws."""
    if torch.Tag.nondeterministic_seeded in op.tags:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


KEEP_RANDOM = functools.partial(create_selective_checkpoint_contexts, _keep_random)


def keep_random_draws(gm: fx.GraphModule) -> fx.GraphModule:
    """Each checkpoint region in ``gm`` (nested ones too) without a rule gets
    :data:`KEEP_RANDOM`."""
    for mod in list(gm.modules()):
        if not isinstance(mod, fx.GraphModule):
            continue
        for node in mod.graph.nodes:
            if node.op == "call_function" and node.target is _compat.CHECKPOINT_OP:
                body = getattr(mod, node.args[0].target)
                body.meta.setdefault(_compat.CHECKPOINT_CONTEXT, KEEP_RANDOM)
    return gm


class Backend:
    """``torch.compile``'s backend for ``backend``, ``mode``, ``options`` and ``dynamic`` (as
    ``torch.compile`` makes it), after :func:`keep_random_draws`."""

    def __init__(self, backend="inductor", mode=None, options=None, dynamic=None):
        self.inner = (_compat.INDUCTOR_BACKEND(mode, options, dynamic)
                      if backend == "inductor" else
                      _compat.OTHER_BACKEND(backend, mode, options, dynamic))
        self.inductor = backend == "inductor"
        self.compiler_name = getattr(self.inner, "compiler_name", "funshard")

    def __call__(self, gm: fx.GraphModule, example_inputs, **kwargs):
        gm = keep_random_draws(gm)
        if not self.inductor:
            return self.inner(gm, example_inputs, **kwargs)
        with _compat.inductor_patch(overlap.OPTIONS):  # (the caller's own options: inside)
            return self.inner(gm, example_inputs, **kwargs)

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()

    def get_compiler_config(self):
        get = getattr(self.inner, "get_compiler_config", None)
        return get() if get is not None else None


def fresh(fn: Callable, name: str) -> Callable:
    """``fn`` under a code object of its own named ``name``: dynamo's cache is per code
    object, so each such function is compiled and guarded on its own."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name)


def compile_options(options: dict) -> dict:
    """``torch.compile``'s keywords for the program: ``options`` (``backend``, ``mode``,
    ``options``, ``dynamic``) with the backend made a :class:`Backend`."""
    rest = {k: v for k, v in options.items() if k not in ("backend", "mode", "options")}
    return {**rest, "backend": Backend(options.get("backend", "inductor"),
                                       options.get("mode"), options.get("options"),
                                       options.get("dynamic"))}
