"""When a step gathers, frees and reduces each group: the schedule, as plain data.

A step learns its schedule on its first step (the order ``loss_fn`` and autograd reach the
groups) and follows it on every later step: it prefetches the next group in that order and
keeps one group gathered from forward into backward. ``fs.plan`` builds the same
:class:`Schedule` on paper from a stated order, with the same rules
(:func:`kept_into_backward`, :func:`split_kept`), so the two cannot drift.

    >>> s = make_schedule([0, 1, 2, 0], [2, 1], reshard_after_forward=True,
    ...                   kept_leaves=lambda g: ([0, 1], [1, 0], [64, 64]))
    >>> s.forward, s.backward, s.kept, s.kept_late      # ((0, 1, 2, 0), (1,), 2, (0,))
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from .. import pytree


def default_group(fqn: str) -> str:
    """``'layers.3.attn.wq'`` -> ``'layers.3'``; ``'0.w'`` -> ``'0'``; no number -> ``''``."""
    parts = fqn.split(".")
    for j, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: j + 1])
    return ""


def group_names(names: Sequence[str], groups: Any, tree: Any) -> list[str]:
    """The group of each leaf (``names``: the leaves' FQNs, ``tree``: the tree itself).

    ``groups``: None (one group per numbered container element, see :func:`default_group`),
    a callable ``fqn -> group name``, or a prefix tree of group names.
    """
    if groups is None:
        return [default_group(n) for n in names]
    if callable(groups):
        return [_call_groups(groups, n) for n in names]
    out = pytree.broadcast_prefix(groups, tree, name="Policy.groups")
    for n, g in zip(names, out):
        _check_group_name(g, n)
    return out


def _call_groups(groups: Callable, fqn: str) -> str:
    try:
        g = groups(fqn)
    except Exception as e:
        raise ValueError(f"Policy.groups raised for parameter {fqn!r}: "
                         f"{type(e).__name__}: {e}") from e
    _check_group_name(g, fqn)
    return g


def _check_group_name(g: Any, fqn: str) -> None:
    if not isinstance(g, str):
        raise TypeError(f"Policy.groups gave {g!r:.60} for parameter {fqn!r}; group names "
                        "are strings (e.g. 'layers.3')")


def partition(gnames: Sequence[str]) -> tuple[list[str], list[list[int]]]:
    """Groups in order of first appearance, and each group's leaf indices."""
    order: dict[str, list[int]] = {}
    for i, g in enumerate(gnames):
        order.setdefault(g, []).append(i)
    return list(order), list(order.values())


def kept_into_backward(forward: Sequence[int], backward: Sequence[int],
                       reshard_after_forward: bool) -> int | None:
    """The group a FULL_SHARD step keeps gathered from forward into backward, if any.

    ``forward`` and ``backward`` are groups in the order they are gathered. Backward's first
    group stays when forward used it in its last two gathers: freeing it would only gather
    it again at once (torchtitan sets FSDP2's last block so).
    """
    if reshard_after_forward and backward and backward[0] in list(forward)[-2:]:
        return backward[0]
    return None


def split_kept(sharded: Sequence[int], first_unpack: Sequence[int],
               nbytes: Sequence[int]) -> list[int]:
    """Leaves of the kept group (see :func:`kept_into_backward`) to free at the end of
    forward and gather again in backward: all but the ones backward unpacks first, up to
    half the group's bytes. Backward starts where every activation is alive, so it holds
    only what its first nodes need; the kept group then costs 2 all-gathers like any other
    (the second of part of it), not 1.

    ``sharded``: the group's gathered leaves; ``first_unpack``: leaves in the order
    backward first used them; ``nbytes``: each leaf's full bytes. [] = no split.
    """
    total = sum(nbytes[k] for k in sharded)
    early, used = set(), 0
    for k in first_unpack:
        if k in sharded and used + nbytes[k] <= total // 2:
            early.add(k)
            used += nbytes[k]
        elif k in sharded:
            break
    late = [k for k in sharded if k not in early]
    return late if early and late else []


class Schedule(NamedTuple):
    """The order one tree's groups are gathered in, forward and backward."""

    forward: tuple[int, ...]  # groups in the order forward gathers them (one may repeat)
    backward: tuple[int, ...]  # groups backward gathers again, in order (not ``kept``)
    kept: int | None  # the group kept gathered from forward into backward
    kept_late: tuple[int, ...]  # leaves of ``kept`` freed when forward ends, gathered again

    def next_after(self, backward: bool, seen: int) -> int | None:
        """The group gathered after the first ``seen`` of forward's (backward's) order."""
        order = self.backward if backward else self.forward
        return order[seen] if seen < len(order) else None

    def before_backward(self, seen: int) -> int | None:
        """The group backward is in when it has gathered ``seen`` groups (``kept`` first)."""
        return self.backward[seen - 1] if seen else self.kept


def make_schedule(forward: Sequence[int], backward: Sequence[int], *,
                  reshard_after_forward: bool,
                  kept_leaves: Callable[[int], tuple[list[int], list[int], list[int]]]
                  ) -> Schedule:
    """The schedule of a forward and backward gather order (``backward`` as first seen,
    its first group still the kept one). ``kept_leaves(g)`` gives the kept group's sharded
    leaves, the order backward first unpacks them, and each leaf's full bytes."""
    kept = kept_into_backward(forward, backward, reshard_after_forward)
    late: list[int] = []
    if kept is not None:
        backward = list(backward)[1:]
        late = split_kept(*kept_leaves(kept))
    return Schedule(tuple(forward), tuple(backward), kept, tuple(late))
