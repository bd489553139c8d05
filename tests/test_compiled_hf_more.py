"""``train_step(..., compile=...)`` on more Hugging Face decoders nobody here wrote (tiny
configs built in code, no download) on 2 gloo ranks (one case on 2x2), 3 AdamW steps: a
GPT-2 (tied embeddings, Conv1D layers, learned positions) under FULL_SHARD and under
SHARD_GRAD_OP (``reshard_after_forward=False``), a Qwen2 (tied embeddings, biased q/k/v,
grouped-query attention) and a Mistral (untied head); with the Policy's clip, micro-batches
and activation checkpointing, right-padded batches (``attention_mask``, labels -100), and
Hugging Face's own ``gradient_checkpointing_enable()``. Each compiled run (``aot_eager``;
three through inductor's program) trains as its eager step and as one process on the whole
batch (torch.optim.AdamW, the same lr): losses and full parameters within 1e-5, in one
dynamo graph with no graph break.

Two runs that need more of the compiled step train as one process too: Hugging
Face's own checkpointing around SDPA (torch tags SDPA ``nondeterministic_seeded`` even at
``dropout_p=0``; the step gives a model's own regions the rule that keeps random draws from
forward: funshard.step.backend), and a tied embedding in a group of its own (gathered at
the program's start, since the tied head reads it outside the group's module)."""

import gc

import pytest
import torch
import torch.distributed as dist

import funshard as fs

from test_compiled_step import LR, _batches, _max_diff, hf_runs

STEPS = 3


def _gpt2(attention="sdpa", hf_checkpointing=False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32,
                                       n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, summary_first_dropout=0.0,
                                       bos_token_id=0, eos_token_id=0,
                                       attn_implementation=attention))
    # "GPT2LMHeadModel" names no loss in transformers' LOSS_MAPPING: each forward with labels
    # calls logger.warning_once and falls back to ForCausalLM. The program traces logging
    # calls as no-ops (they ran at the eager first step), so the model is left as it is.
    if hf_checkpointing:  # each block under torch.utils.checkpoint (non-reentrant)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def _gpt2_hf_checkpointed():
    """Hugging Face's checkpointing with the eager attention: no SDPA in the region."""
    return _gpt2("eager", hf_checkpointing=True)


def _gpt2_sdpa_hf_checkpointed():
    return _gpt2("sdpa", hf_checkpointing=True)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=32,
                                        tie_word_embeddings=True, attention_dropout=0.0))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16,
                                            intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2,
                                            max_position_embeddings=32,
                                            tie_word_embeddings=False, attention_dropout=0.0))


BUILDERS = {"gpt2": _gpt2, "qwen2": _qwen2, "mistral": _mistral,
            "gpt2_hf_checkpointed": _gpt2_hf_checkpointed,
            "gpt2_sdpa_hf_checkpointed": _gpt2_sdpa_hf_checkpointed}
TIED = {"gpt2": ["lm_head.weight"], "qwen2": ["lm_head.weight"], "mistral": []}


def own_embedding_group(fqn: str) -> str:
    """Groups with GPT-2's (tied) embedding in one of its own: ``transformer.wte``."""
    for prefix in ("transformer.wte", "transformer.h.0", "transformer.h.1"):
        if fqn.startswith(prefix + "."):
            return prefix
    return ""


