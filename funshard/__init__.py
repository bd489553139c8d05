"""funshard: fully-sharded data parallelism for PyTorch as pure functions over pytrees.

    >>> import funshard as fs
    >>> mesh = fs.make_mesh(shard=2)
    >>> sparams = fs.shard(fs.params(model), mesh)
    >>> full = fs.unshard(sparams)
"""

__version__ = "0.2.0"

from . import checkpoint, collectives, layout, mesh, optim, plan, pytree, step, testing
from .collectives import (CollectiveRefused, CollectiveTimeout, OutOfStep, PeerLost,
                          RankFailed)
from .mesh import make_mesh
from .pytree import buffers, params
from .reduce import reduce_grads
from .shard import reshard, shard, unshard
from .state_dict import load_state_dict, state_dict
from .step import (EvalStep, LossScale, Mean, MicroBatches, Policy, call, TrainState,
                   TrainStep, eval_step, list_groups, train_step)

__all__ = [
    "__version__",
    "CollectiveRefused",
    "CollectiveTimeout",
    "EvalStep",
    "LossScale",
    "Mean",
    "MicroBatches",
    "OutOfStep",
    "PeerLost",
    "Policy",
    "RankFailed",
    "TrainState",
    "TrainStep",
    "buffers",
    "call",
    "checkpoint",
    "collectives",
    "eval_step",
    "layout",
    "list_groups",
    "load_state_dict",
    "make_mesh",
    "mesh",
    "optim",
    "params",
    "plan",
    "pytree",
    "reduce_grads",
    "reshard",
    "shard",
    "state_dict",
    "step",
    "testing",
    "train_step",
    "unshard",
]
