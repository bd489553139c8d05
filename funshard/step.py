"""The training-step combinator: ``train_step(loss_fn, optimizer, policy=Policy())``.

``loss_fn(params, batch)`` sees every parameter with its full shape. Inside the step each
parameter is a lazy stand-in (:class:`_Lazy`); the first op that touches one gathers its
whole communication group with one all-gather. With ``reshard_after_forward=True`` the
previous group is freed as the next one is gathered, so about two groups are unsharded at
any moment; of the group backward starts with, the leaves its first nodes need stay
gathered from forward on and the rest are gathered again. Autograd's saved copies of
gathered parameters share the group's storage, which is freed (resized to 0 bytes) with the
group; ``saved_tensors_hooks`` count and tag them and, when backward needs one, gather its
group again into the same storage.

Backward is frugal where FSDP2 holds a block whole: each parameter is let go after the last
of its saved copies is used; the next group is prefetched only once half of the current one
is consumed; each parameter's gradient goes to the group's reduce bucket (:class:`_Tap`;
on gloo the bucket keeps the gradient itself and sends its rows from there). Each group's
bucket is reduce-scattered as soon as backward is done with the group (one collective per
group), finished before backward gathers the next group, then the gradient norm, clipping
and the optimizer run on the local shards.

Why this mechanism (measured in tests/test_step.py): module hooks are out by design;
activation checkpointing would recompute the forward; a per-op DTensor redistribute issues
one collective per tensor. The lazy stand-in gives one collective per group and direction
and needs nothing from the model but ``torch.func.functional_call``.

Caveat: a custom ``autograd.Function`` that stashes a parameter on ``ctx`` (not through
``save_for_backward``) bypasses the hooks and would read freed storage; use
``save_for_backward``. Every rank must use the same groups in the same order.

    >>> step = train_step(loss_fn, fs.optim.adamw(lr=3e-4), policy=Policy(clip_norm=1.0))
    >>> state = step.init(fs.shard(fs.params(model), mesh))
    >>> state, metrics = step(state, (x, y))     # metrics["loss"], metrics["grad_norm"]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from . import collectives, pytree
from .collectives import Layout

Tree = Any


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a step shards, casts, accumulates and clips.

    Args:
        reshard_after_forward: True frees each group after its forward use and gathers it
            again in backward (FULL_SHARD: 2 all-gathers + 1 reduce-scatter per group; of
            the group backward starts with, when forward used it last, the leaves backward
            needs first stay gathered and only the rest are gathered again); False keeps
            groups gathered until their backward (SHARD_GRAD_OP: 1 + 1).
        param_dtype: compute dtype for floating parameters (e.g. torch.bfloat16); master
            weights and optimizer state keep the parameters' dtype.
        reduce_dtype: dtype gradients are reduced in (e.g. torch.float32).
        accumulate: micro-batches per step; the batch's dim 0 is split in this many parts and
            gradients are reduced once per step.
        clip_norm: clip the global gradient norm (over all shards, each element once).
        groups: communication groups. None: one per element of a numbered container
            (``layers.0``, ``layers.1``, ...) and one for the rest. Or a callable
            ``fqn -> group name``, or a prefix tree of group names.
        prefetch: gather the next group asynchronously while the current one computes.
        skip_nonfinite: when the global gradient norm is NaN or inf, skip the update on every
            rank (they agree: the norm is all-reduced) and report ``metrics["skipped"] = 1``;
            otherwise such a step raises ``FloatingPointError`` naming the first parameter
            whose gradient is not finite, leaving the state unchanged.
    """

    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    accumulate: int = 1
    clip_norm: float | None = None
    groups: Any = None
    prefetch: bool = True
    skip_nonfinite: bool = False

    def __post_init__(self):
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"Policy: accumulate={self.accumulate!r} must be an int >= 1")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"Policy: clip_norm={self.clip_norm!r} must be > 0 (or None)")
        for name in ("param_dtype", "reduce_dtype"):
            dt = getattr(self, name)
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise ValueError(f"Policy: {name}={dt!r} must be a floating torch.dtype or None")


class TrainState(NamedTuple):
    """Sharded parameters, optimizer state and the number of steps taken."""

    params: Tree
    opt_state: Tree
    step: int


def kept_into_backward(forward: list[int], backward: list[int], policy: Policy) -> int | None:
    """The group a FULL_SHARD step keeps gathered from forward into backward, if any.

    ``forward`` and ``backward`` are groups in the order they are gathered. Backward's first
    group stays when forward used it in its last two gathers: freeing it would only gather
    it again at once (torchtitan sets FSDP2's last block so). ``fs.plan`` uses the same rule.
    """
    if policy.reshard_after_forward and backward and backward[0] in forward[-2:]:
        return backward[0]
    return None


