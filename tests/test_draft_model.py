"""Classical speculative decoding with a draft model in its own engine: output == the
engine's AR output == HF greedy, on every branch (drafts always accepted, always rejected,
partly accepted, catch-up of several tokens after accepted copies, EOS inside the drafts,
max_new_tokens mid-cycle, the confidence stop), and clear errors for a draft model that
cannot share the token ids. Tiny random models sharing one vocabulary."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_or_skip, hf_greedy, perturbed_copy, tiny_model

from hf_selfspec import attach_heads
from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
from hf_selfspec.decoding.draft_model import SOURCE_DRAFT_MODEL
from hf_selfspec.engine.core import Engine, EngineConfig


def prompt(seed, length, alphabet=256):
    return torch.randint(3, alphabet, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models():
    main = tiny_model("llama", seed=0, layers=4)
    # a noisy copy: its drafts agree with the model part of the time
    partial = perturbed_copy(main, 0.1)
    other = tiny_model("qwen3", seed=3, layers=2)  # another architecture, same vocabulary
    return main, partial, other


def engine_of(model, layout="fixed"):
    return engine_or_skip(model, EngineConfig(width=8, capacity=400, row_layout=layout))


CASES = {
    # (draft model: "self" = the main model itself, "partial", "other"; config)
    "always_accepted": ("self", dict(lookup="off", adaptive=False, draft_confidence=0.0)),
    "partly_accepted": ("partial", dict(lookup="off", adaptive=False, draft_confidence=0.0)),
    "rejected": ("other", dict(lookup="off", adaptive=False, draft_confidence=0.0)),
    "confidence_stop": ("partial", dict(lookup="off", adaptive=False, draft_confidence=0.007)),  # ~ its median top-1
    "short_budget": ("self", dict(lookup="off", adaptive=False, max_draft=2, draft_confidence=0.0)),
    "with_lookup": ("partial", dict(lookup="first", adaptive=False, draft_confidence=0.0)),
    "adaptive": ("other", dict(lookup="first")),
}


@pytest.mark.parametrize("layout", ["fixed", "micro", "kernel"])
@pytest.mark.parametrize("case", list(CASES))
def test_draft_model_output_equals_ar(models, case, layout):
    main, partial, other = models
    which, cfg = CASES[case]
    draft = {"self": main, "partial": partial, "other": other}[which]
    engine = engine_of(main, layout)
    decoder = SelfSpecDecoder(engine, None, DecodeConfig(**cfg), engine_of(draft, layout))
    drafted = accepted = 0
    for seed, (length, new) in enumerate([(5, 40), (37, 29), (120, 13), (9, 1), (3, 2)]):
        # repeated text: prompt lookup finds copies, so the draft model must catch up on them
        ids = prompt(seed, length) * (2 if case == "with_lookup" else 1)
        want = engine.generate_ar(ids, new)
        result = decoder.generate(ids, new)
        assert result.tokens == want, (case, seed)
        assert result.tokens == hf_greedy(main, ids, new), (case, seed)
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    assert drafted > 0
    if case in ("always_accepted", "short_budget"):
        assert accepted == drafted
    if case in ("partly_accepted", "rejected"):
        assert accepted < drafted


def test_draft_model_branches_are_reached(models):
    """The cases above reach acceptances, rejections, multi-token catch-up and the
    confidence stop: a test of the tests."""
    main, partial, _ = models
    engine = engine_of(main)
    ids = prompt(1, 30) * 2
    seen_rows = []
    # the model as its own draft model: its drafts are always right; where it is not
    # confident (threshold ~ its median top-1 probability) the copies of the repeated prompt
    # fill in ("fallback"), so the draft model must then catch up on several tokens
    decoder = SelfSpecDecoder(engine, None, DecodeConfig(lookup="fallback", adaptive=False, draft_confidence=0.007),
                              engine_of(main))
    original = Engine.verify

    def spy(self, h, start, meta, logits=True):
        if self is decoder.draft_engine:
            seen_rows.append(h.shape[0])
        return original(self, h, start, meta, logits)

    Engine.verify = spy
    try:
        result = decoder.generate(ids, 60)
    finally:
        Engine.verify = original
    assert result.tokens == engine.generate_ar(ids, 60)
    sources = set(result.stats.sources)
    assert "copy" in sources and SOURCE_DRAFT_MODEL in sources
    assert max(seen_rows) >= 2  # catch-up on an accepted copy + the bonus token in one pass
    strict = SelfSpecDecoder(engine, None, DecodeConfig(lookup="off", adaptive=False, draft_confidence=1.0),
                             engine_of(partial)).generate(ids, 20)
    assert strict.stats.drafted == 0 and strict.tokens == engine.generate_ar(ids, 20)


def test_eos_inside_draft_model_drafts(models):
    main, _, _ = models
    engine = engine_of(main)
    ids = prompt(4, 20)
    free = engine.generate_ar(ids, 30)
    eos = free[7]  # a token the model produces mid-text: generation must stop right there
    decoder = SelfSpecDecoder(engine, None, DecodeConfig(lookup="off", adaptive=False, draft_confidence=0.0),
                              engine_of(main))
    result = decoder.generate(ids, 30, eos_token_ids=[eos])
    assert result.tokens == engine.generate_ar(ids, 30, [eos])
    assert result.tokens[-1] == eos and len(result.tokens) <= 8


def test_generate_with_assistant_model_matches_hf_greedy(models):
    main, partial, other = models
    attach_heads(main, False)
    ids = torch.tensor([prompt(7, 25)])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    want = main.generate(ids, **kw)
    for draft in (partial, other):
        got = main.generate(ids, assistant="self", assistant_model=draft, **kw)
        assert torch.equal(got, want)
    assert main.selfspec_stats.drafted > 0


def test_a_draft_model_of_shorter_context_serves_the_requests_that_fit_it(models):
    """A draft model whose max_position_embeddings are fewer than the main engine's KV slots
    (2048 here) drafts for every request that fits them (its engine gets fewer slots), and a
    request that does not fit them is refused up front naming the draft model's limit."""
    import copy

    main, partial, _ = models
    attach_heads(main, False)
    short = copy.deepcopy(partial)
    short.config.max_position_embeddings = 64
    ids = torch.tensor([prompt(8, 20)])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    got = main.generate(ids, assistant="self", assistant_model=short, max_new_tokens=44, **kw)
    assert torch.equal(got, main.generate(ids, max_new_tokens=44, **kw))
    assert main.selfspec_stats.drafted > 0
    main._selfspec.draft_engine = main._selfspec.draft_model = None
    with pytest.raises(ValueError, match=r"needs 65 positions .* draft model's max_position_embeddings \(64\)"):
        main.generate(ids, assistant="self", assistant_model=short, max_new_tokens=45, **kw)
    assert main._selfspec.draft_engine is None, "a draft engine was built for a refused request"


