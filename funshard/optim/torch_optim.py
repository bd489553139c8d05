"""Any elementwise ``torch.optim`` optimizer on the local shards: ``from_torch(torch.optim.Adam,
lr=1e-3)``. Elementwise means each element's update depends only on that element's gradient
and state (plus per-parameter scalars such as the step count), so running the optimizer on
each rank's shard gives the same numbers as running it on the whole parameter.

Each update builds one torch optimizer over this rank's local shards (as leaf views sharing
their storage), hands it the state as views of the DTensor state (so torch writes into it),
calls ``step()`` and drops it. A leaf torch has not stepped yet gets torch's own initial
state. State: :class:`TorchState`, per torch state key a tree sharded like the params
(elementwise keys) or of 0-dim DTensors replicated on the mesh (per-parameter scalars such
as ``step``), so ``fs.state_dict`` / ``fs.checkpoint`` save it and load it resharded.

    >>> opt = from_torch(torch.optim.Adam, lr=1e-3, foreach=False)   # per leaf: lean memory
    >>> state = opt.init(params)       # TorchState(state={"step": .., "exp_avg": .., ..}, ..)

Inside ``fs.train_step`` torch's Adam and AdamW update with no host read, and the others
with ``select=True`` (:mod:`funshard.optim.torch_gated`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate

from .. import _compat
from .apply import deltas_of
from .base import Optimizer, Tree, counts_tree, flatten, local, materialize, unflatten, zeros_like
from .torch_gated import SELECT, adam_form, counted, counts_of, gated_step, host_counts, on_views
from .traced import Traced

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop",
               "ASGD", "NAdam", "RAdam")
REFUSED = {
    "Adafactor": "its second moment of a matrix is factored into row and column means, which "
                 "need whole rows and columns; a shard holds only some rows",
    "Muon": "it orthogonalises each whole matrix (Newton-Schulz on the full gradient); use "
            "fs.optim.muon, which assembles each matrix on one owner rank",
    "LBFGS": "it needs a closure re-evaluating the loss and keeps a history of the whole "
             "flattened parameter vector (dot products over all elements)",
    "SparseAdam": "it takes sparse gradients; funshard's gradients are dense shards",
}
# fused, their step takes the step's verdict on the device ([Note: torch's fused step gated
# on the device] in funshard.optim.torch_gated)
GATED = (torch.optim.Adam, torch.optim.AdamW)
POINTER = (f"Elementwise torch.optim optimizers work ({', '.join(ELEMENTWISE)}), as do the "
           "fs.optim chains (adamw, sgd, chain(...)) and fs.optim.muon.")


class TorchState(NamedTuple):
    """``state``: per torch state key (``exp_avg``, ``step``, ...) a tree like the params;
    ``stepped``: per leaf a 0-dim int64 count of the steps torch has taken on it; ``count``:
    the same counts on the host (ints), what an update gated on the device forms its
    scalars from ([Note: torch's Adam gated on the device] in
    :mod:`funshard.optim.torch_gated`); a None leaf (or None: a state
    saved before they were kept) is read from ``stepped`` once."""

    state: dict
    stepped: Tree
    count: Tree = None
    _later = ("count",)  # a state dict saved before host counts were kept lacks them


def _check_class(cls: Any, elementwise: bool) -> str:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"from_torch: expected a torch.optim.Optimizer class, got {cls!r}")
    name = cls.__name__
    if name in REFUSED:
        raise ValueError(f"from_torch: torch.optim.{name} is refused: {REFUSED[name]}. {POINTER}")
    if name not in ELEMENTWISE and not elementwise:
        raise ValueError(
            f"from_torch: {cls.__module__}.{name} is not known to be elementwise, and on shards a "
            "non-elementwise update is silently wrong. If each element's update depends only on "
            f"its own gradient and state, pass elementwise=True. {POINTER}")
    return name


def _replicated(t: torch.Tensor, like: Any) -> Any:
    if isinstance(like, DTensor):
        m = like.device_mesh
        return DTensor.from_local(t, m, [Replicate()] * m.ndim, run_check=False)
    return t


def _probe(cls, kwargs: dict, like: torch.Tensor) -> dict[str, tuple]:
    """Torch's state keys for one parameter, ``{key: (elementwise, scalar's device or None,
    dtype)}``, from one step on a two-element dummy (elementwise keys have its shape)."""
    dummy = torch.zeros(2, dtype=like.dtype, device=like.device)
    dummy.grad = torch.zeros_like(dummy)
    opt = cls([dummy], **{**kwargs, "lr": 0.0} if "lr" in kwargs else kwargs)
    opt.step()
    keys = {}
    for k, v in opt.state[dummy].items():
        if not torch.is_tensor(v) or v.shape not in (dummy.shape, torch.Size([])):
            raise ValueError(f"from_torch: {cls.__name__}'s state {k!r} is {type(v).__name__} "
                             f"{tuple(getattr(v, 'shape', ()))}: neither elementwise nor a scalar "
                             f"tensor, so it cannot be sharded. {POINTER}")
        keys[k] = (v.shape == dummy.shape, v.device if v.shape != dummy.shape else None, v.dtype)
    return keys


def _gate(cls, fixed: dict, lr, fused: bool, select: bool) -> tuple[bool, Any]:
    """Whether the step gates ``cls`` on the device, and how (:func:`gated_step`'s
    ``form``): torch's fused Adam by its kernel's found_inf (None), its foreach Adam as
    funshard's ops (:func:`adam_form`), any other selected where asked (``SELECT``)."""
    if cls in GATED and fused:
        return True, None
    form = adam_form(cls, fixed, lr) if cls in GATED else None
    if form is None and select:
        _selectable(cls, fixed)
        form = SELECT
    return form is not None, form


