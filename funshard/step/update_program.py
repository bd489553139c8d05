"""The step's update of ``adam``, ``adamw`` and ``sgd`` (the Policy's clip in front) over every
leaf's local shards at once: the compiled step's second program or, made with no options,
the eager step's foreach ops gated on the device ([Note: an update gated on the device] in
:mod:`funshard.optim.gated`); and ``muon``: its matrices eagerly, gated on the device, in
both steps ([Note: Muon gated on the device] in :mod:`funshard.optim.muon`), the rest as
its other rule.

The host works out the step's scalars ([Note: an update the compiler can hold] in
:mod:`funshard.optim.traced`) and copies them to the device as one small tensor without a
wait (from pinned memory on a GPU); the program reads them there, so one trace serves every
step. It is made once per (optimizer, leaves' grouping by their scalars). Unlike the
gradients' program it reads nothing of the caller's from Python (the schedule runs on the
host), so where dynamo would compile it again (gradients that came in another memory
layout) it does, rather than refuse the step. A chain of fs.optim's pieces that is one of
those three counts as it (:func:`~funshard.optim.traced.traced_of`). ``from_torch`` of
torch's Adam or AdamW runs eagerly, in both steps, gated on the device: fused, by its
kernel's ``found_inf``; else as :func:`funshard.optim.gated.adam_eager` ([Note: torch's
fused step gated on the device], [Note: torch's Adam gated on the device] in
:mod:`funshard.optim.torch_gated`); any other optimizer (another chain, another
``from_torch``) runs its update eagerly after the program and the host's read.

[Note: the update's two candidates] Two ways to make the update one program were built
and timed side by side (``python -m benchmarks.update_candidates``, AdamW over the
host-bound GPT's 100 leaves, CPU): torch's own AdamW with ``capturable=True`` and a tensor
learning rate, compiled, at 0.44x torch's eager foreach update, and this program at 0.55x
(fs.optim's eager update: 1.18x). torch's keeps its step counts on the device, so the host
does no work per leaf; but it has its own state (a step tensor per parameter) and its own
arithmetic. This one keeps fs.optim's state and its numbers, op for op, so checkpoints and
state dicts stay the eager step's and a run switches between the two steps at any
checkpoint; it was kept for that. What it still costs the host is the per-leaf work of
:func:`~funshard.optim.traced.prepare` (the trees flattened, the counts advanced).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from .. import _compat
from ..optim import gated
from ..optim.muon import gated_update as muon_update
from ..optim import traced as traced_
from ..optim.base import flatten, locals_of, path_str
from . import backend

_ids = itertools.count()


def _update(fn, hyper, static, groups, scal, dev, reach):
    """``scal``'s first case, or where ``dev`` says the step before was skipped, its second
    ([Note: two counts in doubt] in :mod:`funshard.step.deferred`); ``reach``: a flag per
    leaf ([Note: a leaf in doubt])."""
    scal = scal[0] if dev is None else torch.where(dev[2] > 0, scal[0], scal[1])
    return fn(hyper, static, groups, scal, dev[:2] if dev is not None else None, reach)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where it is a view (of a bucket, a loaded checkpoint's buffer) the same
    storage without the view's base: dynamo guards a view's base, which would make the
    program's trace depend on where each step's tensors came from."""
    return t if _compat.view_base(t) is None else t.detach()


def without_cuda_graphs(options: dict) -> dict:
    """The update's ``torch.compile`` options: the step's, for static shapes and, under
    inductor, with no CUDA graphs whatever the mode. The update writes its inputs in place
    (parameters, moments), which inductor's CUDA graphs do not record; asked to (the step's
    ``mode="reduce-overhead"``), torch 2.11 crashed the step's process (SIGSEGV) on an H100,
    and with those inputs' addresses marked static, the recording read gradients that the
    gradients' CUDA graph had since overwritten. The gradients' program keeps the mode."""
    out = {**options, "dynamic": False}
    if out.get("backend", "inductor") == "inductor":
        out["options"] = {**(out.get("options") or {}), "triton.cudagraphs": False}
    return out


