"""Muon on shards: ``muon(lr=0.02)`` equals ``torch.optim.Muon`` (2-D leaves) plus AdamW (the
rest) on one process, without any rank gathering every matrix.

[Note: Muon on shards] Muon's momentum is elementwise and runs on the local shards. Its
Newton-Schulz orthogonalisation needs each whole matrix, so each 2-D leaf gets one owner on
the "shard" mesh dimension (greedy, largest cost ``min(m,n)^2 * (2 max(m,n) + min(m,n))``
first, onto the least loaded rank). One all-to-all sends every rank's rows of each matrix
(in bfloat16, as torch casts it first) to its owner, the owner orthogonalises it once, and a
second all-to-all returns each rank's rows of the result: every matrix moves about twice in
bfloat16, and no rank holds a matrix it does not own. On a 2-D mesh each replica group
does this on its own (replicas hold the same shards, so they compute the same numbers).

    >>> opt = muon(lr=0.02, other=adamw(3e-4, weight_decay=0.01))
    >>> state = opt.init(params)   # MultiTransformState({"muon": MuonState, "other": AdamWState})
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch.distributed.tensor import DTensor

from .. import collectives
from ..layout import layout_of
from ..mesh import SHARD, mesh_device
from .alias import adamw
from .base import (Delta, GradientTransformation, Optimizer, Tree, check_held, flatten, local,
                   lr_at, path_str, unflatten, zeros_tree)
from .combine import chain, multi_transform
from .traced import Traced, clip_factor, scalars, traceable
from .transforms import active, add_decayed_weights, scale_by_learning_rate

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


class MuonState(NamedTuple):
    """Muon's momentum buffer, mirroring the (2-D) params it updates."""

    momentum_buffer: Tree


def newton_schulz(x: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7) -> torch.Tensor:
    """Orthogonalise a bfloat16 matrix (m, n) as ``torch.optim.Muon`` does (quintic iteration)."""
    a, b, c = coefficients
    o = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        o = o.T
    o = o.div(o.norm().clamp(min=eps))
    for _ in range(steps):
        gram = o @ o.T
        o = torch.addmm(o, torch.addmm(gram, gram, gram, beta=b, alpha=c), o, beta=a)
    return o.T if tall else o


