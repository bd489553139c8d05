"""shard / unshard / reshard / reduce_grads on real gloo process groups (world 1-4, 2x2)."""

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import funshard as fs
from funshard.testing import TEST_DTYPES, CountCollectives, capture, make_tensor, mesh
from funshard.testing.strategies import shapes, trees
from conftest import MESHES

DTYPES = TEST_DTYPES
# nested dicts / lists / tuples with None slots; every dtype, integer and bool ones included
TREES = trees(integers=True, none=True, frozen=True)
SHAPE_LISTS = st.lists(shapes(max_dims=3), min_size=1, max_size=3)  # float32 leaves' shapes
ROW_SHAPE_LISTS = st.lists(shapes(min_dims=1, max_dims=3), min_size=1, max_size=4)  # no scalars


make = make_tensor


# -- worker functions (run on every rank) ------------------------------------------------


def roundtrip(spec, x):
    m = mesh(spec)
    with CountCollectives() as cc:
        s = fs.shard(x, m)
    shard_counts = dict(cc.counts)
    with CountCollectives() as cc:
        full = fs.unshard(s)
    gather_counts = dict(cc.counts)
    back = fs.reshard(full, like=s)
    xs, ss, fulls, backs = (fs.pytree.fqn_dict(t) for t in (x, s, full, back))
    problems = []
    for k in xs:
        ref, sd = xs[k], ss[k]
        if not (isinstance(sd, DTensor) and sd.shape == ref.shape and sd.dtype == ref.dtype):
            problems.append(f"{k}: shard gave {type(sd).__name__} {sd.shape} {sd.dtype}")
            continue
        if sd.requires_grad != ref.requires_grad:
            problems.append(f"{k}: requires_grad {ref.requires_grad} became {sd.requires_grad}")
        if not (fulls[k].dtype == ref.dtype and torch.equal(fulls[k], ref)):
            problems.append(f"{k}: unshard(shard(x)) != x")
        if not torch.equal(backs[k].to_local(), sd.to_local()):
            problems.append(f"{k}: reshard(unshard(s)) != s")
        if backs[k].placements != sd.placements:
            problems.append(f"{k}: reshard placements {backs[k].placements}")
        dt = distribute_tensor(ref, m, sd.placements, src_data_rank=None)
        if not torch.equal(dt.to_local(), sd.to_local()):
            problems.append(f"{k}: local {tuple(sd.to_local().shape)} != distribute_tensor's")
        want = [Replicate()] * m.ndim
        if ref.ndim:
            want[-1] = Shard(0)
        if list(sd.placements) != want:
            problems.append(f"{k}: placements {sd.placements}")
    gatherable = any(t.ndim and t.numel() for t in xs.values())
    return problems, shard_counts, gather_counts, gatherable


