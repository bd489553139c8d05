"""The cross-memory transport (funshard.collectives.cma, .cma_link): what the handshake decides, a
queue that wraps its ring, and ranks that start different collectives.

Its numbers against gloo's collectives are tests/test_shard.py's exchange parity (property
test, 2, 3, 4 ranks and 2x2); the step on it is tests/test_device.py's and test_stand_ins.py's
``transport="cma"`` cases and :func:`test_the_step_on_each_transport` below. The transport is
opt-in: the ptrace permission it needs is taken only where a caller names it.
"""

import os

import torch
from hypothesis import given, strategies as st
import torch.distributed as dist

import funshard as fs
from funshard.collectives import cma, cma_link
from funshard.collectives.gather import choose
from funshard.layout import layout_of

CPU = torch.device("cpu")


def _fresh_group():
    """A new process group over every rank (a probe that breaks it breaks nothing else)."""
    return dist.new_group(list(range(dist.get_world_size())))


def choices(spec, opt_out_rank):
    """What "p2p" and "cma" become on a fresh group when one rank opts out (or none)."""
    before = os.environ.get("FUNSHARD_CMA")
    if dist.get_rank() == opt_out_rank:
        os.environ["FUNSHARD_CMA"] = "0"
    try:
        pg = _fresh_group()
        p2p = choose("p2p", pg, CPU).name
        try:
            explicit = choose("cma", pg, CPU).name
        except ValueError as e:
            explicit = f"ValueError: {e}"
        return p2p, explicit
    finally:
        if before is None:
            os.environ.pop("FUNSHARD_CMA", None)
        else:
            os.environ["FUNSHARD_CMA"] = before


def test_every_rank_of_a_group_makes_the_same_choice(pools):
    assert pools.run(2, choices, None) == [("p2p", "cma")] * 2
    for p2p, explicit in pools.run(2, choices, 1):  # one rank opted out: every rank refuses
        assert p2p == "p2p"
        assert explicit.startswith("ValueError: transport='cma' reads peers' memory"), explicit


def many_in_flight(spec, n, seed):
    """``n`` all-gathers and reduce-scatters in flight on one group (more than the ring
    holds), finished in reverse order: every result as gloo's own collectives give it."""
    from funshard.collectives import all_gather, reduce_scatter

    m = fs.make_mesh()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(5 + k % 3, 4, generator=g) for k in range(n)]
    shards = [fs.shard({"w": f}, m)["w"] for f in fulls]
    lays = [layout_of("w", s) for s in shards]
    grads = [torch.randn(f.shape, generator=g) * (rank + 1) for f in fulls]
    works = []
    for k in range(n):
        works.append(all_gather([lays[k]], [shards[k].to_local()], m, async_op=True,
                                transport="cma"))
        works.append(reduce_scatter([lays[k]], [grads[k]], m, async_op=True, transport="cma"))
    got = [w.wait() for w in reversed(works)][::-1]
    bad = []
    for k in range(n):
        (full,), (red,) = got[2 * k], got[2 * k + 1]
        want = reduce_scatter([lays[k]], [grads[k]], m, transport="c10d")
        if not torch.equal(full, fulls[k]):
            bad.append(f"gather {k}")
        if not torch.equal(red, want[0]):
            bad.append(f"reduce {k}")
    return bad


def test_more_exchanges_in_flight_than_the_ring_holds(pools):
    n = cma_link.RING // 2 + 8  # two exchanges each: the ring wraps
    assert pools.run(2, many_in_flight, n, 3) == [[], []]


def _error_of(start) -> str:
    """The message ``start(pg)`` raises on a fresh group, or "NO ERROR"."""
    pg = _fresh_group()
    try:
        start(pg)
    except RuntimeError as e:
        return str(e)
    finally:
        dist.destroy_process_group(pg)
    return "NO ERROR"


def different_collectives(spec):
    """Rank 0 starts an all-gather, rank 1 a reduce-scatter, on one group."""
    shard = fs.shard({"w": torch.ones(4, 3)}, fs.make_mesh())["w"]
    lay = layout_of("w", shard)

    def start(pg):
        if dist.get_rank() == 0:
            cma.CMA().all_gather([lay], [shard.to_local()], [torch.float32], pg, None, CPU,
                                 False)
        else:
            cma.CMA().reduce_scatter(torch.empty(2 * 3), torch.ones(2, 6), pg).wait()
    return _error_of(start)


