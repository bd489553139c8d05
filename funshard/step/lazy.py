"""How a parameter reaches ``loss_fn``: a stand-in per parameter that *becomes* its gathered
tensor, and the autograd nodes a group enters the graph through.

[Note: binding]

Inside the step every parameter ``loss_fn`` sees starts as a :class:`LazyParam`: the
parameter's full shape and compute dtype, no storage. The first torch function that
touches one asks the run to make its group resident (one all-gather for the whole group)
and then *binds* every leaf of the group: the stand-in object swaps its C++ tensor with the
gathered full tensor (``torch._C._swap_tensor_impl``, as ``torch.utils.swap_tensors``
does), so the very object ``loss_fn`` and the model hold is, from then on, a plain tensor.
Every later op on it costs what an op on a plain tensor costs, custom autograd Functions
receive plain tensors, and compiled code sees plain tensors. When the run frees the group
it swaps back (the object is an empty stand-in again, and the next op gathers again); a
leaf whose full tensor something else still holds stays gathered instead (correct, never
freed under a reader). Autograd's saved copies of a bound leaf are detached by the pack
hook (:mod:`.saved`), so autograd never holds the object's own tensor.

Why, measured (2026-11-23, this 2-core CPU, world of one, thread CPU time per step, median
of 100): the previous mechanism ran *every* op that touches a parameter through
``__torch_function__`` (optree flatten/unflatten of its arguments). On a loss with 150 such
ops (a 50-step recurrence over two weights) the step took 2.29-2.30x the plain step with it,
1.42-1.48x with binding; on a tiny 8-block GPT (about 6 such ops per block) both were
1.78-1.87x (the rest is the step's per-group work, not per op). And only binding gives
custom Functions, compiled code and recomputation a plain tensor.

Limits: a custom autograd Function that is the *first* to touch a trainable parameter
receives the stand-in itself (``Function.apply`` is not a torch function), and autograd
captures it as a leaf of its own; that is refused by name (its forward runs under no_grad,
or it saves the stand-in). Give it a parameter whose group an earlier op has used, or use
the parameter through plain torch ops first. A frozen one is fine.

[Note: recomputation]

Activation checkpointing recomputes a region's forward in backward. Three things make
that train as one process would, with no extra all-gather:

- *What the recompute reads.* A region that reads ``loss_fn``'s params (a closure, or its
  inputs) reads the stand-ins. A module called through ``torch.func.functional_call`` has
  its own weights back by then; ``fs.call`` (:mod:`.call`) keeps the stand-ins installed
  until the micro-batch's backward ends. A recompute that reads a module's own
  ``nn.Parameter`` anyway is refused by :class:`RecomputeGuard`, a torch function mode over
  backward, only when the forward checkpointed (:func:`checkpointed`).
- *Seeing it.* In backward the stand-ins are never bound (:meth:`Run.end_forward` unbinds
  the ones still bound after a checkpointing forward), so every recomputed op that touches
  a parameter comes through ``__torch_function__`` (:func:`_recomputed`): the group is made
  resident as backward needs it anyway (FULL_SHARD: its one backward gather; the recompute
  happens when backward reaches the region, where the group is due).
- *Owning what it saves.* The recompute's saved tensors are not seen by the step's hooks
  (the checkpoint's own are on top), so the group could free (resize to 0) storage they
  alias. :meth:`Run.recompute_leaf` hands the recompute the gathered leaf and makes the group
  let go of it (``release_leaf``): the storage then lives exactly as long as the saved
  tensors. Regions over two groups crashed without this (tests/test_ac.py, two blocks).
  A region's input that is a parameter is handed over the same way when unpacked.

Reentrant regions (``use_reentrant=True``) run forward under no_grad (the first use there
enters the group under grad mode) and backward through a nested graph that reaches the
group's Tap and Gather: right when the group lives inside the region (a block), refused by
name (:func:`ended_twice`) when it is also used outside, whose gradients would come after
the group's hand-off. Selective checkpointing's dispatch modes do not see the step's own
gather and binding (:func:`_own_ops`).

A group's first gather in a micro-batch goes through :class:`Gather`, whose backward hands
the group's gradients to the run; each trainable leaf then passes :class:`Tap`, whose
backward puts the leaf's gradient in the group's reduce bucket. See [Note: a group's life]
in :mod:`funshard.step.group`.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
import torch.nn.functional as F
import torch.utils._python_dispatch as _dispatch
import torch.utils.checkpoint as _ckpt

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.__len__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.nelement,
}


def lazy_swap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Swap two tensor objects' contents (C++ tensor, class, attributes); False (nothing
    changed) when either C++ tensor is held elsewhere."""
    # torch's C++ swap does not check this itself (torch.utils.swap_tensors checks it in
    # Python): a C++ tensor that something else holds, or an object with weak references,
    # must not change hands
    if a._use_count() != 1 or b._use_count() != 1 or weakref.getweakrefcount(a) or \
            weakref.getweakrefcount(b):
        return False
    torch._C._swap_tensor_impl(a, b)
    a.__class__, b.__class__ = b.__class__, a.__class__
    a.__dict__, b.__dict__ = b.__dict__, a.__dict__
    return True


