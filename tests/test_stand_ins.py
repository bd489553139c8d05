"""Stand-ins ([Note: stand-ins] in funshard.step.lazy): a parameter loss_fn uses outside a
group module stays its stand-in, each op on it computes with the group's full tensor, a freed
group gathers again at its next op, and a custom autograd Function given a parameter (a
stand-in, or a tensor an op made of it) trains as one process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funshard as fs
from funshard.testing import capture, mesh
from funshard.testing.models import MLP, MatMulT


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _forward(p, x):
    """Layer 0 through plain ops (gathers the group), layer 2 through the custom Function."""
    h = torch.tanh(F.linear(x, p["0.weight"], p["0.bias"]))
    return MatMulT.apply(h, p["2.weight"]) + p["2.bias"]


def kinds(spec, raf):
    """What loss_fn holds and computes with: the types of the parameters it was given, and
    of what an op on one returns, at the start, after the first group's op, and after the
    second's; and the all-gathers of each step."""
    m = mesh(spec)
    model = _model()
    seen = []

    def loss_fn(p, b):
        seen.append(("start", type(p["0.weight"]), type(p["0.weight"].view_as(p["0.weight"]))))
        h = torch.tanh(F.linear(b[0], p["0.weight"], p["0.bias"]))
        seen.append(("after 0", type(p["0.weight"]), type(p["0.bias"] * 1)))
        y = F.linear(h, p["2.weight"], p["2.bias"])
        seen.append(("after 2", type(p["0.weight"]), type(p["2.weight"] + 0)))
        return F.mse_loss(y, b[1])

    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.1),  # two groups: "0" and "2"
                         policy=fs.Policy(reshard_after_forward=raf,
                                          groups=lambda fqn: fqn.split(".")[0]))
    state = step.init(fs.shard(fs.params(model), m))
    gathers = []
    for _ in range(2):
        with fs.testing.CountCollectives() as c:
            state, _ = step(state, (torch.randn(2, 4), torch.randn(2, 3)))
        gathers.append(c.counts["all_gather"])
    return [(w, a.__name__, b.__name__) for w, a, b in seen[-3:]], gathers


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_parameters_stay_stand_ins_and_ops_compute_on_plain_tensors(pools, raf):
    for got, gathers in pools.run(2, kinds, raf):
        assert got == [("start", "LazyParam", "Tensor"), ("after 0", "LazyParam", "Tensor"),
                       ("after 2", "LazyParam", "Tensor")]
        # one gather per group and step: group "0"'s backward saved no weight, and the last
        # group is kept into backward; ops after a group's first use gather nothing
        assert gathers == [2, 2], gathers


