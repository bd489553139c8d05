"""The direct exchange: a bucket moves as point-to-point messages, all posted at once (gloo).

gloo's own all-gather and reduce-scatter cost 2-3x a plain exchange of the same bytes on
one machine: for a 12.6 MB bucket on 2 ranks, all_gather_single took 9-11 ms,
reduce_scatter_single 15-17 ms, and isend/irecv of the 6.3 MB halves 4.7-5.1 ms. So:

- all-gather: each leaf's rows go from their rank straight into every other rank's full
  (padded) tensor: no flat buffer to copy out of, no second copy of the group alive;
- reduce-scatter: each rank sends every peer that peer's segment of the flat reduce input
  (or, from leaves, that peer's rows straight from each gradient) and sums what arrives
  into its own.

A message's buffer is held until ``wait``: gloo's point-to-point works cannot tell when
they are done. Messages between two ranks match in the order both post them. Each rank
sends (world - 1) / world of the bytes, as a ring does. Every exchange is one logical
collective, announced by :func:`funshard.collectives.base.announce`.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..layout import byte_plan
from .base import Gathered, Transport, announce, new_padded

TAGS = {"all_gather": 0x6653_0001, "reduce_scatter": 0x6653_0002}
_TAG_SET = frozenset(TAGS.values())


def is_direct_message(opname: str, args) -> bool:
    """A c10d ``send`` / ``recv_`` that belongs to a direct exchange (counted by its marker)."""
    return opname in ("send", "recv_") and len(args) > 3 and args[3] in _TAG_SET


class Exchange:
    """The messages of one direct exchange: ``wait`` finishes them, then runs ``then`` (the
    reduce-scatter's sum). Holds its buffers until then."""

    def __init__(self, works, then=None, keep=()):
        self.works, self.then, self.keep = works, then, keep

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()
        self.works, self.then, self.keep = [], None, ()


def _landing(out: torch.Tensor, world: int, seg: int) -> torch.Tensor:
    """Where peers' rows arrive: 2 ranks receive straight into ``out``; more need one
    landing row per peer, summed into ``out`` at the end."""
    return out.view(1, -1) if world == 2 else out.new_empty(world - 1, seg)


def _sum_landed(out: torch.Tensor, land: torch.Tensor, world: int) -> None:
    if world > 2:
        torch.sum(land, 0, out=out)
    elif world == 1:  # no peer wrote it (collectives forced on one rank): start from zero
        out.zero_()


def own_rows(layouts, shards, dtypes, into, device, world: int):
    """A direct all-gather's start: the padded full tensors (``into()`` or new), this rank's
    rows copied into them (cast to the gather dtype), the exchange announced. Returns
    ``(byte plan, padded, own rows)``."""
    bp = byte_plan(layouts, dtypes)
    padded = list(into()) if into is not None else new_padded(layouts, dtypes, device)
    own = [p[lay.start : lay.start + lay.local_rows] for p, lay in zip(padded, layouts)]
    have = [i for i in bp.order if layouts[i].local_rows]
    if have:  # casts to the gather dtype on the way in
        _compat.foreach_copy_([own[i] for i in have], [shards[i] for i in have])
    nbytes = world * bp.segment
    announce("all_gather", padded[bp.order[0]], nbytes, nbytes)
    return bp, padded, own


class P2P(Transport):
    name = "p2p"
    borrows = True

    def all_gather(self, layouts, shards, dtypes, pg, into, device, async_op) -> Gathered:
        """This rank's rows into its own full tensors, then every leaf's rows to and from
        every peer."""
        world, rank = pg.size(), pg.rank()
        bp, padded, own = own_rows(layouts, shards, dtypes, into, device, world)
        tag, works = TAGS["all_gather"], []
        for peer in (p for p in range(world) if p != rank):
            for i in bp.order:
                lay = layouts[i]
                if lay.local_rows:
                    works.append(pg.send([own[i]], peer, tag))
                n = lay.rows_on(peer)
                if n:
                    works.append(pg.recv([padded[i][peer * lay.chunk : peer * lay.chunk + n]],
                                         peer, tag))
        work = Exchange(works, keep=(padded,))
        if not async_op:
            work.wait()
        return Gathered(work if async_op else None, lambda: padded, layouts)

    def reduce_scatter(self, out, inp, pg):
        world, rank = pg.size(), pg.rank()
        nbytes = inp.numel() * inp.element_size()
        announce("reduce_scatter", out, nbytes, nbytes // world)
        land = _landing(out, world, inp.shape[1])
        tag, works = TAGS["reduce_scatter"], []
        for i, peer in enumerate(p for p in range(world) if p != rank):
            works.append(pg.send([inp[peer]], peer, tag))
            works.append(pg.recv([land[i]], peer, tag))

        def then():
            _sum_landed(out, land, world)
            out.add_(inp[rank])

        return Exchange(works, then, keep=(inp, land))

    def reduce_scatter_leaves(self, out, grads, layouts, offsets, pg):
        world, rank = pg.size(), pg.rank()
        seg = out.numel()
        nbytes = world * seg * out.element_size()
        announce("reduce_scatter", out, nbytes, nbytes // world)
        land = _landing(out, world, seg)
        leaves = [j for j, lay in enumerate(layouts) if lay.sharded and lay.padded_numel]
        need = max((layouts[j].rows_on(p) * layouts[j].row_numel for j in leaves
                    for p in range(world) if grads[j] is None), default=0)
        zeros = out.new_zeros(need) if need else None  # what a leaf never put sends
        tag, works = TAGS["reduce_scatter"], []
        for i, peer in enumerate(p for p in range(world) if p != rank):
            for j in leaves:
                lay, g, off = layouts[j], grads[j], offsets[j]
                n = lay.rows_on(peer)
                if n:
                    src = (g[peer * lay.chunk : peer * lay.chunk + n] if g is not None
                           else zeros[: n * lay.row_numel])
                    works.append(pg.send([src], peer, tag))
                n = lay.rows_on(rank)
                if n:
                    works.append(pg.recv([land[i, off : off + n * lay.row_numel]], peer, tag))

        def then():
            _sum_landed(out, land, world)
            _add_own_rows(out, grads, layouts, offsets, leaves, rank)

        return Exchange(works, then, keep=(grads, land, zeros))


def _add_own_rows(out, grads, layouts, offsets, leaves, rank) -> None:
    """Add this rank's own rows of each gradient to what peers sent; zero the padding."""
    for j in leaves:
        lay, g, off = layouts[j], grads[j], offsets[j]
        n = lay.rows_on(rank)
        mine = out[off : off + n * lay.row_numel].view(n, lay.row_numel)
        if n and g is not None:
            mine.add_(g[rank * lay.chunk : rank * lay.chunk + n])
        if n < lay.chunk:  # padding rows
            out[off + n * lay.row_numel : off + lay.padded_numel].zero_()