def grad_parity(spec, shapes, seed, reduce_dtype):
    """Gradient through unshard == reduce_grads of per-rank grads == mean of all ranks'."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = {f"p{i}": make(s, "float32", seed + i).requires_grad_() for i, s in enumerate(shapes)}
    s = fs.shard(x, m)
    # per-rank upstream gradients, reproducible on every rank
    ups = [{k: make(v.shape, "float32", seed + 1000 * (r + 1) + i) for i, (k, v) in
            enumerate(x.items())} for r in range(world)]
    rdt = DTYPES[reduce_dtype] if reduce_dtype else None
    with CountCollectives() as cc:
        full = fs.unshard(s, reduce_dtype=rdt)
        loss = sum((full[k] * ups[rank][k]).sum() for k in x)
        loss.backward()
    counts = dict(cc.counts)
    reduced = fs.reduce_grads(ups[rank], like=s, reduce_dtype=rdt)
    worst_vs_reduce, worst_vs_mean = 0.0, 0.0
    placements_ok = True
    for k in x:
        g = s[k].grad
        placements_ok &= isinstance(g, DTensor) and g.placements == s[k].placements
        if g.to_local().numel():
            diff = (g.to_local() - reduced[k].to_local()).abs().max().item()
            worst_vs_reduce = max(worst_vs_reduce, diff)
        mean = sum(u[k] for u in ups) / world
        ref = distribute_tensor(mean, m, s[k].placements, src_data_rank=None).to_local()
        if ref.numel():
            worst_vs_mean = max(worst_vs_mean, (g.to_local() - ref).abs().max().item())
    return worst_vs_reduce, worst_vs_mean, placements_ok, counts


def bucket_parity(spec, shapes, puts, seed, borrow=False, cuts=None):
    """GradBucket filled one gradient at a time, in any order, some leaves more than once
    (summed) and some never (zeros) == the mean over ranks of each rank's sums. ``cuts``
    (not None): the puts are handed over in runs through ``put_all`` instead, cut at these
    positions (a leaf may come twice in one run)."""
    from funshard.collectives import GradBucket
    from funshard.layout import layout_of

    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    rdts = [torch.float32 if i % 2 == 0 else torch.float64 for i in range(len(shapes))]
    x = {f"p{i}": torch.zeros(s) for i, s in enumerate(shapes)}
    s = fs.shard(x, m)
    layouts = [layout_of(k, v) for k, v in s.items()]
    grad = lambda r, j, i: make(shapes[i], "float32", seed + 7919 * (r + 1) + 31 * j)  # noqa
    bucket = GradBucket(layouts, m, rdts, borrow=borrow)
    if cuts is not None:
        ends = sorted(set(cuts) | {len(puts)})
        for a, b in zip([0] + ends, ends):
            bucket.put_all([(i, grad(rank, j, i)) for j, i in enumerate(puts) if a <= j < b],
                           add=True)
    else:
        for j, i in enumerate(puts):
            bucket.put(i, grad(rank, j, i), add=True)
    with CountCollectives() as cc:
        got = bucket.launch().wait()
    worst = 0.0
    for i, (k, d) in enumerate(s.items()):
        per_rank = [sum((grad(r, j, i).double() for j, ii in enumerate(puts) if ii == i),
                        torch.zeros(shapes[i], dtype=torch.float64)) for r in range(world)]
        mean = (sum(per_rank) / world).float()
        ref = distribute_tensor(mean, m, d.placements, src_data_rank=None).to_local()
        if got[i].shape != ref.shape or got[i].dtype != torch.float32:
            return f"{k}: got {tuple(got[i].shape)} {got[i].dtype}, want {tuple(ref.shape)}"
        if ref.numel():
            worst = max(worst, (got[i] - ref).abs().max().item())
    bad = capture(lambda: GradBucket(layouts, m, rdts).put(0, torch.zeros(*shapes[0], 2)))
    return worst, dict(cc.counts), bad


# -- properties --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES, ids=str)
@given(tree=TREES)
def test_roundtrip_laws(pools, spec, tree):
    results = pools.run(spec, roundtrip, tree)
    for rank, (problems, shard_counts, gather_counts, gatherable) in enumerate(results):
        assert problems == [], f"rank {rank}: {problems}"
        assert shard_counts == {}, "shard must not communicate"
        # one all-gather for the whole bucket, whatever the number of leaves and dtypes
        expect = {"all_gather": 1} if gatherable and spec != 1 else {}  # world 1: no comms
        assert gather_counts == expect, gather_counts


@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES, ids=str)
@given(shapes=SHAPE_LISTS, seed=st.integers(0, 2**16))
def test_unshard_grad_is_reduce_grads(pools, spec, shapes, seed):
    for rank, (vs_reduce, vs_mean, placements_ok, counts) in enumerate(
        pools.run(spec, grad_parity, shapes, seed, None)
    ):
        assert vs_reduce == 0.0, f"rank {rank}: grad through unshard != reduce_grads"
        assert vs_mean < 1e-5, f"rank {rank}: grad differs from the mean by {vs_mean}"
        assert placements_ok
        sharded = any(len(s) and s[0] * __import__("math").prod(s[1:]) for s in shapes)
        replicated = any(len(s) == 0 for s in shapes)
        if spec == 1:
            assert counts == {}, counts  # a world of one communicates nothing
            continue
        assert counts.get("all_gather", 0) == int(sharded)
        assert counts.get("reduce_scatter", 0) == int(sharded)
        n_ar = int(replicated) + int(spec == "2x2" and (sharded or replicated))
        assert counts.get("all_reduce", 0) == n_ar, counts


def collective_counts(spec, n_layers):
    m = mesh(spec)
    x = {f"layers.{i}.w": torch.randn(5, 3, requires_grad=True) for i in range(n_layers)}
    x["bias"] = torch.randn(7, dtype=torch.bfloat16)  # mixed dtypes still one gather
    s = fs.shard(x, m)
    with CountCollectives() as fwd:
        full = fs.unshard(s)
    with CountCollectives() as bwd:
        sum(full[f"layers.{i}.w"].sum() for i in range(n_layers)).backward()
    return dict(fwd.counts), dict(bwd.counts), dict(fwd.bytes)


@pytest.mark.parametrize("spec", MESHES, ids=str)
def test_one_collective_per_bucket(pools, spec):
    fwd, bwd, nbytes = pools.run(spec, collective_counts, 6)[0]
    if spec == 1:
        assert fwd == bwd == {}  # a world of one communicates nothing
        return
    assert fwd == {"all_gather": 1}
    world = fs.testing.world_of(spec)
    shard = 2 if spec == "2x2" else world
    chunk = -(-5 // shard)
    expect = shard * (6 * chunk * 3 * 4 + -(-7 // shard) * 2)
    assert nbytes["all_gather"] >= expect and nbytes["all_gather"] < expect + 16 * shard
    assert bwd == ({"reduce_scatter": 1, "all_reduce": 1} if spec == "2x2" else
                   {"reduce_scatter": 1})


def mixed_precision(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    x = {"w": torch.randn(9, 4, requires_grad=True), "idx": torch.arange(5)}
    s = fs.shard(x, m)
    full = fs.unshard(s, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ok_fwd = full["w"].dtype == torch.bfloat16 and torch.equal(full["w"], x["w"].to(torch.bfloat16))
    ok_int = full["idx"].dtype == torch.int64 and torch.equal(full["idx"], x["idx"])
    (full["w"].float() * 3).sum().backward()
    g = s["w"].grad
    return ok_fwd, ok_int, g.dtype == torch.float32, torch.allclose(
        g.full_tensor(), torch.full((9, 4), 3.0))


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_mixed_precision(pools, spec):
    for r in pools.run(spec, mixed_precision):
        assert r == (True, True, True, True)


def odd_dtypes(spec):
    """Leaves in dtypes a backend may refuse to move (gloo: float8, uint16), each gathered
    alone (one dtype: the typed buffer) and all together (the byte buffer): bit for bit."""
    m = mesh(spec)
    x = {f"{dt}".split(".")[1]: (torch.arange(35.) - 17).view(7, 5).to(dt)
         for dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.bfloat16)}
    alone = {k: fs.unshard(fs.shard({k: v}, m))[k] for k, v in x.items()}
    together = fs.unshard(fs.shard(x, m))
    same = lambda a, b: a.dtype == b.dtype and torch.equal(a.view(torch.uint8),  # noqa
                                                            b.view(torch.uint8))
    return [k for k in x if not (same(alone[k], x[k]) and same(together[k], x[k]))]


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_every_dtype_moves_as_bytes(pools, spec):
    for rank, bad in enumerate(pools.run(spec, odd_dtypes)):
        assert bad == [], f"rank {rank}: {bad} did not come back bit for bit"


def overrides_and_meta(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    x = {"emb": torch.randn(10, 4), "norm": torch.randn(4), "w": torch.randn(6, 4)}
    by_fn = fs.shard(x, m, spec=lambda name, t: "replicate" if t.ndim == 1 else "shard")
    by_prefix = fs.shard(x, m, spec={"emb": "replicate", "norm": "shard", "w": "shard"})
    meta = fs.shard({"w": torch.empty(7, 3, device="meta", requires_grad=True)}, m)["w"]
    full = fs.unshard(by_fn)
    return (
        [type(p).__name__ for p in by_fn["norm"].placements],
        [type(p).__name__ for p in by_prefix["emb"].placements],
        all(torch.equal(full[k], x[k]) for k in x),
        (meta.to_local().device.type, tuple(meta.to_local().shape), tuple(meta.shape),
         meta.requires_grad, meta.is_leaf),
    )


@pytest.mark.parametrize("spec", [3, "2x2"], ids=str)
def test_spec_overrides_and_meta(pools, spec):
    results = pools.run(spec, overrides_and_meta)
    shard = 2 if spec == "2x2" else 3
    for rank, (norm_pl, emb_pl, equal, meta) in enumerate(results):
        assert set(norm_pl) == {"Replicate"} and set(emb_pl) == {"Replicate"}
        assert equal
        srank = rank % shard
        rows = [3, 3, 1][srank] if shard == 3 else [4, 3][srank]
        assert meta == ("cpu", (rows, 3), (7, 3), True, True)


def reduce_sum(spec):
    m = mesh(spec)
    rank = dist.get_rank()
    x = {"w": torch.zeros(5, 2), "s": torch.zeros(())}
    s = fs.shard(x, m)
    g = fs.reduce_grads({"w": torch.full((5, 2), float(rank + 1)), "s": torch.tensor(1.0)},
                        like=s, op="sum")
    return g["w"].full_tensor(), g["s"].full_tensor()


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_reduce_grads_sum(pools, spec):
    world = fs.testing.world_of(spec)
    for w, sc in pools.run(spec, reduce_sum):
        assert torch.equal(w, torch.full((5, 2), float(sum(range(1, world + 1)))))
        assert sc.item() == world


# -- bad input ---------------------------------------------------------------------------


def errors(spec):
    """Each bad call's (exception type, message)."""
    m = mesh(spec)
    cases = {}

    def case(name, fn):
        cases[name] = capture(fn)

    good = fs.shard({"a": torch.randn(7, 3), "b": [torch.randn(2)]}, m)
    case("non_tensor", lambda: fs.shard({"a": torch.randn(2), "b": [3]}, m))
    dp = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    case("no_shard_dim", lambda: fs.shard({"a": torch.randn(2)}, dp))
    case("mismatch", lambda: fs.reshard({"a": torch.randn(7, 3), "c": [torch.randn(2)]}, like=good))
    case("bad_shape",
         lambda: fs.reshard({"a": torch.randn(6, 3), "b": [torch.randn(2)]}, like=good))
    two = {"a": good["a"], "z": fs.shard(torch.randn(4, 2), mesh("2x2"))}
    case("two_meshes", lambda: fs.unshard(two))
    bad_pl = distribute_tensor(torch.randn(4, 6), m, [Replicate()] * (m.ndim - 1) + [Shard(1)])
    case("placement", lambda: fs.unshard({"layers.0.w": bad_pl}))
    case("plain_in_unshard", lambda: fs.unshard({"a": torch.randn(3)}))
    case("grad_shape", lambda: fs.reduce_grads({"a": torch.randn(4, 3), "b": [None]}, like=good))
    case("grad_tree", lambda: fs.reduce_grads({"a": torch.randn(7, 3)}, like=good))
    case("spec_value", lambda: fs.shard({"a": torch.randn(3)}, m, spec="columns"))
    case("mesh_size", lambda: fs.make_mesh(shard=dist.get_world_size() + 1))
    return cases


