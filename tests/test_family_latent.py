"""The latent family (hf_selfspec/engine/families/latent.py: multi-head latent attention (DeepSeek-V2 / V3
and their kin)): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import torch
from arch_helpers import (
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    check_hf_greedy,
    check_logits,
    supported,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.layered import UnsupportedModelError

CASES = {
    # DeepSeek-V3's latent attention: a query LoRA, the latents RMS-normed, RoPE on each head's
    # last columns (its interleaved pairs), values narrower than q.k; a dense first layer, then
    # MoE blocks routed by sigmoid scores within groups
    "deepseek_v3": dict(arch="DeepseekV3", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, random_norms=True),
    # Sarvam-105B's config (sarvam_mla), which AutoModelForCausalLM builds as DeepseekV3ForCausalLM:
    # no query LoRA, interleaved RoPE, one group
    "sarvam_mla": dict(arch="SarvamMLA", model_class="DeepseekV3ForCausalLM", num_hidden_layers=3,
                       num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                       num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.5, random_norms=True),
    # without a query LoRA, values wider than q.k, rotate_half, biases, YaRN (its mscale in
    # the attention's scale)
    "deepseek_v3-yarn-wide-v": dict(arch="DeepseekV3", num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None,
                                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=24,
                                    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                    moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                    rope_interleave=False, attention_bias=True, random_norms=True,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 128, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0}),
    # DeepSeek-V2: its RoPE as float32 complex products, a softmax router's group-limited top-k
    "deepseek_v2": dict(arch="DeepseekV2", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=1,
                        topk_method="group_limited_greedy", first_k_dense_replace=1, routed_scaling_factor=1.5,
                        random_norms=True, router_scale=1.0),
    # DeepSeek-V2-Lite's form: no query LoRA, the plain top-k of the softmax (no groups)
    "deepseek_v2-greedy": dict(arch="DeepseekV2", num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None,
                               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                               n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, moe_intermediate_size=32,
                               first_k_dense_replace=1, router_scale=1.0),
    # Mistral 4: DeepSeek-V3's attention (served below its Llama-4 query scaling), a softmax
    # router in the rows' dtype choosing within groups, renormalised
    "mistral4": dict(arch="Mistral4", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, random_norms=True, router_scale=1.0,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 128, "llama_4_scaling_beta": 0.1,
                                      "mscale": 1.0, "mscale_all_dim": 1.0}),
    # A.X-K1: DeepSeek-V3's attention and MoE, its MoE blocks' output RMS-normed
    "axk1": dict(arch="AXK1", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                 routed_scaling_factor=2.5, random_norms=True),
    # Youtu-LLM: DeepSeek-V3's attention in dense layers, tied embeddings
    "youtu": dict(arch="Youtu", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=True, random_norms=True),
    # GLM-4.7-Flash: the same attention, MoE layers after a dense one (mlp_layer_types)
    "glm4_moe_lite": dict(arch="Glm4MoeLite", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                          n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                          mlp_layer_types=["dense", "sparse", "sparse"], random_norms=True),
    # MiniCPM3: the latent attention (rotate_half) in dense layers, its scaled embedding rows,
    # residual branches scaled by scale_depth / sqrt(layers), the final hidden state divided
    # before the (tied) LM head
    "minicpm3": dict(arch="MiniCPM3", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, scale_emb=3.0, scale_depth=1.4,
                     dim_model_base=16, random_norms=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v3-yarn-wide-v", "deepseek_v2", "youtu", "glm4_moe_lite",
                                  "minicpm3", "mistral4", "axk1"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


@pytest.mark.parametrize("change", ["kv_heads", "latent_norm"])
def test_latent_attention_it_cannot_run_is_refused(change):
    """A latent attention block outside what LatentAttentionWeights reads is refused at
    attach_heads with the reason, the model untouched: fewer KV heads than heads (HF's own
    attention fails on it), a latent norm that is not an RMSNorm."""
    overrides = dict(supported("deepseek_v3"))
    if change == "kv_heads":
        overrides["num_key_value_heads"] = 2
    model = build(overrides.pop("arch"), **overrides)
    if change == "latent_norm":
        model.model.layers[1].self_attn.kv_a_layernorm = torch.nn.LayerNorm(16)
    with pytest.raises(UnsupportedModelError, match="model.layers.0.self_attn|model.layers.1.self_attn") as error:
        attach_heads(model, heads=False)
    assert "num_key_value_heads" in str(error.value) and "plain model.generate" in str(error.value)
    assert "_selfspec" not in model.__dict__
