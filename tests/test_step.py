"""train_step: N ranks match one process on the N*B batch; collectives; memory; errors."""

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import funshard as fs
from funshard.testing.models import GPT, MLP, gpt_loss, mse_loss
from funshard.testing import CountCollectives, capture, mesh
from funshard.testing.strategies import policies
from conftest import EXAMPLES, MESHES, fsdp2_twin, torch_step


def build(name, seed=0):
    torch.manual_seed(seed)
    if name == "gpt":  # uneven: vocab 37, dim 12 -> rows not divisible by 2, 3 or 4
        model = GPT(vocab=37, dim=12, heads=2, layers=3, seq=8)
        return model, gpt_loss(model), "tokens"
    if name == "mlp":
        model = MLP(dim=5, hidden=7, layers=3, out=3)
        return model, mse_loss(model), "regression"
    if name == "mlpstack":  # PyTorch's own FSDP test model
        from torch.testing._internal.common_fsdp import MLPStack

        model = MLPStack(6)
        return model, mse_loss(model), "regression6"
    raise ValueError(name)


def batches(kind, world, per_rank, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = world * per_rank
        if kind == "tokens":
            out.append((torch.randint(0, 37, (n, 8), generator=g),
                        torch.randint(0, 37, (n, 8), generator=g)))
        elif kind == "regression":
            out.append((torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)))
        else:
            out.append((torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)))
    return out


