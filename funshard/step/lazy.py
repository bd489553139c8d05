"""How a parameter reaches ``loss_fn``: a stand-in per parameter, and the autograd nodes a
group enters the graph through.

Inside the step, every parameter ``loss_fn`` sees is a :class:`LazyParam`: it has the
parameter's full shape and compute dtype and no storage. Its ``__torch_function__`` asks
the run to make the groups of the op's parameters resident (gathering them on first use)
and runs the op on the gathered tensors. A group's first gather in a micro-batch goes
through :class:`Gather`, whose backward hands the group's gradients to the run; each
trainable leaf then passes :class:`Tap`, whose backward puts the leaf's gradient in the
group's reduce bucket. See [Note: a group's life] in :mod:`funshard.step.group`.
"""

from __future__ import annotations

import optree
import torch

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.__len__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.nelement,
}


class LazyParam(torch.Tensor):
    """A parameter inside ``loss_fn``: full shape and compute dtype; gathers on first use."""

    @staticmethod
    def __new__(cls, run, gi: int, k: int, shape, dtype, device, requires_grad):
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        t._run, t._gi, t._k = run, gi, k
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        flat, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        lazies = [x for x in flat if isinstance(x, LazyParam)]
        if lazies:
            run = lazies[0]._run
            run.use([x._gi for x in lazies], new_op=True)
            flat = [run.groups[x._gi].fulls[x._k] if isinstance(x, LazyParam) else x
                    for x in flat]
            args, kwargs = optree.tree_unflatten(spec, flat)
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"funshard: {func} reached a lazy parameter below autograd; call it through torch "
            "functions (this is a funshard bug if it came from a plain torch op)"
        )

    def __repr__(self):
        return f"LazyParam(shape={tuple(self.shape)}, dtype={self.dtype}, group={self._gi})"


def stand_ins(run, params, shards: list[torch.Tensor]) -> list[LazyParam]:
    """One stand-in per leaf of ``params`` (a :class:`ParamGroups`)."""
    return [LazyParam(run, params.group_of[i], params.pos[i], lay.shape, params.dtypes[i],
                      shards[i].device, params.trainable[i])
            for i, lay in enumerate(params.layouts)]


class Tap(torch.autograd.Function):
    """A trainable gathered leaf as ``loss_fn`` sees it. Its backward puts the leaf's
    gradient in the group's reduce bucket, so the full gradient is freed at once."""

    @staticmethod
    def forward(ctx, run, group, k, full):
        ctx.run, ctx.group, ctx.k = run, group, k
        ctx.set_materialize_grads(False)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.run.grads.put(ctx.group, ctx.k, grad)
        return None, None, None, None


class Gather(torch.autograd.Function):
    """First gather of a group in a micro-batch; backward reduces the group's gradients."""

    @staticmethod
    def forward(ctx, run, group, *shards):
        ctx.run, ctx.group = run, group
        ctx.set_materialize_grads(False)
        fulls = run.gather(group)
        frozen = [f for i, f in zip(group.idx, fulls) if not run.params.trainable[i]]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return fulls

    @staticmethod
    def backward(ctx, *grads):
        ctx.run.backward_done(ctx.group, grads)
        return (None, None, *([None] * len(grads)))


def enter(run, group) -> None:
    """A group's first use in a micro-batch: gather it through :class:`Gather` and put each
    trainable leaf behind a :class:`Tap` when gradients are streamed."""
    outs = Gather.apply(run, group, *[run.shards[i] for i in group.idx])
    if run.tapped:
        for k in run.params.grad_pos[group.gi]:
            group.fulls[k] = Tap.apply(run, group, k, outs[k])
