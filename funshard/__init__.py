"""funshard: fully-sharded data parallelism for PyTorch as pure functions over pytrees.

    >>> import funshard as fs
    >>> mesh = fs.make_mesh(shard=2)
    >>> sparams = fs.shard(fs.params(model), mesh)
    >>> full = fs.unshard(sparams)
"""

from . import checkpoint, comm, layout, mesh, optim, pytree, step
from .comm import CollectiveTimeout
from .mesh import make_mesh
from .pytree import params
from .reduce import reduce_grads
from .shard import reshard, shard, unshard
from .state_dict import load_state_dict, state_dict
from .step import Policy, TrainState, TrainStep, train_step

__all__ = [
    "CollectiveTimeout",
    "Policy",
    "TrainState",
    "TrainStep",
    "checkpoint",
    "comm",
    "layout",
    "load_state_dict",
    "make_mesh",
    "mesh",
    "optim",
    "params",
    "pytree",
    "reduce_grads",
    "reshard",
    "shard",
    "state_dict",
    "step",
    "train_step",
    "unshard",
]
