"""The moe family (hf_selfspec/engine/families/moe.py: sparse MoE blocks after Llama-like attention): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import transformers
from arch_helpers import (
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    check_hf_greedy,
    check_logits,
    rope,
    supported,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.layered import UnsupportedModelError

CASES = {
    # sparse MoE blocks (PyTorch layers around the engine's products): Qwen3-MoE with a dense
    # layer among them and renormalised top-k, OLMoE (whole-projection q/k norms, clip_qkv),
    # Mixtral (float32 routing weights, a window)
    "qwen3_moe": dict(arch="Qwen3Moe", head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    "olmoe-clip-qkv": dict(arch="Olmoe", num_experts=8, num_experts_per_tok=3, clip_qkv=0.5),
    "mixtral-window": dict(arch="Mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    # Qwen2-MoE: a sigmoid-gated shared expert beside the routed ones
    "qwen2_moe-shared": dict(arch="Qwen2Moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48),
    # GPT-OSS: attention sinks, a window in every other layer, biases on every projection, MoE
    # experts stored [in, out] with biases, gate/up interleaved, a clamped SwiGLU (a limit low
    # enough to clamp), the softmax of the top-k router logits, RoPE's halves from one table
    "gpt_oss": dict(arch="GptOss", head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
                    random_norms=True, max_position_embeddings=1024,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0}),
    # DeepSeek-V3's MoE routing (sigmoid scores, a correction bias, the best 2 of 4 expert
    # groups, renormalised and scaled weights, a shared MLP): GLM-4.5 (a dense first layer,
    # per-head q/k norms, RoPE on half of each head, q/k/v biases), dots.llm1 (Qwen3's
    # attention), Solar Open (Llama's attention, every layer MoE)
    "glm4_moe": dict(arch="Glm4Moe", head_dim=16, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                     norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                     random_norms=True),
    "dots1": dict(arch="Dots1", head_dim=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                  n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False,
                  routed_scaling_factor=1.5),
    # Mellum: Qwen3-MoE's layers (a dense one among them), a window and a RoPE per layer type
    "mellum": dict(arch="Mellum", head_dim=16, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, sliding_window=16, max_position_embeddings=1024,
                   layer_types=["sliding_attention", "full_attention"] * 2,
                   mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}),
    # Hy3 (Tencent): Apertus's attention (per-head q/k norms), a dense layer, then MoE blocks
    # routed as MiniMax-M2 (the block's correction bias), renormalised and scaled; a gated shared MLP
    "hy_v3": dict(arch="HYV3", num_hidden_layers=3, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_shared_experts=1, router_scaling_factor=2.5,
                  mlp_layer_types=["dense", "sparse", "sparse"], random_norms=True),
    # AFMoE (Arcee's Trinity): per-head q/k norms, RoPE in the sliding layers only, the attention's
    # output gated per element, norms on both sides of each block, muP's sqrt(hidden) on the
    # embedding; a dense layer, then MoE blocks routed by sigmoid scores chosen with the
    # block's expert bias, renormalised and scaled; a gated shared MLP
    "afmoe": dict(arch="Afmoe", num_hidden_layers=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_shared_experts=1, num_dense_layers=1, route_scale=2.5,
                  sliding_window=16, global_attn_every_n_layers=2, mup_enabled=True, max_position_embeddings=1024,
                  random_norms=True),
    # Kolibri-1: EXAONE 4's attention (per-head q/k norms, windows in 4 of 5 layers, the full
    # ones NoPE), GLM-4's norms on both sides of each block, MoE blocks chosen by logit + a
    # correction bias, weighted by the chosen logits' sigmoid, renormalised; a gated shared MLP
    "kolibri1": dict(arch="Kolibri1", num_hidden_layers=5, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48, sliding_window=16,
                     norm_topk_prob=True, max_position_embeddings=1024, random_norms=True),
    # Llama 4 (Scout's form): RoPE on adjacent pairs as complex products in float32 (llama3
    # scaling), each head's q and k L2-normed after it on the RoPE layers, NoPE layers between;
    # dense MLPs and MoE blocks interleaved, the top-1 expert's input scaled by its sigmoid
    # weight, a shared expert added
    "llama4": dict(arch="Llama4Text", model_class="Llama4ForCausalLM", num_hidden_layers=4, num_local_experts=4,
                   num_experts_per_tok=1, intermediate_size_mlp=96, interleave_moe_layer_step=2,
                   no_rope_layer_interval=2, random_norms=True,
                   **rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)),
    # Maverick's form without q/k norms, every layer MoE; here two experts per row and biases
    "llama4-top2-no-qk-norm": dict(arch="Llama4Text", model_class="Llama4ForCausalLM", num_hidden_layers=3,
                                   num_local_experts=4, num_experts_per_tok=2, use_qk_norm=False,
                                   attention_bias=True, no_rope_layer_interval=3),
    # Sarvam-M MoE: GLM-4.5's classes under its own model_type, RoPE over the whole head
    "sarvam_moe": dict(arch="SarvamMoE", model_class="Glm4MoeForCausalLM", head_dim=16, num_hidden_layers=3,
                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                       n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5),
    "solar_open": dict(arch="SolarOpen", head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True),
    # K-EXAONE: EXAONE 4's attention (per-head q/k norms; with a window, its full-attention
    # layers unrotated) in pre-norm layers, a dense first layer, DeepSeek-V3's routing
    "exaone_moe": dict(arch="ExaoneMoe", head_dim=16, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, num_shared_experts=1, n_group=2, topk_group=1,
                       mlp_layer_types=["dense", "sparse", "sparse", "sparse"], routed_scaling_factor=2.0,
                       sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                       max_position_embeddings=1024, random_norms=True),
    # FlexOlmo: OLMo 2's layers (norms on the blocks' outputs, whole-projection q/k norms)
    # with OLMoE's experts
    "flex_olmo": dict(arch="FlexOlmo", num_experts=8, num_experts_per_tok=2, random_norms=True),
    # HunYuan-MoE: HunYuan's q/k norms after RoPE, a float32 router (`wg`) on the rows widened,
    # renormalised top-k weights, the block's ungated shared MLP
    "hunyuan_v1_moe": dict(arch="HunYuanMoEV1", head_dim=16, num_experts=8, moe_topk=2, random_norms=True),
    # ERNIE 4.5 MoE: RoPE pairs, biases, a dense first layer, a float32 router whose choice adds
    # a correction bias, weights over their clamped sum, a shared MLP
    "ernie4_5_moe": dict(arch="Ernie4_5_Moe", head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, moe_num_shared_experts=1, use_bias=True, router_scale=0.5),
    # MiniMax-M2: whole-projection q/k norms, RoPE on part of each head, a sigmoid router whose
    # choice adds the block's correction bias, renormalised weights
    "minimax_m2": dict(arch="MiniMaxM2", head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # PhiMoE (Phi-3.5-MoE): LayerNorms, biases on q/k/v/o and the LM head, its sparsemixer's top-2
    # routing (HF's own function), a window
    "phimoe": dict(arch="Phimoe", num_local_experts=8, num_experts_per_tok=2, random_norms=True,
                   attention_bias=True, lm_head_bias=True, sliding_window=16, router_scale=1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral-window", "glm4_moe", "llama4", "kolibri1", "afmoe", "hy_v3"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


def test_mellum_partial_rotary_refused():
    """HF's Mellum rotates whole heads (its tables of a partial_rotary_factor < 1 would not
    fit them): such a config is refused by name, not run on a guess."""
    overrides = dict(supported("mellum"))
    overrides["rope_parameters"] = {**overrides["rope_parameters"],
                                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}}
    model = build(overrides.pop("arch"), **overrides)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor below 1 \\(mellum\\)"):
        attach_heads(model, heads=False)


def test_llama4_image_text_class_points_to_its_text_model():
    """Llama4ForConditionalGeneration is refused at attach_heads, naming the class that runs
    (what AutoModelForCausalLM loads from the same checkpoint), the model left as it was."""
    text = dict(hidden_size=64, intermediate_size=128, intermediate_size_mlp=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300, num_local_experts=4)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  vision_output_dim=32, projector_input_dim=32, projector_output_dim=64, image_size=28, patch_size=14)
    model = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text, vision_config=vision))
    with pytest.raises(UnsupportedModelError,
                       match="Llama 4's image-text model.*AutoModelForCausalLM.*Llama4ForCausalLM"):
        attach_heads(model, heads=False)
    assert "_selfspec" not in model.__dict__