def split_kept(sharded: list[int], first_unpack: list[int], nbytes: list[int]) -> list[int]:
    """Leaves of the kept group (see :func:`kept_into_backward`) to free at the end of
    forward and gather again in backward: all but the ones backward unpacks first, up to
    half the group's bytes. Backward starts where every activation is alive, so it holds
    only what its first nodes need; the kept group then costs 2 all-gathers like any other
    (the second of part of it), not 1. ``fs.plan`` uses the same rule.

    ``sharded``: the group's gathered leaves; ``first_unpack``: leaves in the order
    backward first used them; ``nbytes``: each leaf's full bytes. [] = no split.
    """
    total = sum(nbytes[k] for k in sharded)
    early, used = set(), 0
    for k in first_unpack:
        if k in sharded and used + nbytes[k] <= total // 2:
            early.add(k)
            used += nbytes[k]
        elif k in sharded:
            break
    late = [k for k in sharded if k not in early]
    return late if early and late else []


def default_group(fqn: str) -> str:
    """``'layers.3.attn.wq'`` -> ``'layers.3'``; ``'0.w'`` -> ``'0'``; no number -> ``''``."""
    parts = fqn.split(".")
    for j, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: j + 1])
    return ""


# -- the per-structure plan --------------------------------------------------------------


class _Plan:
    """What does not change between steps for one tree structure: groups and their order."""

    def __init__(self, params: Tree, policy: Policy):
        mesh, paths, leaves, layouts, spec = collectives.describe(params, what="train_step")
        self.mesh, self.spec, self.layouts = mesh, spec, layouts
        names = [pytree.fqn(p) for p in paths]
        if policy.groups is None:
            gnames = [default_group(n) for n in names]
        else:
            gnames = pytree.broadcast_prefix(
                (lambda fqn, _: policy.groups(fqn)) if callable(policy.groups) else policy.groups,
                params, name="Policy.groups",
            )
        order: dict[str, list[int]] = {}
        for i, g in enumerate(gnames):
            order.setdefault(g, []).append(i)
        self.group_names = list(order)
        self.members = list(order.values())
        self.group_of = [0] * len(leaves)
        self.pos = [0] * len(leaves)  # index within its group
        for gi, idx in enumerate(self.members):
            for k, i in enumerate(idx):
                self.group_of[i], self.pos[i] = gi, k
        self.trainable = [bool(leaf.requires_grad) for leaf in leaves]
        # per group: positions of its trainable leaves, whose gradients are reduced
        self.keep = [[k for k, i in enumerate(idx) if self.trainable[i]] for idx in self.members]
        self.slot = [{k: j for j, k in enumerate(keep)} for keep in self.keep]
        dt = policy.param_dtype
        self.dtypes = [dt if (dt is not None and leaf.is_floating_point()) else leaf.dtype
                       for leaf in leaves]
        self.world = mesh.size()
        rep = dict(zip(mesh.mesh_dim_names, mesh.shape)).get(collectives.REPLICATE, 1)
        # weight of each leaf's local squared norm in the all-ranks sum: count elements once
        self.norm_weight = [1.0 / rep if lay.sharded else 1.0 / self.world for lay in layouts]
        self.group_bytes = [
            sum(layouts[i].world * layouts[i].padded_numel * self.dtypes[i].itemsize
                for i in idx if layouts[i].sharded)
            for idx in self.members
        ]
        self.fwd_order: list[int] | None = None  # learned on the first step
        self.bwd_order: list[int] | None = None
        # the group backward needs first, when forward used it last: it stays gathered
        # from forward into backward instead of being freed and gathered again at once
        self.hold: int | None = None
        # leaves of ``hold`` freed at the end of forward and gathered again in backward once
        # the rest are used: backward starts where every activation is alive, so it holds
        # only what its first nodes need (see split_kept)
        self.late: list[int] = []
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"train_step: the mesh {collectives.mesh_str(mesh)} has {mesh.size()} ranks but "
                f"the world has {dist.get_world_size()}; build it with fs.make_mesh()."
            )


# -- one micro-batch's forward and backward ----------------------------------------------


