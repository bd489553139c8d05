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
import torch.nn.functional as F

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
        if not lazies:
            return func(*args, **kwargs)
        run = lazies[0]._run
        if not run.backward and func is not torch.Tensor.detach:
            _refuse_unsupported(run, lazies)
        run.use([x._gi for x in lazies], new_op=True)
        if func is F.batch_norm:
            _refuse_running_stats(args, kwargs)
        flat = [run.groups[x._gi].fulls[x._k] if isinstance(x, LazyParam) else x
                for x in flat]
        used = [(x, run.groups[x._gi].fulls[x._k]) for x in lazies]
        versions = [f._version for _, f in used]
        args, kwargs = optree.tree_unflatten(spec, flat)
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:  # autograd forbids writing into a trainable one
            if "modified inplace" in str(e):
                raise _in_place_error(lazies[0], func) from e
            raise
        for (x, f), v in zip(used, versions):
            if f._version != v:
                raise _in_place_error(x, func)
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"funshard: {func} reached a lazy parameter below autograd; call it through torch "
            "functions (this is a funshard bug if it came from a plain torch op)"
        )

    def __repr__(self):
        return f"LazyParam(shape={tuple(self.shape)}, dtype={self.dtype}, group={self._gi})"


def _path(x: LazyParam) -> str:
    return x._run.params.layouts[x._run.params.members[x._gi][x._k]].path


# torch's stack of saved-tensor hooks (private; present in every supported torch)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _refuse_unsupported(run, lazies: list[LazyParam]) -> None:
    """What the stand-in cannot make correct yet is refused by name, not trained wrong:
    activation checkpointing inside ``loss_fn`` (its recompute in backward would run the
    module's own, stale weights and give the parameters no gradient)."""
    hooks = _top_hooks(False) if _top_hooks is not None else None
    if hooks is not None and getattr(hooks[0], "__self__", None) is not run.saved:
        what = "saved-tensor hooks other than the step's (torch.utils.checkpoint with "
        what += "use_reentrant=False, selective checkpointing, or saved_tensors_hooks)"
    elif not torch.is_grad_enabled() and any(x.requires_grad for x in lazies):
        what = ("torch.no_grad() (as torch.utils.checkpoint with use_reentrant=True, "
                "gradient_checkpointing_enable() and a custom torch.autograd.Function's "
                "forward run)")
    else:
        return
    raise NotImplementedError(
        f"train_step: parameter {_path(lazies[0])!r} was used under {what}. Activation "
        "checkpointing inside loss_fn is not supported yet: its recompute in backward would "
        "read the module's own weights, not the step's, and train wrong; a custom autograd "
        "Function would take the parameter past the step's gradient reduction. Turn "
        "checkpointing off (e.g. model.gradient_checkpointing_disable()); to use a parameter "
        "without its gradient, use p.detach()."
    )


def _in_place_error(x: LazyParam, func) -> RuntimeError:
    return RuntimeError(
        f"train_step: loss_fn wrote into parameter {_path(x)!r} in place "
        f"({getattr(func, '__name__', func)}); inside the step a parameter is a gathered "
        "copy, so the write would be lost. Compute out of place, and keep buffers out of the "
        "tree given to fs.shard."
    )


def _refuse_running_stats(args: tuple, kwargs: dict) -> None:
    """F.batch_norm updates its running statistics in place without a version bump: a
    stand-in passed there in training would lose the update silently."""
    names = ("input", "running_mean", "running_var", "weight", "bias", "training")
    bound = {**dict(zip(names, args)), **kwargs}
    stats = [x for x in (bound.get("running_mean"), bound.get("running_var"))
             if isinstance(x, LazyParam)]
    if stats and bound.get("training", False):
        raise NotImplementedError(
            f"train_step: {_path(stats[0])!r} is a BatchNorm running statistic in the tree "
            "given to fs.shard; batch_norm updates it in place in training, and inside the "
            "step it is a gathered copy, so the update would be lost. Keep buffers out of the "
            "sharded tree (fs.params(model) has parameters only); funshard does not carry "
            "buffers yet."
        )


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
