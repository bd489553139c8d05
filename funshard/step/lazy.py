"""How a parameter reaches ``loss_fn``: a stand-in per parameter whose ops compute with its
group's gathered tensor, and the autograd nodes a group enters the graph through.

[Note: stand-ins]

Inside the step every parameter ``loss_fn`` sees is a :class:`LazyParam`: the parameter's
full shape and compute dtype, no storage. Inside ``fs.call`` a group module's forward runs
with its group gathered and the group's full tensors installed in the module for the call
([Note: groups entered at their module] in :mod:`.call`): every op there, a custom
autograd Function's included, computes on plain tensors, at a plain op's cost. Anywhere
else (``loss_fn``'s own ops on its params, a module that is no group's, a weight tied
across groups) the stand-in stays: each torch function that touches it asks the run to make
its group resident (the group's first use gathers it with one all-gather) and computes with
the group's full tensor in its place. The stand-in object never changes: nothing is
swapped, so what a caller, a profiler or compiled code holds stays what it was, and an op
on a freed group's stand-in simply gathers it again.

A custom autograd Function given a stand-in as it is (``Function.apply`` is no torch
function, so the step does not see the call) computes with it through its ops, each of
which sees the full tensor, and autograd takes the stand-in for a leaf of its own: its
gradient accumulates in the stand-in's ``.grad``, which the run adds to the group's
gradients when backward is done with the group (:func:`taken`; autograd accumulates a
leaf's gradient as soon as it is computed). One that comes later (the Function is the
group's only use, or its first in backward's order) is refused by name after backward,
before anything is updated (:func:`check_untaken`). Activation checkpointing's recompute:
[Note: recomputation] in :mod:`.recompute`.

Why not make the stand-in object *become* its gathered tensor at its group's first use
(swapping its C++ tensor, as ``torch.utils.swap_tensors`` does, so that later ops outside
group modules cost nothing): that needs torch's private swap and use counts, fails where a
profiler holds a weak reference to the tensor (a second mechanism then), and leaves ops on
the swapped object unseen, so a freed group, the caller's saved-tensor hooks and a
recompute each needed their own repair. Measured 2026-11-27 (this 2-core CPU, runs
alternated against the swapping tree): ``benchmarks.host_floor`` 1.63-1.75x the plain step
against 1.65-1.70x, shapes A, B, C the same collectives and live-tensor peaks
(``benchmarks/results/2026-11-27-cpu-stand-ins.md``).

A group's first gather in a micro-batch goes through :class:`Gather`, whose backward hands
the group's gradients to the run; on a mesh, each trainable leaf with a large gradient
then passes :class:`Tap`, whose backward puts the leaf's gradient in the group's reduce
bucket ([Note: streamed gradients]). A group with nothing to
gather (a world of one, no cast) has no node of the step's: its full tensors are autograd
leaves on the shards' storage, as a plain step's parameters are, and the run hands their
``.grad`` over when backward is done. Measured 2026-11-24 (host-bound GPT 8 x 64, world 1,
9 groups): 8.97 -> 8.54 ms per step against the plain step's 5.56 (1.66x -> 1.54x); the
Gather node and its backward cost about 100 us per group there. When every group is such,
``loss_fn`` gets the leaves themselves, with no stand-in at all ([Note: the direct path] in
:mod:`.direct`). See [Note: a group's life] in :mod:`funshard.step.group`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _compat
from ..layout import from_model
from . import recompute

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.__len__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.nelement,
}


def _scan(values, lazies: list) -> None:
    """The stand-ins among ``values`` (one level of lists and tuples deep)."""
    for x in values:
        if isinstance(x, LazyParam):
            lazies.append(x)
        elif isinstance(x, (list, tuple)):
            _scan(x, lazies)


class LazyParam(torch.Tensor):
    """A parameter inside ``loss_fn``: full shape and compute dtype; gathers on first use."""

    @staticmethod
    def __new__(cls, run, gi: int, k: int, shape, dtype, device, requires_grad):
        t = _compat.make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        t._run, t._gi, t._k = run, gi, k
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with _compat.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _on_stand_ins(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"funshard: {func} reached a lazy parameter below autograd: a parameter kept by "
            "saved-tensor hooks entered after its group's first use and left before any "
            "parameter's first use under them (enter them earlier: [Note: hooks beneath the "
            "step's]), or a funshard bug if it came from a plain torch op"
        )

    def __repr__(self):
        if self._run is None:
            return f"LazyParam({self._gi!r}, of an ended step)"
        return f"LazyParam(shape={tuple(self.shape)}, dtype={self.dtype}, group={self._gi})"


def eager(fn):
    """``fn`` runs eagerly under torch.compile: a compiled loss_fn breaks its graph here (the
    group's gather), and compiles the compute between."""
    return torch.compiler.disable(fn)


def untraced(fn):
    """``fn``'s frames run eagerly under torch.compile, at no cost per call (no wrapper): the
    step's saved-tensor hooks, which autograd calls between a compiled loss_fn's graphs and
    which dynamo would otherwise try to compile (host work a compiled graph cannot hold:
    storage pointers, the run's bookkeeping)."""
    if _compat.skip_code is not None:
        _compat.skip_code(fn.__code__)
    return fn


# (A stand-in compiled code keeps past its step is inert: see Group.release.)
@eager
def _on_stand_ins(func, args: tuple, kwargs: dict):
    """An op touches stand-ins: their groups made resident, the op runs on their full tensors."""
    lazies: list[LazyParam] = []
    _scan(args, lazies)
    _scan(kwargs.values(), lazies)
    if not lazies:
        return func(*args, **kwargs)
    run = lazies[0]._run
    if run is None:  # its step has ended (see Group.release); _gi holds its path
        raise RuntimeError(
            f"funshard: parameter {lazies[0]._gi!r} of a train_step that has ended was used "
            f"({getattr(func, '__name__', func)}): a tensor loss_fn received escaped the step. "
            "Inside the step a parameter exists only while loss_fn runs; outside it, use the "
            "returned state (fs.unshard(state.params))."
        )
    if run.in_backward():  # a forward recomputed in backward: see [Note: recomputation]
        return _recomputed(run, func, args, kwargs, lazies)
    run.note_region()
    if func is F.batch_norm:
        _refuse_running_stats(args, kwargs)
    if _writes_into(func, args, kwargs, lazies):
        raise in_place_error(path_of(lazies[0]), func)
    gather_first(run, lazies, [x._gi for x in lazies], checked=func is not torch.Tensor.detach)
    args = _substitute(run, args)
    kwargs = dict(zip(kwargs, _substitute(run, kwargs.values())))
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:  # said as what the op did, never read from torch's words
        dt = run.policy.param_dtype
        if dt is not None and _other_dtype(args, kwargs.values(), dt):
            raise RuntimeError(
                f"train_step: {getattr(func, '__name__', func)} met parameter "
                f"{path_of(lazies[0])!r}, cast "
                f"to Policy(param_dtype={dt}), and a tensor of another dtype ({e}). Call the "
                "model with fs.call(model, params, *args), which casts floating-point inputs "
                "to it (as FSDP2's cast_forward_inputs), or cast them yourself.") from e
        raise


def gather_first(run, lazies: list, gis: list, checked: bool = True) -> None:
    """Make groups ``gis`` resident for an op on ``lazies`` (the stand-ins met), once
    the use is one the step can follow (``checked``: refused by name where not)."""
    grad = _refuse_unsupported(run, lazies) if checked else False
    with recompute.own_ops(grad):
        run.use(gis, new_op=True)


# the in-place forms of Python's operators (an in-place torch method's name ends in "_")
_IN_PLACE = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift")) | {"__setitem__"}


def _writes_into(func, args: tuple, kwargs: dict, lazies: list) -> bool:
    """Whether ``func`` writes into one of ``lazies``: in place (its first argument), or out=."""
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")
                and name != "requires_grad_") or name in _IN_PLACE
    out = kwargs.get("out")
    return any((in_place and args and args[0] is x) or out is x for x in lazies)


