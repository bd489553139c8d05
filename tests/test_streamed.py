"""Large gradients stream to the reduce bucket through a node per leaf, the rest arrive with
their group ([Note: streamed gradients] in funshard.step.lazy): a group that mixes both
trains as one process, on every mesh and Policy, and only the large leaves get a node."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funshard as fs
from funshard.step.params import TAP_BYTES
from funshard.testing import mesh

IN, HID, OUT, ROWS = 8, 1024, 3, 2


def _model():
    torch.manual_seed(0)
    # "2.weight": HID x HID floats, 4 MiB (streamed); the rest 32 KiB or less each (not)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(),
                         nn.Linear(HID, OUT))


def _taps(t: torch.Tensor) -> int:
    seen, stack, n = set(), [t.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        n += type(node).__name__ == "TapBackward"
        stack.extend(f for f, _ in node.next_functions)
    return n


def streamed(spec, policy_kw, groups):
    """SGD with momentum through the step vs one process on the whole batch: the largest
    parameter difference after 3 steps, and the Tap nodes each step's graph had."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    ref = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    taps = []

    def loss_fn(p, b):
        loss = F.mse_loss(fs.call(model, p, b[0]).float(), b[1])  # torch 2.11: no bf16 mse
        taps.append(_taps(loss))
        return loss

    pol = fs.Policy(groups=(lambda f: "all") if groups == "one" else (lambda f: f.split(".")[0]),
                    **policy_kw)
    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.05, momentum=0.9), policy=pol)
    state = step.init(fs.shard(fs.params(model), m))
    opt = torch.optim.SGD(list(ref.values()), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(world * ROWS, IN, generator=g)
        y = torch.randn(world * ROWS, OUT, generator=g)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        state, _ = step(state, (x[mine], y[mine]))
        opt.zero_grad()
        F.mse_loss(torch.func.functional_call(model, ref, (x,)), y).backward()
        opt.step()
    full = fs.unshard(state.params)
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.items()), taps


POLICIES = {"full_shard": {}, "shard_grad_op": {"reshard_after_forward": False},
            "accumulate": {"accumulate": 2}, "checkpoint": {"checkpoint": True}}


# Policy(checkpoint=True) checkpoints groups named by module: not with one group "all"
CASES = [(p, g) for p in POLICIES for g in ("one", "per_layer")
         if (p, g) != ("checkpoint", "one")]


@pytest.mark.parametrize("policy,groups", CASES, ids="-".join)
@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_a_group_of_streamed_and_other_leaves_trains_as_one_process(pools, spec, policy,
                                                                    groups):
    assert HID * HID * 4 >= TAP_BYTES > IN * HID * 4  # one leaf streams, the others do not
    for err, taps in pools.run(spec, streamed, POLICIES[policy], groups):
        assert err < 1e-5, err
        assert taps and set(taps) == {1}, taps  # the 4 MiB weight's node, and no other


def test_a_world_of_one_taps_nothing(pools):
    """One rank has no bucket to stream to: its gradients are handed over as a plain
    step's are."""
    for err, taps in pools.run(1, streamed, {"param_dtype": torch.bfloat16}, "one"):
        assert err < 3e-2 and set(taps) == {0}, (err, taps)
