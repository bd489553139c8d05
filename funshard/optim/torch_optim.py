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

[Note: torch's fused step gated on the device] Inside ``fs.train_step`` the step's verdict
(the loss and norm finite, the ranks agreeing; the clip factor) stays on the device until
the caller reads it ([Note: a step that reads nothing] in :mod:`funshard.step.deferred`).
Most torch optimizers cannot take it there: their step is host code over in-place ops, so
the step reads the verdict first. ``torch.optim.Adam`` and ``AdamW`` with ``fused=True``
can: their kernel takes a ``found_inf`` tensor and, where it is nonzero, writes nothing
and takes its step count back, which is how ``torch.amp.GradScaler`` skips a step without
a sync. :func:`gated_step` hands it the step's verdict that way (and the clip factor as a
device scalar that multiplies the gradients), so such an optimizer updates with no host
read; its numbers are those of the same optimizer after a read, bit for bit. It gives the
fused kernel its state for every leaf from the first step (zeros, what torch would make),
so the update does not read which leaves torch has stepped either. A leaf this rank's loss
did not reach gets its own call, under its own flag ([Note: a leaf in doubt] in
:mod:`funshard.step.update_program`). ``torch.optim.SGD(fused=True)`` is not gated so: where its
kernel skips a first step, the momentum buffers torch made for that step stay unwritten and
the next step reads them as momentum (torch 2.13), so it reads the verdict first, as every
other optimizer does.