def optimizers(kind, params_for_torch):
    if kind == "sgd":
        return (fs.optim.sgd(lr=0.05, momentum=0.9),
                torch.optim.SGD(params_for_torch, lr=0.05, momentum=0.9))
    return (fs.optim.adamw(lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(params_for_torch, lr=1e-2, weight_decay=0.1))


def parity(spec, model_name, opt_name, policy_kwargs, steps=3, per_rank=2, frozen=None):
    """Train with funshard on the mesh and with plain torch on the full batch; compare."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_fn, kind = build(model_name)
    ref = copy.deepcopy(model)
    if frozen:
        for mod in (model, ref):
            for n, p in mod.named_parameters():
                if n.startswith(frozen):
                    p.requires_grad_(False)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters()
                     if not p.requires_grad}
    ours, theirs = optimizers(opt_name, [p for p in ref.parameters() if p.requires_grad])
    policy = fs.Policy(**policy_kwargs)
    step = fs.train_step(loss_fn, ours, policy=policy)
    state = step.init(fs.shard(fs.params(model), m))
    ref_loss = _ref_loss(model_name, ref)
    curve, ref_curve, norms, ref_norms, counts = [], [], [], [], []
    for b in batches(kind, world, per_rank, steps):
        local = tuple(x[rank * per_rank:(rank + 1) * per_rank] for x in b)
        with CountCollectives() as cc:
            state, metrics = step(state, local)
        counts.append(dict(cc.counts))
        curve.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
        theirs.zero_grad()
        k = policy.accumulate
        total = 0.0
        for j in range(k):  # the reference accumulates like a user of plain torch would
            mb = tuple(torch.cat([x[r * per_rank:(r + 1) * per_rank].chunk(k)[j]
                                  for r in range(world)]) for x in b)
            loss = ref_loss(dict(ref.named_parameters()), mb)
            (loss / k).backward()
            total += loss.item() / k
        ref_curve.append(total)
        ref_norms.append(torch.nn.utils.clip_grad_norm_(
            [p for p in ref.parameters() if p.grad is not None],
            policy.clip_norm if policy.clip_norm else float("inf")).item())
        theirs.step()
    full = fs.unshard(state.params)
    err = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    frozen_ok = all(torch.equal(full[n], v) for n, v in frozen_before.items())
    frozen_state = [n for n, v in _state_leaves(state.opt_state).items()
                    if n in frozen_before and v is not None]
    return dict(err=err, curve=curve, ref_curve=ref_curve, norms=norms, ref_norms=ref_norms,
                counts=counts, frozen_ok=frozen_ok, frozen_state=frozen_state,
                groups=len(fs.step.ParamGroups(state.params, policy).members))


def _ref_loss(model_name, ref):
    return gpt_loss(ref) if model_name == "gpt" else mse_loss(ref)


def _state_leaves(opt_state):
    import optree

    out = {}
    for field in opt_state:
        paths, leaves, _ = optree.tree_flatten_with_path(field, none_is_leaf=True,
                                                         namespace="funshard")
        for p, v in zip(paths, leaves):
            out[".".join(map(str, p))] = v
    return out


def check(results, *, tol=1e-5, curve_tol=1e-5):
    """Parameters to ``tol`` (None: AdamW, judged by its loss curve), curves, norms, frozen."""
    for rank, r in enumerate(results):
        if tol is not None:
            assert r["err"] < tol, f"rank {rank}: params differ from one process by {r['err']}"
        for a, b in zip(r["curve"], r["ref_curve"]):
            assert abs(a - b) <= curve_tol * max(1.0, abs(b)), (r["curve"], r["ref_curve"])
        for a, b in zip(r["norms"], r["ref_norms"]):
            assert abs(a - b) <= 1e-4 * max(1.0, b), (r["norms"], r["ref_norms"])
        assert r["frozen_ok"] and r["frozen_state"] == []


@pytest.mark.parametrize("spec", MESHES, ids=str)
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_gpt_sgd_parity(pools, spec, raf):
    """Tied embedding/head, uneven shapes, every mesh, both resharding policies."""
    results = pools.run(spec, parity, "gpt", "sgd", {"reshard_after_forward": raf})
    check(results)
    world = fs.testing.world_of(spec)
    for r in results:
        g = r["groups"]  # root (embeddings, final norm, tied head) + 3 blocks
        assert g == 4
        for c in r["counts"][1:]:
            if world == 1:
                assert c == {}, c
                continue
            # FULL_SHARD: twice per group. Backward starts with the last block: its first
            # leaves stay gathered from forward on, the rest are gathered again (step 2 on)
            ag = 2 * g if raf else g
            ar = 1 + (g if spec == "2x2" else 0)  # metrics + one per group on "replicate"
            assert c == {"all_gather": ag, "reduce_scatter": g, "all_reduce": ar}, c


@pytest.mark.parametrize("spec", MESHES, ids=str)
def test_adamw_loss_curve_mlpstack(pools, spec):
    """PyTorch's own FSDP test model (MLPStack) with AdamW."""
    check(pools.run(spec, parity, "mlpstack", "adamw", {}, steps=4), tol=None)


@pytest.mark.parametrize("spec", [2, 4], ids=str)
def test_frozen_layer_and_clipping(pools, spec):
    results = pools.run(spec, parity, "mlp", "sgd", {"clip_norm": 0.05}, frozen="layers.1")
    check(results)
    assert all(n > 0.05 for n in results[0]["ref_norms"])  # clipping was active


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_adamw_accumulation_loss_curve(pools, spec):
    check(pools.run(spec, parity, "gpt", "adamw", {"accumulate": 2}, per_rank=4), tol=None)


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_gradient_accumulation(pools, spec):
    results = pools.run(spec, parity, "gpt", "sgd", {"accumulate": 2}, per_rank=4)
    check(results)
    world = fs.testing.world_of(spec)
    if world > 1:  # one reduction per step, not per micro-batch
        for c in results[0]["counts"]:
            assert c["reduce_scatter"] == results[0]["groups"]


@pytest.mark.slow
@settings(max_examples=max(8, EXAMPLES // 3))
@given(spec=st.sampled_from(MESHES), policy=policies(accumulate=(1, 2), clip_norms=(None, 0.1)))
def test_parity_property(pools, spec, policy):
    kwargs = {k: getattr(policy, k) for k in ("reshard_after_forward", "accumulate", "clip_norm",
                                              "prefetch")}
    check(pools.run(spec, parity, "mlp", "sgd", kwargs, steps=2, per_rank=2), tol=2e-5)


def mixed_precision(spec):
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    curves = {}
    for name, pol in {"fp32": fs.Policy(),
                      "bf16": fs.Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                      }.items():
        model, loss_fn, kind = build("gpt")
        step = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2), policy=pol)
        state = step.init(fs.shard(fs.params(model), m))
        curve = []
        for b in batches(kind, world, 2, 5):
            state, metrics = step(state, tuple(x[rank * 2:(rank + 1) * 2] for x in b))
            curve.append(metrics["loss"])
        dtypes = {str(v.dtype) for v in fs.pytree.leaves(state.params)}
        sdt = {str(v.dtype) for v in fs.pytree.leaves(state.opt_state) if torch.is_tensor(v)}
        curves[name] = (curve, dtypes, sdt)
    return curves


def test_mixed_precision_within_tolerance(pools):
    """bf16 compute, fp32 reduce: loss within 2% of fp32; masters and state stay fp32."""
    for r in pools.run(2, mixed_precision):
        fp32, bf16 = r["fp32"][0], r["bf16"][0]
        assert max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16)) < 0.02, (fp32, bf16)
        assert r["bf16"][1] == {"torch.float32"} and r["bf16"][2] == {"torch.float32"}
        assert fp32 != bf16  # bf16 really ran


