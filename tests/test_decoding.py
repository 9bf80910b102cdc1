"""Speculative output == the engine's AR output exactly, on every branch of the loop.

Tiny random models with random exit heads; extreme thresholds force each branch: always
draft (drafts rejected at every position), never draft, climbing to the deepest head,
EOS inside a draft, max_new_tokens hit mid-cycle, stop callbacks, prompt lookup hits and
misses in every mode.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_or_skip, hf_greedy, tiny_model

from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.heads import ExitHeads
from hf_selfspec.heads.top import random_top_heads

NEVER = 2.0  # a confidence threshold no head reaches
ALWAYS = 0.0


def random_heads(model, layers, seed=0):
    """Exit heads whose shallow heads have random adapters (confident, mostly wrong) and
    whose deepest head is the untrained logit lens one layer below the top (often right)."""
    heads = ExitHeads.create(model, layers, torch.arange(model.lm_head.out_features), adapter_dims=32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in heads.heads:
            if head is not heads.heads[-1]:
                for p in (head.down.weight, head.up.weight):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            if head.reject is not None:
                head.reject.bias.fill_(-20.0)  # never reject: every evaluation can draft
    return heads


def prompt(seed, length, alphabet=256):
    return torch.randint(3, alphabet, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["fixed", "micro", "kernel"])
def setup(request):
    model = tiny_model("llama", seed=0, layers=4)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=400, row_layout=request.param))
    heads = random_heads(model, [1, 3])
    return model, engine, heads


# adaptive=False: the thresholds alone decide, so each branch is really forced
CASES = {
    "always_draft": dict(thresholds=(ALWAYS, ALWAYS), lookup="off", adaptive=False),
    "never_draft": dict(thresholds=(NEVER, NEVER), lookup="off", adaptive=False),
    "deep_head_only": dict(thresholds=(NEVER, ALWAYS), lookup="off", adaptive=False),
    "shallow_then_deep": dict(thresholds=(0.9, ALWAYS), lookup="off", adaptive=False),
    "short_chains": dict(thresholds=(ALWAYS, ALWAYS), lookup="off", max_draft=2, adaptive=False),
    "lookup_only": dict(lookup="only", adaptive=False),
    "lookup_first": dict(thresholds=(ALWAYS, ALWAYS), lookup="first", adaptive=False),
    "lookup_fallback": dict(thresholds=(NEVER, 0.5), lookup="fallback", adaptive=False),
    "adaptive_guard": dict(thresholds=(ALWAYS, ALWAYS), lookup="first"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_equals_engine_ar(setup, case):
    model, engine, heads = setup
    decoder = SelfSpecDecoder(engine, heads, DecodeConfig(**CASES[case]))
    for seed, (length, alphabet) in enumerate([(1, 256), (13, 256), (40, 12), (120, 256)]):
        p = prompt(seed, length, alphabet)
        expected = engine.generate_ar(p, 48)
        result = decoder.generate(p, 48)
        assert result.tokens == expected, (case, seed)
        stats = result.stats
        assert stats.new_tokens == len(expected) == len(stats.sources)
        assert stats.accepted <= stats.drafted
        assert stats.new_tokens == stats.accepted + stats.cycles + 1  # +1: the prefill token
    if case == "never_draft":
        assert stats.drafted == 0
    if case in ("always_draft", "short_chains"):
        assert stats.drafted > 0 and stats.head_evaluations > 0


@pytest.mark.parametrize("kind", ["granite", "smollm3", "olmo2", "gemma2", "gemma3"])
def test_exit_heads_on_llama_variants_equal_hf_greedy(kind):
    """Exit heads' rows start from the embedding as the model's own (Granite: times its
    embedding_multiplier) and climb layers with and without RoPE (SmolLM3): the output is
    HF's greedy output, with drafts from every head."""
    model = tiny_model(kind, seed=0, layers=4)
    engine = engine_or_skip(model, EngineConfig(width=8, capacity=400, row_layout="kernel"))
    decoder = SelfSpecDecoder(engine, random_heads(model, [1, 3]), DecodeConfig(**CASES["always_draft"]))
    for seed, (length, alphabet) in enumerate([(13, 256), (40, 12)]):
        p = prompt(seed, length, alphabet)
        result = decoder.generate(p, 32)
        assert result.tokens == hf_greedy(model, p, 32), seed
        assert result.stats.drafted > 0


