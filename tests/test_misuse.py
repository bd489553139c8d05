"""Misuse is loud: what would train wrong, or not at all, raises on every rank with a message
that names the cause and the fix, and leaves the state as it was."""

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard.testing import capture, mesh, stepped
from funshard.testing.models import MLP, mse_loss


def _setup(spec, seed=0, **policy):
    m = mesh(spec)
    torch.manual_seed(seed)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    step = fs.train_step(mse_loss(model), fs.optim.adamw(lr=1e-2), policy=fs.Policy(**policy))
    state = step.init(fs.shard(fs.params(model), m))
    g = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    batch = (torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g))
    return model, step, state, batch


def _locals(state):
    return {k: v.to_local().clone() for k, v in state.params.items()}


def _unchanged(before, state):
    return all(torch.equal(before[k], v.to_local()) for k, v in state.params.items())


def step_misuse(spec):
    """Each probe: (exception type, message, the parameters unchanged)."""
    model, step, state, batch = _setup(spec)
    out = {}

    def probe(name, fn, st):
        before = _locals(st)
        out[name] = (*capture(fn), _unchanged(before, st))

    state2, _ = step(state, batch)
    probe("donated", lambda: step(state, batch), state2)
    state3, _ = step(state2, batch)  # the returned state goes on training
    out["after_donated"] = state3.step

    def loss_of(fn):
        return fs.train_step(fn, fs.optim.adamw(lr=1e-2))

    detached = loss_of(lambda p, b: mse_loss(model)(p, b).detach())
    probe("detached", lambda: detached(detached.init(state3.params), batch), state3)
    constant = loss_of(lambda p, b: (b[0] * torch.ones(5, requires_grad=True)).sum())
    probe("no_params", lambda: constant(constant.init(state3.params), batch), state3)
    nan_loss = loss_of(lambda p, b: mse_loss(model)(p, b) + float("nan"))
    probe("nan_loss", lambda: stepped(nan_loss, nan_loss.init(state3.params), batch), state3)

    def inference():
        with torch.inference_mode():
            return step(state3, batch)
    probe("inference_mode", inference, state3)
    return out


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
def test_step_misuse_raises_everywhere(pools, spec):
    for rank, r in enumerate(pools.run(spec, step_misuse)):
        t, msg, unchanged = r["donated"]
        assert t == "ValueError" and "was donated" in msg and "step 0" in msg, (rank, msg)
        assert "returned the state at step 1" in msg and unchanged
        assert r["after_donated"] == 2
        t, msg, unchanged = r["detached"]
        assert t == "ValueError" and "does not require grad" in msg and unchanged, msg
        t, msg, unchanged = r["no_params"]
        assert t == "ValueError" and "no trainable parameter received a gradient" in msg, msg
        assert unchanged
        t, msg, unchanged = r["nan_loss"]
        assert t == "FloatingPointError" and "the loss is nan" in msg and unchanged, msg
        assert "skip_nonfinite=True" in msg
        t, msg, unchanged = r["inference_mode"]
        assert t == "RuntimeError" and "inference_mode" in msg and unchanged, msg


def no_grad_trains(spec):
    """Under torch.no_grad() the step trains exactly as outside it."""
    results = []
    for ctx in (torch.no_grad, torch.enable_grad):
        _, step, state, batch = _setup(spec)
        with ctx():
            state, metrics = step(state, batch)
        results.append((metrics["loss"], _locals(state)))
    (l0, p0), (l1, p1) = results
    return l0 == l1 and all(torch.equal(p0[k], p1[k]) for k in p0)


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_step_under_no_grad_trains(pools, spec):
    assert all(pools.run(spec, no_grad_trains))


def empty_batch(spec):
    """Rank 1's local batch is empty: every rank raises, naming the empty batch on the rank
    that has it; no NaN update is applied."""
    _, step, state, batch = _setup(spec)
    if dist.get_rank() == 1:
        batch = (batch[0][:0], batch[1][:0])
    before = _locals(state)
    t, msg = capture(lambda: stepped(step, state, batch))
    return t, msg, _unchanged(before, state)


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_empty_local_batch_raises_on_every_rank(pools, spec):
    for rank, (t, msg, unchanged) in enumerate(pools.run(spec, empty_batch)):
        assert t == "FloatingPointError" and unchanged, (rank, t, msg)
        assert ("batch['0'] is empty" in msg) == (rank == 1), (rank, msg)
        assert "empty local batch" in msg


