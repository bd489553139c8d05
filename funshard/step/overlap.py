"""The compiled step's collectives overlapped with its compute: a pass over inductor's
post-grad graph that issues each all-gather a group earlier, waits on each reduction a
group later, reduces CPU tensors by an all-reduce in place, and gathers in place.

[Note: overlap by program order] Traced, the step's program issues each group's all-gather
where the group's module begins and waits on it at once (its first use follows), and waits
on each group's reduce-scatter as soon as it is issued: no collective runs while compute
does. This pass, over the graph inductor lowers (``post_grad_custom_post_pass``), moves:

- **each all-gather** (with what packs its input from the shards) to just after the
  previous all-gather's wait: it runs while the previous group computes, and its own wait
  stays where its group first uses it, so at most two groups are gathered at a time, as
  the eager step and FSDP2 prefetch one group ahead. So in backward (FULL_SHARD: each
  group gathered again) too, but for its first gather, which stays in backward: moved, it
  would be issued in forward, the last group gathered twice over the loss.
- **each reduction's wait** (reduce-scatter; all-reduce), with the views of its result, the
  mean's division and the copy of this rank's part, to just before the next gradient
  buffer is laid out (:func:`funshard.step.packing.lay`) or its first use, whichever comes
  first: the reduction runs while the next group's backward computes (its gather again
  included), and at most one is in flight. NCCL runs it on its own stream; gloo on its
  own threads.

[Note: reductions on the CPU] gloo's reduce-scatter is an all-reduce of a copy of its
input, then a copy of this rank's part. With a reduction in flight for a group, that copy
of the whole gradient buffer lived beside the next group's gather and its own temporary:
moved a group later, the waits cost shape B 67 MiB of in-step peak (323 MiB against 256),
so the CPU's program used to wait on each reduction where it issued it. Now each
reduce-scatter of CPU tensors is rewritten as an all-reduce of the gradient buffer itself
(inductor makes it ``all_reduce_``, in place: the buffer is used by nothing else) and a
copy of this rank's part, fused with the mean's division: the same sums, bit for bit (the
same gloo all-reduce over the same buffer), one copy of the buffer fewer, and the waits
move as on a GPU. Measured side by side, 2 gloo ranks, against the eager step in the same
run (``benchmarks/results/2026-11-29-cpu-reductions-in-place.md``): shape B 0.888x its time
and 0.976x its memory, where the reduce-scatters, each waited at once, read 0.97-1.13x
across runs; A 0.940x (1.004x memory); C 0.975x (1.014x). The GPU keeps its reduce-scatters
(NCCL's moves half an all-reduce's bytes): ``FxPass(scatter_on_cpu=True)`` keeps them on
the CPU too, as the tests check the GPU's program there.

Then each all-gather of a pack gathers **in place**, as the eager step's c10d transport
does: the shards are packed into this rank's segment of the gathered buffer
(:func:`funshard.step.packing.pack_into`), which is the collective's input and output
(``all_gather_into_tensor_out``, as inductor's own bucketing emits it): no separate input
buffer is made and held while the gather is in flight. (Where torch lacks that operator,
the gathers keep their input: :data:`funshard._compat.GATHER_OUT`.)

Backward's gathers were left where they were while gloo's reduce-scatter copied its input:
moved, they cost shape B 415 MiB in the step against 384, the copy in flight beside the
next group's gather. With the reductions in place ([Note: reductions on the CPU]), moved
and kept in place were measured side by side, 2 gloo ranks
(``benchmarks/results/2026-11-29-cpu-backward-prefetch.md``): B 0.866x the eager step
against 0.983x; A and C within this machine's noise either way (A 0.878x against 0.798x,
C 0.999x against 0.981x); memory 1.05x the eager step's on A and B against 1.00x (one group
more, within the 10% bound). An earlier run that moved backward's first gather too (into
forward) read B 0.910x against 0.978x, A 0.820x against 0.908x, C 0.979x against 1.017x.
Kept: a gain where the step is its collectives, and FSDP2's order (it prefetches in
backward too). Inductor chains the collectives in the order of this graph (each issued
after the waits before it), so the order set here is the order every rank issues them in.
Its scheduler's reordering for peak memory (``reorder_for_peak_memory``) would move each
gather back next to its use and each reduction's wait next to its issue, so the program is
compiled with it off (beneath the caller's options:
``compile={"options": {"reorder_for_peak_memory": True}}`` gives back inductor's
memory-first order).

Inductor's own passes that move collectives (``reorder_for_compute_comm_overlap``) were
measured before (``2026-11-26-cpu-compiled-step.md``): they issued every forward gather at
the program's start and hoisted recomputed gathers into forward, undoing the memory bound.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import _compat
from . import packing

_C10D = _compat.C10D_OPS  # (empty where this torch lacks them: the compiled step refuses)
GATHER = _C10D.get("all_gather_into_tensor")
REDUCTIONS = (_C10D.get("reduce_scatter_tensor"), _C10D.get("all_reduce"))
WAIT = _C10D.get("wait_tensor")
DIVIDE = (torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar)  # the mean (packing.pack)
# what a reduction's wait carries along when moved: the mean, this rank's part's copy
CARRIED = (*DIVIDE, torch.ops.aten.clone.default)
LAY = packing.LAY
COLLECTIVES = (GATHER, WAIT, *REDUCTIONS)


def _wait_of(node: fx.Node) -> fx.Node | None:
    """The wait on the collective ``node``."""
    return next((u for u in node.users if u.target is WAIT), None)


def _ancestors(node: fx.Node, after: set) -> set:
    """``node``'s inputs, transitively, among ``after``."""
    out, todo = set(), [node]
    while todo:
        for x in todo.pop().all_input_nodes:
            if x in after and x not in out:
                out.add(x)
                todo.append(x)
    return out


