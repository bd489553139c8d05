"""What a step knows of one tree structure: its leaves in communication groups.

Built once per tree structure and mesh (like a jit cache entry); the :class:`Schedule` is
added after the first step has shown the order the groups are used in.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import pytree
from ..layout import describe, spread_of
from ..mesh import data_size, mesh_device, mesh_str
from ..optim.base import flatten as optim_flatten
from ..reduce import norm_weights
from .buffers import STATS
from .direct import Leaves
from .schedule import Schedule, group_names, partition


TAP_BYTES = 1 << 20  # a gradient this large or larger streams (see [Note: streamed gradients])


class ParamGroups:
    """One tree's leaves partitioned into communication groups, with layouts and dtypes.

    ``members[g]``: leaf indices of group ``g``; ``group_of[i]`` / ``pos[i]``: leaf ``i``'s
    group and its position in it; ``grad_pos[g]``: positions of ``g``'s trainable leaves
    (whose gradients are reduced) and ``slot[g][k]`` the index of position ``k`` among them.
    """

    def __init__(self, params: Any, policy):
        mesh, paths, leaves, layouts, spec = describe(params, what="train_step", model=True)
        self.mesh, self.spec, self.layouts = mesh, spec, layouts
        names = [pytree.fqn(p) for p in paths]
        self.names, self.members = partition(
            group_names(names, policy.groups, params, [lay.shape for lay in layouts]))
        self.group_of = [0] * len(leaves)
        self.pos = [0] * len(leaves)  # index within its group
        for gi, idx in enumerate(self.members):
            for k, i in enumerate(idx):
                self.group_of[i], self.pos[i] = gi, k
        self.trainable = [bool(leaf.requires_grad) for leaf in leaves]
        self.grad_pos = [[k for k, i in enumerate(idx) if self.trainable[i]]
                         for idx in self.members]
        self.slot = [{k: j for j, k in enumerate(pos)} for pos in self.grad_pos]
        # running statistics put into the sharded tree stay stand-ins in their module's call:
        # batch_norm writes them in place without a version bump, so only the stand-in can
        # see (and refuse) it
        self.running_stats = [{k for k, i in enumerate(idx)
                               if names[i].rsplit(".", 1)[-1] in STATS}
                              for idx in self.members]
        self.dtypes = [policy.compute_dtype(n, leaf.dtype) for n, leaf in zip(names, leaves)]
        # every rank of the mesh (the metrics' all-reduce), and the ranks that gather and
        # reduce a leaf: the data-parallel ones (the model's own dimensions hold its parts)
        self.world, self.data_world = mesh.size(), data_size(mesh)
        self.model = any(lay.model is not None for lay in layouts)  # leaves the model places
        # per leaf: the model's dimensions over which it is reduced too ("ep": not an expert)
        self.spreads = [spread_of(leaf) for leaf in leaves]
        # per group: no leaf is cast (on a world of one its shards are its full tensors)
        self.uncast = [all(self.dtypes[i] == leaves[i].dtype for i in idx)
                       for idx in self.members]
        # where this rank's shards live: everything the step makes goes there
        self.device = leaves[0].device if leaves else mesh_device(mesh)
        self.norm_weight = norm_weights(layouts, mesh)
        self.group_bytes = [sum(self.leaf_bytes(i) for i in idx if layouts[i].sharded)
                            for idx in self.members]
        # per group: the trainable leaves whose gradients stream to the bucket through
        # their own node (see [Note: streamed gradients] in .lazy)
        self.tap_pos = [[k for k in pos if self.leaf_bytes(idx[k]) >= TAP_BYTES]
                        for idx, pos in zip(self.members, self.grad_pos)]
        self.schedule: Schedule | None = None  # learned on the first step
        self.linted = False  # a step's loss was seen to reach only these parameters
        self._consts: dict = {}  # see on_device
        self.leaves = Leaves()  # the direct path's (see .direct)
        # each leaf's position in fs.optim's order (optree's: a dict's keys sorted), where
        # an update's counts are; the step's own order is the tree's (a dict's as inserted)
        order = optim_flatten(pytree.unflatten(spec, list(range(len(leaves)))))[1]
        self.optim_pos = [0] * len(leaves)
        for k, i in enumerate(order):
            self.optim_pos[i] = k
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"train_step: the mesh {mesh_str(mesh)} has {mesh.size()} ranks but "
                f"the world has {dist.get_world_size()}; build it with fs.make_mesh()."
            )

    def refuse_compiled(self, what: str) -> None:
        """``compile=True`` on a mesh with the model's own dimensions: not traced (yet)."""
        if self.model:
            raise NotImplementedError(
                f"{what}(compile=True): the mesh {mesh_str(self.mesh)} has the model's own "
                "dimensions, whose DTensors the compiled step does not trace; use the eager "
                "step (compile=False), with the model's blocks compiled (block.compile(), as "
                "torchtitan compiles them).")

    def on_device(self, key: Any, dtype: torch.dtype, values: Callable[[], list]) -> torch.Tensor:
        """A constant tensor of the step (``values()``, on this rank's device), made the first
        time ``key`` is asked for: no host-to-device copy per step. A few keys per tree (the
        norm weights of the leaves with gradients, the groups' order), so a small dict."""
        t = self._consts.get(key)
        if t is None:
            if len(self._consts) >= 64:  # keys that change every step: keep the newest
                self._consts.clear()
            t = self._consts[key] = torch.tensor(values(), dtype=dtype, device=self.device)
        return t

    def leaf_bytes(self, i: int) -> int:
        """Full (padded) bytes of leaf ``i`` in its compute dtype."""
        return self.layouts[i].full_bytes(self.dtypes[i])