def empty_batch_skipped(spec):
    _, step, state, batch = _setup(spec, skip_nonfinite=True)
    if dist.get_rank() == 1:
        batch = (batch[0][:0], batch[1][:0])
    before = _locals(state)
    state, metrics = step(state, batch)
    return metrics["skipped"], state.step, _unchanged(before, state)


def test_empty_local_batch_skipped_with_skip_nonfinite(pools):
    for r in pools.run(2, empty_batch_skipped):
        assert r == (1, 1, True), r


def option_misuse(spec):
    m = mesh(spec)
    sp = fs.shard({"w": torch.randn(4, 3), "layers.0.b": torch.randn(3)}, m)
    cases = {
        "unshard_int": lambda: fs.unshard(sp, param_dtype=torch.int32),
        "unshard_reduce_int": lambda: fs.unshard(sp, reduce_dtype=torch.int64),
        "reduce_int": lambda: fs.reduce_grads({"w": torch.ones(4, 3), "layers.0.b": None},
                                              like=sp, reduce_dtype=torch.int8),
        "reduce_op": lambda: fs.reduce_grads({"w": torch.ones(4, 3), "layers.0.b": None},
                                             like=sp, op="max"),
        "raf_str": lambda: fs.Policy(reshard_after_forward="no"),
        "dtype_str": lambda: fs.Policy(param_dtype="bf16"),
        "clip_bool": lambda: fs.Policy(clip_norm=True),
        "clip_inf": lambda: fs.Policy(clip_norm=float("inf")),
        "prefetch_int": lambda: fs.Policy(prefetch=1),
        "accumulate_bool": lambda: fs.Policy(accumulate=True),
        "groups_int": lambda: fs.Policy(groups=3),
        "transport": lambda: fs.Policy(transport="nccl"),
        "groups_raises": lambda: fs.train_step(lambda p, b: 0, fs.optim.sgd(lr=0.1),
                                               policy=fs.Policy(groups=lambda n: {}[n])).init(sp),
        "groups_not_str": lambda: fs.train_step(lambda p, b: 0, fs.optim.sgd(lr=0.1),
                                                policy=fs.Policy(groups=lambda n: 3)).init(sp),
    }
    return {k: capture(fn) for k, fn in cases.items()}


EXPECT = {
    "unshard_int": ("ValueError", "unshard: param_dtype=torch.int32 must be a floating"),
    "unshard_reduce_int": ("ValueError", "unshard: reduce_dtype=torch.int64 must be a floating"),
    "reduce_int": ("ValueError", "reduce_grads: reduce_dtype=torch.int8 must be a floating"),
    "reduce_op": ("ValueError", "reduce_grads: op='max'; use 'mean' or 'sum'"),
    "raf_str": ("TypeError", "Policy: reshard_after_forward='no' must be True or False"),
    "dtype_str": ("ValueError", "Policy: param_dtype='bf16' must be a floating torch.dtype"),
    "clip_bool": ("ValueError", "Policy: clip_norm=True must be a number > 0"),
    "clip_inf": ("ValueError", "Policy: clip_norm=inf must be a number > 0"),
    "prefetch_int": ("TypeError", "Policy: prefetch=1 must be True or False"),
    "accumulate_bool": ("ValueError", "Policy: accumulate=True must be an int >= 1"),
    "groups_int": ("TypeError", "Policy: groups=3 must be None, a callable"),
    "transport": ("ValueError", "Policy: transport='nccl'; use one of"),
    "groups_raises": ("ValueError", "Policy.groups raised for parameter 'w': KeyError"),
    "groups_not_str": ("TypeError", "Policy.groups gave 3 for parameter 'w'"),
}


@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_options_are_validated(pools, spec):
    for rank, got in enumerate(pools.run(spec, option_misuse)):
        for name, (t, text) in EXPECT.items():
            assert got[name][0] == t and text in got[name][1], (rank, name, got[name])


