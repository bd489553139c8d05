"""torch's optimizers inside ``fs.train_step`` with no host read: their state's counts on
the host, and their step gated on the step's verdict on the device (what
:func:`funshard.optim.torch_optim.from_torch` hands the step).

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
the next step reads them as momentum (torch 2.13): it reads the verdict first, or, with
``select=True``, is selected, as below.

[Note: torch's Adam gated on the device] torch's foreach Adam and AdamW (``foreach`` not
False, not fused; no amsgrad, maximize, capturable or differentiable) take no verdict: their
step reads each leaf's step count on the host to form its bias corrections. Their ops are
those of funshard's own ``adam`` (``lerp``, ``mul``, ``addcmul``, ``sqrt``, ``div``, ``add``,
``addcdiv``, and AdamW's ``mul`` by ``1 - lr * wd``), and so are their Python scalars
(``(lr / (1 - b1 ** n)) * -1``, ``(1 - b2 ** n) ** 0.5``), so inside ``fs.train_step`` such an
optimizer runs as :func:`funshard.optim.gated.adam_eager` ([Note: an update gated on the
device]): the same ops, gated on the step's verdict, their scalars from the counts the host
keeps in :class:`~funshard.optim.torch_optim.TorchState` (``count``), advanced as each update
is issued and corrected where a verdict reads the step skipped (as ``fs.optim.adam``'s counts
are). The counts on
the device (``stepped`` and torch's ``step``) advance where the verdict holds, so the state
is the one torch would hold, and torch's own step can take it up at any step (the reading
path, ``fs.optim.apply``). A state saved before host counts were kept reads them once from
``stepped``. Its numbers are torch's bit for bit (a test compares them); on CPU torch's
default for CPU tensors (``foreach=None``) is its per-tensor loop, whose ops are the same.

[Note: any torch step selected on the device] torch's other optimizers (SGD, RMSprop,
Adagrad, Adamax, RAdam, Rprop, Adadelta; Adam and AdamW with ``amsgrad``, ``maximize``,
``capturable`` or ``foreach=False``) take no verdict: their step is host code over in-place
ops. So by default the step reads its verdict before their update. With
``from_torch(..., select=True)`` their step runs as torch wrote it, whatever the verdict, after
a copy of what it writes in place (the params' shards, the state of the leaves it has
stepped); then each of those tensors takes torch's result where the verdict holds and its
copy where it does not (``torch.where``: exactly one or the other), and a leaf torch had not
stepped takes torch's initial state likewise. torch keeps its step count on the CPU for a GPU
parameter (unless capturable): it is made from the host's count (``count``, as for Adam
above), so nothing is read from the device, and the counts on the device advance where the
verdict holds. Its numbers are the same optimizer's after a read, bit for bit (a test
compares them). The price is memory traffic on the device instead of a host wait: a copy and
a select of each tensor written (about five passes over it, where the update itself makes
two or three), two ops per tensor, and the copies as transient memory, at most
:data:`SELECT_BYTES` at a time (more leaves step in several calls of torch's, whose
elementwise ops give each element the same numbers). That is why it is not the default: a
read costs the device little where the host is far ahead of it (a large model) or far
behind (a small one, whose device has long finished), and the copies cost every step;
``python -m benchmarks.torch_adam --optimizer rmsprop`` times the two. A flat form (the
tensors of one dtype concatenated, one ``where``, one foreach copy back: three ops, not two
per tensor) was timed beside this one and was no faster where the bytes dominate, for two
more passes over them; this one was kept. NAdam and ASGD are
refused: NAdam's running product of momentum is a scalar on the CPU that is not the count,
and ASGD's averaging scalars are read on the host by its own step.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from .apply import deltas_of
from .base import Tree, flatten, local, lr_at, materialize, unflatten
from .gated import _Gate as Gate, adam_eager
from .traced import Traced, _row as row_of, clip_factor

# a funshard.optim.torch_optim.TorchState (that module imports this one: not imported back)
State = Any

SELECT = "select"  # a step selected on the device ([Note: any torch step selected on the device])


def gated_step(cls, fixed: dict, lr, keys_for, form, t: Traced, grads: list,
               state: State, params: Tree, *, step: int, norm, dev, reach) -> State:
    """A fused ``cls`` step over the leaves with a gradient (``grads``, aligned with the
    params' leaves), or, where ``form`` (:func:`adam_form`) is given, torch's foreach Adam
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
    keys, counts = keys_for(p_leaves[idx[0]]), counts_of(state, idx)
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
    if form == SELECT:
        return selected_step(cls, fixed, lr, step, keys, state, calls, g, p_leaves, s_leaves,
                             counts, idx)
    if form is not None:
        host = host_counts(state, idx)
        now = lr_at(form[-1] if lr is None else lr, step)  # (None: torch's default)
        foreach_adam(form, now, calls, g, p_leaves, s_leaves, host, counts)
        return counted(state, idx, host)
    for part, gate in calls:
        if not part:
            continue
        opt, views = on_views(cls, fixed, lr, step, p_leaves, {i: g[i] for i in part})
        for v, i in zip(views, part):  # torch's own initial state is zeros: so is ours
            opt.state[v] = {k: local(s_leaves[k][i]) for k in keys}
        if gate is not None:
            opt.found_inf = (~gate).to(torch.float32)
        opt.step()
        _advance([local(counts[i]) for i in part], gate)
        for v in views:
            v.grad = None
    return counted(state, idx)


# the copies a selected step keeps of one call's tensors before torch writes into them (the
# step's transient memory): more leaves than fit are stepped in several calls of torch's
SELECT_BYTES = 256 << 20


def selected_step(cls, fixed: dict, lr, step: int, keys: dict, state: State,
                  calls: list, g: dict, p_leaves: list, s_leaves: dict, counts: list,
                  idx: list[int]) -> State:
    """torch's own ``step()`` over each ``(leaves, gate)`` of ``calls``, what it wrote kept
    where the gate holds and undone where it does not; the step counts from the host."""
    host = host_counts(state, idx)
    for part, gate in calls:
        for chunk in _chunks(part, p_leaves, keys):
            _select(cls, fixed, lr, step, keys, chunk, gate, g, p_leaves, s_leaves, host)
            _advance([local(counts[i]) for i in chunk], gate)
            if "step" in keys and keys["step"][1].type == "cpu":  # (torch's, from ours)
                _advance([local(s_leaves["step"][i]) for i in chunk], gate)
    return counted(state, idx, host)


def _select(cls, fixed: dict, lr, step: int, keys: dict, chunk: list, gate, g: dict,
            p_leaves: list, s_leaves: dict, host: dict) -> None:
    """One ``cls`` step over the leaves at ``chunk``, kept where ``gate`` holds (None: kept)."""
    opt, views = on_views(cls, fixed, lr, step, p_leaves, {i: g[i] for i in chunk})
    # torch writes into these in place: the params, and the state of the leaves it stepped
    inplace = [k for k, (elem, dev, _) in keys.items() if elem or dev.type != "cpu"]
    ours = {i: {k: local(s_leaves[k][i]) for k in inplace} for i in chunk}
    for v, i in zip(views, chunk):
        if host[i] > 0:  # a leaf torch has not stepped gets torch's own initial state
            opt.state[v] = dict(ours[i])
            if "step" in keys and "step" not in inplace:  # on the CPU: from the host's count
                opt.state[v]["step"] = torch.tensor(float(host[i]), dtype=keys["step"][2],
                                                     device="cpu")
    written = [local(p_leaves[i]) for i in chunk] + [
        ours[i][k] for i in chunk if host[i] > 0 for k in inplace]
    with torch.no_grad():
        before = [t.clone() for t in written] if gate is not None else []
    opt.step()
    with torch.no_grad():
        for t, old in zip(written, before):
            torch.where(gate, t, old, out=t)
        for v, i in zip(views, chunk):
            v.grad = None
            for k in inplace:  # state torch made anew (a leaf's first step): taken likewise
                new = opt.state[v][k]
                if new is not ours[i][k]:
                    _kept(ours[i][k], new, gate)


def _advance(counters: list, gate) -> None:
    """Each of ``counters`` one more where ``gate`` holds (None: everywhere)."""
    with torch.no_grad():
        _compat.foreach_add_(counters, 1 if gate is None else gate.to(counters[0].dtype))


def _kept(t: torch.Tensor, new: torch.Tensor, gate) -> None:
    """``t`` takes ``new`` where ``gate`` holds (None: everywhere), keeps its value else."""
    if gate is None:
        t.copy_(new)
    else:
        torch.where(gate, new, t, out=t)


def _chunks(part: list, p_leaves: list, keys: dict) -> list:
    """``part`` in runs of leaves whose copies (the param and its elementwise state) fit in
    :data:`SELECT_BYTES`, each at least one leaf."""
    per = 1 + sum(elem for elem, _, _ in keys.values())
    out, size = [], 0
    for i in part:
        p = local(p_leaves[i])
        n = p.numel() * p.element_size() * per
        if not out or size + n > SELECT_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def adam_form(cls, fixed: dict, lr) -> tuple | None:
    """``(b1, b2, eps, weight decay, decoupled, lr)`` of a torch Adam or AdamW whose step is
    the foreach one funshard's gated ops repeat ([Note: torch's Adam gated on the device]):
    not fused, foreach not refused, Python numbers for its hyperparameters, none of amsgrad,
    maximize, capturable, differentiable; else None. ``lr``: the caller's (a schedule, or
    None: torch's default)."""
    dummy = torch.zeros(2, requires_grad=True, device="cpu")
    d = cls([dummy], **({**fixed, "lr": 0.0} if callable(lr) else fixed)).defaults
    if (d.get("fused") or d.get("foreach") is False or d.get("amsgrad") or d.get("maximize")
            or d.get("capturable") or d.get("differentiable")):
        return None
    (b1, b2), eps, wd = d["betas"], d["eps"], d["weight_decay"]
    if not all(type(x) in (int, float) for x in (b1, b2, eps, wd, d["lr"])):
        return None
    decoupled = d.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW))
    return float(b1), float(b2), float(eps), float(wd), bool(decoupled), float(d["lr"])


