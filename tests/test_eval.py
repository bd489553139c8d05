"""fs.eval_step: any function of the parameters, forward only, one group at a time; equal to
the same function on the full parameters."""

import pytest
import torch

import funshard as fs
from funshard.testing import CountCollectives, LivePeak, mesh
from funshard.testing.models import GPT, gpt_loss

SPECS = [1, 2, "2x2"]


def _model():
    torch.manual_seed(0)
    return GPT(vocab=32, dim=16, heads=2, layers=3, seq=8)


def eval_parity(spec, policy_kw):
    """Logits, a loss and a greedy generation loop through eval_step vs the full model."""
    m = mesh(spec)
    model = _model()
    policy = fs.Policy(**policy_kw)
    params = fs.shard(fs.params(model), m)
    full = {k: v.detach().clone() for k, v in fs.params(model).items()}
    if policy.param_dtype is not None:
        full = {k: v.to(policy.param_dtype) for k, v in full.items()}
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def logits(p, x):
        return torch.func.functional_call(model, p, (x,))

    def generate(p, x, n=4):
        for _ in range(n):
            nxt = logits(p, x[:, -8:])[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], 1)
        return x

    out = {}
    ev = fs.eval_step(logits, policy=policy)
    with CountCollectives() as cc:
        got = ev(params, idx)
    with torch.no_grad():
        want = logits(full, idx)
    out["logits"] = (got - want).abs().max().item()
    out["requires_grad"] = got.requires_grad
    out["counts"] = dict(cc.counts)
    state = fs.train_step(gpt_loss(model), fs.optim.sgd(lr=0.0)).init(params)
    out["loss"] = abs(fs.eval_step(gpt_loss(model), policy=policy)(state, (idx, idx)).item()
                      - gpt_loss(model)(full, (idx, idx)).item())
    with torch.no_grad():
        out["generate"] = torch.equal(fs.eval_step(generate, policy=policy)(params, idx),
                                      generate(full, idx))
    out["unchanged"] = all(torch.equal(v.full_tensor(), fs.params(model)[k].detach())
                           for k, v in params.items())
    return out


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("policy_kw", [{}, {"reshard_after_forward": False},
                                       {"param_dtype": torch.bfloat16}],
                         ids=["full_shard", "shard_grad_op", "bf16"])
def test_eval_equals_the_full_model(pools, spec, policy_kw):
    world = 4 if spec == "2x2" else spec
    for r in pools.run(spec, eval_parity, policy_kw):
        assert r["logits"] == 0.0 and r["loss"] < 1e-6 and r["generate"], r
        assert r["requires_grad"] is False and r["unchanged"], r
        # one all-gather per group (3 blocks + the rest), never a gradient collective; with
        # FULL_SHARD the rest (embeddings, final norm, tied head) is freed after the
        # embedding and gathered again for the head
        want = {"all_gather": 4 + policy_kw.get("reshard_after_forward", True)}
        want = want if world > 1 else {}
        assert {k: v for k, v in r["counts"].items() if k != "barrier"} == want, r


def eval_peak(spec):
    """FULL_SHARD evaluation holds about one group (and the next one's prefetch); unshard-all
    holds every group."""
    m = mesh(spec)
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=64, heads=4, layers=8, seq=8)
    params = fs.shard(fs.params(model), m)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    ev = fs.eval_step(lambda p, x: torch.func.functional_call(model, p, (x,)))
    ev(params, idx)  # learns the order (then prefetches)
    with LivePeak(torch.device("cpu")) as mine:
        ev(params, idx)
    with LivePeak(torch.device("cpu")) as every:
        with torch.no_grad():
            torch.func.functional_call(model, fs.unshard(params), (idx,))
    block = sum(p.numel() * 4 for p in model.layers[0].parameters())
    return mine.peak, every.peak, block


def test_eval_peak_is_a_group_not_the_model(pools):
    mine, every, block = pools.run(2, eval_peak)[0]
    # unshard-all holds 8 blocks beyond the shards; eval at most the block in use, the next
    # one's prefetch and the rest group's embedding
    assert mine <= every - 5 * block, (mine, every, block)


def escaped(spec):
    m = mesh(spec)
    model = _model()
    params = fs.shard(fs.params(model), m)
    kept = fs.eval_step(lambda p: p["lm_head.weight"] if "lm_head.weight" in p else
                        p["wte.weight"])(params)
    try:
        kept + 1
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_parameter_returned_from_eval_is_refused_when_used(pools):
    for msg in pools.run(2, escaped):
        assert "has ended" in msg, msg