def _sgd_parity(spec, loss_fn, policy, steps=3, per_rank=2):
    """SGD through the step on the mesh vs one process on the concatenated batch: the
    largest parameter difference after ``steps`` steps."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    lf = loss_fn(model)
    ref = {n: p.detach().clone().requires_grad_(p.requires_grad)
           for n, p in model.named_parameters()}
    step = fs.train_step(lf, fs.optim.sgd(lr=0.1), policy=policy)
    state = step.init(fs.shard(fs.params(model), m))
    opt = torch.optim.SGD([p for p in ref.values() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(world * per_rank, 4, generator=g), torch.randn(world * per_rank, 3,
                                                                          generator=g)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        state, _ = step(state, (x[mine], y[mine]))
        opt.zero_grad()
        lf(ref, (x, y)).backward()
        opt.step()
    full = fs.unshard(state.params)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.items())


def custom_function_parity(spec, raf):
    return _sgd_parity(spec, lambda model: lambda p, b: F.mse_loss(_forward(p, b[0]), b[1]),
                       fs.Policy(reshard_after_forward=raf, groups=lambda fqn: "all"))


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_custom_function_on_a_gathered_parameter_trains_as_one_process(pools, spec, raf):
    for err in pools.run(spec, custom_function_parity, raf):
        assert err < 1e-5, err


def custom_function_first(spec):
    """The Function is the first to touch the group: refused by name, state unchanged."""
    m = mesh(spec)
    model = _model()
    step = fs.train_step(lambda p, b: F.mse_loss(
        MatMulT.apply(b[0], p["0.weight"]) + p["0.bias"], b[1][:, :1].expand(-1, 8)),
        fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), m))
    before = {k: v.to_local().clone() for k, v in state.params.items()}
    t, msg = capture(lambda: step(state, (torch.randn(2, 4), torch.randn(2, 3))))
    same = all(torch.equal(before[k], v.to_local()) for k, v in state.params.items())
    return t, msg, same


def test_custom_function_first_touch_is_refused(pools):
    for t, msg, same in pools.run(2, custom_function_first):
        assert t == "NotImplementedError" and "given to a torch.autograd.Function" in msg, msg
        assert "'0.weight'" in msg and same


def frozen_first_in_function(spec, raf):
    """A custom Function is the first to touch a group, through its frozen weight (saved
    as it is): the group still enters autograd, so its trainable bias trains."""

    def loss_fn(model):
        model[0].weight.requires_grad_(False)
        return lambda p, b: F.mse_loss(
            torch.tanh(MatMulT.apply(b[0], p["0.weight"]) + p["0.bias"]) @ p["2.weight"].t(),
            b[1])

    return _sgd_parity(spec, loss_fn, fs.Policy(reshard_after_forward=raf,
                                                 groups=lambda f: f.split(".")[0]))


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_custom_function_first_on_a_frozen_leaf_trains_the_group(pools, raf):
    for err in pools.run(2, frozen_first_in_function, raf):
        assert err < 1e-5, err


def no_grad_first(spec, raf):
    """A trainable weight's first use is under the user's own torch.no_grad() (a scale taken
    from its norm): that op takes no gradient, the rest of the loss trains as one process."""

    def loss_fn(model):
        def f(p, b):
            with torch.no_grad():
                scale = 1.0 / (1.0 + p["0.weight"].norm())
            h = torch.tanh(F.linear(b[0], p["0.weight"], p["0.bias"]) * scale)
            return F.mse_loss(F.linear(h, p["2.weight"], p["2.bias"]), b[1])
        return f

    return _sgd_parity(spec, loss_fn, fs.Policy(reshard_after_forward=raf,
                                                 groups=lambda f: f.split(".")[0]))


@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_first_use_under_no_grad_trains_as_one_process(pools, raf):
    for err in pools.run(2, no_grad_first, raf):
        assert err < 1e-5, err


def checkpoint_parity(spec, reentrant, as_input, groups, raf):
    """Checkpoint the second layer, its parameters read from loss_fn's dict inside the region
    or given as the region's inputs; in one group with the first layer (gathered before the
    region) or in a group of its own (first gathered inside it)."""
    from torch.utils.checkpoint import checkpoint

    def loss_fn(model):
        def f(p, b):
            h = torch.tanh(F.linear(b[0], p["0.weight"], p["0.bias"]))
            if as_input:
                y = checkpoint(lambda t, w, c: F.linear(t, w, c), h, p["2.weight"], p["2.bias"],
                               use_reentrant=reentrant)
            else:
                y = checkpoint(lambda t: F.linear(t, p["2.weight"], p["2.bias"]), h,
                               use_reentrant=reentrant)
            return F.mse_loss(y, b[1])
        return f

    group = (lambda f: "all") if groups == "one" else (lambda f: f.split(".")[0])
    try:
        return "trained", _sgd_parity(spec, loss_fn,
                                      fs.Policy(reshard_after_forward=raf, groups=group))
    except NotImplementedError as e:
        return "refused", str(e)


# what a reentrant region cannot make correct: its own backward runs the group's gradient
# hand-off (a group used outside it too), or autograd captured an unused stand-in itself
REFUSED = {
    ("one", False): "group 'all' is used inside a torch.utils.checkpoint(use_reentrant=True) "
                    "region and outside it",
    ("per_layer", True): "parameter '2.weight' was given to a torch.autograd.Function",
}


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("as_input", [False, True], ids=["closure", "as_input"])
@pytest.mark.parametrize("groups", ["one", "per_layer"])
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_checkpoint_region_trains_as_one_process(pools, reentrant, as_input, groups, raf):
    refused = REFUSED.get((groups, as_input)) if reentrant else None
    for what, got in pools.run(2, checkpoint_parity, reentrant, as_input, groups, raf):
        if refused:
            assert what == "refused" and refused in got, (what, got)
        else:
            assert what == "trained" and got < 1e-5, (what, got)


def profiled(spec, dtype, opts):
    """Three steps under torch.profiler (``opts``: record_shapes or with_stack, whose records
    hold C++ weak references to op inputs and module parameters, so a stand-in cannot swap
    back) against the same steps unprofiled: the same parameters, bit for bit, and the
    profile has the model's ops."""
    from torch.profiler import ProfilerActivity, profile

    m, rank = mesh(spec), dist.get_rank()
    out, seen = [], set()
    for prof in (False, True):
        model = _model()
        step = fs.train_step(lambda p, b: F.mse_loss(fs.call(model, p, b[0]).float(), b[1]),
                             fs.optim.adamw(1e-2),
                             policy=fs.Policy(param_dtype=dtype,
                                              groups=lambda f: f.split(".")[0]))
        state = step.init(fs.shard(fs.params(model), m))
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            b = (torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g))
            if not prof:
                state, _ = step(state, b)
                continue
            with profile(activities=[ProfilerActivity.CPU], **opts) as p:
                state, _ = step(state, b)
            seen |= {e.key for e in p.key_averages()}
        out.append(fs.unshard(state.params))
    return all(torch.equal(out[0][k], out[1][k]) for k in out[0]), "aten::tanh" in seen