def disagreeing_init(spec, what):
    """One rank was given something else: every rank raises the same error at init."""
    m = mesh(spec)
    rank = dist.get_rank()
    torch.manual_seed(rank if what == "unseeded" else 0)
    hidden = 8 if (what == "shape" and rank == 1) else 7
    model = MLP(dim=5, hidden=hidden, layers=2, out=3)
    params = fs.params(model)
    policy = {}
    if what == "policy" and rank == 1:
        policy = {"param_dtype": torch.bfloat16}
    if what == "groups" and rank == 1:
        policy = {"groups": lambda n: "all"}
    if what == "keep_dtype":  # rank 1 keeps another leaf in its own dtype
        policy = {"param_dtype": torch.bfloat16,
                  "keep_dtype": (lambda n: n == "inp.bias") if rank else (lambda n: False)}
    if what == "replicated":  # a 0-d leaf is replicated on every rank
        params = {**params, "scale": torch.tensor(float(rank))}
    if what == "replicated_imaginary":  # the same real part on every rank, not the same value
        params = {**params, "phase": torch.tensor(complex(1.0, float(rank)))}
    step = fs.train_step(mse_loss(model), fs.optim.sgd(lr=0.1), policy=fs.Policy(**policy))
    return capture(lambda: step.init(fs.shard(params, m)))


DISAGREE = {
    "shape": ("2", "ranks disagree on parameter 'inp.weight': rank 0 has shape (7, 5)"),
    "policy": ("2", "ranks disagree on Policy.param_dtype: rank 0 has None, rank 1 has "
                    "torch.bfloat16"),
    "groups": ("2", "rank 1 has shape (7, 5), torch.float32, trainable, group 'all'"),
    "keep_dtype": ("2", "ranks disagree on parameter 'inp.bias': rank 0 has shape (7,), "
                        "torch.float32, trainable, group '', computes in torch.bfloat16, rank 1 "
                        "has shape (7,), torch.float32, trainable, group '', computes in "
                        "torch.float32"),
    "unseeded": ("2x2", "differs between rank 0 and rank 2 (the same shard on two replicas"),
    "replicated": ("2", "parameter 'scale' (shape ()) differs between rank 0 and rank 1 "
                        "(a replicated parameter"),
    "replicated_imaginary": ("2", "parameter 'phase' (shape ()) differs between rank 0 and "
                                  "rank 1 (a replicated parameter"),
}


@pytest.mark.parametrize("what", list(DISAGREE))
def test_ranks_agree_at_init(pools, what):
    spec, text = DISAGREE[what]
    spec = int(spec) if spec.isdigit() else spec
    results = pools.run(spec, disagreeing_init, what)
    for rank, (t, msg) in enumerate(results):
        assert t == "ValueError" and text in msg, (rank, msg)
        assert msg == results[0][1]  # the same message on every rank


def seeded_1d_any_values(spec):
    """A 1-D mesh: each rank keeps its own rows, so differently seeded ranks still make one
    consistent model; nothing to refuse."""
    torch.manual_seed(dist.get_rank())
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    step = fs.train_step(mse_loss(model), fs.optim.sgd(lr=0.1))
    return capture(lambda: step.init(fs.shard(fs.params(model), mesh(spec))))


def test_one_dimensional_mesh_accepts_any_sharded_values(pools):
    assert pools.run(2, seeded_1d_any_values) == [(None, "no error")] * 2


# -- what the step cannot make correct yet is refused by name, never trained wrong ---------


