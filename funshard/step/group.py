"""One communication group inside one micro-batch: its state, its storages, its moves.

[Note: a group's life]

Inside ``train_step`` every parameter ``loss_fn`` sees is a stand-in (:mod:`.lazy`); the
first op that touches one gathers its whole group with one all-gather, and autograd's
saved copies of gathered parameters are tracked by the saved-tensor hooks (:mod:`.saved`).
A group's full tensors own their storages; freeing a group resizes those storages to 0
bytes, so the tensors autograd saved stay valid objects and are filled again, in place,
when backward needs them. One group's life in a FULL_SHARD step::

    forward                               backward
    SHARDED -> GATHERING -> GATHERED -> SHARDED ... GATHERING -> GATHERED -> SHARDED
               (prefetch:  (first op  (the next      (prefetch   (its nodes  (its last
                previous    uses it)   group's op)    once half   unpack it;  node ran:
                group's op)                           the group   each leaf   reduce-
                                                      before is   dropped     scatter)
                                                      consumed)   after its
                                                                  last use)

- The group backward starts with (the last block, :attr:`Schedule.kept`) stays
  GATHERED from forward into backward, except the leaves its first nodes do not need
  (``kept_late``): those are freed when forward ends (GATHERED -> PARTIAL) and gathered
  again once the rest are used (PARTIAL -> PARTIAL_GATHERING -> GATHERED).
- SHARD_GRAD_OP (``reshard_after_forward=False``) skips the middle: a group is gathered
  once and freed at the end of its backward.
- A world of one with no cast has nothing to gather: the shards are the full tensors
  (ALIASED), never freed; they enter autograd as leaves, as a plain step's parameters do
  (:meth:`Group.alias`), and their gradients are handed over when backward is done.
- Each trainable leaf's gradient reaches the group's reduce bucket through one autograd
  node (:mod:`.grads`); when backward is done with the group its bucket is reduce-scattered
  (one collective), finished before backward gathers the next group.

[Note: rank-independent freeing] A rank's collectives must not depend on what it alone does
(NCCL ranks that disagree hang, or read each other's bytes). A leaf held elsewhere (one
rank's profiler, a view, an uncollected cycle) is freed for the collectives all the same:
its group goes SHARDED and gathers again as on every rank, into the held storage it keeps,
at the same op as every rank.

Autograd holds the step's run through ``ctx`` objects (run -> gathered tensor -> grad_fn
-> ctx -> run), a cycle through C++ that Python's collector cannot see: the step breaks it
by hand (``Run.release``) once the gradients are taken.
"""

from __future__ import annotations

import enum

import torch

from .. import _compat, collectives
from .lazy import LazyParam, in_place_error
from .params import ParamGroups


class GroupState(enum.Enum):
    SHARDED = "sharded"  # no full storage: never gathered in this micro-batch, or freed
    GATHERING = "gathering"  # an all-gather in flight (a prefetch)
    GATHERED = "gathered"  # full tensors usable
    PARTIAL = "partial"  # gathered but some leaves freed, to be gathered again on use
    PARTIAL_GATHERING = "partial-gathering"  # PARTIAL with those leaves' gather in flight
    ALIASED = "aliased"  # a world of one with no cast: the shards are the full tensors


S = GroupState
ALLOWED: dict[GroupState, frozenset[GroupState]] = {
    S.SHARDED: frozenset({S.GATHERING, S.GATHERED, S.ALIASED}),
    S.GATHERING: frozenset({S.GATHERED, S.SHARDED}),
    S.GATHERED: frozenset({S.PARTIAL, S.SHARDED}),
    S.PARTIAL: frozenset({S.PARTIAL_GATHERING, S.GATHERED, S.SHARDED}),
    S.PARTIAL_GATHERING: frozenset({S.GATHERED, S.SHARDED}),
    S.ALIASED: frozenset(),
}
RESIDENT = frozenset({S.GATHERED, S.PARTIAL, S.PARTIAL_GATHERING, S.ALIASED})


class IllegalTransition(RuntimeError):
    """A group was asked to move between two states that do not follow: a funshard bug."""