def adjusted_ratio(shape, adjust_lr_fn: Optional[str]) -> float:
    """torch.optim.Muon's learning-rate factor for a matrix of ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"muon: adjust_lr_fn={adjust_lr_fn!r}; use None, 'original' or "
                     "'match_rms_adamw'")


def owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """An owner rank per matrix, balancing Newton-Schulz cost (largest first, least loaded)."""
    load, out = [0.0] * world, [0] * len(shapes)
    cost = lambda s: min(s) ** 2 * (2 * max(s) + min(s))
    for j in sorted(range(len(shapes)), key=lambda j: (-cost(shapes[j]), j)):
        r = min(range(world), key=lambda k: (load[k], k))
        out[j], load[r] = r, load[r] + cost(shapes[j])
    return out


def _all_to_all(parts: list[list[torch.Tensor]], sizes: list[int], like: torch.Tensor, pg,
                mesh) -> list[torch.Tensor]:
    """Send ``parts[d]`` (flattened) to rank ``d`` of ``pg``; return what each rank sent us."""
    inp = torch.cat([t.reshape(-1) for p in parts for t in p] or [like.new_empty(0)])
    out = like.new_empty(sum(sizes))
    with collectives.watch("all-to-all of Muon's matrices", mesh, SHARD):
        collectives.all_to_all(out, inp, sizes, [sum(t.numel() for t in p) for p in parts], pg)
    return list(out.split(sizes))


def orthogonalize(us: list[torch.Tensor], lays: list, mesh, ns) -> list[torch.Tensor]:
    """Each rank's rows of ``newton_schulz(whole matrix)`` for local bf16 shards ``us``."""
    sdim = mesh.mesh_dim_names.index(SHARD)
    world, me, pg = mesh.size(sdim), mesh.get_local_rank(sdim), mesh.get_group(SHARD)
    own = owners([tuple(lay.shape) for lay in lays], world)
    mine = [j for j in range(len(us)) if own[j] == me]
    like = torch.empty(0, dtype=torch.bfloat16, device=mesh_device(mesh))
    send = [[] if d == me else [us[j] for j in range(len(us)) if own[j] == d] for d in range(world)]
    got = _all_to_all(send, [0 if s == me else sum(lays[j].rows_on(s) * lays[j].row_numel
                                                   for j in mine) for s in range(world)],
                      like, pg, mesh)
    offs, results = [0] * world, {}
    for j in mine:
        rows = []
        for s in range(world):
            if s == me:
                rows.append(us[j])
                continue
            n = lays[j].rows_on(s) * lays[j].row_numel
            rows.append(got[s][offs[s]:offs[s] + n].view(-1, *lays[j].shape[1:]))
            offs[s] += n
        results[j] = ns(torch.cat(rows))
    back = [[] if d == me else [results[j].narrow(0, min(lays[j].rows, d * lays[j].chunk),
                                                  lays[j].rows_on(d)) for j in mine]
            for d in range(world)]
    got = _all_to_all(back, [0 if s == me else sum(lays[j].local_rows * lays[j].row_numel
                                                   for j in range(len(us)) if own[j] == s)
                             for s in range(world)], like, pg, mesh)
    out, offs = [], [0] * world
    for j, lay in enumerate(lays):
        if own[j] == me:
            out.append(results[j].narrow(0, lay.start, lay.local_rows))
            continue
        n = lay.local_rows * lay.row_numel
        out.append(got[own[j]][offs[own[j]]:offs[own[j]] + n].view(lay.local_shape))
        offs[own[j]] += n
    return out


def scale_by_muon(momentum: float = 0.95, *, nesterov: bool = True,
                  ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7, ns_steps: int = 5,
                  adjust_lr_fn: Optional[str] = None) -> GradientTransformation:
    """Muon's direction for 2-D leaves: momentum on the shards, then each whole matrix
    orthogonalised once on its owner rank (see [Note: Muon on shards]), times torch's
    learning-rate adjustment. State :class:`MuonState`."""
    if not momentum >= 0.0:
        raise ValueError(f"Invalid momentum: {momentum!r} (valid range: momentum >= 0)")
    if not 0 < ns_steps < 100:
        raise ValueError(f"Invalid ns_steps: {ns_steps!r} (valid range: 0 < ns_steps < 100)")
    adjusted_ratio((1, 1), adjust_lr_fn)  # validates the name
    ns = lambda x: newton_schulz(x, ns_coefficients, ns_steps, eps)

    def update(updates: Tree, state: MuonState, params: Tree, *, step: int):
        spec, leaves, idx, grads, _, (bufs,) = active(updates, params, state.momentum_buffer)
        paths, p_leaves, _ = flatten(params)
        with torch.no_grad():
            us = []
            for i, g, buf in zip(idx, grads, bufs):
                _check_matrix(paths[i], p_leaves[i])
                buf.lerp_(g, 1 - momentum)
                us.append((g.lerp(buf, momentum) if nesterov else buf).bfloat16())
            out = _directions(us, [p_leaves[i] for i in idx], [paths[i] for i in idx], ns)
        new = list(leaves)
        for i, o in zip(idx, out):
            p = p_leaves[i]
            new[i] = Delta(o.to(p.dtype), numer=adjusted_ratio(p.shape, adjust_lr_fn), final=True)
        return unflatten(spec, new), state

    return GradientTransformation(lambda params: MuonState(zeros_tree(params)), update)


def _check_matrix(path: tuple, p) -> None:
    if p.ndim != 2 or p.is_complex():
        raise ValueError(
            f"muon: leaf {path_str(path)} of shape {tuple(p.shape)} ({p.dtype}) is not a real "
            "2-D matrix; give it another rule (fs.optim.muon(other=...) takes every leaf that "
            "is not 2-D)")


