"""What every transport shares: the interface, timeouts, and the marker counters count.

A transport moves the bytes of one bucket: an all-gather of every rank's shards into full
tensors, a reduce-scatter of every rank's gradients into this rank's rows. Which one a call
uses is explicit (``transport=`` on the bucket calls, ``Policy(transport=)`` for the step):

- ``"c10d"`` (:mod:`funshard.collectives.c10d`, the default on every backend): the backend's
  own collectives, NCCL on GPUs, gloo on CPUs;
- ``"p2p"`` (:mod:`funshard.collectives.p2p`, opt-in, gloo CPU groups only): a direct
  exchange of point-to-point messages, a third to a half of gloo's collectives' time for the
  same bytes on one host;
- ``"cma"`` (:mod:`funshard.collectives.cma`, opt-in, gloo CPU ranks of one x86-64 Linux
  host only): ranks read each other's CPU tensors straight from memory (cross-memory
  attach), a seventh of a gloo message's time. **Security:** choosing it lets every process
  of the same user read this process's memory (``prctl(PR_SET_PTRACER,
  PR_SET_PTRACER_ANY)``, taken when the transport is first used on a group and never
  undone); ``FUNSHARD_CMA=0`` makes a rank refuse it (the group then raises, by name).

The library never picks a transport of its own: one the caller did not name never runs.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..layout import Layout
from ..mesh import mesh_str
from . import calls, failures
from .failures import CollectiveTimeout

TRANSPORTS = ("c10d", "p2p", "cma")

# A world of one needs no collective, and the step, the reductions and the clip skip them.
# FUNSHARD_FORCE_COLLECTIVES=1 (or :func:`force_collectives`) runs them all the same, over
# one rank: how the CUDA test lane exercises NCCL and the collective paths on one GPU.
_FORCED = [os.environ.get("FUNSHARD_FORCE_COLLECTIVES", "") == "1"]


def skips(world: int) -> bool:
    """Whether a group of ``world`` ranks skips its collectives (a world of one, not forced)."""
    return world == 1 and not _FORCED[0]


@contextlib.contextmanager
def force_collectives(on: bool = True):
    """Within: a world of one runs every collective it would otherwise skip (tests)."""
    before, _FORCED[0] = _FORCED[0], on
    try:
        yield
    finally:
        _FORCED[0] = before


@contextlib.contextmanager
def watch(kind: str, mesh: DeviceMesh | None, dim: str | None = None,
          since: float | None = None):
    """Turn a backend's failure into an error that says what happened: :class:`RankFailed`
    when another rank's exception caused it (see :mod:`funshard.collectives.failures`), else a
    :class:`CollectiveTimeout`, a refusal every rank met alike (``CollectiveRefused``), or a
    lost peer, each saying what to do. ``since``: when the
    collective waited on inside was issued (``time.monotonic()``; default: now), which tells
    a timeout from a lost peer (:func:`failures.timed_out`)."""
    since = time.monotonic() if since is None else since
    try:
        yield
    except RuntimeError as e:
        if not failures.is_comm_failure(e):
            raise
        where = kind + (f" on mesh dimension {dim!r}" if dim else "") + (
            f" of {mesh_str(mesh)}" if mesh is not None else "")
        failed = failures.explain(e, where)
        if failed is not None:
            raise failed from e
        late = failures.timed_out(since)
        seen = calls.positions(where, wait=1.5 if late else 1.0)
        text, differ = str(e), calls.differ(where, seen=seen)
        if not late and calls.all_failed_here(seen):
            raise failures.CollectiveRefused(failures.refused(
                f"funshard: {where}", len(seen), text.strip()[:300])) from e
        if not late:
            raise failures.PeerLost(
                f"funshard: {where} failed on rank {dist.get_rank()}: another rank is gone (its "
                "process ended or closed the connection) without reporting an error through "
                f"funshard; see that rank's output.{differ} Backend said: "
                + text.strip()[:300]) from e
        raise CollectiveTimeout(
            f"funshard: {where} did not complete in time on rank {dist.get_rank()}: another "
            "rank is stuck, died, or issued a different collective (every rank must run the "
            "same ops on the same groups in the same order). The limit is make_mesh(timeout=...)."
            f"{differ} Backend said: {text.strip()[:300]}"
        ) from e


# Every logical collective a transport runs is announced by one ``funshard::collective``
# op, which the counters (fs.testing.CountCollectives, the benchmark) count instead of the
# messages a direct exchange is made of.
_LIB = torch.library.Library("funshard", "DEF")
_LIB.define("collective(Tensor anchor, str kind, int logical, int counted) -> ()")
_LIB.impl("collective", lambda anchor, kind, logical, counted: None, "CompositeExplicitAutograd")


def announce(kind: str, anchor: torch.Tensor, logical: int, counted: int) -> None:
    """One logical collective, for counters: ``logical`` bytes (all-gather output,
    reduce-scatter input) and ``counted`` (the c10d op's first argument: for a
    reduce-scatter, its output)."""
    torch.ops.funshard.collective(anchor, kind, logical, counted)


class Gathered:
    """An in-flight bucketed all-gather; :meth:`wait` returns the full tensors.

    ``work`` is what is in flight (None: done); ``finish()`` returns the padded full tensors
    once it is (copying out of a flat buffer, for a collective).
    """

    def __init__(self, work, finish: Callable[[], list[torch.Tensor]],
                 layouts: Sequence[Layout]):
        self._work, self._finish, self._layouts = work, finish, layouts
        self._since = time.monotonic()  # (made as the gather is issued: see watch)

    def wait(self) -> list[torch.Tensor]:
        """Finish the gather; return full tensors in ``layouts`` order (views ``[:rows]`` of
        the padded tensors)."""
        if self._work is not None:
            with watch("all-gather", None, since=self._since):
                self._work.wait()
            self._work = None
        with torch.no_grad():
            padded, self._finish = self._finish(), None
        return [p if p.shape[0] == lay.rows else p[: lay.rows]
                for p, lay in zip(padded, self._layouts)]


def new_padded(layouts: Sequence[Layout], dtypes: Sequence[torch.dtype],
               device: torch.device) -> list[torch.Tensor]:
    """Fresh padded full tensors for a gather to write into."""
    return [torch.empty(lay.padded_shape, dtype=dt, device=device)
            for lay, dt in zip(layouts, dtypes)]


class Transport:
    """How one bucket's bytes move. Subclasses: :class:`funshard.collectives.c10d.C10d`,
    :class:`funshard.collectives.p2p.P2P`, :class:`funshard.collectives.cma.CMA`.

    ``borrows``: the transport can reduce-scatter straight from each leaf's gradient
    (:meth:`reduce_scatter_leaves`) instead of from a flat ``(world, seg)`` input.
    """

    name = "base"
    borrows = False

    def all_gather(self, layouts, shards, dtypes, pg, into, device, async_op) -> Gathered:
        """Start gathering ``shards`` (sharded leaves) into padded full tensors (``into()``
        gives them, else new ones); ``pg`` is None for a world of one."""
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, pg):
        """Start summing every rank's ``inp[rank]`` (``inp``: (world, seg)) into ``out``;
        returns a work whose ``wait()`` finishes it."""
        raise NotImplementedError

    def reduce_scatter_leaves(self, out, grads, layouts, offsets, pg):
        """:meth:`reduce_scatter` from each leaf's (rows, row_numel) gradient (None: zeros);
        ``out`` holds each leaf's padded chunk at its offset. Only where ``borrows``."""
        raise NotImplementedError(f"transport {self.name!r} does not reduce from leaves")
