"""The sharded training step: ``train_step(loss_fn, optimizer, policy=Policy())``.

- :mod:`.policy`: Policy; :mod:`.api`: TrainState, TrainStep, train_step;
  :mod:`.evaluate`: eval_step (forward only, the same gather schedule);
- :mod:`.schedule`: the order groups are gathered, freed and reduced (pure data, shared
  with ``fs.plan``); :mod:`.params`: a tree's leaves in communication groups;
- :mod:`.group`: a group's states and their allowed transitions ([Note: a group's life]);
- :mod:`.lazy`: the parameter stand-in; :mod:`.saved`: autograd's saved parameters;
- :mod:`.call`: fs.call, functional_call whose parameters last until backward ends;
  :mod:`.install`: what fs.call puts in a module, from a plan cached per module;
  :mod:`.recompute`: activation checkpointing inside loss_fn; :mod:`.donation`: a used-up
  state raises;
- :mod:`.buffers`: buffers in the state and their cross-rank rules; :mod:`.scaling`: loss
  scaling for float16 (LossScale);
- :mod:`.grads`: gradient buckets and reductions; :mod:`.run`: one micro-batch's driver;
  :mod:`.loss`: what loss_fn returns; :mod:`.batches`: micro-batches.
"""

from .api import TrainState, TrainStep, train_step
from .batches import MicroBatches
from .call import call
from .evaluate import EvalStep, eval_step
from .group import ALLOWED, Group, GroupState, IllegalTransition
from .loss import Mean
from .params import ParamGroups
from .policy import Policy
from .run import Run
from .scaling import LossScale
from .schedule import (GroupInfo, Schedule, block_groups, default_group, group_names,
                       kept_into_backward, list_groups, make_schedule, partition, split_kept)

__all__ = [
    "ALLOWED",
    "EvalStep",
    "Group",
    "GroupInfo",
    "GroupState",
    "IllegalTransition",
    "LossScale",
    "Mean",
    "MicroBatches",
    "ParamGroups",
    "Policy",
    "Run",
    "Schedule",
    "TrainState",
    "TrainStep",
    "block_groups",
    "call",
    "default_group",
    "eval_step",
    "group_names",
    "kept_into_backward",
    "list_groups",
    "make_schedule",
    "partition",
    "split_kept",
    "train_step",
]