def _selectable(cls, fixed: dict) -> None:
    """Refuse, naming why, a ``cls`` whose step cannot be selected on the device ([Note: any
    torch step selected on the device] in :mod:`funshard.optim.torch_gated`): a
    per-parameter scalar other than its step count (NAdam's running product, ASGD's
    averaging scalars)."""
    keys = _probe(cls, fixed, torch.zeros(1, device="cpu"))
    other = [k for k, (elem, _, _) in keys.items() if not elem and k != "step"]
    if other:
        raise ValueError(
            f"from_torch: select=True cannot select torch.optim.{cls.__name__}'s step on the "
            f"device: its state {other} holds per-parameter scalars that are not its step "
            "count, which its step keeps on the host. Leave select off (the step reads its "
            "verdict before the update).")


def _init(keys_for, params: Tree) -> TorchState:
    """The state torch makes before its first step: zeros (``keys_for(p)``: its keys)."""
    _, leaves, spec = flatten(params)
    live = [p for p in leaves if p is not None and p.requires_grad]
    keys = keys_for(live[0]) if live else {}
    state = {}
    for k, (elem, dev, dtype) in keys.items():
        state[k] = unflatten(spec, [None if p is None or not p.requires_grad else
                                    zeros_like(p) if elem else
                                    _replicated(torch.zeros((), dtype=dtype,
                                                            device=local(p).device), p)
                                    for p in leaves])
    stepped = unflatten(spec, [None if p is None or not p.requires_grad else
                               _replicated(torch.zeros((), dtype=torch.int64,
                                                       device=local(p).device), p)
                               for p in leaves])
    return TorchState(state, stepped, counts_tree(params))


