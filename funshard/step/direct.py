"""A world of one with nothing to cast: ``loss_fn`` computes on the parameters themselves.

[Note: the direct path]

On one rank, with no cast, no group has anything to gather: a group's full tensors are its
shards. There the step gives ``loss_fn`` autograd leaves on the shards' storage, as a plain
step's parameters are: made once and kept from step to step while the state holds the same
shards (the optimizer updates the shards in place, so the leaves are always current). No
stand-ins, no first use, no saved-tensor hooks, no node of the step's in the graph; each
group is ALIASED from the start (:meth:`Group.alias`), and the run hands the leaves'
``.grad`` to the buckets when backward is done (:meth:`Run.hand_over`), as for any ALIASED
group. Tree structures with a BatchNorm statistic among the parameters keep the stand-ins
(only a stand-in sees batch_norm's unversioned in-place update, and refuses it).

What the stand-ins checked is checked here another way, at a few microseconds a step:

- a write into a parameter inside the step: the leaves' version counters after backward.
  The write has landed in the state by then (as on the ALIASED path; see Group.alias); a
  write into a trainable one under grad is refused by autograd before it lands (its own
  error: the traceback's last line is the write);
- a backward inside ``loss_fn``: a leaf with a ``.grad`` when forward ends
  (:meth:`Run.end_forward`);
- anything done to a leaf that would outlast its step (a gradient from a backward outside
  the step, hooks, ``requires_grad_``, ``.data`` replaced): new leaves are made for the next
  step (:class:`Leaves`), as a stand-in's gathered tensors are new every step;
- a recompute (activation checkpointing) that reads a module's own parameter, or a module
  ``fs.call`` installed twice: :class:`RecomputeGuard`, over every direct backward. It sees
  only the Python-level torch calls made during backward, which a model without
  checkpointing or Python-side backward code does not make.

What needs no check here: a custom autograd Function or other saved-tensor hooks meeting a
parameter first (a leaf is a leaf), and a parameter kept past ``loss_fn`` (it stays on the
shard's memory, so it reads the live values; a later step uses it as it is, or new leaves
if something was done to it).

Why, measured 2026-11-24 (host-bound GPT 8 x 64, seq 8, batch 1, this 2-core CPU, world 1,
median of 8 rounds of 20 steps): 8.3 -> 7.1 ms per step against the plain step's 5.5
(1.50x -> 1.27x); with fused AdamW on both sides, 1.66x -> 1.33x. The stand-ins cost about
60 us per group at first use (gather, alias, bind) and the saved-tensor hooks about 1.5 us
per saved tensor; neither buys anything when nothing is gathered.
"""

from __future__ import annotations

import operator

import torch

from .. import _compat, collectives
from .lazy import in_place_error


def usable(params) -> bool:
    """Whether a step over ``params`` (a :class:`ParamGroups`) takes the direct path."""
    return (collectives.skips(params.data_world) and all(params.uncast) and not params.model
            and not any(params.running_stats))


class Leaves:
    """The direct path's leaves for one :class:`ParamGroups`: one per parameter, on its
    local shard's storage, trainable ones requiring grad. Made again when the state's
    shards are other tensors, and when anything was done to one (a ``.grad``, hooks,
    ``requires_grad``, ``.data`` replaced): what ``loss_fn`` or a caller does to a leaf lasts
    one step, as it does to a stand-in's gathered tensor."""

    def __init__(self):
        self.shards: list = []  # the local shards the leaves alias
        self.leaves: list = []
        self.versions: list[int] = []  # the leaves' version counters when the step began

    def of(self, params, dtensors: list) -> list[torch.Tensor]:
        shards = [_compat.local_tensor(d) for d in dtensors]
        if (len(shards) != len(self.shards) or not all(map(operator.is_, shards, self.shards))
                or not all(map(_intact, self.leaves, shards, params.trainable))):
            self.shards = shards
            self.leaves = [s.detach().requires_grad_(t)
                           for s, t in zip(shards, params.trainable)]
        self.versions = [_compat.version(leaf) for leaf in self.leaves]
        return self.leaves

    def check_unwritten(self, params) -> None:
        """No op wrote into a parameter during the step (forward or backward)."""
        for i, (leaf, v) in enumerate(zip(self.leaves, self.versions)):
            if _compat.version(leaf) != v:
                raise in_place_error(params.layouts[i].path, "an in-place op", landed=True)


def _intact(leaf: torch.Tensor, shard: torch.Tensor, trainable: bool) -> bool:
    """As made: no gradient, no hooks, the same requires_grad, still on the shard's memory
    (about 0.25 us)."""
    return (leaf.grad is None and leaf.requires_grad is trainable and not _compat.tensor_hooks(leaf)
            and not getattr(leaf, "_post_accumulate_grad_hooks", None)
            and leaf.data_ptr() == shard.data_ptr())
