"""``fs.train_step`` and ``fs.eval_step`` on meshes with the model's own dimensions: torch's
test Transformer tensor parallel (with and without sequence parallel), its mixture of
experts on "ep" (alone and with "tp"), and Hugging Face Llama with a tensor-parallel plan,
against one process on the whole batch, against FSDP2 + TP, and against the same step on a
plain data-parallel mesh (its collectives and its gathered-group peak)."""

import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

import funshard as fs
from funshard.testing import mesh
from test_ep import _moe
from test_tp import (_batch, _Collectives, _group_ranks, _llama, _llama_loss, _transformer,
                     fsdp2_llama, one_process)

POLICIES = {
    "full_shard": {},
    "shard_grad_op": {"reshard_after_forward": False},
    "checkpoint": {"checkpoint": True},
    "accumulate": {"accumulate": 2},
    "compiled_blocks": {"compile_blocks": True},  # torch.compile per block, as torchtitan
}


def _optimizer(name):
    return (fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adamw(1e-2))
            if name == "adamw" else fs.optim.sgd(0.5, momentum=0.9))


def _step_loss(model):
    def loss_fn(p, b):
        out = fs.call(model, p, b[0])
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), b[1].reshape(-1))
    return loss_fn


def stepped(spec, kind, policy, optimizer, sequence_parallel=False):
    """3 steps of ``fs.train_step`` on this rank's rows (a "tp" group's ranks share theirs);
    the losses (the step's mean over ranks), the trained weights, and the second step's
    collectives (funshard's, by kind and group ranks; the model's, by group ranks) and
    gathered-group peak. ``kind``: "tp" (test Transformer, its TP plan), "ep" (its MoE,
    experts on "ep"), "ep+tp", or "plain" (the unparallelized Transformer on a 1-D mesh);
    ``policy["compile_blocks"]``: each block torch.compile-d."""
    m = mesh(spec)
    policy = dict(policy)
    compiled = policy.pop("compile_blocks", False)
    model = {"tp": lambda: _transformer(m["tp"], sequence_parallel),
             "ep": lambda: _moe(m["ep"]), "ep+tp": lambda: _moe(m["ep"], m["tp"]),
             "plain": _transformer}[kind]()
    for block in model.layers if compiled else ():
        block.compile()
    tp = m.size(m.ndim - 1) if "tp" in m.mesh_dim_names else 1
    n, r = dist.get_world_size() // tp, dist.get_rank() // tp
    rows = slice(r * 4 // n, (r + 1) * 4 // n)
    step = fs.train_step(_step_loss(model), _optimizer(optimizer), policy=fs.Policy(**policy))
    state = step.init(fs.shard(fs.params(model), m))
    losses, seen = [], None
    for s in range(3):
        x, y = _batch(s)
        with _Collectives() as cc:
            state, metrics = step(state, (x[rows], y[rows]))
            losses.append(float(metrics["loss"]))
        if s == 1:
            seen = (Counter((op, _group_ranks(g)) for op, g in cc.ours),
                    {_group_ranks(g) for _, g in cc.model}, metrics["unsharded_groups_peak"])
    groups = {d: _group_ranks(m.get_group(d).group_name) for d in m.mesh_dim_names}
    return losses, fs.state_dict(state.params, "full"), *seen, groups


def _ours(counts, op, group):
    return sum(c for (o, g), c in counts.items() if op in o and g == group)


@pytest.mark.parametrize("spec,sequence_parallel,optimizer,policy", [
    (spec, sp, opt, policy) for spec, sp, opt in (("1x2x2", True, "adamw"),
                                                  ("2x1x2", False, "sgd"))
    for policy in POLICIES] + [("2x2x2", True, "sgd", "full_shard"),
                               ("2x2x2", False, "adamw", "shard_grad_op")])
def test_train_step_with_tensor_parallel_trains_as_one_process(pools, spec, sequence_parallel,
                                                              optimizer, policy):
    """torch's test Transformer with its TP plan (SP too), FULL_SHARD, SHARD_GRAD_OP,
    checkpointed blocks, 2 micro-batches: 3 steps match one process on the whole batch
    (AdamW with a clipped norm; SGD with momentum, which sees the gradient's scale). The
    step's collectives on "shard" are those of the same step on a plain mesh of the
    data-parallel ranks (one all-gather per group and direction, one reduce-scatter per
    group), as is its gathered-group peak; "replicate" has one all-reduce per group; the
    model's own collectives are all on "tp"."""
    want_losses, want = one_process(optimizer)
    plain = pools.run(2, stepped, "plain", POLICIES[policy], optimizer)[0]
    out = pools.run(spec, stepped, "tp", POLICIES[policy], optimizer, sequence_parallel)
    for losses, full, ours, theirs, peak, groups in out:
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=k)
        assert theirs == {groups["tp"]}, theirs
        assert peak == plain[4], (peak, plain[4])
        shard = groups["shard"]
        for op in ("gather", "reduce_scatter"):
            want_n = _ours(plain[2], op, (0, 1)) if len(shard) > 1 else 0
            assert _ours(ours, op, shard) == want_n, (op, ours, plain[2])
        n_groups = _ours(plain[2], "reduce_scatter", (0, 1))
        assert _ours(ours, "allreduce", groups.get("replicate")) == (
            n_groups if "replicate" in groups else 0), ours
        world = tuple(range(len(out)))  # every rank: the metrics' all-reduce
        assert sum(ours.values()) == (_ours(ours, "gather", shard) + _ours(
            ours, "reduce_scatter", shard) + _ours(ours, "allreduce", groups.get("replicate"))
            + ours[("allreduce_", world)]), ours


