"""``train_step(..., compile=...)`` on models nobody here wrote: peft LoRA (a tiny Hugging Face
Llama, with and without Hugging Face's checkpointing, and PyTorch's own MLPStack) with its
base frozen, and PyTorch's own test models (``common_fsdp.MLPStack``;
``common_dtensor.Transformer``, its output head tied to the embedding, with and without its
own ``torch.utils.checkpoint`` per block) under FULL_SHARD and SHARD_GRAD_OP. On 2 gloo
ranks, 3 AdamW steps: the compiled step (``aot_eager``, AOTAutograd's graphs run op by op)
trains as the eager step and as one process on the whole batch (``torch.optim.AdamW``), in
one dynamo graph with no graph break, its program run at every step; frozen leaves stay
bit-identical. ``Policy(param_dtype=bfloat16, reduce_dtype=float32)`` compiled trains as
the eager step does (LoRA: a frozen bfloat16 base)."""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funshard as fs
from funshard.testing import mesh
from test_compiled_step import _max_diff

LR, WD, VOCAB, SEQ = 1e-3, 0.1, 32, 8


def _llama(checkpointed=False):
    """``checkpointed``: Hugging Face's own non-reentrant checkpointing of each decoder layer
    (the usual LoRA fine-tuning set-up, as tests/test_ac.py trains it eagerly)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=36, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    if checkpointed:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def _mlpstack():
    from torch.testing._internal.common_fsdp import MLPStack

    torch.manual_seed(0)
    return MLPStack(6)


def _transformer(checkpointed=False):
    """weight_tying (the default): output.weight is tok_embeddings.weight; ``checkpointed``:
    each block under the model's own torch.utils.checkpoint (non-reentrant)."""
    from torch.testing._internal.distributed._tensor.common_dtensor import (ModelArgs,
                                                                           Transformer)

    torch.manual_seed(0)
    return Transformer(ModelArgs(n_layers=2, dim=16, n_heads=2, vocab_size=VOCAB,
                                 max_seq_len=SEQ, dropout_p=0.0,
                                 checkpoint_activations=checkpointed))


def _lora(base, targets):
    """peft LoRA on ``base()``: only the adapters trainable. B starts at zero: moved, so that
    every adapter gets a gradient from the first step."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                              target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    return model


def _direct(model, params, *args, **kwargs):
    """The one-process reference: the module with its own parameters."""
    return model(*args, **kwargs)


def _causal_lm(model, params, batch, call):
    (ids,) = batch
    return call(model, params, input_ids=ids, labels=ids, use_cache=False).loss


def _next_token(model, params, batch, call):
    x, y = batch
    return F.cross_entropy(call(model, params, x).flatten(0, 1), y.flatten())


def _regression(model, params, batch, call):
    x, y = batch
    return F.mse_loss(call(model, params, x), y)


MODELS = {  # name: (build, loss, batch kind)
    "lora_llama": (lambda: _lora(_llama, ["q_proj", "v_proj"]), _causal_lm, "ids"),
    "lora_llama_checkpointed": (lambda: _lora(lambda: _llama(True), ["q_proj", "v_proj"]),
                                _causal_lm, "ids"),
    "lora_mlpstack": (lambda: _lora(_mlpstack, ["in_proj", "out_proj"]), _regression,
                      "regression"),
    "mlpstack": (_mlpstack, _regression, "regression"),
    "transformer": (_transformer, _next_token, "tokens"),
    "transformer_checkpointed": (lambda: _transformer(True), _next_token, "tokens"),
}


def _batches(kind, world, steps=3, per_rank=2):
    g = torch.Generator().manual_seed(1)
    n, out = world * per_rank, []
    for _ in range(steps):
        if kind == "regression":
            out.append((torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)))
            continue
        ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        out.append((ids[:, :-1],) if kind == "ids" else (ids[:, :-1], ids[:, 1:]))
    return out


def _counted_aot_eager(runs):
    """``aot_eager`` that counts the runs of its program's forward in ``runs``: the numbers
    a compiled run reports come from the program, not from an eager path."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        program = aot_eager(gm, example_inputs)

        def run(*args):
            runs[0] += 1
            return program(*args)
        return run
    return {"backend": backend}