def _upstream(node: fx.Node):
    """``node``'s inputs, transitively, each once, nearest first."""
    todo, seen = [node], {node}
    while todo:
        for x in todo.pop(0).all_input_nodes:
            if x not in seen:
                seen.add(x)
                todo.append(x)
                yield x


def _shards(node: fx.Node) -> frozenset:
    """The graph inputs a gather reads through what packs them (its group's shards)."""
    return frozenset(x for x in _upstream(node) if x.op == "placeholder")


def raise_gathers(items: list) -> int:
    """Each all-gather (with what packs its input) moved to just after the previous one's
    wait, but backward's first (a group gathered again), which stays in backward; returns
    how many."""
    moved, gathered, prev, again = 0, set(), None, False
    for ag in [x for x in items if x.target is GATHER]:
        key = _shards(ag)
        first = key in gathered and not again  # backward's first gather
        again = again or first
        gathered.add(key)
        target, prev = (None if first else prev), _wait_of(ag)
        if target is None or prev is None:
            continue
        t, at = items.index(target), items.index(ag)
        if t > at:
            continue
        lift = _ancestors(ag, set(items[t + 1:at]))
        if any(x.target in COLLECTIVES for x in lift):
            continue
        lifted = [x for x in items[t + 1:at] if x in lift] + [ag]
        rest = [x for x in items[t + 1:at] if x not in lift]
        items[t + 1:at + 1] = lifted + rest
        moved += 1
    return moved


def sink_waits(items: list) -> int:
    """Each reduction's wait, with the views of its result, the mean's division and the
    copy of this rank's part, moved to just before the next gradient buffer's layout or
    the first other node that reads its result, whichever comes first (never past the
    output); returns how many moved."""
    moved = 0
    for red in [x for x in items if x.target in REDUCTIONS]:
        wait = _wait_of(red)
        if wait is not None:
            moved += _sink(items, items.index(wait))
    return moved


def _device(node: fx.Node) -> str | None:
    val = node.meta.get("val")
    return val.device.type if isinstance(val, torch.Tensor) else None


def _sink(items: list, at: int) -> int:
    wait = items[at]
    reads, views, passed, stop = {wait}, [], [], len(items)
    for j in range(at + 1, len(items)):
        x = items[j]
        if x.op == "output" or x.target is LAY:
            stop = j
            break
        if not any(i in reads for i in x.all_input_nodes):
            passed.append(x)
        elif getattr(x.target, "is_view", False) or x.target in CARRIED:  # (moved with it)
            views.append(x)
            reads.add(x)
        else:
            stop = j
            break
    if not passed:
        return 0
    items[at:stop] = [*passed, wait, *views]
    return 1


def gather_in_place(graph: fx.Graph) -> int:
    """Each all-gather of a pack (used by nothing else) made to gather in place, as the
    eager step's c10d transport does: the shards packed into this rank's segment of the
    gathered buffer (:func:`~funshard.step.packing.pack_into`), which is the collective's
    input and output (``all_gather_into_tensor_out``, as inductor's own bucketing emits
    it), so no separate input buffer is made and held per gather; returns how many. A
    pack of symbolic sizes (``dynamic=True``) keeps its gather as traced."""
    if _compat.GATHER_OUT is None:
        return 0
    done = 0
    for ag in [x for x in graph.nodes if x.target is GATHER]:
        packed, world, group = ag.args
        if getattr(packed, "target", None) is not packing.PACK or len(packed.users) != 1:
            continue
        shards, numels, dtype, _, rank, _ = packed.args
        if not all(type(x) is int for x in numels):  # a symbolic size (dynamic=True): kept
            continue
        val, n = ag.meta["val"], sum(numels)
        with graph.inserting_before(packed):
            buf = graph.call_function(packing.PACK_INTO, (shards, numels, dtype, world, rank))
            seg = graph.call_function(torch.ops.aten.slice.Tensor,
                                      (buf, 0, rank * n, (rank + 1) * n))
        with graph.inserting_before(ag):
            out = graph.call_function(_compat.GATHER_OUT, (seg, world, group), {"out": buf})
        buf.meta["val"] = out.meta["val"] = val
        seg.meta["val"] = val.narrow(0, rank * n, n)
        ag.replace_all_uses_with(out)
        graph.erase_node(ag)
        graph.erase_node(packed)
        done += 1
    return done