def _scan(run_of, values, lazies: list, gis: list) -> None:
    """The stand-ins among ``values`` (one level of lists and tuples deep) and the groups of
    bound leaves among them (an op that touches them must not free them)."""
    for x in values:
        if isinstance(x, LazyParam):
            lazies.append(x)
        elif isinstance(x, (list, tuple)):
            _scan(run_of, x, lazies, gis)
        elif run_of is not None and type(x) is torch.Tensor:
            gi = run_of.bound_group(x)
            if gi is not None:
                gis.append(gi)


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
        return _first_use(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"funshard: {func} reached a lazy parameter below autograd; call it through torch "
            "functions (this is a funshard bug if it came from a plain torch op)"
        )

    def __repr__(self):
        if self._run is None:
            return f"LazyParam({self._gi!r}, of an ended step)"
        return f"LazyParam(shape={tuple(self.shape)}, dtype={self.dtype}, group={self._gi})"


def _eager(fn):
    """``fn`` runs eagerly under torch.compile: a compiled loss_fn breaks its graph here (the
    group's gather and binding), and compiles the compute between."""
    disable = getattr(getattr(torch, "_dynamo", None), "disable", None)
    return disable(fn) if disable is not None else fn


# (Under dynamo.disable a rank once crashed later in the same test worker: compiled code
# kept stand-ins alive past their step, and an op on one gathered on a finished run. A
# stand-in is inert once its step ends (Group.release), which ended that.)
@_eager
def _first_use(func, args: tuple, kwargs: dict):
    """An op touches a stand-in: gather and bind its group, then run the op."""
    lazies: list[LazyParam] = []
    _scan(None, args, lazies, [])
    _scan(None, kwargs.values(), lazies, [])
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
    if run.backward:  # a forward recomputed in backward: see [Note: recomputation]
        return _recomputed(run, func, args, kwargs, lazies)
    grad = False
    if func is not torch.Tensor.detach:
        grad = _refuse_unsupported(run, lazies)
    if func is F.batch_norm:
        _refuse_running_stats(args, kwargs)
    gis = [x._gi for x in lazies]
    path = path_of(lazies[0])  # before binding turns it into a plain tensor
    _scan(run, args, [], gis)  # bound leaves this op also reads
    _scan(run, kwargs.values(), [], gis)
    with _own_ops(grad):
        run.use(gis, new_op=True)  # gathers and binds: the stand-ins are now plain tensors
    if any(isinstance(x, LazyParam) for x in lazies):  # a leaf that could not bind
        args = _substitute(run, args)
        kwargs = dict(zip(kwargs, _substitute(run, kwargs.values())))
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:  # autograd forbids writing into a trainable one
        if "modified inplace" in str(e) or "is being modified inplace" in str(e):
            raise in_place_error(path, func) from e
        raise


def _recomputed(run, func, args: tuple, kwargs: dict, lazies: list):
    """An op of a forward that backward recomputes touches stand-ins: it gets the gathered
    leaves, which the recompute then owns (:meth:`Run.recompute_leaf`)."""
    with _own_ops(False), torch.no_grad():  # the step's own work is not recomputed
        run.use([x._gi for x in lazies], new_op=True)
        args = _substitute(run, args, recompute=True)
        kwargs = dict(zip(kwargs, _substitute(run, kwargs.values(), recompute=True)))
    return func(*args, **kwargs)