def float_inputs(spec):
    """An MLP fed float32 inputs under Policy(param_dtype=bfloat16): fs.call casts them, as
    FSDP2's MixedPrecisionPolicy (cast_forward_inputs=True) does; the same losses and
    parameters as FSDP2 per layer and root. cast_inputs=False leaves them float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_fn, kind = build("mlp")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs = fsdp2_twin(model, m, mp_policy=mp)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=True)
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    step = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2), policy=fs.Policy(**bf16))
    state = step.init(fs.shard(fs.params(model), m))
    ours, fsdp = [], []
    for b in batches(kind, world, 2, 3):
        local = tuple(x[rank * 2:(rank + 1) * 2] for x in b)
        state, metrics = step(state, local)
        ours.append(metrics["loss"])
        loss = F.mse_loss(theirs(local[0]).float(), local[1])
        fsdp.append(torch_step(topt, loss))
    full = fs.unshard(state.params)
    err = max((full[n] - p.full_tensor()).abs().max().item() for n, p in theirs.named_parameters())
    x = batches(kind, world, 2, 1)[0][0]
    out = fs.eval_step(lambda p, x: fs.call(model, p, x), policy=fs.Policy(**bf16))(
        state.params, x)
    off = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2),
                        policy=fs.Policy(cast_inputs=False, **bf16))
    refused = capture(lambda: off(off.init(fs.shard(fs.params(model), m)), local))
    return ours, fsdp, err, out.dtype, refused


def test_float_inputs_are_cast_as_fsdp2_casts_them(pools):
    for ours, theirs, err, eval_dtype, (kind, msg) in pools.run(2, float_inputs):
        assert all(abs(a - b) < 1e-6 * max(1, abs(b)) for a, b in zip(ours, theirs)), (ours,
                                                                                        theirs)
        assert err < 1e-6, err
        assert eval_dtype == torch.bfloat16  # eval_step's fs.call casts too
        assert kind == "RuntimeError" and "dtype" in msg, (kind, msg)  # cast_inputs=False


def sparse_embedding(spec):
    """nn.Embedding(sparse=True): its sparse gradient is made dense, so the step trains as
    the same model with sparse=False in one process (SGD with momentum, 3 steps)."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4, sparse=True), torch.nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    ref[0].sparse = False
    step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]).sum(1), b[1]),
                         fs.optim.sgd(lr=0.1, momentum=0.9))
    state = step.init(fs.shard(fs.params(model), m))
    topt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randint(0, 11, (2 * world, 5), generator=g), torch.randn(2 * world, 3)
        state, _ = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
        topt.zero_grad()
        F.mse_loss(ref(x).sum(1), y).backward()
        topt.step()
    full = fs.unshard(state.params)
    return max((full[k] - v).abs().max().item() for k, v in ref.named_parameters())


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_sparse_embedding_gradients_train_as_dense(pools, spec):
    for err in pools.run(spec, sparse_embedding):
        assert err < 1e-6, err