def test_bad_input_errors(pools):
    cases = pools.run(4, errors)[0]
    t, msg = cases["non_tensor"]
    assert t == "TypeError" and "'b.0'" in msg and "int" in msg and "torch.Tensor" in msg
    t, msg = cases["no_shard_dim"]
    assert t == "ValueError" and "'dp': 4" in msg and "no 'shard' dimension" in msg
    assert "fs.make_mesh" in msg
    t, msg = cases["mismatch"]
    assert t == "TreeMismatchError" and "full['<root>']" in msg and "like['<root>']" in msg
    assert "keys only in full: ['c']; keys only in like: ['b']" in msg
    t, msg = cases["bad_shape"]
    assert t == "ValueError" and "'a'" in msg and "(6, 3)" in msg and "(7, 3)" in msg
    assert "'shard': 4" in msg
    t, msg = cases["two_meshes"]
    assert t == "ValueError" and "'a'" in msg and "'z'" in msg and "different meshes" in msg
    assert "'shard': 4" in msg and "'replicate': 2, 'shard': 2" in msg
    t, msg = cases["placement"]
    assert t == "ValueError" and "'layers.0.w'" in msg and "(4, 6)" in msg
    assert "Shard(dim=1)" in msg and "'shard': 4" in msg and "redistribute" in msg
    t, msg = cases["plain_in_unshard"]
    assert t == "TypeError" and "'a'" in msg and "(3,)" in msg and "fs.shard" in msg
    t, msg = cases["grad_shape"]
    assert t == "ValueError" and "'a'" in msg and "(4, 3)" in msg and "(7, 3)" in msg
    t, msg = cases["grad_tree"]
    assert t == "TreeMismatchError" and "keys only in like: ['b']" in msg
    t, msg = cases["spec_value"]
    assert t == "ValueError" and "'columns'" in msg and "'a'" in msg
    t, msg = cases["mesh_size"]
    assert t == "ValueError" and "shard=5" in msg and "world has 4" in msg


