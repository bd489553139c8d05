"""Combining transformations: ``chain`` (one after another), ``masked`` (on some leaves only)
and ``multi_transform`` (a transformation per label), as in optax.

    >>> no_decay = lambda fqn: not fqn.endswith(("bias", "norm.weight"))
    >>> opt = chain(clip_by_global_norm(1.0), scale_by_adam(),
    ...             add_decayed_weights(0.1, mask=no_decay), scale_by_learning_rate(3e-4))
    >>> opt = chain(multi_transform({"lora": adamw(1e-3).transform, "frozen": set_to_zero()},
    ...                             lambda fqn: "lora" if "lora_" in fqn else "frozen"))
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple, Union

from .apply import as_optimizer
from .traced import traced_of
from .base import (EmptyState, GradientTransformation, Optimizer, Tree, flatten, mask_flags,
                   path_str, per_leaf, unflatten)

Transform = Union[GradientTransformation, Optimizer]


def as_transform(t: Any, where: str) -> GradientTransformation:
    """A GradientTransformation, or an Optimizer's (so ``chain(adamw(...), ...)`` composes)."""
    if isinstance(t, GradientTransformation):
        return t
    if isinstance(t, Optimizer) and t.transform is not None:
        return t.transform
    raise TypeError(f"{where}: expected an fs.optim GradientTransformation or an Optimizer made by "
                    f"fs.optim (chain, adamw, sgd, ...), got {type(t).__name__}")


def chain(*transforms: Transform) -> Optimizer:
    """The transformations one after another, as an :class:`Optimizer` (``.transform`` nests).

    State: the tuple of the members' states, stateless members left out; with one stateful
    member its state itself (so ``adamw``'s state is ``AdamWState(exp_avg, exp_avg_sq, count)``).
    """
    ts = [as_transform(t, f"chain: argument {i}") for i, t in enumerate(transforms)]
    stateful = [i for i, t in enumerate(ts) if not t.stateless]

    def pack(states: list) -> Tree:
        if not stateful:
            return EmptyState()
        return states[0] if len(stateful) == 1 else tuple(states)

    def init(params: Tree) -> Tree:
        return pack([ts[i].init(params) for i in stateful])

    def update(updates: Tree, state: Tree, params: Tree, *, step: int):
        states = [state] if len(stateful) == 1 else list(state) if stateful else []
        if len(states) != len(stateful):
            raise ValueError(f"chain: the state has {len(states)} parts, the chain {len(stateful)} "
                             "stateful transformations; pass the state this chain's init made")
        own = dict(zip(stateful, states))
        for i, t in enumerate(ts):
            updates, s = t.update(updates, own.get(i, EmptyState()), params, step=step)
            if i in own:
                own[i] = s
        return updates, pack([own[i] for i in stateful])

    forms = tuple(("traced", t.traced) if isinstance(t, Optimizer) and t.traced is not None
                  else u.form for t, u in zip(transforms, ts))
    return as_optimizer(GradientTransformation(init, update, not stateful, ("chain", forms))
                        )._replace(traced=traced_of(forms))


def _restrict(tree: Tree, keep: list[bool]) -> Tree:
    _, leaves, spec = flatten(tree)
    return unflatten(spec, [x if k else None for x, k in zip(leaves, keep)])


def masked(inner: Transform, mask: Union[Tree, Callable[[str], bool]]) -> GradientTransformation:
    """``inner`` on the leaves where ``mask`` is True; the other updates pass unchanged.

    Args:
        inner: a transformation (or an fs.optim Optimizer).
        mask: a tree of bools with the params' structure (or a prefix of it), or a callable
            ``fqn -> bool``, e.g. ``lambda fqn: not fqn.endswith("bias")``.
    Returns:
        A transformation whose state is ``inner``'s over the masked params (``None`` elsewhere).
    """
    t = as_transform(inner, "masked")

    def keep(params: Tree) -> list[bool]:
        return mask_flags(mask, params)

    def init(params: Tree) -> Tree:
        return t.init(_restrict(params, keep(params)))

    def update(updates: Tree, state: Tree, params: Tree, *, step: int):
        k = keep(params)
        new, state = t.update(_restrict(updates, k), state, _restrict(params, k), step=step)
        _, old, spec = flatten(updates)
        return unflatten(spec, [n if f else o for n, o, f in zip(flatten(new)[1], old, k)]), state

    return GradientTransformation(init, update, t.stateless)


class MultiTransformState(NamedTuple):
    """Each label's transformation state, ``{label: state}``."""

    inner_states: dict


def multi_transform(transforms: dict[Hashable, Transform],
                    labels: Union[Tree, Callable[[str], Hashable]]) -> GradientTransformation:
    """A transformation per label: leaf ``x`` gets ``transforms[label(x)]``.

    Args:
        transforms: ``{label: transformation}``, e.g. a different learning rate per group.
        labels: a tree of labels with the params' structure (or a prefix), or a callable
            ``fqn -> label`` or ``(fqn, param) -> label``.
    Returns:
        A transformation with state :class:`MultiTransformState`.
    """
    ts = {k: as_transform(t, f"multi_transform[{k!r}]") for k, t in transforms.items()}

    def labels_of(params: Tree) -> list:
        out = per_leaf(labels, params, "label")
        for p, lab in zip(flatten(params)[0], out):
            if lab not in ts:
                raise ValueError(f"multi_transform: leaf {path_str(p)} has label {lab!r}, which "
                                 f"has no transformation; labels with one: {sorted(map(repr, ts))}")
        return out

    def init(params: Tree) -> MultiTransformState:
        labs = labels_of(params)
        return MultiTransformState({k: t.init(_restrict(params, [x == k for x in labs]))
                                    for k, t in ts.items()})

    def update(updates: Tree, state: MultiTransformState, params: Tree, *, step: int):
        labs = labels_of(params)
        _, out, spec = flatten(updates)
        out, new = list(out), {}
        for k, t in ts.items():
            keep = [x == k for x in labs]
            u, new[k] = t.update(_restrict(updates, keep), state.inner_states[k],
                                 _restrict(params, keep), step=step)
            for j, (x, f) in enumerate(zip(flatten(u)[1], keep)):
                if f:
                    out[j] = x
        return unflatten(spec, out), MultiTransformState(new)

    return GradientTransformation(init, update)


def set_to_zero() -> GradientTransformation:
    """No update at all (for frozen groups in :func:`multi_transform`)."""
    return GradientTransformation(
        lambda params: EmptyState(),
        lambda u, s, p, *, step: (_restrict(u, [False] * len(flatten(u)[1])), s), True)