def _pack_of(node: fx.Node) -> fx.Node | None:
    """The pack an all-gather's input comes from (through a cast, a view), or None."""
    return next((x for x in _upstream(node) if x.target is packing.PACK), None)


def _ranks(graph: fx.Graph) -> dict:
    """This rank's place in each process group a pack's all-gather runs on (by name)."""
    out = {}
    for ag in graph.nodes:
        if ag.target is GATHER and ag.args[2] not in out:
            pack = _pack_of(ag)
            if pack is not None:
                out[ag.args[2]] = pack.args[4]
    return out


def reduce_by_all_reduce(graph: fx.Graph) -> int:
    """Each reduce-scatter of CPU tensors made an all-reduce of its input, in place, and
    a copy of this rank's part: what gloo's reduce-scatter does, without its copy of the
    whole input ([Note: reductions on the CPU]); returns how many."""
    ranks, done = _ranks(graph), 0
    for red in [x for x in graph.nodes if x.target is REDUCTIONS[0]]:
        inp, op, _, name = red.args
        wait = _wait_of(red)
        n = red.meta["val"].shape[0]  # this rank's rows (a complex leaf's: real pairs)
        if wait is None or name not in ranks or _device(red) != "cpu" or type(n) is not int:
            continue  # (no wait, no pack on its group, a GPU's, a symbolic size: kept)
        r, val = ranks[name], inp.meta["val"]
        with graph.inserting_before(red):
            ar = graph.call_function(REDUCTIONS[1], (inp, op, name))
        ar.meta["val"] = val
        wait.replace_input_with(red, ar)
        wait.meta["val"] = val
        with graph.inserting_after(wait):
            part = graph.call_function(torch.ops.aten.slice.Tensor, (wait, 0, r * n,
                                                                      (r + 1) * n))
        with graph.inserting_after(part):
            mine = graph.call_function(torch.ops.aten.clone.default, (part,))
        part.meta["val"] = val.narrow(0, r * n, n)
        mine.meta["val"] = red.meta["val"]
        wait.replace_all_uses_with(mine, delete_user_cb=lambda u: u is not part)
        graph.erase_node(red)
        done += 1
    return done


def fx_pass(graph: fx.Graph, scatter_on_cpu: bool = False) -> None:
    """The pass over the post-grad graph: the order inductor lowers, and in which it
    chains the collectives (each issued after the waits before it). ``scatter_on_cpu``:
    reduce-scatters of CPU tensors kept as they are (the GPU's collectives)."""
    if not scatter_on_cpu:
        reduce_by_all_reduce(graph)
    items = list(graph.nodes)
    raise_gathers(items)
    sink_waits(items)
    at = None
    for n in items:
        if at is not None and n.prev is not at:
            at.append(n)
        at = n
    gather_in_place(graph)
    graph.lint()


class PassFailed(RuntimeError):
    """:func:`fx_pass` failed on a program: funshard's bug, not the model's (the compiled
    step says so, where dynamo reports it as a loss it could not compile)."""

    @property
    def why(self) -> str:
        return (f"funshard's pass over inductor's program failed ({self}), a funshard bug: "
                "please report it with the model and Policy")

    hint = ("compile={'options': {'post_grad_custom_post_pass': None}} compiles without the "
            "pass; compile={'fallback': 'eager'} runs such a program eagerly.")


def failure_in(e: BaseException | None) -> PassFailed | None:
    """The pass's own failure behind dynamo's exception ``e``, if that is what failed."""
    todo, seen = [e], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, PassFailed):
            return e
        seen.add(id(e))
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return None


class FxPass(_compat.CustomGraphPass or object):
    """:func:`fx_pass` as inductor's custom post-grad pass (its cache key: this file and
    ``scatter_on_cpu``)."""

    def __init__(self, scatter_on_cpu: bool = False):
        self.scatter_on_cpu = scatter_on_cpu

    def __call__(self, graph: fx.Graph) -> None:
        try:
            fx_pass(graph, self.scatter_on_cpu)
        except Exception as e:  # noqa: BLE001 - named as the pass's, the cause chained
            raise PassFailed(f"{type(e).__name__}: {e}") from e

    def uuid(self) -> str:
        import hashlib
        from pathlib import Path

        key = Path(__file__).read_bytes() + bytes([self.scatter_on_cpu])
        return hashlib.sha256(key).hexdigest()


# inductor's options the compiled step's programs are compiled under, beneath the caller's
# own: the pass, and inductor's reordering for peak memory off (it would put each gather back
# next to its use and each reduction's wait next to its issue)
OPTIONS = {"post_grad_custom_post_pass": FxPass(), "reorder_for_peak_memory": False}
