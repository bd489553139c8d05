"""A world of one skips its collectives: a group's gather is a cast of its shards
(Group._cast) and a group's reduction is its gradients themselves (Reductions._put_local).
It must train bit for bit as the same step with every collective forced (the CUDA lane's
way of running them on one GPU), with activation checkpointing too."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import funshard as fs
from funshard.collectives import force_collectives
from funshard.testing import mesh

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Net(nn.Module):
    """An embedding (sparse or not), three residual blocks (the step's groups, which
    ``Policy(checkpoint=True)`` checkpoints), a head and a group that gets no gradient."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = nn.Embedding(11, 6, sparse=sparse)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.GELU())
                                     for _ in range(3)])
        self.head = nn.Linear(6, 3)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        h = self.emb(x).mean(1)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _model(sparse: bool, frozen: bool):
    torch.manual_seed(0)
    model = _Net(sparse)
    if frozen:
        model.blocks[1][0].weight.requires_grad_(False)
    return model


def local_and_forced(spec, param, reduce, raf, accumulate, sparse, frozen, checkpoint):
    """Parameters and metrics after 3 steps, the collectives skipped then forced."""
    model = _model(sparse, frozen)

    def loss_fn(p, b):
        return F.mse_loss(fs.call(model, p, b[0]).float(), b[1])

    policy = fs.Policy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce],
                       reshard_after_forward=raf, accumulate=accumulate, checkpoint=checkpoint,
                       loss_scale="dynamic" if param == "fp16" else None)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (4, 5), generator=g), torch.randn(4, 3, generator=g))
               for _ in range(3)]
    out = []
    for forced in (False, True):
        step = fs.train_step(loss_fn, fs.optim.adamw(lr=0.05), policy=policy)
        state = step.init(fs.shard(fs.params(model), mesh(spec)))
        losses = []
        with force_collectives(forced):
            for b in batches:
                state, metrics = step(state, b)
                losses.append((metrics["loss"], metrics["grad_norm"]))
        out.append((fs.unshard(state.params), losses))
    (local, l_losses), (forced, f_losses) = out
    return max((local[k] - forced[k]).abs().max().item() for k in local), l_losses, f_losses


@settings(max_examples=16)
@given(param=st.sampled_from(sorted(DTYPES)), reduce=st.sampled_from(sorted(DTYPES)),
       raf=st.booleans(), accumulate=st.sampled_from([1, 2]), sparse=st.booleans(),
       frozen=st.booleans(), checkpoint=st.booleans())
def test_a_world_of_one_trains_as_with_its_collectives(pools, param, reduce, raf, accumulate,
                                                       sparse, frozen, checkpoint):
    err, local, forced = pools.run(1, local_and_forced, param, reduce, raf, accumulate,
                                   sparse, frozen, checkpoint)[0]
    assert err == 0.0 and local == forced, (err, local, forced)