[Note: torch's Adam gated on the device] torch's foreach Adam and AdamW (``foreach`` not
False, not fused; no amsgrad, maximize, capturable or differentiable) take no verdict: their
step reads each leaf's step count on the host to form its bias corrections. Their ops are
those of funshard's own ``adam`` (``lerp``, ``mul``, ``addcmul``, ``sqrt``, ``div``, ``add``,
``addcdiv``, and AdamW's ``mul`` by ``1 - lr * wd``), and so are their Python scalars
(``(lr / (1 - b1 ** n)) * -1``, ``(1 - b2 ** n) ** 0.5``), so inside ``fs.train_step`` such an
optimizer runs as :func:`funshard.optim.gated.adam_eager` ([Note: an update gated on the
device]): the same ops, gated on the step's verdict, their scalars from the counts the host
keeps in :class:`TorchState` (``count``), advanced as each update is issued and corrected
where a verdict reads the step skipped (as ``fs.optim.adam``'s counts are). The counts on
the device (``stepped`` and torch's ``step``) advance where the verdict holds, so the state
is the one torch would hold, and torch's own step can take it up at any step (the reading
path, ``fs.optim.apply``). A state saved before host counts were kept reads them once from
``stepped``. Its numbers are torch's bit for bit (a test compares them); on CPU torch's
default for CPU tensors (``foreach=None``) is its per-tensor loop, whose ops are the same.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate

from .. import _compat
from .apply import deltas_of
from .base import (Optimizer, Tree, counts_tree, flatten, local, lr_at, materialize, unflatten,
                   zeros_like)
from .gated import _Gate as Gate, adam_eager
from .traced import Traced, _row as row_of, clip_factor

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
# on the device])
GATED = (torch.optim.Adam, torch.optim.AdamW)
POINTER = (f"Elementwise torch.optim optimizers work ({', '.join(ELEMENTWISE)}), as do the "
           "fs.optim chains (adamw, sgd, chain(...)) and fs.optim.muon.")


class TorchState(NamedTuple):
    """``state``: per torch state key (``exp_avg``, ``step``, ...) a tree like the params;
    ``stepped``: per leaf a 0-dim int64 count of the steps torch has taken on it; ``count``:
    the same counts on the host (ints), what an update gated on the device forms its
    scalars from ([Note: torch's Adam gated on the device]); a None leaf (or None: a state
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


def from_torch(cls, *, elementwise: bool = False, **kwargs) -> Optimizer:
    """Run ``cls(params, **kwargs)`` on each rank's local shards.

    Args:
        cls: an elementwise ``torch.optim.Optimizer`` class (Adam, AdamW, SGD, RMSprop, ...).
            Adafactor, Muon, LBFGS and SparseAdam are refused with the reason.
        elementwise: vouch that a class not in :data:`ELEMENTWISE` is elementwise.
        kwargs: the optimizer's arguments; ``lr`` may be a schedule ``step -> lr``.
    Returns:
        An :class:`Optimizer` (its ``update`` donates params and state), state
        :class:`TorchState`. ``foreach=False`` or ``fused=True`` keep the transients to one
        leaf's size. Adam and AdamW update inside ``fs.train_step`` with no host read
        ([Note: torch's fused step gated on the device], [Note: torch's Adam gated on the
        device]), but with ``amsgrad``, ``maximize``, ``capturable``, ``differentiable`` or
        ``foreach=False``.
    """
    _check_class(cls, elementwise)
    lr = kwargs.get("lr")
    fixed = {k: v for k, v in kwargs.items() if not (k == "lr" and callable(v))}
    probed: dict = {}

    def keys_for(p: torch.Tensor) -> dict:
        if "keys" not in probed:
            probed["keys"] = _probe(cls, fixed, local(p))
        return probed["keys"]

    def init(params: Tree) -> TorchState:
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

    def update(grads: Tree, state: TorchState, params: Tree, *, step: int):
        spec, _, p_leaves, deltas = deltas_of(grads, params, step)
        idx = [i for i, d in enumerate(deltas) if d is not None]
        if idx:
            host = _host_counts(state, idx)
            _step(cls, fixed, lr, step, keys_for(p_leaves[idx[0]]), state, p_leaves, deltas, idx,
                  host)
            state = _counted(state, idx, host)
        return unflatten(spec, p_leaves), state

    form = _adam_form(cls, fixed, lr) if cls in GATED else None
    if form is None and (cls not in GATED or kwargs.get("fused") is not True):
        return Optimizer(init, update)
    gated = functools.partial(gated_step, cls, fixed, lr, keys_for, form)
    return Optimizer(init, update, traced=Traced("torch", lr, (gated,), 0.0, False))


def gated_step(cls, fixed: dict, lr, keys_for, form, t: Traced, grads: list,
               state: TorchState, params: Tree, *, step: int, norm, dev, reach) -> TorchState:
    """A fused ``cls`` step over the leaves with a gradient (``grads``, aligned with the
    params' leaves), or, where ``form`` (:func:`_adam_form`) is given, torch's foreach Adam
    step as funshard's own ops, skipped on the device where the step's verdict ``dev``
    (``(clip factor, ok)``) says; or, where ``dev`` is None, clipped by the host's ``norm``.
    ``reach``: per leaf no rank may have reached, whether some rank did (a device flag). See
    [Note: torch's fused step gated on the device], [Note: torch's Adam gated on the
    device]."""
    spec = flatten(params)[2]
    _, _, p_leaves, deltas = deltas_of(unflatten(spec, list(grads)), params, step)
    idx = [i for i, d in enumerate(deltas) if d is not None]
    if not idx:
        return state
    keys, counts = keys_for(p_leaves[idx[0]]), _counts(state, idx)
    g = {i: materialize(deltas[i], p_leaves[i]) for i in idx}
    if dev is not None:
        if t.clip is not None:  # (g: the step's own gradients, in place)
            _compat.foreach_mul_(list(g.values()), dev[0])
        ok = dev[1] > 0
    else:
        ok, coef = None, clip_factor(t, norm)
        g = {i: x if coef >= 1.0 else torch.mul(x, coef) for i, x in g.items()}
    doubt = [i for i in idx if reach and i in reach]
    calls = [([i for i in idx if i not in doubt], ok)] + [
        ([i], ok & reach[i] if ok is not None else reach[i]) for i in doubt]
    s_leaves = {k: flatten(v)[1] for k, v in state.state.items()}
    if form is not None:
        host = _host_counts(state, idx)
        now = lr_at(form[-1] if lr is None else lr, step)  # (None: torch's default)
        _foreach_adam(form, now, calls, g, p_leaves, s_leaves, host, counts)
        return _counted(state, idx, host)
    for part, gate in calls:
        if not part:
            continue
        opt, views = _on_views(cls, fixed, lr, step, p_leaves, {i: g[i] for i in part})
        for v, i in zip(views, part):  # torch's own initial state is zeros: so is ours
            opt.state[v] = {k: local(s_leaves[k][i]) for k in keys}
        mine = [local(counts[i]) for i in part]
        if gate is not None:
            opt.found_inf = (~gate).to(torch.float32)
        opt.step()
        with torch.no_grad():
            _compat.foreach_add_(mine, 1 if gate is None else gate.to(mine[0].dtype))
        for v in views:
            v.grad = None
    return _counted(state, idx)


def _adam_form(cls, fixed: dict, lr) -> tuple | None:
    """``(b1, b2, eps, weight decay, decoupled, lr)`` of a torch Adam or AdamW whose step is
    the foreach one funshard's gated ops repeat ([Note: torch's Adam gated on the device]):
    not fused, foreach not refused, Python numbers for its hyperparameters, none of amsgrad,
    maximize, capturable, differentiable; else None. ``lr``: the caller's (a schedule, or
    None: torch's default)."""
    dummy = torch.zeros(2, requires_grad=True)
    d = cls([dummy], **({**fixed, "lr": 0.0} if callable(lr) else fixed)).defaults
    if (d.get("fused") or d.get("foreach") is False or d.get("amsgrad") or d.get("maximize")
            or d.get("capturable") or d.get("differentiable")):
        return None
    (b1, b2), eps, wd = d["betas"], d["eps"], d["weight_decay"]
    if not all(type(x) in (int, float) for x in (b1, b2, eps, wd, d["lr"])):
        return None
    decoupled = d.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW))
    return float(b1), float(b2), float(eps), float(wd), bool(decoupled), float(d["lr"])


