"""Optimizers gated on the device in the eager step (no host read in the step) besides the
named ``adam``, ``adamw`` and ``sgd``: ``fs.optim.muon``, a chain of fs.optim's own
transformations that is one of those three (optax's idiom, a clip in front), and torch's
fused AdamW through ``from_torch`` (its kernel's ``found_inf``). Each trains as
the same optimizer run after the step's host read (its traced form taken off) bit for bit
(SGD: to float32 rounding), whatever batches are non-finite and whether the policy refuses or
skips them; a refused step leaves the state passed into it usable, a skipped one counts no
leaf's update, and neither reads on the host."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

import funshard as fs
from funshard.optim.base import local
from funshard.optim.with_policy import with_policy
from funshard.testing import mesh
from test_device import _HostReads
from test_skip_counts import Net

POLICIES = {"refuse": {}, "skip": {"skip_nonfinite": True}, "plain": {}}  # (plain: no NaN)


O = fs.optim
OPTIMIZERS = {
    "muon": lambda: O.chain(O.clip_by_global_norm(0.5), O.muon(
        lr=0.02, momentum=0.9, other=O.adamw(lr=1e-2, weight_decay=0.1))),
    # AdamW written out, with a schedule and a decay mask, behind optax's clip
    "adamw_chain": lambda: O.chain(
        O.apply_if_finite(), O.clip_by_global_norm(0.5), O.scale_by_adam(0.8, 0.99),
        O.add_decayed_weights(0.1, lambda fqn: fqn.endswith("weight")),
        O.scale_by_learning_rate(O.warmup_cosine(1e-2, 2, 5))),
    # schedules: where the step before's verdict is unread, the compiled step's update takes
    # both cases' learning rates and the device chooses
    "muon_schedules": lambda: O.chain(O.clip_by_global_norm(0.5), O.muon(
        lr=O.linear(0.02, 0.005, 5), momentum=0.9,
        other=O.adamw(O.warmup_cosine(1e-2, 2, 5), weight_decay=0.1))),
    # torch's fused AdamW (its kernel takes the verdict as found_inf), a schedule and a clip
    "torch_adamw_fused": lambda: with_policy(O.from_torch(
        torch.optim.AdamW, lr=O.warmup_cosine(1e-2, 2, 5), weight_decay=0.1, fused=True),
        clip_norm=0.5),
    # torch's foreach AdamW (its step as funshard's own ops, gated), a schedule and a clip
    "torch_adamw": lambda: with_policy(O.from_torch(
        torch.optim.AdamW, lr=O.warmup_cosine(1e-2, 2, 5), weight_decay=0.1), clip_norm=0.5),
    # torch's own defaults (lr 1e-3, weight decay 0.01)
    "torch_adamw_defaults": lambda: O.from_torch(torch.optim.AdamW),
    # torch's Adam with an L2 penalty and its own betas
    "torch_adam_l2": lambda: O.from_torch(torch.optim.Adam, lr=1e-2, weight_decay=0.1,
                                          betas=(0.8, 0.99), foreach=True),
    # torch's steps selected on the device (select=True: torch's own step, then kept or
    # undone)
    "torch_rmsprop": lambda: with_policy(O.from_torch(
        torch.optim.RMSprop, lr=O.warmup_cosine(1e-2, 2, 5), momentum=0.5, centered=True,
        select=True), clip_norm=0.5),
    "torch_sgd_nesterov": lambda: O.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9,
                                               nesterov=True, weight_decay=0.01, select=True),
    # dampening: a first step's buffer is the gradient, later ones take (1 - dampening) of it
    "torch_sgd_dampening": lambda: O.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9,
                                                dampening=0.5, select=True),
    "torch_adam_amsgrad": lambda: O.from_torch(torch.optim.Adam, lr=1e-2, amsgrad=True,
                                               foreach=False, select=True),
    "torch_adagrad": lambda: O.from_torch(torch.optim.Adagrad, lr=0.1, lr_decay=0.01,
                                          select=True),
    "torch_rprop": lambda: O.from_torch(torch.optim.Rprop, lr=1e-2, select=True),
    "torch_adamax": lambda: O.from_torch(torch.optim.Adamax, lr=1e-2, select=True),
    "sgd_chain": lambda: O.chain(O.clip_by_global_norm(0.5),
                                 O.chain(O.add_decayed_weights(0.01), O.trace(0.9, nesterov=True),
                                         O.scale_by_learning_rate(0.1))),
}


def _counts(name: str, opt_state) -> dict:
    if name.startswith("torch"):  # the updates torch took, its own step count, the host's
        assert all(n is None or int(local(n).item()) == c for n, c in zip(
            opt_state.stepped.values(), opt_state.count.values())), opt_state
        steps = opt_state.state.get("step", opt_state.stepped)  # (SGD keeps none)
        return {k: None if n is None else (int(local(n).item()), float(local(s).item()), c)
                for (k, n), s, c in zip(opt_state.stepped.items(), steps.values(),
                                        opt_state.count.values())}
    return dict((opt_state.inner_states["other"] if name.startswith("muon")
                 else opt_state).count)


def _updates(name: str, counts: dict, key: str):
    return counts[key][0] if name.startswith("torch") and counts[key] else counts[key]


def through(spec, name: str, gated: bool, policy: str, bads: tuple, steps: int = 5):
    """Train ``steps`` batches, NaN at ``bads``, reading each step's loss; at a refusal go on
    from the state passed into the refused step, with the batch after it. The refusals (the
    batch whose read raised), the counts, the other rule's counts, the host reads the steps
    made, and the final parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    model.a.bias.requires_grad_(False)  # frozen: no count, the later leaves move in the order

    def loss_fn(p, batch):
        return nn.functional.mse_loss(fs.call(model, p, batch[0]), batch[1])

    opt = OPTIMIZERS[name]()
    assert opt.traced is not None  # the device gates it
    step = fs.train_step(loss_fn, opt if gated else opt._replace(traced=None),
                         policy=fs.Policy(**POLICIES[policy]))
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 2, generator=g))
            for _ in range(steps)]
    rows = slice(2 * rank, 2 * rank + 2)
    refusals, inputs, reads, i = [], {}, {}, 0
    while i < steps:
        x, y = data[i]
        inputs[i] = state
        seen = _HostReads()
        try:
            with seen:
                new, metrics = step(state, (x[rows], y[rows] * (float("nan") if i in bads
                                                                else 1.0)))
            float(metrics["loss"])
        except FloatingPointError:
            refusals.append(i)
            state, i = inputs[i], i + 1
            continue
        finally:
            for k, n in seen.seen.items():
                reads[k.split(":")[0]] = reads.get(k.split(":")[0], 0) + n
        state, i = new, i + 1
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    if name.startswith("torch"):  # and torch's state
        full.update({f"{key}:{k}": v.detach().clone() for key, tree in
                     state.opt_state.state.items() for k, v in fs.unshard(tree).items()
                     if v is not None})
    return refusals, (state.step, state.skipped), _counts(name, state.opt_state), reads, full