class Group:
    """Group ``gi`` in one micro-batch: its gathered tensors and where they stand.

    ``storage`` maps the data pointer of every gathered storage to ``(group, leaf)``, for
    the saved-tensor hooks; the group keeps it current as it gathers and frees.
    """

    def __init__(self, gi: int, params: ParamGroups, shards: list[torch.Tensor],
                 storage: dict, transport: str):
        self.gi, self.params, self.shards, self.storage = gi, params, shards, storage
        self.transport = transport
        self.idx = params.members[gi]
        lays = params.layouts
        self.sharded = [k for k, i in enumerate(self.idx) if lays[i].sharded]
        self.replicated = [k for k, i in enumerate(self.idx) if not lays[i].sharded]
        self.state = S.SHARDED
        self.bases: list[torch.Tensor | None] | None = None  # padded full tensors
        self.fulls: list[torch.Tensor | None] | None = None  # what loss_fn computes with
        self.pending: collectives.Gathered | None = None  # the gather in flight
        self.grads: list[torch.Tensor | None] | None = None  # reduced gradient shards
        self.saved = [0] * len(self.idx)  # per leaf: autograd's saved copies not unpacked
        self.bare = [0] * len(self.idx)  # of those, stand-ins saved as they were (no storage)
        self.held = 0  # bytes of gathered storages this group holds
        self.next_prefetched = False  # backward has prefetched the group after this one
        self.written: list | None = None  # the full tensors' versions when first made
        self.to_regather: list[int] = []  # leaves freed while PARTIAL, gathered again on use
        self.stands: list | None = None  # the stand-ins loss_fn holds (see .lazy)
        self.ended = False  # backward is done with it (its gradients are complete)
        self.pinned = False  # resident until its backward ([Note: hooks beneath the step's])
        self.local = collectives.skips(params.data_world)  # one data rank: a gather is a cast

    @property
    def name(self) -> str:
        return self.params.names[self.gi]

    @property
    def resident(self) -> bool:
        return self.state in RESIDENT

    def move(self, to: GroupState) -> None:
        """The one place a group's state changes; an illegal move is a bug report."""
        if to not in ALLOWED[self.state]:
            raise IllegalTransition(
                f"funshard bug: group {self.name!r} cannot go from {self.state.name} to "
                f"{to.name} (allowed: {sorted(s.name for s in ALLOWED[self.state])}). "
                "Please report it with the model and Policy."
            )
        self.state = to

    # gathering ---------------------------------------------------------------------

    def launch(self, async_op: bool, leaves: list[int] | None = None) -> collectives.Gathered:
        """Start gathering the sharded ``leaves`` (default: all of them)."""
        leaves = self.sharded if leaves is None else leaves
        p, idx = self.params, self.idx
        # gathered before in this micro-batch: fill the same storages (autograd saved them)
        into = None if self.bases is None else (lambda: self._refill(leaves))
        return collectives.all_gather([p.layouts[idx[k]] for k in leaves],
                               [self.shards[idx[k]] for k in leaves], p.mesh,
                               dtypes=[p.dtypes[idx[k]] for k in leaves],
                               async_op=async_op, into=into, transport=self.transport)

    def _get(self, leaves: list[int]) -> list[torch.Tensor]:
        """Gather ``leaves`` now, or finish the gather in flight (:attr:`pending`)."""
        pending, self.pending = self.pending, None
        if pending is None and self.local:
            return self._cast(leaves)
        return (pending or self.launch(async_op=False, leaves=leaves)).wait()

    def _cast(self, leaves: list[int]) -> list[torch.Tensor]:
        """A world of one's gather, with no collective: each full tensor is a copy of its
        shard (one shape, no padding) in the compute dtype, into the storages autograd saved
        when there are some. What :func:`collectives.all_gather` does there, without its buckets
        and views. Measured 2026-11-24 (host-bound GPT 8 x 64, bfloat16, world 1, this CPU):
        96 -> 85 us per group gathered; with :meth:`Reductions._put_local`, 0.94x the step
        time (best of 20 rounds, in one process)."""
        idx, shards = self.idx, self.shards
        if self.bases is None:
            dts = self.params.dtypes
            outs = [torch.empty_like(shards[idx[k]], dtype=dts[idx[k]],
                                     memory_format=torch.contiguous_format) for k in leaves]
        else:
            outs = self._refill(leaves)
        with torch.no_grad():  # a refill in backward runs under grad mode
            _compat.foreach_copy_(outs, [shards[idx[k]] for k in leaves])
        return outs

    def prefetch(self) -> None:
        """SHARDED -> GATHERING: start the whole group's gather."""
        self.pending = self.launch(async_op=True)
        self.move(S.GATHERING)

    def prefetch_regather(self) -> None:
        """PARTIAL -> PARTIAL_GATHERING: start gathering the leaves it owes."""
        self.pending = self.launch(async_op=True, leaves=self.to_regather)
        self.move(S.PARTIAL_GATHERING)

    def _refill(self, leaves: list[int]) -> list[torch.Tensor]:
        """The padded full tensors of ``leaves``, grown back to full size (or new, for a
        leaf backward dropped), for a gather to write into."""
        p, outs = self.params, []
        for k in leaves:
            b = self.bases[k]
            if b is None:  # dropped in backward (see drop): a fresh storage
                i = self.idx[k]
                lay = p.layouts[i]
                b = self.bases[k] = torch.empty(lay.padded_shape, dtype=p.dtypes[i],
                                                device=self.shards[i].device)
                self.fulls[k] = b if b.shape[0] == lay.rows else b[: lay.rows]
                self.written[k] = _compat.version(b)  # (the gather into it keeps it: below)
            b.untyped_storage().resize_(b.numel() * b.element_size())
            # autograd saved these tensors; refilling them is not a mutation it must see:
            # the gather writes through ``.data``, which shares the storage, not the version
            outs.append(b.data)
        return outs

    @property
    def aliased(self) -> bool:
        return self.state is S.ALIASED

    @property
    def aliases(self) -> bool:
        """A world of one with no cast: the shards are the full tensors (see :meth:`alias`)."""
        return collectives.skips(self.params.data_world) and self.params.uncast[self.gi]

    def alias(self, given: bool = False) -> None:
        """SHARDED -> ALIASED: nothing to gather. Each full tensor is a new autograd leaf on
        its shard's storage (trainable leaves require grad), so the group enters autograd as
        a plain step's parameters do: its gradients accumulate in the leaves' ``.grad``,
        with no node of the step's in the graph, and the run hands them over when the
        micro-batch's backward is done (:meth:`Run.finish`).

        The shards are the state's own tensors: autograd refuses a write into a trainable
        leaf before it lands, and so does the stand-in into a frozen one; inside its
        module's call one lands in the state before the step finds it (at the end of the
        micro-batch: :meth:`check_unwritten`) and refuses the step. (A view made under
        no_grad of a leaf that requires grad would be refused too, but autograd then
        computes the frozen weight's gradient: a matmul per frozen linear.)

        ``given``: the run's shards are such leaves already (see [Note: the direct path] in
        :mod:`.direct`)."""
        self.fulls = [self.shards[i] if given else
                      self.shards[i].detach().requires_grad_(self.shards[i].requires_grad)
                      for i in self.idx]
        self.bases = list(self.fulls)
        self.written = [_compat.version(f) for f in self.fulls]
        self.move(S.ALIASED)

    def gather(self) -> tuple[torch.Tensor, ...]:
        """SHARDED | GATHERING -> GATHERED: the group's full tensors."""
        got = self._get(self.sharded)
        if self.bases is None:  # first gather in this micro-batch: fresh tensors
            self._adopt(got)
        self.held = 0
        self._hold(self.sharded)
        self.next_prefetched, self.to_regather = False, []
        self.move(S.GATHERED)
        return tuple(self.fulls)

    def _adopt(self, got: list[torch.Tensor]) -> None:
        """Take a first gather's tensors (and cast copies of the replicated leaves)."""
        bases: list = [None] * len(self.idx)
        fulls: list = [None] * len(self.idx)
        for k, t in zip(self.sharded, got):
            fulls[k] = t
            base = _compat.view_base(t)
            bases[k] = base if base is not None else t
        for k in self.replicated:
            i = self.idx[k]
            fulls[k] = bases[k] = self.shards[i].detach().to(self.params.dtypes[i], copy=True)
        self.bases, self.fulls = bases, fulls
        self.written = [_compat.version(f) for f in fulls]

    def _hold(self, leaves: list[int]) -> None:
        """``leaves`` are gathered: count their bytes, map their storages for the hooks."""
        for k in leaves:
            st = self.bases[k].untyped_storage()
            self.held += st.nbytes()
            if st.data_ptr():
                self.storage[st.data_ptr()] = (self, k)

    def regather(self) -> None:
        """PARTIAL | PARTIAL_GATHERING -> GATHERED: gather the leaves it owes."""
        self._get(self.to_regather)
        self._hold(self.to_regather)
        self.to_regather = []
        self.move(S.GATHERED)

    def finish_gather(self) -> None:
        """Finish a gather still in flight (it writes into the group's storages): its
        tensors are then full (GATHERED), or, for a first gather nobody used, dropped."""
        if self.pending is None:
            return
        self.pending.wait()
        self.pending = None
        self.to_regather = []
        self.move(S.GATHERED if self.bases is not None else S.SHARDED)

    # freeing -----------------------------------------------------------------------

    def check_unwritten(self) -> None:
        """No op wrote into a full tensor in place (``F.embedding(max_norm=)`` renormalizing
        its rows, a module clipping its own weight): the write went to the gathered copy and
        would be lost (on one rank with no cast it landed in the state). Refill in backward
        keeps the versions (:meth:`_refill`)."""
        for k, v in enumerate(self.written or ()):
            full = self.fulls[k]
            if full is not None and _compat.version(full) != v:
                raise in_place_error(self.params.layouts[self.idx[k]].path, "an in-place op",
                                     landed=self.aliased)

    def free_leaves(self, leaves: list[int]) -> None:
        """Free ``leaves`` of a GATHERED group (PARTIAL: gathered again on unpack)."""
        if self.pinned and not self.ended:
            return
        self.check_unwritten()
        leaves = [k for k in leaves if self.bases[k] is not None]
        kept = self._held(leaves)
        for k in leaves:
            st = self.bases[k].untyped_storage()
            self.storage.pop(st.data_ptr(), None)
            self.held -= st.nbytes()
            if k not in kept:
                st.resize_(0)
            # owed: autograd will want it back, or a recompute reads it (its saved tensors
            # bypass the step's hooks), so GATHERED always means every leaf is full
            self.to_regather.append(k)
        if self.to_regather:
            self.move(S.PARTIAL)

    def free(self) -> None:
        """Resident -> SHARDED: gathered storages resized to 0 bytes, but held ones ([Note:
        rank-independent freeing]); ALIASED and pinned groups stay."""
        if self.state is S.ALIASED:
            self.check_unwritten()
        if self.state in (S.SHARDED, S.GATHERING, S.ALIASED):
            return
        if self.state is S.PARTIAL_GATHERING:  # leaves on their way into its storages
            self.finish_gather()
        if self.pinned and not self.ended:
            return  # the caller's hooks may hold its storages (the same on every rank)
        self.check_unwritten()
        kept = self._held(range(len(self.idx)))
        for k in self.sharded:
            if self.bases[k] is not None:
                st = self.bases[k].untyped_storage()
                self.storage.pop(st.data_ptr(), None)
                if k not in kept:
                    st.resize_(0)
        self.held, self.to_regather = 0, []
        self.move(S.SHARDED)

    def _held(self, leaves) -> set[int]:
        """Of ``leaves``, those whose storage stays when the group is freed: held by anything
        but the group and autograd's saved copies not yet unpacked (a profiler, a view, a
        checkpoint region's recompute, whose own saved tensors the step's hooks never see
        and which may keep a leaf backward handed it past its node). Counted on the storage:
        its references beyond the group's tensors and the saved copies."""
        held = set()
        for k in leaves:
            full, base = self.fulls[k], self.bases[k]
            if full is None:
                continue
            known = 1 + (base is not full) + self.saved[k] - self.bare[k]
            if _compat.tensor_refs(full) > 1 or (base is not None
                                                 and _compat.storage_refs(base) > known):
                held.add(k)
        return held

    def release_leaf(self, k: int) -> None:
        """Backward has unpacked every saved copy of leaf ``k``: let go of it.

        Its storage is not resized (the node unpacking it is still computing with it): the
        group drops its own references, so the storage is freed with autograd's last one,
        when that node's saved tensors are released. A stray later unpack still holds it.
        """
        b = self.bases[k]
        if b is None or self.state is S.ALIASED:
            return
        self.storage.pop(b.untyped_storage().data_ptr(), None)
        self.held -= b.untyped_storage().nbytes()
        self.bases[k] = self.fulls[k] = None

    def release(self) -> None:
        """Drop every tensor (see [Note: a group's life] on the autograd cycle)."""
        for k, stand in enumerate(self.stands or ()):
            if isinstance(stand, LazyParam):  # one that escaped loss_fn: inert from now on
                stand._run, stand._gi = None, self.params.layouts[self.idx[k]].path
        self.stands = None
        self.fulls = self.bases = self.grads = self.pending = None
        self.shards = []
