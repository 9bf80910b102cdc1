"""Exact speculative sampling: the committed tokens are distributed as HF sampling's.

The distribution test draws the first three new tokens many times from a tiny model (fixed
seed, so the test is deterministic) with temperature + top-k processors, and compares the
counts of every (t1, t2, t3) with the exact probabilities computed from HF's own forward
and the same processors (chi-square). Tokens 2 and 3 come from a chain of two drafts, so
the acceptance test and the residual draw are both on the path. The same test with a
deliberately biased acceptance rule (every draft accepted) must fail: the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from test_decoding import random_heads
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_selfspec import DecodeConfig, attach_heads
from hf_selfspec.decoding import sampling
from hf_selfspec.decoding.cycle import SelfSpecDecoder
from hf_selfspec.decoding.sampling import RowScorer, residual, speculative_tokens
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.heads.top import random_top_heads

TOP_K = 3
TEMPERATURE = 2.0
DRAWS = 1000
PROMPT = [5, 17, 9, 17, 9, 33, 5, 17]  # "17 9" repeats: prompt lookup has copies to offer


def processors():
    return LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])


@torch.no_grad()
def exact_joint(model, prompt, depth=3):
    """{(t1..t_depth): probability} under HF's forward + the processors."""
    procs = processors()
    joint = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, prob in joint.items():
            ids = torch.tensor([prompt + list(prefix)])
            scores = procs(ids, model(ids).logits[:, -1].float())
            p = torch.softmax(scores, -1)[0]
            for t in torch.nonzero(p > 0).reshape(-1).tolist():
                nxt[prefix + (t,)] = prob * float(p[t])
        joint = nxt
    return joint


def chi_square_p_value(counts: dict, expected: dict, draws: int) -> float:
    if not set(counts) <= set(expected):  # a sequence of probability 0 was sampled
        return 0.0
    stat = sum((counts.get(k, 0) - draws * p) ** 2 / (draws * p) for k, p in expected.items())
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", seed=0, layers=4)
    engine = Engine(model, EngineConfig(width=8, capacity=64))
    return model, engine, exact_joint(model, PROMPT)


DRAFTERS = {
    "top_heads": lambda m: (random_top_heads(m), DecodeConfig(thresholds=0.0, lookup="off", adaptive=False)),
    "exit_heads": lambda m: (random_heads(m, [1, 3]), DecodeConfig(thresholds=0.0, lookup="off", adaptive=False)),
    "copies": lambda m: (None, DecodeConfig(lookup="only", lookup_min_ngram=1, adaptive=False)),
    # a noisy copy of the model: q != p on the same support, so both branches happen
    "draft_model": lambda m: (None, DecodeConfig(lookup="off", adaptive=False, draft_confidence=0.0),
                              Engine(perturbed_copy(m, 0.2), EngineConfig(width=8, capacity=64))),
}


def sample_counts(model, engine, drafter, draws=DRAWS, seed=0):
    heads, config, *draft_engine = DRAFTERS[drafter](model)
    decoder = SelfSpecDecoder(engine, heads, config, *draft_engine)
    torch.manual_seed(seed)
    counts, drafted, accepted = {}, 0, 0
    for _ in range(draws):
        scorer = RowScorer(processors(), PROMPT, model.config.vocab_size, "cpu")
        result = decoder.generate(PROMPT, 4, scorer=scorer, do_sample=True)
        key = tuple(result.tokens[:3])
        counts[key] = counts.get(key, 0) + 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    return counts, drafted, accepted


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_speculative_sampling_matches_the_model_distribution(tiny, drafter):
    model, engine, expected = tiny
    counts, drafted, accepted = sample_counts(model, engine, drafter)
    assert drafted > DRAWS // 2  # drafts were made ...
    assert 0 < accepted < drafted  # ... and both acceptances and rejections happened
    assert chi_square_p_value(counts, expected, DRAWS) > 1e-3


def test_a_biased_acceptance_rule_fails_the_test(tiny, monkeypatch):
    model, engine, expected = tiny
    monkeypatch.setattr(sampling, "accept_drafts", lambda p, drafts, q: [True] * len(drafts))
    counts, _, _ = sample_counts(model, engine, "top_heads")
    assert chi_square_p_value(counts, expected, DRAWS) < 1e-6


def test_residual_and_point_mass():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.7, 0.1, 0.2, 0.0])
    assert torch.allclose(residual(p, q, 0), torch.tensor([0.0, 0.2, 0.0, 0.0]))
    assert torch.equal(residual(p, None, 1), torch.tensor([0.5, 0.0, 0.2, 0.0]))
    # a copy of a token the model cannot produce is never accepted
    torch.manual_seed(0)
    for _ in range(20):
        m, token = speculative_tokens(torch.stack([p, p]), [3], [None])
        assert m == 0 and token != 3