@pytest.mark.parametrize("policy", [{}, {"param_dtype": torch.float64}, {"checkpoint": True},
                                    {"accumulate": 2}], ids=str)
def test_train_step_with_tensor_parallel_alone_trains_as_one_process(pools, policy):
    """One data-parallel rank ("tp" 2 alone): nothing is gathered (the step computes on the
    shards' own storage, or on a cast of them) and funshard's one collective is the
    metrics' all-reduce; 3 steps match one process."""
    want_losses, want = one_process("adamw")
    for losses, full, ours, _, _, _ in pools.run("1x1x2", stepped, "tp", policy, "adamw",
                                                 True):
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=k)
        assert ours == {("allreduce_", (0, 1)): 1}, ours


@pytest.mark.parametrize("spec,kind", [("1x2x2ep", "ep"), ("2x1x2ep", "ep"),
                                       ("1x1x2x2", "ep+tp"), ("1x2x2x2", "ep+tp")])
@pytest.mark.parametrize("policy", ["full_shard", "shard_grad_op"])
def test_train_step_with_experts_on_ep_trains_as_one_process(pools, spec, kind, policy):
    """The mixture of experts with its experts on "ep" (and "tp"): 3 AdamW steps match one
    process. Each group is reduce-scattered once on "shard", experts and the rest together,
    then the rest alone (a prefix of the result) is all-reduced on "ep": one all-reduce per
    group there."""
    want_losses, want = one_process("adamw", _moe())
    for losses, full, ours, theirs, _, groups in pools.run(spec, stepped, kind,
                                                           POLICIES[policy], "adamw"):
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=k)
        n_groups = 3  # "", layers.0, layers.1
        if len(groups["shard"]) > 1:
            assert _ours(ours, "reduce_scatter", groups["shard"]) == n_groups, ours
        assert _ours(ours, "allreduce", groups["ep"]) == n_groups, ours
        if "replicate" in groups:
            assert _ours(ours, "allreduce", groups["replicate"]) == n_groups, ours


def _llama_like_steps(m, model, rows, optimizer, policy, steps=3):
    """``steps`` of ``fs.train_step`` on a causal LM (Llama, Mixtral: ``.logits``) on ``rows``
    of each batch; the losses (the step's mean over ranks) and the weights."""
    step = fs.train_step(lambda p, b: _llama_loss(fs.call(model, p, b[0]).logits, b[1]),
                         optimizer, policy=fs.Policy(**policy))
    state = step.init(fs.shard(fs.params(model), m))
    losses = []
    for s in range(steps):
        x, y = _batch(s, 64)
        state, metrics = step(state, (x[rows], y[rows]))
        losses.append(float(metrics["loss"]))
    return losses, fs.state_dict(state.params, "full")


