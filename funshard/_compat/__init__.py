"""The private torch funshard uses, found in this one module and checked at import.

``train_step(compile=True)`` traces the whole step into one program. What that takes from
torch beyond its public API is looked up here, once, when funshard is imported: each name
below is either found or recorded as missing, and :func:`require` raises, naming the torch
version and every missing symbol, when a compiled step is made on a torch without them.
The eager step's own private torch is listed below (:data:`EAGER_MISSING`,
:func:`require_eager`); importing funshard never fails for either. It does without torch's
multi-tensor kernels, or the private attributes of torch objects :mod:`.attrs` reads.

- ``torch.distributed._functional_collectives``: the traceable collectives (an all-gather
  whose autograd is a reduce-scatter, an all-reduce, the wait), what the program issues;
- ``torch.ops._c10d_functional``'s all-gather and wait overloads, which the checkpoint
  policy marks for recomputation in backward;
- ``torch._dynamo.config.trace_autograd_ops``: dynamo traces ``torch.autograd.grad`` into
  the graph (the loss and its gradients one program); ``ignore_logger_methods``: logging
  calls traced as no-ops (they ran at the eager first step); ``error_on_recompile``: a
  second compile of a program refused as ``RecompileError``;
- ``torch._dynamo.exc``'s ``TorchDynamoException`` and ``RecompileError``: what dynamo
  raises when a ``loss_fn`` cannot be traced whole, and when a program would be compiled
  again;
- ``torch.nn.utils.stateless._reparametrize_module``: the tensors of a group put into its
  module for one call (what ``torch.func.functional_call`` does, and dynamo knows);
- ``torch._higher_order_ops.wrap.tag_activation_checkpoint``, the operator dynamo makes of
  a ``torch.utils.checkpoint`` region, and the key under which its body carries the
  region's ``context_fn`` (:data:`CHECKPOINT_CONTEXT`); ``torch._TorchCompileInductorWrapper``
  and ``torch._TorchCompileWrapper``, the backends ``torch.compile`` makes of its
  ``backend``, ``mode`` and ``options``: the compiled step's backend passes dynamo's graph
  on to them after giving the model's own checkpoint regions a rule
  (:mod:`funshard.step.backend`).
- ``torch._inductor.config``'s ``post_grad_custom_post_pass`` and
  ``reorder_for_peak_memory``, and ``torch._inductor.custom_graph_pass.CustomGraphPass``:
  the pass that orders the program's collectives to overlap its compute, run by inductor
  over its post-grad graph, with inductor's own reordering for peak memory off
  (:mod:`funshard.step.overlap`); ``torch.ops._c10d_functional.all_gather_into_tensor_out``
  (optional: :data:`GATHER_OUT` is None without it), the all-gather into a given buffer the
  pass turns each gather into, to gather in place.

Newer torch names the autograd all-gather ``all_gather_single_autograd``; older releases
``all_gather_tensor_autograd``: the first found is used.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .attrs import (dtensor_spec, local_tensor, own_buffers, own_modules,  # noqa: F401
                    own_parameters, storage_id, tensor_hooks, version, view_base)

MISSING: list[str] = []


def _find(path: str, *names: str):
    """The first of ``names`` found on the object at ``path`` (dotted), or None (recorded)."""
    obj = torch
    try:
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        for name in names:
            if hasattr(obj, name):
                return getattr(obj, name)
    except (AttributeError, ImportError):
        pass
    MISSING.append(f"{path}.{'|'.join(names)}")
    return None


def _import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        MISSING.append(name)
        return None


@contextlib.contextmanager
def _recorded_in(into: list[str]):
    """Within: the names :func:`_find` and :func:`_import` do not find are recorded in
    ``into`` (what one feature lacks), not in :data:`MISSING`."""
    before = len(MISSING)
    try:
        yield into
    finally:
        into.extend(MISSING[before:])
        del MISSING[before:]


_fc = _import("torch.distributed._functional_collectives")
_import("torch._dynamo")
_import("torch.nn.utils.stateless")
all_gather = _find("torch.distributed._functional_collectives", "all_gather_single_autograd",
                   "all_gather_tensor_autograd")
all_reduce = _find("torch.distributed._functional_collectives", "all_reduce")
wait_tensor = _find("torch.distributed._functional_collectives", "wait_tensor")
reparametrize = _find("torch.nn.utils.stateless", "_reparametrize_module")
DynamoError = _find("torch._dynamo.exc", "TorchDynamoException")
RecompileError = _find("torch._dynamo.exc", "RecompileError")
_import("torch._higher_order_ops.wrap")
CHECKPOINT_OP = _find("torch._higher_order_ops.wrap", "tag_activation_checkpoint")
CHECKPOINT_CONTEXT = "_checkpoint_context_fn"  # what tag_activation_checkpoint reads
INDUCTOR_BACKEND = _find("torch", "_TorchCompileInductorWrapper")
OTHER_BACKEND = _find("torch", "_TorchCompileWrapper")
_import("torch._inductor.custom_graph_pass")
CustomGraphPass = _find("torch._inductor.custom_graph_pass", "CustomGraphPass")
_inductor_config = _find("torch._inductor", "config")
for _name in ("post_grad_custom_post_pass", "reorder_for_peak_memory"):
    if _inductor_config is not None and not hasattr(_inductor_config, _name):
        MISSING.append(f"torch._inductor.config.{_name}")
_dynamo_config = _find("torch._dynamo", "config")
if _dynamo_config is not None and not hasattr(_dynamo_config, "trace_autograd_ops"):
    MISSING.append("torch._dynamo.config.trace_autograd_ops")
for _name in ("ignore_logger_methods", "error_on_recompile"):
    if _dynamo_config is not None and not hasattr(_dynamo_config, _name):
        MISSING.append(f"torch._dynamo.config.{_name}")
_ops = getattr(torch.ops, "_c10d_functional", None)
try:  # what the overlap pass moves (funshard.step.overlap): the gather, the reductions, the wait
    C10D_OPS = {name: getattr(_ops, name).default for name in (
        "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor")}
except (AttributeError, RuntimeError):
    C10D_OPS = {}
    MISSING.append("torch.ops._c10d_functional.{all_gather_into_tensor,reduce_scatter_tensor,"
                   "all_reduce,wait_tensor}")
GATHER_OPS = tuple(C10D_OPS[k] for k in ("all_gather_into_tensor", "wait_tensor") if C10D_OPS)
# aten's dtype copy (``Tensor.to``): a cast the compiled step's recompute rule recomputes
TO_COPY = getattr(getattr(torch.ops.aten, "_to_copy", None), "default", None)
if TO_COPY is None:
    MISSING.append("torch.ops.aten._to_copy")
# an all-gather into a given buffer (inductor's own bucketing emits it): where torch lacks it,
# the compiled step's gathers keep their separate input (funshard.step.overlap)
GATHER_OUT = getattr(getattr(_ops, "all_gather_into_tensor_out", None), "default", None)


# DTensor.redistribute(forward_dtype=, backward_dtype=) (public, newer torch): a gather in
# the compute dtype whose gradient is reduced in another; without it the compiled step
# gathers in the reduce dtype and casts after
try:
    import inspect as _inspect

    from torch.distributed.tensor import DTensor as _DTensor

    REDISTRIBUTE_DTYPES = "backward_dtype" in _inspect.signature(
        _DTensor.redistribute).parameters
except (ImportError, TypeError, ValueError):
    REDISTRIBUTE_DTYPES = False

# torch.compile(options={"guard_filter_fn": ...}) (public, with the torch.compiler helpers
# that use it): which of dynamo's guards a compiled function keeps; without it, all
GUARD_FILTER = hasattr(torch.compiler, "skip_guard_on_globals_unsafe")


def _lacking(what: str, missing: list[str], use: str) -> str:
    """What every refusal below says: who needs which names, this torch's version, and
    what to use instead."""
    return (f"{what} needs torch internals this torch {torch.__version__} lacks: "
            f"{', '.join(missing)}. Use {use} (2.11 or newer).")


def require(what: str) -> None:
    """Raise, naming the torch version and the missing symbols, if any is missing."""
    if MISSING:
        raise RuntimeError(_lacking(what, MISSING, "the eager step (compile=False), or a "
                                    "torch with them"))


# [Note: a context made once] dynamo's ``config.patch`` defines a class per call, a
# reference cycle: made per step, it left garbage that only Python's cyclic collector frees,
# and those collections, each step's survivors promoted, led to a full collection over every
# object torch.compile had made (540,000 on the host-bound GPT: 0.47 s, about every 1,000
# steps; measured 2026-11-26). A patch object can be entered again and again, so the step's
# two are made here, once.
def _patch(name: str):
    """dynamo's config with ``name`` set to True, as a reusable context (None: absent)."""
    return (_dynamo_config.patch(name, True)
            if _dynamo_config is not None and hasattr(_dynamo_config, name) else None)


