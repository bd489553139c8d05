"""The updates of ``adam``, ``adamw`` and ``sgd`` (with the Policy's clip in front) in the form
a compiled program holds: :class:`Traced` says what the chain does; :func:`prepare` works out
on the host what changes from step to step (the learning rate, each leaf's bias corrections,
the clip factor) as one small tensor; :func:`adam_update` and :func:`sgd_update` are plain
torch over the local shards, with no Python branch on a value, so one trace serves every
step.

[Note: an update the compiler can hold] The chains' own update (:mod:`.apply`) keeps its
scalars as Python numbers and branches on them (a factor of 1 skips a multiply, leaves are
grouped by their scalars): traced, each step's numbers are new constants, and the program
was compiled again at every step (measured 2026-11-26, ``benchmarks.update_candidates``).
Here the numbers that change from step to step (the learning rate, the bias corrections of
each leaf's count, the clip factor) are formed on the host as the chains form them (Python
floats, then each op's float32 scalar) and reach the program as a tensor with one row per
set of leaves that share them; what does not change (which leaves decay, an L2 penalty,
SGD's first step) is fixed in the trace, and the program is made once per grouping of the
leaves. A clip factor the chain would skip is applied as 1, which is exact. The ops are the
chains' (hence ``torch.optim``'s foreach ones), in their order: ``p *= 1 - lr * wd``, ``p +=
(-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)``. Run op by op, Adam's numbers are the
chain's bit for bit; SGD's last add rounds once more (a multiply, then an add, where the
chain's ``add_(alpha=)`` fuses them); compiled, the fused kernels may round differently
(float32: about 1e-7 relative).

A chain of fs.optim's pieces that is one of these (their members in their order, a clip in
front or not) has this form too, read off its members' forms (:func:`traced_of`); a chain
of other transformations has none: the compiled step runs its update eagerly, as the eager
step does.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ..reduce import real
from .base import (ScalarOrSchedule, Tree, advance_counts, check_held, flatten, locals_of,
                   lr_at, mask_flags, unflatten)


class Traced(NamedTuple):
    """What an ``adam``, ``adamw`` or ``sgd`` chain does, for :func:`prepare`; or a
    ``muon`` (kind ``"muon"``): its own hyperparameters, ``mask`` the ``(fqn, param) ->
    bool`` of the leaves it takes, ``other`` the rest's (its matrices' update runs eagerly,
    gated on the device, in the compiled step too: :func:`funshard.optim.muon.gated_update`;
    the rest's as ``other``'s)."""

    kind: str  # "adam", "sgd", "muon" or "torch" (hyper: its gated step, from_torch's)
    lr: ScalarOrSchedule
    hyper: tuple  # adam: (b1, b2, eps); sgd: (momentum, dampening, nesterov)
    weight_decay: float
    decoupled: bool  # AdamW's decay, after the direction; else an L2 penalty on the gradient
    mask: Any = None  # where the decay applies (as add_decayed_weights' mask); None: everywhere
    clip: Optional[float] = None  # the global norm clip in front (Policy(clip_norm=))
    fused: bool = False  # Adam's fused kernel (adamw(fused=True))
    other: Any = None  # muon's: the Traced of the leaves it does not take


class Prepared(NamedTuple):
    """One step's update: ``groups`` (per row of ``scal``, the positions of its leaves),
    ``static`` (per group, what fixes its ops: its L2 penalty and whether AdamW's decay or
    SGD's first step applies), ``scal`` (the rows, Python floats), the state with its counts
    advanced, and per group the updates its leaves had before this one (Adam's)."""

    groups: tuple
    static: tuple
    scal: list  # [case][row][scalar]: the second case, the step before skipped
    state: Any
    counts: tuple = ()


def _decays(t: Traced, params: Tree) -> list[bool]:
    """Which leaves decay: the mask's flags, refused as ``masked`` refuses them."""
    if t.mask is None or t.weight_decay == 0.0:
        return [t.weight_decay != 0.0] * len(flatten(params)[1])
    return mask_flags(t.mask, params)


def prepare(t: Traced, grads: list, state: Any, params: Tree, *, step: int,
            norm: Optional[float], doubt: Optional[tuple] = None) -> Prepared:
    """The host's part of one update: ``grads`` per leaf (None: no update), ``norm`` the
    step's global gradient norm (finite; None: the clip factor is worked out on the device
    and the rows carry 1). The state's counts advance as the chain's do.

    ``scal`` holds two sets of rows: the second for the case that the step before this one
    was skipped on the device, its verdict not yet read (``doubt``: the leaves that step
    counted; None: no doubt, the two sets alike); [Note: two counts in doubt] in
    :mod:`funshard.step.deferred`. Leaves share a row where both cases give them the same."""
    paths, _, _ = flatten(params)
    idx = [i for i, g in enumerate(grads) if g is not None]
    alt_step = step if doubt is None else step - 1
    if _stateless(t):  # no state: nothing held, nothing counted (the schedule reads the step)
        prior, alt, count = [step] * len(grads), [alt_step] * len(grads), state.count
    else:
        tensors = state.exp_avg if t.kind == "adam" else state.momentum_buffer
        check_held(paths, idx, flatten(tensors)[1])
        prior, count = advance_counts(state.count, len(grads), idx, step)
        alt = prior if doubt is None else advance_counts(uncount(state.count, doubt),
                                                         len(grads), idx, alt_step)[0]
    coef = clip_factor(t, norm)
    lr, alt_lr, decays = lr_at(t.lr, step), lr_at(t.lr, alt_step), _decays(t, params)
    rows: dict[tuple, list[int]] = {}
    for i in idx:  # a count each way, or SGD's first (alike both ways: see decided())
        lead = ((prior[i], alt[i]) if t.kind == "adam" else (False,) * 2 if _stateless(t)
                else (prior[i] == 0,) * 2)
        rows.setdefault((lead, decays[i]), []).append(i)
    wd = t.weight_decay
    static = tuple((0.0 if t.decoupled or not d else wd, d and t.decoupled)
                   if t.kind == "adam" else (wd if d else 0.0, lead[0])
                   for lead, d in rows)
    scal = [[_row(t, (lead[k], d), coef, r) for lead, d in rows]
            for k, r in ((0, lr), (1, alt_lr))]
    return Prepared(tuple(tuple(v) for v in rows.values()), static, scal,
                    state._replace(count=count), tuple(lead[0] for lead, _ in rows))


def traced_of(forms: tuple) -> Optional[Traced]:
    """What a chain of transformations whose forms are ``forms`` does, where it is an
    ``adam``, ``adamw`` or ``sgd`` (their chains' members in their order; a member that is an
    optimizer with a traced form: ``("traced", t)``), with a global norm clip and
    ``apply_if_finite`` in front or not; else None. Inside ``fs.train_step``,
    ``apply_if_finite`` changes nothing: a non-finite step is refused before the optimizer
    runs, or skipped by the Policy's own in front of it."""
    flat = _flat(forms)
    if flat is None:
        return None
    clips = [f[1] for f in flat if f[0] == "clip"]
    lead = next((j for j, f in enumerate(flat) if f[0] not in ("clip", "finite")), len(flat))
    if len(clips) > 1 or any(f[0] in ("clip", "finite") for f in flat[lead:]):
        return None
    t = _core(flat[lead:])
    if t is None or not clips:
        return t
    return None if t.clip is not None else t._replace(clip=clips[0])


def _flat(forms: tuple) -> Optional[list]:
    """The members' forms, nested chains opened; None where some member has none."""
    out = []
    for f in forms:
        if f is None:
            return None
        if f[0] == "chain":
            inner = _flat(f[1])
            if inner is None:
                return None
            out += inner
        else:
            out.append(f)
    return out


def _core(forms: list) -> Optional[Traced]:
    """``adam`` (an L2 penalty first), ``adamw`` (the decay after the direction), ``sgd``,
    each with its learning rate last: as :mod:`funshard.optim.alias` chains them."""
    kinds = [f[0] for f in forms]
    if kinds == ["traced"]:
        return forms[0][1]
    if len(forms) < 2 or kinds[-1] != "lr" or kinds.count("decay") > 1:
        return None
    lr = forms[-1][1]
    wd, mask = next(((f[1], f[2]) for f in forms if f[0] == "decay"), (0.0, None))
    if kinds[:2] == ["adam", "decay"] and len(forms) == 3 or kinds == ["adam", "lr"]:
        _, b1, b2, eps, fused = forms[0]
        return Traced("adam", lr, (b1, b2, eps), wd, True, mask, fused=fused)
    if kinds == ["decay", "adam", "lr"] and not forms[1][4]:  # (fused: no L2 penalty)
        return Traced("adam", lr, forms[1][1:4], wd, False, mask)
    if kinds in (["decay", "trace", "lr"], ["trace", "lr"]):
        return Traced("sgd", lr, forms[-2][1:], wd, False, mask)
    return None


def recount(state: Any, idx) -> Any:
    """The optimizer state ``state`` with one update fewer counted for the leaves at ``idx``
    (:func:`uncount`), in each part that counts (a ``muon``'s parts by label)."""
    if hasattr(state, "inner_states"):
        return state._replace(inner_states={k: recount(v, idx)
                                            for k, v in state.inner_states.items()})
    if "count" in getattr(type(state), "_fields", ()):  # (a tuple's own count is a method)
        return state._replace(count=uncount(state.count, idx))
    return state


def clip_factor(t: Traced, norm: Optional[float]) -> float:
    """The clip's factor for the step's global norm read on the host (``clip_by_global_norm``'s
    rule); 1 without a clip, or where the norm stays on the device (None)."""
    return 1.0 if t.clip is None or norm is None else min(1.0, t.clip / (norm + 1e-6))


def uncount(count: Tree, idx) -> Tree:
    """``count`` with one update fewer for the leaves at ``idx`` (a step found skipped after
    its counts advanced); None stays None (such a state counts by the step)."""
    if count is None:
        return None
    _, counts, spec = flatten(count)
    counts = list(counts)
    for i in idx:
        if counts[i] is not None:  # (SGD without momentum counts nothing)
            counts[i] -= 1
    return unflatten(spec, counts)


def decided(t: Traced, state: Any, doubt: tuple, step: int) -> bool:
    """Whether one program serves both cases of ``doubt``: SGD's first update of a leaf is
    fixed in the trace, and a leaf first updated by the step in doubt is first or not."""
    if t.kind == "muon":  # (its matrices' scalars are chosen on the device)
        return decided(t.other, state.inner_states["other"], doubt, step)
    if t.kind == "torch":  # (its scalars are the host's: the verdict is read first)
        return False
    if t.kind != "sgd" or _stateless(t):
        return True
    if state.count is None:
        return step != 1
    counts = flatten(state.count)[1]
    return all(counts[i] != 1 for i in doubt)


def _row(t: Traced, key: tuple, coef: float, lr: float) -> list[float]:
    """One row of scalars, as the chains form them (in Python floats)."""
    n, decay = key
    if t.kind == "sgd":
        return [coef, -lr]
    b1, b2, _ = t.hyper
    bc1, bc2 = 1 - b1 ** float(n + 1), (1 - b2 ** float(n + 1)) ** 0.5
    return [coef, -lr / bc1, bc2, 1 + t.weight_decay * -lr if decay and t.decoupled else 1.0]


def scalars(rows: list, device: torch.device) -> torch.Tensor:
    """``rows`` as a float32 tensor on ``device``, copied without waiting for it."""
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.float32, device=device)
    return torch.tensor(rows, dtype=torch.float32, pin_memory=True).to(device, non_blocking=True)


def leaves_of(prepared: Prepared, t: Traced, grads: list, state: Any, params: Tree) -> tuple:
    """The program's tensor inputs: per group, its leaves' (gradient, param, state...)
    local tensors."""
    p = locals_of(flatten(params)[1])
    if t.kind == "adam":
        more = [locals_of(flatten(state.exp_avg)[1]), locals_of(flatten(state.exp_avg_sq)[1])]
    else:
        more = [] if _stateless(t) else [locals_of(flatten(state.momentum_buffer)[1])]
    # Adam steps a complex leaf as its real pairs (views), as torch.optim.Adam does: its second
    # moment is per part (a complex ``g * g`` would mix them); SGD's ops are the same either way
    # and torch's steps the complex tensors
    pairs = t.kind == "adam"

    def leaf(i: int) -> tuple:
        got = (grads[i], p[i], *(m[i] for m in more))
        return tuple(map(real, got)) if pairs and p[i].is_complex() else got

    return tuple(tuple(leaf(i) for i in g) for g in prepared.groups)


def adam_update(hyper: tuple, static: tuple, groups: tuple, scal: torch.Tensor,
                dev: Optional[torch.Tensor] = None, reach: Optional[torch.Tensor] = None) -> None:
    """Adam's (and AdamW's) update of every leaf, in place: ``groups[r]`` are the
    ``(grad, param, exp_avg, exp_avg_sq)`` local tensors that take row ``r`` of ``scal``
    (``coef, -lr / bc1, sqrt(bc2), 1 - lr * wd``) and ``static[r]`` (``l2, decay``). Each op
    is the chain's, in its order (``addcdiv_`` is ``p + (value * m) / den``). ``dev``: the
    step's ``(clip factor, ok)`` worked out on the device ([Note: a step that reads nothing]
    in :mod:`funshard.step.deferred`): the factor multiplies each row's, and where ``ok`` is
    0 every tensor keeps its value; ``reach``: with ``dev``, a flag per leaf (rows in turn),
    false where no rank reached it: it keeps its values too."""
    b1, b2, eps = hyper
    gain, keep = (None, None) if dev is None else (dev[0], dev[1] > 0)
    at = iter(range(sum(map(len, groups))))
    for (l2, decay), leaves, row in zip(static, groups, scal.unbind()):
        coef, s, bc2, shrink = row.unbind()
        coef = coef if gain is None else coef * gain
        for g, p, m, v in leaves:
            here = keep if reach is None or keep is None else keep & reach[next(at)]
            g = g.to(p.dtype) * coef
            if l2:
                g = g.add(p, alpha=l2)
            if keep is None:
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if decay:
                    p.mul_(shrink)
                p.add_(s * m / (v.sqrt() / bc2 + eps))
                continue
            m2 = m.lerp(g, 1 - b1)
            v2 = v.mul(b2).addcmul_(g, g, value=1 - b2)
            p2 = (p.mul(shrink) if decay else p).add(s * m2 / (v2.sqrt() / bc2 + eps))
            _keep(here, (m, v, p), (m2, v2, p2))


def _keep(keep: torch.Tensor, olds: tuple, news: tuple) -> None:
    """Each of ``olds`` takes its new value where ``keep`` is true, else stays."""
    for old, new in zip(olds, news):
        old.copy_(torch.where(keep, new, old))


def sgd_update(hyper: tuple, static: tuple, groups: tuple, scal: torch.Tensor,
               dev: Optional[torch.Tensor] = None, reach: Optional[torch.Tensor] = None) -> None:
    """SGD's update, in place: ``groups[r]`` are the ``(grad, param, momentum_buffer)`` local
    tensors of row ``r`` (``coef, -lr``; without momentum no buffer), ``static[r]`` is
    ``(l2, first)`` (a leaf's first update sets its buffer to its gradient). ``dev``: as
    :func:`adam_update`'s."""
    momentum, dampening, nesterov = hyper
    gain, keep = (None, None) if dev is None else (dev[0], dev[1] > 0)
    at = iter(range(sum(map(len, groups))))
    for (l2, first), leaves, row in zip(static, groups, scal.unbind()):
        coef, lr = row.unbind()
        coef = coef if gain is None else coef * gain
        for g, p, *buf in leaves:
            here = keep if reach is None or keep is None else keep & reach[next(at)]
            g = g.to(p.dtype) * coef
            if l2:
                g = g.add(p, alpha=l2)
            if not buf:  # no momentum
                if keep is None:
                    p.add_(g * lr)
                else:
                    _keep(here, (p,), (p.add(g * lr),))
                continue
            buf = buf[0]
            if keep is None:
                if first:
                    buf.copy_(g)
                else:
                    buf.mul_(momentum).add_(g, alpha=1 - dampening)
                p.add_((g.add(buf, alpha=momentum) if nesterov else buf) * lr)
                continue
            b2 = g if first else buf.mul(momentum).add_(g, alpha=1 - dampening)
            p2 = p.add((g.add(b2, alpha=momentum) if nesterov else b2) * lr)
            _keep(here, (buf, p), (b2, p2))


UPDATES = {"adam": adam_update, "sgd": sgd_update}


def traceable(t: Optional[Traced]) -> bool:
    """Whether the update program covers ``t``."""
    return t is not None


def _stateless(t: Traced) -> bool:
    """SGD without momentum: no state."""
    return t.kind == "sgd" and t.hyper[0] == 0.0
