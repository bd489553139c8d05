"""Donation, enforced, as ``jax.jit(donate_argnums=)`` does: ``step(state, batch)`` updates
the state's parameters and optimizer state in place (their local shards), so the state given
is used up and the returned one is the state to go on with.

The step marks the state it was given as donated: one attribute, no work per leaf. Reading a
donated state's ``params``, ``opt_state``, ``buffers`` or ``loss_scale``, indexing,
iterating or unpacking it (``_replace``, ``_asdict``, pickling, ``fs.state_dict`` and
``fs.checkpoint.save`` do) raises a ``ValueError`` naming the step it was donated to and
the fix; its ``step`` and ``skipped`` counts stay readable. optree reads a tuple's items
directly, so ``optree.tree_flatten`` of a donated state still walks it, and sees the
counts a compiled step built its state with before it read that a step before was skipped
(corrected in the fields: [Note: two counts in doubt] in :mod:`funshard.step.deferred`):
funshard's own functions read a state through its fields. A state that reaches the step
again another way (a copy taken before the call) is caught by its step count
(:class:`Donations`).
"""

from __future__ import annotations

import weakref


class Donatable:
    """A NamedTuple state that refuses to be read once donated (mixed in ahead of the
    fields, with :func:`field` over the donated ones)."""

    __slots__ = ()
    _donated_to = None  # the step the state was given to, once it was
    _pending = None  # the checks of the step that returned it, until read (step.deferred)
    _fixed = None  # its values, corrected once a step it was built on read as skipped

    def __iter__(self):
        settle(self)
        if self._donated_to is not None:
            refuse(self, "iterating (unpacking, _replace, pickling, a state dict of) it")
        return iter(values(self))

    def __getitem__(self, i):
        settle(self)
        if self._donated_to is not None:
            refuse(self, f"indexing it ([{i!r}], as fs.state_dict and fs.checkpoint.save do)")
        return _item(self, i)

    def __repr__(self) -> str:
        if self._donated_to is not None:
            return (f"{type(self).__name__}(<donated to {self._donated_to}>, "
                    f"step={getattr(self, 'step', '?')})")
        return super().__repr__()


def values(state) -> tuple:
    """``state``'s values, as corrected (:mod:`funshard.step.deferred`'s [Note: two counts in
    doubt]), without settling or refusing anything."""
    return state._fixed if state._fixed is not None else tuple(tuple.__iter__(state))


def _item(state, i):
    """``values(state)[i]``, without a copy of the tuple (a field read, several per step)."""
    return state._fixed[i] if state._fixed is not None else tuple.__getitem__(state, i)


def field(index: int, name: str, donated: bool = False) -> property:
    """The NamedTuple field ``name`` (at ``index``), refused on a donated state (but
    ``donated``: a count readable after)."""

    def read(state):
        settle(state)
        if state._donated_to is not None and not donated:
            refuse(state, f"reading its .{name}")
        return _item(state, index)

    return property(read, doc=f"``{name}`` (refused once the state is donated to a step)."
                    if not donated else f"``{name}``.")


def settle(state) -> None:
    """Read the checks of the step that returned ``state``, if not yet read: raises that
    step's refusal ([Note: a step that reads nothing] in :mod:`funshard.step.deferred`)."""
    pending = state._pending
    if pending is not None:
        pending.settle()
        state._pending = None


def refuse(state, what: str):
    n = getattr(state, "step", None)
    after = f" and returned the state at step {n + 1}" if isinstance(n, int) else ""
    raise ValueError(
        f"this {type(state).__name__} (step {n}) was donated to {state._donated_to}, which "
        f"updated its parameters and optimizer state in place{after}: {what} would give the "
        "new values under the old state's name (jax.jit(donate_argnums=) deletes a donated "
        "array the same way). Use the state the step returned: "
        "state, metrics = step(state, batch).")


class Donations:
    """Donation, enforced, for one step named ``label``: :meth:`donate` marks the state the
    step was given; and the step remembers, per tree (keyed by its first leaf's identity:
    tensors compare elementwise), the step count of the state it last returned, so that a
    state with another count (a copy of an old, donated one) is refused too. Trees that died
    are dropped."""

    def __init__(self, label: str = "train_step"):
        self.label = label
        self._by_id: dict[int, tuple[weakref.ref, int]] = {}

    def donate(self, state) -> None:
        """Mark ``state`` donated: the step updated its leaves in place."""
        if isinstance(state, Donatable):
            state._donated_to = self.label

    def remember(self, state, leaves: list):
        """Remember ``state`` as the latest of its tree; ``leaves``: its parameter leaves
        (the caller has flattened them already)."""
        if leaves:
            if len(self._by_id) > 1:  # several trees: drop the ones that died
                self._by_id = {i: (r, s) for i, (r, s) in self._by_id.items()
                               if r() is not None}
            self._by_id[id(leaves[0])] = (weakref.ref(leaves[0]), state.step)
        return state

    def check(self, state, leaves: list) -> None:
        ref, last = self._by_id.get(id(leaves[0]), (None, None)) if leaves else (None, None)
        if ref is not None and ref() is leaves[0] and state.step != last:
            raise ValueError(
                f"train_step: this TrainState (step {state.step}) was donated to an earlier call "
                f"of {self.label}, which updated its parameters and optimizer state in place "
                f"and returned the state at step {last}; use the state it returned: "
                "state, metrics = step(state, batch)."
            )
