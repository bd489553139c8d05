"""Parity of a sharded training run with one process: :func:`assert_parity`.

N ranks with batch B each must match one process training on the concatenated N*B batch
(the design's numerics contract). ``assert_parity`` trains ``fs.train_step`` on each mesh of
a pool and, in the calling process, the same loss and optimizer on plain tensors over the
whole batch, and fails naming the first step, leaf, rank and difference beyond the
tolerance.

    >>> opt = functools.partial(fs.optim.sgd, lr=0.1)        # a factory: sent to the ranks
    >>> assert_parity(funshard_pool, model, opt, batches, criterion=F.mse_loss,
    ...               meshes=[2, "2x2"])                      # batches: [(x, y), ...]
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import pytree
from ..reduce import real
from .lane import mesh, world_of
from .pool import Pool, Pools


class ModelLoss:
    """``loss_fn(params, (inputs, targets))`` = ``criterion(model(inputs), targets)`` through
    ``fs.call``; picklable when the model and the criterion are."""

    def __init__(self, model: nn.Module, criterion: Callable):
        self.model, self.criterion = model, criterion

    def __call__(self, params, batch):
        from ..step import call

        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"assert_parity: with a model, each batch is (inputs, targets); "
                            f"got {type(batch).__name__}")
        return self.criterion(call(self.model, params, batch[0]), batch[1])


def assert_parity(pool: Pools | Pool, model: nn.Module | Callable, optimizer: Callable,
                  batches: Sequence, *, params: Any = None, criterion: Callable | None = None,
                  meshes: Sequence = (2,), policy: Any = None, atol: float = 1e-5,
                  rtol: float = 1e-5, timeout: float | None = None) -> None:
    """Train ``len(batches)`` steps on each mesh and in one process; fail at the first leaf
    (or loss) that differs beyond ``atol + rtol * |one process|``.

    Args:
        pool: the ``funshard_pool`` fixture (any mesh up to its size) or a :class:`Pool`
            (meshes of its world).
        model: an ``nn.Module`` (with ``criterion``; batches are ``(inputs, targets)``), or
            ``loss_fn(params, batch) -> loss`` (with ``params``). Module-level (pickled).
        optimizer: a picklable factory of an ``fs.optim`` optimizer, e.g.
            ``functools.partial(fs.optim.adamw, lr=1e-2)``: the same optimizer steps the
            shards and, in one process, the plain tensors.
        batches: global batches (trees of tensors); rank r of N takes rows ``[r*B, (r+1)*B)``
            of each leaf's dim 0, so it must divide by N times ``policy.accumulate``.
        params: the tree ``loss_fn`` trains (plain tensors; ``requires_grad=False`` leaves are
            frozen).
        criterion: ``(outputs, targets) -> loss`` for a model, e.g. ``F.cross_entropy``.
        meshes: mesh specs (``2``, ``"2x2"``) to train on.
        policy: an ``fs.Policy`` (mixed precision needs a looser tolerance; the one process
            computes in the parameters' dtype).
        atol: the absolute tolerance, elementwise, as ``torch.isclose``'s.
        rtol: the relative tolerance, elementwise, as ``torch.isclose``'s.
        timeout: seconds per mesh's run (default: the pool's).
    Raises:
        AssertionError: naming the mesh, step, rank, leaf, the max abs diff and the tolerance.
        TypeError: an argument of the wrong kind, by name.
        ValueError: a bad value (a mesh spec, batch rows that do not divide), by name.

    Example:
        >>> assert_parity(funshard_pool, MyNet(), functools.partial(fs.optim.sgd, lr=0.1),
        ...               [(torch.randn(8, 5), torch.randn(8, 3))] * 3, criterion=F.mse_loss,
        ...               meshes=[2, "2x2"])     # 8 rows: 4 per rank on 2 ranks, 2 on 2x2
    """
    loss_fn, params = _loss_and_params(model, params, criterion)
    policy, meshes = _check(pool, optimizer, policy, batches, meshes)
    ref = reference(loss_fn, params, optimizer(), batches, policy)
    args = (loss_fn, params, optimizer, policy, batches)
    for spec in meshes:
        if isinstance(pool, Pool):
            ranks = pool.run(train_on_ranks, spec, *args, timeout=timeout)
        else:
            ranks = pool.run(spec, train_on_ranks, *args, timeout=timeout)
        for step in range(len(batches)):
            for rank, ours in enumerate(ranks):
                why = _difference(ours[step], ref[step], atol, rtol)
                if why:
                    raise AssertionError(
                        f"assert_parity: mesh {spec!r}, step {step + 1} of {len(batches)}, rank "
                        f"{rank}: {why} (N ranks vs one process on the concatenated batch)")


def _check(pool, optimizer, policy, batches, meshes) -> tuple[Any, list]:
    """The policy (default ``fs.Policy()``) and the list of mesh specs, once the arguments
    are checked: a TypeError / ValueError names the first bad one."""
    from ..step import Policy

    if isinstance(optimizer, tuple) or not callable(optimizer):
        raise TypeError("assert_parity: optimizer must be a picklable factory of an fs.optim "
                        "optimizer, e.g. functools.partial(fs.optim.sgd, lr=0.1); an optimizer "
                        f"object holds closures that cannot travel to the ranks (got "
                        f"{type(optimizer).__name__})")
    policy = Policy() if policy is None else policy
    if not isinstance(policy, Policy):
        raise TypeError(f"assert_parity: policy must be an fs.Policy, got "
                        f"{type(policy).__name__}")
    if not isinstance(batches, (list, tuple)) or not batches:
        raise ValueError("assert_parity: batches must be a non-empty list of global batches")
    meshes = [meshes] if isinstance(meshes, (int, str)) else list(meshes)
    for spec in meshes:
        if isinstance(pool, Pool) and world_of(spec) != pool.world:
            raise ValueError(f"assert_parity: mesh {spec!r} needs {world_of(spec)} ranks; "
                             f"the Pool has {pool.world}")
        _check_rows(batches, world_of(spec), policy.accumulate, spec)
    return policy, meshes


def _loss_and_params(model, params, criterion) -> tuple[Callable, Any]:
    if isinstance(model, nn.Module):
        if params is not None:
            raise TypeError("assert_parity: give params with a loss_fn, not with a model (its "
                            "parameters are the ones trained)")
        if criterion is None or not callable(criterion):
            raise TypeError("assert_parity: a model needs criterion=(outputs, targets) -> loss, "
                            "e.g. torch.nn.functional.cross_entropy")
        return ModelLoss(model, criterion), pytree.params(model)
    if not callable(model):
        raise TypeError(f"assert_parity: expected an nn.Module or loss_fn(params, batch), got "
                        f"{type(model).__name__}")
    if params is None:
        raise TypeError("assert_parity: a loss_fn needs params=, the tree it trains")
    return model, params


def _check_rows(batches: Sequence, world: int, accumulate: int, spec) -> None:
    for i, batch in enumerate(batches):
        for key, x in pytree.fqn_dict(batch).items():
            if isinstance(x, torch.Tensor) and (x.ndim == 0 or x.shape[0] % (world * accumulate)):
                rows = x.shape[0] if x.ndim else "no"
                raise ValueError(
                    f"assert_parity: batches[{i}] leaf {key!r} has {rows} rows: mesh {spec!r} "
                    f"splits dim 0 over {world} ranks x {accumulate} micro-batches; give a "
                    f"multiple of {world * accumulate}")


def _split(batch, rank: int, world: int):
    def mine(x):
        return x.chunk(world)[rank] if isinstance(x, torch.Tensor) else x

    return pytree.tree_map(mine, batch)


def _record(loss: float, params) -> tuple[float, dict]:
    return loss, {k: v.detach().clone() for k, v in pytree.fqn_dict(params).items()}


def train_on_ranks(spec, loss_fn, params, make_optimizer, policy, batches) -> list:
    """(On every rank.) ``fs.train_step`` on this rank's rows of each batch; per step the
    loss (the mean over ranks) and this rank's unsharded parameters."""
    from .. import shard, train_step, unshard

    rank, world = dist.get_rank(), dist.get_world_size()
    step = train_step(loss_fn, make_optimizer(), policy=policy)
    state = step.init(shard(params, mesh(spec)))
    out = []
    for batch in batches:
        state, metrics = step(state, _split(batch, rank, world))
        with torch.no_grad():
            out.append(_record(float(metrics["loss"]), unshard(state.params)))
    return out


