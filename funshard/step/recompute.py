"""Activation checkpointing inside ``loss_fn``: what the step recognizes of
``torch.utils.checkpoint``, and what keeps a recompute correct.

[Note: recomputation]

Activation checkpointing recomputes a region's forward in backward. Three things make
that train as one process would, with no extra all-gather:

- *What the recompute reads.* A region that reads ``loss_fn``'s params (a closure, or its
  inputs) reads the stand-ins. A module called through ``torch.func.functional_call`` has
  its own weights back by then; ``fs.call`` (:mod:`.call`) keeps the stand-ins installed
  until the micro-batch's backward ends. A recompute that reads a module's own
  ``nn.Parameter`` anyway is refused by :class:`RecomputeGuard`, a torch function mode over
  backward wherever a module may have had the step's tensors for its forward only.
- *Seeing it.* Outside a group module's call the parameters are stand-ins, so every
  recomputed op that touches one comes through ``__torch_function__``
  (``lazy._recomputed``), and a group module recomputed through its call installs the
  leaves the recompute owns (``call.recomputed``): the group is made
  resident as backward needs it anyway (FULL_SHARD: its one backward gather; the recompute
  happens when backward reaches the region, where the group is due).
- *Owning what it saves.* The recompute's saved tensors are not seen by the step's hooks
  (the checkpoint's own are on top), so the group could free (resize to 0) storage they
  alias. :meth:`Run.recompute_leaf` hands the recompute the gathered leaf and makes the group
  let go of it (``release_leaf``): the storage then lives exactly as long as the saved
  tensors. Regions over two groups crashed without this (tests/test_ac.py, two blocks).
  A region's input that is a parameter comes back through the step's hooks, which cannot
  tell a recompute's unpack from any other node's: so a group being freed keeps any
  storage something holds beyond the group and autograd's pending saved copies, counted on
  the storage itself (``Group._held``); what holds it frees it. (Keeping every leaf backward
  had unpacked instead kept a model called twice fully gathered through its backward:
  4.86 against 3.88 MB live peak, measured.) And a leaf freed when forward ends
  (``kept_late``) is owed to the group whether or not autograd saved it
  (``Group.free_leaves``): a recompute reads it all the same.

Reentrant regions (``use_reentrant=True``) run forward under no_grad (the first use there
enters the group under grad mode) and backward through a nested graph that reaches the
group's Tap and Gather: right when the group lives inside the region (a block), refused by
name (:func:`ended_twice`) when it is also used outside, whose gradients would come after
the group's hand-off. Selective checkpointing's dispatch modes do not see the step's own
gather (:func:`own_ops`).
"""

from __future__ import annotations

import contextlib

import torch

from .. import _compat

# selective checkpointing's dispatch modes (private classes, recognized by name; the mode
# stack through funshard._compat)
_SAC_MODES = frozenset({"_CachingTorchDispatchMode", "_CachedTorchDispatchMode"})
_dispatch_stack = _compat.dispatch_mode_stack or list


def is_checkpoint_hook(pack) -> bool:
    return getattr(pack, "__qualname__", "").startswith("_checkpoint_hook.")


def own_ops(grad: bool):
    """The step's gather and frees, kept out of a selective-checkpointing region's op
    cache (its dispatch modes would record or replay them), with grad on where the op runs
    under no_grad (a group's first gather enters autograd). Nothing to do (no dispatch
    mode, grad already on) is the usual case: a shared empty context then."""
    if not grad and not _dispatch_stack():
        return _NOTHING
    return _own_ops(grad)


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _own_ops(grad: bool):
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
    popped = [_compat.pop_mode() for _ in range(len(modes) - low)]  # top first
    kept = [m for m in reversed(popped) if type(m).__name__ not in _SAC_MODES]
    for m in kept:
        _compat.push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _compat.pop_mode()
        for m in reversed(popped):
            _compat.push_mode(m)


# the autograd engine's entry (private; in every supported torch): a torch function mode
# sees loss.backward() itself, and is off inside its own handler
_run_backward = _compat.engine_run_backward