class _Group:
    """A communication group inside one micro-batch: its gathered tensors and their state."""

    __slots__ = ("gi", "idx", "sharded", "replicated", "bases", "fulls", "pending", "resident",
                 "grads", "borrowed", "saved", "held", "handed_on", "versions", "owed")

    def __init__(self, gi: int, idx: list[int], layouts: list[Layout]):
        self.gi, self.idx = gi, idx
        self.sharded = [k for k, i in enumerate(idx) if layouts[i].sharded]
        self.replicated = [k for k, i in enumerate(idx) if not layouts[i].sharded]
        self.bases: list[torch.Tensor] | None = None  # padded full tensors (own storages)
        self.fulls: list[torch.Tensor | None] | None = None  # what loss_fn computes with
        self.pending: collectives.Gathered | None = None
        self.resident = False
        self.grads: list[torch.Tensor | None] | None = None
        self.borrowed = False  # fulls are the shards themselves (a world of one): never freed
        self.saved = [0] * len(idx)  # per leaf: autograd's saved copies not yet unpacked
        self.held = 0  # bytes of gathered storages this run still holds
        self.handed_on = False  # backward has prefetched the group after this one
        self.versions = None  # autograd version counters to restore after a refill
        self.owed: list[int] = []  # leaves freed while the group is resident, gathered on use


class _Tap(torch.autograd.Function):
    """A trainable gathered leaf as ``loss_fn`` sees it. Its backward runs as soon as the
    leaf's gradient is complete and copies it into the group's reduce buffer, so the full
    gradient is freed at once instead of waiting for the rest of the group's backward."""

    @staticmethod
    def forward(ctx, run, group, k, full):
        ctx.run, ctx.group, ctx.k = run, group, k
        ctx.set_materialize_grads(False)
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        if grad is not None:
            ctx.run.put(ctx.group, ctx.k, grad)
        return None, None, None, None


class _Gather(torch.autograd.Function):
    """First gather of a group in a micro-batch; backward reduces the group's gradients."""

    @staticmethod
    def forward(ctx, run, group, *shards):
        ctx.run, ctx.group = run, group
        ctx.set_materialize_grads(False)
        fulls = run.gather(group)
        frozen = [f for i, f in zip(group.idx, fulls) if not run.plan.trainable[i]]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return fulls

    @staticmethod
    def backward(ctx, *grads):
        ctx.run.reduce(ctx.group, grads)
        return (None, None, *([None] * len(grads)))