_TRACING_AUTOGRAD = _patch("trace_autograd_ops")
_REFUSING_RECOMPILES = _patch("error_on_recompile")


def tracing_autograd():
    """A context in which dynamo traces ``torch.autograd.grad`` into the graph."""
    return _TRACING_AUTOGRAD


def refusing_recompiles():
    """A context in which dynamo raises ``RecompileError`` instead of compiling a function
    again (``torch.compiler.set_stance("fail_on_recompile")`` raises a plain RuntimeError)."""
    return _REFUSING_RECOMPILES


# torch 2.11 sorts every set in dynamo's config when it records a compile's metrics, and
# functions do not sort: it logs the TypeError, a traceback per compile, on this logger
# (which logs nothing else); torch 2.13 leaves this set out of the record
_METRICS_LOG = "torch._dynamo.metrics_context"


@contextlib.contextmanager
def tracing_without_logs(methods: set):
    """A context in which dynamo traces the ``logging.Logger`` ``methods`` as no-ops."""
    quiet = logging.getLogger(_METRICS_LOG)
    before = quiet.disabled
    with _dynamo_config.patch(
            ignore_logger_methods=set(_dynamo_config.ignore_logger_methods) | methods):
        quiet.disabled = True
        try:
            yield
        finally:
            quiet.disabled = before


