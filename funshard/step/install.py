"""Putting a dict of tensors in a module's place, as ``torch.func.functional_call`` does, for a
fraction of its host time: what ``fs.call`` does once per call inside a step.

``functional_call`` (``torch.nn.utils.stateless._reparametrize_module``) finds the module's
tied tensors again on every call: a walk of every module, parameter and buffer, then one
``swap_tensor`` per name (about 0.5 ms per call for a 4-block GPT of 52 leaves, on a CPU
core: host time a GPU waits on). :func:`install` learns the same once per module and set of
names (:class:`Plan`: where each name goes, with the tied names that share its tensor) and
then writes the module's ``_parameters`` / ``_buffers`` entries directly, restoring them on
exit in reverse order. Its numbers are the same: the same tensors land at the same places.

A plan stays valid while the module tree keeps its shape: before each use it checks, per
module, that its children are the same objects and its parameter and buffer dicts the same
size, and that every place still holds the tensor the plan was made from. A module changed
in between (a submodule replaced or added, a parameter re-tied or swapped) gets a new plan;
names the plan cannot place (not a parameter or buffer, several values for one tied tensor),
and every call traced by ``torch.compile``, go through ``_reparametrize_module`` itself.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from .. import _compat
from .._compat import own_buffers, own_modules, own_parameters

_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

# module -> {names: Plan}; weak, so no state stays on or with a module that is gone
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


class Plan:
    """Where each name of a dict of tensors goes in ``module``, tied names included."""

    def __init__(self, module: torch.nn.Module, names: tuple):
        places: dict[str, tuple] = {}  # full name -> (owning dict, key, tensor)
        by_tensor: dict[int, list[str]] = {}
        mods = {}
        for prefix, m in module.named_modules(remove_duplicate=False):
            mods[id(m)] = m
            for where in (own_parameters(m), own_buffers(m)):
                for key, t in where.items():
                    if t is None:
                        continue
                    full = f"{prefix}.{key}" if prefix else key
                    places[full] = (where, key, t)
                    by_tensor.setdefault(id(t), []).append(full)
        self.ok = all(n in places for n in names)
        given = set(names)
        # (owning dict, key, name whose tensor goes there, whether the place is that name's)
        self.writes: list[tuple] = []
        for n in names if self.ok else ():
            tied = by_tensor[id(places[n][2])]
            if sum(t in given for t in tied) > 1:  # several values for one tied tensor
                self.ok = False
                break
            self.writes += [(places[t][0], places[t][1], n, t == n) for t in tied]
        # modules by weak reference: the plan is the value of a weak mapping keyed by module
        self.shape = [(weakref.ref(m), tuple(map(weakref.ref, own_modules(m).values())),
                       len(own_parameters(m)), len(own_buffers(m))) for m in mods.values()]
        self.held = [(where, key, t, full) for full, (where, key, t) in places.items()]

    def valid(self, same_tensors: bool = True) -> bool:
        """The module tree has its shape, and (``same_tensors``) every place holds the tensor
        the plan was made from."""
        for ref, children, n_params, n_buffers in self.shape:
            m = ref()
            if (m is None or len(own_parameters(m)) != n_params
                    or len(own_buffers(m)) != n_buffers or len(own_modules(m)) != len(children)
                    or any(a is not b() for a, b in zip(own_modules(m).values(), children))):
                return False
        return not same_tensors or all(where.get(key) is t for where, key, t, _ in self.held)


def plan_for(module: torch.nn.Module, names: tuple, over: bool = False) -> Plan:
    plans = _PLANS.setdefault(module, {})
    plan = plans.get((names, over))
    if plan is None or not plan.valid(same_tensors=not over):
        plan = plans[(names, over)] = Plan(module, names)
    return plan


def own_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own parameters and buffers by name, as its plans found them (while an
    installation is in place the module holds the installed tensors)."""
    return [(full, t) for plan in _PLANS.get(module, {}).values()
            for _, _, t, full in plan.held]


# Never traced: after a graph break in a compiled loss_fn dynamo would compile these frames
# on their own, iterating the weak mapping while the garbage collector may remove from it
# ("dictionary changed size during iteration", seen in a compiled test's first step).
# Skipped by code object (as the saved-tensor hooks are): no wrapper, no cost per call.
if _compat.skip_code is not None:
    for _fn in (plan_for, own_tensors):
        _compat.skip_code(_fn.__code__)