@pytest.mark.parametrize("lookup", ["off", "first"])
@pytest.mark.parametrize("thresholds", [(ALWAYS, ALWAYS), (ALWAYS, NEVER), (NEVER, NEVER)])
def test_top_draft_heads_equal_engine_ar(setup, lookup, thresholds):
    model, engine, _ = setup
    top = random_top_heads(model, depth=2)
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=thresholds, lookup=lookup, adaptive=False))
    drafted = accepted = 0
    for seed, (length, alphabet) in enumerate([(1, 256), (17, 256), (40, 12)]):
        p = prompt(seed, length, alphabet)
        r = decoder.generate(p, 40)
        assert r.tokens == engine.generate_ar(p, 40), seed
        drafted += r.stats.drafted
        accepted += sum(s.startswith("head") for s in r.stats.sources)
    if thresholds[0] == ALWAYS and lookup == "off":
        assert drafted > 0 and accepted > 0  # both accept and reject branches taken


@pytest.mark.parametrize("thresholds", [(ALWAYS,) * 3, (ALWAYS, ALWAYS, NEVER), (ALWAYS, NEVER, ALWAYS)])
def test_three_step_top_heads_equal_engine_ar(setup, thresholds):
    """A 3-draft chain (the free width of the wx4 layout): every step may draft, a step
    whose threshold fails ends the chain, and the output is the engine's AR output."""
    model, engine, _ = setup
    top = random_top_heads(model, depth=3)
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=thresholds, lookup="off", adaptive=False))
    exits = [0, 0, 0]
    for seed, (length, alphabet) in enumerate([(1, 256), (17, 256), (40, 12)]):
        p = prompt(seed, length, alphabet)
        r = decoder.generate(p, 40)
        assert r.tokens == engine.generate_ar(p, 40), seed
        exits = [a + b for a, b in zip(exits, r.stats.exits_per_head)]
    assert exits[0] > 0
    assert (exits[2] > 0) == (thresholds == (ALWAYS,) * 3)  # step 2 drafts only after step 1 did