def llama_stepped(spec, how):
    """3 AdamW steps of Llama (bfloat16 compute, float32 reduction) on this data-parallel
    rank's rows: ``fs.train_step``, or (``how="fsdp2"``) torch's fully_shard per decoder
    layer and the root on "shard". The mean loss over ranks per step and the weights."""
    m = mesh(spec)
    model = _llama(m["tp"])
    ndp = fs.mesh.data_size(m)
    dp = dist.get_rank() // m.size(m.ndim - 1)
    rows = slice(dp * 4 // ndp, (dp + 1) * 4 // ndp)
    if how == "fsdp2":
        losses, weights = fsdp2_llama(m, model, rows, torch.bfloat16, torch.float32)
        mean = torch.tensor(losses)  # each rank's, summed over the ranks
        dist.all_reduce(mean)
        return [v / dist.get_world_size() for v in mean.tolist()], weights
    return _llama_like_steps(m, model, rows, fs.optim.adamw(1e-2),
                             {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32})


def test_hugging_face_llama_tensor_parallel_train_step_trains_as_fsdp2_with_tp(pools):
    """Llama with its tensor-parallel plan (torch's API), bfloat16 compute and float32
    reduction: the step's losses and weights are FSDP2 + TP's on the same mesh and rows."""
    ours = pools.run("1x2x2", llama_stepped, "step")
    theirs = pools.run("1x2x2", llama_stepped, "fsdp2")
    for (losses, weights), (want_losses, want) in zip(ours, theirs):
        assert losses == pytest.approx(want_losses, abs=1e-6)
        assert weights.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0, msg=k)


def evaluated(spec):
    m = mesh(spec)
    model = _transformer(m["tp"], True)
    evaluate = fs.eval_step(lambda p, x: fs.call(model, p, x))
    out = evaluate(fs.shard(fs.params(model), m), _batch(0)[0])
    return out.full_tensor() if isinstance(out, torch.distributed.tensor.DTensor) else out


def test_eval_step_with_tensor_parallel_computes_as_one_process(pools):
    model = _transformer()
    with torch.no_grad():
        want = model(_batch(0)[0])
    for got in pools.run("1x2x2", evaluated):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def with_extra(spec, extra):
    """2 SGD steps whose loss adds 0.01 x the sum of twice the final norm's weight (a
    sequence-parallel DTensor to the model), through a custom Function given the leaf as
    loss_fn received it (``"function"``), through torch ops (``"ops"``), or not at all."""
    m = mesh(spec)
    model = _transformer(m["tp"], True)

    def loss_fn(p, b):
        out = fs.call(model, p, b[0])
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), b[1].reshape(-1))
        w = p["norm.weight"]
        if extra is None:
            return loss
        twice = _Twice.apply(w) if extra == "function" else w * 2
        return loss + 0.01 * twice.to_local().sum()

    step = fs.train_step(loss_fn, fs.optim.sgd(0.1))
    state = step.init(fs.shard(fs.params(model), m))
    for s in range(2):
        state, _ = step(state, _batch(s))
    return fs.state_dict(state.params, "full")


def test_a_custom_function_given_a_tensor_parallel_leaf_as_it_is_trains(pools):
    """Outside its group's module a leaf is a stand-in; a custom autograd Function given it
    as it is computes with the model's DTensor, and the gradient it returns (a DTensor) is
    taken as the leaf's part: the same weights as the loss written with torch ops."""
    through = pools.run("1x2x2", with_extra, "function")
    ops = pools.run("1x2x2", with_extra, "ops")[0]
    none = pools.run("1x2x2", with_extra, None)[0]
    assert not torch.equal(ops["norm.weight"], none["norm.weight"])  # the term counts
    for got in through:
        for k, v in ops.items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=k)


# -- Hugging Face Mixtral, its experts over "ep" ---------------------------------------------

_RS = (getattr(funcol, "reduce_scatter_single_autograd", None)
       or funcol.reduce_scatter_tensor_autograd)  # (torch 2.11 has the second only)


