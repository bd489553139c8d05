"""Expert parallel meshes: a mixture-of-experts model whose experts torch's own test
Transformer places on the mesh's ``"ep"`` dimension (each rank owns whole experts, the model
exchanges the tokens), the rest sharded by funshard over ``"shard"``, on 4 gloo ranks against
one process."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import funshard as fs
from funshard.testing import capture, make_tensor, mesh
from test_tp import _batch, _group_ranks, _loss, one_process, train

EP_MESHES = ["1x2x2ep", "2x1x2ep"]  # replicate x shard x ep, 4 ranks
EXPERTS = ("expert_layer.experts.w1", "expert_layer.experts.w2")


def _moe(ep_mesh=None, tp_mesh=None):
    """torch's ExpertParallel (tokens all-gathered, outputs reduce-scattered) on ``ep_mesh``;
    with ``tp_mesh`` its tensor-parallel plan and experts split on both (w1 Shard(1), w2
    Shard(2) on "tp")."""
    from torch.testing._internal.distributed._tensor.common_dtensor import (ModelArgs,
                                                                            Transformer)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=16, max_seq_len=8, dim=16, n_heads=4,
                                  dropout_p=0.0, num_experts=4))
    if ep_mesh is not None:
        model = Transformer.parallelize(model, tp_mesh, False, local_output_for_attn=True,
                                        ep_mesh=ep_mesh)
    return model


def ep_trains(spec, optimizer):
    """test_tp's 3 training steps, every rank on its own rows (the ranks of "ep" too); with
    what was placed how."""
    m = mesh(spec)
    model = _moe(m["ep"])
    sparams = fs.shard(fs.params(model), m)
    placed = {k: (tuple(v.placements), type(fs.unshard({k: v})[k]).__name__)
              for k, v in sparams.items()}
    n, r = dist.get_world_size(), dist.get_rank()  # every dimension splits the batch
    losses, full, ours, _ = train(m, model, sparams, optimizer, slice(r * 4 // n,
                                                                    (r + 1) * 4 // n))
    groups = {d: _group_ranks(m.get_group(d).group_name) for d in m.mesh_dim_names}
    return losses, full, placed, ours, groups


@pytest.mark.parametrize("spec", EP_MESHES)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_expert_parallel_moe_trains_as_one_process(pools, spec, optimizer):
    """3 steps (AdamW with a clipped norm; SGD with momentum, which sees a gradient's scale)
    match one process on the whole batch: an expert's gradient is reduced over "shard" only
    (the model's token exchange already summed the "ep" ranks' rows into it), the rest over
    "ep" too. Experts are placed on "ep" as the model has them, and over "shard" after the
    expert split (a strided shard); the rest is plain to the model. funshard's collectives:
    one all-gather and one reduce-scatter on "shard" for both kinds (experts, the rest), the
    mean over "replicate", and for the rest alone (a prefix of the result) over "ep"."""
    want_losses, params = one_process(optimizer, _moe())
    for losses, full, placed, ours, groups in pools.run(spec, ep_trains, optimizer):
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for k, v in params.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=k)
        for k, (placements, given) in placed.items():
            expert = k.endswith(EXPERTS)
            assert given == ("DTensor" if expert else "Tensor"), (k, given)
            assert placements[-1] == (Shard(0) if expert else Replicate()), (k, placements)
        kinds = [(op, g) for op, g in ours]
        gathers = [g for op, g in kinds if "gather" in op]
        reduces = [g for op, g in kinds if "reduce_scatter" in op]
        means = [g for op, g in kinds if op == "allreduce_"]
        assert len(gathers) + len(reduces) + len(means) == len(kinds), ours
        if len(groups["shard"]) > 1:
            assert gathers == reduces == [groups["shard"]], ours
        else:
            assert not gathers and not reduces, ours
        want_means = ([groups["replicate"]] if "replicate" in groups else []) + [
            groups["ep"]]  # "replicate" for both kinds at once, "ep" for the rest alone
        assert sorted(means) == sorted(want_means), ours


def ep_tp_trains(spec, optimizer):
    """:func:`train` with experts on "ep" x "tp" and the rest tensor parallel: the ranks of a
    "tp" group share rows, those of "ep" do not."""
    m = mesh(spec)
    model = _moe(m["ep"], m["tp"])
    tp = m.size(m.ndim - 1)
    n, r = dist.get_world_size() // tp, dist.get_rank() // tp
    sparams = fs.shard(fs.params(model), m)
    placed = {k: v.device_mesh.mesh_dim_names for k, v in sparams.items()}
    losses, full, _, _ = train(m, model, sparams, optimizer, slice(r * 4 // n, (r + 1) * 4 // n))
    return losses, full, placed


@pytest.mark.parametrize("spec", ["1x1x2x2", "1x2x2x2"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_expert_and_tensor_parallel_on_one_mesh_train_as_one_process(pools, spec, optimizer):
    """Experts on "ep" x "tp" (torch's ExpertParallelWithTP), attention tensor parallel, the
    norms plain: each leaf on the data-parallel dimensions and the model's it is placed on
    ("ep" too, replicated, for all but the experts); 3 steps as one process, on 4 and on 8
    ranks (shard 2 x ep 2 x tp 2)."""
    want_losses, want = one_process(optimizer, _moe())
    for losses, full, placed in pools.run(spec, ep_tp_trains, optimizer):
        assert losses == pytest.approx(want_losses, abs=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, atol=1e-5, rtol=0, msg=k)
        assert placed["layers.0.expert_layer.experts.w1"] == ("shard", "ep", "tp")
        assert placed["layers.0.attention.wq.weight"] == ("shard", "ep", "tp")
        assert placed["layers.0.ffn_norm.weight"] == ("shard", "ep")


def ep_reduce(spec, seed):
    """Per-rank gradients of an expert leaf (as the model holds it: a DTensor on mesh["ep"])
    and of a plain one -> reduce_grads: the expert's summed over "shard" (and "replicate"),
    the plain one's summed over every rank, both divided by the number of ranks."""
    m = mesh(spec)
    n, r = dist.get_world_size(), dist.get_rank()
    like = fs.shard({"w": distribute_tensor(make_tensor((4, 3, 2), "float32", seed), m["ep"],
                                            [Shard(0)], src_data_rank=None),
                     "b": make_tensor((5,), "float32", seed)}, m)
    per_rank = [{"w": make_tensor((4, 3, 2), "float32", seed + 10 * i + 1),
                 "b": make_tensor((5,), "float32", seed + 10 * i + 2)} for i in range(n)]
    grads = {"w": distribute_tensor(per_rank[r]["w"], m["ep"], [Shard(0)], src_data_rank=None),
             "b": per_rank[r]["b"]}
    got = fs.reduce_grads(grads, like=like)
    e = m.get_local_rank("ep")
    same_experts = [i for i in range(n) if i % m.size(m.ndim - 1) == e]
    part = slice(e * 2, e * 2 + 2)  # this rank's experts
    want_w = sum(per_rank[i]["w"][part] for i in same_experts) / n
    want_b = sum(p["b"] for p in per_rank) / n
    return (got["w"].full_tensor()[part], want_w, got["b"].full_tensor(), want_b,
            fs.optim.clip.global_norm(got, like),
            torch.cat([got["w"].full_tensor().reshape(-1), got["b"].full_tensor()]))


@pytest.mark.parametrize("spec", EP_MESHES)
def test_reduce_grads_averages_an_expert_over_the_rows_it_saw(pools, spec):
    for w, want_w, b, want_b, norm, flat in pools.run(spec, ep_reduce, 5):
        torch.testing.assert_close(w, want_w, atol=1e-6, rtol=0)
        torch.testing.assert_close(b, want_b, atol=1e-6, rtol=0)
        assert norm == pytest.approx(flat.double().norm().item(), rel=1e-6)


def ep_saved(spec, tmp):
    m = mesh(spec)
    sparams = fs.shard(fs.params(_moe(m["ep"])), m)
    fs.checkpoint.save(f"{tmp}/ep", sparams)
    full = fs.state_dict(sparams, "full")
    back = fs.load_state_dict(full if dist.get_rank() == 0 else None, sparams, rank0_only=True)
    same = all(torch.equal(back[k].to_local(), v.to_local()) for k, v in sparams.items())
    return full, same


def ep_loaded(spec, tmp, ep):
    m = mesh(spec)
    like = fs.shard(fs.params(_moe(m["ep"] if ep else None)), m)
    return fs.state_dict(fs.checkpoint.load(f"{tmp}/ep", like=like), "full")


def test_a_checkpoint_of_experts_loads_on_other_layouts(pools, tmp_path):
    """Saved on shard 2 x ep 2; loaded on 4 data-parallel ranks without expert parallel and
    on ep 2 alone; the full state dict is the plain model's, and loads from rank 0 alone."""
    got = pools.run("1x2x2ep", ep_saved, str(tmp_path))
    assert all(same for _, same in got)  # a full dict read on rank 0 alone, back in place
    full = got[0][0]
    plain = dict(_moe().named_parameters())
    assert full.keys() == plain.keys()
    for k, v in full.items():
        assert torch.equal(v, plain[k]), k
    for spec, ep in ((4, False), ("1x1x2ep", True)):
        for sd in pools.run(spec, ep_loaded, str(tmp_path), ep):
            for k in full:
                assert torch.equal(sd[k], full[k]), (spec, k)


def ep_misuse(spec):
    from torch.distributed.device_mesh import init_device_mesh

    m = mesh(spec)
    sparams = fs.shard(fs.params(_moe(m["ep"])), m)
    step = fs.train_step(lambda p, b: _loss(_moe(), p, *b), fs.optim.adamw(1e-2),
                         compile=True)
    backwards = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("shard", "tp", "ep"))
    return (capture(lambda: step(step.init(sparams), _batch(0))),
            capture(fs.shard, {"w": torch.ones(4)}, backwards))


def test_what_expert_parallel_cannot_do_yet_is_refused_by_name(pools):
    for (kind, msg), (kind2, msg2) in pools.run("1x2x2ep", ep_misuse):
        assert kind == "NotImplementedError" and "'ep'" in msg, msg
        assert "train_step(compile=True)" in msg, msg
        assert kind2 == "ValueError" and "'ep'" in msg2 and "'tp'" in msg2, msg2
        assert "out of order" in msg2, msg2