def _other_dtype(args, more, dt: torch.dtype) -> bool:
    """Whether a floating-point tensor among the op's arguments is not of dtype ``dt``."""
    flat = [y for x in (*args, *more) for y in (x if isinstance(x, (list, tuple)) else (x,))]
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dt
               for x in flat)


def _recomputed(run, func, args: tuple, kwargs: dict, lazies: list):
    """An op of a forward that backward recomputes touches stand-ins: it gets the gathered
    leaves, which the recompute then owns (:meth:`Run.recompute_leaf`)."""
    recompute.check_reinstalled(run)
    with recompute.own_ops(False), torch.no_grad():  # the step's own work is not recomputed
        run.use([x._gi for x in lazies], new_op=True)
        args = _substitute(run, args, recompute=True)
        kwargs = dict(zip(kwargs, _substitute(run, kwargs.values(), recompute=True)))
    return func(*args, **kwargs)


def path_of(x) -> str:
    return x._run.params.layouts[x._run.params.members[x._gi][x._k]].path


def _refuse_unsupported(run, lazies: list[LazyParam]) -> bool:
    """Under the caller's own saved-tensor hooks the step's go over them ([Note: hooks
    beneath the step's] in :mod:`.saved`), or the use is refused by name where torch offers
    no way to. Returns whether the group must enter autograd under grad mode (the op runs
    under no_grad: the user's own, a Function's forward, a reentrant checkpoint region's;
    the op takes no gradient, the group's other uses do)."""
    top = run.foreign_hooks()
    if top is not None and not recompute.is_checkpoint_hook(top[0]):  # not a region's forward
        if not run.adopt_hooks(top):
            raise NotImplementedError(
                f"train_step: parameter {path_of(lazies[0])!r} was first used under "
                "saved-tensor hooks other than the step's (this torch has no way to put the "
                "step's over them); use it once before entering them.")
    return not torch.is_grad_enabled()