def fsdp2_parity(spec, raf):
    """The same GPT trained with FSDP2 fully_shard per block gives the same losses."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_fn, kind = build("gpt")
    theirs = fsdp2_twin(model, m, reshard_after_forward=raf)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    step = fs.train_step(loss_fn, fs.optim.adamw(lr=1e-2),
                         policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    ours_curve, fsdp_curve = [], []
    for b in batches(kind, world, 2, 4):
        local = tuple(x[rank * 2:(rank + 1) * 2] for x in b)
        state, metrics = step(state, local)
        ours_curve.append(metrics["loss"])
        loss = F.cross_entropy(theirs(local[0]).flatten(0, 1), local[1].flatten())
        fsdp_curve.append(torch_step(topt, loss))
    return ours_curve, fsdp_curve


@pytest.mark.parametrize("spec,raf", [(2, True), (3, False), ("2x2", True)], ids=str)
def test_matches_fsdp2(pools, spec, raf):
    for ours, theirs in pools.run(spec, fsdp2_parity, raf):
        assert all(abs(a - b) < 1e-5 * max(1, abs(b)) for a, b in zip(ours, theirs)), (ours,
                                                                                        theirs)


def memory(spec, raf, blocks=8):
    """Unsharded-parameter peak of an 8-block transformer: the step's own count, and every
    live tensor storage sampled at each op during the forward (where no gradient exists yet)."""
    from funshard.testing import LiveMemory

    m = mesh(spec)
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=64, heads=4, layers=blocks, seq=8)
    fwd = LiveMemory()

    def loss_fn(params, batch):  # measure the forward only: gathers happen in here
        with fwd:
            return gpt_loss(model)(params, batch)

    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.01),
                         policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 32, (1, 8), generator=g), torch.randint(0, 32, (1, 8), generator=g))
    state, _ = step(state, batch)  # learn the order (prefetch starts on step 2)
    fwd.peak = 0
    with LiveMemory() as whole:
        state, metrics = step(state, batch)
    block_bytes = sum(p.numel() * 4 for p in model.layers[0].parameters())
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    return dict(groups=metrics["unsharded_groups_peak"], bytes=metrics["unsharded_bytes_peak"],
                fwd_peak=fwd.peak, step_peak=whole.peak, block=block_bytes, model=model_bytes)


def test_full_shard_keeps_about_two_blocks_unsharded(pools):
    full_shard, grad_op = (pools.run(2, memory, raf)[0] for raf in (True, False))
    block, model = full_shard["block"], full_shard["model"]
    # the step's own count: the computing group and the prefetched one
    assert full_shard["groups"] == 2 and full_shard["bytes"] <= 2 * block + 1024, full_shard
    assert grad_op["bytes"] >= 0.95 * model  # SHARD_GRAD_OP keeps everything until backward
    # independent: every live storage in the forward (same activations in both runs), so
    # the difference is parameter memory: SHARD_GRAD_OP holds the whole model, FULL_SHARD
    # the computing block, the prefetched one's in-flight buffers and one shard-size input
    assert grad_op["fwd_peak"] >= model, grad_op
    unsharded_fs = model - (grad_op["fwd_peak"] - full_shard["fwd_peak"])
    assert unsharded_fs <= 2.6 * block, (unsharded_fs / block, full_shard, grad_op)


# -- bad input ---------------------------------------------------------------------------


def step_errors(spec):
    m = mesh(spec)
    model, loss_fn, kind = build("mlp")
    params = fs.shard(fs.params(model), m)
    cases = {}

    def case(name, fn):
        cases[name] = capture(fn)

    x, y = torch.randn(3, 5), torch.randn(3, 3)
    vec = fs.train_step(lambda p, b: (torch.func.functional_call(model, p, (b[0],)) - b[1]) ** 2,
                        fs.optim.sgd(lr=0.1))
    case("vector_loss", lambda: vec(vec.init(params), (x, y)))
    acc = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1), policy=fs.Policy(accumulate=2))
    case("batch_split", lambda: acc(acc.init(params), (x, y)))
    case("accumulate", lambda: fs.Policy(accumulate=0))
    case("clip", lambda: fs.Policy(clip_norm=-1.0))
    case("dtype", lambda: fs.Policy(param_dtype=torch.int32))
    plain = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1))
    case("unsharded", lambda: plain.init(fs.params(model)))
    # a failed step leaves the state usable: the same state then trains fine
    case("after_failure", lambda: plain(plain.init(params), (x, y)))
    return cases


def test_step_errors(pools):
    cases = pools.run(2, step_errors)[0]
    t, msg = cases["vector_loss"]
    assert t == "ValueError" and "scalar" in msg and "(3, 3)" in msg and ".mean()" in msg
    t, msg = cases["batch_split"]
    assert t == "ValueError" and "batch['0']" in msg and "(3, 5)" in msg and "accumulate=2" in msg
    assert cases["accumulate"][0] == "ValueError" and "accumulate=0" in cases["accumulate"][1]
    assert cases["clip"][0] == "ValueError" and "clip_norm=-1.0" in cases["clip"][1]
    assert cases["dtype"][0] == "ValueError" and "param_dtype=torch.int32" in cases["dtype"][1]
    t, msg = cases["unsharded"]
    assert t == "TypeError" and "'inp.weight'" in msg and "fs.shard" in msg
    assert cases["after_failure"] == (None, "no error")


def test_default_groups():
    assert fs.step.default_group("layers.3.attn.wq") == "layers.3"
    assert fs.step.default_group("0.in_proj.weight") == "0"
    assert fs.step.default_group("transformer.h.11.mlp.w") == "transformer.h.11"
    assert fs.step.default_group("wte.weight") == ""


def custom_groups(spec):
    m = mesh(spec)
    model, loss_fn, kind = build("gpt")
    counts = {}
    for name, groups in {
        "callable": lambda fqn: "blocks" if fqn.startswith("layers.") else "rest",
        "prefix": {k: ("a" if i % 2 else "b") for i, k in enumerate(fs.params(model))},
        "one": "everything",
    }.items():
        step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1), policy=fs.Policy(groups=groups))
        state = step.init(fs.shard(fs.params(model), m))
        b = batches(kind, 2, 2, 1)[0]
        with CountCollectives() as cc:
            step(state, tuple(x[:2] for x in b))
        counts[name] = dict(cc.counts)
    return counts


def test_custom_groups(pools):
    counts = pools.run(2, custom_groups)[0]
    # 2 groups used rest -> blocks -> rest: 3 forward gathers + 1 in backward (the head's
    # group stays gathered), one reduce-scatter each
    assert counts["callable"]["reduce_scatter"] == 2
    assert counts["prefix"]["reduce_scatter"] == 2
    assert counts["one"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}


def nonfinite(spec):
    m = mesh(spec)
    rank = dist.get_rank()
    model, loss_fn, kind = build("mlp")

    poison = float("nan") if rank == 1 else 0.0

    def poisoned(params, batch):  # on rank 1 only, layers.1's gradient is NaN
        # every rank runs the same ops (the same groups, in the same order), values differ
        return loss_fn(params, batch) + 0 * (params["layers.1.0.weight"] * poison).sum()

    out = {}
    for skip in (True, False):
        step = fs.train_step(poisoned, fs.optim.adamw(lr=0.1),
                             policy=fs.Policy(skip_nonfinite=skip))
        state = step.init(fs.shard(fs.params(model), m))
        before = {k: v.to_local().clone() for k, v in state.params.items()}
        x, y = torch.randn(2, 5), torch.randn(2, 3)
        try:  # (the refusal comes at the first read of the step's metrics)
            new, metrics = step(state, (x, y))
            out[skip] = ("ok", metrics["skipped"], new.step)
            state = new
        except FloatingPointError as e:  # the state passed in is usable again
            out[skip] = ("raised", str(e), state.step)
        out[(skip, "unchanged")] = all(torch.equal(before[k], v.to_local())
                                       for k, v in state.params.items())
    return out


def test_nonfinite_gradients_skip_or_raise(pools):
    for r in pools.run(2, nonfinite):
        assert r[True] == ("ok", 1, 1) and r[(True, "unchanged")]
        kind, msg, step = r[False]
        assert kind == "raised" and "'layers.1.0.weight'" in msg and "(7, 7)" in msg
        assert "skip_nonfinite=True" in msg and "unchanged" in msg and r[(False, "unchanged")]


def skipped_steps(spec):
    """A NaN gradient on rank 1 at step 0, skipped; then 3 steps. One torch process on the
    full batches skips ``optimizer.step()`` there, as a GradScaler does."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for opt_name in ("adamw", "sgd"):
        model, loss_fn, kind = build("mlp")
        ref = copy.deepcopy(model)
        poison = [0.0]

        def poisoned(params, batch):
            return loss_fn(params, batch) + 0 * (params["layers.1.0.weight"]
                                                 * (poison[0] if rank == 1 else 0.0)).sum()

        opt, topt = optimizers(opt_name, list(ref.parameters()))
        step = fs.train_step(poisoned, opt, policy=fs.Policy(skip_nonfinite=True))
        state = step.init(fs.shard(fs.params(model), m))
        skips = []
        for j, (x, y) in enumerate(batches(kind, world, 2, 4)):
            poison[0] = float("nan") if j == 0 else 0.0
            state, mt = step(state, (x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]))
            skips.append(mt["skipped"])
            if j > 0:  # the reference's step 0 is skipped: no optimizer.step()
                topt.zero_grad()
                F.mse_loss(ref(x), y).backward()
                topt.step()
        full = fs.unshard(state.params)
        out[opt_name] = (skips, state.step, state.skipped,
                         max((full[k] - v).abs().max().item()
                             for k, v in ref.named_parameters()))
    return out