def inductor_patch(options: dict):
    """A context in which inductor's config has ``options`` (what the compiled step's
    backend puts under the caller's own: :mod:`funshard.step.overlap`); made at compile
    time only."""
    return _inductor_config.patch(options)


# -- the eager step's private torch -----------------------------------------------------
#
# What the eager step takes from torch beyond its public API, found here once, each name
# either found or recorded in EAGER_MISSING (train_step refuses to build an eager step on a
# torch without them, naming the version and the names: :func:`require_eager`):
#
# - ``torch.Tensor._use_count`` and ``torch._C._storage_Use_Count``: a gathered tensor, or
#   its storage, another holder has keeps its storage when its group is freed ([Note:
#   rank-independent freeing] in funshard.step.group);
#   ``torch.Tensor._make_wrapper_subclass``, the stand-in ([Note: stand-ins] in
#   funshard.step.lazy);
#   ``torch._C.DisableTorchFunctionSubclass``: its metadata read without its own hook;
# - ``torch._C._current_autograd_node``: which backward node unpacks a saved tensor;
# - ``torch._C._autograd``'s saved-tensor default-hook stack (top, push, pop): the step's
#   hooks put over the caller's ([Note: hooks beneath the step's] in funshard.step.saved);
# - ``torch.autograd.graph._engine_run_backward``: backward under a torch function mode
#   that sees a recompute (funshard.step.recompute.RecomputeGuard);
# - ``torch.utils._python_dispatch``'s mode stack (get, pop, push): the step's own ops kept
#   out of selective checkpointing's cache;
# - ``torch._dynamo.eval_frame.skip_code``: the saved-tensor hooks never compiled;
# - and for shard / unshard: ``torch._C._functorch``'s wrapped-tensor check and transform
#   stack (a shard under torch.func).
EAGER_MISSING: list[str] = []