def reference(loss_fn: Callable, params, optimizer, batches: Sequence, policy) -> list:
    """One process on the whole batches: plain autograd, the policy's clipping (as
    ``torch.nn.utils.clip_grad_norm_``), ``optimizer`` on plain tensors. Per step the loss
    and the parameters, as :func:`train_on_ranks` records them."""
    leaves, spec = pytree.flatten(params)
    p = pytree.unflatten(spec, [x.detach().clone().requires_grad_(x.requires_grad)
                                for x in leaves])
    state = optimizer.init(p)
    out = []
    for i, batch in enumerate(batches):
        leaves = pytree.leaves(p)
        trainable = [j for j, x in enumerate(leaves) if x.requires_grad]
        with _kept_in(loss_fn, p):
            loss = loss_fn(p, batch)
            got = torch.autograd.grad(loss, [leaves[j] for j in trainable], allow_unused=True)
        grads: list = [None] * len(leaves)
        for j, g in zip(trainable, got):
            grads[j] = torch.zeros_like(leaves[j]) if g is None else g
        if policy.clip_norm is not None:
            total = math.sqrt(sum(real(g).double().pow(2).sum().item()
                                  for g in got if g is not None))
            coef = min(1.0, policy.clip_norm / (total + 1e-6))
            grads = [g if g is None else g * coef for g in grads]
        p, state = optimizer.update(pytree.unflatten(spec, grads), state, p, step=i)
        out.append(_record(loss.item(), p))
    return out


