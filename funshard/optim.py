"""Pure, optax-style optimizers over (sharded) parameter pytrees.

An :class:`Optimizer` is a pair of pure-looking functions ``init(params) -> state``
and ``update(grads, state, params, *, step) -> (new_params, new_state)``. Leaves of
``params`` are :class:`~torch.distributed.tensor.DTensor` shards or plain tensors; the
math runs on the local shards with ``torch._foreach_*`` ops and never communicates.

Donation rule: like JAX donated buffers, ``update`` modifies the local shards of
``params`` and of ``state`` IN PLACE (under ``torch.no_grad()``) and returns trees
that share storage with its inputs. Callers must not use the old ``params`` / ``state``
after the call. Parameter leaves keep their identity (a leaf requiring grad stays one).
Grads are never modified.

The math reproduces ``torch.optim.SGD(foreach=True)`` and ``torch.optim.AdamW(foreach=True)``
op for op, with one difference: the step count is global (the ``step`` argument), whereas
torch counts per parameter, so a parameter whose grad is ``None`` on some steps sees a
different bias correction (AdamW) / momentum-buffer initialisation (SGD) than in torch.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import optree
import torch
from torch.distributed.tensor import DTensor

Tree = Any
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]

__all__ = ["Optimizer", "SGDState", "AdamWState", "sgd", "adamw"]


class Optimizer(NamedTuple):
    """A pair of functions ``init(params) -> state`` and ``update(grads, state, params, *, step)``."""

    init: Callable[[Tree], Tree]
    update: Callable[..., tuple[Tree, Tree]]


class SGDState(NamedTuple):
    """SGD state: ``momentum_buffer`` mirrors params (all ``None`` leaves when momentum == 0)."""

    momentum_buffer: Tree


class AdamWState(NamedTuple):
    """AdamW state: first and second moment estimates, each mirroring params."""

    exp_avg: Tree
    exp_avg_sq: Tree


# ----------------------------------------------------------------------------- helpers


def _is_none(x: Any) -> bool:
    return x is None


def _flatten(tree: Tree) -> tuple[list, list, Any]:
    """Flatten keeping ``None`` as leaves so that trees with holes stay aligned."""
    return optree.tree_flatten_with_path(tree, is_leaf=_is_none, none_is_leaf=False, namespace="funshard")


def _path_str(path: tuple) -> str:
    return ".".join(str(k) for k in path) if path else "<root>"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _check(name: str, value: float, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (valid range: {valid})")


def _check_lr(lr: ScalarOrSchedule) -> None:
    if not callable(lr):
        _check("lr", lr, float(lr) >= 0.0, "lr >= 0")


def _lr_at(lr: ScalarOrSchedule, step: int) -> float:
    value = float(lr(step)) if callable(lr) else float(lr)
    _check(f"lr (schedule value at step {step})", value, value >= 0.0, "lr >= 0")
    return value


def _zeros_like(p: Any) -> Any:
    """Zero state sharded like ``p``; ``None`` for frozen (requires_grad=False) params."""
    if p is None or not p.requires_grad:
        return None
    local = torch.zeros_like(_local(p).detach(), memory_format=torch.preserve_format)
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


def _gather(grads: Tree, params: Tree, states: tuple[Tree, ...], step: int):
    """Align trees and return (spec, param leaves, active indices, local lists per tree)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"Invalid step: {step!r} (valid range: int >= 0)")
    p_paths, p_leaves, spec = _flatten(params)
    g_paths, g_leaves, g_spec = _flatten(grads)
    if p_paths != g_paths:
        first = next((a, b) for a, b in zip(p_paths + [None], g_paths + [None]) if a != b)
        raise ValueError(
            "grads and params trees differ: first differing path is "
            f"{_path_str(first[0]) if first[0] is not None else '<missing>'} in params vs "
            f"{_path_str(first[1]) if first[1] is not None else '<missing>'} in grads"
        )
    if g_spec != spec:
        raise ValueError(f"grads and params trees have different node types: {g_spec} vs {spec}")
    s_leaves = []
    for s in states:
        s_paths, leaves, _ = _flatten(s)
        if s_paths != p_paths:
            raise ValueError("optimizer state tree does not match the params tree structure")
        s_leaves.append(leaves)
    idx, p_loc, g_loc = [], [], []
    for i, (path, p, g) in enumerate(zip(p_paths, p_leaves, g_leaves)):
        if g is None or p is None:
            continue
        if g.shape != p.shape and not (isinstance(p, DTensor) and not isinstance(g, DTensor) and g.shape == _local(p).shape):
            raise ValueError(f"grad shape mismatch at {_path_str(path)}: param {tuple(p.shape)} vs grad {tuple(g.shape)}")
        if isinstance(p, DTensor) and isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            raise ValueError(f"grad placements at {_path_str(path)} are {g.placements}, param has {p.placements}")
        if any(leaves[i] is None for leaves in s_leaves):
            raise ValueError(f"grad given for {_path_str(path)} which has no optimizer state (requires_grad=False at init)")
        pl, gl = _local(p), _local(g)
        idx.append(i)
        p_loc.append(pl)
        g_loc.append(gl if gl.dtype == pl.dtype else gl.to(pl.dtype))
    s_loc = [[_local(leaves[i]) for i in idx] for leaves in s_leaves]
    return spec, p_leaves, s_leaves, idx, p_loc, g_loc, s_loc


