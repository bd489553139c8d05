"""The compiled step's program: every group's all-gather, ``loss_fn``, backward and every
group's reduction, one function that ``torch.compile`` traces whole.

[Note: the step as one program] A :class:`Program` is a function of (this rank's shards,
the buffers, the batch) returning (loss, the ``fs.Mean`` count, aux, the reduced gradient
shards). Traced with ``fullgraph=True`` and ``torch.autograd.grad`` in the graph, it is one
inductor program per step: no host work per op, no graph break. How the pieces map:

- **A group's gather** is one functional all-gather of the group's local shards packed in
  one flat buffer (each leaf's ``torch.chunk`` rows padded to the same count on every rank,
  cast to the compute dtype first), then each leaf cut out of the result; the packing and
  the cutting are opaque operators (:mod:`funshard.step.packing` says why). Its autograd is
  one reduce-scatter of the group's flat gradient: FULL_SHARD's collectives by
  construction, one per group and direction, without a bucketing pass. (Measured against a
  DTensor gather per leaf, which needs a compiler pass to bucket, in
  ``benchmarks/results/*compiled-candidates*``: this form was faster and kept the memory
  bound.)
- **Where it is gathered.** At the boundary of the group's module, as ``fs.call`` enters
  it: the step puts a forward in front of each group module for the duration of the call
  (the host does this around the program, so nothing stays on the module), which gathers
  the group and runs the module's own forward with the gathered tensors installed. Under
  FULL_SHARD that forward is a ``torch.utils.checkpoint`` region whose policy marks the
  gather, its packing and every view of it ``MUST_RECOMPUTE`` and the module's compute
  ``MUST_SAVE``: the compiler gathers the group again in backward, where the gradient needs
  it, and keeps nothing gathered from forward to backward (AOTAutograd's remat pass for a
  forward-loss-backward graph; SimpleFSDP marks its gathers the same way). SHARD_GRAD_OP has
  no region: the gathered tensors stay for backward (one all-gather per group).
  ``Policy(checkpoint=)`` turns the region's compute to ``PREFER_RECOMPUTE``.
- **Parameters outside every group module** (the embedding, the final norm, the head, a
  group whose name is not a module ``fs.call`` enters, a group tied to a parameter outside
  its module) are gathered at the program's start,
  in the tree ``loss_fn`` receives, and stay gathered through backward, as FSDP2 keeps its
  root module's. A group module's leaves are in that tree as their shards, DTensors (no
  collective): ``fs.call`` installs them and the module's forward replaces them with the
  gathered tensors. Read anywhere else (by ``loss_fn`` itself, by a submodule called
  without its group module), they compute as DTensors: the global values, or an error
  where they meet plain tensors, never a shard taken for the whole. (A gather there
  instead, left unused, is not removed: inductor keeps a collective whose result is
  waited on.)
- **Micro-batches.** ``Policy(accumulate=k)`` runs the program once per micro-batch and
  sums the reduced gradients (the loss divided by ``k`` as the eager step divides it): the
  remat pass that gathers again in backward takes one backward region per graph, so ``k``
  forward-backward pairs do not fit one program. Random draws (ops tagged
  ``nondeterministic_seeded``) in a recomputed region are kept from forward: the pass
  refuses to draw them again, and drawing again would not give the forward's numbers (the
  model's own regions get the same rule: :mod:`funshard.step.backend`).
- **Mixed precision.** A bucket whose gradient is reduced in another dtype than it is
  gathered in (``param_dtype`` bfloat16, ``reduce_dtype`` float32) is gathered by
  ``DTensor.redistribute(forward_dtype=, backward_dtype=)`` from ``Shard(0)`` to
  ``Replicate()``, its gradient taken as ``Partial()``: the cast before the all-gather, the
  gradient's cast back before the reduce-scatter, as SimpleFSDP gathers. (A plain gather
  of the cast shards reduces in the gather's dtype: autograd casts a gradient to its
  input's dtype before it reaches the all-gather's backward.)
- **The reductions.** The reduce-scatter comes from autograd, summed over ranks; the
  pack's backward finishes each group's, on its output: on a 2-D mesh one all-reduce over
  ``"replicate"``, then the mean (divided by the data-parallel world), as the eager step
  does per group. Replicated leaves (scalars) are all-reduced over every data-parallel rank
  at the end, one all-reduce per dtype and mesh dim.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from .. import _compat, collectives, pytree
from ..mesh import REPLICATE, SHARD
from . import loss as loss_
from . import packing
from .params import ParamGroups

# what the region recomputes besides the gather's own ops and the packing's: casts (a world
# of one's gather is its cast; a cast after the gather)
_COPIES = (_compat.TO_COPY,)


def _policy(gather: CheckpointPolicy, compute: CheckpointPolicy, ctx, op, *args,
            **kwargs) -> CheckpointPolicy:
    """A group region's rule: ``gather`` for its gather's ops (and the views of it),
    ``compute`` for the rest."""
    if op in _compat.GATHER_OPS or op in packing.OPS or op in _COPIES or op.is_view:
        return gather
    if torch.Tag.nondeterministic_seeded in op.tags:  # random draws are kept, not redrawn
        return CheckpointPolicy.MUST_SAVE
    return compute


def context_fn(regather: bool, recompute: bool):
    """The selective-checkpoint contexts of a group region: ``regather`` the group in
    backward (FULL_SHARD), ``recompute`` its compute (``Policy(checkpoint=)``)."""
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
    rule = functools.partial(_policy, again if regather else save,
                             CheckpointPolicy.PREFER_RECOMPUTE if recompute else save)
    return functools.partial(create_selective_checkpoint_contexts, rule)


class Bucket(NamedTuple):
    """Leaves of one group gathered together: sharded, of one gather dtype."""

    idx: tuple[int, ...]  # tree positions
    dtype: torch.dtype  # what moves
    cast: torch.dtype  # what the leaves compute in (after the gather)
    grad: torch.dtype  # what their gradient is reduced in
    master: torch.dtype  # the shards' own
    # what packing and unpacking take, plain ints read once here: the program reads no
    # Layout property while traced (dynamo on torch 2.11 guards a cached_property's first
    # read as missing, then fails its own guard)
    world: int
    numels: tuple[int, ...]  # each leaf's padded chunk
    dims: tuple[int, ...]  # the padded full shapes, flat
    ndims: tuple[int, ...]
    rows: tuple[int, ...]


def buckets_of(params: ParamGroups, policy, gi: int) -> list[Bucket]:
    """Group ``gi``'s sharded leaves by the dtypes they are gathered and reduced in: they
    move in the compute dtype and their gradients in ``reduce_dtype`` (or the compute
    dtype); a torch without ``DTensor.redistribute``'s ``backward_dtype`` moves them in the
    reduce dtype (the parameters' own) and casts after the gather."""
    out: dict[tuple, list[int]] = {}
    for i in params.members[gi]:
        lay, dt = params.layouts[i], params.dtypes[i]
        if not lay.sharded:
            continue
        rd = policy.reduce_dtype if dt.is_floating_point and policy.reduce_dtype else dt
        move = dt
        if rd != dt and not _compat.REDISTRIBUTE_DTYPES:
            if rd != lay.dtype:
                raise NotImplementedError(
                    f"train_step(compile=True): reduce_dtype={rd} is neither the compute "
                    f"dtype ({dt}) nor the dtype ({lay.dtype}) of {lay.path!r}, and torch "
                    f"{torch.__version__}'s DTensor.redistribute has no backward_dtype. Use "
                    "compile=False for this policy.")
            move = rd
        out.setdefault((move, dt, rd, lay.dtype), []).append(i)
    buckets = []
    for key, idx in out.items():
        lays = [params.layouts[i] for i in idx]
        buckets.append(Bucket(
            tuple(idx), *key, lays[0].world, tuple(x.padded_numel for x in lays),
            tuple(d for x in lays for d in x.padded_shape),
            tuple(len(x.padded_shape) for x in lays), tuple(x.rows for x in lays)))
    return buckets


class Program:
    """The step's function of (shards, buffers, batch), traced once per batch signature.

    ``blocks``: group index -> (module, its forward) for the groups gathered at a module's
    boundary; ``leaves`` is set while the program runs (the group forwards read it)."""

    def __init__(self, loss_fn, params: ParamGroups, policy, blocks: dict, like: list,
                 train: bool = True):
        self.loss_fn, self.params, self.policy, self.blocks = loss_fn, params, policy, blocks
        self.train = train  # False: an eval_step's fn, under no_grad
        # (mesh, placements) of each leaf: a group module's leaves reach loss_fn as DTensors
        self.like = [(d.device_mesh, d.placements) for d in like]
        self.buckets = [buckets_of(params, policy, gi) for gi in range(len(params.members))]
        mesh = params.mesh
        names = mesh.mesh_dim_names
        self.shard_group = mesh.get_group(names.index(SHARD)).group_name
        self.replicate_group = (mesh.get_group(names.index(REPLICATE)).group_name
                                if REPLICATE in names else None)
        self.shard_mesh = mesh[SHARD] if mesh.ndim > 1 else mesh
        self.world = mesh.size()
        self.alone = collectives.skips(self.world)  # a world of one: no collective at all
        # pack's (divide, rank, across): its backward finishes each group's reduction (the
        # replicate all-reduce, the mean); this rank's place in its shard group's gathers
        self.place = (self.world, mesh.get_local_rank(names.index(SHARD)),
                      self.replicate_group)
        self.trainable = [i for i, t in enumerate(params.trainable) if t]
        check, again = policy.checkpoint, policy.reshard_after_forward
        chosen = {gi: check is True or (callable(check) and bool(check(params.names[gi])))
                  for gi in blocks}
        self.regions = {gi: context_fn(again, c) for gi, c in chosen.items()
                        if train and (again or c)}
        self.leaves: list | None = None
        # the tree's structure as plain containers of leaf positions: dynamo traces their
        # construction, not optree's (a spec made outside the trace is opaque to it)
        self.template = pytree.plain_map(
            _position, pytree.unflatten(params.spec, range(len(params.layouts))))

    def gather(self, gi: int, local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Group ``gi``'s full tensors from its local shards (``local``: position -> shard)."""
        lays = self.params.layouts
        full = {i: local[i] for i in local if not lays[i].sharded}  # replicated: as they are
        for b in self.buckets[gi]:
            if self.alone:  # the shard is the whole: the cast is the gather
                full.update((i, local[i].to(b.cast)) for i in b.idx)
                continue
            numels = list(b.numels)
            if b.grad == b.dtype:  # gathered and reduced in one dtype
                flat = packing.pack([local[i] for i in b.idx], numels, b.dtype, *self.place)
                if flat.is_complex():  # as its real pairs (no backend has a complex type)
                    got = torch.view_as_complex(_compat.all_gather(
                        torch.view_as_real(flat), 0, self.shard_group))
                else:
                    got = _compat.all_gather(flat, 0, self.shard_group)
            else:  # cast on the way, its gradient cast back before the reduce-scatter
                flat = packing.pack([local[i] for i in b.idx], numels, b.master, *self.place)
                got = DTensor.from_local(flat, self.shard_mesh, [Shard(0)], run_check=False
                                         ).redistribute(
                    self.shard_mesh, [Replicate()], forward_dtype=b.dtype,
                    backward_dtype=b.grad).to_local(grad_placements=[Partial()])
            full.update(zip(b.idx, packing.unpack(
                got, b.world, numels, list(b.dims), list(b.ndims), list(b.rows), b.cast)))
        return full

    def block(self, gi: int, *args, **kwargs):
        """Group ``gi``'s module forward, its group gathered at the boundary."""
        module, forward = self.blocks[gi]
        local = {i: self.leaves[i] for i in self.params.members[gi]}
        run = functools.partial(self._gathered_forward, gi, module, forward)
        if gi in self.regions:
            return checkpoint(run, local, *args, use_reentrant=False,
                              context_fn=self.regions[gi], **kwargs)
        return run(local, *args, **kwargs)

    def _gathered_forward(self, gi: int, module, forward, local: dict, *args, **kwargs):
        full = self.gather(gi, local)
        prefix = len(self.params.names[gi]) + 1
        lays = self.params.layouts
        with _compat.reparametrize(module, {lays[i].path[prefix:]: t for i, t in full.items()},
                                   tie_weights=True):
            return forward(*args, **kwargs)

    def __call__(self, shards: list, bufs: Any, inputs: Any):
        """A training step's :meth:`step` over micro-batches ``inputs``, or an eval_step's
        ``fn`` with ``inputs`` = (args, kwargs)."""
        if self.train:
            return self.step(shards, bufs, *inputs)
        args, kwargs = inputs
        leaves = [s.detach() for s in shards]
        self.leaves = leaves
        out = self.loss_fn(self._tree(leaves, bufs), *args, **kwargs)
        self.leaves = None
        return out

    def step(self, shards: list, bufs: Any, parts: list, scale: torch.Tensor | None):
        """The step over micro-batches ``parts``: (the losses' sum, the ``fs.Mean`` counts'
        sum or None, each micro-batch's aux, the reduced gradients summed over them).
        ``scale``: the loss scale, a float32 scalar (None: none), an input of the program,
        so that a new scale is not a new program."""
        leaves = list(shards)  # the trainable ones require grad (Compiled._run)
        total = count = summed = None
        auxes = []
        for mb in parts:  # each micro-batch gathers again, as the eager step's do
            self.leaves = leaves
            loss, aux = loss_.loss_of(self.loss_fn(self._tree(leaves, bufs), mb))
            self.leaves = None
            value = loss_.value(loss)
            share = loss_.share(loss, self.policy.accumulate)  # the step's, not this call's
            start = value / share if scale is None else value / share * scale  # as scaled()
            grads = torch.autograd.grad(start,
                                        [leaves[i] for i in self.trainable], allow_unused=True)
            reduced = self.reduce(list(grads))
            summed = reduced if summed is None else [
                b if a is None else a if b is None else a + b for a, b in zip(summed, reduced)]
            v = value.detach().double()
            total = v if total is None else total + v
            if isinstance(loss, loss_.Mean):
                c = loss_.count_of(loss, value.device)
                count = c if count is None else count + c
            auxes.append(pytree.plain_map(_detached, aux))
        return total, count, auxes, summed

    def _tree(self, leaves: list, bufs: Any):
        """What ``loss_fn`` gets: the tree of gathered tensors (a group module's leaves as
        DTensors over their shards), with the buffers when there are."""
        full: list = [None] * len(leaves)
        for gi, idx in enumerate(self.params.members):
            if gi in self.blocks:  # gathered at its module; here the shards, as DTensors
                for i in idx:
                    full[i] = DTensor.from_local(leaves[i], *self.like[i], run_check=False)
            else:
                for i, t in self.gather(gi, {i: leaves[i] for i in idx}).items():
                    full[i] = t
        tree = pytree.plain_map(lambda i: None if i is None else full[i], self.template)
        return tree if bufs is None else (tree, bufs)

    def reduce(self, grads: list) -> list:
        """The replicated leaves' gradients as means over the data-parallel ranks, one
        all-reduce per dtype and mesh dim (a sharded leaf's is one already: its group's
        pack's backward finished it)."""
        lays = self.params.layouts
        if self.alone:
            return grads
        pending: dict[torch.dtype, list[int]] = {}
        for j, (i, g) in enumerate(zip(self.trainable, grads)):
            if g is not None and not lays[i].sharded:
                pending.setdefault(g.dtype, []).append(j)
        for js in pending.values():
            flat = torch.cat([grads[j].reshape(-1) for j in js])
            for name in (self.shard_group, self.replicate_group):
                if name is not None:
                    flat = _compat.wait_tensor(_compat.all_reduce(flat, "sum", name))
            flat, at = flat / self.world, 0
            for j in js:
                n = grads[j].numel()
                grads[j], at = flat[at:at + n].view(grads[j].shape), at + n
        return grads


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _position(x: Any) -> Any:
    """A leaf of the template: a leaf's position, or None (an empty subtree)."""
    if x is None or isinstance(x, int):
        return x
    raise NotImplementedError(
        f"train_step(compile=True): the parameter tree holds a {type(x).__name__}; the "
        "compiled step takes trees of dicts, lists and tuples. Use compile=False.")
