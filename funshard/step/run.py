"""One micro-batch's forward and backward: which groups are resident, and when they move.

The run follows the step's :class:`Schedule` (once learned): it prefetches the next group
in forward's order, keeps the schedule's group into backward, prefetches in backward once
the group before is half consumed, and hands each group's gradients to its reduction when
backward is done with it. Group states change only through :class:`Group`'s methods.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .. import _compat, collectives
from ..layout import as_model
from . import lazy, recompute
from .grads import Reductions
from .group import Group, S
from .install import Installations
from .params import ParamGroups
from .saved import SavedParams
from .schedule import make_schedule

# the run whose loss_fn is executing (fs.call installs parameters into it; see .call)
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("funshard_run", default=None)


class Run:
    """State of one micro-batch: its groups, the order it met them, its reductions."""

    @staticmethod
    def current() -> "Run | None":
        return _CURRENT.get()

    def __init__(self, params: ParamGroups, shards: list, policy, buckets: dict,
                 accumulating: bool, sync: bool, record: bool, direct: bool = False,
                 used: set | None = None, streams: bool = True):
        self.params, self.shards, self.policy = params, shards, policy
        self.sync, self.record = sync, record
        self.direct = direct  # shards are the leaves loss_fn gets: see .direct
        # large gradients streamed to their buckets (lazy.Tap); ``streams``: there are some
        self.tapped = streams and not collectives.skips(params.data_world)
        self.storage: dict[int, tuple[Group, int]] = {}  # storage data_ptr -> (group, leaf)
        self.groups = [Group(gi, params, shards, self.storage, policy.transport)
                       for gi in range(len(params.members))]
        # ``used``: the leaves given a gradient, shared by a step's micro-batches
        self.grads = Reductions(params, policy, buckets, accumulating,
                                set() if used is None else used)
        self.saved = SavedParams(self)
        self.active: list[int] = []  # groups the latest op (or autograd node) uses
        self.backward = False
        self.seen: dict[bool, list[int]] = {False: [], True: []}  # gathered, per phase
        self.in_order = {False: True, True: True}  # seen so far == the schedule's order
        self.peak_groups = 0  # most groups gathered or in flight at once
        self.peak_bytes = 0  # their full-size bytes
        self.stand_group: dict[int, tuple] = {}  # id of a stand-in -> (group, leaf)
        # activation checkpointing (see [Note: recomputation] in .recompute)
        self.recompute: tuple = (None, {})  # (autograd node recomputing, its leaves)
        self.calls = Installations()  # fs.call's, undone at finish
        self.checkpointing = False  # a region outside them met a stand-in (recompute.backward)

    @property
    def kept(self) -> int | None:
        s = self.params.schedule
        return s.kept if s is not None else None

    def order(self, backward: bool) -> tuple[int, ...] | None:
        s = self.params.schedule
        return None if s is None else (s.backward if backward else s.forward)

    def gather(self, group: Group) -> tuple:
        fulls = group.gather()
        self.note_peak()
        return fulls

    # -- what the modules around a run read of it -----------------------------------------

    def group(self, gi: int) -> Group:
        return self.groups[gi]

    def all_groups(self) -> list[Group]:
        return self.groups

    def gathers(self) -> bool:
        """Whether some group holds gathered storage."""
        return bool(self.storage)

    def gathered_at(self, ptr: int) -> tuple | None:
        """``(group, leaf)`` whose gathered storage starts at data pointer ``ptr``, or None."""
        return self.storage.get(ptr)

    def in_backward(self) -> bool:
        """Whether forward has ended (a forward op now is a recompute)."""
        return self.backward

    def is_direct(self) -> bool:
        """Whether ``loss_fn`` gets the shards themselves ([Note: the direct path])."""
        return self.direct

    def shard(self, i: int) -> torch.Tensor:
        return self.shards[i]

    def shard_ids(self) -> set[int]:
        """The ids of the run's shards (the leaves Gather takes, or the direct path's)."""
        return {id(t) for t in self.shards}

    def installations(self) -> Installations:
        """``fs.call``'s installations in this run (undone when it finishes)."""
        return self.calls

    def hooks(self):
        """The step's saved-tensor hooks around ``loss_fn`` (:meth:`SavedParams.hooks`)."""
        return self.saved.hooks()

    def foreign_hooks(self):
        """The caller's saved-tensor hooks on top of autograd's stack, or None."""
        return self.saved.foreign_top()

    def adopt_hooks(self, top) -> bool:
        """The step's hooks put over the caller's ``top`` (:meth:`SavedParams.adopt`)."""
        return self.saved.adopt(top)

    def set_stand_ins(self, stands: list, group_of: list, pos: list) -> None:
        """``loss_fn``'s stand-ins, one per leaf (leaf ``i``: leaf ``pos[i]`` of group
        ``group_of[i]``), known to their groups."""
        self.stand_group = {id(x): (group_of[i], pos[i]) for i, x in enumerate(stands)}
        for g in self.groups:
            g.stands = [stands[i] for i in g.idx]

    def stand_in_of(self, t) -> tuple:
        """``(group, leaf)`` of ``t`` if it is one of this run's stand-ins, else ``(None,
        None)``."""
        return self.stand_group.get(id(t), (None, None))

    def has_stand_ins(self) -> bool:
        return bool(self.stand_group)

    def put_grad(self, group: Group, k: int, grad: torch.Tensor) -> None:
        """Leaf ``k`` of ``group``'s gradient for this micro-batch, complete (a Tap's)."""
        self.grads.put(group, k, grad)

    def streams(self) -> bool:
        """Whether large gradients stream to their buckets (:class:`lazy.Tap`)."""
        return self.tapped

    def recording(self) -> bool:
        """Whether this run learns the step's schedule."""
        return self.record

    def peaks(self) -> tuple[int, int]:
        """The most groups gathered or in flight at once, and the most bytes they held."""
        return self.peak_groups, self.peak_bytes

    def order_seen(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The groups in the order forward gathered them, and backward."""
        return tuple(self.seen[False]), tuple(self.seen[True])

    def hold(self, gi: int) -> None:
        """Group ``gi`` is the latest op's again (its module returned): freed when an op
        gathers another group (FULL_SHARD), kept into backward if none does."""
        if gi not in self.active:
            self.active.append(gi)

    def note_region(self) -> None:
        """A stand-in's op outside fs.call's module calls: backward guards its recompute
        if it runs in a checkpoint region (:func:`recompute.backward`)."""
        if not (self.checkpointing or self.calls.in_call()):
            self.checkpointing = recompute.in_region()

    def guarded(self) -> bool:
        """Whether a recompute in backward could read what the step did not give it (see
        :func:`recompute.backward`)."""
        return self.direct or self.checkpointing or bool(self.calls.twice())

    def note_peak(self) -> None:
        live = [g for g in self.groups if g.resident or g.pending is not None]
        self.peak_groups = max(self.peak_groups, len(live))
        nbytes = sum(g.held if g.resident else self.params.group_bytes[g.gi] for g in live)
        self.peak_bytes = max(self.peak_bytes, nbytes)

    def use(self, gis: list[int], *, new_op: bool) -> None:
        """Make the groups one op needs resident; free the previous op's other groups.

        ``new_op``: this call starts a new op (forward: every torch function; backward: a
        new autograd node). Groups the same op needs are never freed under it.
        """
        if new_op:
            stale = [g for g in self.active if g not in gis]
            self.active = list(dict.fromkeys(gis))
            if self.backward or self.policy.reshard_after_forward:
                for g in stale:  # a group whose module runs stays (call.leave_module hands it back)
                    if self.backward or (g != self.kept and not self.calls.within(g)):
                        self.groups[g].free()
        else:
            self.active.extend(g for g in gis if g not in self.active)
        for gi in dict.fromkeys(gis):
            group = self.groups[gi]
            if group.resident:
                continue
            self._note_seen(gi)
            if group.fulls is None:  # first use in this micro-batch: enters autograd here
                lazy.enter(self, group)
            else:
                if self.backward:
                    # The group backward reaches next: the previous group's reduce-scatter
                    # (launched as its backward ended) is finished first, so its input is
                    # not alive under this group's first node, where memory peaks.
                    self.grads.finish_reduce_scatter()
                self.gather(group)
            if not self.backward:  # the next group's gather overlaps this group's forward
                self._prefetch()

    def _note_seen(self, gi: int) -> None:
        seen, order = self.seen[self.backward], self.order(self.backward)
        seen.append(gi)
        if not order or len(seen) > len(order) or order[len(seen) - 1] != gi:
            self.in_order[self.backward] = False  # diverged from the schedule

    def _prefetch(self) -> None:
        """Start gathering the group the schedule has next, if this run follows it."""
        if (not self.policy.prefetch or collectives.skips(self.params.data_world)
                or not self.in_order[self.backward]):
            return
        order, seen = self.order(self.backward), self.seen[self.backward]
        if not order or len(seen) >= len(order):
            return
        g = self.groups[order[len(seen)]]
        if g.state is S.SHARDED and (not self.backward or g.fulls is not None):
            g.prefetch()
            self.note_peak()

    def prefetch_after(self, group: Group) -> None:
        """Backward is mostly done with ``group``: prefetch the leaves it owes, else the
        group the schedule has next, if ``group`` is the one before it there."""
        if group.to_regather:
            if group.state is S.PARTIAL and self.policy.prefetch:
                group.prefetch_regather()
            return
        if group.next_prefetched:
            return
        group.next_prefetched = True
        s, j = self.params.schedule, len(self.seen[True])
        if s is not None and j < len(s.backward):
            before = s.before_backward(j)
            if before is None or before == group.gi:
                self._prefetch()

    def backward_done(self, group: Group, grads: tuple) -> None:
        """Backward is done with ``group``: reduce its gradients (after the last micro-batch)."""
        # Free the group's parameters and move the previous group's reduction on (it had this
        # group's whole backward to complete): its reduce-scatter is finished (freeing its
        # input) and, on a 2-D mesh, its "replicate" all-reduce launched, to be finished
        # after the next group's backward. So each stage overlaps a group's backward.
        if not self.backward:
            raise recompute.backward_in_forward(f"group {group.name!r}")
        if group.ended:
            raise recompute.ended_twice(group)
        group.ended = True
        group.free()
        self.grads.wait(keep_newest=1)
        self.prefetch_after(group)  # if unpacking did not already
        pos = self.params.grad_pos[group.gi]  # a tapped leaf gives None here: its Tap put it
        grads = list(grads)
        lazy.taken(group, grads)
        self.grads.put_all(group, [(k, grads[k]) for k in pos if grads[k] is not None])
        if self.sync and pos:
            self.grads.launch(group)

    @contextlib.contextmanager
    def running(self):
        """This run is :meth:`current` while ``loss_fn`` runs."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def model_view(self, gi: int, k: int, full: torch.Tensor) -> torch.Tensor:
        """Leaf ``k`` of group ``gi``'s gathered tensor as the model takes it: on a mesh with
        the model's own dimensions, a DTensor there for a leaf the model places on them
        (:func:`funshard.layout.as_model`; its backward reduces the model's own pending
        gradients), else ``full``. Under grad mode always: a recompute asks for it under
        no_grad (the step's own work is not recomputed), and its ops must save what the
        first pass's did."""
        if not self.params.model:
            return full
        with torch.enable_grad():
            return as_model(full, self.params.layouts[self.params.members[gi][k]])

    def recompute_leaf(self, gi: int, k: int) -> torch.Tensor:
        """Leaf ``k`` of group ``gi`` for a forward recomputed in backward (activation
        checkpointing): the group's gathered tensor, which the group then lets go of, so
        that the recompute's saved tensors own its storage and no free resizes it under
        them. One tensor per leaf per recomputing node."""
        node = _compat.current_autograd_node()
        if self.recompute[0] is not node:
            self.recompute = (node, {})
        got = self.recompute[1]
        t = got.get((gi, k))
        if t is None:
            group = self.groups[gi]
            if (group.ended and self.params.trainable[group.idx[k]]
                    and type(node).__name__ == "CheckpointFunctionBackward"):
                # a reentrant region's gradients would come after the group's hand-off
                raise recompute.ended_twice(group)
            if group.fulls[k] is None:  # an earlier recompute took it: gather again
                group.free()
                self.use([gi], new_op=False)
            elif k in group.to_regather:
                group.regather()
            t = group.fulls[k]
            if self.params.trainable[group.idx[k]] and not t.requires_grad:
                # gathered afresh (an earlier recompute took the first): as its forward saw
                # it, it requires grad, or the recompute's ops save fewer tensors
                t = t.detach().requires_grad_()
            got[(gi, k)] = t
            group.release_leaf(k)
        return t

    def end_forward(self) -> None:
        for g in self.groups:  # an ALIASED group's leaves take no gradient before backward
            if g.state is S.ALIASED and any(g.fulls[k].grad is not None
                                            for k in self.params.grad_pos[g.gi]):
                raise recompute.backward_in_forward(f"group {g.name!r}")
        self.backward = True
        # ``active`` holds the groups of forward's last op on a stand-in (or last module);
        # backward's first node frees nothing as "the previous op's".
        active, self.active = self.active, []
        if not self.policy.reshard_after_forward:
            return
        kept = self.kept  # keep only the group backward starts with (and the last op's)
        for g in self.groups:
            if g.gi not in active and g.gi != kept:
                g.free()
        late = self.params.schedule.kept_late if kept is not None else ()
        if late and self.groups[kept].state is S.GATHERED:
            self.groups[kept].free_leaves(list(late))

    def start_direct(self) -> list:
        """Every group ALIASED on the run's shards, which ``loss_fn`` gets as they are
        (see [Note: the direct path] in :mod:`.direct`)."""
        for g in self.groups:
            g.alias(given=True)
        return self.shards

    def hand_over(self, group: Group) -> None:
        """Backward is done with an ALIASED group (:meth:`Group.alias`): its leaves'
        gradients go to its bucket as :meth:`backward_done` puts a gathered group's."""
        group.ended = True
        grads = [group.fulls[k].grad for k in range(len(group.idx))]
        lazy.taken(group, grads)
        got = [(k, g) for k in self.params.grad_pos[group.gi] if (g := grads[k]) is not None]
        for k, _ in got:  # the bucket has it (the direct path's leaves outlive the step)
            group.fulls[k].grad = None
        if got:
            self.grads.put_all(group, got)
            if self.sync:
                self.grads.launch(group)

    def finish(self) -> None:
        self.calls.undo()
        for g in self.groups:
            if g.state is S.ALIASED:
                self.hand_over(g)
        self.grads.wait()
        self.saved.prefetch_when_done = None
        for g in self.groups:
            g.finish_gather()  # a prefetch nobody used
            g.pinned = False
            g.free()
        if self.record:
            p = self.params

            def kept_leaves(g: int):
                return (self.groups[g].sharded, self.saved.first_unpack.get(g, []),
                        [p.leaf_bytes(i) for i in p.members[g]])

            p.schedule = make_schedule(self.seen[False], self.seen[True],
                                       reshard_after_forward=self.policy.reshard_after_forward,
                                       kept_leaves=kept_leaves,
                                       gathers=not collectives.skips(p.world))

    def release(self) -> None:
        """Drop every tensor this run holds (see [Note: a group's life])."""
        for g in self.groups:
            g.release()
        self.storage.clear()
        self.grads.release()
        self.saved.release()
        self.recompute = (None, {})  # its autograd node reaches every ctx, and so this run
        self.calls.release()
        self.shards = []