# [Note: a leaf in doubt] A leaf this rank's loss did not reach may have been reached on
# another rank, or on none (then, as in one process, it is not updated and not counted:
# [Note: a parameter no rank reached] in funshard.step.update). Which, the flags in the
# step's metrics all-reduce say, on the device. A reading step read them at once; here such
# a leaf is updated under a gate of its own (the step's ``ok`` and the leaf's flag: the eager
# update gates the leaves in doubt in one more pass of its foreach ops, each op given a
# scalar per leaf, or, for the fused kernel, one call each; the compiled one takes a flag
# per leaf as an input, true for the others, so one trace serves every step; measured on
# this 2-core CPU, AdamW over 100 leaves of 64 x 64, 2026-11-28: with all 100 in doubt the
# update took 5.0-5.9 ms with a call per leaf, 2.5 ms with the flags in the ops, 1.7-1.8 ms
# with none in doubt either way), counted as updated, and the count corrected where the
# verdict reads it as reached by none: in each state built since
# (as a skipped step's) and before the next step's update, whose scalars take the counts (so
# that step reads the verdict of the one before, as the eager step does under
# ``skip_nonfinite``). A step whose leaves no rank reached is refused as a reading step
# refuses it, when read.


def _parts(prep, leaves: tuple, dev: torch.Tensor, reach: dict | None,
           fused: bool = False) -> list:
    """The eager update's calls ``(prepared, leaves, gate, each)``: every leaf but
    ``reach``'s under ``dev``; then ``reach``'s under their own flags too ([Note: a leaf in
    doubt]): each leaf's flag last in its tuple (``each``), or, for the fused kernel (one
    verdict per call), a call per leaf."""
    if not reach:
        return [(prep, leaves, dev, False)]
    rows = [[j for j, i in enumerate(g) if i not in reach] for g in prep.groups]
    parts = [_subset(prep, leaves, list(enumerate(rows)), dev)] if any(rows) else []
    doubt = [[j for j, i in enumerate(g) if i in reach] for g in prep.groups]
    if not fused:
        part, doubted, _, _ = _subset(prep, leaves, list(enumerate(doubt)), dev)
        flagged = tuple(tuple((*leaf, reach[i]) for leaf, i in zip(row, g))
                        for row, g in zip(doubted, part.groups))
        return parts + [(part, flagged, dev, True)]
    for r, js in enumerate(doubt):
        parts += [_subset(prep, leaves, [(r, [j])],
                          torch.stack([dev[0], dev[1] * reach[prep.groups[r][j]]]))
                  for j in js]
    return parts


def _subset(prep, leaves: tuple, rows: list, gate: torch.Tensor) -> tuple:
    """``prep`` and ``leaves`` for the leaves at ``rows`` (``(row, [positions])`` pairs)."""
    rows = [(r, js) for r, js in rows if js]
    return (prep._replace(groups=tuple(tuple(prep.groups[r][j] for j in js) for r, js in rows),
                          static=tuple(prep.static[r] for r, _ in rows),
                          scal=[[case[r] for r, _ in rows] for case in prep.scal],
                          counts=tuple(prep.counts[r] for r, _ in rows)),
            tuple(tuple(leaves[r][j] for j in js) for r, js in rows), gate, False)