@contextlib.contextmanager
def _own_ops(grad: bool):
    """The step's gather and binding, kept out of a selective-checkpointing region's op
    cache (its dispatch modes would record or replay them), with grad on where the op runs
    under no_grad (a group's first gather enters autograd)."""
    with contextlib.ExitStack() as stack:
        if any(type(m).__name__ in _SAC_MODES for m in _dispatch_stack()):
            stack.enter_context(_without_sac())
        if grad:
            stack.enter_context(torch.enable_grad())
        yield


@contextlib.contextmanager
def _without_sac():
    """The dispatch mode stack without selective checkpointing's modes (others, such as a
    collective counter, still see the step's work)."""
    modes = _dispatch_stack()
    low = min(i for i, m in enumerate(modes) if type(m).__name__ in _SAC_MODES)
    popped = [_dispatch._pop_mode() for _ in range(len(modes) - low)]  # top first
    kept = [m for m in reversed(popped) if type(m).__name__ not in _SAC_MODES]
    for m in kept:
        _dispatch._push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _dispatch._pop_mode()
        for m in reversed(popped):
            _dispatch._push_mode(m)


def path_of(x) -> str:
    return x._run.params.layouts[x._run.params.members[x._gi][x._k]].path



# torch's stack of saved-tensor hooks (private; present in every supported torch)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
# torch.utils.checkpoint's pieces the step recognizes (private; feature-detected): the
# non-reentrant region's hooks, the reentrant region's forward, selective checkpointing's
# dispatch modes
_REENTRANT_FORWARD = getattr(getattr(getattr(_ckpt, "CheckpointFunction", None), "forward",
                                     None), "__code__", None)
_SAC_MODES = frozenset({"_CachingTorchDispatchMode", "_CachedTorchDispatchMode"})
_dispatch_stack = getattr(_dispatch, "_get_current_dispatch_mode_stack", list)


def _is_checkpoint_hook(pack) -> bool:
    return getattr(pack, "__qualname__", "").startswith("_checkpoint_hook.")


_FUNCTION_APPLY = torch.autograd.Function.apply.__func__.__code__


def _on_stack(code) -> bool:
    """Whether ``code`` runs in a frame of the calling stack (walked only on a first use of
    a trainable parameter under no_grad)."""
    f = sys._getframe(2)
    while f is not None and code is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _in_reentrant_forward() -> bool:
    """True inside ``torch.utils.checkpoint(..., use_reentrant=True)``'s forward."""
    return _on_stack(_REENTRANT_FORWARD)


def _refuse_unsupported(run, lazies: list[LazyParam]) -> bool:
    """A first use the step cannot follow is refused by name, not trained wrong: under
    saved-tensor hooks other than the step's and activation checkpointing's (they would
    keep gathered storage the step frees), or in a custom autograd Function's forward (it
    received the stand-in itself: the parameter's gradient would bypass the step's
    reduction). Elsewhere under no_grad (the user's own, a reentrant checkpoint region's
    forward) the op just takes no gradient. Returns whether the group must enter autograd
    under grad mode (the op runs under no_grad)."""
    hooks = _top_hooks(False) if _top_hooks is not None else None
    if hooks is not None and getattr(hooks[0], "__self__", None) is not run.saved:
        if _is_checkpoint_hook(hooks[0]):
            run.checkpointing = True
            return False
        what = ("saved-tensor hooks other than the step's and activation checkpointing's "
                "(torch.autograd.graph.saved_tensors_hooks, save_on_cpu)")
    elif not torch.is_grad_enabled():
        # the group enters autograd with grad on all the same (its other leaves may train)
        if not any(x.requires_grad for x in lazies):
            return True
        if _in_reentrant_forward():
            run.checkpointing = True
            return True
        if not _on_stack(_FUNCTION_APPLY):  # the user's own no_grad: this op takes no grad
            return True
        what = "a custom torch.autograd.Function's forward"
    else:
        return False
    raise NotImplementedError(
        f"train_step: parameter {path_of(lazies[0])!r} was first used under {what}, where the "
        "step cannot follow it: a custom autograd Function would take the parameter past the "
        "step's gradient reduction, and other saved-tensor hooks would keep gathered storage "
        "the step frees. Use the parameter through a plain torch op first (a Function then "
        "receives a plain tensor), or p.detach() to use it without its gradient."
    )