def in_region() -> bool:
    """Whether an op runs in a checkpoint region's forward, as far as torch lets it be seen:
    a non-reentrant region's saved-tensor hooks on top, or grad mode off (a reentrant
    region's forward; also any no_grad code, which costs only the guard)."""
    if not torch.is_grad_enabled():
        return True
    top = _compat.top_saved_hooks(False) if _compat.top_saved_hooks is not None else None
    return top is not None and is_checkpoint_hook(top[0])


def backward(run, loss: torch.Tensor) -> None:
    """``loss.backward()``, under :class:`RecomputeGuard` where a recompute could read what
    the step did not give it: on the direct path, where a checkpoint region met a stand-in
    outside ``fs.call`` (a module ``torch.func.functional_call`` gave the step's tensors for
    its forward only: :func:`in_region`), and where a module was installed twice. Not
    elsewhere: the step's own hooks make a few hundred Python-level torch calls in backward,
    which the guard would see (20% of the host-bound GPT's step, measured), and through
    ``fs.call`` a recompute reads the step's tensors."""
    if not run.guarded() or _run_backward is None:
        loss.backward()
        return
    ones = torch.ones_like(loss)
    with RecomputeGuard(run):
        _run_backward((loss,), (ones,), False, False, (), allow_unreachable=True,
                      accumulate_grad=True)


class RecomputeGuard(torch.overrides.TorchFunctionMode):
    """Backward: a recomputed forward that reads a module's own ``nn.Parameter`` (one
    ``fs.call`` did not leave in place) reads the module's weights, not the step's, and one
    that reads a tensor of a module ``fs.call`` installed twice with other tensors may run on
    the last installation's: both refused by name. It sees only the Python-level torch calls
    made in backward (a recompute's, and the step's own: see :func:`backward`)."""

    def __init__(self, run):
        super().__init__()
        self.run, self._own = run, None
        self.reinstalled = run.installations().twice_ids()

    @property
    def own(self) -> set[int]:
        """The module parameters fs.call left in place (params did not name them)."""
        if self._own is None:
            self._own = self.run.installations().left_in_place()
        return self._own

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in (*args, *kwargs.values()):
            if self.reinstalled and id(x) in self.reinstalled:
                raise reinstalled(self.run.installations().twice())
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


def check_reinstalled(run) -> None:
    """A recompute (in backward) of a forward in which ``fs.call`` installed a module twice
    with other tensors: refused (it would run every call on the last one's tensors)."""
    if (twice := run.installations().twice()):
        raise reinstalled(twice)


def reinstalled(name: str) -> NotImplementedError:
    """A module ``fs.call`` installed twice with other tensors, and checkpointing."""
    return NotImplementedError(
        f"train_step: loss_fn called a {name} through fs.call twice with different tensors "
        "and checkpointed: backward's recompute would run every call on the last one's. "
        "Call it once per step with the step's params, or turn checkpointing off.")


def backward_in_forward(what: str) -> RuntimeError:
    """``loss_fn`` ran a backward of its own (``loss.backward()``, ``torch.autograd.backward``):
    the step's backward would count the gradients again."""
    return RuntimeError(
        f"train_step: {what} received gradients while loss_fn was running: loss_fn ran a "
        "backward of its own (loss.backward() or torch.autograd.backward), and the step's "
        "backward would count them twice. Return the loss and let the step differentiate it; "
        "for a gradient inside loss_fn (a penalty) use torch.autograd.grad(..., "
        "create_graph=True), which leaves the parameters' gradients alone.")


def ended_twice(group) -> NotImplementedError:
    """Backward reached a group it had finished: a reentrant checkpoint region's own backward
    (torch.utils.checkpoint with use_reentrant=True) completed the group's gradients while
    the rest of the graph still used it."""
    return NotImplementedError(
        f"train_step: group {group.name!r} is used inside a "
        "torch.utils.checkpoint(use_reentrant=True) region and outside it (or in another "
        "region): the region's own backward finished the group's gradients before the rest "
        "of backward reached it, so the rest would be lost. Use use_reentrant=False, or "
        "groups that keep the region's parameters apart (fs.Policy(groups=...); "
        "fs.list_groups shows them).")