def _groups(idx_lists: list[list[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
    """Split parallel tensor lists into groups by the (device, dtype) of the first list."""
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    for j, t in enumerate(idx_lists[0]):
        g = groups.setdefault((t.device, t.dtype), [[] for _ in idx_lists])
        for k, lst in enumerate(idx_lists):
            g[k].append(lst[j])
    return list(groups.values())


# ----------------------------------------------------------------------------- optimizers


def sgd(lr: ScalarOrSchedule, momentum: float = 0.0, weight_decay: float = 0.0, *,
        nesterov: bool = False, dampening: float = 0.0) -> Optimizer:
    """Stochastic gradient descent, matching ``torch.optim.SGD(foreach=True)``.

    Args:
      lr: learning rate, or a schedule ``step -> lr`` (``step`` = updates already applied).
      momentum: momentum factor (>= 0); the buffer is set to the first grad at ``step == 0``.
      weight_decay: L2 penalty added to the gradient (>= 0).
      nesterov: use Nesterov momentum (requires momentum > 0 and dampening == 0).
      dampening: dampening for momentum.

    Returns:
      An :class:`Optimizer` with state :class:`SGDState`. ``update`` donates params and state
      (see the module docstring).

    Example::

      opt = sgd(0.1, momentum=0.9)
      state = opt.init(params)
      params, state = opt.update(grads, state, params, step=0)
    """
    _check_lr(lr)
    _check("momentum", momentum, momentum >= 0.0, "momentum >= 0")
    _check("weight_decay", weight_decay, weight_decay >= 0.0, "weight_decay >= 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"Invalid nesterov=True with momentum={momentum!r}, dampening={dampening!r} "
                         "(valid range: momentum > 0 and dampening == 0)")

    def init(params: Tree) -> SGDState:
        if momentum == 0:
            return SGDState(optree.tree_map(lambda p: None, params, is_leaf=_is_none, namespace="funshard"))
        return SGDState(optree.tree_map(_zeros_like, params, is_leaf=_is_none, namespace="funshard"))

    def update(grads: Tree, state: SGDState, params: Tree, *, step: int) -> tuple[Tree, SGDState]:
        spec, p_leaves, s_leaves, _, p_loc, g_loc, s_loc = _gather(
            grads, params, (state.momentum_buffer,) if momentum != 0 else (), step)
        lr_t = _lr_at(lr, step)
        with torch.no_grad():
            for ps, gs, *bufs in _groups([p_loc, g_loc, *s_loc]):
                if weight_decay != 0:
                    gs = torch._foreach_add(gs, ps, alpha=weight_decay)
                if momentum != 0:
                    (bufs,) = bufs
                    if step == 0:
                        torch._foreach_copy_(bufs, gs)
                    else:
                        torch._foreach_mul_(bufs, momentum)
                        torch._foreach_add_(bufs, gs, alpha=1 - dampening)
                    gs = torch._foreach_add(gs, bufs, alpha=momentum) if nesterov else bufs
                torch._foreach_add_(ps, gs, alpha=-lr_t)
        new_state = SGDState(optree.tree_unflatten(spec, s_leaves[0]) if momentum != 0 else state.momentum_buffer)
        return optree.tree_unflatten(spec, p_leaves), new_state

    return Optimizer(init, update)


def adamw(lr: ScalarOrSchedule, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01) -> Optimizer:
    """AdamW (decoupled weight decay), matching ``torch.optim.AdamW(foreach=True)``.

    Args:
      lr: learning rate, or a schedule ``step -> lr`` (``step`` = updates already applied;
        bias corrections use ``step + 1``).
      betas: coefficients ``(beta1, beta2)`` of the running averages, each in [0, 1).
      eps: term added to the denominator (>= 0).
      weight_decay: decoupled weight decay, applied as ``p *= 1 - lr * weight_decay`` (>= 0).

    Returns:
      An :class:`Optimizer` with state :class:`AdamWState`. ``update`` donates params and state
      (see the module docstring).

    Example::

      opt = adamw(1e-3, weight_decay=0.1)
      state = opt.init(params)
      for step in range(n):
          params, state = opt.update(grads_fn(params), state, params, step=step)
    """
    _check_lr(lr)
    beta1, beta2 = betas
    _check("betas[0]", beta1, 0.0 <= beta1 < 1.0, "0 <= beta1 < 1")
    _check("betas[1]", beta2, 0.0 <= beta2 < 1.0, "0 <= beta2 < 1")
    _check("eps", eps, eps >= 0.0, "eps >= 0")
    _check("weight_decay", weight_decay, weight_decay >= 0.0, "weight_decay >= 0")

    def init(params: Tree) -> AdamWState:
        zeros = lambda: optree.tree_map(_zeros_like, params, is_leaf=_is_none, namespace="funshard")
        return AdamWState(exp_avg=zeros(), exp_avg_sq=zeros())

    def update(grads: Tree, state: AdamWState, params: Tree, *, step: int) -> tuple[Tree, AdamWState]:
        spec, p_leaves, s_leaves, _, p_loc, g_loc, s_loc = _gather(
            grads, params, (state.exp_avg, state.exp_avg_sq), step)
        lr_t = _lr_at(lr, step)
        bias_correction1 = 1 - beta1 ** float(step + 1)
        bias_correction2_sqrt = (1 - beta2 ** float(step + 1)) ** 0.5
        step_size = (lr_t / bias_correction1) * -1
        with torch.no_grad():
            for ps, gs, m, v in _groups([p_loc, g_loc, *s_loc]):
                if weight_decay != 0:
                    torch._foreach_mul_(ps, 1 - lr_t * weight_decay)
                torch._foreach_lerp_(m, gs, 1 - beta1)
                torch._foreach_mul_(v, beta2)
                torch._foreach_addcmul_(v, gs, gs, 1 - beta2)
                denom = torch._foreach_sqrt(v)
                torch._foreach_div_(denom, bias_correction2_sqrt)
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_(ps, m, denom, step_size)
        new_state = AdamWState(optree.tree_unflatten(spec, s_leaves[0]), optree.tree_unflatten(spec, s_leaves[1]))
        return optree.tree_unflatten(spec, p_leaves), new_state

    return Optimizer(init, update)
