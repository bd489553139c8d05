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

from .group import S


class SavedParams:
    """The saved-tensor hooks of one run (``torch.autograd.graph.saved_tensors_hooks``)."""

    def __init__(self, run):
        self.run = run
        self.node = None  # the autograd node whose saved tensors are being unpacked
        self.prefetch_when_done = None  # (node, group): prefetch after group once node is done
        self.first_unpack: dict[int, list[int]] = {}  # per group: leaves in backward's order

    def pack(self, t: torch.Tensor):
        try:
            hit = self.run.storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
            return t
        if hit is None:
            return t
        group, k = hit
        group.saved[k] += 1
        # a separate tensor on the same storage: autograd never holds a bound stand-in's own
        # tensor, so the stand-in can always be unbound (see [Note: binding] in .lazy)
        return (group.gi, k, t.detach())

    def unpack(self, packed):
        run = self.run
        waiting = self.prefetch_when_done is not None and run.backward
        if not waiting and not isinstance(packed, tuple):
            return packed  # the common case: an activation, nothing to do
        node = torch._C._current_autograd_node()
        if waiting and node is not self.prefetch_when_done[0]:  # the consuming node finished
            g, self.prefetch_when_done = self.prefetch_when_done[1], None
            run.prefetch_after(g)
        if not isinstance(packed, tuple):
            return packed
        gi, k, t = packed
        group = run.groups[gi]
        if group.bases is None or group.bases[k] is not None:  # else dropped: t is intact
            run.use([gi], new_op=node is None or node is not self.node)
            if k in group.to_regather:
                group.regather()
        self.node = node
        if run.backward:
            self._consumed(group, k, node)
        return t

    def _consumed(self, group, k: int, node) -> None:
        """Backward used one saved copy of leaf ``k``: count it; drop the leaf after its
        last; schedule the next prefetch once enough of the group is consumed."""
        run = self.run
        if run.record:
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
        # autograd nodes: they reach every ctx in the graph
        self.node = self.prefetch_when_done = None