def from_torch(cls, *, elementwise: bool = False, select: bool = False, **kwargs) -> Optimizer:
    """Run ``cls(params, **kwargs)`` on each rank's local shards.

    Args:
        cls: an elementwise ``torch.optim.Optimizer`` class (Adam, AdamW, SGD, RMSprop, ...).
            Adafactor, Muon, LBFGS and SparseAdam are refused with the reason.
        elementwise: vouch that a class not in :data:`ELEMENTWISE` is elementwise.
        select: inside ``fs.train_step``, run torch's step whatever the step's verdict and
            keep its result, or the old values, on the device: no host read, for a copy and
            a select of each tensor the step writes (NAdam and ASGD are refused). Without it
            the step reads its verdict first (Adam and AdamW need it only with the options
            below).
        kwargs: the optimizer's arguments; ``lr`` may be a schedule ``step -> lr``.
    Returns:
        An :class:`Optimizer` (its ``update`` donates params and state), state
        :class:`TorchState`. ``foreach=False`` or ``fused=True`` keep the transients to one
        leaf's size. Adam and AdamW update inside ``fs.train_step`` with no host read
        ([Note: torch's fused step gated on the device], [Note: torch's Adam gated on the
        device] in :mod:`funshard.optim.torch_gated`), but with ``amsgrad``, ``maximize``,
        ``capturable``, ``differentiable`` or ``foreach=False``; so do the others with
        ``select`` ([Note: any torch step selected on the device]).
    """
    _check_class(cls, elementwise)
    lr = kwargs.get("lr")
    fixed = {k: v for k, v in kwargs.items() if not (k == "lr" and callable(v))}
    probed: dict = {}

    def keys_for(p: torch.Tensor) -> dict:
        if "keys" not in probed:
            probed["keys"] = _probe(cls, fixed, local(p))
        return probed["keys"]

    init = functools.partial(_init, keys_for)

    def update(grads: Tree, state: TorchState, params: Tree, *, step: int):
        spec, _, p_leaves, deltas = deltas_of(grads, params, step)
        idx = [i for i, d in enumerate(deltas) if d is not None]
        if idx:
            host = host_counts(state, idx)
            _step(cls, fixed, lr, step, keys_for(p_leaves[idx[0]]), state, p_leaves, deltas, idx,
                  host)
            state = counted(state, idx, host)
        return unflatten(spec, p_leaves), state

    gates, form = _gate(cls, fixed, lr, kwargs.get("fused") is True, select)
    if not gates:
        return Optimizer(init, update)
    gated = functools.partial(gated_step, cls, fixed, lr, keys_for, form)
    return Optimizer(init, update, traced=Traced("torch", lr, (gated,), 0.0, False))


def _step(cls, fixed: dict, lr, step: int, keys: dict, state: TorchState, p_leaves: list,
          deltas: list, idx: list[int], host: dict) -> None:
    """One torch ``step()`` over the local shards of the leaves with a gradient (``host``:
    each one's count of torch's steps before it)."""
    s_leaves = {k: flatten(t)[1] for k, t in state.state.items()}
    counts = counts_of(state, idx)
    opt, views = on_views(cls, fixed, lr, step, p_leaves,
                           {i: materialize(deltas[i], p_leaves[i]) for i in idx})
    started = [host[i] for i in idx]
    ours = {i: {k: local(s_leaves[k][i]) for k in keys} for i in idx}
    # a scalar torch keeps elsewhere (Adam's step on the CPU for a GPU parameter) crosses
    # once per key for all leaves, not once per leaf: each crossing is a device sync
    moved = {k: dev for k, (_, dev, _) in keys.items()
             if dev is not None and idx and ours[idx[0]][k].device != dev}
    stepped = [i for i, n in zip(idx, started) if n > 0]
    there = {k: torch.stack([ours[i][k] for i in stepped]).to(dev).unbind() if stepped else ()
             for k, dev in moved.items()}
    j = 0
    for v, i, n in zip(views, idx, started):
        if n > 0:
            opt.state[v] = {k: there[k][j] if k in moved else t for k, t in ours[i].items()}
            j += 1
    opt.step()
    with torch.no_grad():
        for k in moved:  # back in one crossing, then one copy into every leaf's scalar
            back = torch.stack([opt.state[v][k] for v in views]).to(ours[idx[0]][k].device)
            _compat.foreach_copy_([ours[i][k] for i in idx], list(back.unbind()))
        for v, i in zip(views, idx):
            for k, t in ours[i].items():
                theirs = opt.state[v][k]
                if k not in moved and theirs is not t:
                    t.copy_(theirs)
            v.grad = None
        _compat.foreach_add_([local(counts[i]) for i in idx], 1)
