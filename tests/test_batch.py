"""Batched self-speculation (decoding/batch.py): the sequences of a batch share one engine
step a cycle, and every sequence's output is bitwise what it gets decoded alone (greedy:
the engine's AR output), whatever its neighbours.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model
from test_decoding import prompt, random_heads
from test_sampling import DRAWS, PROMPT, chi_square_p_value, exact_joint, processors

from hf_selfspec import DecodeConfig, attach_heads
from hf_selfspec.decoding.batch import BatchDecoder, SequenceRequest, batch_obstacle, share_rows
from hf_selfspec.decoding.candidates import Source
from hf_selfspec.decoding.cycle import SelfSpecDecoder
from hf_selfspec.decoding.sampling import RowScorer
from hf_selfspec.decoding.tree import DraftTree
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.engine.regions import KVRegion
from hf_selfspec.heads.top import random_top_heads


def tree_of(values):
    """A chain whose rows have the given expected acceptances."""
    tree = DraftTree(0, 16)
    parent = 0
    for i, v in enumerate(values):
        parent = tree.add(parent, i + 1, Source.HEAD, value=v)
    return tree


def test_share_rows_takes_the_likeliest_rows_while_they_pay():
    linear = [1.0] + [1.0 + 0.1 * (n - 1) for n in range(1, 40)]  # each row costs 0.1 of a step
    trees = [tree_of([0.9, 0.8, 0.05]), tree_of([0.3]), tree_of([])]
    # 3 roots (3 tokens / 1.2); 0.9 and 0.8 pay (they beat the tokens per cost so far), 0.3
    # does not (4.7 / 1.4 = 3.36 > 5.0 / 1.5), nor 0.05
    assert share_rows(trees, linear, most=32) == [3, 1, 1]
    # rows are nearly free: every row that adds tokens pays
    flat = [1.0] + [1.0 + 0.001 * (n - 1) for n in range(1, 40)]
    assert share_rows(trees, flat, most=32) == [4, 2, 1]
    # the step's row cap, and adaptive=False keeps every row that fits
    assert share_rows(trees, linear, most=4) == [2, 1, 1]
    assert share_rows(trees, linear, most=32, adaptive=False) == [4, 2, 1]
    with pytest.raises(ValueError, match="do not fit"):
        share_rows(trees, linear, most=2)


@pytest.fixture(scope="module")
def kernel_engine():
    model = tiny_model("llama", seed=0, layers=4)
    return model, Engine(model, EngineConfig(width=8, capacity=400, row_layout="kernel"))


CONFIGS = {  # each drafter and tree shape; adaptive=False forces the rows
    "heads_trees_lookup": dict(thresholds=0.0, lookup="first", siblings=3, sibling_min_prob=0.0, adaptive=False),
    "heads_trees_adaptive": dict(thresholds=0.0, lookup="first"),
    "heads_chains": dict(thresholds=0.0, lookup="fallback", tree="off", adaptive=False),
    "lookup_only": dict(lookup="only", lookup_min_ngram=1),
    "lossy_chains": dict(thresholds=0.0, lookup="off", tree="off", lossy_top_k=2, adaptive=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_rows_equal_each_sequence_alone(kernel_engine, name):
    """Property: random batches (2..8 sequences) of different prompt lengths, alphabets
    (copies or not), EOS ids, max_new_tokens and min_new_tokens; every sequence's tokens are
    bitwise those it gets decoded alone, and greedy (not lossy) the engine's AR output."""
    model, engine = kernel_engine
    heads = random_top_heads(model, depth=3)
    config = DecodeConfig(**CONFIGS[name])
    rng = random.Random(name)
    accepted = 0
    for trial in range(3):
        size = rng.randint(2, 8)
        requests, eos = [], [rng.randrange(3, 12)]
        for b in range(size):
            length, alphabet = rng.choice([(3, 256), (30, 10), (70, 256), (12, 6)])
            requests.append(SequenceRequest(prompt(rng.randrange(10 ** 6), length, alphabet),
                                            max_new_tokens=rng.choice([1, 9, 24, 36]),
                                            min_new_tokens=rng.choice([0, 0, 5])))
        results = BatchDecoder(engine, heads, config).generate(requests, 40, eos)
        for r, res in zip(requests, results):
            alone = SelfSpecDecoder(engine, heads, config).generate(
                r.prompt, r.max_new_tokens, eos, min_new_tokens=r.min_new_tokens)
            assert res.tokens == alone.tokens, (name, trial)
            if config.lossy_top_k == 1 and r.min_new_tokens == 0:
                assert res.tokens == engine.generate_ar(r.prompt, r.max_new_tokens, eos), (name, trial)
        accepted += sum(res.stats.accepted for res in results)
    assert accepted > 0


