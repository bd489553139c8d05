"""Models nobody here wrote: tiny Hugging Face transformers configs built in code (no
download), trained on N ranks == one process; what funshard cannot make correct yet is
refused by name."""

import copy

import pytest
import torch
import torch.distributed as dist

import funshard as fs
from funshard.testing import capture, mesh


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=36, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _loss_fn(model):
    def loss_fn(params, ids):
        return torch.func.functional_call(model, params, (), {"input_ids": ids,
                                                              "labels": ids}).loss
    return loss_fn


def llama_parity(spec, tied, raf, frozen_head=False, steps=3, per_rank=2):
    """SGD on the mesh vs one process on the concatenated batch (mean of per-rank losses);
    a frozen head (tied: the embedding too) stays bit-identical."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _llama(tied)
    if frozen_head:
        model.lm_head.weight.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ref = copy.deepcopy(model)
    step = fs.train_step(_loss_fn(model), fs.optim.sgd(lr=0.1),
                         policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (world * per_rank, 8), generator=g)
        state, _ = step(state, ids[rank * per_rank:(rank + 1) * per_rank])
        opt.zero_grad()
        chunks = ids.split(per_rank)
        loss = sum(ref(input_ids=c, labels=c).loss for c in chunks) / len(chunks)
        loss.backward()
        opt.step()
    full = fs.unshard(state.params)
    assert all(torch.equal(full[n], v) for n, v in frozen.items())
    return max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_llama_trains_as_one_process(pools, spec, tied, raf):
    for rank, err in enumerate(pools.run(spec, llama_parity, tied, raf)):
        assert err < 1e-5, (rank, err)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_llama_frozen_head(pools, tied, raf):
    """A frozen lm_head (tied: the embedding with it) once crashed when its group was
    gathered again in backward; it now trains the rest exactly and keeps the head."""
    for rank, err in enumerate(pools.run(2, llama_parity, tied, raf, True)):
        assert err < 1e-5, (rank, err)


def llama_checkpointing(spec):
    model = _llama(False)
    model.gradient_checkpointing_enable()
    model.train()
    step = fs.train_step(_loss_fn(model), fs.optim.sgd(lr=0.1))
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    before = {k: v.to_local().clone() for k, v in state.params.items()}
    t, msg = capture(lambda: step(state, torch.randint(0, 64, (2, 8))))
    same = all(torch.equal(before[k], v.to_local()) for k, v in state.params.items())
    return t, msg, same


def test_gradient_checkpointing_through_functional_call_is_refused_by_name(pools):
    """functional_call puts the module's own weights back before backward recomputes: the
    recompute would train on them. Refused, pointing at fs.call (tests/test_ac.py: trains)."""
    for rank, (t, msg, same) in enumerate(pools.run(2, llama_checkpointing)):
        assert t == "NotImplementedError" and same, (rank, t, msg)
        assert "Call the module with fs.call(model, params, *args)" in msg, msg


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=32,
                                      max_position_embeddings=16, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    model = _llama(False)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"]))


def _t5():
    """An encoder-decoder with tied embeddings, whose first blocks hold the relative position
    bias (unlike the others: they are blocks all the same)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=24,
                                               num_layers=3, num_heads=2, dropout_rate=0.0,
                                               decoder_start_token_id=0))


def _mixtral():
    """Mixture of experts: each token routed to 2 of 4 experts, by the data on each rank."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0))


BUILDERS = {"gpt2": _gpt2, "bert": _bert, "lora": _lora_llama, "t5": _t5, "mixtral": _mixtral}


def model_parity(spec, which, raf, steps=3, per_rank=2):
    """SGD on the mesh vs torch.optim.SGD in one process on the concatenated batch; frozen
    leaves bit-identical; an AdamW state holds the trainable leaves only."""
    m = mesh(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = BUILDERS[which]()
    if which == "lora":  # B starts at zero: move it so every LoRA weight gets a gradient
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    step = fs.train_step(_loss_fn(model), fs.optim.sgd(lr=0.1),
                         policy=fs.Policy(reshard_after_forward=raf))
    state = step.init(fs.shard(fs.params(model), m))
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (world * per_rank, 8), generator=g)
        state, _ = step(state, ids[rank * per_rank:(rank + 1) * per_rank])
        opt.zero_grad()
        chunks = ids.split(per_rank)
        (sum(ref(input_ids=c, labels=c).loss for c in chunks) / len(chunks)).backward()
        opt.step()
    full = fs.unshard(state.params)
    out = {"err": max((full[n] - p.detach()).abs().max().item()
                      for n, p in ref.named_parameters()),
           "frozen_equal": all(torch.equal(full[n], v) for n, v in frozen.items()),
           "groups": [gi.name for gi in fs.list_groups(fs.params(model))]}
    adam = fs.optim.adamw(lr=1e-3).init(state.params)
    state_elems = sum(x.numel() for x in fs.pytree.flatten(adam)[0]  # global sizes
                      if isinstance(x, torch.Tensor) and x.ndim)
    out["opt_state_x_trainable"] = state_elems / sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    return out


@pytest.mark.parametrize("spec", [2, "2x2"], ids=str)
@pytest.mark.parametrize("which", ["gpt2", "bert", "lora", "t5", "mixtral"])
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_real_models_train_as_one_process(pools, spec, which, raf):
    for rank, r in enumerate(pools.run(spec, model_parity, which, raf)):
        assert r["err"] < 1e-5 and r["frozen_equal"], (rank, r)
        assert r["groups"][1:] == {
            "gpt2": ["transformer.h.0", "transformer.h.1"],
            "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
            "lora": [f"base_model.model.model.layers.{i}" for i in range(3)],
            "t5": [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(3)],
            "mixtral": ["model.layers.0", "model.layers.1"]}[which], r
        # AdamW keeps two moments of the trainable leaves only (LoRA: of the adapters)
        assert r["opt_state_x_trainable"] == 2.0, r


@pytest.mark.parametrize("which", list(BUILDERS))
def test_models_on_one_rank(pools, which):
    """A world of one with no cast (the parameters are autograd leaves, Group.alias): tied
    embeddings, LoRA's frozen base and BERT train as one process, frozen leaves unchanged."""
    r = pools.run(1, model_parity, which, True)[0]
    assert r["err"] < 1e-5 and r["frozen_equal"], r