@pytest.mark.parametrize("opts", [{"record_shapes": True}, {"with_stack": True}],
                         ids=["record_shapes", "with_stack"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", [1, 2], ids=str)
def test_a_profiled_step_trains_as_an_unprofiled_one(pools, spec, dtype, opts):
    for same, ops in pools.run(spec, profiled, dtype, opts):
        assert same and ops, (same, ops)


def profiled_on_rank_0(spec, policy, own=None, again=False, opts=None):
    """Three steps profiled on rank 0 alone (record_shapes, or ``opts``: its weak references
    keep rank 0's leaves from swapping back) against the same steps profiled nowhere: the
    same parameters, bit for bit; the ranks' collectives stay in step ([Note:
    rank-independent freeing] in funshard.step.group, [Note: demoted leaves] in
    funshard.step.binding; the direct transport names a rank that starts another).
    ``own``: every block checkpoints itself (torch.utils.checkpoint, "reentrant" or
    "non_reentrant"), whose recompute must gather on rank 0 too; ``again``: loss_fn uses a
    block's weight again after the model, when FULL_SHARD has freed its group."""
    import functools

    import torch.utils.checkpoint as cp
    from torch.profiler import ProfilerActivity, profile

    m, rank = mesh(spec), dist.get_rank()
    out = []
    for prof in (False, True):
        torch.manual_seed(0)
        model = MLP(dim=5, hidden=7, layers=3, out=3)  # a group per layer, the head apart
        for layer in model.layers if own else ():
            layer.forward = functools.partial(cp.checkpoint, layer.forward,
                                              use_reentrant=own == "reentrant")

        def loss_fn(p, b, model=model):
            loss = F.mse_loss(fs.call(model, p, b[0]).float(), b[1])
            return loss + p["layers.1.0.weight"].float().square().mean() if again else loss

        step = fs.train_step(loss_fn, fs.optim.adamw(1e-2), policy=fs.Policy(**policy))
        state = step.init(fs.shard(fs.params(model), m))
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            b = (torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g))
            if prof and rank == 0:
                with profile(activities=[ProfilerActivity.CPU],
                             **(opts or {"record_shapes": True})):
                    state, _ = step(state, b)
            else:
                state, _ = step(state, b)
        out.append(fs.unshard(state.params))
    return all(torch.equal(out[0][k], out[1][k]) for k in out[0])


POLICIES = {"full_shard": {}, "shard_grad_op": {"reshard_after_forward": False},
            "bf16": {"param_dtype": torch.bfloat16}, "accumulate": {"accumulate": 2},
            "no_prefetch": {"prefetch": False}, "cma": {"transport": "cma"},
            "checkpoint": {"checkpoint": True},
            "checkpoint_bf16": {"checkpoint": True, "param_dtype": torch.bfloat16}}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_step_profiled_on_one_rank_keeps_the_ranks_in_step(pools, policy):
    """Profiling rank 0 alone, a common way to profile, used to part the ranks' gathers:
    a group its weak references kept gathered there was gathered again on the others."""
    for rank, same in enumerate(pools.run(2, profiled_on_rank_0, policy)):
        assert same, rank


@pytest.mark.parametrize("own", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("policy", ["full_shard", "shard_grad_op", "bf16", "accumulate",
                                    "no_prefetch", "cma"])
def test_the_models_own_checkpointing_profiled_on_one_rank_keeps_the_ranks_in_step(
        pools, policy, own):
    """The model's own checkpoint regions recompute in backward with the leaves the
    profiler holds on rank 0: their ops must be seen there and gather as on rank 1 (they
    parted the ranks' collectives at the first recompute until 2026-11-25)."""
    for rank, same in enumerate(pools.run(2, profiled_on_rank_0, POLICIES[policy], own)):
        assert same, rank


@pytest.mark.parametrize("opts", [{"record_shapes": True}, {"with_stack": True}],
                         ids=["record_shapes", "with_stack"])
@pytest.mark.parametrize("policy", ["full_shard", "bf16", "checkpoint"])
def test_a_group_used_again_after_its_free_on_a_profiled_rank_gathers_again(pools, policy,
                                                                             opts):
    """A block's weight used again after the model (its group freed by FULL_SHARD) gathers
    again on the profiled rank too: the ranks' collectives part otherwise."""
    for rank, same in enumerate(pools.run(2, profiled_on_rank_0, POLICIES[policy], None,
                                          True, opts)):
        assert same, rank


def held(spec, dtype, how):
    """Three steps of a loss_fn that holds a parameter while its group is bound and past the
    group's free, against the same steps with nothing held: a weak reference (a cache keyed
    weakly by the weight; torch.compile's guards hold such ones), which keeps the leaf bound,
    whose unpadded tensor is then the stand-in object itself; or a view, read after the
    group is freed ([Note: rank-independent freeing]). The largest difference."""
    import weakref

    m, rank = mesh(spec), dist.get_rank()
    out = []
    for hold in (None, how):
        torch.manual_seed(0)
        model = MLP(dim=5, hidden=8, layers=3, out=3)
        refs = []

        def loss_fn(p, b, hold=hold, model=model, refs=refs):
            w = p["layers.1.0.weight"]
            z = (w * 0).sum()  # its group gathered and bound
            v = w.t()
            if hold == "weak":
                refs.append(weakref.ref(w))
            if hold != "view":
                z = z + v.sum() * 1e-3
            y = fs.call(model, p, b[0]).float()  # frees the group (FULL_SHARD)
            if hold == "view":  # read after the group's free
                z = z + v.sum() * 1e-3
            return F.mse_loss(y + z, b[1])

        step = fs.train_step(loss_fn, fs.optim.adamw(1e-2), policy=fs.Policy(param_dtype=dtype))
        state = step.init(fs.shard(fs.params(model), m))
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            state, _ = step(state, (torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)))
        out.append(fs.unshard(state.params))
    return max((out[0][k] - out[1][k]).abs().max().item() for k in out[0])


@pytest.mark.parametrize("how", ["weak", "view"])
@pytest.mark.parametrize("spec,dtype", [(1, torch.bfloat16), (2, None), (2, torch.bfloat16)],
                         ids=["1-bf16", "2-fp32", "2-bf16"])
def test_a_held_parameter_trains_as_one_not_held(pools, spec, dtype, how):
    for rank, err in enumerate(pools.run(spec, held, dtype, how)):
        assert err == 0.0 if how == "weak" else err < 1e-6, (rank, err)


def profiled_llama(spec, reentrant):
    """Hugging Face Llama with gradient_checkpointing_enable(), two AdamW steps profiled on
    rank 0 alone (record_shapes) against the same unprofiled: the same parameters."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    m, rank = mesh(spec), dist.get_rank()
    out = []
    for prof in (False, True):
        cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=36,
                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=32)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        step = fs.train_step(
            lambda p, ids, model=model: fs.call(model, p, input_ids=ids, labels=ids).loss,
            fs.optim.adamw(1e-2))
        state = step.init(fs.shard(fs.params(model), m))
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(2):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            if prof and rank == 0:
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
                    state, _ = step(state, ids)
            else:
                state, _ = step(state, ids)
        out.append(fs.unshard(state.params))
    return all(torch.equal(out[0][k], out[1][k]) for k in out[0])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_hugging_face_checkpointing_profiled_on_one_rank_keeps_the_ranks_in_step(pools,
                                                                                 reentrant):
    for rank, same in enumerate(pools.run(2, profiled_llama, reentrant)):
        assert same, rank
