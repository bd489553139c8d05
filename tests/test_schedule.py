"""step.schedule: group naming, the kept group and its split, the schedule as data.

No processes: the schedule is pure, and fs.plan and the step build it with the same rules.
"""

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard.step.schedule import (Schedule, default_group, group_names, kept_into_backward,
                                    make_schedule, partition, split_kept)
from funshard.testing import mesh


def test_default_group_and_partition():
    names = ["emb.w", "layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b", "head.w"]
    gnames = group_names(names, None, dict.fromkeys(names), [(2,)] * 6)
    assert gnames == ["", "layers.0", "layers.0", "layers.1", "layers.1", ""]
    groups, members = partition(gnames)
    assert groups == ["", "layers.0", "layers.1"]
    assert members == [[0, 5], [1, 2], [3, 4]]
    names = ["emb.w", "layers.0.a", "layers.0.b", "layers.1.a", "head.w"]
    assert group_names(names, lambda n: n[0], None) == ["e", "l", "l", "l", "h"]
    tree = {"emb": {"w": 0}, "layers": {"0": {"a": 0, "b": 0}, "1": {"a": 0}}, "head": {"w": 0}}
    names = ["emb.w", "layers.0.a", "layers.0.b", "layers.1.a", "head.w"]
    assert group_names(names, {"emb": "x", "layers": "y", "head": "x"}, tree) == \
        ["x", "y", "y", "y", "x"]
    assert default_group("a.b") == ""


GPT_FWD = [0, 1, 2, 3, 0]  # root, three blocks, root again (final norm, tied head)
GPT_BWD = [3, 2, 1]  # backward regathers every block in reverse; root stays from forward


def _leaves(sharded, first, nbytes):
    return lambda g: (sharded, first, nbytes)


def test_full_shard_keeps_last_block_and_splits_it():
    # the last block: leaf 2 (the MLP's output projection) is what backward needs first
    s = make_schedule(GPT_FWD, GPT_BWD, reshard_after_forward=True,
                      kept_leaves=_leaves([0, 1, 2], [2, 1, 0], [40, 40, 40]), gathers=True)
    assert s == Schedule((0, 1, 2, 3, 0), (2, 1), 3, (0, 1))
    assert s.next_after(False, 0) == 0 and s.next_after(False, 3) == 3
    assert s.next_after(False, 5) is None
    assert s.next_after(True, 0) == 2 and s.next_after(True, 2) is None
    assert s.before_backward(0) == 3 and s.before_backward(1) == 2


def test_shard_grad_op_keeps_nothing():
    s = make_schedule([0, 1, 2, 3], [], reshard_after_forward=False,
                      kept_leaves=_leaves([], [], []), gathers=True)
    assert s == Schedule((0, 1, 2, 3), (), None, ())
    assert kept_into_backward([0, 1, 2], [2, 1], False, True) is None


def test_kept_only_when_forward_used_it_last():
    assert kept_into_backward([0, 1, 2], [2, 1, 0], True, True) == 2
    assert kept_into_backward([0, 1, 2, 0], [2, 1], True, True) == 2  # second to last counts
    assert kept_into_backward([0, 1, 2, 3], [1, 0], True, True) is None  # not among the last two
    assert kept_into_backward([0, 1], [], True, True) is None
    # a world of one: no all-gather to save, only memory to hold
    assert kept_into_backward([0, 1, 2], [2, 1, 0], True, False) is None


@pytest.mark.parametrize("first,nbytes,late", [
    ([2, 1, 0], [40, 40, 40], [0, 1]),  # the first third fits in half: the rest is late
    ([0, 1, 2], [10, 10, 100], [2]),  # two small leaves first, then a big one: stop there
    ([2, 1, 0], [10, 10, 100], []),  # the first leaf is over half: no split
    ([], [40, 40, 40], []),  # backward unpacked none of them: no split
    ([2, 1, 0], [10, 10, 10], [0, 1]),
])
def test_split_kept(first, nbytes, late):
    assert split_kept([0, 1, 2], first, nbytes) == late


def test_split_ignores_unsharded_leaves():
    # leaf 1 is replicated (never gathered): neither early nor late
    assert split_kept([0, 2], [2, 1, 0], [40, 1000, 40]) == [0]


def test_plan_reads_the_same_schedule():
    """fs.plan counts the gathers of the schedule the step would follow."""
    from funshard.plan import gpt_order, plan
    from funshard.testing.models import GPT

    with torch.device("meta"):
        model = GPT(vocab=64, dim=32, heads=2, layers=3, seq=8)
    full = plan(model, shard=2, **gpt_order(3))
    grad_op = plan(model, shard=2, policy=fs.Policy(reshard_after_forward=False),
                   **gpt_order(3))
    # FULL_SHARD: root twice, blocks 0-1 twice, block 2 once whole + once its late half
    assert full.comms["all_gather"].count == 2 + 2 * 2 + 2
    assert grad_op.comms["all_gather"].count == 4
    assert full.comms["reduce_scatter"].count == grad_op.comms["reduce_scatter"].count == 4