def test_make_mesh_single_process():
    """Without torchrun's environment a plain process gets a world of one."""
    import subprocess
    import sys

    code = (
        "import funshard as fs, torch;"
        "m = fs.make_mesh();"
        "s = fs.shard({'w': torch.arange(6.).view(3, 2)}, m);"
        "print(m.shape, m.mesh_dim_names, fs.unshard(s)['w'].sum().item())"
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1,) ('shard',) 15.0"


@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES, ids=str)
@given(shapes=st.lists(shapes(max_dims=3), min_size=1, max_size=4), data=st.data(),
       seed=st.integers(0, 2**16))
def test_grad_bucket_incremental(pools, spec, shapes, data, seed):
    puts = data.draw(st.lists(st.integers(0, len(shapes) - 1), max_size=8))
    borrow = data.draw(st.booleans())  # gradients kept and sent from (gloo) or copied
    # handed over one at a time, or in runs (as the step hands over a group's gradients)
    cuts = tuple(data.draw(st.lists(st.integers(0, len(puts)), max_size=3)))
    cuts = cuts if data.draw(st.booleans()) else None
    for rank, res in enumerate(pools.run(spec, bucket_parity, shapes, puts, seed, borrow,
                                         cuts)):
        assert not isinstance(res, str), f"rank {rank}: {res}"
        worst, counts, bad = res
        assert worst < 1e-5, f"rank {rank}: differs from the mean of sums by {worst}"
        # one collective of each kind per reduce dtype, whatever the order and repeats
        if spec != 1:
            assert counts.get("reduce_scatter", 0) <= 2 and counts.get("all_reduce", 0) <= 4
        assert bad[0] == "ValueError" and "gradient of 'p0' has shape" in bad[1], bad
        assert "DeviceMesh(" in bad[1], bad