class _Run:
    """State of one micro-batch: which groups are gathered, and the gradients reduced."""

    def __init__(self, plan: _Plan, shards: list[torch.Tensor], policy: Policy,
                 buckets: dict, accumulating: bool, sync: bool, record: bool):
        self.plan, self.shards, self.policy = plan, shards, policy
        # per group: its gradients, summed over the step's micro-batches until reduced
        self.buckets: dict[int, collectives.GradBucket] = buckets
        self.accumulating, self.sync = accumulating, sync
        self.tapped = plan.world > 1  # gradients reach the buckets through _Tap
        self.groups = [_Group(gi, idx, plan.layouts) for gi, idx in enumerate(plan.members)]
        self.active: list[int] = []  # groups the latest op (or autograd node) uses
        # reductions in flight, oldest first: (group, leaf positions, collectives.Reducing)
        self.reducing: list[tuple[_Group, list[int], collectives.Reducing]] = []
        self.node = None  # the autograd node whose saved tensors are being unpacked
        self.deferred = None  # (node, group): hand on from group once node is done
        self.phase = "forward"
        self.storage: dict[int, tuple[_Group, int]] = {}  # storage data_ptr -> (group, leaf)
        self.record = record
        self.fwd_seen: list[int] = []  # groups in the order they were gathered
        self.bwd_seen: list[int] = []
        self.in_order = {"forward": True, "backward": True}  # seen so far == recorded order
        self.first_unpack: dict[int, list[int]] = {}  # per group: leaves in backward's order
        self.peak_groups = 0  # most groups gathered or in flight at once
        self.peak_bytes = 0  # their full-size bytes

    # gathering ----------------------------------------------------------------------

    def _launch(self, group: _Group, async_op: bool,
                leaves: list[int] | None = None) -> collectives.Gathered:
        """Start gathering the group's sharded ``leaves`` (default: all of them)."""
        leaves = group.sharded if leaves is None else leaves
        lays = [self.plan.layouts[group.idx[k]] for k in leaves]
        shards = [self.shards[group.idx[k]] for k in leaves]
        dts = [self.plan.dtypes[group.idx[k]] for k in leaves]
        # gathered before in this micro-batch: fill the same storages (autograd saved them)
        into = None if group.bases is None else (lambda: self._refill(group, leaves))
        return collectives.all_gather(lays, shards, self.plan.mesh, dtypes=dts,
                                      async_op=async_op, into=into)

    def _refill(self, group: _Group, leaves: list[int]) -> list[torch.Tensor]:
        """The padded full tensors of ``leaves``, grown back to full size (or new, for a
        leaf backward dropped), for a gather to write into."""
        plan, outs = self.plan, []
        for k in leaves:
            b = group.bases[k]
            if b is None:  # dropped in backward (see _drop): a fresh storage
                i = group.idx[k]
                lay = plan.layouts[i]
                b = group.bases[k] = torch.empty((lay.world * lay.chunk, *lay.shape[1:]),
                                                 dtype=plan.dtypes[i],
                                                 device=self.shards[i].device)
                group.fulls[k] = b if b.shape[0] == lay.rows else b[: lay.rows]
            b.untyped_storage().resize_(b.numel() * b.element_size())
            outs.append(b)
        # Autograd saved these tensors; refilling them is not a mutation it must see: their
        # version counters are put back once the gather is done (see gather).
        group.versions = torch.autograd._unsafe_preserve_version_counter(tuple(outs))
        return outs

    def gather(self, group: _Group) -> tuple[torch.Tensor, ...]:
        """Gather ``group`` (waiting for its prefetch if one is in flight) into its tensors."""
        plan = self.plan
        if plan.world == 1 and all(plan.dtypes[i] == self.shards[i].dtype for i in group.idx):
            # a world of one with no cast: the shards are the full tensors; nothing to gather
            group.fulls = [self.shards[i].view_as(self.shards[i]) for i in group.idx]
            group.bases, group.borrowed, group.resident = list(group.fulls), True, True
            return tuple(group.fulls)
        pending = group.pending or self._launch(group, async_op=False)
        group.pending = None
        got = pending.wait()
        if group.bases is None:  # first gather in this micro-batch: fresh tensors
            bases = [None] * len(group.idx)
            fulls = [None] * len(group.idx)
            for k, t in zip(group.sharded, got):
                fulls[k] = t
                bases[k] = t._base if t._base is not None else t
            for k in group.replicated:
                i = group.idx[k]
                fulls[k] = bases[k] = self.shards[i].detach().to(plan.dtypes[i], copy=True)
            group.bases, group.fulls = bases, fulls
        else:
            self._refilled(group)
        group.held = 0
        self._hold(group, group.sharded)
        group.resident, group.handed_on, group.owed = True, False, []
        self._note_peak()
        return tuple(group.fulls)

    def _refilled(self, group: _Group) -> None:
        if group.versions is not None:
            group.versions.__exit__(None, None, None)
            group.versions = None

    def _hold(self, group: _Group, leaves: list[int]) -> None:
        """``leaves`` are gathered: count their bytes, map their storages for ``pack``."""
        for k in leaves:
            st = group.bases[k].untyped_storage()
            group.held += st.nbytes()
            if st.data_ptr():
                self.storage[st.data_ptr()] = (group, k)

    def _pay(self, group: _Group) -> None:
        """Gather the leaves a resident group owes (waiting for their prefetch, if any)."""
        pending = group.pending or self._launch(group, async_op=False, leaves=group.owed)
        group.pending = None
        pending.wait()
        self._refilled(group)
        self._hold(group, group.owed)
        group.owed = []

    def _forgo(self, group: _Group, leaves: list[int]) -> None:
        """Free ``leaves`` of a resident group; it gathers them again when one is unpacked."""
        for k in leaves:
            b = group.bases[k]
            if b is None:
                continue
            st = b.untyped_storage()
            self.storage.pop(st.data_ptr(), None)
            group.held -= st.nbytes()
            st.resize_(0)
            if group.saved[k]:  # autograd will want it back
                group.owed.append(k)

    def _settle_gather(self, group: _Group) -> None:
        """Finish a gather of ``group`` still in flight (it writes into the group's storages)."""
        if group.pending is not None:
            group.pending.wait()
            self._refilled(group)
            group.pending = None
            if group.bases is not None:
                group.resident = True  # its storages may be full again: free() shrinks them

    def _leaf_bytes(self, gi: int, k: int) -> int:
        i = self.plan.members[gi][k]
        lay = self.plan.layouts[i]
        return lay.world * lay.padded_numel * self.plan.dtypes[i].itemsize

    def _note_peak(self) -> None:
        live = [g for g in self.groups if g.resident or g.pending is not None]
        self.peak_groups = max(self.peak_groups, len(live))
        nbytes = sum(g.held if g.resident else self.plan.group_bytes[g.gi] for g in live)
        self.peak_bytes = max(self.peak_bytes, nbytes)

    def free(self, group: _Group) -> None:
        if not group.resident or group.borrowed:
            return
        if group.pending is not None:  # leaves it owed are on their way into its storages
            self._settle_gather(group)
        for k in group.sharded:
            if group.bases[k] is not None:
                st = group.bases[k].untyped_storage()
                self.storage.pop(st.data_ptr(), None)
                st.resize_(0)
        group.resident, group.held, group.owed = False, 0, []

    def _drop(self, group: _Group, k: int) -> None:
        """Backward has unpacked every saved copy of leaf ``k``: let go of it.

        Its storage is not resized (the node unpacking it is still computing with it): the
        step drops its own references, so the storage is freed with autograd's last one,
        when that node's saved tensors are released. A stray later unpack still holds it.
        """
        b = group.bases[k]
        if b is None or group.borrowed:
            return
        self.storage.pop(b.untyped_storage().data_ptr(), None)
        group.held -= b.untyped_storage().nbytes()
        group.bases[k] = group.fulls[k] = None

    def use(self, gis: list[int], *, new_op: bool) -> None:
        """Make the groups one op needs resident; free the previous op's other groups.

        ``new_op``: this call starts a new op (forward: every torch function; backward: a
        new autograd node). Groups the same op needs are never freed under it.
        """
        if new_op:
            stale = [g for g in self.active if g not in gis]
            self.active = list(dict.fromkeys(gis))
            if self.phase == "backward" or self.policy.reshard_after_forward:
                for g in stale:
                    if self.phase == "backward" or g != self.plan.hold:
                        self.free(self.groups[g])
        else:
            self.active.extend(g for g in gis if g not in self.active)
        for gi in dict.fromkeys(gis):
            group = self.groups[gi]
            if group.resident:
                continue
            forward = self.phase == "forward"
            seen = self.fwd_seen if forward else self.bwd_seen
            order = self.plan.fwd_order if forward else self.plan.bwd_order
            seen.append(gi)
            if not order or len(seen) > len(order) or order[len(seen) - 1] != gi:
                self.in_order[self.phase] = False  # diverged from the recorded order
            if group.fulls is None:  # first use in this micro-batch: enters autograd here
                outs = _Gather.apply(self, group, *[self.shards[i] for i in group.idx])
                if self.tapped:
                    for k in self.plan.keep[gi]:
                        group.fulls[k] = _Tap.apply(self, group, k, outs[k])
            else:
                if not forward:
                    # The group backward reaches next: the previous group's reduce-scatter
                    # (launched as its backward ended) is finished first, so its input is
                    # not alive under this group's first node, where memory peaks.
                    self.advance()
                self.gather(group)
            if forward:  # the next group's gather overlaps this group's forward
                self._prefetch()

    def _prefetch(self) -> None:
        """Start gathering the group the recorded order has next, if this run follows it."""
        if not self.policy.prefetch or self.plan.world == 1 or not self.in_order[self.phase]:
            return
        forward = self.phase == "forward"
        order = self.plan.fwd_order if forward else self.plan.bwd_order
        seen = self.fwd_seen if forward else self.bwd_seen
        if not order or len(seen) >= len(order):
            return
        g = self.groups[order[len(seen)]]
        if not g.resident and g.pending is None and (forward or g.fulls is not None):
            g.pending = self._launch(g, async_op=True)
            self._note_peak()

    # saved tensors --------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        try:
            hit = self.storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
            return t
        if hit is None:
            return t
        group, k = hit
        group.saved[k] += 1
        return (group.gi, k, t)

    def unpack(self, packed):
        waiting = self.deferred is not None and self.phase == "backward"
        if not waiting and not isinstance(packed, tuple):
            return packed  # the common case: an activation, nothing to do
        node = torch._C._current_autograd_node()
        if waiting and node is not self.deferred[0]:  # the node that consumed it finished
            g, self.deferred = self.deferred[1], None
            self._hand_on(g)
        if not isinstance(packed, tuple):
            return packed
        gi, k, t = packed
        group = self.groups[gi]
        if group.bases is None or group.bases[k] is not None:  # else dropped: t is intact
            self.use([gi], new_op=node is None or node is not self.node)
            if k in group.owed:
                self._pay(group)
        self.node = node
        if self.phase == "backward":
            if self.record:
                seen = self.first_unpack.setdefault(gi, [])
                if k not in seen:
                    seen.append(k)
            group.saved[k] -= 1
            if group.saved[k] == 0:
                self._drop(group, k)
            # Hand on once half the group is consumed (a group that owes leaves: once the
            # rest is), when the node consuming it is done: the next gather overlaps the
            # rest of this group's backward, but is not allocated while the whole group (or
            # the node's own outputs) are alive.
            if group.owed:
                due = group.pending is None and group.held == 0
            else:
                due = not group.handed_on and 2 * group.held <= self.plan.group_bytes[gi]
            if due and self.deferred is None and group.resident:
                self.deferred = (node, group)
        return t

    def _hand_on(self, group: _Group) -> None:
        """Backward is mostly done with ``group``: prefetch the leaves it owes, else the
        group the recorded order has next, if ``group`` is the one before it there."""
        if group.owed:
            if group.pending is None and self.policy.prefetch:
                group.pending = self._launch(group, async_op=True, leaves=group.owed)
            return
        if group.handed_on:
            return
        group.handed_on = True
        order, j = self.plan.bwd_order, len(self.bwd_seen)
        if order and j < len(order):
            before = order[j - 1] if j else self.plan.hold
            if before is None or before == group.gi:
                self._prefetch()

    # backward -------------------------------------------------------------------------

    def bucket(self, group: _Group) -> collectives.GradBucket:
        """The group's gradient bucket for this step (made on its first gradient)."""
        b = self.buckets.get(group.gi)
        if b is None:
            # The previous group's reduce-scatter had this group's first node to complete:
            # finish it now, so its input is freed before this bucket is allocated.
            self.advance()
            plan, keep = self.plan, self.plan.keep[group.gi]
            # Reduce in reduce_dtype; else in the compute dtype, or when micro-batches are
            # summed first, in the parameters' own dtype.
            dts = [self.policy.reduce_dtype or (plan.layouts[group.idx[k]].dtype
                                                if self.accumulating
                                                else plan.dtypes[group.idx[k]])
                   for k in keep]
            b = self.buckets[group.gi] = collectives.GradBucket(
                [plan.layouts[group.idx[k]] for k in keep], plan.mesh, dts, alias=True,
                borrow=not self.accumulating)
        return b

    def put(self, group: _Group, k: int, grad: torch.Tensor) -> None:
        """Leaf ``k``'s gradient for this micro-batch is complete: add it to the bucket."""
        self.bucket(group).put(self.plan.slot[group.gi][k], grad, add=True)

    def reduce(self, group: _Group, grads: tuple) -> None:
        """Backward is done with ``group``: reduce its gradients (after the last micro-batch)."""
        # Free the group's parameters and move the previous group's reduction on (it had this
        # group's whole backward to complete): its reduce-scatter is finished (freeing its
        # input) and, on a 2-D mesh, its "replicate" all-reduce launched, to be finished
        # after the next group's backward. So each stage overlaps a group's backward.
        self.free(group)
        self.settle(keep=1)
        self._hand_on(group)  # if unpacking did not already
        keep = self.plan.keep[group.gi]
        if not self.tapped:
            for k in keep:
                if grads[k] is not None:
                    self.put(group, k, grads[k])
        if self.sync and keep:
            bucket = self.bucket(group)
            del self.buckets[group.gi]
            self.reducing.append((group, keep, bucket.launch()))

    def settle(self, keep: int = 0) -> None:
        """Finish the reductions in flight but the newest ``keep``, whose first stage is
        finished and second launched; keep the finished ones' gradient shards."""
        while len(self.reducing) > keep:
            group, pos, pending = self.reducing.pop(0)
            group.grads = [None] * len(group.idx)
            for k, g in zip(pos, pending.wait()):
                group.grads[k] = g
        self.advance()

    def advance(self) -> None:
        """Finish the reduce-scatter of every reduction in flight (freeing its input) and
        launch its "replicate" all-reduce, if any."""
        for _, _, pending in self.reducing:
            pending.advance()

    def end_forward(self) -> None:
        self.phase = "backward"
        if self.policy.reshard_after_forward:  # keep only the group backward starts with
            for g in self.groups:
                if g.gi not in self.active and g.gi != self.plan.hold:
                    self.free(g)
            hold = self.groups[self.plan.hold] if self.plan.hold is not None else None
            if hold is not None and hold.resident and not hold.borrowed and self.plan.late:
                self._forgo(hold, self.plan.late)

    def finish(self) -> None:
        self.settle()
        self.deferred = None
        for g in self.groups:
            self._settle_gather(g)  # a prefetch nobody used: finish it, then free
            self.free(g)
        if self.record:
            fwd, bwd = list(self.fwd_seen), list(self.bwd_seen)
            self.plan.hold = kept_into_backward(fwd, bwd, self.policy)
            self.plan.late = []
            if self.plan.hold is not None:
                bwd.pop(0)
                g = self.plan.hold
                self.plan.late = split_kept(
                    self.groups[g].sharded, self.first_unpack.get(g, []),
                    [self._leaf_bytes(g, k) for k in range(len(self.plan.members[g]))])
            self.plan.fwd_order, self.plan.bwd_order = fwd, bwd

    def release(self) -> None:
        """Drop every tensor this run holds. Autograd's ``ctx.run`` makes a cycle through
        C++ (run -> gathered tensor -> grad_fn -> ctx -> run) that Python's collector cannot
        see, so the step breaks it by hand once the gradients are taken."""
        for g in self.groups:
            g.fulls = g.bases = g.grads = g.pending = None
        self.storage.clear()
        self.reducing = []
        self.shards = []
        self.node = self.deferred = None  # autograd nodes: they reach every ctx in the graph
        self.buckets = {}