def compiled_or_not(spec, name: str, compile, bads: tuple, read: bool, steps: int = 5):
    """``steps`` batches under ``skip_nonfinite``, NaN at ``bads``, the metrics read after
    each step (``read``) or never; per step from the third (compiled: the first two trace),
    the host reads it made; the counts and the final parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()

    def loss_fn(p, batch):
        return nn.functional.mse_loss(fs.call(model, p, batch[0]), batch[1])

    torch._dynamo.reset()
    step = fs.train_step(loss_fn, OPTIMIZERS[name](), policy=fs.Policy(skip_nonfinite=True),
                         compile=compile)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    g = torch.Generator().manual_seed(1)
    rows, reads = slice(2 * rank, 2 * rank + 2), []
    for i in range(steps):
        x, y = torch.randn(2 * world, 6, generator=g), torch.randn(2 * world, 2, generator=g)
        seen = _HostReads()
        with seen if i >= 2 else contextlib.nullcontext():
            state, metrics = step(state, (x[rows], y[rows] * (float("nan") if i in bads
                                                              else 1.0)))
        reads += [seen.seen] if i >= 2 else []
        if read:
            float(metrics["loss"])
    full = {k: v.detach().clone() for k, v in fs.unshard(state.params).items()}
    return reads, (state.step, state.skipped), _counts(name, state.opt_state), full


@pytest.mark.parametrize("read", [True, False], ids=["read", "unread"])
@pytest.mark.parametrize("name", ["muon", "muon_schedules", "torch_adamw", "torch_adamw_fused",
                                  "torch_rmsprop"])
def test_the_compiled_step_gates_as_the_eager_step(pools, name, read):
    """The compiled step runs Muon's matrices (torch's fused AdamW: all of it) eagerly,
    gated on the device as the eager step does (the rest in its update program), and reads
    nothing on the host: with the metrics read, no read in a step; unread, one earlier
    verdict at a step's start (Muon: the step before last's, as with adamw; torch's: the
    step before's, whose count its learning rate on the host takes, as in the eager step).
    Skipped batches (the second, the fourth: with the verdicts unread, each step's scalars
    in both cases), counts and parameters as the eager step's (the program's fused ops:
    within 1e-5)."""
    bads = (1, 3)
    for (er, ec, ek, ep), (cr, cc, ck, cp) in zip(
            pools.run(2, compiled_or_not, name, False, bads, read),
            pools.run(2, compiled_or_not, name, {"backend": "aot_eager"}, bads, read)):
        assert ec == cc == (5, 2) and ek == ck, (ec, cc, ek, ck)
        for k in ep:
            assert (cp[k] - ep[k]).abs().max().item() <= 1e-5, k
        if read:
            assert cr == [{}] * 3, cr
        else:
            assert all(sum(r.values()) == 1 and all(w.startswith("step/deferred.py") for w in r)
                       for r in cr), cr


def _same(name: str, a: dict, b: dict) -> None:
    for k in b:
        if name == "sgd_chain":  # (the gated update's last add rounds once more)
            assert (a[k] - b[k]).abs().max().item() <= 1e-6, k
        else:
            assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max().item())


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), bads=st.sets(st.integers(0, 4), max_size=2),
       policy=st.sampled_from(sorted(POLICIES)))
def test_gated_on_the_device_trains_as_read_on_the_host(pools, name, bads, policy):
    """A law over the optimizer, which batches are NaN and the policy: gated, its refusals,
    counts and parameters are those of the same optimizer run after the host read, on 2
    ranks (Muon: each matrix orthogonalised on its owner), and its steps read nothing on
    the host."""
    _law(pools, name, tuple(sorted(bads)) if policy != "plain" else (), policy)


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n.startswith("torch")])
@pytest.mark.parametrize("policy", ["refuse", "skip"])
def test_torch_gated_as_read_on_two_ranks(pools, name, policy):
    """The law for torch's Adam and AdamW on 2 ranks, the second and fourth batches NaN:
    gated on the device (foreach: funshard's ops with its scalars; fused: its kernel's
    found_inf), they skip or refuse them as the read step does, torch's own step, bit for
    bit."""
    _law(pools, name, (1, 3), policy)


def _law(pools, name: str, bads: tuple, policy: str) -> None:
    for (gr, gc, gk, greads, gp), (rr, rc, rk, rreads, rp) in zip(
            pools.run(2, through, name, True, policy, bads),
            pools.run(2, through, name, False, policy, bads)):
        assert gr == rr == ([] if policy == "skip" else list(bads)), (gr, rr, bads)
        assert gc == rc and gk == rk, (gc, rc, gk, rk)
        skipped = len(bads) if policy == "skip" else 0
        assert gc == (5 - (0 if policy == "skip" else len(bads)), skipped), gc
        assert gk["a.bias"] is None, gk  # frozen
        assert _updates(name, gk, "a.weight") == (None if name.startswith("muon")
                                                  else 5 - len(bads)), gk
        assert _updates(name, gk, "b.bias") == 5 - len(bads), gk  # updates applied
        assert greads == {}, greads
        assert "step/update.py" in rreads, rreads
        _same(name, gp, rp)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("spec", [1, "2x2"], ids=str)
def test_gated_skips_as_read_on_the_host_on_any_mesh(pools, spec, name):
    """One process and a 2x2 mesh (Muon: each replica group orthogonalises on its own): a
    skipped batch and a clip, the gated update's parameters and counts are the host-read
    one's."""
    for (_, gc, gk, greads, gp), (_, rc, rk, _, rp) in zip(
            pools.run(spec, through, name, True, "skip", (1,)),
            pools.run(spec, through, name, False, "skip", (1,))):
        assert gc == rc == (5, 1) and gk == rk and greads == {}, (gc, rc, gk, greads)
        _same(name, gp, rp)


