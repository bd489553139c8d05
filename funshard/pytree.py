"""Pytrees for funshard: optree under the ``"funshard"`` namespace, keyed by FQN strings.

Tensors and DTensors are leaves; dicts, lists, tuples, NamedTuples and ``None`` are nodes.
Dicts keep their insertion order (``named_parameters()`` order), not sorted order, so
flattening a parameter dict walks the model front to back.

    >>> paths, leaves, spec = flatten_with_path({"layers": [{"w": w0}, {"w": w1}]})
    >>> [fqn(p) for p in paths]
    ['layers.0.w', 'layers.1.w']
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import optree
import torch
from torch import nn

NAMESPACE = "funshard"

Tree = Any
Path = tuple


class TreeMismatchError(ValueError):
    """Two trees that must have the same structure do not."""


def _ordered():
    return optree.dict_insertion_ordered(True, namespace=NAMESPACE)


def flatten(tree: Tree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves in order and the tree's structure. A flat dict of tensors (a parameter dict,
    flattened a few times per step) takes its values as they are and a structure cached per
    key tuple: about 2 us for 100 leaves against optree's 25."""
    if type(tree) is dict and len(tree) >= 8:
        leaves = list(tree.values())
        if all(issubclass(t, torch.Tensor) for t in set(map(type, leaves))):
            return leaves, _dict_spec(tuple(tree))
    with _ordered():
        return optree.tree_flatten(tree, namespace=NAMESPACE)


@functools.lru_cache(maxsize=64)
def _dict_spec(keys: tuple) -> optree.PyTreeSpec:
    """The structure of a dict with these keys (in this order) whose values are leaves."""
    with _ordered():
        return optree.tree_structure(dict.fromkeys(keys, 0), namespace=NAMESPACE)


def flatten_with_path(tree: Tree) -> tuple[list[Path], list[Any], optree.PyTreeSpec]:
    """Paths (tuples of keys), leaves and structure, in the same order."""
    with _ordered():
        return optree.tree_flatten_with_path(tree, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: Iterable[Any]) -> Tree:
    """The inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, list(leaves))


def leaves(tree: Tree) -> list[Any]:
    return flatten(tree)[0]


def tree_map(fn: Callable, tree: Tree, *rest: Tree) -> Tree:
    """``fn`` over corresponding leaves; ``rest`` must have ``tree``'s structure."""
    for i, other in enumerate(rest):
        check_same_structure(tree, other, names=("tree", f"rest[{i}]"))
    with _ordered():
        return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def plain_map(fn: Callable, tree: Tree) -> Tree:
    """``fn`` over the leaves of nested dicts, lists and tuples (named tuples too), in plain
    Python: what a function ``torch.compile`` traces uses, where optree is opaque to it."""
    if isinstance(tree, dict):
        return {k: plain_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [plain_map(fn, v) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return fn(tree)


def fqn(path: Path) -> str:
    """``('layers', 3, 'attn.wq')`` -> ``'layers.3.attn.wq'``; the root is ``'<root>'``."""
    return ".".join(str(k) for k in path) if path else "<root>"


def fqn_dict(tree: Tree) -> dict[str, Any]:
    """A flat ``{fqn: leaf}`` dict of any tree; nested keys are joined with dots."""
    paths, lvs, _ = flatten_with_path(tree)
    out: dict[str, Any] = {}
    for p, leaf in zip(paths, lvs):
        key = fqn(p)
        if key in out:
            raise ValueError(
                f"two leaves flatten to the FQN {key!r}; rename a key so that dotted paths "
                "are unique"
            )
        out[key] = leaf
    return out


def from_fqn_dict(flat: dict[str, Any], like: Tree) -> Tree:
    """Put a flat ``{fqn: leaf}`` dict back into ``like``'s structure."""
    paths, _, spec = flatten_with_path(like)
    keys = [fqn(p) for p in paths]
    missing = [k for k in keys if k not in flat]
    extra = sorted(set(flat) - set(keys))
    if missing or extra:
        raise TreeMismatchError(
            f"FQN dict does not match the tree: missing keys {missing[:8]}, unexpected keys "
            f"{extra[:8]} ({len(missing)} missing, {len(extra)} unexpected)"
        )
    return unflatten(spec, [flat[k] for k in keys])


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    """The flat FQN dict of ``module.named_parameters()``; a tied parameter appears once.

    Example: ``fs.params(nn.Linear(3, 2))`` -> ``{'weight': (2, 3), 'bias': (2,)}``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"params() takes an nn.Module, got {type(module).__name__}")
    return dict(module.named_parameters())


def buffers(module: nn.Module, *, persistent: bool = True) -> dict[str, torch.Tensor]:
    """The flat FQN dict of ``module``'s buffers that its ``state_dict`` holds (BatchNorm's
    running statistics; ``persistent=False`` adds the non-persistent ones); a shared buffer
    appears once. Give them to ``step.init(params, buffers)``, not to ``fs.shard``.

    Example: ``fs.buffers(nn.BatchNorm1d(3))`` -> ``{'running_mean': (3,), 'running_var':
    (3,), 'num_batches_tracked': ()}``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"buffers() takes an nn.Module, got {type(module).__name__}")
    keep = set(module.state_dict(keep_vars=True))
    return {name: b for name, b in module.named_buffers() if persistent is False or name in keep}


def _node(tree: Tree):
    """(kind, entries, children) of one level, or None for a leaf."""
    with _ordered():
        if optree.tree_is_leaf(tree, namespace=NAMESPACE):
            return None
        out = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    return type(tree), tuple(out.entries), list(out.children)