def test_draft_model_with_other_token_ids_is_refused(models):
    main, _, _ = models
    attach_heads(main, False)
    small = tiny_model("llama", seed=1, layers=2, vocab=300)
    ids = torch.tensor([prompt(7, 10)])
    with pytest.raises(ValueError, match="same tokenizer"):
        main.generate(ids, assistant="self", assistant_model=small, max_new_tokens=4)
    with pytest.raises(ValueError, match="same tokenizer"):
        SelfSpecDecoder(engine_of(main), None, DecodeConfig(), engine_of(small))


def test_draft_model_of_an_unsupported_architecture_is_refused(models):
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    from hf_selfspec.engine.layered import UnsupportedModelError

    main, _, _ = models
    attach_heads(main, False)
    differential = DiffLlamaForCausalLM(DiffLlamaConfig(  # differential attention: two softmaxes per head
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    ids = torch.tensor([prompt(7, 10)])
    with pytest.raises(UnsupportedModelError, match="diffllama"):
        main.generate(ids, assistant="self", assistant_model=differential, max_new_tokens=4)


def test_a_draft_model_without_attention_drafts_exactly(models):
    """A Mamba draft model (no attention, a recurrent state per layer) for a Llama: the
    main model's greedy output."""
    from transformers import MambaConfig, MambaForCausalLM

    main, _, _ = models
    attach_heads(main, False)
    torch.manual_seed(5)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1)).eval()
    ids = torch.tensor([prompt(7, 25)])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(main.generate(ids, assistant="self", assistant_model=mamba, **kw), main.generate(ids, **kw))
    assert main.selfspec_stats.drafted > 0


def test_draft_confidence_is_validated():
    with pytest.raises(ValueError, match="draft_confidence"):
        DecodeConfig(draft_confidence=1.5)
