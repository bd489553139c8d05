"""The compiled step's copies around a gather (``funshard.step.packing``): a group's shards
packed per rank and gathered, then unpacked, give back the full leaves (and packed in place,
each rank's segment of the gathered buffer); ``lay`` is ``unpack``'s transpose; both
operators' gradients are what autograd gives the same copies written with ``torch.cat`` and
slices, the pack's divided by its ``divide``."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funshard.step import packing


@st.composite
def groups(draw):
    world = draw(st.integers(1, 4))
    shapes = draw(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 3)), min_size=1,
                           max_size=4))
    shapes = [s if draw(st.booleans()) else s[:1] for s in shapes]
    return world, [list(s) for s in shapes if s[0] > 0] or [[1]]


def _shard(f, world, r):
    """Rank ``r``'s rows of ``f``, as ``torch.chunk`` gives them (maybe none)."""
    c = -(-f.shape[0] // world)
    return f[c * r:c * (r + 1)]


def _layout(world, shapes):
    """Per leaf: chunk rows, padded numel per rank, padded shape, rows (torch.chunk's)."""
    out = []
    for s in shapes:
        chunk = -(-s[0] // world)
        cols = 1
        for d in s[1:]:
            cols *= d
        out.append((chunk * cols, [world * chunk, *s[1:]], s[0]))
    return out


@settings(max_examples=60, deadline=None)
@given(groups(), st.sampled_from([torch.float32, torch.float64]))
def test_pack_gather_unpack_is_the_identity_and_lay_its_transpose(group, dtype):
    world, shapes = group
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    lay = _layout(world, shapes)
    numels = [n for n, _, _ in lay]
    dims = [d for _, shape, _ in lay for d in shape]
    ndims = [len(shape) for _, shape, _ in lay]
    rows = [r for _, _, r in lay]
    per_rank = [packing.pack([_shard(f, world, r) for f in full], numels, dtype, 1, r, None)
                for r in range(world)]
    gathered = torch.cat(per_rank)
    # pack_into (a gather in place): rank r's pack, at its segment of the gathered buffer
    n = sum(numels)
    for r in range(world):
        into = packing.pack_into([_shard(f, world, r) for f in full], numels, dtype, world, r)
        assert into.shape == gathered.shape and torch.equal(into[r * n:(r + 1) * n],
                                                            per_rank[r])
    back = packing.unpack(gathered, world, numels, dims, ndims, rows, torch.float64)
    assert all(torch.equal(a, b.to(dtype).double()) for a, b in zip(back, full))
    # <unpack(x), y> == <x, lay(y)>: lay is unpack's transpose
    ys = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    x = torch.randn(gathered.shape, generator=g, dtype=torch.float64)
    lhs = sum((u * y).sum() for u, y in
              zip(packing.unpack(x, world, numels, dims, ndims, rows, torch.float64), ys))
    rhs = (x * packing.lay(ys, world, numels, dims, ndims, rows, torch.float64)).sum()
    assert torch.allclose(lhs, rhs), (lhs, rhs)


def test_the_operators_gradients_are_autograds_of_the_plain_copies():
    torch.manual_seed(0)
    shards = [torch.randn(3, 2, requires_grad=True), torch.randn(1, requires_grad=True)]
    flat = packing.pack(shards, [6, 2], torch.float32, 1, 0, None)
    w = torch.randn(8)
    (gs,) = torch.autograd.grad((flat * w).sum(), [shards[0]])
    assert torch.equal(gs, w[:6].view(3, 2))
    # divide: the mean of the reduce-scatter's sum, taken on the gradient before the cut
    flat = packing.pack(shards, [6, 2], torch.float32, 4, 0, None)
    (gs,) = torch.autograd.grad((flat * w).sum(), [shards[0]])
    assert torch.equal(gs, (w / 4)[:6].view(3, 2))
    gathered = torch.randn(2 * 7, requires_grad=True)  # world 2: leaves (6, 2) and (2,)
    outs = packing.unpack(gathered, 2, [6, 1], [6, 2, 2], [2, 1], [5, 2], torch.float32)
    assert [tuple(o.shape) for o in outs] == [(5, 2), (2,)]
    ys = [torch.randn(5, 2), torch.randn(2)]
    (gg,) = torch.autograd.grad(sum((o * y).sum() for o, y in zip(outs, ys)), [gathered])
    seg = gathered.detach().view(2, 7)
    plain = seg.detach().clone().requires_grad_()
    ref = [plain[:, :6].reshape(6, 2)[:5], plain[:, 6:].reshape(2)]
    (gr,) = torch.autograd.grad(sum((o * y).sum() for o, y in zip(ref, ys)), [plain])
    assert torch.equal(gg, gr.view(-1))
