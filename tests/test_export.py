"""fs.checkpoint.export_module: trained shards back into an nn.Module (meta or real, rank 0 or
every rank), the Hugging Face save_pretrained path, and what is refused by name."""

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard.testing import mesh
from funshard.testing.models import GPT, gpt_loss

DIMS = dict(vocab=32, dim=16, heads=2, layers=2, seq=8)


def _trained(m, model):
    """Shards of a seeded GPT after one SGD step (values no fresh model has)."""
    step = fs.train_step(gpt_loss(model), fs.optim.sgd(lr=0.5))
    state = step.init(fs.shard(fs.params(model), m))
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, DIMS["vocab"], (2, DIMS["seq"]), generator=g)
    state, _ = step(state, (x, x.roll(1, dims=1)))
    return state.params


def export_gpt(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    params = _trained(m, GPT(**DIMS))
    full = fs.unshard(params)
    with torch.device("meta"):
        meta = GPT(**DIMS)
    got = fs.checkpoint.export_module(meta, params, rank0_only=False)  # every rank
    assert got is meta and meta.head.weight is meta.wte.weight  # swapped, tie kept
    every = all(torch.equal(p, full[n]) and p.device.type == "cpu" and p.requires_grad
                for n, p in meta.named_parameters())
    torch.manual_seed(1)
    real = GPT(**DIMS)
    storage = real.wte.weight.data_ptr()
    got = fs.checkpoint.export_module(real, params)  # rank 0 only
    if dist.get_rank():
        return every, got is None and not torch.equal(real.wte.weight, full["wte.weight"])
    copied = all(torch.equal(p, full[n]) for n, p in real.named_parameters())
    return every, (got is real and copied and real.wte.weight.data_ptr() == storage
                   and real.head.weight is real.wte.weight)


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_export_into_meta_and_real_modules(pools, spec):
    assert pools.run(spec, export_gpt) == [(True, True)] * (4 if spec == "2x2" else 2)


def export_errors(spec):
    m = mesh(spec)
    torch.manual_seed(0)
    params = fs.shard(fs.params(GPT(**DIMS)), m)
    msgs = []
    bad = {
        "wider": GPT(**{**DIMS, "dim": 24}),
        "missing": {k: v for k, v in params.items() if k != "ln_f.bias"},
        "extra": {**params, "extra.weight": params["ln_f.bias"]},
    }
    for what, x in bad.items():
        module, tree = (x, params) if isinstance(x, torch.nn.Module) else (GPT(**DIMS), x)
        try:
            fs.checkpoint.export_module(module, tree)
        except ValueError as e:
            msgs.append(str(e))
    with torch.device("meta"):
        buffered = GPT(**DIMS)
    buffered.register_buffer("mask", torch.ones(3, device="meta"))
    try:
        fs.checkpoint.export_module(buffered, params)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_export_refuses_by_name(pools):
    wider, missing, extra, buffer = pools.run(2, export_errors)[1]
    assert wider.startswith("export_module: the params tree does not fit the module; nothing "
                            "was gathered:")
    assert ("params['wte.weight'] is (32, 16) torch.float32, the module's parameter is (32, 24) "
            "torch.float32") in wider
    assert "module parameter 'ln_f.bias' (16,) is not in params" in missing
    assert "params['extra.weight'] is not a parameter of the module" in extra
    assert "buffer 'mask' (3,) is on the meta device and was not given: pass " in buffer


def export_buffers(spec):
    """A BatchNorm model trained with its buffers in the state: export_module(meta, state)
    fills parameters and running statistics; the module in eval mode gives what eval_step
    gives on the state."""
    from torch import nn

    m = mesh(spec)

    def build():
        return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    torch.manual_seed(0)
    model = build()
    step = fs.train_step(lambda pb, b: torch.nn.functional.mse_loss(
        fs.call(model, pb, b[0]), b[1]), fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), m), fs.buffers(model))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        state, _ = step(state, (torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)))
    with torch.device("meta"):
        meta = build()
    got = fs.checkpoint.export_module(meta, state, rank0_only=False)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(9))
    model.eval()
    want = fs.eval_step(lambda pb, x: fs.call(model, pb, x))(state, x)
    meta.eval()
    stats = meta[1].running_mean
    return (got is meta and torch.equal(meta(x), want) and stats.device.type == "cpu"
            and torch.equal(stats, state.buffers["1.running_mean"].to_local())
            and int(meta[1].num_batches_tracked) == 2)


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
def test_export_carries_buffers(pools, spec):
    assert all(pools.run(spec, export_buffers))


def _llama(tied: bool, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=36, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def hf_save_pretrained(spec, tied, path):
    """Train 2 SGD steps, export into a fresh Llama on rank 0, save_pretrained, reload with
    from_pretrained: its logits equal the trained params' through the training model."""
    from transformers import LlamaForCausalLM

    m = mesh(spec)
    model = _llama(tied, seed=0)

    def loss_fn(params, ids):
        return torch.func.functional_call(model, params, (), {"input_ids": ids,
                                                              "labels": ids}).loss

    step = fs.train_step(loss_fn, fs.optim.sgd(lr=0.5))
    state = step.init(fs.shard(fs.params(model), m))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        state, _ = step(state, torch.randint(0, 64, (2, 8), generator=g))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = torch.func.functional_call(model, fs.unshard(state.params), (ids,)).logits
    target = _llama(tied, seed=1) if dist.get_rank() == 0 else model  # rank 0 holds the copy
    hf = fs.checkpoint.export_module(target, state.params)
    if hf is None:
        return None
    hf.save_pretrained(path)
    back = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        got = back(ids).logits
    return (got - want).abs().max().item(), back.lm_head.weight is back.model.embed_tokens.weight


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_save_pretrained_round_trip(pools, tmp_path, tied):
    err, shared = pools.run(2, hf_save_pretrained, tied, str(tmp_path / "hf"))[0]
    assert err < 1e-6 and shared == tied
