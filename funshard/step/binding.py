"""A group's leaves bound to their stand-ins and back: see [Note: binding] in :mod:`.lazy`.

While leaf ``k`` of a group is bound, ``stands[k]`` (the object ``loss_fn`` holds) *is*
its full tensor and ``lazies[k]`` holds the stand-in's empty shell; unbound, ``stands[k]``
is the empty stand-in again and ``lazies[k]`` is None.
"""

from __future__ import annotations

import weakref

import torch

from .. import _compat
from .lazy import LazyParam, in_place_error


def lazy_swap(a: torch.Tensor, b: torch.Tensor, held_ok: bool = False) -> bool:
    """Swap two tensor objects' contents (C++ tensor, class, attributes); False (nothing
    changed) when either C++ tensor is held elsewhere (``held_ok``: only when either object
    has weak references, or a C++ weak reference stops the swap)."""
    # torch's C++ swap does not check this itself (torch.utils.swap_tensors checks it in
    # Python): a C++ tensor that something else holds, or an object with weak references,
    # must not change hands. Unbinding may hand over a held one ([Note: rank-independent
    # freeing] in .group): the holder keeps the C++ tensor, whose storage is then kept.
    if weakref.getweakrefcount(a) or weakref.getweakrefcount(b) or (
            not held_ok and (a._use_count() != 1 or b._use_count() != 1)):
        return False
    try:
        _compat.swap_tensor_impl(a, b)
    except RuntimeError:  # a C++ weak reference (torch.profiler's record_shapes holds one to
        return False  # each op's inputs), which no Python API counts: refused before any change
    swap_identity(a, b)
    return True


def swap_identity(a: torch.Tensor, b: torch.Tensor) -> None:
    """Swap two tensor objects' classes and attributes, not their C++ tensors."""
    a.__class__, b.__class__ = b.__class__, a.__class__
    a.__dict__, b.__dict__ = b.__dict__, a.__dict__


class Binding:
    """The binding half of :class:`~.group.Group` (its fields: ``stands``, ``lazies``,
    ``fulls``, ``bases``, ``bound_version``, ``pinned``, ``ended``, ``aliased``, ``params``,
    ``gi``, ``idx``). A leaf is *demoted* (below) when ``lazies[k]`` holds its shell and
    ``stands[k]`` is a :class:`~.lazy.LazyParam` all the same."""

    def base(self, k: int) -> torch.Tensor | None:
        """Leaf ``k``'s padded full tensor: bound, unpadded, that is the stand-in object."""
        b = self.bases[k]
        return self.stands[k] if b is not None and self.lazies and b is self.lazies[k] else b

    def bound(self, k: int) -> bool:
        """Leaf ``k``'s stand-in is its full tensor (``lazies[k]`` holds the shell)."""
        return self.lazies is not None and self.lazies[k] is not None

    def bind_all(self) -> None:
        """Make every gathered leaf's stand-in its full tensor: later ops on it are plain."""
        if self.stands is None:
            return
        for k, full in enumerate(self.fulls):
            if k in self.params.unbindable[self.gi]:
                continue
            if self.lazies[k] is not None and type(self.stands[k]) is LazyParam:  # demoted
                swap_identity(self.stands[k], self.lazies[k])  # plain again, same C++ tensor
            elif (self.lazies[k] is None and full is not None
                  and lazy_swap(self.stands[k], full)):
                self.lazies[k], self.fulls[k] = full, self.stands[k]
                self.bound_version[k] = self.stands[k]._version

    def unbind(self, k: int, held_ok: bool = False) -> bool:
        """Leaf ``k``'s stand-in back to an empty shell (the next op on it gathers again).
        False when something else holds its full tensor: with ``held_ok`` (never for an
        ALIASED leaf, autograd's own) a weak reference, which keeps it *demoted* (below);
        otherwise it stays bound."""
        if self.pinned and not self.ended:
            return False
        shell = self.lazies[k] if self.lazies is not None else None
        if shell is None:
            return True
        stand = self.stands[k]
        if type(stand) is LazyParam:  # demoted
            return False
        if stand._version != self.bound_version[k]:
            raise in_place_error(self.params.layouts[self.idx[k]].path, "an in-place op",
                                 landed=self.aliased)
        held_ok = held_ok and not self.aliased
        if lazy_swap(stand, shell, held_ok=held_ok):
            self.fulls[k], self.lazies[k] = shell, None
            return True
        if held_ok:
            self._demote(k)
        return False

    # [Note: demoted leaves] A weak reference to a bound leaf's C++ tensor (one rank's
    # torch.profiler with record_shapes or with_stack holds one to each op's inputs) stops
    # the swap that unbinds it. Left a plain tensor, the ops on it would go unseen: a later
    # use in forward (the group used again after its free) or a recompute of the model's
    # own checkpointing would gather nothing on that rank alone, and the ranks' collectives
    # part (NCCL hangs, or pairs bytes wrongly). So the object takes the stand-in's class
    # and attributes back over its own C++ tensor (whose storage stays, see [Note:
    # rank-independent freeing] in .group): its next op is seen and gathers, as on every
    # rank, into that storage; binding then makes it plain again, and in backward (where
    # stand-ins stay unbound) an op gets a view of it (:meth:`full`). The group's own
    # storage work goes through a plain alias of it (``bases[k]``).

    def _demote(self, k: int) -> None:
        stand, shell = self.stands[k], self.lazies[k]
        if self.bases[k] is shell:  # base(k) was the stand-in object itself
            self.bases[k] = stand.detach()  # its storage and version counter
        swap_identity(stand, shell)

    def full(self, k: int) -> torch.Tensor | None:
        """Leaf ``k``'s full tensor for an op: of a demoted leaf, a view of the stand-in
        object (on its autograd history), which itself would go through the stand-in."""
        t = self.fulls[k]
        if type(t) is not LazyParam:
            return t
        with torch.enable_grad(), _compat.DisableTorchFunctionSubclass():
            return t.view_as(t)

    def unbind_all(self, held_ok: bool = False) -> bool:
        return all([self.unbind(k, held_ok) for k in range(len(self.idx))])
