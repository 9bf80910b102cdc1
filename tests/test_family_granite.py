"""The granite family (hf_selfspec/engine/families/granite.py: Llama's layers with Granite's four multipliers): its
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
    # embedding, attention, residual and logits multipliers (Granite 3's values)
    "granite-multipliers": dict(arch="Granite", embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                residual_multiplier=0.22, logits_scaling=8.0),
    # Granite MoE: the softmax of the top-k logits, Granite's four multipliers, block_sparse_moe
    "granitemoe": dict(arch="GraniteMoe", num_local_experts=8, num_experts_per_tok=3, embedding_multiplier=12.0,
                       attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=8.0),
    # HyperCLOVAX: Granite's multipliers, RMSNorms on both blocks' outputs (post_norm1 / 2),
    # logits multiplied by logits_scaling; and without the output norms (nn.Identity)
    "hyperclovax": dict(arch="HyperCLOVAX", random_norms=True, embedding_multiplier=3.0,
                        attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=0.25),
    "hyperclovax-no-post-norm": dict(arch="HyperCLOVAX", use_post_norm=False, logits_scaling=4.0),
    # Granite-SWA: Granite's multipliers, attention sinks (HF's sigmoid(lse - sink) scaling), a
    # window in 3 of 4 layers, a RoPE base per layer (two bases, and a layer without RoPE)
    "granite_swa": dict(arch="GraniteSWA", num_hidden_layers=4, sliding_window=16,
                        layer_rope_theta=[10000.0, 10.0, 0, 10.0], embedding_multiplier=3.0,
                        attention_multiplier=0.2, residual_multiplier=0.5,
                        logits_scaling=2.0, max_position_embeddings=1024),
    # GraniteMoeShared: Granite MoE with the layer's ungated shared MLP (gate/up rows fused)
    "granitemoeshared": dict(arch="GraniteMoeShared", num_local_experts=8, num_experts_per_tok=3,
                             shared_intermediate_size=48, embedding_multiplier=12.0, attention_multiplier=0.0078125,
                             residual_multiplier=0.22, logits_scaling=8.0),
    # Granite-MoE-SWA: GraniteMoeShared's layers with Granite-SWA's attention (sinks, windows, a
    # RoPE base per layer)
    "granitemoe_swa": dict(arch="GraniteMoeSWA", num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
                           shared_intermediate_size=48, sliding_window=16, layer_rope_theta=[10000.0, 0, 10.0, 10.0],
                           max_position_embeddings=1024),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["granite-multipliers", "hyperclovax", "granitemoeshared"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])