def test_batch_stop_and_scores_per_sequence(kernel_engine):
    """Each sequence's own stopping criterion and logits processors (HF semantics: the
    processors see its own history), and its collected scores, as alone."""
    model, engine = kernel_engine
    heads = random_top_heads(model, depth=3)
    config = DecodeConfig(thresholds=0.0, lookup="first", adaptive=False)
    prompts = [prompt(1, 9), prompt(2, 40, 8), prompt(3, 20)]

    def request(p, stop_after):
        return SequenceRequest(p, stop=lambda out, n=stop_after: len(out) >= n,
                               scorer=RowScorer(processors(), p, model.config.vocab_size, "cpu"))

    results = BatchDecoder(engine, heads, config).generate(
        [request(p, n) for p, n in zip(prompts, [4, 30, 17])], 30, collect_logits=True)
    for p, n, res in zip(prompts, [4, 30, 17], results):
        alone = SelfSpecDecoder(engine, heads, config).generate(
            p, 30, stop=lambda out, n=n: len(out) >= n, collect_logits=True,
            scorer=RowScorer(processors(), p, model.config.vocab_size, "cpu"))
        assert res.tokens == alone.tokens and len(res.tokens) == n
        assert all(torch.equal(a, b) for a, b in zip(res.scores, alone.scores))
        assert all(torch.equal(a, b) for a, b in zip(res.logits, alone.logits))


def test_batch_sampling_is_exact_per_sequence(kernel_engine):
    """Speculative sampling in a batch: each sequence's first three tokens are distributed
    as the model's (chi-square against HF's forward with the processors), and drafts were
    both accepted and rejected."""
    model, engine = kernel_engine
    other = [9, 33, 5, 9, 33, 5, 17]
    expected = [exact_joint(model, PROMPT), exact_joint(model, other)]
    heads = random_top_heads(model)
    decoder = BatchDecoder(engine, heads, DecodeConfig(thresholds=0.0, lookup="first", adaptive=False))
    torch.manual_seed(0)
    counts = [{}, {}]
    drafted = accepted = 0
    draws = DRAWS // 2
    for _ in range(draws):
        requests = [SequenceRequest(p, scorer=RowScorer(processors(), p, model.config.vocab_size, "cpu"))
                    for p in (PROMPT, other)]
        for b, res in enumerate(decoder.generate(requests, 4, do_sample=True)):
            key = tuple(res.tokens[:3])
            counts[b][key] = counts[b].get(key, 0) + 1
            drafted += res.stats.drafted
            accepted += res.stats.accepted
    assert 0 < accepted < drafted
    for b in range(2):
        assert chi_square_p_value(counts[b], expected[b], draws) > 1e-3, b


