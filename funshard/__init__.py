"""funshard: fully-sharded data parallelism for PyTorch as pure functions over pytrees.

    >>> import funshard as fs
    >>> mesh = fs.make_mesh(shard=2)
    >>> sparams = fs.shard(fs.params(model), mesh)
    >>> full = fs.unshard(sparams)
"""

from . import checkpoint, collectives, optim, pytree
from .state_dict import load_state_dict, state_dict
from .collectives import reduce_grads
from .pytree import params
from .shard import make_mesh, reshard, shard, unshard
from .step import Policy, TrainState, TrainStep, train_step

__all__ = [
    "Policy",
    "TrainState",
    "TrainStep",
    "checkpoint",
    "collectives",
    "load_state_dict",
    "make_mesh",
    "optim",
    "params",
    "pytree",
    "reduce_grads",
    "reshard",
    "shard",
    "state_dict",
    "train_step",
    "unshard",
]