def test_a_skipped_step_does_not_count_in_the_optimizer(pools):
    """Adam's bias correction and SGD's first momentum step count applied updates, as torch's
    do when a GradScaler skips optimizer.step(): after a skip at step 0 the parameters are
    one torch process's that never took that step."""
    for r in pools.run(2, skipped_steps):
        for name, (skips, n, skipped, err) in r.items():
            assert skips == [1, 0, 0, 0] and (n, skipped) == (4, 1), (name, skips, n, skipped)
            assert err < 1e-6, (name, err)


def policy_sugar(spec):
    """Policy(clip_norm=, skip_nonfinite=) against the same transforms written in the chain,
    and against from_torch (an optimizer that is not a chain)."""
    m = mesh(spec)
    rank = dist.get_rank()
    model, loss_fn, kind = build("mlp")
    poison = [0.0]

    def poisoned(params, batch):  # a NaN gradient on rank 1 when poison[0] is NaN
        return loss_fn(params, batch) + 0 * (params["layers.1.0.weight"]
                                             * (poison[0] if rank == 1 else 0.0)).sum()

    O = fs.optim
    runs = {
        "policy": (O.adamw(1e-2), fs.Policy(clip_norm=0.05, skip_nonfinite=True)),
        "chain": (O.chain(O.clip_by_global_norm(0.05), O.adamw(1e-2)),
                  fs.Policy(skip_nonfinite=True)),
        "torch": (O.from_torch(torch.optim.AdamW, lr=1e-2),
                  fs.Policy(clip_norm=0.05, skip_nonfinite=True)),
    }
    data = batches(kind, dist.get_world_size(), 2, 3)
    out = {}
    for name, (opt, policy) in runs.items():
        step = fs.train_step(poisoned, opt, policy=policy)
        state = step.init(fs.shard(fs.params(model), m))
        metrics, counts = [], []
        for j, b in enumerate(data):
            poison[0] = float("nan") if j == 1 else 0.0
            local = tuple(x[rank * 2:(rank + 1) * 2] for x in b)
            before = {k: v.to_local().clone() for k, v in state.params.items()}
            with CountCollectives() as cc:
                state, mt = step(state, local)
            unchanged = all(torch.equal(before[k], v.to_local()) for k, v in state.params.items())
            metrics.append((mt["skipped"], repr(mt["grad_norm"]), unchanged))  # nan == nan
            counts.append(dict(cc.counts))
        out[name] = dict(metrics=metrics, counts=counts,
                         params={k: v.to_local().clone() for k, v in state.params.items()})
    return out