def test_batches_need_the_kernel_layout_and_these_drafters():
    """Where a batch cannot share steps it is refused by BatchDecoder (generate() then
    decodes its sequences one after the other); a KV region outside the cache is refused."""
    model = tiny_model("llama", seed=0, layers=2)
    micro = Engine(model, EngineConfig(width=8, capacity=64, row_layout="fixed"))
    assert not micro.supports_batches
    with pytest.raises(ValueError, match="cannot share engine steps"):
        BatchDecoder(micro)
    with pytest.raises(ValueError, match="batched steps need a row attention"):
        micro.make_meta([3, 4], bases=[0, 0])
    kernel = Engine(model, EngineConfig(width=8, capacity=64, row_layout="kernel"))
    exit_heads = SelfSpecDecoder(kernel, random_heads(model, [1]), DecodeConfig(thresholds=0.0))
    assert "exit heads" in batch_obstacle(kernel, exit_heads)
    with pytest.raises(ValueError, match="outside the engine"):
        KVRegion(kernel, 60, 16)
    with pytest.raises(ValueError, match="takes 1..64 rows"):
        kernel.make_meta([3] * 65, bases=[0] * 65)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_generate_batch_rows_equal_batch_one(dtype):
    """Through HF generate(): a left-padded batch with assistant='self' shares steps, each
    row equals that prompt decoded alone (fp32: and HF batch-1 greedy); output_scores come
    as HF lays them out ([batch, V] per step, zeros after a row ended)."""
    model = tiny_model("llama", seed=1, layers=3).to(dtype)
    attach_heads(model, heads=False)
    prompts = [prompt(4, 6), prompt(5, 30, 8), prompt(6, 15)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=7)
    out = model.generate(ids, attention_mask=mask, assistant="self", output_scores=True,
                         return_dict_in_generate=True, **kw)
    assert model._selfspec.engine.supports_batches
    assert len(out.scores) == out.sequences.shape[1] - width
    for b, p in enumerate(prompts):
        alone = model.generate(torch.tensor([p]), assistant="self", output_scores=True,
                               return_dict_in_generate=True, **kw)
        new = alone.sequences[0, len(p):]
        assert torch.equal(out.sequences[b, width:width + len(new)], new), b
        assert (out.sequences[b, width + len(new):] == 0).all()
        for t, s in enumerate(alone.scores):
            assert torch.equal(out.scores[t][b], s[0]), (b, t)
        for s in out.scores[len(alone.scores):]:
            assert (s[b] == 0).all()
        if dtype == torch.float32:
            hf = model.generate(torch.tensor([p]), **kw)
            assert torch.equal(hf[0, len(p):], new), b


def test_heads_draft_trees_together_as_alone(kernel_engine):
    """TopDraftHeads.draft_trees (a batch's head steps run together) gives each sequence
    the tree draft_tree gives it alone: depths 0..3, stop tokens, beams and thresholds."""
    model, _ = kernel_engine
    heads = random_top_heads(model, depth=3)
    gen = torch.Generator().manual_seed(5)
    finals = torch.randn(5, model.config.hidden_size, generator=gen)
    roots, depths = [6, 9, 200, 6, 31], [3, 0, 2, 3, 1]
    alone = [heads.draft_tree(finals[b], roots[b], depths[b], [0.0, 0.0, 0.0], 3, 2, 0.0) for b in range(5)]
    stops = [frozenset(), frozenset(), frozenset({alone[2][0].token}), frozenset(), frozenset()]
    alone[2] = heads.draft_tree(finals[2], roots[2], depths[2], [0.0, 0.0, 0.0], 3, 2, 0.0, stops[2])
    together = heads.draft_trees(finals, roots, depths, [0.0, 0.0, 0.0], 3, 2, 0.0, stops)
    assert together == alone and alone[1] == [] and len(alone[0]) > len(alone[4]) > 0


def test_a_batch_larger_than_a_step_runs_in_groups():
    """More sequences than half a step's rows: each cycle runs the live sequences in
    groups of steps; every sequence still equals its own decode alone."""
    model = tiny_model("llama", seed=2, layers=2)
    engine = Engine(model, EngineConfig(width=2, capacity=64, row_layout="kernel"))
    assert engine.max_step_rows // 2 < 10
    config = DecodeConfig(lookup="only", lookup_min_ngram=1)
    prompts = [prompt(100 + b, 5 + 3 * b, 6) for b in range(10)]
    results = BatchDecoder(engine, None, config).generate([SequenceRequest(p) for p in prompts], 12)
    for p, res in zip(prompts, results):
        assert res.tokens == engine.generate_ar(p, 12)