def unsupported(spec, what):
    """loss_fn does something whose result the stand-in cannot make equal to one process."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    m = mesh(spec)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    tree = fs.params(model)

    def out(p, x):
        return torch.func.functional_call(model, p, (x,))

    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a)
            return a @ w.t()

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return None, g.t() @ a

    def backward_in_loss_fn(p, b):
        loss = torch.nn.functional.mse_loss(out(p, b[0]), b[1])
        loss.backward(retain_graph=True)  # the step differentiates the loss again
        return loss

    def in_place(p, b):
        p["2.bias" if what == "in_place" else "0.bias"].add_(1.0)
        return torch.nn.functional.mse_loss(out(p, b[0]), b[1])

    losses = {
        # the model checkpoints inside its forward; functional_call has put its own weights
        # back by the time backward recomputes
        "checkpoint": lambda p, b: torch.nn.functional.mse_loss(
            torch.func.functional_call(ckpt, p, (b[0],)), b[1]),
        "checkpoint_reentrant": lambda p, b: torch.nn.functional.mse_loss(
            torch.func.functional_call(ckpt, p, (b[0].requires_grad_(),)), b[1]),
        "custom_function": lambda p, b: Mul.apply(b[0], p["0.weight"]).pow(2).mean(),
        # functional_call does not cast the input to Policy(param_dtype=): fs.call does
        "uncast_input": lambda p, b: torch.nn.functional.mse_loss(out(p, b[0]).float(), b[1]),
        "in_place": in_place,
        "in_place_frozen": in_place,
        "batchnorm_buffers": lambda p, b: torch.nn.functional.mse_loss(out(p, b[0]), b[1]),
        "backward_in_loss_fn": backward_in_loss_fn,
    }
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return checkpoint(self.net, x, use_reentrant=what == "checkpoint_reentrant")

    ckpt = Checkpointed()
    if what.startswith("checkpoint"):
        tree = fs.params(ckpt)
    if what == "in_place_frozen":
        model[0].bias.requires_grad_(False)
        tree = fs.params(model)
    if what == "batchnorm_buffers":
        tree = {**tree, "1.running_mean": model[1].running_mean,
                "1.running_var": model[1].running_var}
    policy = fs.Policy(param_dtype=torch.bfloat16 if what == "uncast_input" else None)
    step = fs.train_step(losses[what], fs.optim.sgd(lr=0.1), policy=policy)
    state = step.init(fs.shard(tree, m))
    before = _locals(state)
    g = torch.Generator().manual_seed(1)
    t, msg = capture(lambda: step(state, (torch.randn(4, 4, generator=g),
                                          torch.randn(4, 2, generator=g))))
    return t, msg, _unchanged(before, state)


UNSUPPORTED = {
    "checkpoint": "Call the module with fs.call(model, params, *args)",
    "checkpoint_reentrant": "Call the module with fs.call(model, params, *args)",
    "custom_function": "was given to a torch.autograd.Function",
    "uncast_input": "met parameter '0.weight', cast to Policy(param_dtype=torch.bfloat16), and "
                    "a tensor of another dtype",
    "in_place": "loss_fn wrote into parameter '2.bias' in place",
    "in_place_frozen": "loss_fn wrote into parameter '0.bias' in place",
    "batchnorm_buffers": "'1.running_mean' is a BatchNorm running statistic",
    "backward_in_loss_fn": "received gradients while loss_fn was running",
}


@pytest.mark.parametrize("what", list(UNSUPPORTED))
def test_unsupported_is_refused_by_name(pools, what):
    for rank, (t, msg, unchanged) in enumerate(pools.run(2, unsupported, what)):
        assert t in ("NotImplementedError", "RuntimeError"), (rank, t, msg)
        assert UNSUPPORTED[what] in msg and unchanged, (rank, msg)


@pytest.mark.parametrize("what", ["checkpoint", "checkpoint_reentrant"])
def test_stale_recompute_is_refused_on_one_rank(pools, what):
    """The direct path (one rank, no cast) sees no checkpoint region in forward: its backward
    runs under the guard all the same, which refuses a recompute of the module's own
    weights (functional_call put them back) by name."""
    for t, msg, unchanged in pools.run(1, unsupported, what):
        assert t == "NotImplementedError" and unchanged, (t, msg)
        assert UNSUPPORTED[what] in msg, msg


@pytest.mark.parametrize("what", ["in_place", "in_place_frozen", "backward_in_loss_fn"])
def test_in_place_is_refused_on_one_rank(pools, what):
    """A world of one with no cast computes on the shards themselves (the direct path): a
    write into a parameter would change the state outside the optimizer; the parameters
    are autograd leaves there, so a backward inside loss_fn would fill their gradients."""
    for t, msg, unchanged in pools.run(1, unsupported, what):
        assert t == "RuntimeError", (t, msg)
        if what == "in_place":  # autograd refuses it before the write (its own error)
            assert unchanged, msg
        else:
            assert UNSUPPORTED[what] in msg, msg
        if what == "backward_in_loss_fn":
            assert unchanged


def escaped_param(spec):
    """loss_fn keeps a parameter it received; rank 0 alone uses it after the step. The
    stand-in of an ended step must raise by name there, not start a gather the other ranks
    never join (it aborted a rank of the reused test worker once)."""
    model, step, state, batch = _setup(spec)
    kept = {}

    def loss_fn(p, b):
        kept.update(p)
        return mse_loss(model)(p, b)

    keeper = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1))
    state, _ = keeper(keeper.init(state.params), batch)
    import gc
    gc.collect()
    escaped = [v for v in kept.values() if isinstance(v, fs.step.lazy.LazyParam)]
    t, msg = capture(lambda: escaped[0] * 2) if dist.get_rank() == 0 else (None, None)
    dist.barrier()  # the other rank is still in step with this one
    return len(escaped), t, msg


def test_parameter_escaping_loss_fn_is_inert(pools):
    (n, t, msg), (n1, _, _) = pools.run(2, escaped_param)
    assert n == n1 > 0  # what escaped is an unbound stand-in, on every rank
    assert t == "RuntimeError" and "has ended" in msg and "'inp.weight'" in msg, msg


def aux_graph_after_the_step(spec, force):
    """loss_fn returns an aux output whose graph saved a parameter on a branch the loss does
    not use; a backward through it after the step must raise by name (the gathered copy and
    the run are gone), on each rank alone, and leave the state as it was. ``force``: one
    rank with its collectives run, so its parameters are gathered copies too."""
    with fs.collectives.force_collectives(force):
        model, step, state, batch = _setup(spec)

        def loss_fn(p, b):
            return mse_loss(model)(p, b), (p["inp.weight"] * p["inp.weight"]).sum()

        keeper = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1))
        state, metrics = keeper(keeper.init(state.params), batch)
        before = _locals(state)
        t, msg = capture(lambda: metrics["aux"].backward())
        return t, msg, _unchanged(before, state)


@pytest.mark.parametrize("spec,force", [(2, False), (1, True)], ids=["two_ranks", "one_forced"])
def test_aux_graph_used_after_the_step_is_refused(pools, spec, force):
    for t, msg, same in pools.run(spec, aux_graph_after_the_step, force):
        assert t == "RuntimeError" and "'inp.weight' of a train_step that has ended" in msg, msg
        assert same


def branch_per_rank(spec, raf):
    """Rank 0 runs the MLP's two identical blocks in order, rank 1 the other way round: the
    all-gathers have equal sizes and would pair block 0 on one rank with block 1 on the
    other. The step's metrics all-reduce compares the gather orders: refused on every rank
    before any update."""
    m = mesh(spec)
    torch.manual_seed(0)
    model = MLP(dim=5, hidden=7, layers=2, out=3)
    rank = dist.get_rank()

    def loss_fn(p, b):
        h = torch.nn.functional.linear(b[0], p["inp.weight"], p["inp.bias"])
        for i in ((0, 1) if rank == 0 else (1, 0)):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(
                h, p[f"layers.{i}.0.weight"], p[f"layers.{i}.0.bias"]))
        return torch.nn.functional.mse_loss(
            torch.nn.functional.linear(h, p["head.weight"], p["head.bias"]), b[1])

    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1),
                         policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    before = _locals(state)
    g = torch.Generator().manual_seed(rank)
    t, msg = capture(lambda: stepped(step, state, (torch.randn(2, 5, generator=g),
                                                   torch.randn(2, 3, generator=g))))
    return t, msg, _unchanged(before, state)


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_ranks_gathering_in_different_orders_are_refused(pools, raf):
    for t, msg, same in pools.run(2, branch_per_rank, raf):
        assert t == "ValueError" and same, (t, msg)
        assert "the ranks gathered the parameter groups in different orders" in msg, msg