with _recorded_in(EAGER_MISSING):
    _import("torch.utils._python_dispatch")
    _import("torch._dynamo.eval_frame")
    tensor_refs = _find("torch.Tensor", "_use_count")  # (a tensor object's references)
    _storage_use_count = _find("torch._C", "_storage_Use_Count")
    make_wrapper_subclass = _find("torch.Tensor", "_make_wrapper_subclass")
    DisableTorchFunctionSubclass = _find("torch._C", "DisableTorchFunctionSubclass")
    current_autograd_node = _find("torch._C", "_current_autograd_node")
    top_saved_hooks = _find("torch._C._autograd", "_top_saved_tensors_default_hooks")
    push_saved_hooks = _find("torch._C._autograd", "_push_saved_tensors_default_hooks")
    pop_saved_hooks = _find("torch._C._autograd", "_pop_saved_tensors_default_hooks")
    engine_run_backward = _find("torch.autograd.graph", "_engine_run_backward")
    dispatch_mode_stack = _find("torch.utils._python_dispatch",
                                "_get_current_dispatch_mode_stack")
    pop_mode = _find("torch.utils._python_dispatch", "_pop_mode")
    push_mode = _find("torch.utils._python_dispatch", "_push_mode")
    skip_code = _find("torch._dynamo.eval_frame", "skip_code")
    functorch_wrapped = _find("torch._C._functorch", "is_functorch_wrapped_tensor")
    peek_interpreter_stack = _find("torch._C._functorch", "peek_interpreter_stack")
if reparametrize is None:
    EAGER_MISSING.append("torch.nn.utils.stateless._reparametrize_module")


def storage_refs(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors on it, and storage objects): what holds its
    bytes."""
    st = t.untyped_storage()
    return _storage_use_count(storage_id(st)) - 1  # not ``st``, made for the call


def require_eager(what: str) -> None:
    """Raise, naming the torch version and the missing symbols, if any the eager step needs
    is missing."""
    if EAGER_MISSING:
        raise RuntimeError(_lacking(what, EAGER_MISSING, "a torch the step supports"))


# -- meshes past data parallelism -------------------------------------------------------
#
# ``torch.distributed.tensor.placement_types._StridedShard``: the placement of a leaf that
# the model shards on a dimension (tensor parallel, ``Shard(0)`` on ``"tp"``) and funshard
# shards again on the same tensor dimension over ``"shard"``: the tensor-parallel split
# first, then funshard's (what FSDP2 and DTensor's own redistribution use for it). Without
# it funshard refuses such a leaf (:func:`require_strided`).
with _recorded_in([]) as MODEL_MISSING:
    _import("torch.distributed.tensor.placement_types")
    StridedShard = _find("torch.distributed.tensor.placement_types", "_StridedShard")


def require_strided(what: str) -> None:
    """Raise, naming the torch version, if ``_StridedShard`` is missing."""
    if MODEL_MISSING:
        raise RuntimeError(_lacking(what, MODEL_MISSING, "a torch funshard supports"))


# -- a process group's timeout ------------------------------------------------------------
#
# ``ProcessGroup._get_backend(device).options._timeout``: how long a collective on a group
# may wait (what ``make_mesh(timeout=)`` gave ``init_process_group``). torch raises the same
# ``RuntimeError`` for a collective that timed out and for a peer that left, so funshard tells
# them apart by how long the collective had been waiting
# (:func:`funshard.collectives.failures.timed_out`), and sizes the cross-memory transport's
# waits by it. Optional: None where this torch does not expose it (a failure is then said
# to be a lost peer, whatever its wait).


def pg_timeout(pg) -> float | None:
    """Seconds a collective on ``pg`` may wait, or None."""
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


# -- the c10d state a failure report reads --------------------------------------------------
#
# ``torch.distributed.distributed_c10d._get_default_store``: the store a failed rank posts
# its error to, which its peers read (funshard.collectives.failures); and, per process group
# (``_world.pg_names``) and per backend (``ProcessGroup._device_types``, ``_get_backend``),
# ``_get_sequence_number_for_group``: how many collectives this rank has issued there, the
# position a failure report compares across ranks. Optional: without them a failure is
# reported by the backend's words alone (``REPORT_MISSING`` names what is absent).
with _recorded_in([]) as REPORT_MISSING:
    _get_default_store = _find("torch.distributed.distributed_c10d", "_get_default_store")
    _c10d_world = _find("torch.distributed.distributed_c10d", "_world")


def default_store():
    """The default process group's store, or None (none yet, or this torch lacks it)."""
    try:
        return _get_default_store() if _get_default_store is not None else None
    except (RuntimeError, ValueError, AttributeError):
        return None


