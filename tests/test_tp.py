"""Meshes past data parallelism: funshard's shard / unshard / reshard / reduce_grads and the
optimizers over leaves a tensor-parallel model (torch's ``parallelize_module``) places on the
mesh's ``"tp"`` dimension, on 4 gloo ranks, against one process and DTensor's own reading."""

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import funshard as fs
from funshard.testing import capture, make_tensor, mesh
from funshard.testing.strategies import shapes

TP_MESHES = ["1x2x2", "2x1x2"]  # replicate x shard x tp, 4 ranks


# -- the laws: DTensor reads funshard's placements as funshard lays the leaves out ---------


def placed_roundtrip(spec, cases, seed, tmp):
    """For each (shape, model placement): the model's DTensor on mesh["tp"] -> fs.shard ->
    what DTensor's own full_tensor reads, unshard, reshard, the state dicts; all of them
    saved in a checkpoint at ``tmp``."""
    m = mesh(spec)
    problems, saved = [], {}
    for i, (shape, kind) in enumerate(cases):
        x = make_tensor(shape, "float32", seed + i)
        pl = Replicate() if kind is None else Shard(kind)
        d = distribute_tensor(x, m["tp"], [pl], src_data_rank=None)
        s = fs.shard({"w": d}, m)["w"]
        name = f"{shape} {pl}"
        if not isinstance(s, DTensor) or s.device_mesh != m or s.shape != x.shape:
            problems.append(f"{name}: shard gave {type(s).__name__} {tuple(s.shape)}")
            continue
        if not torch.equal(s.full_tensor(), x):
            problems.append(f"{name}: DTensor reads placements {s.placements} as another tensor")
        full = fs.unshard({"w": s})["w"]
        if not (isinstance(full, DTensor) and full.device_mesh == m["tp"]
                and tuple(full.placements) == (pl,)):
            problems.append(f"{name}: unshard gave {full!r:.80}")
            continue
        if not torch.equal(full.to_local(), d.to_local()):
            problems.append(f"{name}: unshard's local part differs from the model's")
        back = fs.reshard({"w": full}, like={"w": s})["w"]
        if not (torch.equal(back.to_local(), s.to_local()) and back.placements == s.placements):
            problems.append(f"{name}: reshard(unshard(s)) != s")
        if not torch.equal(fs.state_dict({"w": s}, "full")["w"], x):
            problems.append(f"{name}: the full state dict is not the global tensor")
        piece = fs.state_dict({"w": s}, "local")["w"]
        box = x[tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.tensor.shape))]
        if not torch.equal(box, piece.tensor):
            problems.append(f"{name}: the local piece is not at its offset {piece.offset}")
        saved[f"w{i}"] = s
    fs.checkpoint.save(tmp, saved)
    return problems


def plain_loaded(spec, cases, seed, tmp):
    """The checkpoint of :func:`placed_roundtrip` loaded on a mesh without "tp": each leaf
    as the global tensor it was made from."""
    like = fs.shard({f"w{i}": make_tensor(shape, "float32", 0) for i, (shape, _) in
                     enumerate(cases)}, mesh(spec))
    got = fs.state_dict(fs.checkpoint.load(tmp, like=like), "full")
    return [f"w{i} {shape}" for i, (shape, _) in enumerate(cases)
            if not torch.equal(got[f"w{i}"], make_tensor(shape, "float32", seed + i))]


CASES = st.lists(
    shapes(min_dims=1, max_dims=3).flatmap(
        lambda s: st.tuples(st.just(s), st.sampled_from([None, *range(len(s))]))),
    min_size=1, max_size=4)


@settings(max_examples=12, deadline=None)
@given(cases=CASES, seed=st.integers(0, 1000), spec=st.sampled_from(TP_MESHES))
def test_shard_places_the_model_part_as_dtensor_reads_it(pools, cases, seed, spec):
    """Uneven shapes included: the tensor-parallel split first, then funshard's rows of each
    part, which DTensor's own ``full_tensor`` reads back as the global tensor (the placement
    on "shard" is the model's split first when both split dim 0); the state dicts hold the
    global tensor and each piece where it sits; a checkpoint loads on 4 ranks without
    "tp"."""
    tmp = tempfile.mkdtemp(prefix="funshard-tp-")
    try:
        for problems in pools.run(spec, placed_roundtrip, cases, seed, f"{tmp}/ckpt"):
            assert not problems, problems
        for wrong in pools.run(4, plain_loaded, cases, seed, f"{tmp}/ckpt"):
            assert not wrong, wrong
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- training as one process ----------------------------------------------------------------


