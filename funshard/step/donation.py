"""Donation, enforced, as JAX does: ``step(state, batch)`` updates the state's parameters and
optimizer state in place, so the state given is used up; using it again raises."""

from __future__ import annotations

import weakref


class Donations:
    """Donation, enforced: a state's parameters are updated in place, so the step remembers,
    per tree (keyed by its first leaf's identity: tensors compare elementwise), the step
    count of the state it last returned; a state with another count is an old, donated one.
    Trees that died are dropped."""

    def __init__(self):
        self._by_id: dict[int, tuple[weakref.ref, int]] = {}

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
                f"of this step, which updated its parameters and optimizer state in place and "
                f"returned the state at step {last}; use the state it returned: "
                "state, metrics = step(state, batch)."
            )