def group_positions() -> dict[str, int]:
    """``{"pg NAME[ DEVICE]": collectives issued}`` for every process group this rank is in:
    each backend of ``"cpu:gloo,cuda:nccl"`` counts its own; {} where torch lacks them."""
    out: dict[str, int] = {}
    for pg, name in list(getattr(_c10d_world, "pg_names", {}).items()):
        with contextlib.suppress(Exception):
            devices = getattr(pg, "_device_types", ())
            per = ({pg._get_backend(d): f" {d.type}" for d in devices} if len(devices) > 1
                   else {pg: ""})
            for b, dev in per.items():
                out[f"pg {name}{dev}"] = int(b._get_sequence_number_for_group())
    return out


# -- torch's multi-tensor kernels -----------------------------------------------------------
#
# ``torch._foreach_*`` and ``torch._fused_adamw_`` (torch.optim's foreach and fused paths):
# funshard's optimizers, clip and reductions run them; importing funshard fails without.
with _recorded_in([]) as _kernels_missing:
    foreach_add = _find("torch", "_foreach_add")
    foreach_add_ = _find("torch", "_foreach_add_")
    foreach_addcdiv_ = _find("torch", "_foreach_addcdiv_")
    foreach_addcmul_ = _find("torch", "_foreach_addcmul_")
    foreach_copy_ = _find("torch", "_foreach_copy_")
    foreach_div_ = _find("torch", "_foreach_div_")
    foreach_lerp_ = _find("torch", "_foreach_lerp_")
    foreach_mul = _find("torch", "_foreach_mul")
    foreach_mul_ = _find("torch", "_foreach_mul_")
    foreach_norm = _find("torch", "_foreach_norm")
    foreach_sqrt = _find("torch", "_foreach_sqrt")
    fused_adamw_ = _find("torch", "_fused_adamw_")
if _kernels_missing:
    raise ImportError(f"funshard needs torch's multi-tensor kernels, which this torch "
                      f"{torch.__version__} lacks: {', '.join(_kernels_missing)}. Use a "
                      "torch funshard supports (2.11 or newer).")

# -- the testing helpers' -------------------------------------------------------------------
#
# ``torch.utils._python_dispatch.TorchDispatchMode``: fs.testing's counters and memory meter
# are such modes. fs.testing fails at its import without it.
with _recorded_in([]) as TESTING_MISSING:
    _import("torch.utils._python_dispatch")
    TorchDispatchMode = _find("torch.utils._python_dispatch", "TorchDispatchMode")


def require_testing(what: str) -> None:
    """Raise, naming the torch version, if what fs.testing needs is missing."""
    if TESTING_MISSING:
        raise ImportError(_lacking(what, TESTING_MISSING, "a torch funshard supports"))
