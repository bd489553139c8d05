"""Forward without training: ``eval_step(fn, policy=Policy())``.

``fn(params, *args)`` runs on a sharded tree under the training step's gather schedule: each
group is gathered when ``fn`` first touches it and freed once ``fn`` moves to the next
(``reshard_after_forward=True``, the default: the FULL_SHARD forward peak, one group and the
next one's prefetch), with no gradient state: no autograd graph, no reduce buckets, no
optimizer. Validation, generation or any metric of the parameters goes through it.

    >>> evaluate = fs.eval_step(lambda p, x: torch.func.functional_call(model, p, (x,)))
    >>> logits = evaluate(state.params, tokens)          # every rank calls it

Every rank must call it with the same groups in the same order (as the training step). A
function that touches a group again later (a generation loop calling the model once per
token) gathers it again each time; ``Policy(reshard_after_forward=False)`` keeps each group
gathered from its first use to the end of the call instead (faster, the unsharded peak).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .. import _compat, collectives, pytree
from . import buffers as buffers_
from . import lazy
from .api import TrainState
from .policy import Policy
from .call import casting
from .params import ParamGroups
from .run import Run

Tree = Any


class EvalStep(NamedTuple):
    """``evaluate(params, *args, **kwargs) -> fn(full-shape params, *args, **kwargs)``."""

    apply: Callable[..., Any]

    def __call__(self, params: Tree, *args: Any, **kwargs: Any) -> Any:
        return self.apply(params, *args, **kwargs)


def eval_step(fn: Callable, *, policy: Policy = Policy(), compile: Any = False) -> EvalStep:
    """Run ``fn(params, *args)`` on sharded ``params`` one group at a time, without gradients.

    Args:
        fn: ``(params, *args, **kwargs) -> anything``; ``params`` has full shapes and the
            policy's compute dtype. What it returns must not be a parameter itself (a
            parameter exists only while ``fn`` runs); tensors computed from them are plain.
        policy: :class:`Policy`: ``groups``, ``param_dtype``, ``reshard_after_forward``,
            ``prefetch`` and ``transport`` apply; the gradient options are ignored.
        compile: as ``train_step``'s: True (or a dict of ``torch.compile``'s options)
            traces ``fn`` and every group's all-gather into one compiled program per
            signature of the arguments, after one eager call that learns the modules
            ``fn`` enters through ``fs.call`` (see :mod:`funshard.step.compiled`).
    Returns:
        :class:`EvalStep`; ``out = evaluate(state.params, batch)``, or ``evaluate(state,
        batch)``: then a state with buffers gives ``fn`` ``(params, buffers)`` as the
        training step gives ``loss_fn`` (copies: what ``fn`` writes into them is not kept).
        Results are computed under ``torch.no_grad()``.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"eval_step: policy must be an fs.Policy, got {type(policy).__name__}")
    _compat.require_eager("eval_step")
    cache: dict[Any, ParamGroups] = {}
    compiled = None
    if compile is not False:
        from .compiled import Compiled  # torch.compile's machinery only when asked for

        compiled = Compiled(fn, policy, compile, train=False)

    def groups_for(params: Tree) -> ParamGroups:
        leaves, spec = pytree.flatten(params)
        key = (spec, getattr(leaves[0], "device_mesh", None) if leaves else None)
        if key not in cache or not all(isinstance(x, DTensor) for x in leaves):
            cache[key] = ParamGroups(params, policy)
        return cache[key]

    def apply(params: Tree, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():  # as under no_grad: the step's own tensors
            with torch.inference_mode(False):  # keep version counters (inputs may not)
                return apply(params, *args, **kwargs)
        collectives.failures.in_step()  # see [Note: a rank out of step]
        bufs = None
        if isinstance(params, TrainState):
            if params.buffers is not None:  # fn((params, buffers), ...), as loss_fn
                bufs = buffers_.locals_of(params.buffers)[2]  # copies: nothing is kept
            params = params.params
        groups = groups_for(params)
        if bufs is not None:
            buffers_.check_dtypes(groups, bufs, where="eval_step")
        leaves = pytree.flatten(params)[0]
        if compiled is not None:
            groups.refuse_compiled("eval_step")
            return compiled.evaluate(groups, leaves, bufs, args, kwargs,
                                     lambda: _eager(fn, policy, groups, leaves, bufs, args,
                                                    kwargs))
        return _eager(fn, policy, groups, leaves, bufs, args, kwargs)

    return EvalStep(apply)


def _eager(fn: Callable, policy: Policy, groups: ParamGroups, leaves: list, bufs: Any,
           args: tuple, kwargs: dict) -> Any:
    """``fn`` on stand-ins that gather their groups as it reaches them."""
    shards = [_compat.local_tensor(d).detach() for d in leaves]
    run = Run(groups, shards, policy, {}, accumulating=False, sync=False,
              record=groups.schedule is None,  # the first call learns the order
              streams=False)  # no gradients: nothing is streamed to a bucket
    stands = lazy.stand_ins(run, groups, shards, requires_grad=False)
    tree = pytree.unflatten(groups.spec, stands)
    if bufs is not None:
        tree = (tree, bufs)
    try:
        with torch.no_grad(), casting(policy):
            return fn(tree, *args, **kwargs)
    finally:
        run.finish()
        run.release()