def _transformer(tp_mesh=None, sequence_parallel=False):
    from torch.testing._internal.distributed._tensor.common_dtensor import (ModelArgs,
                                                                            Transformer)
    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4,
                     dropout_p=0.0)
    model = Transformer(args)
    if tp_mesh is not None:  # on the CPU: no sharding rule for the flash-attention kernel
        model = Transformer.parallelize(model, tp_mesh, sequence_parallel,
                                        local_output_for_attn=True)
    return model


def _batch(step, vocab=16):
    toks = torch.randint(0, vocab, (4, 9), generator=torch.Generator().manual_seed(100 + step))
    return toks[:, :-1], toks[:, 1:]


def _loss(model, params, x, y):
    out = torch.func.functional_call(model, params, (x,))
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class _Collectives(TorchDispatchMode):
    """funshard's own collectives (c10d ops) apart from the model's (DTensor's functional
    collectives), with the process group each runs on."""

    def __init__(self):
        super().__init__()
        self.ours, self.model = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, name = func.namespace, func._opname
        if ns == "c10d" and name in ("allgather_", "_allgather_base_",
                                     "allgather_into_tensor_coalesced_",
                                     "reduce_scatter_tensor_coalesced_",
                                     "_reduce_scatter_base_", "reduce_scatter_", "allreduce_"):
            pg = next(a for a in args if isinstance(a, torch.ScriptObject))
            self.ours.append((name, dist.ProcessGroup.unbox(pg).group_name))
        elif ns == "_c10d_functional":
            names = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, str)]
            if names:  # a collective (not a wrapper): the group's name comes last
                self.model.append((name, names[-1]))
        return func(*args, **(kwargs or {}))


def _group_ranks(name: str) -> tuple:
    """A process group's ranks, by its name: a mesh slice's group may be another mesh's
    over the same ranks, so groups are compared by their ranks."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))


def train(m, model, sparams, optimizer, rows):
    """3 steps over fs.unshard -> the model -> backward on ``rows`` of each step's batch
    (AdamW with a clipped norm, or SGD with momentum); the mean loss over every rank, the
    trained parameters, and the collectives of the first step: funshard's and the model's,
    each on its group's ranks."""
    params = {k: v.detach().requires_grad_() for k, v in sparams.items()}
    opt = (fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adamw(1e-2))
           if optimizer == "adamw" else fs.optim.sgd(0.5, momentum=0.9))
    state = opt.init(params)
    losses, seen = [], None
    for step in range(3):
        x, y = _batch(step)
        with _Collectives() as cc:
            loss = _loss(model, fs.unshard(params), x[rows], y[rows])
            loss.backward()
        seen = seen or cc
        grads = {k: v.grad for k, v in params.items()}
        for v in params.values():
            v.grad = None
        params, state = opt.update(grads, state, params, step=step)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank's loss: a "tp" group's ranks hold the same one
        losses.append(mean.item() / m.size())
    ours = [(op, _group_ranks(g)) for op, g in seen.ours]
    theirs = [(op, _group_ranks(g)) for op, g in seen.model]
    return losses, fs.state_dict(params, "full"), ours, theirs