def foreach_adam(form: tuple, lr: float, calls: list, g: dict, p_leaves: list,
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
        _advance([local(counts[i]) for i in part], ok)
        if steps is not None:
            _advance([local(steps[i]) for i in part], ok)


def _real(*ts: torch.Tensor) -> tuple:
    """Complex tensors as real pairs, as torch's Adam steps them."""
    return tuple(torch.view_as_real(x) if x.is_complex() else x for x in ts)


def host_counts(state: State, idx: list[int]) -> dict:
    """Each leaf's count of torch's steps on the host: ``state.count``'s, or, where it has
    none, ``stepped``'s, read (once: the state returned keeps them, :func:`counted`)."""
    known = _known(state)[0]
    out = {i: known[i] for i in idx if known[i] is not None}
    missing = [i for i in idx if i not in out]
    if missing:  # (a state saved before host counts were kept)
        counts = counts_of(state, missing)
        read = torch.stack([local(counts[i]) for i in missing]).tolist()
        out.update(zip(missing, (int(n) for n in read)))
    return out


def _known(state: State) -> tuple[list, Any]:
    """``state.count``'s leaves aligned with ``stepped``'s (None: not known), and the
    structure of ``stepped``."""
    _, stepped, spec = flatten(state.stepped)
    known = flatten(state.count)[1] if state.count is not None else []
    return (list(known) if len(known) == len(stepped) else [None] * len(stepped)), spec


def counted(state: State, idx: list[int], host: dict | None = None) -> State:
    """``state`` with one step more counted on the host for the leaves at ``idx``, from
    their counts before it (``host``; else ``state.count``'s: one not known stays so)."""
    counts, spec = _known(state)
    for i in idx:
        before = host[i] if host is not None else counts[i]
        counts[i] = None if before is None else before + 1
    return state._replace(count=unflatten(spec, counts))


def counts_of(state: State, idx: list[int]) -> list:
    """Each leaf's count of torch's steps; refused where a leaf with a gradient has none."""
    counts = flatten(state.stepped)[1]
    if any(counts[i] is None for i in idx):
        raise ValueError("from_torch: a gradient reached a leaf which has no optimizer state "
                         "(requires_grad=False at init)")
    return counts


def on_views(cls, fixed: dict, lr, step: int, p_leaves: list, grads: dict) -> tuple:
    """A ``cls`` over leaves sharing the storage of the local shards at ``grads``' positions,
    each given its gradient (the step's learning rate where ``lr`` is a schedule); and them."""
    views = []
    for i, g in grads.items():
        v = local(p_leaves[i]).detach()  # a leaf sharing the shard's storage
        v.grad = g
        views.append(v)
    return cls(views, **({**fixed, "lr": lr_at(lr, step)} if callable(lr) else fixed)), views