def install(module: torch.nn.Module, tensors: dict, over: bool = False):
    """A context manager: ``tensors`` (``{fqn: tensor}``) in place of ``module``'s own
    parameters and buffers, tied names tied, until exit; what the module rebound meanwhile
    is written back into ``tensors`` (as ``functional_call`` does). ``over``: ``module`` is
    a submodule of one an installation of this step holds (a group module's gathered
    tensors over its stand-ins): that installation checked the places, whose tensors are
    new each step, so the plan is checked against the module tree's shape only."""
    # under torch.compile, torch's own path, which dynamo knows (a plan's weak mapping and
    # checks would break its graph; the compiled code does not run them again anyway)
    plan = None if _compiling() else plan_for(module, tuple(tensors), over)
    if plan is None or not plan.ok:
        return _compat.reparametrize(module, tensors, tie_weights=True)
    return _Installed(plan, tensors)


class _Installed:
    def __init__(self, plan: Plan, tensors: dict):
        self.plan, self.tensors, self.before = plan, tensors, None

    def __enter__(self):
        writes, tensors = self.plan.writes, self.tensors
        self.before = [where[key] for where, key, _, _ in writes]
        for where, key, name, _ in writes:
            where[key] = tensors[name]
        return self

    def __exit__(self, *exc):
        tensors = self.tensors
        for (where, key, name, own), old in zip(reversed(self.plan.writes),
                                                reversed(self.before)):
            now = where[key]
            if own and now is not tensors[name]:  # the module rebound it: keep what it made
                tensors[name] = now
            where[key] = old
        return False


class Installations:
    """What ``fs.call`` installed in one micro-batch, undone (last first) when its backward is
    done (:meth:`undo`); whether it installed a module twice with other tensors; how many of
    its module calls run, and which group modules' forwards run, how deep."""

    __slots__ = ("_stacks", "_tensors", "_twice", "_twice_ids", "_calls", "_depth")

    def __init__(self):
        self._stacks: list[tuple] = []  # (module, its installation's ExitStack)
        self._tensors: dict[int, dict] = {}  # per module installed: the tensors
        self._twice = ""  # a module installed twice with other tensors
        self._twice_ids: set[int] = set()  # its installations' tensors the guard watches
        self._calls = 0  # module calls in progress
        self._depth: dict[int, int] = {}  # group -> how deep its module's forward runs

    def add(self, module: torch.nn.Module, tensors: dict, stand_in: type) -> contextlib.ExitStack:
        """``tensors`` installed in ``module`` until :meth:`undo`: the ExitStack returned
        takes the call's other undos. A second installation of ``module`` with other tensors
        is noted, with its tensors but ``stand_in``'s (a stand-in a recompute reads is
        refused as it is read)."""
        before = self._tensors.setdefault(id(module), tensors)
        if before is not tensors and (before.keys() != tensors.keys() or any(
                before[k] is not v for k, v in tensors.items())):  # refused if recomputed
            self._twice = type(module).__name__
            self._twice_ids.update(id(t) for d in (before, tensors) for t in d.values()
                                   if not isinstance(t, stand_in))
        stack = contextlib.ExitStack()
        stack.enter_context(install(module, tensors))
        self._stacks.append((module, stack))
        return stack

    def any(self) -> bool:
        """Whether ``fs.call`` installed anything in this micro-batch."""
        return bool(self._stacks)

    def twice(self) -> str:
        """The class name of a module installed twice with other tensors, or ""."""
        return self._twice

    def twice_ids(self) -> set[int]:
        """The ids of those installations' tensors (stand-ins aside)."""
        return self._twice_ids

    def left_in_place(self) -> set[int]:
        """The ids of the installed modules' own ``nn.Parameter``s (those no call named)."""
        return {id(p) for module, _ in self._stacks for p in module.parameters()
                if isinstance(p, torch.nn.Parameter)}

    def name_of(self, t: torch.Tensor) -> str:
        """``t``'s name in an installed module, if it is one's own, else ""."""
        for module, _ in self._stacks:
            for name, own in own_tensors(module):
                if own is t:
                    return name
        return ""

    def calling(self, by: int) -> None:
        """A module call starts (``by=1``) or returns (``by=-1``)."""
        self._calls += by

    def in_call(self) -> bool:
        """Whether a module call is in progress."""
        return self._calls > 0

    def enter(self, gi: int) -> None:
        """Group ``gi``'s module's forward starts."""
        self._depth[gi] = self._depth.get(gi, 0) + 1

    def leave(self, gi: int) -> bool:
        """Group ``gi``'s module's forward returns; whether one of its forwards still runs."""
        n = self._depth.pop(gi) - 1
        if n:
            self._depth[gi] = n
        return n > 0

    def within(self, gi: int) -> bool:
        """Whether group ``gi``'s module's forward runs."""
        return gi in self._depth

    def undo(self) -> None:
        """Every installation undone, last first."""
        while self._stacks:
            self._stacks.pop()[1].close()

    def release(self) -> None:
        """Drop the tensors noted per module."""
        self._tensors = {}