def function_first(path: str) -> NotImplementedError:
    return NotImplementedError(
        f"train_step: parameter {path!r} was given to a torch.autograd.Function (a custom "
        "one, or torch.utils.checkpoint with use_reentrant=True) as it is, outside its "
        "group's module, and its gradient came after backward had handed on its group's "
        "(nothing was updated). Give the Function a tensor a torch op made of it "
        "(p.view_as(p)), call its module through fs.call (its group is gathered as the "
        "module is entered), or pass p.detach() to use it without its gradient."
    )


def taken(group, grads: list) -> None:
    """Into ``grads`` (per leaf of ``group``, None where none), the gradients its stand-ins
    took themselves, added; the stand-ins let go of them. A stand-in takes one where a
    custom ``autograd.Function`` was given it as it is (``Function.apply`` is no torch
    function: the Function computes with the stand-in's own ops, each of which sees the
    group's full tensor, and autograd holds the stand-in as a leaf of its own). Autograd
    accumulates a leaf's gradient as soon as it is computed, so it is there when backward
    is done with the group, unless the Function is the group's first use in backward's
    order (:func:`check_untaken` refuses that). A leaf the model places on its own mesh
    dimensions took the gradient as the model holds it (a DTensor): its part is taken."""
    with _compat.DisableTorchFunctionSubclass():
        for k, x in enumerate(group.stands or ()):
            if x.requires_grad and (g := x.grad) is not None:
                x.grad = None
                lay = group.params.layouts[group.idx[k]]
                if lay.model is not None:
                    g = from_model(g, lay, "train_step")
                grads[k] = g if grads[k] is None else grads[k] + g


def check_untaken(run) -> None:
    """After a micro-batch's backward: no stand-in holds a gradient :func:`taken` did not
    take (one that came after its group's gradients were handed on): refused by name."""
    with _compat.DisableTorchFunctionSubclass():
        for g in run.all_groups():
            for x in g.stands or ():
                if x.requires_grad and x.grad is not None:
                    raise function_first(path_of(x))


