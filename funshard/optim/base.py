"""The two shapes of ``fs.optim``: a :class:`GradientTransformation` and an :class:`Optimizer`.

A ``GradientTransformation(init, update)`` is optax's idea: ``init(params) -> state`` and
``update(updates, state, params, *, step) -> (updates, state)``, pure pieces that
:func:`~funshard.optim.chain` composes. An :class:`Optimizer` is a transformation applied:
``update(grads, state, params, *, step) -> (new_params, new_state)`` (what ``fs.train_step``
calls). State leaves are DTensors sharded like the params (``None`` for frozen leaves), so
``fs.state_dict`` and ``fs.checkpoint`` handle them; the math runs on local shards.

[Note: pending updates] An update travelling down a chain is, per leaf, a :class:`Delta`:
``(numer / divisor) * num / den + wd * (wd_numer / wd_divisor) * param`` with tensors
``num``, ``den`` (or None) and Python scalars. Scalings (learning rate, clipping) and
decoupled weight decay stay scalars until the parameter is written, which then takes torch's
own ops: ``p.mul_(1 - lr * wd); p.addcdiv_(m, denom, value=-lr / bc1)`` for AdamW,
``p.add_(g + wd * p, alpha=-lr)`` for SGD. So the chains give torch.optim's numbers bit for
bit and no update-sized temporary is made. A transform that needs the update's values calls
:func:`materialize` (a plain tensor per leaf); a custom transform may return plain tensors.

[Note: lean updates] No transient of the optimizer is larger than the largest leaf's local
shard or :data:`CHUNK_FLOOR` elements (4 MiB in float32), whichever is larger: Adam's
denominator stays pending too (:class:`RootDen`, ``sqrt(v) / c + eps``), and whatever must
be computed (a pending denominator, a scaled gradient) is computed for one :func:`chunks` of
leaves at a time, with the same foreach ops torch.optim uses (so the numbers stay torch's,
bit for bit). The floor keeps the number of foreach calls (on a GPU, kernel launches) small
where every leaf is small: without it a GPT of 100 leaves of at most 16K elements took 25
runs, 100 foreach calls per update for the denominators alone (measured 2026-11-23); a 4 MiB
transient is nothing beside torch's foreach AdamW, which makes every denominator at once.

Donation rule: like JAX donated buffers, ``Optimizer.update`` modifies the local shards of
``params`` and of ``state`` IN PLACE (under ``torch.no_grad()``) and returns trees sharing
storage with its inputs; do not use the old ``params`` / ``state`` after the call. Parameter
leaves keep their identity. Grads are never modified; transforms must not write into the
tensors of the updates they are given.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from typing import Any, Callable, NamedTuple, Optional, Union

import optree
import torch
from torch.distributed.tensor import DTensor

from .. import _compat

Tree = Any
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]


class GradientTransformation(NamedTuple):
    """``init(params) -> state``, ``update(updates, state, params, *, step) -> (updates, state)``.

    ``stateless=True`` marks a transformation whose state is always ``EmptyState()``; a chain
    leaves such states out of its own. ``form``: what one of fs.optim's own transformations
    does, as a tuple (``("adam", b1, b2, eps, fused)``, ``("chain", forms)``, ...), from
    which a chain of them is recognised as ``adam``, ``adamw`` or ``sgd``
    (:func:`funshard.optim.traced.traced_of`); None: anything else.
    """

    init: Callable[[Tree], Tree]
    update: Callable[..., tuple[Tree, Tree]]
    stateless: bool = False
    form: Any = None


class Optimizer(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params, *, step) -> (params, state)``.

    ``transform`` is the :class:`GradientTransformation` it applies (what ``chain`` composes);
    ``traced``, where the optimizer is one of ``adam``, ``adamw``, ``sgd`` (a chain of their
    members, :func:`funshard.optim.traced.traced_of`) or ``muon``, what it does, in the form
    the step's update program holds (:class:`funshard.optim.traced.Traced`).
    """

    init: Callable[[Tree], Tree]
    update: Callable[..., tuple[Tree, Tree]]
    transform: Optional[GradientTransformation] = None
    traced: Any = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation: no leaves."""


class RootDen(NamedTuple):
    """A pending denominator ``sqrt(v) / scale + eps`` (Adam's), computed when written."""

    v: torch.Tensor
    scale: float
    eps: float


class FusedAdam:
    """Adam's whole update, pending: the moments are not touched until the parameter is
    written, where one ``torch._fused_adamw_`` call updates moments and parameters of every
    such leaf at once ([Note: fused Adam]); ``scale`` is a factor the gradient still owes
    (a clip's). :meth:`realize` turns it into the unfused form (once) for anything else."""

    __slots__ = ("m", "v", "b1", "b2", "eps", "step", "scale", "done")

    def __init__(self, m, v, b1: float, b2: float, eps: float, step: int, scale: float):
        self.m, self.v, self.b1, self.b2, self.eps = m, v, b1, b2, eps
        self.step, self.scale, self.done = step, scale, None

    def realize(self, d: "Delta") -> "Delta":
        """``d`` (whose ``den`` this is) as torch's foreach Adam would leave it: moments
        updated in place, the direction ``m / RootDen(v)`` with its bias corrections."""
        if self.done is None:
            g = d.num if self.scale == 1.0 else torch.mul(d.num, self.scale)
            self.m.lerp_(g, 1 - self.b1)
            self.v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            self.done = (1 - self.b1 ** float(self.step + 1),
                         (1 - self.b2 ** float(self.step + 1)) ** 0.5)
        bc1, bc2 = self.done
        return d.replace(num=self.m, den=RootDen(self.v, bc2, self.eps),
                         divisor=d.divisor * bc1)


def dens(ds: list) -> list:
    """The denominators of deltas ``ds`` (each a tensor or a :class:`RootDen`), as torch's
    foreach Adam computes them: ``sqrt``, ``div_``, ``add_``, one foreach call per scalar pair."""
    out = [d if not isinstance(d, RootDen) else None for d in ds]
    lazy = [j for j, d in enumerate(ds) if isinstance(d, RootDen)]
    for (scale, eps), (pos, vs) in group_by([(ds[j].scale, ds[j].eps) for j in lazy], lazy,
                                            [ds[j].v for j in lazy]):
        t = _compat.foreach_sqrt(vs)
        _compat.foreach_div_(t, scale)
        _compat.foreach_add_(t, eps)
        for j, x in zip(pos, t):
            out[j] = x
    return out


CHUNK_FLOOR = 1 << 20  # elements a run may hold even when every leaf is smaller


def chunks(tensors: list) -> list[list[int]]:
    """Positions of ``tensors`` in runs of at most the largest one's elements or
    :data:`CHUNK_FLOOR` (so a temporary per element of a run is that small: [Note: lean
    updates]), packed first-fit by decreasing size: few runs, so few foreach calls (kernel
    launches on a GPU)."""
    return _packed(tuple(t.numel() for t in tensors))


@functools.lru_cache(maxsize=256)  # the same sizes every step
def _packed(sizes: tuple) -> list[list[int]]:
    limit = max(max(sizes, default=0), CHUNK_FLOOR)
    if sum(sizes) <= limit:
        return [list(range(len(sizes)))]
    runs: list[list[int]] = []
    room: list[int] = []
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        k = next((k for k, r in enumerate(room) if r >= sizes[j]), len(runs))
        if k == len(runs):
            runs.append([])
            room.append(limit)
        runs[k].append(j)
        room[k] -= sizes[j]
    return [sorted(r) for r in runs]


@dataclasses.dataclass(frozen=True, init=False)
class Delta:
    """One leaf's pending update (see [Note: pending updates]); ``num`` is a local tensor.

    Made several times per leaf per step: ``__init__`` and :meth:`replace` fill the frozen
    instance's ``__dict__`` at once (0.37 us against the generated ``__init__``'s 0.82 us)."""

    num: torch.Tensor
    den: Optional[Union[torch.Tensor, RootDen]] = None
    numer: float = 1.0
    divisor: float = 1.0
    wd: float = 0.0
    wd_numer: float = 1.0
    wd_divisor: float = 1.0
    final: bool = False  # a finished direction (Muon's): weight decay after it is decoupled

    def __init__(self, num: torch.Tensor, den=None, numer: float = 1.0, divisor: float = 1.0,
                 wd: float = 0.0, wd_numer: float = 1.0, wd_divisor: float = 1.0,
                 final: bool = False):
        self.__dict__.update(num=num, den=den, numer=numer, divisor=divisor, wd=wd,
                             wd_numer=wd_numer, wd_divisor=wd_divisor, final=final)

    @property
    def plain(self) -> bool:
        return self.den is None and self.numer == 1.0 and self.divisor == 1.0 and self.wd == 0.0

    @property
    def coupled(self) -> bool:
        """Weight decay added to the raw update before any scaling (SGD's L2 penalty)."""
        return (self.den is None and not self.final
                and (self.wd_numer, self.wd_divisor) == (self.numer, self.divisor))

    def scaled(self, factor: float) -> "Delta":
        return self.replace(numer=self.numer * factor, wd_numer=self.wd_numer * factor)

    def replace(self, **fields) -> "Delta":
        """``dataclasses.replace`` without its per-call checks (once per leaf per transform)."""
        new = object.__new__(Delta)
        d = new.__dict__
        d.update(self.__dict__)
        d.update(fields)
        return new


# -- trees ------------------------------------------------------------------------------


def is_none(x: Any) -> bool:
    return x is None


def flatten(tree: Tree) -> tuple[list, list, Any]:
    """Paths, leaves and structure, ``None`` kept as a leaf so trees with holes stay aligned.

    A flat dict of leaves (``fs.params``' FQN dicts: every tree an update flattens about ten
    times) takes a cached layout of its keys: 4 us for 100 leaves against optree's 27.
    The paths list is shared between calls: read it, do not change it."""
    if type(tree) is dict and len(tree) >= 8:
        take, paths, spec = _dict_layout(tuple(tree))
        leaves = list(take(tree))
        if all(_is_leaf_type(t) for t in set(map(type, leaves))):
            return paths, leaves, spec
    return optree.tree_flatten_with_path(tree, is_leaf=is_none, none_is_leaf=False,
                                         namespace="funshard")


@functools.lru_cache(maxsize=64)
def _is_leaf_type(t: type) -> bool:
    """A leaf for optree in every namespace: None, an int (Adam's counts), a tensor, a
    :class:`Delta`."""
    return t is type(None) or t is int or issubclass(t, (torch.Tensor, Delta))


@functools.lru_cache(maxsize=64)
def _dict_layout(keys: tuple) -> tuple[Callable, list, Any]:
    """For a dict with these keys whose values are all leaves: a getter of its values in
    optree's order, the paths and the structure (found once, by flattening such a dict)."""
    paths, _, spec = optree.tree_flatten_with_path(dict.fromkeys(keys, 0), namespace="funshard")
    return operator.itemgetter(*[p[0] for p in paths]), paths, spec


def unflatten(spec: Any, leaves: list) -> Tree:
    return optree.tree_unflatten(spec, leaves)


def path_str(path: tuple) -> str:
    return ".".join(str(k) for k in path) if path else "<root>"


def local(t: torch.Tensor) -> torch.Tensor:
    return _compat.local_tensor(t) if isinstance(t, DTensor) else t


def locals_of(ts: list) -> list:
    """:func:`local` of each (one comprehension: several hundred per update)."""
    return [_compat.local_tensor(t) if isinstance(t, DTensor) else t for t in ts]


def zeros_like(p: Any) -> Any:
    """Zero state sharded like ``p``; ``None`` for frozen (requires_grad=False) or absent ``p``."""
    if p is None or not p.requires_grad:
        return None
    z = torch.zeros_like(local(p).detach(), memory_format=torch.preserve_format)
    if isinstance(p, DTensor):
        return DTensor.from_local(z, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return z


def zeros_tree(params: Tree) -> Tree:
    return optree.tree_map(zeros_like, params, is_leaf=is_none, none_is_leaf=False,
                           namespace="funshard")


def counts_tree(params: Tree) -> Tree:
    """0 per trainable leaf (a count of updates), ``None`` where :func:`zeros_like` is."""
    return optree.tree_map(lambda p: None if p is None or not p.requires_grad else 0, params,
                           is_leaf=is_none, none_is_leaf=False, namespace="funshard")


def advance_counts(count: Tree, n: int, idx: list[int], step: int) -> tuple[list, Tree]:
    """Each of the ``n`` leaves' updates before this one, and ``count`` with one more for the
    leaves at ``idx`` (those updated now). A ``count`` of None (a state made before counts
    were kept) stays None, and every leaf has had ``step`` updates."""
    if count is None:
        return [step] * n, None
    _, prior, spec = flatten(count)
    counts = list(prior)
    for i in idx:
        counts[i] += 1
    return prior, unflatten(spec, counts)


def check_held(paths: list, idx: list[int], held: list) -> None:
    """Every leaf at ``idx`` (given an update) has its optimizer state in ``held``."""
    missing = [i for i in idx if held[i] is None]
    if missing:
        raise ValueError(f"an update reached leaf {path_str(paths[missing[0]])}, which has no "
                         "optimizer state (it was frozen or absent at init)")


def as_delta(u: Any) -> Optional[Delta]:
    """A transform's output leaf as a Delta: plain tensors (a custom transform's) are wrapped."""
    if u is None or isinstance(u, Delta):
        return u
    return Delta(local(u))


def materialize(d: Optional[Delta], p: Any) -> Optional[torch.Tensor]:
    """The update's values as one local tensor (``d.num`` itself when nothing is pending)."""
    d = as_delta(d)
    if d is None or d.plain:
        return None if d is None else d.num
    if isinstance(d.den, FusedAdam):
        d = d.den.realize(d)
    s = d.numer / d.divisor
    # one new tensor, then in place (the values of torch.add / mul / div, without a second one)
    if d.coupled and d.wd != 0.0:  # SGD's L2 penalty: g + wd * p, as torch adds it
        t = torch.add(d.num, local(p), alpha=d.wd)
        return t if s == 1.0 else t.mul_(s)
    if d.den is None:
        t = d.num if s == 1.0 else torch.mul(d.num, s)
    elif isinstance(d.den, RootDen):
        den = dens([d.den])[0]
        t = torch.div(d.num, den, out=den)
    else:
        t = torch.div(d.num, d.den)
    if s != 1.0 and d.den is not None:
        t.mul_(s)
    if d.wd != 0.0:
        wd = d.wd * (d.wd_numer / d.wd_divisor)
        t = torch.add(t, local(p), alpha=wd) if t is d.num else t.add_(local(p), alpha=wd)
    return t


def group_by(keys: list, *lists: list) -> list[tuple[Any, list[list]]]:
    """Split parallel lists by a key per position: ``[(key, [sublist per list]), ...]``."""
    if keys and keys.count(keys[0]) == len(keys):  # the usual case: one key for all
        return [(keys[0], [list(lst) for lst in lists])]
    out: dict[Any, list[list]] = {}
    for j, k in enumerate(keys):
        g = out.setdefault(k, [[] for _ in lists])
        for i, lst in enumerate(lists):
            g[i].append(lst[j])
    return list(out.items())


def check(name: str, value: float, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (valid range: {valid})")


def check_lr(lr: ScalarOrSchedule) -> None:
    if not callable(lr):
        check("lr", lr, float(lr) >= 0.0, "lr >= 0")


def lr_at(lr: ScalarOrSchedule, step: int) -> float:
    value = float(lr(step)) if callable(lr) else float(lr)
    check(f"lr (schedule value at step {step})", value, value >= 0.0, "lr >= 0")
    return value


def per_leaf(spec_tree: Any, params: Tree, what: str) -> list:
    """A value per params leaf from a callable ``fqn -> value`` or a (prefix) tree of values."""
    paths, leaves, _ = flatten(params)
    if callable(spec_tree):
        try:
            two = len(inspect.signature(spec_tree).parameters) == 2
        except (TypeError, ValueError):
            two = False
        return [spec_tree(path_str(p), x) if two else spec_tree(path_str(p))
                for p, x in zip(paths, leaves)]
    try:
        full = optree.tree_broadcast_prefix(spec_tree, params, is_leaf=is_none,
                                            none_is_leaf=False, namespace="funshard")
    except ValueError as e:
        raise ValueError(f"{what}: the tree of {what}s is not a prefix of the params tree "
                         f"(leaves {[path_str(p) for p in paths[:4]]}...): {e}") from None
    return flatten(full)[1]


def mask_flags(mask: Union[Tree, Callable[[str], bool]], params: Tree) -> list[bool]:
    """``mask``'s flag per params leaf (see :func:`funshard.optim.combine.masked`); a flag
    that is not a bool is refused, naming its leaf."""
    flags = per_leaf(mask, params, "mask")
    for p, f in zip(flatten(params)[0], flags):
        if not isinstance(f, bool):
            raise TypeError(f"masked: the mask at {path_str(p)} is {f!r}; use True or False")
    return flags
