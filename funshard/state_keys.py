"""A tree's state-dict keys, and the keys a state dict saved before a field existed lacks.

Keys are FQNs, NamedTuple fields by name (``params.<fqn>``, ``opt_state.exp_avg.<fqn>``,
``step``); ``None`` leaves have none. A field added to a saved structure after states were
saved has a fill for loading those states (:func:`later_fields`): for a NamedTuple that names
it in ``_later``, None, "not known" (``TorchState.count``: read from the state's tensors);
in a TrainState, ``skipped`` and the loss scale.
"""

from __future__ import annotations

from typing import Any

from . import pytree

Tree = Any


def _flat(tree: Tree) -> tuple[list[str], list[Any], Any]:
    """Keys (FQNs, NamedTuple fields by name), leaves and structure; None leaves skipped.
    A step's state is read through its fields (optree reads a tuple's items directly):
    its checks settled, refused once donated, its counts as corrected (``funshard.step``'s
    donation and deferred modules)."""
    if isinstance(tree, tuple) and hasattr(tree, "_donated_to"):
        tree = type(tree)._make(tree)
    paths, leaves, spec = pytree.flatten_with_path(tree)
    keys = [_key(tree, path)[0] for path in paths]
    seen = set()
    for k in keys:
        if k in seen:
            raise ValueError(f"two leaves flatten to the key {k!r}; rename a key so that dotted "
                             "paths are unique")
        seen.add(k)
    return keys, leaves, spec


def _key(tree: Tree, path: tuple) -> tuple[str, bool]:
    """The key of the leaf at ``path``, and whether it is in a field that a state dict saved
    before the field existed lacks (a NamedTuple's ``_later``: a field whose None means "not
    known", such as ``TorchState.count``)."""
    node, parts, later = tree, [], False
    for k in path:
        fields = getattr(node, "_fields", None) if isinstance(node, tuple) else None
        parts.append(fields[k] if fields is not None else str(k))
        later = later or (fields is not None and fields[k] in getattr(node, "_later", ()))
        try:
            node = node[k]
        except (TypeError, KeyError, IndexError):
            node = None
    return (".".join(parts) if parts else "<root>"), later


SCALE = "loss_scale."  # the keys of a TrainState's loss scale (see later_fields)


def later_fields(like: Tree, like_sd: dict) -> dict[str, Any]:
    """The keys that a state dict or checkpoint may lack, and their value then: a field a
    NamedTuple names in ``_later`` (None: not known; ``TorchState.count``, read from the
    state's own tensors); in a TrainState ``skipped`` (0: states saved before it existed
    counted every step in the optimizer's) and ``loss_scale`` (like's: a run saved without
    loss scaling resumed with it starts where the Policy starts)."""
    if isinstance(like, tuple) and hasattr(like, "_donated_to"):
        like = type(like)._make(like)
    unknown = {k: None for k, later in (_key(like, path) for path in
                                        pytree.flatten_with_path(like)[0]) if later}
    fields = getattr(like, "_fields", ()) if isinstance(like, tuple) else ()
    if "params" not in fields or "skipped" not in fields:
        return unknown
    return {"skipped": 0, **unknown,
            **{k: v for k, v in like_sd.items() if k.startswith(SCALE)}}


def with_later_fields(sd: dict, like: Tree, like_sd: dict) -> dict:
    """``sd`` with the :func:`later_fields` it lacks filled in, and without a loss scale
    ``like`` has none of (a run saved with loss scaling resumed without it)."""
    later = later_fields(like, like_sd)
    if not later:
        return sd
    return {**{k: v for k, v in later.items() if k not in sd},
            **{k: v for k, v in sd.items() if k in like_sd or not k.startswith(SCALE)}}