def first_difference(
    a: Tree, b: Tree, path: Path = (), *, names: tuple[str, str] = ("a", "b")
) -> tuple[Path, str] | None:
    """The first path where ``a`` and ``b`` differ in structure, and how; None if equal."""
    na, nb = _node(a), _node(b)
    if na is None or nb is None:
        if na is None and nb is None:
            return None
        which = "a leaf" if na is None else f"a {type(a).__name__} node"
        other = "a leaf" if nb is None else f"a {type(b).__name__} node"
        return path, f"{names[0]} has {which}, {names[1]} has {other}"
    (ta, ea, ca), (tb, eb, cb) = na, nb
    if ta is not tb:
        return path, f"{names[0]} has a {ta.__name__}, {names[1]} has a {tb.__name__}"
    if ea != eb:
        if len(ea) != len(eb) and not isinstance(a, dict):
            return path, f"{names[0]} has {len(ea)} children, {names[1]} has {len(eb)}"
        only_a = [k for k in ea if k not in eb]
        only_b = [k for k in eb if k not in ea]
        if only_a or only_b:
            return path, (
                f"keys only in {names[0]}: {only_a[:8]}; keys only in {names[1]}: {only_b[:8]}"
            )
        return path, f"children {list(ea)[:8]} vs {list(eb)[:8]}"
    for key, x, y in zip(ea, ca, cb):
        found = first_difference(x, y, path + (key,), names=names)
        if found is not None:
            return found
    return None


def check_same_structure(a: Tree, b: Tree, *, names: tuple[str, str] = ("a", "b")) -> None:
    """Raise :class:`TreeMismatchError` naming the first differing path on both sides."""
    if flatten(a)[1] == flatten(b)[1]:
        return
    raise _mismatch(a, b, names, "The two trees must have the same keys and nesting (e.g. both "
                    "from fs.params(model)).")


def _mismatch(a: Tree, b: Tree, names: tuple[str, str], fix: str) -> TreeMismatchError:
    found = first_difference(a, b, names=names)
    path, how = found if found is not None else ((), "structures differ")
    return TreeMismatchError(
        f"{names[0]} and {names[1]} differ at {names[0]}[{fqn(path)!r}] vs "
        f"{names[1]}[{fqn(path)!r}]: {how}. {fix}"
    )


def broadcast_prefix(prefix: Tree, tree: Tree, *, name: str = "spec") -> list[Any]:
    """Expand a prefix tree (``prefix``) to one value per leaf of ``tree``.

    A callable prefix is called as ``fn(fqn, leaf)`` for each leaf.
    """
    paths, lvs, _ = flatten_with_path(tree)
    if callable(prefix):
        return [prefix(fqn(p), leaf) for p, leaf in zip(paths, lvs)]
    try:
        with _ordered():
            return optree.broadcast_prefix(prefix, tree, namespace=NAMESPACE)
    except ValueError:  # optree's message prints the whole tree, tensor values and all
        only_prefix, only_tree, other = _prefix_problems(prefix, tree)
        lines = [f"{name} is not a prefix of the tree:"]
        if only_prefix:
            lines.append(f"  paths it names that the tree lacks: {_paths(only_prefix)}")
        if only_tree:
            lines.append(f"  paths of the tree it gives no value for: {_paths(only_tree)}")
        lines += [f"  {x}" for x in other[:3]]
        if len(lines) == 1:
            lines.append("  the structures differ")
        lines.append("Give one value for the whole tree, a tree with the same keys, or a "
                     "callable (fqn, tensor) -> value.")
        raise TreeMismatchError("\n".join(lines)) from None


def _prefix_problems(prefix: Tree, tree: Tree, path: Path = ()) -> tuple[list, list, list]:
    """Where ``prefix`` is not a prefix of ``tree``: the paths only ``prefix`` has, those
    only ``tree`` has, and other differences (node kinds), each a short string."""
    pn, tn = _node(prefix), _node(tree)
    if pn is None:  # a prefix leaf covers any subtree
        return [], [], []
    if tn is None or pn[0] is not tn[0]:
        what = (f"a tensor of shape {tuple(tree.shape)}" if isinstance(tree, torch.Tensor)
                else f"a {type(tree).__name__}") if tn is None else f"a {tn[0].__name__}"
        return [], [], [f"at {fqn(path)!r} it has a {pn[0].__name__}, the tree {what}"]
    (_, pe, pc), (_, te, tc) = pn, tn
    only_prefix = [fqn(path + (k,)) for k in pe if k not in te]
    only_tree = [fqn(path + (k,)) for k in te if k not in pe]
    other: list = []
    children = dict(zip(te, tc))
    for k, child in zip(pe, pc):
        if k in children:
            a, b, c = _prefix_problems(child, children[k], path + (k,))
            only_prefix, only_tree, other = only_prefix + a, only_tree + b, other + c
    return only_prefix, only_tree, other


def _paths(paths: list[str]) -> str:
    more = f" (and {len(paths) - 6} more)" if len(paths) > 6 else ""
    return ", ".join(repr(p) for p in paths[:6]) + more


def leaves_like(tree: Tree, like: Tree, *, names: tuple[str, str] = ("tree", "like")) -> list:
    """``tree``'s subtrees at ``like``'s leaf positions; a ``None`` there stays ``None``.

    For gradient trees, where a frozen parameter's gradient is ``None``.
    """
    spec = flatten(like)[1]
    try:
        with _ordered():
            return spec.flatten_up_to(tree)
    except (ValueError, TypeError):
        pass
    raise _mismatch(tree, like, names, f"{names[0]} must have {names[1]}'s keys and nesting "
                    "(None allowed in place of a leaf).")