class Ops(TorchDispatchMode):
    """The c10d ops run while active, in order (``names``)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def bucket_inputs(spec, shapes, seed):
    """Full tensors, their layouts and local shards on the mesh, and this rank's gradients."""
    from funshard.layout import layout_of

    m = mesh(spec)
    rank = dist.get_rank()
    x = {f"p{i}": make(s, "float32", seed + i) for i, s in enumerate(shapes)}
    s = fs.shard(x, m)
    layouts = [layout_of(k, v) for k, v in s.items()]
    locals_ = [v.to_local() for v in s.values()]
    grads = [make(sh, "float32", seed + 1009 * (rank + 1) + i) for i, sh in enumerate(shapes)]
    return m, x, layouts, locals_, grads


def exchange_parity(spec, shapes, seed, direct="p2p"):
    """A direct exchange (``"p2p"`` or ``"cma"``) == gloo's own collectives, with two
    all-gathers and a reduce-scatter in flight at once on one group, finished in reverse."""
    from funshard.collectives import all_gather, reduce_scatter

    m, x, layouts, locals_, grads = bucket_inputs(spec, shapes, seed)
    got = {}
    for how in ("c10d", direct):
        with Ops() as ops, CountCollectives() as cc:
            first = all_gather(layouts, locals_, m, async_op=True, transport=how)
            second = all_gather(layouts, locals_, m, async_op=True, transport=how)
            red = reduce_scatter(layouts, grads, m, async_op=True, transport=how).wait()
            b, a = second.wait(), first.wait()
        got[how] = (a, b, red, set(ops.names), dict(cc.counts))
    (na, nb, nred, nops, ncounts), (da, db, dred, dops, dcounts) = got["c10d"], got[direct]
    problems = []
    for k, full in zip(x, x.values()):
        i = list(x).index(k)
        if not all(torch.equal(t[i], full) for t in (da, db, na, nb)):
            problems.append(f"{k}: a gathered tensor differs from the full one")
        if dred[i].shape != nred[i].shape:
            problems.append(f"{k}: reduced shapes {dred[i].shape} vs {nred[i].shape}")
    worst = max([(d - n).abs().max().item() for d, n in zip(dred, nred) if d.numel()],
                default=0.0)
    return problems, worst, nops, dops, ncounts, dcounts