@pytest.mark.parametrize("prompt_len", [250, 254])
def test_blocks_that_cross_a_key_block_boundary(setup, prompt_len):
    """Drafted rows on both sides of a KEY_BLOCK boundary (slot 256): the verify step
    attends over one more key block than the AR step of its first rows would, and must
    still give the AR output (masked blocks contribute exactly nothing)."""
    from hf_selfspec.engine.attention import KEY_BLOCK

    model, engine, heads = setup
    assert prompt_len < (prompt_len // KEY_BLOCK + 1) * KEY_BLOCK < prompt_len + 24
    cases = (dict(thresholds=(ALWAYS, ALWAYS), lookup="off", adaptive=False), dict(lookup="only", adaptive=False))
    for cfg in cases:
        decoder = SelfSpecDecoder(engine, heads, DecodeConfig(**cfg))
        p = prompt(prompt_len, prompt_len, 12)
        r = decoder.generate(p, 24)
        assert r.tokens == engine.generate_ar(p, 24)
        assert r.stats.drafted > 0


def test_branches_are_really_taken(setup):
    """The cases above must exercise acceptance by heads and by copies, and rejection."""
    model, engine, heads = setup
    totals = {"head": 0, "copy": 0, "rejected": 0}
    for case in ("always_draft", "deep_head_only", "lookup_first"):
        decoder = SelfSpecDecoder(engine, heads, DecodeConfig(**CASES[case]))
        for seed in range(4):
            r = decoder.generate(prompt(seed, 40, 12), 48)
            totals["head"] += sum(s.startswith("head") for s in r.stats.sources)
            totals["copy"] += r.stats.sources.count("copy")
            totals["rejected"] += r.stats.drafted - r.stats.accepted
    assert all(v > 0 for v in totals.values()), totals


def test_guard_stops_drafting_where_drafts_fail(setup):
    """Heads that are always confident and almost always wrong: the adaptive budget falls
    back to plain AR steps after a few cycles, probing once every PROBE_EVERY cycles."""
    from hf_selfspec.decoding.policy import PROBE_EVERY

    model, engine, heads = setup
    p = prompt(1, 13, 256)
    forced = SelfSpecDecoder(engine, heads, DecodeConfig(thresholds=(ALWAYS, NEVER), lookup="off",
                                                         adaptive=False)).generate(p, 96)
    guarded = SelfSpecDecoder(engine, heads, DecodeConfig(thresholds=(ALWAYS, NEVER), lookup="off")).generate(p, 96)
    assert guarded.tokens == forced.tokens == engine.generate_ar(p, 96)
    assert forced.stats.accepted < 0.2 * forced.stats.drafted  # the heads really fail here
    # the prior (a = 0.5) decays within ~10 cycles; then only probes draft
    assert guarded.stats.drafted <= 30 + guarded.stats.cycles // PROBE_EVERY
    assert guarded.stats.drafted < forced.stats.drafted // 10


def test_speculative_equals_hf_greedy(setup):
    model, engine, heads = setup
    decoder = SelfSpecDecoder(engine, heads, DecodeConfig(thresholds=ALWAYS, lookup="first"))
    for seed in range(3):
        p = prompt(seed, 30, 40)
        assert decoder.generate(p, 40).tokens == hf_greedy(model, p, 40)


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 8, 13])
def test_max_new_tokens_mid_cycle(setup, max_new):
    model, engine, heads = setup
    decoder = SelfSpecDecoder(engine, heads, DecodeConfig(thresholds=ALWAYS, lookup="first"))
    p = prompt(7, 40, 12)
    assert decoder.generate(p, max_new).tokens == engine.generate_ar(p, 40)[:max_new]


def test_eos_inside_a_draft(setup):
    """Every EOS choice from the AR output: stop exactly after its first occurrence, even
    when it is drafted in the middle of an accepted chunk."""
    model, engine, heads = setup
    p = prompt(3, 40, 12)
    free = engine.generate_ar(p, 40)
    for cfg in (DecodeConfig(lookup="only"), DecodeConfig(thresholds=ALWAYS, lookup="first")):
        decoder = SelfSpecDecoder(engine, heads, cfg)
        for eos in sorted(set(free))[:6]:
            expected = free[: free.index(eos) + 1]
            assert decoder.generate(p, 40, eos_token_ids=[eos, 10_000]).tokens == expected
            assert engine.generate_ar(p, 40, [eos]) == expected


def test_stop_callback_and_commit_chunks(setup):
    model, engine, heads = setup
    p = prompt(4, 40, 12)
    free = engine.generate_ar(p, 40)
    decoder = SelfSpecDecoder(engine, heads, DecodeConfig(lookup="first", thresholds=ALWAYS))
    for k in (1, 4, 9):
        chunks = []
        r = decoder.generate(p, 40, stop=lambda out, k=k: len(out) >= k, on_commit=chunks.append)
        assert r.tokens == free[:k]
        assert [t for c in chunks for t in c] == free[:k]