def _run(spec, name, policy, compiled, batches):
    """Losses and full parameters after AdamW on this rank's rows of ``batches``; dynamo's
    graph count and graph breaks; after each step, how many times the program has run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    build, loss, _ = MODELS[name]
    model = build()
    runs = [0]
    step = fs.train_step(lambda p, b: loss(model, p, b, fs.call),
                         fs.optim.adamw(LR, weight_decay=WD), policy=policy,
                         compile=_counted_aot_eager(runs) if compiled else False)
    state = step.init(fs.shard(fs.params(model), mesh(spec)))
    losses, per, seen = [], batches[0][0].shape[0] // world, []
    for b in batches:
        state, metrics = step(state, tuple(t[rank * per:(rank + 1) * per] for t in b))
        losses.append(float(metrics["loss"]))
        seen.append(runs[0])
    out = (losses, {k: v.detach().clone() for k, v in fs.unshard(state.params).items()},
           counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), seen)
    torch._dynamo.reset()
    gc.collect()
    return out


def _one_process(name, batches):
    """torch.optim.AdamW on the trainable parameters, on the whole batch: the reference."""
    build, loss, _ = MODELS[name]
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=WD)
    losses = []
    for b in batches:
        opt.zero_grad()
        value = loss(model, None, b, _direct)
        value.backward()
        opt.step()
        losses.append(value.item())
    return losses, {k: p.detach() for k, p in model.named_parameters()}


def external_parity(spec, name, policy_kwargs, one=True):
    """The compiled step, the eager step and (``one``) one process on model ``name``; the
    initial parameters and which of them are frozen."""
    batches = _batches(MODELS[name][2], dist.get_world_size())
    policy = fs.Policy(**policy_kwargs)
    init = MODELS[name][0]()
    out = {"eager": _run(spec, name, policy, False, batches),
           "compiled": _run(spec, name, policy, True, batches),
           "init": {k: p.detach().clone() for k, p in init.named_parameters()},
           "frozen": sorted(k for k, p in init.named_parameters() if not p.requires_grad)}
    if one:
        out["one"] = _one_process(name, batches)
    gc.collect()
    return out


def _check(rank, r, tol_loss=1e-5, tol_params=1e-5):
    (el, ep, _, _, _), (cl, cp, graphs, breaks, runs) = r["eager"], r["compiled"]
    assert breaks == 0 and graphs == 2, (rank, graphs, breaks)
    # the first step: eager gradients, the program tried once and the update's program;
    # then both programs each step
    assert runs == [2, 4, 6], (rank, runs)
    assert max(abs(a - b) for a, b in zip(cl, el)) <= tol_loss, (rank, cl, el)
    assert _max_diff(cp, ep) <= tol_params, (rank, _max_diff(cp, ep))
    if "one" in r:
        ol, op = r["one"]
        assert cp.keys() == op.keys(), (rank, sorted(cp.keys() ^ op.keys()))
        assert max(abs(a - b) for a, b in zip(cl, ol)) <= 1e-5, (rank, cl, ol)
        assert _max_diff(cp, op) <= 1e-5, (rank, _max_diff(cp, op))
    init, frozen = r["init"], set(r["frozen"])
    for k in frozen:
        assert torch.equal(cp[k], init[k]) and torch.equal(ep[k], init[k]), (rank, k)
    moved = {k: (cp[k].float() - init[k].float()).abs().max().item() for k in init
             if k not in frozen}
    assert moved and min(moved.values()) > 0, (rank, moved)  # every trainable leaf trained


@pytest.mark.parametrize("name", ["lora_llama", "lora_llama_checkpointed",
                                  "lora_mlpstack"])
def test_peft_lora_compiled_trains_the_adapters_as_one_process(pools, name):
    pytest.importorskip("peft")
    for rank, r in enumerate(pools.run(2, external_parity, name, {}, timeout=600)):
        assert r["frozen"] and all("lora_" not in k for k in r["frozen"]), r["frozen"]
        assert all("lora_" in k for k in r["init"] if k not in r["frozen"]), rank
        _check(rank, r)


@pytest.mark.parametrize("name", ["mlpstack", "transformer", "transformer_checkpointed"])
@pytest.mark.parametrize("raf", [True, False], ids=["full_shard", "shard_grad_op"])
def test_torch_test_models_compiled_train_as_eager_and_one_process(pools, name, raf):
    for rank, r in enumerate(pools.run(2, external_parity, name,
                                       {"reshard_after_forward": raf}, timeout=600)):
        assert not r["frozen"], r["frozen"]
        if name == "transformer":  # the tied head: one leaf, under the embedding's name
            assert "output.weight" not in r["init"], sorted(r["init"])
        _check(rank, r)


@pytest.mark.parametrize("name", ["mlpstack", "transformer", "lora_llama"])
def test_mixed_precision_compiled_trains_as_the_eager_step(pools, name):
    if name.startswith("lora"):
        pytest.importorskip("peft")
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    for rank, r in enumerate(pools.run(2, external_parity, name, policy, False,
                                       timeout=600)):
        # both gather bfloat16 copies and reduce in float32: the same rounding points
        _check(rank, r, tol_loss=2e-2, tol_params=2e-3)