def _directions(us: list, ps: list, paths: list, ns) -> list[torch.Tensor]:
    """Orthogonalised local rows: sharded matrices through their owners, the rest in place."""
    mesh = next((p.device_mesh for p in ps if isinstance(p, DTensor)), None)
    lays = [layout_of(path_str(path), p) if isinstance(p, DTensor) else None
            for p, path in zip(ps, paths)]
    spread = [j for j, lay in enumerate(lays) if lay is not None and lay.sharded and lay.world > 1]
    out = [None if j in spread else ns(u) for j, u in enumerate(us)]
    if spread:
        for j, o in zip(spread, orthogonalize([us[j] for j in spread], [lays[j] for j in spread],
                                              mesh, ns)):
            out[j] = o
    return out


def muon(lr=1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
         ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7, ns_steps: int = 5,
         adjust_lr_fn: Optional[str] = None, *, other=None, matrices=None) -> Optimizer:
    """``torch.optim.Muon`` on the 2-D leaves, ``other`` (AdamW) on the rest, on shards.

    Args:
        lr: as ``torch.optim.Muon``'s, or a schedule ``step -> lr``.
        weight_decay: as ``torch.optim.Muon``'s.
        momentum: as ``torch.optim.Muon``'s.
        nesterov: as ``torch.optim.Muon``'s.
        ns_coefficients: as ``torch.optim.Muon``'s (the Newton-Schulz polynomial's a, b, c).
        eps: as ``torch.optim.Muon``'s.
        ns_steps: as ``torch.optim.Muon``'s (Newton-Schulz iterations).
        adjust_lr_fn: as ``torch.optim.Muon``'s (``"original"`` or ``"match_rms_adamw"``).
        other: the rule for leaves that are not Muon's (embeddings, norms, biases); default
            ``adamw(3e-4, weight_decay=0.01)``, as torch's Muon documentation advises.
        matrices: ``fqn -> bool`` choosing which 2-D leaves Muon takes (default: all of them;
            keep embeddings and the output head on AdamW, e.g. ``lambda f: "embed" not in f``).
    Returns:
        An :class:`Optimizer`, state ``MultiTransformState({"muon": MuonState, "other": ...})``.

    Example: ``fs.train_step(loss_fn, fs.optim.muon(lr=0.02), policy=fs.Policy())``.
    """
    rule = chain(scale_by_muon(momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
                               eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn),
                 add_decayed_weights(weight_decay), scale_by_learning_rate(lr))
    takes = lambda fqn, p: (p is not None and p.ndim == 2 and (matrices is None or matrices(fqn)))
    label = lambda fqn, p: "muon" if takes(fqn, p) else "other"
    other = other or adamw(3e-4, weight_decay=0.01)
    rest = getattr(other, "traced", None)
    gated = traceable(rest) and rest.kind in ("adam", "sgd") and rest.clip is None
    return chain(multi_transform({"muon": rule, "other": other}, label))._replace(
        traced=Traced("muon", lr, (momentum, nesterov, tuple(ns_coefficients), eps, ns_steps,
                                   adjust_lr_fn), weight_decay, True, takes,
                      other=rest) if gated else None)


# [Note: Muon gated on the device] The step's update without a host read ([Note: a step that
# reads nothing] in funshard.step.deferred) runs Muon's own ops with the step's ``(clip factor,
# ok)`` on the device: the momentum and the parameter are worked out new, and each takes its
# new value where ``ok`` holds (and, for a leaf this rank left unreached, where some rank
# reached it), else keeps its old one. Each matrix's orthogonalisation and its two
# all-to-alls run either way, so every rank takes part in the same collectives; they run
# eagerly in the compiled step too (the collectives' split sizes are the host's), after its
# gradients' program. The ops are the chain's in its order (the clip's factor, the momentum's
# lerp, ``p *= 1 - lr * wd``, ``p += -lr * ratio * direction``), so where ``ok`` holds the
# numbers are the chain's. Where the step before's verdict is unread and a schedule gives
# the two cases different learning rates (the compiled step under ``skip_nonfinite``: [Note:
# two counts in doubt] in funshard.step.deferred), the scalars of both go to the device and
# the step before's verdict there chooses. The leaves Muon does not take go through the other
# rule's update.