def test_policy_clip_and_skip_are_the_transforms(pools):
    """Policy(clip_norm=, skip_nonfinite=) builds clip_by_global_norm / apply_if_finite: the
    same parameters bit for bit, the same metrics, and no collective beyond the metrics'
    all-reduce; the skipped step leaves the parameters unchanged."""
    for r in pools.run(2, policy_sugar):
        pol, ch, th = r["policy"], r["chain"], r["torch"]
        assert [x[0] for x in pol["metrics"]] == [0, 1, 0]
        assert pol["metrics"][1][2] and not pol["metrics"][0][2]  # skipped step: unchanged
        assert float(pol["metrics"][0][1]) > 0.05 and pol["metrics"][1][1] == "nan"  # clipped
        assert pol["metrics"] == ch["metrics"] == th["metrics"]
        assert pol["counts"] == ch["counts"] == th["counts"], (pol["counts"], ch["counts"])
        assert all(c["all_reduce"] == 1 for c in pol["counts"]), pol["counts"]
        for k, v in pol["params"].items():  # a skip is not in either optimizer's count
            assert torch.equal(v, ch["params"][k]), k
            torch.testing.assert_close(v, th["params"][k], rtol=1e-6, atol=1e-7)


def step_peaks(spec, blocks=8):
    """Live tensor peak of one FULL_SHARD step (all storages, regrown ones included), funshard
    and FSDP2 (fully_shard per block) on the same GPT, AdamW, same batch."""
    from funshard.testing import LivePeak

    m = mesh(spec)
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=64, heads=4, layers=blocks, seq=8)
    theirs = fsdp2_twin(model, m)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=True)
    step = fs.train_step(gpt_loss(model), fs.optim.adamw(lr=1e-3))
    state = step.init(fs.shard(fs.params(model), m))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))

    def fsdp2_step():
        F.cross_entropy(theirs(batch[0]).flatten(0, 1), batch[1].flatten()).backward()
        topt.step()
        topt.zero_grad()

    peaks = {}
    for name, run in (("funshard", lambda: step(state, batch)), ("fsdp2", fsdp2_step)):
        for _ in range(2):  # learn the order; create the optimizer state
            out = run()
            if name == "funshard":
                state = out[0]
        gc.collect()
        with LivePeak(torch.device("cpu")) as live:
            out = run()
        if name == "funshard":
            state = out[0]
        peaks[name] = live.peak
    return peaks, sum(p.numel() * 4 for p in model.layers[0].parameters())