SELECTED = ["torch_rmsprop", "torch_sgd_dampening", "torch_adam_amsgrad", "torch_rprop",
            "torch_adamax"]


def through_in_chunks(spec, name: str, policy: str, bads: tuple, steps: int = 5):
    """:func:`through`, gated, each leaf stepped by a call of torch's of its own (the copies
    a selected step keeps limited to one byte)."""
    from funshard.optim import torch_gated

    before, torch_gated.SELECT_BYTES = torch_gated.SELECT_BYTES, 1
    try:
        return through(spec, name, True, policy, bads, steps)
    finally:
        torch_gated.SELECT_BYTES = before


@pytest.mark.parametrize("name", SELECTED)
@pytest.mark.parametrize("policy", ["refuse", "skip"])
def test_a_selected_step_skips_a_first_step_and_steps_in_parts(pools, name, policy):
    """torch's step selected on the device ([Note: any torch step selected on the device]):
    the first batch NaN (torch made the state of that step, which the verdict discards: the
    next step makes it afresh), stepped one leaf per call of torch's or all in one, it trains
    as the same optimizer after a read, bit for bit, and so does its state (after the
    skipped first step alone: torch's initial state, what the read step holds)."""
    _law(pools, name, (0, 3), policy)
    for steps in (5, 1):
        for (gr, gc, gk, greads, gp), (rr, rc, rk, _, rp) in zip(
                pools.run(2, through_in_chunks, name, policy, (0, 3), steps),
                pools.run(2, through, name, False, policy, (0, 3), steps)):
            assert (gr, gc, gk, greads) == (rr, rc, rk, {}), (gr, rr, gc, rc, gk, rk, greads)
            assert set(gp) == set(rp), (set(gp), set(rp))
            _same(name, gp, rp)