# -- the lazy parameter stand-in ---------------------------------------------------------

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.__len__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.nelement,
}


class _Lazy(torch.Tensor):
    """A parameter inside ``loss_fn``: full shape and compute dtype; gathers on first use."""

    @staticmethod
    def __new__(cls, run: _Run, gi: int, k: int, shape, dtype, device, requires_grad):
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
        lazies = [x for x in flat if isinstance(x, _Lazy)]
        if lazies:
            run = lazies[0]._run
            run.use([x._gi for x in lazies], new_op=True)
            flat = [run.groups[x._gi].fulls[x._k] if isinstance(x, _Lazy) else x for x in flat]
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


# -- the step ----------------------------------------------------------------------------


class TrainStep(NamedTuple):
    """``init(params) -> TrainState`` and ``apply(state, batch) -> (state, metrics)``.

    Calling the object is ``apply``. Donation rule: ``apply`` updates the parameters and
    optimizer state in place (their local shards), as JAX does with donated buffers; the
    returned state is the one to use; do not use the old one after the call.
    """

    init: Callable[[Tree], TrainState]
    apply: Callable[[TrainState, Any], tuple[TrainState, dict]]

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        return self.apply(state, batch)


def _split_batch(batch: Any, k: int) -> list[Any]:
    if k == 1:
        return [batch]
    paths, leaves, spec = pytree.flatten_with_path(batch)
    parts = []
    for p, x in zip(paths, leaves):
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] % k:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"train_step: batch[{pytree.fqn(p)!r}] of shape {shape} does not split into "
                f"accumulate={k} micro-batches along dim 0; use a batch size divisible by {k}."
            )
        parts.append(x.chunk(k))
    return [pytree.unflatten(spec, [c[j] for c in parts]) for j in range(k)]


