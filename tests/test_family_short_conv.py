"""The short_conv family (hf_selfspec/engine/families/short_conv.py: gated short convolutions between
attention layers (LFM2)): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
from arch_helpers import (
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    check_hf_greedy,
    check_logits,
)

CASES = {
    # LFM2: gated short convolutions (3 positions) in place of attention in most layers, two
    # in a row, the last layer one; per-head q/k norms in the attention layers; the final norm
    # named embedding_norm; with conv_bias, biases in every convolution layer's products too
    "lfm2": dict(arch="Lfm2", layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4,
                 block_auto_adjust_ff_dim=False, random_norms=True),
    "lfm2-conv-bias": dict(arch="Lfm2", layer_types=["full_attention", "conv", "conv"], conv_bias=True,
                           num_hidden_layers=3, block_auto_adjust_ff_dim=False),
    # LFM2-MoE (LFM2-8B-A1B's form): LFM2's layers, a dense first layer, then sigmoid routers
    # choosing with the block's expert bias (float32), weights renormalised and scaled
    "lfm2_moe": dict(arch="Lfm2Moe", layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3,
                     num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     routed_scaling_factor=2.0, random_norms=True, router_scale=1.0),
    "lfm2_moe-unbiased": dict(arch="Lfm2Moe", layer_types=["full_attention", "conv"], num_dense_layers=0,
                              num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32, use_expert_bias=False,
                              norm_topk_prob=False),
    # LFM3: LFM2's convolutions, sliding and full attention layers each with its own RoPE
    # (float32 tables), sandwich norms around every block, a sigmoid gate per attention head;
    # and without the last two
    "lfm3": dict(arch="Lfm3", head_dim=16, num_hidden_layers=4, sliding_window=16, random_norms=True,
                 layer_types=["conv", "sliding_attention", "conv", "full_attention"]),
    "lfm3-plain": dict(arch="Lfm3", head_dim=16, num_hidden_layers=3, sliding_window=16, use_sandwich_norm=False,
                       use_attention_gate=False, layer_types=["sliding_attention", "conv", "full_attention"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["lfm2", "lfm2-conv-bias", "lfm2_moe", "lfm3"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])
