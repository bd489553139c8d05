"""fs.optim.muon in the eager step, gated on the device (no host read in the step): it trains
as the same Muon run after the step's host read (``chain(muon(...))``, which the device does
not gate) bit for bit, whatever batches are non-finite and whether the policy refuses or
skips them; a refused step leaves the state passed into it usable, a skipped one counts no
leaf's update, and neither reads on the host."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

import funshard as fs
from funshard.testing import mesh
from test_device import _HostReads
from test_skip_counts import Net

POLICIES = {"refuse": {"clip_norm": 0.5}, "skip": {"skip_nonfinite": True, "clip_norm": 0.5},
            "plain": {}}


def _muon():
    return fs.optim.muon(lr=0.02, momentum=0.9, other=fs.optim.adamw(lr=1e-2, weight_decay=0.1))


def through(spec, gated: bool, policy: str, bads: tuple, steps: int = 5):
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

    opt = _muon() if gated else fs.optim.chain(_muon())
    step = fs.train_step(loss_fn, opt, policy=fs.Policy(**POLICIES[policy]))
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
    counts = dict(state.opt_state.inner_states["other"].count)
    return refusals, (state.step, state.skipped), counts, reads, full


@settings(max_examples=5, deadline=None)
@given(bads=st.sets(st.integers(0, 4), max_size=2), policy=st.sampled_from(sorted(POLICIES)))
def test_muon_gated_on_the_device_trains_as_muon_read_on_the_host(pools, bads, policy):
    """A law over which batches are NaN and the policy: the gated Muon's refusals, counts
    and parameters are the host-read Muon's, bit for bit, on 2 ranks (each matrix
    orthogonalised on its owner), and its steps read nothing on the host."""
    bads = tuple(sorted(bads)) if policy != "plain" else ()
    for (gr, gc, gk, greads, gp), (rr, rc, rk, rreads, rp) in zip(
            pools.run(2, through, True, policy, bads), pools.run(2, through, False, policy, bads)):
        assert gr == rr == ([] if policy == "skip" else list(bads)), (gr, rr, bads)
        assert gc == rc and gk == rk, (gc, rc, gk, rk)
        skipped = len(bads) if policy == "skip" else 0
        assert gc == (5 - (0 if policy == "skip" else len(bads)), skipped), gc
        assert gk["a.bias"] is None and gk["a.weight"] is None, gk  # Muon's matrix, frozen
        assert gk["b.bias"] == 5 - len(bads), gk  # the other rule's counts: updates applied
        assert greads == {}, greads
        assert "step/update.py" in rreads, rreads
        for k in rp:
            assert torch.equal(gp[k], rp[k]), (k, (gp[k] - rp[k]).abs().max().item())


@pytest.mark.parametrize("spec", [1, "2x2"], ids=str)
def test_muon_gated_skips_as_read_on_the_host_on_any_mesh(pools, spec):
    """One process and a 2x2 mesh (each replica group orthogonalises on its own): a skipped
    batch and a clip, the gated Muon's parameters and counts are the host-read one's."""
    for (_, gc, gk, greads, gp), (_, rc, rk, _, rp) in zip(
            pools.run(spec, through, True, "skip", (1,)),
            pools.run(spec, through, False, "skip", (1,))):
        assert gc == rc == (5, 1) and gk == rk and greads == {}, (gc, rc, gk, greads)
        for k in rp:
            assert torch.equal(gp[k], rp[k]), (k, (gp[k] - rp[k]).abs().max().item())