def test_bad_config():
    with pytest.raises(ValueError, match="lookup"):
        DecodeConfig(lookup="sometimes")
    with pytest.raises(ValueError, match="gamma"):
        DecodeConfig(gamma=2.0)
    model = tiny_model("llama", layers=4)
    engine = Engine(model, EngineConfig(width=4, capacity=128))
    heads = random_heads(model, [1, 2])
    with pytest.raises(ValueError, match="max_draft"):
        SelfSpecDecoder(engine, heads, DecodeConfig(max_draft=9, thresholds=0.5))
    with pytest.raises(ValueError, match="thresholds"):
        SelfSpecDecoder(engine, heads, DecodeConfig(thresholds=(0.5,)))
    with pytest.raises(ValueError, match="calibration"):
        SelfSpecDecoder(engine, heads, DecodeConfig())


def test_lossy_top_k_is_opt_in_and_stays_in_the_models_top_k(setup):
    """LOSSY acceptance: with lossy_top_k=2 every committed token is in the model's top-2
    after the committed prefix (checked with HF's own forward), more drafts are accepted,
    and the stats say lossy; lossy_top_k=1 is the exact loop."""
    model, engine, heads = setup
    base = dict(thresholds=(NEVER, ALWAYS), lookup="off", adaptive=False)  # the deep head: near misses
    accepted = {"exact": 0, "lossy": 0}
    for seed in range(4):
        p = prompt(seed, 30, 256)
        exact = SelfSpecDecoder(engine, heads, DecodeConfig(**base)).generate(p, 40)
        lossy = SelfSpecDecoder(engine, heads, DecodeConfig(lossy_top_k=2, **base)).generate(p, 40)
        assert exact.tokens == engine.generate_ar(p, 40) and not exact.stats.lossy and lossy.stats.lossy
        accepted["exact"] += exact.stats.accepted
        accepted["lossy"] += lossy.stats.accepted
        with torch.no_grad():
            logits = model(torch.tensor([p + lossy.tokens])).logits[0, len(p) - 1: -1]
        top2 = logits.topk(2, -1).indices
        assert all(t in top2[i].tolist() for i, t in enumerate(lossy.tokens))
    assert accepted["lossy"] > accepted["exact"], accepted
    with pytest.raises(ValueError, match="lossy_top_k"):
        DecodeConfig(lossy_top_k=0)
    with pytest.raises(ValueError, match="greedy option"):
        SelfSpecDecoder(engine, heads, DecodeConfig(lossy_top_k=2, **base)).generate([5, 6], 5, do_sample=True)


@pytest.mark.parametrize("drafter", ["exit_heads", "top_heads_tree", "top_heads_chain", "lookup"])
def test_a_full_cache_drafts_less_at_its_end(drafter):
    """An engine whose KV cache holds exactly prompt + max_new_tokens slots (what AR
    decoding needs): the last cycles draft fewer rows instead of writing past the cache,
    and the output is still the AR output of a roomier engine."""
    model = tiny_model("llama", seed=0, layers=4)
    roomy = Engine(model, EngineConfig(width=8, capacity=400, row_layout="kernel"))
    tight = Engine(model, EngineConfig(width=8, capacity=256, row_layout="kernel"))
    heads = {"exit_heads": random_heads(model, [1, 3]), "lookup": None}.get(drafter, random_top_heads(model, 3))
    config = dict(thresholds=ALWAYS, adaptive=False, lookup="off" if heads is not None else "only",
                  tree="on" if drafter == "top_heads_tree" else "off")
    if drafter == "exit_heads":
        config["thresholds"] = (ALWAYS, ALWAYS)
    p = prompt(4, 40, alphabet=6)  # repetitive: lookup copies too
    max_new = tight.capacity - len(p)
    expected = roomy.generate_ar(p, max_new)
    result = SelfSpecDecoder(tight, heads, DecodeConfig(**config)).generate(p, max_new)
    assert result.tokens == expected and result.stats.drafted > 0
    with pytest.raises(ValueError, match="KV capacity"):
        SelfSpecDecoder(tight, heads, DecodeConfig(**config)).generate(p, max_new + 1)