def _kept_in(loss_fn: Callable, params):
    """A model's parameters are ``params`` until backward is done, as ``fs.call`` keeps them
    in a step: a forward the model checkpoints is recomputed on them, not on its own (which
    ``torch.func.functional_call`` puts back when the call returns)."""
    if not isinstance(loss_fn, ModelLoss):
        return contextlib.nullcontext()
    from ..step.install import install

    return install(loss_fn.model, pytree.fqn_dict(params))


def _difference(ours: tuple, ref: tuple, atol: float, rtol: float) -> str:
    """'' when ``ours`` (loss, leaves) is within the tolerance of ``ref``; else what differs
    first: the loss, then the leaves in tree order."""
    (loss, leaves), (ref_loss, ref_leaves) = ours, ref
    tol = f"atol={atol:g} + rtol={rtol:g} * |one process|"
    if not abs(loss - ref_loss) <= atol + rtol * abs(ref_loss):
        return (f"the loss differs: {loss!r} vs {ref_loss!r} (diff {abs(loss - ref_loss):.3g}), "
                f"beyond {tol}")
    for key, want in ref_leaves.items():
        got = leaves.get(key)
        if got is None or got.shape != want.shape:
            return (f"leaf {key!r} has shape {None if got is None else tuple(got.shape)}, one "
                    f"process {tuple(want.shape)}")
        if not want.numel():
            continue
        a, b = real(got).double(), real(want).double()  # a complex leaf: its parts
        bad = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            diff = (a - b).abs().nan_to_num(nan=math.inf)
            at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
            return (f"leaf {key!r} differs by {diff.max().item():.3g} (max abs diff, at {at}: "
                    f"{a[at].item():.6g} vs {b[at].item():.6g}), beyond {tol}")
    return ""