def tp_trains(spec, sequence_parallel, optimizer):
    """:func:`train` on this data-parallel rank's rows; the groups by their ranks."""
    m = mesh(spec)
    model = _transformer(m["tp"], sequence_parallel)
    ndp = fs.mesh.data_size(m)
    dp = dist.get_rank() // m.size(m.ndim - 1)  # "tp" is the innermost dimension
    rows = slice(dp * 4 // ndp, (dp + 1) * 4 // ndp)
    out = train(m, model, fs.shard(fs.params(model), m), optimizer, rows)
    groups = {n: tuple(dist.get_process_group_ranks(m.get_group(n))) for n in m.mesh_dim_names}
    return (*out, groups)


def one_process(optimizer, model=None):
    """:func:`train`'s steps in one process on the whole batch (torch's optimizers)."""
    model = _transformer() if model is None else model
    params = {k: torch.nn.Parameter(v.detach().clone()) for k, v in fs.params(model).items()}
    opt = (torch.optim.AdamW(params.values(), lr=1e-2, foreach=True) if optimizer == "adamw"
           else torch.optim.SGD(params.values(), lr=0.5, momentum=0.9, foreach=True))
    losses = []
    for step in range(3):
        x, y = _batch(step)
        loss = _loss(model, params, x, y)
        loss.backward()
        if optimizer == "adamw":
            torch.nn.utils.clip_grad_norm_(params.values(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize("spec,sequence_parallel,optimizer", [
    (spec, sp, opt) for spec in TP_MESHES
    for sp, opt in ((False, "adamw"), (True, "adamw"), (True, "sgd"))] + [
    ("2x2x2", True, "adamw"), ("2x2x2", False, "sgd")])
def test_tensor_parallel_transformer_trains_as_one_process(pools, spec, sequence_parallel,
                                                           optimizer):
    """torch's own 2-D test Transformer, parallelized by its own plan (with and without
    sequence parallel), sharded by funshard over the data-parallel dimensions: 3 steps (AdamW
    with a clipped global norm; SGD with momentum, which sees a gradient's scale) match one
    process on the whole batch; funshard's collectives
    are one all-gather in forward and one reduce-scatter in backward on "shard" (an all-reduce
    on "replicate"), every other one the model's, on "tp"."""
    want_losses, want = one_process(optimizer)
    for losses, full, ours, theirs, groups in pools.run(spec, tp_trains, sequence_parallel,
                                                        optimizer):
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=k)
        kinds = [(name, g) for name, g in ours]
        gather = [(n, g) for n, g in kinds if "gather" in n]
        reduce = [(n, g) for n, g in kinds if "reduce_scatter" in n]
        mean = [(n, g) for n, g in kinds if n == "allreduce_"]
        assert len(gather) + len(reduce) + len(mean) == len(kinds), ours
        if len(groups["shard"]) > 1:  # one all-gather, one reduce-scatter, on "shard"
            assert len(gather) == len(reduce) == 1, ours
            assert {g for _, g in gather + reduce} == {groups["shard"]}, ours
        else:  # nothing to gather
            assert not gather and not reduce, ours
        if "replicate" in groups:  # the mean over the replicas
            assert mean == [("allreduce_", groups["replicate"])], ours
        else:
            assert not mean, ours
        assert theirs and {g for _, g in theirs} == {groups["tp"]}, theirs


_USER_MESH: list = []  # per worker: the caller's mesh and funshard's naming of it


def users_mesh_trains(spec):
    """A mesh the caller built with dimensions of its own names, the model parallelized on
    its "tp": fs.mesh.data_parallel names "dp" as funshard's "shard"; :func:`train`."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _USER_MESH:
        users = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _USER_MESH[:] = [users, fs.mesh.data_parallel(users, shard="dp")]
    users, m = _USER_MESH
    model = _transformer(users["tp"], True)
    dp = users.get_local_rank("dp")
    out = train(m, model, fs.shard(fs.params(model), m), "adamw", slice(dp * 2, dp * 2 + 2))
    return (*out[:2], m.mesh_dim_names, m["tp"] == users["tp"],
            capture(fs.mesh.data_parallel, users, shard="ep"))


def test_a_mesh_the_caller_built_is_named_for_funshard(pools):
    want_losses, want = one_process("adamw")
    for losses, full, names, same_tp, (kind, msg) in pools.run(4, users_mesh_trains):
        assert names == ("shard", "tp") and same_tp
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=k)
        assert kind == "ValueError" and "'ep'" in msg and "'dp': 2" in msg, msg


# -- Hugging Face Llama with a tensor-parallel plan, against FSDP2 + TP --------------------


def _llama(tp_mesh=None):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=36, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    if tp_mesh is not None:  # the plan of Llama's base_model_tp_plan, in torch's own API
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(2):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, tp_mesh, plan)
    return model


def _llama_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def fsdp2_llama(m, model, rows, param_dtype, reduce_dtype):
    """3 AdamW steps of ``model`` (Llama) with torch's fully_shard per decoder layer and the
    root on "shard" of ``m``, on ``rows`` of each batch: this rank's losses, the weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=m["shard"], mp_policy=mp)
    fully_shard(model, mesh=m["shard"], mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(3):
        x, y = _batch(step, 64)
        loss = _llama_loss(model(x[rows]).logits, y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.full_tensor() for k, v in model.named_parameters()}


def llama_trains(spec, bf16, fsdp2):
    """3 AdamW steps of Llama on this data-parallel rank's rows: funshard (unshard, or
    ``fsdp2``: torch's fully_shard per decoder layer and the root on "shard"), with
    ``bf16``: bfloat16 compute, float32 reduction. Per-rank losses and the trained weights."""
    m = mesh(spec)
    model = _llama(m["tp"])
    ndp = fs.mesh.data_size(m)
    dp = dist.get_rank() // m.size(m.ndim - 1)
    rows = slice(dp * 4 // ndp, (dp + 1) * 4 // ndp)
    dt = (torch.bfloat16, torch.float32) if bf16 else (None, None)
    losses = []
    if fsdp2:
        return fsdp2_llama(m, model, rows, *dt)
    params = {k: v.detach().requires_grad_() for k, v in fs.shard(fs.params(model), m).items()}
    opt = fs.optim.adamw(1e-2)
    state = opt.init(params)
    for step in range(3):
        x, y = _batch(step, 64)
        full = fs.unshard(params, param_dtype=dt[0], reduce_dtype=dt[1])
        loss = _llama_loss(torch.func.functional_call(model, full, (x[rows],)).logits, y[rows])
        loss.backward()
        grads = {k: v.grad for k, v in params.items()}
        for v in params.values():
            v.grad = None
        params, state = opt.update(grads, state, params, step=step)
        losses.append(loss.item())
    return losses, fs.state_dict(params, "full")


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
def test_hugging_face_llama_with_a_tensor_parallel_plan_trains_as_fsdp2_with_it(pools, bf16):
    """The same losses and weights as FSDP2 + TP on the same mesh and rows (float32, and
    bfloat16 compute with float32 reduction), and in float32 as one process on the whole
    batch."""
    ours = pools.run("1x2x2", llama_trains, bf16, False)
    theirs = pools.run("1x2x2", llama_trains, bf16, True)
    for (losses, weights), (want_losses, want) in zip(ours, theirs):
        assert losses == pytest.approx(want_losses, abs=1e-6)
        assert weights.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(weights[k], v, atol=1e-6, rtol=0, msg=k)
    if bf16:
        return
    model = _llama()
    params = {k: torch.nn.Parameter(v.detach().clone()) for k, v in fs.params(model).items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=True)
    one = []
    for step in range(3):
        x, y = _batch(step, 64)
        loss = _llama_loss(torch.func.functional_call(model, params, (x,)).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        one.append(loss.item())
    per_rank = [losses for losses, _ in ours]
    mean = [sum(r[s] for r in per_rank) / len(per_rank) for s in range(3)]
    assert mean == pytest.approx(one, abs=1e-5)
    for k, v in params.items():
        torch.testing.assert_close(ours[0][1][k], v.detach(), atol=1e-5, rtol=0, msg=k)


# -- reduce_grads and the norm over every dimension ----------------------------------------


def tp_reduce(spec, seed):
    """Per-data-parallel-rank gradients of a row- and a column-split leaf and a replicated
    one, as the model holds them (DTensors on mesh["tp"]) -> reduce_grads: their mean over
    the data-parallel ranks, as DTensor reads it; and the global norm of those shards."""
    m = mesh(spec)
    ndp = fs.mesh.data_size(m)
    dp = dist.get_rank() // m.size(m.ndim - 1)
    shapes_ = {"col": (6, 4), "row": (5, 3), "rep": (3,)}
    pls = {"col": Shard(0), "row": Shard(1), "rep": Replicate()}
    like = fs.shard({k: distribute_tensor(make_tensor(s, "float32", seed), m["tp"], [pls[k]],
                                          src_data_rank=None) for k, s in shapes_.items()}, m)
    per_rank = [{k: make_tensor(s, "float32", seed + 10 * r + 1) for k, s in shapes_.items()}
                for r in range(ndp)]
    grads = {k: distribute_tensor(per_rank[dp][k], m["tp"], [pls[k]], src_data_rank=None)
             for k in shapes_}
    got = fs.reduce_grads(grads, like=like)
    out = {k: got[k].full_tensor() for k in shapes_}
    want = {k: sum(r[k] for r in per_rank) / ndp for k in shapes_}
    return out, want, fs.optim.clip.global_norm(got, like)


@pytest.mark.parametrize("spec", TP_MESHES)
def test_reduce_grads_and_the_norm_count_every_element_once(pools, spec):
    for out, want, norm in pools.run(spec, tp_reduce, 3):
        for k in want:
            torch.testing.assert_close(out[k], want[k], atol=1e-6, rtol=0, msg=k)
        # the norm of the reduced gradients themselves, each element once (per-leaf norms are
        # float32: a leaf counted twice or missed is off by far more)
        assert norm == pytest.approx(
            torch.cat([o.reshape(-1) for o in out.values()]).double().norm().item(), rel=1e-6)


# -- misuse, refused by name --------------------------------------------------------------


def misuse(spec):
    m = mesh(spec)
    model = _transformer(m["tp"])
    sparams = fs.shard(fs.params(model), m)
    out = {}
    step = fs.train_step(lambda p, b: _loss(model, p, *b), fs.optim.adamw(1e-2), compile=True)
    out["train_step"] = capture(lambda: step(step.init(sparams), _batch(0)))
    evaluate = fs.eval_step(lambda p, x: _loss(model, p, x, x), compile=True)
    out["eval_step"] = capture(evaluate, sparams, _batch(0)[0])
    w = sparams["layers.0.attention.wq.weight"]
    partial = DTensor.from_local(w.to_local(), m, [Replicate(), Partial()], run_check=False)
    out["partial"] = capture(fs.unshard, {"p": partial})
    full = fs.unshard(sparams)
    plain = dict(full, **{"layers.0.attention.wq.weight": full[
        "layers.0.attention.wq.weight"].full_tensor()})
    out["reshard_plain"] = capture(fs.reshard, plain, sparams)
    out["make_mesh"] = capture(fs.make_mesh, shard=2, tp=3)
    # a model parallelized on the dimension the mesh calls data-parallel
    out["on_shard"] = capture(fs.shard, fs.params(_transformer(m["shard"])), m)
    # rank 1 alone keeps one leaf plain (its model parallelized otherwise)
    odd = dict(fs.params(model))
    if dist.get_rank() == 1:
        odd["layers.0.attention.wq.weight"] = torch.zeros(odd["layers.0.attention.wq.weight"].shape)
    out["differs"] = capture(fs.shard, odd, m)
    return out


def test_what_funshard_cannot_do_with_tensor_parallel_leaves_is_refused_by_name(pools):
    every = pools.run("1x2x2", misuse)
    # a tree one rank placed otherwise: every rank refuses it (none is left in a collective)
    assert all(o["differs"][0] == "ValueError" for o in every), [o["differs"] for o in every]
    out = every[0]
    for what in ("train_step", "eval_step"):  # the compiled step: not over DTensors (yet)
        kind, msg = out[what]
        assert kind == "NotImplementedError" and "'tp'" in msg, out[what]
        assert f"{what}(compile=True)" in msg, msg
    kind, msg = out["partial"]
    assert kind == "ValueError" and "Partial" in msg and "'p'" in msg, out["partial"]
    kind, msg = out["reshard_plain"]
    assert kind == "TypeError" and "'layers.0.attention.wq.weight'" in msg, out["reshard_plain"]
    assert "DeviceMesh('tp': 2" in msg, msg
    kind, msg = out["make_mesh"]
    assert kind == "ValueError" and "tp=3" in msg, out["make_mesh"]
    kind, msg = out["on_shard"]
    assert kind == "TypeError" and "'tok_embeddings.weight'" in msg, out["on_shard"]
    assert "DeviceMesh('shard': 2" in msg and "DeviceMesh('tp': 2" in msg, msg
    kind, msg = out["differs"]
    assert kind == "ValueError" and "'layers.0.attention.wq.weight'" in msg, out["differs"]
    assert "rank 1" in msg and "plain" in msg and "Shard(dim=0)" in msg, msg


def _plus(d, seed):
    noise = make_tensor(tuple(d.to_local().shape), "float32", seed)
    return DTensor.from_local(d.to_local() + noise, d.device_mesh, d.placements, run_check=False,
                              shape=d.shape, stride=d.stride())


def state_dicts(spec, tmp):
    """Each kind of state dict of a tensor-parallel tree (a full one read on rank 0 alone
    too), and a checkpoint, loaded back on the same mesh: the full one is the plain model's
    own, each comes back shard for shard."""
    m = mesh(spec)
    base = fs.shard(fs.params(_transformer(m["tp"])), m)
    initial = fs.state_dict(base, "full")
    sparams = {k: _plus(v, 7 + i) for i, (k, v) in enumerate(base.items())}  # as if trained
    full = fs.state_dict(sparams, "full")
    problems = []
    for kind in ("full", "sharded", "local"):
        back = fs.load_state_dict(fs.state_dict(sparams, kind), like=sparams)
        problems += [f"{kind} {k}" for k in sparams
                     if not torch.equal(back[k].to_local(), sparams[k].to_local())]
    on_rank0 = fs.state_dict(sparams, "full", rank0_only=True) or None  # {} elsewhere
    back = fs.load_state_dict(on_rank0, like=sparams, rank0_only=True)
    problems += [f"rank0_only {k}" for k in sparams
                 if not torch.equal(back[k].to_local(), sparams[k].to_local())]
    for k, piece in fs.state_dict(sparams, "local").items():
        box = full[k][tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.tensor.shape))]
        if not torch.equal(box, piece.tensor):
            problems.append(f"local {k}: offset {piece.offset} is not where its piece sits")
    fs.checkpoint.save(f"{tmp}/tp", sparams)
    back = fs.checkpoint.load(f"{tmp}/tp", like=sparams)
    problems += [f"checkpoint {k}" for k in sparams
                 if not torch.equal(back[k].to_local(), sparams[k].to_local())]
    return problems, initial, full


def meta_loaded(spec):
    """The model built on ``meta`` and parallelized there, sharded (only this rank's part is
    made), then the plain model's own state dict loaded into it: as if sharded from real
    weights."""
    m = mesh(spec)
    with torch.device("meta"):
        like = fs.shard(fs.params(_transformer(m["tp"], True)), m)
    got = fs.load_state_dict(_transformer().state_dict(), like, strict=False)
    real = fs.shard(fs.params(_transformer(m["tp"], True)), m)
    return [k for k in real if not (torch.equal(got[k].to_local(), real[k].to_local())
                                    and got[k].placements == real[k].placements)]


def test_a_model_built_on_meta_loads_the_plain_models_weights(pools):
    for wrong in pools.run("1x2x2", meta_loaded):
        assert not wrong, wrong


def loaded_elsewhere(spec, tmp, tp):
    """The checkpoint saved on another layout, loaded here: its full state dict."""
    m = mesh(spec)
    model = _transformer(m["tp"]) if tp else _transformer()
    like = fs.shard(fs.params(model), m)
    return fs.state_dict(fs.checkpoint.load(f"{tmp}/tp", like=like), "full")


def wrong_layout(spec, tmp):
    """The checkpoint of :func:`state_dicts` loaded into a model whose vocabulary is larger:
    refused before anything is read."""
    from torch.testing._internal.distributed._tensor.common_dtensor import (ModelArgs,
                                                                            Transformer)
    m = mesh(spec)
    torch.manual_seed(0)
    other = Transformer.parallelize(Transformer(ModelArgs(
        n_layers=2, vocab_size=18, max_seq_len=8, dim=16, n_heads=4, dropout_p=0.0)),
        m["tp"], True, local_output_for_attn=True)
    return capture(fs.checkpoint.load, f"{tmp}/tp", like=fs.shard(fs.params(other), m))


def test_state_dicts_and_checkpoints_of_tensor_parallel_leaves(pools, tmp_path):
    """Saved on data-parallel 2 x tensor-parallel 2, loaded on data-parallel 4 (no tensor
    parallel) and on tensor-parallel 2 alone; every kind of state dict round-trips, the full
    one is the plain model's."""
    got = pools.run("1x2x2", state_dicts, str(tmp_path))
    for problems, _, _ in got:
        assert not problems, problems
    _, initial, full = got[0]
    plain = dict(_transformer().named_parameters())
    assert initial.keys() == plain.keys()
    for k, v in initial.items():
        assert torch.equal(v, plain[k]), k
    for spec, tp in ((4, False), ("1x1x2", True), ("2x1x2", True)):
        for sd in pools.run(spec, loaded_elsewhere, str(tmp_path), tp):
            assert sd.keys() == full.keys(), spec
            for k in full:
                assert torch.equal(sd[k], full[k]), (spec, k)
    for kind, msg in pools.run("1x2x2", wrong_layout, str(tmp_path)):  # cannot hold it
        assert kind == "ValueError" and "tok_embeddings.weight" in msg, (kind, msg)
        assert "(16, 16)" in msg and "(18, 16)" in msg, msg

