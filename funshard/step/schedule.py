"""When a step gathers, frees and reduces each group: the schedule, as plain data.

A step learns its schedule on its first step (the order ``loss_fn`` and autograd reach the
groups) and follows it on every later step: it prefetches the next group in that order and
keeps one group gathered from forward into backward. ``fs.plan`` builds the same
:class:`Schedule` on paper from a stated order, with the same rules
(:func:`kept_into_backward`, :func:`split_kept`), so the two cannot drift.

    >>> s = make_schedule([0, 1, 2, 0], [2, 1], reshard_after_forward=True,
    ...                   kept_leaves=lambda g: ([0, 1], [1, 0], [64, 64]), gathers=True)
    >>> s.forward, s.backward, s.kept, s.kept_late      # ((0, 1, 2, 0), (1,), 2, (0,))
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

from .. import pytree


def default_group(fqn: str) -> str:
    """A name-only grouping (state dicts gather by it): ``'layers.3.attn.wq'`` ->
    ``'layers.3'``; ``'0.w'`` -> ``'0'``; no number -> ``''``."""
    parts = fqn.split(".")
    for j, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: j + 1])
    return ""


def block_groups(names: Sequence[str], shapes: Sequence[tuple]) -> list[str]:
    """The step's default groups: one per repeated block, one (``''``) for the rest.

    A container's children are its numbered FQN components (``layers.3``, ``h.11``,
    ``encoder.layer.0``); two are identical when their leaves have the same relative names
    and shapes. A container with at least two identical children, not inside another such
    container's child, is a stack, and each of its children a block, the ones unlike the
    rest too (T5's first block, which holds the relative position bias; dense layers before
    mixture-of-experts ones), as FSDP wraps each layer. The blocks are those of the stacks
    with the most children (ties: those holding at least half the largest's elements, so an
    encoder and a decoder stack both count, a two-layer head beside two blocks does not).
    A ``Sequential`` inside a block stays in its block; one that is not a stack
    (``head.0``, ``head.2``) goes to the rest.

        >>> block_groups(["wte.w", "layers.0.w", "layers.1.w", "mlp.0.w", "mlp.2.w"],
        ...              [(9, 4), (4, 4), (4, 4), (8, 4), (4, 8)])
        ['', 'layers.0', 'layers.1', '', '']
    """
    sig: dict[str, dict[str, list]] = {}  # container -> child -> [(suffix, shape)]
    for n, shape in zip(names, shapes):
        parts = n.split(".")
        for j, part in enumerate(parts[:-1]):
            if part.isdigit():
                sig.setdefault(".".join(parts[:j]), {}).setdefault(part, []).append(
                    (".".join(parts[j + 1:]), tuple(shape)))
    found: dict[str, tuple[set, int]] = {}  # container -> (its block children, elements)
    for prefix, children in sig.items():
        classes: dict[tuple, list[str]] = {}
        for child, items in children.items():
            classes.setdefault(tuple(sorted(items)), []).append(child)
        if max(len(c) for c in classes.values()) >= 2:  # a stack: each child is a block
            found[prefix] = (set(children), sum(math.prod(s) for items in children.values()
                                                for _, s in items))

    def inside_block(prefix: str) -> bool:
        parts = prefix.split(".")
        return any(parts[j] in found.get(".".join(parts[:j]), ((), 0))[0]
                   for j in range(len(parts)))

    outer = {p: v for p, v in found.items() if not inside_block(p)}
    if not outer:
        return [""] * len(names)
    run = max(len(c) for c, _ in outer.values())
    big = max(e for c, e in outer.values() if len(c) == run)
    blocks = {p: c for p, (c, e) in outer.items() if len(c) == run and 2 * e >= big}
    out = []
    for n in names:
        parts, g = n.split("."), ""
        for j, part in enumerate(parts[:-1]):
            if part.isdigit() and ".".join(parts[:j]) in blocks:
                g = ".".join(parts[: j + 1])
                break
        out.append(g)
    return out


class GroupInfo(NamedTuple):
    """One communication group a policy chooses: its name, its leaves' FQNs (tree order)
    and its bytes unsharded in the compute dtype."""

    name: str
    leaves: tuple[str, ...]
    nbytes: int


def list_groups(tree: Any, policy: Any = None) -> list[GroupInfo]:
    """The groups ``policy`` (default ``fs.Policy()``) makes of ``tree`` (full tensors,
    DTensors or anything with ``shape`` and ``dtype``), in the order a step would first
    meet them if it used the leaves in tree order.

        >>> for g in fs.list_groups(fs.params(model)):
        ...     print(g.name or "(rest)", len(g.leaves), g.nbytes)
    """
    from .policy import Policy

    policy = Policy() if policy is None else policy
    paths, leaves, _ = pytree.flatten_with_path(tree)
    names = [pytree.fqn(p) for p in paths]
    order, members = partition(group_names(names, policy.groups, tree,
                                           [x.shape for x in leaves]))
    return [GroupInfo(g, tuple(names[i] for i in idx),
                      sum(math.prod(leaves[i].shape)
                          * policy.compute_dtype(names[i], leaves[i].dtype).itemsize
                          for i in idx))
            for g, idx in zip(order, members)]


def group_names(names: Sequence[str], groups: Any, tree: Any,
                shapes: Sequence[tuple] | None = None) -> list[str]:
    """The group of each leaf (``names``: the leaves' FQNs, ``tree``: the tree itself).

    ``groups``: None (the repeated blocks, see :func:`block_groups`; ``shapes`` are the
    leaves' full shapes), a callable ``fqn -> group name``, or a prefix tree of group names.
    """
    if groups is None:
        if shapes is None:
            leaves = pytree.flatten(tree)[0]
            shapes = ([getattr(x, "shape", ()) for x in leaves] if len(leaves) == len(names)
                      else [()] * len(names))
        return block_groups(names, shapes)
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
                       reshard_after_forward: bool, gathers: bool) -> int | None:
    """The group a FULL_SHARD step keeps gathered from forward into backward, if any.

    ``forward`` and ``backward`` are groups in the order they are gathered. Backward's first
    group stays when forward used it in its last two gathers: freeing it would only gather
    it again at once (torchtitan sets FSDP2's last block so). ``gathers``: a gather moves
    data (False on a world of one, where keeping saves only a cast: none is kept, and the
    peak at the loss holds no block FSDP2's would not; measured 2026-11-24, GPT 4 x 256 in
    bfloat16, world 1: live peak 74.64 MiB with the block kept, FSDP2 74.26).
    """
    if not gathers:
        return None
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
                  kept_leaves: Callable[[int], tuple[list[int], list[int], list[int]]],
                  gathers: bool) -> Schedule:
    """The schedule of a forward and backward gather order (``backward`` as first seen,
    its first group still the kept one). ``kept_leaves(g)`` gives the kept group's sharded
    leaves, the order backward first unpacks them, and each leaf's full bytes; ``gathers``:
    see :func:`kept_into_backward`."""
    kept = kept_into_backward(forward, backward, reshard_after_forward, gathers)
    late: list[int] = []
    if kept is not None:
        backward = list(backward)[1:]
        late = split_kept(*kept_leaves(kept))
    return Schedule(tuple(forward), tuple(backward), kept, tuple(late))
