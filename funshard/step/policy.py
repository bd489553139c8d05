"""``Policy``: what the step does with the parameters, their gradients and the ranks' bytes
(FULL_SHARD or SHARD_GRAD_OP, mixed precision, accumulation, clipping, groups,
checkpointing, the transport), checked when it is made.

    >>> policy = Policy(reshard_after_forward=False, param_dtype=torch.bfloat16, clip_norm=1.0)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from .. import collectives
from ..layout import check_float_dtype, compute_dtype
from . import buffers as buffers_
from . import scaling


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a step shards, casts, accumulates and clips.

    Args:
        reshard_after_forward: True frees each group after its forward use and gathers it
            again in backward (FULL_SHARD: 2 all-gathers + 1 reduce-scatter per group; of
            the group backward starts with, when forward used it last, the leaves backward
            needs first stay gathered and only the rest are gathered again); False keeps
            groups gathered until their backward (SHARD_GRAD_OP: 1 + 1).
        param_dtype: compute dtype for floating parameters (e.g. torch.bfloat16); master
            weights and optimizer state keep the parameters' dtype.
        reduce_dtype: dtype gradients are reduced in (e.g. torch.float32).
        accumulate: micro-batches per step; the batch's dim 0 is split in this many parts and
            gradients are reduced once per step.
        clip_norm: clip the global gradient norm (over all shards, each element once): sugar
            for ``fs.optim.clip_by_global_norm(clip_norm)`` in front of the optimizer.
        groups: communication groups. None: one per repeated block (``layers.0``,
            ``transformer.h.1``, ...: :func:`funshard.step.block_groups`) and one for the
            rest. Or a callable ``fqn -> group name``, or a prefix tree of group names.
            ``fs.list_groups(tree, policy)`` lists what a policy chooses.
        prefetch: gather the next group asynchronously while the current one computes.
        skip_nonfinite: when the global gradient norm is NaN or inf, skip the update on every
            rank (they agree: the norm is all-reduced) and report ``metrics["skipped"] = 1``;
            otherwise such a step raises ``FloatingPointError`` naming the first parameter
            whose gradient is not finite, leaving the state unchanged. True is sugar for
            ``fs.optim.apply_if_finite()`` first in front of the optimizer (a non-finite loss
            counts too); ``metrics["skipped"]`` says whether it dropped the update. A
            skipped step counts in ``state.step`` and in ``state.skipped``, not in the
            optimizer's count (``step - skipped``: Adam's bias correction, the schedules),
            as when torch's GradScaler skips ``optimizer.step()``.
        transport: how buckets move. ``"c10d"`` (default): the backend's collectives (NCCL
            on GPUs, gloo on CPUs). Opt-in, for gloo CPU ranks of one host: ``"p2p"`` (a
            direct exchange over point-to-point sends) and ``"cma"`` (ranks read each
            other's memory with ``process_vm_readv``). Choosing ``"cma"`` lets every process
            of the same user read the trainer's memory (``PR_SET_PTRACER_ANY``, never
            undone); see :mod:`funshard.collectives.base`.
        checkpoint: activation checkpointing per group: True for every group that names a
            submodule of the module ``loss_fn`` calls through :func:`funshard.call` (the
            repeated blocks), or a predicate ``group name -> bool``. The group's module
            forward runs under ``torch.utils.checkpoint`` (non-reentrant); its recompute runs
            when backward reaches the group, which backward gathers anyway: no extra
            all-gather. Needs ``fs.call`` in ``loss_fn``.
        buffers: how the ranks' buffers (``TrainState.buffers``) agree after each step:
            ``"mean"`` over ranks (others: rank 0's), ``"broadcast"`` rank 0's, or ``"own"``
            (each rank its own); see :mod:`funshard.step.buffers`.
        cast_inputs: with ``param_dtype``, :func:`funshard.call` casts the floating-point
            tensors among the module's inputs (args and kwargs, nested) to it, as FSDP2's
            ``MixedPrecisionPolicy(cast_forward_inputs=True)`` casts a module's inputs (float
            inputs into bfloat16 weights would fail otherwise). Integer inputs and
            ``torch.func.functional_call`` are untouched.
        loss_scale: ``"dynamic"`` scales the loss as torch's GradScaler does (for float16
            compute, whose small gradients otherwise round to zero): from 2^16, halved on
            an overflow (that step skipped), doubled after 2000 finite steps; a number is a
            static scale; None (default) none. The step unscales the reduced gradients
            before the metrics, clipping and optimizer ([Note: loss scaling] in
            :mod:`funshard.step.scaling`); ``TrainState.loss_scale`` holds the scale.
        keep_dtype: with ``param_dtype``, a predicate ``fqn -> bool``: the floating leaves
            it selects compute in their own dtype (float32 masters: float32), as FSDP2 users
            give such modules a policy of their own and FSDP1 keeps BatchNorm by default.
            BatchNorm needs it: its running statistics (``TrainState.buffers``) stay float32,
            and ``F.batch_norm`` takes a bfloat16 input with float32 weight, bias and
            statistics, not a bfloat16 weight with float32 statistics (a step given both is
            refused by name). E.g. ``keep_dtype=lambda fqn: ".bn" in fqn``.
    """

    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    accumulate: int = 1
    clip_norm: float | None = None
    groups: Any = None
    prefetch: bool = True
    skip_nonfinite: bool = False
    transport: str = "c10d"
    buffers: str = "mean"
    checkpoint: Any = False
    loss_scale: Any = None
    cast_inputs: bool = True
    keep_dtype: Callable[[str], bool] | None = None

    def __post_init__(self):
        for name in ("reshard_after_forward", "prefetch", "skip_nonfinite", "cast_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Policy: {name}={getattr(self, name)!r} must be True or False")
        if (isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int)
                or self.accumulate < 1):
            raise ValueError(f"Policy: accumulate={self.accumulate!r} must be an int >= 1")
        if self.clip_norm is not None and (
                isinstance(self.clip_norm, bool) or not isinstance(self.clip_norm, (int, float))
                or not 0 < self.clip_norm < math.inf):
            raise ValueError(f"Policy: clip_norm={self.clip_norm!r} must be a number > 0 "
                             "(or None)")
        for name in ("param_dtype", "reduce_dtype"):
            check_float_dtype(getattr(self, name), f"Policy: {name}")
        if not (self.groups is None or callable(self.groups)
                or isinstance(self.groups, (str, dict, list, tuple))):
            raise TypeError(
                f"Policy: groups={self.groups!r:.60} must be None, a callable fqn -> group "
                "name, or a prefix tree (dict / list / tuple) of group names")
        collectives.check_transport(self.transport, where="Policy")
        if not isinstance(self.checkpoint, bool) and not callable(self.checkpoint):
            raise TypeError(f"Policy: checkpoint={self.checkpoint!r} must be True, False or a "
                            "predicate on group names")
        if self.keep_dtype is not None and not callable(self.keep_dtype):
            raise TypeError(f"Policy: keep_dtype={self.keep_dtype!r:.60} must be None or a "
                            "predicate fqn -> bool")
        scaling.check(self.loss_scale)
        if self.buffers not in buffers_.RULES:
            raise ValueError(f"Policy: buffers={self.buffers!r} must be one of "
                             f"{', '.join(map(repr, buffers_.RULES))}")

    def compute_dtype(self, fqn: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype the leaf ``fqn`` of ``dtype`` computes in under this policy."""
        if self.keep_dtype is not None and self.keep_dtype(fqn):
            return dtype
        return compute_dtype(dtype, self.param_dtype)
