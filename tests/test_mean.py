"""``fs.Mean(total, count)``: a loss averaged over every rank's and micro-batch's items
(tokens whose label is not masked), as one process averages over the whole batch, where
the plain per-rank mean weighs a rank's few tokens as much as another's many."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import DEVICE, capture, device, mesh
from funshard.testing.models import GPT

V, SEQ, B = 37, 8, 2  # vocabulary, sequence, rows per rank
IGNORE = -100
TOL = 1e-6 if DEVICE == "cpu" else 1e-4  # CUDA kernels may sum in another order


def _model():
    torch.manual_seed(0)
    return GPT(vocab=V, dim=12, heads=2, layers=2, seq=SEQ).to(device())


def _batch(step, world, empty=True):
    """Every rank's rows, with a different share of masked labels per row; ``empty``: one row
    masked whole (a micro-batch that counts nothing on its rank, with accumulate=2; the
    plain mean's loss is NaN there)."""
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randint(0, V, (world * B, SEQ), generator=g)
    y = torch.randint(0, V, (world * B, SEQ), generator=g)
    keep = torch.rand(world * B, SEQ, generator=g) < torch.linspace(0.1, 1.0, world * B)[:, None]
    keep[:, 0] = True
    y = torch.where(keep, y, IGNORE)
    if empty:
        y[1 if world == 1 else B] = IGNORE
    return x.to(device()), y.to(device())


def _loss(model, mean: bool):
    def loss_fn(p, b):
        logits = fs.call(model, p, b[0]).flatten(0, 1).float()
        y = b[1].flatten()
        if not mean:
            return F.cross_entropy(logits, y, ignore_index=IGNORE)
        total = F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
        return fs.Mean(total, (y != IGNORE).sum())
    return loss_fn


def _reference(world, steps, clip, empty):
    """One process on every rank's rows: the mean over all unmasked tokens; SGD, clipped as
    torch clips. Per step: (loss, tokens, grad norm); and the parameters."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    for s in range(steps):
        x, y = _batch(s, world, empty)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        seen.append((loss.item(), int((y != IGNORE).sum()), norm.item()))
    return seen, dict(model.named_parameters())


def train_on_mean(spec, accumulate, raf, steps=3, clip=0.5):
    m = mesh(spec)
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for mean in (True, False):  # the plain mean on data where each micro-batch counts some
        ref_seen, ref = _reference(world, steps, clip, empty=mean)
        model = _model()
        policy = fs.Policy(accumulate=accumulate, reshard_after_forward=raf, clip_norm=clip)
        step = fs.train_step(_loss(model, mean), fs.optim.sgd(lr=0.5), policy=policy)
        state = step.init(fs.shard(fs.params(model), m))
        seen = []
        for s in range(steps):
            x, y = _batch(s, world, empty=mean)
            state, met = step(state, (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]))
            seen.append((met["loss"], met.get("count"), met["grad_norm"]))
        full = fs.unshard(state.params)
        out[mean] = (max((full[k] - v).abs().max().item() for k, v in ref.items()), seen,
                     ref_seen)
    return out


@pytest.mark.lane
@pytest.mark.parametrize("spec,accumulate,raf", [(1, 2, True), (2, 1, True), (2, 2, False),
                                                 ("2x2", 2, True)])
def test_mean_over_every_ranks_tokens_equals_one_process(pools, spec, accumulate, raf):
    """Parameters, loss, token count and gradient norm (clipping active) as one process on
    the whole batch; the plain per-rank mean on the same data is not (so the data can tell)."""
    for out in pools.run(spec, train_on_mean, accumulate, raf):
        err, seen, ref_seen = out[True]
        assert err < TOL, err
        for (loss, count, norm), (r_loss, r_count, r_norm) in zip(seen, ref_seen):
            assert count == r_count and abs(loss - r_loss) < 10 * TOL * r_loss, (seen, ref_seen)
            assert abs(norm - r_norm) < 10 * TOL * r_norm and r_norm > 0.5, (norm, r_norm)
        plain_err, plain_seen, _ = out[False]
        assert plain_err > 1e-3 and plain_seen[0][1] is None, plain_err


def misuse(spec):
    m = mesh(spec)
    rank = dist.get_rank()
    x, y = _batch(0, dist.get_world_size())
    batch = (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B])
    model = _model()
    sp = fs.shard(fs.params(model), m)
    mean_fn, plain_fn = _loss(model, True), _loss(model, False)

    def attempt(loss_fn, policy=fs.Policy(), batch=batch):
        step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.5), policy=policy)
        state = step.init(copy.deepcopy(sp))
        return capture(lambda: dict(step(state, batch)[1]))  # (a refusal: at the read)

    counter = {"n": 0}

    def alternating(p, b):  # fs.Mean for the first micro-batch, a plain loss for the second
        counter["n"] += 1
        return (mean_fn if counter["n"] % 2 else plain_fn)(p, b)

    masked = (batch[0], torch.full_like(batch[1], IGNORE))
    step = fs.train_step(mean_fn, fs.optim.sgd(lr=0.5), policy=fs.Policy(skip_nonfinite=True))
    state = step.init(copy.deepcopy(sp))
    state, met = step(state, masked)
    unchanged = all(torch.equal(state.params[k].to_local(), v.to_local()) for k, v in sp.items())
    return {
        "ranks": attempt(mean_fn if rank == 0 else plain_fn),
        "micro": attempt(alternating, fs.Policy(accumulate=2)),
        "nothing": attempt(mean_fn, batch=masked),
        "skipped": (met["skipped"], met["count"], unchanged),
        "negative": attempt(lambda p, b: fs.Mean(mean_fn(p, b).total, -1)),
        "vector": attempt(lambda p, b: fs.Mean(mean_fn(p, b).total, torch.ones(2))),
        "total": attempt(lambda p, b: fs.Mean(mean_fn(p, b).total.expand(2), 3)),
    }


def test_mean_misuse_is_refused_by_name(pools):
    for r in pools.run(2, misuse):
        assert r["ranks"][0] == "ValueError" and "fs.Mean on 1 of 2 ranks" in r["ranks"][1], r
        assert r["micro"][0] == "ValueError" and "fs.Mean for micro-batch 0 and a plain loss " \
            "for micro-batch 1" in r["micro"][1], r
        assert r["nothing"][0] == "FloatingPointError" and "count" in r["nothing"][1] \
            and "is 0.0 at step 0" in r["nothing"][1], r
        assert r["skipped"] == (1, 0.0, True), r
        for key in ("negative", "vector"):
            assert r[key][0] == "ValueError" and "fs.Mean's count must be" in r[key][1], r
        assert r["total"][0] == "ValueError" and "floating scalar total" in r["total"][1], r


def uneven_batches(spec):
    """Rank 1 has a row more than rank 0: the plain mean warns on every rank, once (not
    when the rows agree); fs.Mean over the same rows equals one process on all of them."""
    import warnings

    m = mesh(spec)
    rank = dist.get_rank()
    x, y = _batch(0, 2, empty=False)
    x, y = torch.cat([x, x[:1]]), torch.cat([y, y[:1]])  # 5 rows: rank 0 gets 2, rank 1 3
    mine = slice(0, 2) if rank == 0 else slice(2, 5)
    out = {}
    for name, mean, rows in (("plain_even", False, slice(rank * 2, rank * 2 + 2)),
                             ("plain_uneven", False, mine), ("mean_uneven", True, mine)):
        model = _model()
        step = fs.train_step(_loss(model, mean), fs.optim.sgd(lr=0.5))
        state = step.init(fs.shard(fs.params(model), m))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):  # (the check is made where the step's metrics are read)
                state, met = step(state, (x[rows], y[rows]))
                float(met["loss"])
        out[name] = [str(w.message) for w in seen if "differ in size" in str(w.message)]
        if mean:
            ref = _model()
            F.cross_entropy(ref(x).flatten(0, 1).float(), y.flatten(),
                            ignore_index=IGNORE).backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p -= 0.5 * p.grad
            first = fs.train_step(_loss(_model(), True), fs.optim.sgd(lr=0.5))
            one = first.init(fs.shard(fs.params(_model()), m))
            one, _ = first(one, (x[mine], y[mine]))
            full = fs.unshard(one.params)
            out["mean_err"] = max((full[k] - v).abs().max().item()
                                  for k, v in ref.named_parameters())
    return out


def test_uneven_local_batches_warn_and_fs_mean_is_exact(pools):
    for r in pools.run(2, uneven_batches):
        assert r["plain_even"] == [] and r["mean_uneven"] == [], r
        assert len(r["plain_uneven"]) == 2 and "5 rows over 2 ranks" in r["plain_uneven"][0], r
        assert r["mean_err"] < TOL, r


def _ragged(world):
    """Per rank, two micro-batches of their own shapes (rows x length), some labels masked."""
    g = torch.Generator().manual_seed(7)
    shapes = [[(2, 8), (1, 5)], [(1, 8), (3, 6)], [(2, 3), (2, 7)], [(1, 4), (1, 8)]]
    out = []
    for r in range(world):
        parts = []
        for rows, length in shapes[r]:
            x = torch.randint(0, V, (rows, length), generator=g)
            y = torch.randint(0, V, (rows, length), generator=g)
            y[torch.rand(rows, length, generator=g) < 0.3] = IGNORE
            parts.append((x.to(device()), y.to(device())))
        out.append(parts)
    return out


def ragged_micro_batches(spec, steps=2):
    """fs.MicroBatches of different lengths with fs.Mean: one process on every token; a plain
    loss over them warns; a wrong number of micro-batches is refused by name."""
    import warnings

    m = mesh(spec)
    world, rank = dist.get_world_size(), dist.get_rank()
    data = _ragged(world)
    model = _model()
    step = fs.train_step(_loss(model, True), fs.optim.sgd(lr=0.5),
                         policy=fs.Policy(accumulate=2))
    state = step.init(fs.shard(fs.params(model), m))
    for _ in range(steps):
        state, met = step(state, fs.MicroBatches(data[rank]))
    ref = _model()
    for _ in range(steps):
        parts = [p for r in data for p in r]
        total = sum(F.cross_entropy(ref(x).flatten(0, 1).float(), y.flatten(),
                                    ignore_index=IGNORE, reduction="sum") for x, y in parts)
        count = sum(int((y != IGNORE).sum()) for _, y in parts)
        (total / count).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.5 * p.grad
                p.grad = None
    full = fs.unshard(state.params)
    err = max((full[k] - v).abs().max().item() for k, v in ref.named_parameters())
    plain = fs.train_step(_loss(_model(), False), fs.optim.sgd(lr=0.5),
                          policy=fs.Policy(accumulate=2))
    ps = plain.init(fs.shard(fs.params(_model()), m))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ps, _ = plain(ps, fs.MicroBatches(data[rank]))
    warned = [str(w.message) for w in seen if "micro-batches differ in size" in str(w.message)]
    wrong = capture(lambda: plain(ps, fs.MicroBatches(data[rank][:1])))
    return err, met["count"], count, warned, wrong


@pytest.mark.parametrize("spec", [1, 2])
def test_ragged_micro_batches_with_fs_mean_equal_one_process(pools, spec):
    for err, count, ref_count, warned, wrong in pools.run(spec, ragged_micro_batches):
        assert err < TOL and count == ref_count, (err, count, ref_count)
        assert len(warned) == 1, warned
        assert wrong[0] == "ValueError" and "holds 1 micro-batches and Policy(accumulate=2)" \
            in wrong[1], wrong
