"""The cross-memory transport: ranks on one host read each other's CPU tensors directly,
over the links of :mod:`.cma_link` ([Note: cross-memory exchange] there says how and why).

    >>> CMA().all_gather(layouts, shards, dtypes, pg, None, device, async_op=True).wait()
"""

from __future__ import annotations

import torch

from .base import Gathered, Transport, announce
from .cma_link import link_of
from .p2p import _add_own_rows, _landing, _sum_landed, own_rows


def _plain(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype`` (what a peer reads by address)."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


class CMA(Transport):
    name = "cma"
    borrows = True

    def all_gather(self, layouts, shards, dtypes, pg, into, device, async_op) -> Gathered:
        """This rank's rows into its own full tensors; each peer's rows read from its."""
        link, world = link_of(pg), pg.size()
        bp, padded, _ = own_rows(layouts, shards, dtypes, into, device, world)
        nbytes, order = world * bp.segment, bp.order

        def plan(peer, words):
            reads = []
            for w, i in zip(words, order):
                lay, n = layouts[i], layouts[i].rows_on(peer)
                if n:
                    rb = lay.row_numel * padded[i].element_size()
                    off = peer * lay.chunk * rb
                    reads.append((padded[i].data_ptr() + off, w + off, n * rb))
            return reads, ()

        ex = link.post("all-gather", nbytes, [padded[i].data_ptr() for i in order], plan,
                       keep=(padded,))
        if not async_op:
            ex.wait()
        return Gathered(ex if async_op else None, lambda: padded, layouts)

    def reduce_scatter(self, out, inp, pg):
        link, world, rank = link_of(pg), pg.size(), pg.rank()
        nbytes = inp.numel() * inp.element_size()
        announce("reduce_scatter", out, nbytes, nbytes // world)
        inp = _plain(inp, out.dtype)
        land = _landing(out, world, inp.shape[1])
        seg = inp.shape[1] * inp.element_size()
        where = {p: i for i, p in enumerate(link.peers)}

        def plan(peer, words):
            return ([(land[where[peer]].data_ptr(), words[0] + rank * seg, seg)] if seg
                    else []), ()

        def then():
            _sum_landed(out, land, world)
            out.add_(inp[rank])

        return link.post("reduce-scatter", nbytes, [inp.data_ptr()], plan, then,
                         keep=(inp, land))

    def reduce_scatter_leaves(self, out, grads, layouts, offsets, pg):
        link, world, rank = link_of(pg), pg.size(), pg.rank()
        seg, es = out.numel(), out.element_size()
        nbytes = world * seg * es
        announce("reduce_scatter", out, nbytes, nbytes // world)
        land = _landing(out, world, seg)
        leaves = [j for j, lay in enumerate(layouts) if lay.sharded and lay.padded_numel]
        mine = [None if grads[j] is None else _plain(grads[j], out.dtype) for j in leaves]
        where = {p: i for i, p in enumerate(link.peers)}

        def plan(peer, words):
            reads, zeros, i = [], [], where[peer]
            for w, j in zip(words, leaves):
                lay = layouts[j]
                n = lay.rows_on(rank) * lay.row_numel
                if not n:
                    continue
                dst = land[i, offsets[j] : offsets[j] + n]
                if w:
                    reads.append((dst.data_ptr(), w + rank * lay.chunk * lay.row_numel * es,
                                  n * es))
                else:  # the peer has no gradient for this leaf: zeros
                    zeros.append(dst)
            return reads, zeros

        def then():
            _sum_landed(out, land, world)
            _add_own_rows(out, grads, layouts, offsets, leaves, rank)

        return link.post("reduce-scatter from leaves", nbytes,
                         [0 if g is None else g.data_ptr() for g in mine], plan, then,
                         keep=(mine, land))

    def all_to_all(self, out, inp, out_sizes, in_sizes, pg):
        """``dist.all_to_all_single(out, inp, out_sizes, in_sizes)``: each peer's part for
        this rank read from its input. The logical size differs per rank, so it is checked
        per part."""
        link, rank = link_of(pg), pg.rank()
        es = inp.element_size()
        announce("all_to_all", out, out.numel() * es, out.numel() * es)
        inp = _plain(inp, out.dtype)
        sent, got = [0], [0]
        for a, b in zip(in_sizes, out_sizes):
            sent.append(sent[-1] + a * es)
            got.append(got[-1] + b * es)
        out.view(-1).narrow(0, got[rank] // es, out_sizes[rank]).copy_(
            inp.view(-1).narrow(0, sent[rank] // es, in_sizes[rank]))

        def plan(peer, words):
            lo, hi = words[1 + rank], words[2 + rank]
            if hi - lo != out_sizes[peer] * es:
                raise RuntimeError(
                    f"funshard: all-to-all sizes differ: rank {peer} sends {hi - lo} bytes to "
                    f"rank {rank}, which expects {out_sizes[peer] * es}")
            return ([(out.data_ptr() + got[peer], words[0] + lo, hi - lo)] if hi > lo
                    else []), ()

        return link.post("all-to-all", 0, [inp.data_ptr(), *sent], plan, keep=(inp, out))
