"""The heads' one-sync drafting (heads/device_drafting.py, what a CUDA model drafts with)
gives exactly the host-side drafting's chains and trees, and decodes the same tokens.

Run here on CPU tensors: the functions are device-agnostic. The heads' adapter is 32 wide
so that every elementwise op sees whole vector blocks per row whatever the row count
(PyTorch's CPU SiLU rounds a tail block differently), which makes both versions' head
outputs bitwise equal and the comparison exact."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from hf_selfspec.decoding.config import DecodeConfig
from hf_selfspec.decoding.cycle import SelfSpecDecoder
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.heads.device_drafting import draft_chain_on_device, draft_trees_on_device
from hf_selfspec.heads.top import random_top_heads


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0, layers=2)


# (depths per sequence, children, beam, min_prob, thresholds per step): frontiers wider
# than the first step's grid (children 1, beam 3), steps cut by a threshold, min_prob
CUT = [0.0, 0.3, 0.0, 0.1]
CASES = [([4, 0, 2, 3], 4, 8, 0.0, [0.0] * 4), ([4, 0, 2, 3], 4, 3, 0.01, CUT), ([4, 4, 4, 4], 4, 1, 0.0, CUT),
         ([4, 4, 4, 4], 1, 3, 0.0, [0.0] * 4), ([4, 4, 4, 4], 4, 8, 0.01, [0.0] * 4),
         ([4, 0, 2, 3], 1, 1, 0.01, CUT), ([4, 4, 4, 4], 3, 2, 0.0, CUT)]


def test_one_sync_trees_and_chains_equal_the_host_drafting(model):
    """Every option of the tree (children, beam, min_prob, thresholds that cut steps, per
    sequence depths 0..4, stop tokens) and the chain: the same nodes in the same order,
    the same probabilities to the bit."""
    roots = [6, 9, 200, 31]
    branched = 0
    for seed in (0, 2):
        heads = random_top_heads(model, 4, seed, adapter=32)
        # the host side's PyTorch step (what a CUDA model's host drafting runs), not the CPU's
        # fused C++ step, whose own rounding would make the two trees' nodes differ in bits
        heads._fused_step = None
        finals = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)) * 3
        for depths, children, beam, min_prob, thresholds in CASES:
            first = heads.draft_tree(finals[1], roots[1], depths[1], thresholds, children, beam, min_prob)
            stops = [frozenset(), frozenset({first[0].token}) if first else frozenset(), frozenset({3, 4}),
                     frozenset()]
            host = heads.draft_trees(finals, roots, depths, thresholds, children, beam, min_prob, stops)
            one_sync = draft_trees_on_device(heads, finals, roots, depths, thresholds, children, beam,
                                             min_prob, stops)
            assert one_sync == host, (seed, depths, children, beam, min_prob, thresholds)
            branched += sum(len(t) > 1 for t in host)
            for b in range(4):
                assert (draft_chain_on_device(heads, finals[b], roots[b], depths[b], thresholds)
                        == heads.draft(finals[b], roots[b], depths[b], thresholds))
    assert branched > 20  # trees with branches were compared, not only empty ones


@pytest.mark.parametrize("tree", ["on", "off"])
def test_decoding_with_one_sync_drafting_is_the_engines_ar(model, tree):
    """The decoder's heads drafter forced to the one-sync path (as on CUDA): the output is
    the engine's AR output and the drafting (same drafts) accepts exactly as much."""
    engine = Engine(model, EngineConfig(width=8, capacity=200, row_layout="kernel"))
    heads = random_top_heads(model, 3, 0, adapter=32)
    prompt = [5, 17, 99, 5, 17, 42, 7, 7, 7, 120]
    config = DecodeConfig(thresholds=0.0, lookup="off", tree=tree, siblings=2, sibling_min_prob=0.0,
                          adaptive=False)
    results = []
    for one_sync in (False, True):
        decoder = SelfSpecDecoder(engine, heads, config)
        assert decoder.drafter.one_sync is False  # CPU heads draft step by step by default
        decoder.drafter.one_sync = one_sync
        results.append(decoder.generate(prompt, 30))
    host, one_sync = results
    assert one_sync.tokens == host.tokens == engine.generate_ar(prompt, 30)
    assert one_sync.stats.accepted == host.stats.accepted > 0
    assert one_sync.stats.sources == host.stats.sources
