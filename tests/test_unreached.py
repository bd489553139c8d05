"""A trainable parameter the loss reaches on no rank in a step (a branch not taken, a layer
dropped, an expert no token chose) gets no gradient and no update, as in one process where
its ``.grad`` stays None and torch.optim skips it; one that some rank reaches trains on the
mean over ranks. Neither depends on the groups ([Note: a parameter no rank reached] in
funshard.step.update)."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funshard as fs
from funshard.testing import CountCollectives, mesh

PER_RANK = 3
# per step, which of each rank's rows take the branch: none anywhere (no rank reaches it),
# rank 0's only (some rank does), every row, none again. With a group of its own, the branch
# is a group some ranks would gather and others not: refused (tests/test_misuse.py), so
# every rank takes it or none does.
PICKS = {"one_group": ["none", "rank0", "all", "none"],
         "per_module": ["none", "all", "none", "all"]}
GROUPS = {"one_group": None, "per_module": lambda fqn: fqn.split(".")[0]}
OPTIMIZERS = {
    # torch.optim on the shards: skips a None gradient, with AdamW's own per-leaf step (its
    # foreach step as funshard's own ops, gated on the device)
    "torch_adamw": (lambda: fs.optim.from_torch(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    # torch's RMSprop: its step is host code, run after the step's read of its verdict
    "torch_rmsprop": (lambda: fs.optim.from_torch(torch.optim.RMSprop, lr=1e-2),
                      lambda ps: torch.optim.RMSprop(ps, lr=1e-2)),
    # the same with select=True: torch's own step, kept or undone on the device
    "torch_rmsprop_selected": (lambda: fs.optim.from_torch(torch.optim.RMSprop, lr=1e-2,
                                                           select=True),
                               lambda ps: torch.optim.RMSprop(ps, lr=1e-2)),
    # torch's fused kernel, skipping on the device a leaf no rank reached (found_inf)
    "torch_adamw_fused": (lambda: fs.optim.from_torch(torch.optim.AdamW, lr=1e-2,
                                                      weight_decay=0.1, fused=True),
                          lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                       fused=True)),
    # fs.optim's Adam: bias corrections by the leaf's own count of updates, as torch's
    "adamw": (lambda: fs.optim.adamw(lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adamw_fused": (lambda: fs.optim.adamw(lr=1e-2, weight_decay=0.1, fused=True),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adam_l2": (lambda: fs.optim.adam(lr=1e-2, weight_decay=0.1),
                lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1)),
    "sgd": (lambda: fs.optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    # a leaf's buffer starts at its first gradient, whenever that comes (then dampened)
    "sgd_dampening": (lambda: fs.optim.sgd(lr=0.1, momentum=0.9, dampening=0.5),
                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5)),
    # Muon on the matrices (its momentum starts at zero), AdamW on the biases
    "muon": (lambda: fs.optim.muon(lr=0.02, momentum=0.9, other=fs.optim.adamw(lr=1e-2)),
             lambda ps: _Both(torch.optim.Muon([p for p in ps if p.ndim == 2], lr=0.02,
                                               momentum=0.9),
                              torch.optim.AdamW([p for p in ps if p.ndim != 2], lr=1e-2))),
}


class _Both:
    """Two torch optimizers over disjoint parameters, as one."""

    def __init__(self, *opts):
        self.opts = opts

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.opts:
            o.step()


class Net(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.maybe = nn.Linear(d, d)
        self.head = nn.Linear(d, 2)

    def forward(self, x, pick):
        h = torch.tanh(self.a(x))
        if pick.any():  # the branch, on the rows that take it
            h = torch.where(pick[:, None], torch.tanh(self.maybe(h)), h)
        return self.head(h)


def _loss(model):
    def loss_fn(params, batch):
        x, y, pick = batch
        return nn.functional.mse_loss(fs.call(model, params, x, pick).float(), y)
    return loss_fn


def _pick(kind: str, world: int) -> torch.Tensor:
    rows = torch.zeros(world * PER_RANK, dtype=torch.bool)
    if kind == "rank0":
        rows[:PER_RANK] = True
    elif kind == "all":
        rows[:] = True
    return rows


def unreached_parity(spec, groups: str, optimizer: str, policy: dict):
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    make, make_ref = OPTIMIZERS[optimizer]
    step = fs.train_step(_loss(model), make(),
                         policy=fs.Policy(groups=GROUPS[groups], **policy))
    state = step.init(fs.shard(fs.params(model), m))
    opt = make_ref(list(ref.parameters()))
    g = torch.Generator().manual_seed(1)
    errs, unchanged, all_reduces = [], None, []
    for kind in PICKS[groups]:
        x = torch.randn(world * PER_RANK, 6, generator=g)
        y = torch.randn(world * PER_RANK, 2, generator=g)
        pick = _pick(kind, world)
        sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        with CountCollectives() as cc:
            state, _ = step(state, (x[sl], y[sl], pick[sl]))
        all_reduces.append(cc.counts.get("all_reduce", 0))
        opt.zero_grad(set_to_none=True)
        loss = sum(_loss(ref)(dict(ref.named_parameters()),
                              tuple(t[j * PER_RANK:(j + 1) * PER_RANK] for t in (x, y, pick)))
                   for j in range(world)) / world
        loss.backward()
        opt.step()
        full = fs.unshard(state.params)
        errs.append(max((full[n] - p.detach()).abs().max().item()
                        for n, p in ref.named_parameters()))
        if unchanged is None:  # after the first step, which no rank's loss took the branch
            unchanged = all(torch.equal(full[n], before[n]) for n in ("maybe.weight",
                                                                     "maybe.bias"))
    return {"errs": errs, "unchanged": unchanged, "all_reduces": all_reduces}


@pytest.mark.parametrize("spec", [1, 2, "2x2"], ids=str)
@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_parameter_no_rank_reaches_is_left_alone_as_in_one_process(pools, spec, groups,
                                                                     optimizer):
    """Step 0: no rank takes the branch, its leaves keep their values and state (torch's
    weight decay and momentum skip them); in one group, step 1: rank 0 alone does, and the
    mean over ranks trains them as one process on the whole batch. Whatever the groups."""
    for rank, r in enumerate(pools.run(spec, unreached_parity, groups, optimizer, {})):
        assert r["unchanged"], (rank, r)
        assert max(r["errs"]) < 1e-6, (rank, r)


@pytest.mark.parametrize("policy", [{"accumulate": 3}, {"param_dtype": torch.bfloat16},
                                    {"reshard_after_forward": False}],
                         ids=["accumulate", "bf16", "shard_grad_op"])
def test_unreached_leaves_under_other_policies(pools, policy):
    """Accumulated micro-batches (a leaf counts as reached when any micro-batch reaches it),
    bfloat16 compute, SHARD_GRAD_OP: the same rule, on 2 ranks."""
    tol = 2e-2 if "param_dtype" in policy else 1e-6
    for rank, r in enumerate(pools.run(2, unreached_parity, "one_group", "sgd", policy)):
        assert r["unchanged"], (rank, r)
        assert max(r["errs"]) < tol, (rank, r)


@pytest.mark.parametrize("optimizer", ["sgd", "torch_adamw", "torch_rmsprop",
                                       "torch_rmsprop_selected"])
def test_the_leaves_reached_cost_no_second_all_reduce_where_the_device_gates(pools,
                                                                             optimizer):
    """With sgd, torch's AdamW or its RMSprop with ``select`` (updates gated on the device),
    the step's one metrics all-reduce carries a flag per leaf, whichever leaves the ranks
    reached. With an optimizer that runs after the host read (torch's RMSprop): the one all-reduce where every leaf was
    reached on every rank (step 2), one more, of a flag per leaf, where some rank left one
    (steps 0, 1, 3)."""
    for rank, r in enumerate(pools.run(2, unreached_parity, "one_group", optimizer, {})):
        want = [2, 2, 1, 2] if optimizer == "torch_rmsprop" else [1, 1, 1, 1]
        assert r["all_reduces"] == want, (rank, r)



def reads_with_a_leaf_in_doubt(spec, optimizer: str, read: bool, compile=False):
    """Host reads of each step, the caller reading its metrics after it (``read``) or never;
    rank 0 alone takes the branch in steps 0, 2 and 3 (the other ranks leave its leaves
    unreached, not knowing whether some rank reached them), no rank in step 1. Then the
    parameters against one process."""
    from tests.test_device import _HostReads

    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    make, make_ref = OPTIMIZERS[optimizer]
    torch._dynamo.reset()
    step = fs.train_step(_loss(model), make(), compile=compile)
    state = step.init(fs.shard(fs.params(model), m))
    opt = make_ref(list(ref.parameters()))
    g = torch.Generator().manual_seed(1)
    seen = []
    for kind in ("rank0", "none", "rank0", "rank0"):
        x, y = torch.randn(world * PER_RANK, 6, generator=g), torch.randn(world * PER_RANK, 2,
                                                                          generator=g)
        pick, sl = _pick(kind, world), slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        reads = _HostReads()
        with reads if not compile or len(seen) >= 2 else contextlib.nullcontext():
            state, metrics = step(state, (x[sl], y[sl], pick[sl]))  # (compiled: once traced)
        seen.append(reads.seen)
        if read:
            float(metrics["loss"])
        opt.zero_grad(set_to_none=True)
        sum(_loss(ref)(dict(ref.named_parameters()),
                       tuple(t[j * PER_RANK:(j + 1) * PER_RANK] for t in (x, y, pick)))
            for j in range(world)).div(world).backward()
        opt.step()
    full = fs.unshard(state.params)
    err = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return seen, err


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "sgd_dampening", "muon",
                                       "torch_adamw", "torch_adamw_fused",
                                       "torch_rmsprop_selected"])
@pytest.mark.parametrize("read", [True, False], ids=["read", "unread"])
def test_a_leaf_some_rank_left_unreached_costs_no_host_read(pools, spec, optimizer, read):
    """Where a rank's loss left a leaf unreached, whether another rank reached it is a flag
    of the metrics all-reduce, on the device: the eager step gates that leaf's update on it
    and reads nothing (it read the flags at once before), and trains as one process. Its
    count of updates stays in doubt until the verdict is read: with the metrics unread, the
    next step reads it before its update, whose bias corrections take the counts (the step
    before, which the device finished: on a GPU, no wait), and a step's start reads the
    step before last's as always."""
    for rank, (seen, err) in enumerate(pools.run(spec, reads_with_a_leaf_in_doubt,
                                                 optimizer, read)):
        assert err < 1e-6, (rank, err)
        if read:
            assert seen == [{}] * 4, (rank, seen)
            continue
        assert all(w.startswith("step/deferred.py") for s in seen for w in s), (rank, seen)
        doubt = [rank > 0, True, rank > 0, rank > 0]  # leaves in doubt, per step
        want = [0] + [int(doubt[k - 1]) + (k >= 2 and not doubt[k - 2]) for k in (1, 2, 3)]
        assert [sum(s.values()) for s in seen] == want, (rank, seen)



def compiled_reads(spec, optimizer: str, compile):
    """A leaf only rank 0's loss reaches (a term of its own) and one no rank's loss reaches
    (a module never called): the host reads of steps 2 and 3 (compiled: after its first,
    eager, step and the second, which compiles), the caller reading each step's metrics;
    then the parameters."""
    from tests.test_device import _HostReads

    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    model.spare = nn.Linear(6, 6)  # never called

    def loss_fn(params, batch):
        x, y = batch
        h = torch.tanh(fs.call(model.a, {k[2:]: v for k, v in params.items()
                                         if k.startswith("a.")}, x))
        if rank == 0:  # the other ranks leave "maybe" unreached
            h = h + torch.tanh(fs.call(model.maybe, {k[6:]: v for k, v in params.items()
                                                     if k.startswith("maybe.")}, h))
        out = fs.call(model.head, {k[5:]: v for k, v in params.items()
                                   if k.startswith("head.")}, h)
        return nn.functional.mse_loss(out, y)

    torch._dynamo.reset()
    init = {k: v.detach().clone() for k, v in fs.params(model).items()}
    make, _ = OPTIMIZERS[optimizer]
    step = fs.train_step(loss_fn, make(), compile=compile)
    state = step.init(fs.shard(fs.params(model), m))
    g = torch.Generator().manual_seed(1)
    seen = []
    for k in range(4):
        x, y = torch.randn(world * PER_RANK, 6, generator=g), torch.randn(world * PER_RANK, 2,
                                                                          generator=g)
        sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        reads = _HostReads()
        with reads if k >= 2 else contextlib.nullcontext():
            state, metrics = step(state, (x[sl], y[sl]))
        seen.append(reads.seen)
        float(metrics["loss"])
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    torch._dynamo.reset()
    return seen[2:], full, init


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_dampening"])
def test_the_compiled_step_gates_a_leaf_in_doubt_on_the_device(pools, optimizer):
    """The compiled update takes a flag per leaf as a program input: a leaf this rank left
    unreached is updated where some rank reached it, and one no rank reached is left alone,
    with no host read (it read the flags at every step before), as the eager step trains
    them (aot_eager, 2 ranks)."""
    for rank, ((es, e, init), (cs, c, _)) in enumerate(zip(
            pools.run(2, compiled_reads, optimizer, False, timeout=600),
            pools.run(2, compiled_reads, optimizer, {"backend": "aot_eager"}, timeout=600))):
        assert cs == [{}, {}] and es == [{}, {}], (rank, cs, es)
        assert max((c[k] - e[k]).abs().max().item() for k in e) <= 1e-5, rank
        assert not torch.equal(c["maybe.weight"], init["maybe.weight"]), rank  # trained
        assert torch.equal(c["spare.weight"], init["spare.weight"]), rank  # left alone