def checkpointed(run, loss: torch.Tensor) -> bool:
    """Whether activation checkpointing ran in this forward. A non-reentrant region saved
    its inputs through the step's hooks (``run.saved.checkpointed``) or met a stand-in; a
    reentrant one left its node in the graph (about 0.3 ms to find in a graph of 500
    nodes, once per micro-batch)."""
    if run.checkpointing or run.saved.checkpointed:
        return True
    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "CheckpointFunctionBackward":
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


# the autograd engine's entry (private; in every supported torch): a torch function mode
# sees loss.backward() itself, and is off inside its own handler
_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def backward(run, loss: torch.Tensor) -> None:
    """``loss.backward()``; after checkpointing, under :class:`RecomputeGuard`."""
    if not run.checkpointing or _run_backward is None:
        loss.backward()
        return
    ones = torch.ones_like(loss)
    with RecomputeGuard(run):
        _run_backward((loss,), (ones,), False, False, (), allow_unreachable=True,
                      accumulate_grad=True)


class RecomputeGuard(torch.overrides.TorchFunctionMode):
    """Backward of a micro-batch that checkpointed: a recomputed forward that reads a
    module's own ``nn.Parameter`` (one ``fs.call`` did not leave in place) reads the
    module's weights, not the step's: refused by name."""

    def __init__(self, run):
        super().__init__()
        # the module parameters fs.call left in place (params did not name them)
        self.own = {id(p) for module, _ in run.installed for p in module.parameters()
                    if isinstance(p, torch.nn.Parameter)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.nn.Parameter) and id(x) not in self.own:
                raise NotImplementedError(
                    "train_step: activation checkpointing recomputed a forward that read a "
                    f"module's own parameter (shape {tuple(x.shape)}, {x.dtype}) in "
                    f"{getattr(func, '__name__', func)}, not the step's: "
                    "torch.func.functional_call put the module's weights back when loss_fn "
                    "returned, before backward recomputes, so the recompute would train on "
                    "stale weights. Call the module with fs.call(model, params, *args) (it "
                    "keeps the step's parameters in the module until backward ends), or turn "
                    "checkpointing off (e.g. model.gradient_checkpointing_disable()).")
        return func(*args, **kwargs)


def _substitute(run, values, recompute: bool = False) -> list:
    """``values`` with each unbound stand-in replaced by its group's full tensor (for a
    recompute: :meth:`Run.recompute_leaf`)."""
    out = []
    for x in values:
        if isinstance(x, LazyParam):
            x = (run.recompute_leaf(x._gi, x._k) if recompute
                 else run.groups[x._gi].fulls[x._k])
        elif isinstance(x, (list, tuple)):
            x = type(x)(_substitute(run, x, recompute))
        out.append(x)
    return out


def ended_twice(group) -> NotImplementedError:
    """Backward reached a group it had finished: a reentrant checkpoint region's own backward
    (torch.utils.checkpoint with use_reentrant=True) completed the group's gradients while
    the rest of the graph still used it."""
    return NotImplementedError(
        f"train_step: group {group.name!r} is used inside a "
        "torch.utils.checkpoint(use_reentrant=True) region and outside it (or in another "
        "region): the region's own backward finished the group's gradients before the rest "
        "of backward reached it, so the rest would be lost. Use use_reentrant=False, or groups that keep the region's parameters "
        "apart (fs.Policy(groups=...); fs.list_groups shows them).")


def in_place_error(path: str, func) -> RuntimeError:
    return RuntimeError(
        f"train_step: loss_fn wrote into parameter {path!r} in place "
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
    out = [LazyParam(run, params.group_of[i], params.pos[i], lay.shape, params.dtypes[i],
                     shards[i].device, requires_grad and params.trainable[i])
           for i, lay in enumerate(params.layouts)]
    run.stand_group = {id(x): params.group_of[i] for i, x in enumerate(out)}
    for g in run.groups:
        g.stands = [out[i] for i in g.idx]
        g.lazies = [None] * len(g.idx)
    return out


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
            raise ended_twice(ctx.group)
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