def test_different_collectives_are_named_on_every_rank(pools):
    for rank, msg in enumerate(pools.run(2, different_collectives, timeout=60)):
        assert "ranks started different collectives" in msg, (rank, msg)
        assert "all-gather of" in msg and "reduce-scatter of" in msg, (rank, msg)


def same_bytes_other_tensors(spec):
    """Both ranks all-gather as many bytes: rank 0 one 4 x 3 leaf, rank 1 two 2 x 3 leaves."""
    mine = {"w": torch.ones(4, 3)} if dist.get_rank() == 0 else {"a": torch.ones(2, 3),
                                                                "b": torch.ones(2, 3)}
    shards = fs.shard(mine, fs.make_mesh())
    lays = [layout_of(k, v) for k, v in shards.items()]
    return _error_of(lambda pg: cma.CMA().all_gather(
        lays, [v.to_local() for v in shards.values()], [torch.float32] * len(lays), pg, None,
        CPU, False))


def test_a_gather_of_other_tensors_is_named_with_its_tensor_counts(pools):
    """The same kind and size, a different number of tensors: the message says so, with
    the rank's last exchanges (what a rank-dependent gather looks like)."""
    import re

    for rank, msg in enumerate(pools.run(2, same_bytes_other_tensors, timeout=60)):
        said = re.findall(r"all-gather of (\d+) bytes in (\d+) tensors", msg)[:2]
        assert len({n for n, _ in said}) == 1 and {k for _, k in said} == {"1", "2"}, msg
        assert "its last posts: #1 all-gather of" in msg, (rank, msg)


@given(sizes=st.lists(st.integers(0, 300), max_size=40), limit=st.integers(1, 200),
       iov=st.integers(1, 5))
def test_reads_are_split_into_calls_the_kernel_takes(sizes, limit, iov, monkeypatch):
    """Each call moves at most the byte limit in at most IOV_MAX pieces; together the
    pieces are exactly the reads asked for, in order."""
    monkeypatch.setattr(cma_link, "_CALL_BYTES", limit)
    monkeypatch.setattr(cma_link, "_IOV_MAX", iov)
    pairs = [(10_000 * k, 10_000 * k + 5_000_000, n) for k, n in enumerate(sizes)]
    runs = list(cma_link._runs(pairs))
    assert all(sum(n for *_, n in r) <= limit and 0 < len(r) <= iov for r in runs)
    got, want = [], []
    for a, b, n in pairs:
        want += [(a + i, b + i) for i in range(n)]
    for r in runs:
        for a, b, n in r:
            assert n > 0
            got += [(a + i, b + i) for i in range(n)]
    assert got == want


@given(stale=st.sampled_from(["kind", "nbytes", "desc", "words", "seal", "all"]),
       seq=st.integers(1, cma_link.RING))
def test_a_slot_read_while_its_writer_fills_it_is_read_again(stale, seq):
    """A peer's slot that shows this exchange's number beside a field of the exchange that
    had the slot before (one read may load the slot's words in any order) is not posted
    yet: nothing is consumed and nothing raised; once read whole, it is consumed."""
    link = cma_link._Link(2, 0, timeout=5.0)
    link.seq = seq - 1
    ex = link.post("all-gather", 64, [], lambda peer, words: ([], []))
    at = cma_link._HEAD + 2 + (seq % cma_link.RING) * cma_link._SLOT
    fresh = {"kind": ex.kind, "nbytes": 64, "desc": 0, "words": 0}
    old = {"kind": 2, "nbytes": 128, "desc": 4096, "words": 2}  # exchange seq - RING's
    torn = {k: old[k] if stale in (k, "all") else v for k, v in fresh.items()}
    view = link.view[1]
    view[at], view[at + 1], view[at + 2] = seq, torn["kind"], torn["nbytes"]
    view[at + 3], view[at + 4] = torn["desc"], torn["words"]
    sealed = {**(old if stale in ("seal", "all") else fresh), "seq": seq - cma_link.RING
              if stale in ("seal", "all") else seq}
    view[at + 5] = cma_link._seal(sealed["seq"], *(sealed[k] for k in fresh))
    assert not link._progress() and ex in link.pending
    for j, k in enumerate(fresh, start=1):
        view[at + j] = fresh[k]
    view[at + 5] = cma_link._seal(seq, *fresh.values())
    assert link._progress() and ex not in link.pending
    assert link.ctl[cma_link._HEAD + 1] == seq  # consumed, as the peer will read