def _loss_of(out: Any) -> tuple[torch.Tensor, Any]:
    loss, aux = (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        what = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
                if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
        raise ValueError(
            f"train_step: loss_fn must return a floating scalar tensor (or (loss, aux)), got "
            f"{what}; reduce it, e.g. with .mean()."
        )
    return loss, aux


def train_step(loss_fn: Callable, optimizer, *, policy: Policy = Policy()) -> TrainStep:
    """Compose ``loss_fn`` and ``optimizer`` into one sharded training step.

    Args:
        loss_fn: ``(params, batch) -> loss`` or ``(loss, aux)``; ``params`` has full shapes
            (the loss is the mean over the local batch).
        optimizer: an ``fs.optim`` optimizer (``init``, ``update``).
        policy: :class:`Policy`.
    Returns:
        :class:`TrainStep`; ``state, metrics = step(state, batch)`` with ``metrics["loss"]``
        (mean over all data-parallel ranks) and ``metrics["grad_norm"]`` (before clipping).

    Example: N ranks with batch B each match one process on the N*B batch.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"train_step: policy must be an fs.Policy, got {type(policy).__name__}")
    plans: dict[Any, _Plan] = {}  # per tree structure, learned once (like a jit cache)

    def plan_for(params: Tree) -> _Plan:
        leaves, spec = pytree.flatten(params)
        key = (spec, getattr(leaves[0], "device_mesh", None) if leaves else None)
        if key not in plans or not all(isinstance(x, DTensor) for x in leaves):
            plans[key] = _Plan(params, policy)  # validates: DTensors, one mesh, placements
        return plans[key]

    def init(params: Tree) -> TrainState:
        plan_for(params)
        return TrainState(params, optimizer.init(params), 0)

    def apply(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        plan = plan_for(state.params)
        leaves = pytree.flatten(state.params)[0]
        shards = [d._local_tensor.detach().requires_grad_(t)
                  for d, t in zip(leaves, plan.trainable)]
        micro = _split_batch(batch, policy.accumulate)
        k = len(micro)
        buckets: dict = {}  # gradients summed over micro-batches, per group
        record = plan.fwd_order is None
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_all, runs = [], []
        for j, mb in enumerate(micro):
            run = _Run(plan, shards, policy, buckets, accumulating=k > 1, sync=(j == k - 1),
                       record=record and j == 0)
            lazies = [
                _Lazy(run, plan.group_of[i], plan.pos[i], lay.shape, plan.dtypes[i],
                      shards[i].device, plan.trainable[i])
                for i, lay in enumerate(plan.layouts)
            ]
            try:
                with saved_tensors_hooks(run.pack, run.unpack):
                    loss, aux = _loss_of(loss_fn(pytree.unflatten(plan.spec, lazies), mb))
                run.end_forward()
                if loss.requires_grad:
                    (loss / k).backward()
            finally:
                run.finish()
            loss_sum += loss.detach().double()
            aux_all.append(aux)
            runs.append(run)
        last = runs[-1]
        grads: list[torch.Tensor | None] = [None] * len(leaves)
        for g in last.groups:
            if g.grads is not None:
                for k2, i in enumerate(g.idx):
                    grads[i] = g.grads[k2]
        peaks = (max(r.peak_groups for r in runs), max(r.peak_bytes for r in runs))
        for r in runs:
            r.release()
        # one all-reduce per step for the loss metric and the global gradient norm
        sq = torch.zeros((), dtype=torch.float64)
        present = [i for i, g in enumerate(grads) if g is not None]
        if present:
            norms = torch._foreach_norm([grads[i].float() for i in present])
            w = torch.tensor([plan.norm_weight[i] for i in present], dtype=torch.float64)
            sq = (torch.stack(norms).double() ** 2 * w).sum()
        both = torch.stack([loss_sum / k, sq]).to(shards[0].device if shards else "cpu")
        if plan.world > 1:
            with collectives.watch("all-reduce of the step's metrics", plan.mesh):
                dist.all_reduce(both)
        both = both.cpu()
        mean_loss = both[0].item() / plan.world
        norm = both[1].clamp_min(0).sqrt().item()
        base = {
            "loss": mean_loss,
            "grad_norm": norm,
            "unsharded_groups_peak": peaks[0],
            "unsharded_bytes_peak": peaks[1],
            "skipped": 0,
        }
        if any(a is not None for a in aux_all):
            base["aux"] = aux_all[0] if k == 1 else aux_all
        if not math.isfinite(norm):
            if policy.skip_nonfinite:  # every rank sees the same norm: all skip together
                return TrainState(state.params, state.opt_state, state.step + 1), {
                    **base, "skipped": 1}
            _raise_nonfinite(plan, grads, present, state.step)
        if policy.clip_norm is not None and present:
            coef = min(1.0, policy.clip_norm / (norm + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_([grads[i] for i in present], coef)
        grad_tree = optree.tree_unflatten(plan.spec, grads)  # None for frozen/unused leaves
        params, opt_state = optimizer.update(grad_tree, state.opt_state, state.params,
                                             step=state.step)
        return TrainState(params, opt_state, state.step + 1), base

    return TrainStep(init, apply)


def _raise_nonfinite(plan: _Plan, grads: list, present: list[int], step: int) -> None:
    """Name the first parameter (in tree order, over all ranks) whose gradient is not finite."""
    bad = torch.tensor([0.0 if grads[i].isfinite().all() else 1.0 for i in present])
    if plan.world > 1:
        dev = grads[present[0]].device
        bad = bad.to(dev)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        bad = bad.cpu()
    hits = [present[j] for j in range(len(present)) if bad[j] > 0]
    lay = plan.layouts[hits[0]] if hits else None
    where = (f"the gradient of {lay.path!r} (shape {tuple(lay.shape)}, on "
             f"{collectives.mesh_str(plan.mesh)})" if lay else "the loss")
    raise FloatingPointError(
        f"train_step: {where} is not finite (NaN or inf) at step {step}"
        f"{f'; {len(hits)} parameters in all' if len(hits) > 1 else ''}. The parameters and "
        "optimizer state are unchanged. Lower the learning rate or check the data, or pass "
        "fs.Policy(skip_nonfinite=True) to skip such steps."
    )