def test_full_shard_step_peak_below_fsdp2(pools):
    """Backward prefetches the next block only once half the current one is consumed, drops
    each parameter after its last use and moves each gradient to the reduce buffer as it
    completes; FSDP2 prefetches at each block's start and holds the block's parameters and
    gradients until it ends. The whole step's live peak (on 2 ranks: 6.4 MB against 8.8 MB)
    must stay at least half a block under FSDP2's."""
    peaks, block = pools.run(2, step_peaks)[0]
    assert peaks["funshard"] <= peaks["fsdp2"] - block / 2, (peaks, block)


def runs_alive(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, heads=2, layers=2, seq=8)
    step = fs.train_step(gpt_loss(model), fs.optim.adamw(lr=1e-3))
    state = step.init(fs.shard(fs.params(model), m))
    batch = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    gc.collect()  # runs other tests left behind (a failing step keeps its traceback) don't count
    before = {id(o) for o in gc.get_objects()
              if not isinstance(o, weakref.ProxyTypes) and isinstance(o, fs.step.Run)}
    for _ in range(3):
        state, _ = step(state, batch)
    gc.collect()
    return sum(not isinstance(o, weakref.ProxyTypes) and isinstance(o, fs.step.Run)
               and id(o) not in before for o in gc.get_objects())


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_no_step_state_outlives_the_step(pools, spec):
    """A run kept alive through an autograd node it still held leaked ~0.5 MB/step of
    resident memory in the demo; after the step nothing of it may remain."""
    assert pools.run(spec, runs_alive) == [0] * fs.testing.world_of(spec)