class UpdateProgram:
    """The compiled updates of one ``train_step``, keyed by what fixes their trace. The
    shards' shapes never change, so each is compiled for static shapes whatever the
    caller's ``dynamic``."""

    def __init__(self, options: dict):
        self.options = options
        self.fns: dict[tuple, list] = {}  # key -> [compiled fn, ran once]
        self._health: torch.Tensor | None = None
        self._applied: torch.Tensor | None = None
        self._scale: tuple | None = None
        self._ones: tuple | None = None  # the flags of an update with no leaf in doubt

    def health(self, device: torch.device | None) -> torch.Tensor:
        """A bool on ``device``: false from a step refused on the device until the host
        reads its refusal ([Note: a step that reads nothing] in
        :mod:`funshard.step.deferred`)."""
        if self._health is None or (device is not None and self._health.device != device):
            self._health = torch.ones((), dtype=torch.bool, device=device)
        return self._health

    def applied(self, device: torch.device) -> torch.Tensor:
        """A bool on ``device``: whether the last step that did not read applied its update
        ([Note: two counts in doubt] in :mod:`funshard.step.deferred`)."""
        if self._applied is None or self._applied.device != device:
            self._applied = torch.ones((), dtype=torch.bool, device=device)
        return self._applied

    def loss_scale(self, device: torch.device) -> tuple:
        """The dynamic loss scale and its finite steps, float32 on ``device`` ([Note: a loss
        scale on the device] in :mod:`funshard.step.scaling`)."""
        if self._scale is None or self._scale[0].device != device:
            self._scale = tuple(torch.ones((), device=device) for _ in range(2))
        return self._scale

    def _flags(self, prep, reach: dict | None, dev, device) -> torch.Tensor | None:
        """The compiled update's flag per leaf (rows in turn): whether some rank reached it
        (``reach``'s, else true), a program input either way, so one trace serves both."""
        if dev is None:
            return None
        if not reach:
            key = ("reach", sum(map(len, prep.groups)), device)
            if self._ones is None or self._ones[0] != key:
                self._ones = (key, torch.ones(key[1], dtype=torch.bool, device=device))
            return self._ones[1]
        true = torch.ones((), dtype=torch.bool, device=device)
        return torch.stack([reach.get(i, true) for row in prep.groups for i in row])

    @property
    def eager(self) -> bool:
        """Whether it runs the update eagerly (the eager step's: made with no options)."""
        return self.options is None

    @staticmethod
    def covers(optimizer) -> bool:
        return traced_.traceable(getattr(optimizer, "traced", None))

    def __call__(self, optimizer, grad_tree: Any, opt_state: Any, params: Any, *, step: int,
                 norm: float | None, device: torch.device, dev: torch.Tensor | None = None,
                 doubt: tuple | None = None, reach: dict | None = None) -> tuple[Any, Any]:
        """Update ``params`` and ``opt_state`` in place (donated); return them. ``norm``: the
        step's global norm, read on the host; or None and ``dev``, the step's ``(clip
        factor, ok, the step before applied)`` on the device ([Note: a step that reads
        nothing] in :mod:`funshard.step.deferred`), ``doubt`` the leaves that step counted
        while its verdict is unread; ``reach``: per leaf no rank may have reached, whether
        some rank did, on the device (the eager update's: [Note: a leaf in doubt])."""
        t, grads = optimizer.traced, flatten(grad_tree)[1]
        kw = dict(step=step, norm=norm, device=device, dev=dev, doubt=doubt, reach=reach)
        if t.kind == "muon":
            return params, self._muon(t, grads, opt_state, params, **kw)
        if t.kind == "torch":  # eagerly, its kernel gated on the device by its verdict
            return params, t.hyper[0](t, grads, opt_state, params, step=step, norm=norm,
                                      dev=dev, reach=reach)
        return params, self._update(t, grads, opt_state, params, **kw)

    def _muon(self, t, grads: list, opt_state: Any, params: Any, **kw) -> Any:
        """``muon``'s update: its matrices by :func:`funshard.optim.muon.gated_update`
        (eagerly, in the compiled step too: their all-to-alls), the rest by the other rule's
        update; the state with the other's counts advanced."""
        paths, leaves, _ = flatten(params)
        takes = [bool(t.mask(path_str(k), p)) for k, p in zip(paths, leaves)]
        inner = opt_state.inner_states
        other = self._update(t.other._replace(clip=t.clip),
                             [None if m else g for g, m in zip(grads, takes)], inner["other"],
                             params, **kw)
        muon_update(t, [g if m else None for g, m in zip(grads, takes)], inner["muon"],
                    params, **{k: v for k, v in kw.items() if k != "device"})
        return opt_state._replace(inner_states={**inner, "other": other})

    def _update(self, t, grads: list, opt_state: Any, params: Any, *, step: int,
                norm: float | None, device: torch.device, dev: torch.Tensor | None,
                doubt: tuple | None, reach: dict | None) -> Any:
        """``t``'s update (adam or sgd) of ``params`` in place; the state it leaves."""
        prep = traced_.prepare(t, grads, opt_state, params, step=step, norm=norm, doubt=doubt)
        if not prep.groups:
            return prep.state
        leaves = traced_.leaves_of(prep, t, locals_of(grads), prep.state, params)
        if self.eager:  # the eager step's ([Note: an update gated on the device])
            with torch.no_grad():
                for part, part_leaves, gate, each in _parts(prep, leaves, dev, reach, t.fused):
                    gated.eager_update(t, part, part_leaves, step, gate, each)
            return prep.state
        leaves = tuple(tuple(tuple(_plain(x) for x in leaf) for leaf in group)
                       for group in leaves)
        key = (t.kind, t.hyper, prep.static, tuple(len(g) for g in prep.groups), dev is None)
        entry = self.fns.get(key)
        if entry is None:
            fn = torch.compile(backend.fresh(_update, f"funshard_update_{next(_ids)}"),
                               fullgraph=True,
                               **backend.compile_options(without_cuda_graphs(self.options)))
            self.fns[key] = entry = [fn, False]
        logs = (contextlib.nullcontext() if entry[1] else _compat.tracing_without_logs(set()))
        with torch.no_grad(), logs:
            entry[0](traced_.UPDATES[t.kind], t.hyper, prep.static, leaves,
                     traced_.scalars(prep.scal, device), dev, self._flags(prep, reach, dev, device))
        entry[1] = True
        return prep.state
