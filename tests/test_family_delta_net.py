"""The delta_net family (hf_selfspec/engine/families/delta_net.py: gated DeltaNets between attention
layers (Qwen 3.5, Qwen3-Next, OLMo Hybrid)): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import torch
import transformers
from arch_helpers import (
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    check_hf_greedy,
    check_logits,
    hf_greedy,
    prompts,
    self_greedy,
    supported,
)

from hf_selfspec import attach_heads

CASES = {
    # Qwen 3.5 (text): gated DeltaNets (a SiLU convolution over 4 positions, a recurrent state
    # per head) in most layers, attention gated by more rows of q_proj, RoPE on a quarter of
    # each head, norms by 1 + w; value heads twice the key heads, or as many
    "qwen3_5": dict(arch="Qwen3_5Text", model_class="Qwen3_5ForCausalLM", head_dim=16, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    random_norms=True),
    "qwen3_5-one-value-head-per-key": dict(arch="Qwen3_5Text", model_class="Qwen3_5ForCausalLM", head_dim=16,
                                           linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=3,
                                           linear_num_value_heads=3, num_hidden_layers=2,
                                           layer_types=["full_attention", "linear_attention"]),
    # a DeltaNet convolving each row alone (kernel 1): its state's parent is still the row before
    "qwen3_5-one-tap": dict(arch="Qwen3_5Text", model_class="Qwen3_5ForCausalLM", head_dim=16, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                            linear_conv_kernel_dim=1, num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"]),
    # OLMo Hybrid: gated DeltaNets (q, k, v from three projections, beta up to 2) in pre-norm
    # layers, attention in OLMo 2's post-norm layers; its released form without RoPE, and with
    "olmo_hybrid": dict(arch="OlmoHybrid", linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_hidden_layers=3, random_norms=True,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        rope_parameters={"rope_type": "default", "rope_theta": None}),
    "olmo_hybrid-rope": dict(arch="OlmoHybrid", linear_key_head_dim=16, linear_value_head_dim=8,
                             linear_num_key_heads=2, linear_num_value_heads=2, num_hidden_layers=2,
                             linear_allow_neg_eigval=False, layer_types=["full_attention", "linear_attention"]),
    # Qwen 3.5 MoE (text): Qwen 3.5's layers with Qwen2-MoE's block (softmax top-k, a shared
    # expert gated by a sigmoid)
    "qwen3_5_moe": dict(arch="Qwen3_5MoeText", model_class="Qwen3_5MoeForCausalLM", head_dim=16,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48, random_norms=True,
                        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # Qwen3-Next: Qwen 3.5 MoE's layers with the DeltaNet's projections fused per key head
    # (q, k, v, z in one; b, a in another), a dense layer among the MoE ones
    "qwen3_next": dict(arch="Qwen3Next", head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=4, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       mlp_only_layers=[2], random_norms=True,
                       layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_moe", "olmo_hybrid", "qwen3_next"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


def test_qwen3_5_image_text_class_decodes_its_text():
    """Qwen3_5ForConditionalGeneration (what a Qwen 3.5 checkpoint's own class is): its
    language model decodes HF's greedy tokens, and its media inputs are refused by name."""
    torch.manual_seed(0)
    overrides = dict(supported("qwen3_5"))
    for key in ("arch", "model_class", "random_norms"):
        overrides.pop(key)
    text = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("conv1d.weight"):
                param.normal_(0.0, 0.5)
    rows = prompts(11, 30)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False)
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows) == expected
    cache = model._selfspec.engine.mixer_cache
    assert len(cache._regions) == 2  # a ring of convolution inputs and states per sequence of the batch
    assert self_greedy(model, rows[:1]) == expected[:1]
    assert len(cache._regions) == 1  # a new request reuses the rings
    ids = torch.tensor(rows[:1])
    with pytest.raises(ValueError, match="pixel_values"):
        model.generate(ids, pixel_values=torch.zeros(4, 3), assistant="self", max_new_tokens=4)