def param_groups_of(spec):
    """ParamGroups: frozen leaves are gathered but have no gradient slot."""
    m = mesh(spec)
    torch.manual_seed(0)
    tree = {"layers": {"0": {"w": torch.randn(4, 3), "b": torch.randn(3)},
                       "1": {"w": torch.randn(4, 3, requires_grad=True)}},
            "head": torch.randn(5, 2, requires_grad=True)}
    tree["layers"]["0"]["w"].requires_grad_(True)
    sp = fs.shard(tree, m)
    blocks = fs.Policy(param_dtype=torch.bfloat16,  # the two layers differ: named by hand
                       groups=lambda fqn: fqn.rsplit(".", 1)[0] if "." in fqn else "")
    pg = fs.step.ParamGroups(sp, blocks)
    return (pg.names, pg.members, pg.grad_pos, pg.slot, pg.group_bytes,
            [str(d) for d in pg.dtypes], dist.get_world_size())


def test_param_groups_frozen(pools):
    for names, members, grad_pos, slot, group_bytes, dtypes, world in pools.run(
            2, param_groups_of):
        assert names == ["layers.0", "layers.1", ""]
        assert members == [[0, 1], [2], [3]]
        assert grad_pos == [[0], [0], [0]]  # layers.0.b is frozen
        assert slot == [{0: 0}, {0: 0}, {0: 0}]
        # padded bf16 bytes: (4, 3) -> 2 rows per rank; (3,) -> 2 rows per rank
        assert group_bytes == [2 * 2 * 3 * 2 + 2 * 2 * 2, 2 * 2 * 3 * 2, 2 * 3 * 2 * 2]
        assert set(dtypes) == {"torch.bfloat16"} and world == 2


def test_default_groups_are_the_repeated_blocks():
    from funshard.step import block_groups
    # a Sequential inside a block stays in it; one beside the blocks goes to the rest
    names = ["wte.w", "layers.0.ln.w", "layers.0.mlp.0.w", "layers.0.mlp.2.w",
             "layers.1.ln.w", "layers.1.mlp.0.w", "layers.1.mlp.2.w", "head.0.w", "head.2.w"]
    shapes = [(9, 4), (4,), (16, 4), (4, 16), (4,), (16, 4), (4, 16), (4, 4), (4, 4)]
    assert block_groups(names, shapes) == ["", "layers.0", "layers.0", "layers.0", "layers.1",
                                           "layers.1", "layers.1", "", ""]
    # experts inside a layer stay in the layer; an encoder and a decoder stack both count
    moe = [f"layers.{i}.experts.{e}.w" for i in range(2) for e in range(8)]
    assert block_groups(moe, [(4, 4)] * 16) == ["layers.0"] * 8 + ["layers.1"] * 8
    t5 = [f"enc.layer.{i}.w" for i in range(3)] + [f"dec.layer.{i}.w" for i in range(3)]
    assert block_groups(t5, [(4, 4)] * 6) == [n.rsplit(".", 1)[0] for n in t5]
    # a plain Sequential of different layers is one group; a block unlike the others in a
    # stack of blocks is a block too (a last odd layer; T5's first block, with the relative
    # position bias; dense layers before mixture-of-experts ones)
    assert block_groups(["0.w", "0.b", "2.w", "2.b"], [(3, 5), (3,), (2, 3), (2,)]) == [""] * 4
    odd = ["h.0.w", "h.1.w", "h.2.w"]
    assert block_groups(odd, [(4, 4), (4, 4), (8, 4)]) == ["h.0", "h.1", "h.2"]
    t5 = ["shared.w", "enc.block.0.bias.w"] + [f"{s}.block.{i}.w" for s in ("enc", "dec")
                                               for i in range(3)]
    assert block_groups(t5, [(4, 4)] * 8) == ["", "enc.block.0"] + [
        n.rsplit(".", 1)[0] for n in t5[2:]]
    dense_then_moe = ([f"layers.{i}.mlp.w" for i in range(2)]
                      + [f"layers.{i}.experts.{e}.w" for i in range(2, 6) for e in range(4)])
    assert block_groups(dense_then_moe, [(4, 16)] * 2 + [(4, 4)] * 16) == [
        n.split(".experts")[0].split(".mlp")[0] for n in dense_then_moe]


def test_list_groups_of_real_models():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50,
                                      n_positions=16))
    groups = fs.list_groups(fs.params(gpt2))
    assert [g.name for g in groups] == ["", "transformer.h.0", "transformer.h.1",
                                        "transformer.h.2"]
    assert sum(g.nbytes for g in groups) == sum(p.numel() * 4 for p in gpt2.parameters())
    bert = BertModel(BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                intermediate_size=32, vocab_size=50))
    names = [g.name for g in fs.list_groups(fs.params(bert))]
    assert names == ["", "encoder.layer.0", "encoder.layer.1"], names
    half = fs.list_groups(fs.params(gpt2), fs.Policy(param_dtype=torch.bfloat16))
    assert [g.nbytes * 2 for g in half] == [g.nbytes for g in groups]
    assert fs.list_groups(fs.params(gpt2), fs.Policy(groups="all"))[0].name == "all"