@pytest.mark.slow
@pytest.mark.parametrize("direct", ["p2p", "cma"])
@pytest.mark.parametrize("spec", [2, 3, 4, "2x2"], ids=str)
@given(shapes=ROW_SHAPE_LISTS, seed=st.integers(0, 2**16))
def test_direct_exchange_is_the_collective(pools, spec, direct, shapes, seed):
    for rank, (problems, worst, nops, dops, ncounts, dcounts) in enumerate(
            pools.run(spec, exchange_parity, shapes, seed, direct)):
        assert problems == [], f"rank {rank}: {problems}"
        # 2 ranks sum a + b either way; more may add in another order
        assert worst <= (0.0 if spec in (2, "2x2") else 1e-5), f"rank {rank}: {worst}"
        assert not {"_allgather_base_", "_reduce_scatter_base_"} & dops, dops
        assert not {"send", "recv_"} & nops, nops
        if any(math.prod(s) for s in shapes):  # else nothing moves at all
            # p2p moves messages; cma none (2x2: the replicate all-reduce is gloo's)
            assert ({"send", "recv_"} <= dops) if direct == "p2p" else \
                not {"send", "recv_", "allgather", "reduce_scatter"} & dops, dops
        # counters see one collective per exchange, as they see gloo's own
        assert dcounts == ncounts, (dcounts, ncounts)