def test_generate_sampling_is_reproducible_and_honours_processors(tmp_path):
    from hf_selfspec.heads import save_heads

    model = tiny_model("qwen3", seed=2, layers=4)
    save_heads(random_top_heads(model), tmp_path, thresholds=[0.0, 0.0])
    attach_heads(model, str(tmp_path))
    ids = torch.tensor([PROMPT])
    kw = dict(max_new_tokens=24, do_sample=True, top_k=5, top_p=0.9, temperature=0.8,
              repetition_penalty=1.2, min_new_tokens=24, pad_token_id=0, eos_token_id=2)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **kw))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape[1] == len(PROMPT) + 24 and 2 not in outs[0][0, len(PROMPT):].tolist()
    assert model.selfspec_stats.drafted > 0
    torch.manual_seed(124)
    other = model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **kw)
    assert not torch.equal(other, outs[0])


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2),
                                dict(suppress_tokens=[7, 8, 9], min_new_tokens=5)])
def test_greedy_with_processors_matches_hf(kw, tmp_path):
    from hf_selfspec.heads import save_heads

    ref = tiny_model("llama", seed=3, layers=4)
    model = tiny_model("llama", seed=3, layers=4)
    save_heads(random_top_heads(model), tmp_path, thresholds=[0.0, 0.0])
    attach_heads(model, str(tmp_path))
    for seed in range(2):
        ids = torch.randint(3, 40, (1, 20), generator=torch.Generator().manual_seed(seed))
        common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=25, do_sample=False,
                      pad_token_id=0, **kw)
        expected = ref.generate(ids, **common)
        assert torch.equal(model.generate(ids, assistant="self", **common), expected)


def test_prefix_allowed_tokens_fn_per_batch_row(tmp_path):
    """Constrained decoding: HF asks prefix_allowed_tokens_fn with each row's batch index; a
    batch row decoded with drafts gets the answers HF batch-1 greedy gets for that index."""
    from hf_selfspec.heads import save_heads

    ref = tiny_model("llama", seed=3, layers=4)
    model = tiny_model("llama", seed=3, layers=4)
    save_heads(random_top_heads(model), tmp_path, thresholds=[0.0, 0.0])
    attach_heads(model, str(tmp_path))
    calls = []

    def allowed(batch_id, sent):  # row 0: even ids, row 1: odd ids; never the last token again
        calls.append(batch_id)
        return [t for t in range(3 + batch_id, 60, 2) if t != int(sent[-1])]

    prompts = [torch.randint(3, 40, (n,), generator=torch.Generator().manual_seed(n)) for n in (20, 14)]
    ids = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 20 - len(p):], mask[b, 20 - len(p):] = p, 1
    common = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, assistant="self", prefix_allowed_tokens_fn=allowed, **common)
    assert model.selfspec_stats.drafted > 0 and set(calls) == {0, 1}
    for b, p in enumerate(prompts):
        alone = ref.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             prefix_allowed_tokens_fn=lambda _, sent, b=b: allowed(b, sent), **common)
        assert out[b, 20:].tolist() == alone[0, len(p):].tolist()
        assert all(t % 2 == (3 + b) % 2 for t in out[b, 20:].tolist())


@pytest.mark.parametrize("warpers", [
    [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50)],
    [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)],
    [MinPLogitsWarper(0.05)],
])
def test_head_q_on_the_reduced_vocabulary_is_the_full_rows_q(warpers):
    """Temperature, top-k, top-p and min-p read only a row's finite scores: a head's q
    shaped on its reduced vocabulary alone is the q of the full row (every other token
    -inf), to float rounding. A processor that reads ids keeps the full row."""
    gen = torch.Generator().manual_seed(0)
    vocab, vocab_ids = 1000, torch.randperm(1000, generator=gen)[:160].sort().values
    logits = torch.randn(160, generator=gen) * 3
    scorer = RowScorer(LogitsProcessorList(warpers), PROMPT, vocab, "cpu")
    assert scorer.id_free
    reduced = scorer.draft_distribution([7, 8], [9], logits, vocab_ids)
    scorer.id_free = False  # the full row, as for any other processor
    full = scorer.draft_distribution([7, 8], [9], logits, vocab_ids)
    assert reduced.shape == full.shape == (vocab,)
    assert torch.allclose(reduced, full, atol=1e-6) and float(reduced.sum()) == pytest.approx(1.0, abs=1e-5)
    assert not RowScorer(LogitsProcessorList([*warpers, RepetitionPenaltyLogitsProcessor(1.3)]),
                         PROMPT, vocab, "cpu").id_free


def test_sample_draws_each_token_in_proportion_and_never_a_zero_weight():
    """sampling.sample inverts the cumulative sum: frequencies follow the (unnormalised)
    weights, and a token of weight 0 (the first, the last, between two others) never comes."""
    weights = torch.tensor([0.0, 2.0, 0.0, 5.0, 3.0, 0.0])
    torch.manual_seed(0)
    draws = torch.tensor([sampling.sample(weights) for _ in range(5000)])
    counts = torch.bincount(draws, minlength=len(weights))
    assert counts[[0, 2, 5]].sum() == 0
    expected = {k: float(w) / 10.0 for k, w in enumerate(weights) if w > 0}
    assert chi_square_p_value({k: int(counts[k]) for k in expected}, expected, 5000) > 1e-3
    assert sampling.sample(torch.tensor([0.0, 0.0, 1e-30])) == 2