def ptrace_taken(spec):
    """On a fresh group: how often a rank let its peers read it (``PR_SET_PTRACER_ANY``) and
    shook hands for cross-memory reads, over a step and the functions on the default
    transport, then on ``"p2p"``, then once ``"cma"`` is named."""
    from torch.distributed.device_mesh import DeviceMesh

    from funshard.testing.models import GPT, gpt_loss

    calls = {"ptracer": 0, "handshake": 0}
    let, shake = cma_link._let_peers_read, cma_link._handshake

    def counted_let():
        calls["ptracer"] += 1
        return let()

    def counted_shake(pg, link):
        calls["handshake"] += 1
        return shake(pg, link)

    cma_link._let_peers_read, cma_link._handshake = counted_let, counted_shake
    try:
        m = DeviceMesh.from_group(_fresh_group(), "cpu", mesh_dim_names=("shard",))
        torch.manual_seed(0)
        model = GPT(vocab=17, dim=8, heads=2, layers=2, seq=4)
        batch = (torch.randint(0, 17, (2, 4)), torch.randint(0, 17, (2, 4)))
        seen = []
        for policy in (fs.Policy(), fs.Policy(transport="p2p")):
            step = fs.train_step(gpt_loss(model), fs.optim.adamw(1e-2), policy=policy)
            state, _ = step(step.init(fs.shard(fs.params(model), m)), batch)
            full = fs.unshard(state.params, transport=policy.transport)
            fs.reduce_grads(full, like=state.params, transport=policy.transport)
            seen.append(dict(calls))
        fs.unshard(state.params, transport="cma")
        seen.append(dict(calls))
        return seen
    finally:
        cma_link._let_peers_read, cma_link._handshake = let, shake


def test_the_ptrace_permission_is_taken_only_where_cma_is_named(pools):
    """The default (the backend's collectives) and ``"p2p"`` never offer cross-memory reads:
    no handshake, no ``PR_SET_PTRACER_ANY``; naming ``"cma"`` takes it, once per group."""
    none = {"ptracer": 0, "handshake": 0}
    assert pools.run(2, ptrace_taken) == [[none, none, {"ptracer": 1, "handshake": 1}]] * 2


def test_auto_is_refused_naming_the_default():
    for make in (lambda: fs.Policy(transport="auto"),
                 lambda: fs.unshard({}, transport="auto")):
        try:
            make()
        except ValueError as e:
            assert "transport='auto' is not a transport: the default is 'c10d'" in str(e)
            assert "'p2p' or 'cma'" in str(e)
        else:
            raise AssertionError("transport='auto' was accepted")


def step_on(spec, transport):
    """Three AdamW steps of a small GPT on ``transport``: losses and the final parameters."""
    from funshard.testing import mesh
    from funshard.testing.models import GPT, gpt_loss

    torch.manual_seed(0)
    model = GPT(vocab=23, dim=12, heads=2, layers=2, seq=6)
    g = torch.Generator().manual_seed(dist.get_rank() + 1)
    step = fs.train_step(gpt_loss(model), fs.optim.adamw(1e-2),
                         policy=fs.Policy(transport=transport, accumulate=2))
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    losses = []
    for _ in range(3):
        batch = (torch.randint(0, 23, (4, 6), generator=g),
                 torch.randint(0, 23, (4, 6), generator=g))
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, {k: v.detach() for k, v in fs.unshard(state.params).items()}


def test_the_step_on_each_transport(pools):
    """The opt-in exchanges train as the backend's collectives do (sums in another order:
    float32 round-off)."""
    for spec in (2, "2x2"):
        ref = pools.run(spec, step_on, "c10d")[0]
        for transport in ("p2p", "cma"):
            losses, params = pools.run(spec, step_on, transport)[0]
            assert max(abs(a - b) for a, b in zip(losses, ref[0])) < 1e-5, transport
            for k, v in params.items():
                assert torch.allclose(v, ref[1][k], atol=1e-6, rtol=1e-5), (transport, k)
