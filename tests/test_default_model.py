"""The real embedded default model (SmolLM2-135M-Instruct): engine AR and self-speculative
decoding produce HF greedy's tokens on real prompts of each category."""

from __future__ import annotations

import pytest
import torch
from transformers import TextIteratorStreamer

from hf_selfspec import DecodeConfig, attach_heads, detach_heads
from hf_selfspec.data import prompt_sets, render_prompt
from hf_selfspec.engine.core import Engine, EngineConfig

pytestmark = pytest.mark.slow
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def model_and_prompts(default_model):
    model, tokenizer = default_model
    sets = prompt_sets(tokenizer, per_category=1)
    prompts = {cat: render_prompt(tokenizer, sets[cat][0]) for cat in ("chat", "code", "summarize")}
    refs = {}
    for cat, p in prompts.items():
        ids = torch.tensor([p])
        refs[cat] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False)[0, len(p):].tolist()
    return model, tokenizer, prompts, refs


def test_engine_ar_matches_hf_greedy(model_and_prompts):
    model, tokenizer, prompts, refs = model_and_prompts
    engine = Engine(model, EngineConfig(width=8, capacity=1024))
    assert engine.layout.name in ("micro", "kernel")  # MKL: a fast layout passes its self-test here
    # the embedded model is dequantized from GGUF Q4_1: every projection is read compactly
    # (engine/compact.py) on the kernel layout
    assert engine.layout.name != "kernel" or engine.compact.count == 7 * model.config.num_hidden_layers
    for cat, p in prompts.items():
        assert engine.generate_ar(p, NEW_TOKENS, [tokenizer.eos_token_id]) == refs[cat], cat


def test_engine_prefill_path_matches_hf_greedy(model_and_prompts):
    model, tokenizer, prompts, refs = model_and_prompts
    engine = Engine(model, EngineConfig(width=8, capacity=1024, prefill="engine"))
    p = prompts["chat"]
    assert engine.generate_ar(p, NEW_TOKENS, [tokenizer.eos_token_id]) == refs["chat"]


def test_generate_assistant_self_matches_hf_greedy(model_and_prompts):
    model, tokenizer, prompts, refs = model_and_prompts
    attach_heads(model, heads=False, decode=DecodeConfig(lookup="only"))
    try:
        for cat, p in prompts.items():
            ids = torch.tensor([p])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant="self")
            assert out[0, len(p):].tolist() == refs[cat], cat
            assert model.selfspec_stats.new_tokens == len(refs[cat])
    finally:
        detach_heads(model)


def test_streamer_and_stop_strings_on_real_text(model_and_prompts):
    model, tokenizer, prompts, refs = model_and_prompts
    attach_heads(model, heads=False)
    try:
        p = prompts["summarize"]
        ids = torch.tensor([p])
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant="self",
                             streamer=streamer)
        streamed = "".join(streamer)
        assert streamed == tokenizer.decode(out[0, len(p):])
        # stop at a word that occurs in the reply: HF greedy and self-spec stop at the same token
        text = tokenizer.decode(refs["summarize"])
        word = text.split()[len(text.split()) // 2]
        kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, stop_strings=[word], tokenizer=tokenizer)
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        got = model.generate(ids, assistant="self", **kw)
        assert torch.equal(expected, got)
        assert got.shape[1] < ids.shape[1] + NEW_TOKENS
    finally:
        detach_heads(model)


def test_shipped_default_heads_exact_and_drafting(model_and_prompts):
    """attach_heads(model) with the shipped default heads: HF greedy's tokens on every
    category, and the heads really draft and get accepted on real text."""
    from hf_selfspec.heads import default_heads_path, read_kind

    model, tokenizer, prompts, refs = model_and_prompts
    assert read_kind(default_heads_path()) == "top_draft"
    attach_heads(model)
    try:
        accepted_from_heads = 0
        for cat, p in prompts.items():
            ids = torch.tensor([p])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant="self")
            assert out[0, len(p):].tolist() == refs[cat], cat
            accepted_from_heads += sum(s.startswith("head") for s in model.selfspec_stats.sources)
        assert accepted_from_heads > 0
    finally:
        detach_heads(model)


def test_shipped_heads_survive_pickle(model_and_prompts):
    """torch.save(model) / pickle of a model with the shipped top heads (whose drafting runs
    on the row kernel): the copy drafts on the kernel again and gives the same tokens."""
    import pickle

    model, tokenizer, prompts, refs = model_and_prompts
    attach_heads(model)
    try:
        p = prompts["chat"]
        ids = torch.tensor([p])
        clone = pickle.loads(pickle.dumps(model))
        heads = clone._selfspec.heads
        assert heads._fast_linear is not None and heads._fused_step is not None and heads._draft_copies == {}
        out = clone.generate(ids, max_new_tokens=16, do_sample=False, assistant="self")
        assert out[0, len(p):].tolist() == refs["chat"][:16]
        assert any(s.startswith("head") for s in clone.selfspec_stats.sources)
    finally:
        detach_heads(model)


def test_shipped_heads_batch_rows_equal_hf_batch_one(model_and_prompts):
    """A left-padded batch of the three prompts with the shipped heads shares engine steps
    (decoding/batch.py): every row is HF batch-1 greedy's tokens, then pad."""
    model, tokenizer, prompts, refs = model_and_prompts
    attach_heads(model)
    try:
        cats = list(prompts)
        width = max(len(prompts[c]) for c in cats)
        pad = tokenizer.eos_token_id
        ids = torch.full((len(cats), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, c in enumerate(cats):
            ids[b, width - len(prompts[c]):], mask[b, width - len(prompts[c]):] = torch.tensor(prompts[c]), 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             assistant="self", pad_token_id=pad)
        assert model._selfspec.engine.supports_batches
        for b, c in enumerate(cats):
            assert out[b, width:width + len(refs[c])].tolist() == refs[c], c
        assert model.selfspec_stats.new_tokens == sum(len(r) for r in refs.values())
    finally:
        detach_heads(model)


def test_shipped_exit_heads_exact(model_and_prompts):
    from hf_selfspec.heads import exit_heads_path

    model, tokenizer, prompts, refs = model_and_prompts
    attach_heads(model, heads=exit_heads_path(), decode=DecodeConfig(lookup="off"))
    try:
        p = prompts["chat"]
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, assistant="self")
        assert out[0, len(p):].tolist() == refs["chat"]
        assert model.selfspec_stats.head_evaluations > 0
    finally:
        detach_heads(model)