def _padded(ids):
    """``ids`` with an attention mask that pads the last 1 or 2 positions of alternate rows
    (each rank's two rows: the same count of labels on every rank, so the mean of the
    ranks' losses is the whole batch's) and labels -100 there."""
    mask = torch.ones_like(ids)
    for i in range(ids.shape[0]):
        mask[i, ids.shape[1] - 1 - i % 2:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _forward(model, params, batch):
    """The model's loss on ``batch``: ids (labels = ids) or (ids, mask, labels)."""
    if isinstance(batch, tuple):
        ids, mask, labels = batch
        return fs.call(model, params, input_ids=ids, attention_mask=mask, labels=labels,
                       use_cache=False).loss
    return fs.call(model, params, input_ids=batch, labels=batch, use_cache=False).loss


def _one_process(build, batches, clip=None):
    """torch.optim.AdamW (the same lr, torch's defaults) on the whole batch, with torch's
    global-norm clip when ``clip`` is given: the reference."""
    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = _forward(ref, dict(ref.named_parameters()), batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in ref.named_parameters()}


def hf_parity(spec, which, policy=None, per_rank=2, padded=False, compile=None):
    """Model ``which`` compiled and eager (``hf_runs`` under ``fs.Policy(**policy)``) and
    in one process; which of its parameters are tied, how far one process moved them."""
    build = BUILDERS[which]
    batches = [x for x, _ in _batches(STEPS, dist.get_world_size(), per_rank)]
    if padded:
        batches = [_padded(x) for x in batches]
    out = hf_runs(spec, build, batches, fs.Policy(**(policy or {})), _forward, compile)
    out["one"] = _one_process(build, batches, (policy or {}).get("clip_norm"))
    init = build()
    out["tied"] = [n for n, _ in init.named_parameters(remove_duplicate=False)
                   if n not in dict(init.named_parameters())]
    out["moved"] = _max_diff(out["one"][1], dict(init.named_parameters()))
    torch._dynamo.reset()
    gc.collect()
    return out


def _check(results, tied):
    for rank, r in enumerate(results):
        (el, ep), (cl, cp), (ol, op) = r["eager"], r["compiled"], r["one"]
        assert r["tied"] == tied, (rank, r["tied"])  # the config ties (or not) as meant
        assert r["moved"] > 1e-4, (rank, r["moved"])  # the reference trained at all
        assert r["breaks"] == 0 and r["graphs"] == 2, (rank, r["breaks"], r["graphs"])
        assert set(cp) == set(ep) == set(op), (rank, set(cp) ^ set(op), set(ep) ^ set(op))
        assert max(abs(a - b) for a, b in zip(cl, el)) <= 1e-5, (rank, cl, el)
        assert max(abs(a - b) for a, b in zip(cl, ol)) <= 1e-5, (rank, cl, ol)
        assert max(abs(a - b) for a, b in zip(el, ol)) <= 1e-5, (rank, el, ol)
        assert _max_diff(cp, ep) <= 1e-5, (rank, _max_diff(cp, ep))
        assert _max_diff(cp, op) <= 1e-5, (rank, _max_diff(cp, op))
        assert _max_diff(ep, op) <= 1e-5, (rank, _max_diff(ep, op))


def test_compiled_step_trains_a_hugging_face_gpt2_as_one_process(pools):
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, "gpt2", timeout=600), TIED["gpt2"])


@pytest.mark.parametrize("which", ["qwen2", "mistral"], ids=["qwen2_tied", "mistral"])
def test_compiled_step_trains_qwen2_and_mistral_as_one_process(pools, which):
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, which, timeout=600), TIED[which])


@pytest.mark.parametrize("which,policy", [
    ("gpt2", None), ("qwen2", dict(clip_norm=1.0, accumulate=2)),
    ("mistral", dict(checkpoint=True))], ids=["gpt2", "qwen2-clip-accumulate",
                                              "mistral-checkpoint"])
def test_hugging_face_decoders_in_inductors_program_train_as_one_process(pools, which,
                                                                        policy):
    """Compiled by inductor, with the step's pass over its program (the gathers moved
    ahead, the reductions made all-reduces in place): as the eager step and one process."""
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, which, policy, compile=True, timeout=900), TIED[which])


def test_compiled_gpt2_under_shard_grad_op_trains_as_one_process(pools):
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, "gpt2", dict(reshard_after_forward=False), timeout=600),
           TIED["gpt2"])


# name: (model, mesh, Policy keywords, rows per rank)
FEATURES = {
    "gpt2_clip_accumulate": ("gpt2", 2, dict(clip_norm=1.0, accumulate=2), 4),
    "gpt2_checkpoint": ("gpt2", 2, dict(checkpoint=True), 2),
    "gpt2_2x2_clip": ("gpt2", "2x2", dict(clip_norm=1.0), 2),
    "qwen2_grad_op_clip": ("qwen2", 2, dict(reshard_after_forward=False, clip_norm=1.0), 2),
    "mistral_checkpoint_accumulate": ("mistral", 2, dict(checkpoint=True, accumulate=2), 4),
}


@pytest.mark.parametrize("case", list(FEATURES))
def test_compiled_hugging_face_decoders_with_policy_features_train_as_one_process(pools,
                                                                                  case):
    pytest.importorskip("transformers")
    which, spec, policy, per_rank = FEATURES[case]
    _check(pools.run(spec, hf_parity, which, policy, per_rank, timeout=600), TIED[which])


def test_compiled_qwen2_on_right_padded_batches_trains_as_one_process(pools):
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, "qwen2", None, 2, True, timeout=600), TIED["qwen2"])


def test_hugging_face_gradient_checkpointing_compiled_trains_as_one_process(pools):
    """Hugging Face's own checkpoint region around each block (the step's FULL_SHARD region
    inside it), the eager attention."""
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, "gpt2_hf_checkpointed", timeout=600), TIED["gpt2"])


def test_hugging_face_gradient_checkpointing_around_sdpa_compiled_trains_as_one_process(
        pools):
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, "gpt2_sdpa_hf_checkpointed", timeout=600), TIED["gpt2"])


def test_compiled_gpt2_with_its_tied_embedding_in_a_group_of_its_own_trains_as_one_process(
        pools):
    pytest.importorskip("transformers")
    _check(pools.run(2, hf_parity, "gpt2", dict(groups=own_embedding_group), timeout=600),
           TIED["gpt2"])