def _mixtral(ep_mesh=None):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, router_jitter_noise=0.0))
    if ep_mesh is not None:
        for layer in model.model.layers:
            _expert_parallel(layer.mlp.experts, ep_mesh)
    return model


def _expert_parallel(experts, ep_mesh):
    """Mixtral's experts on ``ep_mesh`` as torch's test ExpertParallel places its own: each
    rank owns whole experts (``Shard(0)`` of the 3-D weights); the tokens, their expert
    choices and weights are all-gathered over "ep", each rank applies its experts (Mixtral's
    own loop; a choice of another rank's expert is its sentinel, skipped), and the outputs
    are reduce-scattered back to the tokens' ranks."""
    n, r = ep_mesh.size(), ep_mesh.get_local_rank()
    local = experts.num_experts // n
    for name in ("gate_up_proj", "down_proj"):
        experts.register_parameter(name, torch.nn.Parameter(distribute_tensor(
            getattr(experts, name).data, ep_mesh, [Shard(0)], src_data_rank=None)))
    pg = ep_mesh.get_group()
    loop = getattr(type(experts).forward, "__wrapped__", type(experts).forward)

    def forward(h, idx, w):
        h = _waited(funcol.all_gather_tensor_autograd(h, 0, pg))
        w = _waited(funcol.all_gather_tensor_autograd(w, 0, pg))
        mine = _waited(funcol.all_gather_tensor(idx, 0, pg)) - r * local
        mine = torch.where((mine >= 0) & (mine < local), mine, torch.full_like(mine, local))
        these = types.SimpleNamespace(num_experts=local, act_fn=experts.act_fn,
                                      gate_up_proj=experts.gate_up_proj.to_local(),
                                      down_proj=experts.down_proj.to_local())
        return _waited(_RS(loop(these, h, mine, w), "sum", 0, pg))
    experts.forward = forward


def _waited(t):
    """A functional collective's result waited on at once (its clone waits on it): left in
    flight on gloo, torch's functional collectives of this expert parallelism crash a rank
    now and then, with no funshard in the step as well (plain autograd and an all-reduce of
    the gradients: "malloc(): unaligned tcache chunk detected" in a gloo thread, 1 run in
    124; with ``fs.train_step``, 1 run in 240-680). Waited at once: 1,200 runs under
    ``fs.train_step`` and 700 with plain autograd passed."""
    return t.clone()