def _foreach_adam(form: tuple, lr: float, calls: list, g: dict, p_leaves: list,
                  s_leaves: dict, host: dict, counts: list) -> None:
    """torch's foreach Adam (AdamW) step as :func:`funshard.optim.gated.adam_eager`'s ops,
    one call per ``(leaves, gate)`` of ``calls``, its scalars from each leaf's count on the
    host (``host``), the step counts on the device advanced where the gate holds."""
    b1, b2, eps, wd, decoupled, _ = form
    t = Traced("adam", lr, (b1, b2, eps), wd, decoupled)
    steps = s_leaves.get("step")
    for part, gate in calls:
        if not part:
            continue
        ok = torch.ones((), dtype=torch.bool, device=g[part[0]].device) if gate is None else gate
        rows: dict[int, list] = {}
        for i in part:
            rows.setdefault(host[i], []).append(i)
        groups = tuple(tuple(_real(g[i], local(p_leaves[i]), local(s_leaves["exp_avg"][i]),
                                   local(s_leaves["exp_avg_sq"][i])) for i in r)
                       for r in rows.values())
        static = ((0.0, wd != 0.0),) * len(rows) if decoupled else ((wd, False),) * len(rows)
        scal = [row_of(t, (n, decoupled and wd != 0.0), 1.0, lr) for n in rows]
        oks = ok.float()
        adam_eager(t.hyper, static, groups, scal, Gate(None, oks, ok, ~ok))
        with torch.no_grad():
            mine = [local(counts[i]) for i in part]
            _compat.foreach_add_(mine, ok.to(mine[0].dtype))
            if steps is not None:
                theirs = [local(steps[i]) for i in part]
                _compat.foreach_add_(theirs, oks.to(theirs[0].dtype))


def _real(*ts: torch.Tensor) -> tuple:
    """Complex tensors as real pairs, as torch's Adam steps them."""
    return tuple(torch.view_as_real(x) if x.is_complex() else x for x in ts)


def _host_counts(state: TorchState, idx: list[int]) -> dict:
    """Each leaf's count of torch's steps on the host: ``state.count``'s, or, where it has
    none, ``stepped``'s, read (once: the state returned keeps them, :func:`_counted`)."""
    known = _known(state)[0]
    out = {i: known[i] for i in idx if known[i] is not None}
    missing = [i for i in idx if i not in out]
    if missing:  # (a state saved before host counts were kept)
        counts = _counts(state, missing)
        read = torch.stack([local(counts[i]) for i in missing]).tolist()
        out.update(zip(missing, (int(n) for n in read)))
    return out


def _known(state: TorchState) -> tuple[list, Any]:
    """``state.count``'s leaves aligned with ``stepped``'s (None: not known), and the
    structure of ``stepped``."""
    _, stepped, spec = flatten(state.stepped)
    known = flatten(state.count)[1] if state.count is not None else []
    return (list(known) if len(known) == len(stepped) else [None] * len(stepped)), spec


def _counted(state: TorchState, idx: list[int], host: dict | None = None) -> TorchState:
    """``state`` with one step more counted on the host for the leaves at ``idx``, from
    their counts before it (``host``; else ``state.count``'s: one not known stays so)."""
    counts, spec = _known(state)
    for i in idx:
        before = host[i] if host is not None else counts[i]
        counts[i] = None if before is None else before + 1
    return state._replace(count=unflatten(spec, counts))


def _counts(state: TorchState, idx: list[int]) -> list:
    """Each leaf's count of torch's steps; refused where a leaf with a gradient has none."""
    counts = flatten(state.stepped)[1]
    if any(counts[i] is None for i in idx):
        raise ValueError("from_torch: a gradient reached a leaf which has no optimizer state "
                         "(requires_grad=False at init)")
    return counts


def _on_views(cls, fixed: dict, lr, step: int, p_leaves: list, grads: dict) -> tuple:
    """A ``cls`` over leaves sharing the storage of the local shards at ``grads``' positions,
    each given its gradient (the step's learning rate where ``lr`` is a schedule); and them."""
    views = []
    for i, g in grads.items():
        v = local(p_leaves[i]).detach()  # a leaf sharing the shard's storage
        v.grad = g
        views.append(v)
    return cls(views, **({**fixed, "lr": lr_at(lr, step)} if callable(lr) else fixed)), views


def _step(cls, fixed: dict, lr, step: int, keys: dict, state: TorchState, p_leaves: list,
          deltas: list, idx: list[int], host: dict) -> None:
    """One torch ``step()`` over the local shards of the leaves with a gradient (``host``:
    each one's count of torch's steps before it)."""
    s_leaves = {k: flatten(t)[1] for k, t in state.state.items()}
    counts = _counts(state, idx)
    opt, views = _on_views(cls, fixed, lr, step, p_leaves,
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