def _substitute(run, values, recompute: bool = False) -> list:
    """``values`` with each stand-in replaced by its group's full tensor (for a
    recompute: :meth:`Run.recompute_leaf`)."""
    out = []
    for x in values:
        if isinstance(x, LazyParam):
            x = run.model_view(x._gi, x._k, run.recompute_leaf(x._gi, x._k) if recompute
                               else run.group(x._gi).fulls[x._k])
        elif isinstance(x, (list, tuple)):
            x = type(x)(_substitute(run, x, recompute))
        out.append(x)
    return out


def in_place_error(path: str, func, landed: bool = False) -> RuntimeError:
    """``landed``: the parameter is the state's own tensor (one rank, no cast), so the
    write has changed the state; else it went to a gathered copy."""
    why = ("on one rank with no cast the step computes on the state's own tensors, so the "
           "write has changed the parameter outside the optimizer (restore it from a "
           "checkpoint)" if landed else
           "inside the step a parameter is a gathered copy, so the write would be lost")
    return RuntimeError(
        f"train_step: loss_fn wrote into parameter {path!r} in place "
        f"({getattr(func, '__name__', func)}); {why}. Compute out of place, and keep "
        "buffers out of the tree given to fs.shard."
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
            f"train_step: {path_of(stats[0])!r} is a BatchNorm running statistic in the tree "
            "given to fs.shard; batch_norm updates it in place in training, and inside the "
            "step it is a gathered copy, so the update would be lost. Give buffers to "
            "step.init(fs.shard(fs.params(model), mesh), fs.buffers(model)): loss_fn then "
            "receives (params, buffers) and their updates are kept."
        )


def stand_ins(run, params, shards: list[torch.Tensor], *,
              requires_grad: bool = True) -> list[LazyParam]:
    """One stand-in per leaf of ``params`` (a :class:`ParamGroups`), known to its group;
    trainable leaves' require grad unless ``requires_grad`` is False (evaluation)."""
    out = [LazyParam(run, params.group_of[i], params.pos[i],
                     lay.shape if lay.model is None else lay.model.shape, params.dtypes[i],
                     shards[i].device, requires_grad and params.trainable[i])
           for i, lay in enumerate(params.layouts)]
    run.set_stand_ins(out, params.group_of, params.pos)
    return out


# [Note: streamed gradients] Autograd runs Gather's backward once every output's gradient
# is complete, and holds each of them until then: a whole group's full gradients at once,
# as FSDP2 holds them until its reduce-scatter. A leaf behind a Tap of its own reaches the
# bucket as soon as its gradient is complete, and that full gradient is freed there. A Tap
# costs a node's host time, forward and backward: 8.9 us per leaf (100 leaves of 64 x 64,
# 2.61 against 1.72 ms, this 2-core CPU, 2026-11-24; a hook on a view of each leaf instead,
# 3.48 ms: registering it per step costs more; a hook on Gather's own output runs only when
# Gather does, which frees nothing early). So only a leaf whose full gradient
# is at least ``params.TAP_BYTES`` (1 MiB) is tapped; the rest (biases, norms, the leaves of
# a small model) reach the bucket from Gather's backward, a few KiB each. Measured
# 2026-11-24, 2 gloo ranks: on the host-bound GPT 8 x 64 (no leaf tapped), 0.87-0.97x the
# CPU time per step of tapping every leaf (paired rounds; bf16 in 3 runs, fp32 in 1); on
# 12 x 1024 (seq 128, batch 1, bf16) the live-tensor peak is 1545 MiB either way (tapping
# none: 1577; FSDP2: 2106).


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
        if ctx.group.ended:
            raise recompute.ended_twice(ctx.group)
        if grad is not None:
            ctx.run.put_grad(ctx.group, ctx.k, grad)
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
    trainable leaf behind a :class:`Tap` when gradients are streamed; a group with nothing
    to gather enters as autograd leaves (:meth:`Group.alias`)."""
    if group.aliases:
        group.alias()
        return
    outs = Gather.apply(run, group, *[run.shard(i) for i in group.idx])
    if run.streams():
        for k in run.params.tap_pos[group.gi]:
            group.fulls[k] = Tap.apply(run, group, k, outs[k])