def flat_api_parity(spec, shapes, seed):
    """The c10d transport on this torch's newest flat API == on the oldest supported one
    (all_gather_into_tensor / reduce_scatter_tensor): same tensors, same c10d ops, counts."""
    from funshard.collectives import all_gather, c10d, gather, reduce_scatter

    m, x, layouts, locals_, grads = bucket_inputs(spec, shapes, seed)
    got, default = {}, gather._IMPLS["c10d"]
    try:
        for name, api in (("newest", c10d.API), ("legacy", c10d.LEGACY)):
            gather._IMPLS["c10d"] = c10d.C10d(api)
            with Ops() as ops, CountCollectives() as cc:
                full = all_gather(layouts, locals_, m, async_op=True, transport="c10d").wait()
                red = reduce_scatter(layouts, grads, m, transport="c10d")
            got[name] = (full, red, ops.names, dict(cc.counts))
    finally:
        gather._IMPLS["c10d"] = default
    (nf, nr, nops, nc), (lf, lr, lops, lc) = got["newest"], got["legacy"]
    same = all(torch.equal(a, b) for a, b in zip(nf, lf)) and all(
        torch.equal(a, b) for a, b in zip(nr, lr))
    exact = all(torch.equal(a, b) for a, b in zip(lf, x.values()))
    return same, exact, nops == lops, nc == lc, c10d.API.name


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
@given(shapes=st.lists(shapes(min_dims=1, max_dims=3), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
@settings(max_examples=10)
def test_flat_api_fallback_is_the_same(pools, spec, shapes, seed):
    for rank, (same, exact, ops, counts, api) in enumerate(
            pools.run(spec, flat_api_parity, shapes, seed)):
        assert same and exact and ops and counts, (rank, same, exact, ops, counts)
        want = "all_gather_single" if hasattr(dist, "all_gather_single") else \
            "all_gather_into_tensor"
        assert api == want


def complex_reduce(spec):
    """Complex gradients through the c10d transport: the mean of every rank's, and what the
    reduce-scatter call was given."""
    from funshard.collectives import c10d, gather, reduce_scatter
    from funshard.layout import layout_of, local_slice

    m, rank, world = mesh(spec), dist.get_rank(), dist.get_world_size()
    fulls = [torch.randn(5, 3, generator=torch.Generator().manual_seed(r), dtype=torch.cfloat)
             for r in range(world)]
    lay = layout_of("w", fs.shard({"w": fulls[0]}, m)["w"])
    seen, default, api = [], gather._IMPLS["c10d"], c10d.API

    def spy(out, inp, **kw):
        seen.append((out.dtype, inp.dtype))
        return api.reduce_scatter(out, inp, **kw)

    gather._IMPLS["c10d"] = c10d.C10d(c10d.FlatApi(api.name, api.all_gather, spy))
    try:
        (got,) = reduce_scatter([lay], [fulls[rank]], m, transport="c10d")
    finally:
        gather._IMPLS["c10d"] = default
    err = (got - local_slice(sum(fulls) / world, lay)).abs().max().item() if got.numel() else 0.0
    return got.dtype, err, seen


@pytest.mark.parametrize("spec", [2, 3], ids=str)
def test_complex_gradients_reduce_as_pairs_of_reals(pools, spec):
    """NCCL has no complex type: the c10d transport reduces a complex gradient as pairs of
    reals (the sum of (re, im) pairs is the complex sum), and gets the complex mean."""
    for rank, (dtype, err, seen) in enumerate(pools.run(spec, complex_reduce)):
        assert dtype == torch.cfloat and err < 1e-6, (rank, dtype, err)
        assert seen and not any(a.is_complex or b.is_complex for a, b in seen), seen


@pytest.mark.parametrize("spec", [2, 3, "2x2"], ids=str)
def test_zero_size_leaf_gradient_keeps_placement(pools, spec):
    """A leaf with a dimension of 0 (uneven: some ranks hold no rows) gets a Shard(0)
    gradient through unshard on every supported torch (2.11 re-placed it as Replicate)."""
    shapes = [(1, 0), (3, 0), (1, 0, 2), (0, 3), (0,), (2, 3)]
    for rank, (vs_reduce, vs_mean, placements_ok, _) in enumerate(
            pools.run(spec, grad_parity, shapes, 7, None)):
        assert placements_ok, f"rank {rank}"
        assert vs_reduce == 0.0 and vs_mean < 1e-5