def gated_update(t: Traced, grads: list, state: MuonState, params: Tree, *, step: int,
                 norm: Optional[float] = None, dev: Optional[torch.Tensor] = None,
                 doubt: Optional[tuple] = None, reach: Optional[dict] = None) -> None:
    """Muon's update of the leaves with a gradient in ``grads`` (local tensors or DTensors,
    None elsewhere), in place: gated by ``dev``'s ``(clip factor, ok, the step before
    applied)`` and ``reach``'s flag per leaf, or (``dev`` None) with ``norm`` the step's
    global norm read on the host; ``doubt``: the step before's verdict is unread ([Note:
    Muon gated on the device])."""
    momentum, nesterov, coefficients, eps, ns_steps, adjust_lr_fn = t.hyper
    paths, p_leaves, _ = flatten(params)
    idx = [i for i, g in enumerate(grads) if g is not None]
    bufs = flatten(state.momentum_buffer)[1]
    check_held(paths, idx, bufs)
    if not idx:
        return
    if dev is None:
        gain = clip_factor(t, norm)
        keeps = [None] * len(idx)
    else:
        gain, ok = dev[0], dev[1] > 0
        keeps = [ok if reach is None or i not in reach else ok & reach[i] for i in idx]
    alphas, shrink = _scales(t, [p_leaves[i].shape for i in idx], step, dev, doubt)
    ns = lambda x: newton_schulz(x, coefficients, ns_steps, eps)
    with torch.no_grad():
        us = []
        for i, keep in zip(idx, keeps):
            _check_matrix(paths[i], p_leaves[i])
            p, buf = local(p_leaves[i]), local(bufs[i])
            g = local(grads[i]).to(p.dtype) * gain
            b2 = buf.lerp(g, 1 - momentum)
            us.append((g.lerp(b2, momentum) if nesterov else b2).bfloat16())
            _put(buf, b2, keep)  # (the new momentum: one leaf's at a time)
        out = _directions(us, [p_leaves[i] for i in idx], [paths[i] for i in idx], ns)
        for i, o, keep, alpha in zip(idx, out, keeps, alphas):
            p = local(p_leaves[i])
            p2 = p.mul(shrink) if t.weight_decay != 0.0 else p
            o = o.to(p.dtype)
            _put(p, p2.add(o, alpha=alpha) if isinstance(alpha, float) else p2 + o * alpha, keep)


def _put(old: torch.Tensor, new: torch.Tensor, keep) -> None:
    old.copy_(new if keep is None else torch.where(keep, new, old))


def _scales(t: Traced, shapes: list, step: int, dev, doubt) -> tuple[list, Any]:
    """Per matrix ``-lr * ratio``, and ``1 - lr * wd``, as the chain forms them: Python
    floats, or where the step before's verdict is unread and the two cases differ, float32
    on the device, the verdict's choice."""
    rows = []
    for n in (step, step - 1) if doubt is not None and dev is not None else (step,):
        lr = lr_at(t.lr, n)
        rows.append([adjusted_ratio(s, t.hyper[5]) * -lr / 1.0 for s in shapes]
                    + [1 + t.weight_decay * (-lr / 1.0)])
    if len(rows) == 1 or rows[0] == rows[1]:
        return rows[0][:-1], rows[0][-1]
    both = scalars(rows, dev.device)
    chosen = torch.where(dev[2] > 0, both[0], both[1])
    return list(chosen[:-1].unbind()), chosen[-1]