def mixtral_trained(spec, optimizer, policy):
    """3 steps of ``fs.train_step`` on Mixtral (experts on "ep" where the mesh has it), every
    rank on its own rows; the losses and the weights."""
    m = mesh(spec)
    model = _mixtral(m["ep"] if "ep" in m.mesh_dim_names else None)
    n, r = dist.get_world_size(), dist.get_rank()
    rows = slice(r * 4 // n, (r + 1) * 4 // n)
    return _llama_like_steps(m, model, rows, _optimizer(optimizer), policy)


def _mixtral_one_process(optimizer):
    model = _mixtral()
    params = {k: torch.nn.Parameter(v.detach().clone()) for k, v in fs.params(model).items()}
    opt = (torch.optim.AdamW(params.values(), lr=1e-2, foreach=True) if optimizer == "adamw"
           else torch.optim.SGD(params.values(), lr=0.5, momentum=0.9, foreach=True))
    losses = []
    for s in range(3):
        x, y = _batch(s, 64)
        loss = _llama_loss(torch.func.functional_call(model, params, (x,)).logits, y)
        loss.backward()
        if optimizer == "adamw":
            torch.nn.utils.clip_grad_norm_(params.values(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize("spec", ["1x2x2ep", "2x1x2ep"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_hugging_face_mixtral_with_experts_on_ep_trains_as_one_process(pools, spec, optimizer):
    """Mixtral, its experts on "ep" (the router, attention and norms replicated there): 3
    steps of the training step, FULL_SHARD and SHARD_GRAD_OP, match one process on the whole
    batch."""
    want_losses, want = _mixtral_one_process(optimizer)
    for policy in ({}, {"reshard_after_forward": False}):
        losses, full = pools.run(spec, mixtral_trained, optimizer, policy)[0]
        assert losses == pytest.approx(want_losses, abs=1e-5), policy
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=(policy, k))


def test_hugging_face_mixtral_in_bfloat16_trains_on_ep_as_on_data_parallel_ranks(pools):
    """bfloat16 compute, float32 reduction, SGD (which sees a gradient's scale): experts on
    "ep" train as the same step on 4 data-parallel ranks without expert parallelism, within
    bfloat16's rounding of the experts' partial outputs summed over "ep"."""
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    want_losses, want = pools.run(4, mixtral_trained, "sgd", policy)[0]
    losses, full = pools.run("1x2x2ep", mixtral_trained, "sgd", policy)[0]
    assert losses == pytest.approx(want_losses, abs=1e-3)
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, atol=5e-3, rtol=0, msg=k)


def llama_checkpointed(spec, mode, policy):
    """2 SGD steps of Llama with its tensor-parallel plan and (``mode``) Hugging Face's own
    activation checkpointing, non-reentrant or reentrant; the losses, the weights, and how
    often the first decoder layer's attention ran (twice a step when recomputed)."""
    m = mesh(spec)
    model = _llama(m["tp"])
    if mode is not None:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    model.train()
    runs = []
    model.model.layers[0].self_attn.register_forward_hook(lambda *a: runs.append(1))
    dp = dist.get_rank() // m.size(m.ndim - 1)
    rows = slice(dp * 4 // fs.mesh.data_size(m), (dp + 1) * 4 // fs.mesh.data_size(m))
    losses, weights = _llama_like_steps(m, model, rows, fs.optim.sgd(0.5), policy, steps=2)
    return losses, weights, len(runs)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_the_models_own_checkpointing_on_a_tensor_parallel_mesh(pools, mode):
    """Hugging Face's gradient_checkpointing_enable() on Llama with its TP plan: the
    recompute runs (the attention twice a step) on the step's gathered DTensors, and the
    weights are those of the same steps without it, FULL_SHARD and SHARD_GRAD_OP."""
    want_losses, want, runs = pools.run("1x2x2", llama_checkpointed, None, {})[0]
    assert runs == 2
    for policy in ({}, {"reshard_after_forward": False}):
        losses, full, runs = pools.run("1x2x2", llama_checkpointed, mode, policy)[0]
        assert runs == 4, runs
        assert losses == pytest.approx(want_losses, abs=1e-6)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-6, rtol=0, msg=(policy, k))


def resumed(spec, path, phase):
    """4 AdamW steps of the test Transformer (tensor parallel where the mesh has "tp"), or
    the first 2 then ``fs.checkpoint.save`` of the whole TrainState, or ``load`` then the
    last 2; the weights."""
    m = mesh(spec)
    tp = m.size(m.ndim - 1) if "tp" in m.mesh_dim_names else 1
    model = _transformer(m["tp"], True) if tp > 1 else _transformer()
    n, r = dist.get_world_size() // tp, dist.get_rank() // tp
    rows = slice(r * 4 // n, (r + 1) * 4 // n)
    step = fs.train_step(_step_loss(model), fs.optim.adamw(1e-2))
    state = step.init(fs.shard(fs.params(model), m))
    if phase == "resume":
        state = fs.checkpoint.load(path, like=state)
    for s in {"all": range(4), "save": range(2), "resume": range(2, 4)}[phase]:
        x, y = _batch(s)
        state, _ = step(state, (x[rows], y[rows]))
    if phase == "save":
        fs.checkpoint.save(path, state)
    return fs.state_dict(state.params, "full")


def test_a_train_state_saved_on_tensor_parallel_resumes_on_other_layouts(pools, tmp_path):
    """The whole TrainState (weights, AdamW's moments and counts) saved after 2 steps on
    data-parallel 2 x tensor-parallel 2 resumes there, on data-parallel 4 and on
    tensor-parallel 2 alone: 2 more steps reach the weights of 4 uninterrupted ones."""
    want = pools.run("1x2x2", resumed, None, "all")[0]
    path = str(tmp_path / "ck")
    pools.run("1x2x2", resumed, path, "save")
    for spec in ("1x2x2", 4, "1x1x2"):
        got = pools.run(spec, resumed, path, "resume")[0]
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=(spec, k))
