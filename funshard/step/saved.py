"""Autograd's saved copies of gathered parameters: counted when saved, gathered again when
backward unpacks them, let go after their last use.

``pack`` tags a saved tensor whose storage belongs to a gathered group as
``(group, leaf, tensor)`` and counts it; ``unpack`` makes the group resident again (its
freed storage is refilled in place), and when a leaf's last saved copy is unpacked drops
the group's reference to it. Once half a group is consumed (a PARTIAL group: once the rest
is), and the node consuming it has finished, the run prefetches what backward needs next.
See [Note: a group's life] in :mod:`funshard.step.group`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .. import _compat
from .group import S
from .lazy import LazyParam, untraced

# torch's stack of saved-tensor hooks (private: funshard._compat)
_TOP, _PUSH, _POP = _compat.top_saved_hooks, _compat.push_saved_hooks, _compat.pop_saved_hooks

# [Note: hooks beneath the step's]
#
# Autograd calls only the saved-tensor hooks on top of its stack. A caller's own hooks
# (torch.autograd.graph.save_on_cpu, an activation-offloading context) around the model
# would take the gathered parameters the step frees and gathers again, and the step's
# around loss_fn would hide the caller's activations from them. So the two compose: where
# the caller's hooks are on top when the step begins, or when a parameter is first used
# under them, the step puts :class:`Beneath` in their place (their context's exit pops it).
# A tensor on a gathered group's storage is the step's (gathered again for backward, never
# copied); every other tensor goes to the caller's hooks, as it would without funshard. A
# group resident when the caller's hooks are taken over may have been saved by them
# already (by ops inside its module's call, which the step does not see): it stays resident
# until its backward is done. Not covered: the caller's hooks entered inside a group
# module's forward and left before any op on a stand-in under them, which keep that
# group's parameter (itself, or a view) rather than a copy: backward then reads freed
# storage (an error, not a wrong gradient). The other way, FSDP2's (the caller's hooks
# take everything: save_on_cpu copies each gathered parameter to the host and back), moves
# a parameter's bytes over PCIe twice per use where the step gathers it again once.


class SavedParams:
    """The saved-tensor hooks of one run (``torch.autograd.graph.saved_tensors_hooks``)."""

    def __init__(self, run):
        self.run = run  # None once released (see release)
        self.params = run.params  # names a parameter after release
        self.node = None  # the autograd node whose saved tensors are being unpacked
        self.prefetch_when_done = None  # (node, group): prefetch after group once node is done
        self.first_unpack: dict[int, list[int]] = {}  # per group: leaves in backward's order

    @untraced
    def pack(self, t: torch.Tensor):
        if isinstance(t, LazyParam):  # a stand-in no op has used yet, saved as it is
            return self._pack_stand_in(t)
        run = self.run
        if not run.gathers():  # no group holds gathered storage (a world of one, no cast)
            return t
        # a DTensor the model computes with (see Run.model_view): its local tensor's storage
        local = t
        if isinstance(t, DTensor):
            with torch.no_grad():  # the local tensor itself, no autograd node
                local = t.to_local()
        try:
            hit = run.gathered_at(local.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
            return t
        if hit is None:
            return t
        group, k = hit
        group.saved[k] += 1
        return (group.gi, k, t.detach())  # a separate tensor on the same storage

    def owns(self, pack) -> bool:
        """Whether ``pack`` is the step's (its own, or :class:`Beneath`'s)."""
        owner = getattr(pack, "__self__", None)
        return owner is self or getattr(owner, "saved", None) is self

    def foreign_top(self):
        """The (pack, unpack) on top of autograd's stack when not the step's, else None."""
        top = _TOP(False) if _TOP is not None else None
        return None if top is None or self.owns(top[0]) else top

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The step's hooks around ``loss_fn``, over the caller's if theirs are on top."""
        top = self.foreign_top()
        if top is None:
            return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        over = Beneath(self, *top)
        return torch.autograd.graph.saved_tensors_hooks(over.pack, over.unpack)

    def adopt(self, top) -> bool:
        """A parameter's first use under the caller's hooks ``top``: the step's go over
        them; groups resident now stay so until their backward ([Note: hooks beneath the
        step's]). False when torch offers no way to (the caller's hooks stay: refuse)."""
        if _PUSH is None or _POP is None:
            return False
        over = Beneath(self, *top)
        _POP()
        _PUSH(over.pack, over.unpack)
        for g in self.run.all_groups():
            if g.resident:
                g.pinned = True
        return True

    def _pack_stand_in(self, t):
        """A stand-in saved as it is (by a custom Function it was given to, or as a
        checkpoint region's input): counted as a saved copy of its leaf, and unpacked as
        the leaf's full tensor."""
        group = self.run.group(t._gi)
        group.saved[t._k] += 1
        group.bare[t._k] += 1
        return (t._gi, t._k, None)

    @untraced
    def unpack(self, packed):
        run = self.run
        waiting = self.prefetch_when_done is not None and run.in_backward()
        if not waiting and not isinstance(packed, tuple):
            return packed  # the common case: an activation, nothing to do
        node = _compat.current_autograd_node()
        if waiting and node is not self.prefetch_when_done[0]:  # the consuming node finished
            g, self.prefetch_when_done = self.prefetch_when_done[1], None
            run.prefetch_after(g)
        if not isinstance(packed, tuple):
            return packed
        gi, k, t = packed
        if run is None:  # released (see release): a graph kept past its step, used again
            raise RuntimeError(
                "funshard: backward reached parameter "
                f"{self.params.layouts[self.params.members[gi][k]].path!r} of a train_step "
                "that has ended (a graph kept past the step: an aux output's, or a tensor "
                "loss_fn kept): its gathered copy is gone. Compute what needs gradients inside "
                "loss_fn, as part of the loss.")
        group = run.group(gi)
        if group.bases is None or group.bases[k] is not None:  # else let go: t is intact
            run.use([gi], new_op=node is None or node is not self.node)
            if k in group.to_regather:
                group.regather()
        self.node = node
        if t is None:  # a stand-in saved as it was (_pack_stand_in): its gathered leaf
            group.bare[k] -= 1
            t = group.fulls[k]
            if t is None:  # let go of (an earlier unpack was its last): gathered again
                t = run.recompute_leaf(gi, k)
        if run.in_backward():
            self._consumed(group, k, node)
        return t

    def _consumed(self, group, k: int, node) -> None:
        """Backward used one saved copy of leaf ``k``: count it; drop the leaf after its
        last; schedule the next prefetch once enough of the group is consumed."""
        run = self.run
        if run.recording():
            seen = self.first_unpack.setdefault(group.gi, [])
            if k not in seen:
                seen.append(k)
        group.saved[k] -= 1
        if group.saved[k] == 0:
            group.release_leaf(k)
        # Hand on once half the group is consumed (a group that owes leaves: once the
        # rest is), when the node consuming it is done: the next gather overlaps the
        # rest of this group's backward, but is not allocated while the whole group (or
        # the node's own outputs) are alive.
        if group.to_regather:
            due = group.state is S.PARTIAL and group.held == 0
        else:
            due = not group.next_prefetched and 2 * group.held <= run.params.group_bytes[group.gi]
        if due and self.prefetch_when_done is None and group.resident:
            self.prefetch_when_done = (node, group)

    def release(self) -> None:
        # autograd nodes: they reach every ctx in the graph; the run: it holds this object,
        # and without the cycle it is freed when dropped, not by the garbage collector
        self.node = self.prefetch_when_done = self.run = None


class _Theirs:
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class Beneath:
    """The step's saved-tensor hooks over the caller's (``below``): see [Note: hooks
    beneath the step's]."""

    __slots__ = ("saved", "below_pack", "below_unpack")

    def __init__(self, saved: SavedParams, pack, unpack):
        self.saved, self.below_pack, self.below_unpack = saved, pack, unpack

    @untraced
    def pack(self, t: torch.Tensor):
        packed = self.saved.pack(t)
        return packed if packed is not t else _Theirs(self.below_pack(t))

    @untraced
    def unpack(self, packed):
        if type(packed) is _Theirs:
            self.saved.unpack(None)  # a node moved on: the step's prefetch looks
            return self.below_unpack(packed.packed)
        return self.saved.unpack(packed)
