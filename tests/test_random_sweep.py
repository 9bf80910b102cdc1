"""A seeded random sweep off the happy path: each case draws an architecture, a dtype, a
batch of left-padded prompts of mixed lengths, generation options and a drafter (none, exit
heads or top-layer heads, thresholds, prompt lookup mode, either prefill, the C++ layers or
the PyTorch ones; sliding windows shorter than most requests) on a tiny random
model, and checks generate(..., assistant="self") row by row against its reference: in fp32
HF's greedy output for the prompt alone (HF's batched output where a processor reads the
padded row: repetition penalty, no_repeat_ngram_size), in bf16/fp16 the engine's own AR
output. A longer run of the same sweep (other seeds) found the batched repetition-penalty
failure fixed in sampling.row_processors.

fp32 outputs may part at a near-tie (two logits within float32 rounding of each other,
where HF's and the engine's sums round differently); a mismatch counts only where HF's top
two logits there differ by more than 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from test_decoding import random_heads
from transformers.pytorch_utils import Conv1D

from hf_selfspec import DecodeConfig, attach_heads
from hf_selfspec.engine.core import EngineConfig
from hf_selfspec.heads.top import random_top_heads

TWO_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
             "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
ARCHS = {
    "Llama": {}, "Qwen3": {}, "Qwen2": dict(use_sliding_window=False), "Mistral": dict(sliding_window=24),
    "SmolLM3": dict(no_rope_layer_interval=2), "Phi3": {}, "Olmo2": {},
    "Granite": dict(embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                    logits_scaling=8.0),
    "Gemma": dict(tie_word_embeddings=False),
    "Gemma2": dict(tie_word_embeddings=False, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   query_pre_attn_scalar=24),
    # a RoPE per layer type (Gemma 3 text, OLMo 3): bases 10 and 10000 in alternate layers;
    # their sliding windows (and Mistral's) shorter than most requests here
    "Gemma3Text": dict(tie_word_embeddings=False, query_pre_attn_scalar=24, sliding_window=24,
                       layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=TWO_ROPES),
    "Olmo3": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2,
                  rope_parameters=TWO_ROPES),
    # output norms, per-head q/k norms, a window on the sliding layers, the full ones unrotated
    "Exaone4": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2),
    "Ministral": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2),
    "SeedOss": dict(attention_bias=True, attention_out_bias=True),
    # RoPE turning adjacent pairs (GLM: on half of each head, gate/up fused)
    "Glm": {}, "Ernie4_5": dict(use_bias=False),
    # LayerNorm models: parallel blocks (Phi, Cohere, GPT-NeoX), plain MLPs, q/k/v clamped
    # (OLMo), fused per head (GPT-NeoX), per-head q/k LayerNorms (Cohere)
    "StableLm": dict(partial_rotary_factor=0.5), "Olmo": dict(clip_qkv=2.0), "Phi": {},
    "Starcoder2": dict(sliding_window=24), "Cohere": dict(use_qk_norm=True), "GPTNeoX": dict(rotary_pct=0.5),
    # sparse MoE blocks (random routers and experts below)
    "Qwen3Moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
    "Olmoe": dict(num_experts=8, num_experts_per_tok=2, clip_qkv=2.0),
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24),
    "Qwen2Moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                     shared_expert_intermediate_size=64),
    "Glm4": {}, "Arcee": {}, "Apertus": {}, "HunYuanDenseV1": {}, "Helium": {},
    "GraniteMoe": dict(num_local_experts=8, num_experts_per_tok=3, embedding_multiplier=12.0,
                       attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=8.0),
    # Conv1D projections read transposed, learned positions, no RoPE
    "GPT2": {},
    # learned positions from row 2, the layer holding its MLP's fc1 / fc2
    "OPT": {},
    # unscaled attention scores, a window in every other layer
    "GPTNeo": dict(attention_types=[[["global", "local"], 2]], window_size=24),
    "GPTBigCode": {},  # one KV head (multi_query); its MHA form in test_family_gpt2
    "GPTJ": dict(rotary_dim=8),  # RoPE pairs on part of each head, parallel blocks
    # the new architecture: q/k/v rows grouped per KV head, two norms (its other forms in
    # the test_family_* files)
    "Falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "Nemotron": {},  # LayerNorm1P, ReLU² plain MLP, RoPE on half of each head
    "CodeGen": dict(rotary_dim=8),  # q/k/v in 4 shards; GPT-J's layers
    "Bloom": {},  # ALiBi, its embedding rows normed
    "Mpt": {},  # ALiBi relative to the last key, Wqkv rows, norms without biases
    # Gemma 2 without the blocks' output norms
    "VaultGemma": dict(tie_word_embeddings=False, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                       query_pre_attn_scalar=24),
    "Cwm": dict(sliding_window=24, layer_types=["full_attention", "sliding_attention"] * 2,  # Qwen2's windows
                rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "Jais2": {},  # LayerNorms, ReLU² plain MLP, biases
    # Granite's multipliers, output norms (post_norm1 / 2), logits times logits_scaling
    "HyperCLOVAX": dict(embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.5,
                        logits_scaling=0.25),
    # yarn RoPE; its query scaling starts at original_max_position_embeddings (= the positions here)
    "Ministral3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 2048, "llama_4_scaling_beta": 0.1}),
    # parallel blocks, RoPE pairs in its sliding layers only, the full ones NoPE
    "Cohere2": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2),
    # attention sinks, windows in alternate layers, MoE experts stored [in, out] with biases,
    # a clamped SwiGLU, yarn RoPE from half-width tables
    "GptOss": dict(num_local_experts=8, num_experts_per_tok=2, swiglu_limit=2.0, sliding_window=24,
                   layer_types=["sliding_attention", "full_attention"] * 2,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0}),
    # attention sinks as a sigmoid scaling, Granite's multipliers, a RoPE base per layer (0: NoPE)
    "GraniteSWA": dict(sliding_window=24, layer_types=["full_attention"] + ["sliding_attention"] * 3,
                       layer_rope_theta=[10000.0, 10.0, 0, 10.0], embedding_multiplier=3.0, attention_multiplier=0.2,
                       residual_multiplier=0.5, logits_scaling=2.0),
    # Granite MoE with the layer's shared MLP; and with Granite-SWA's attention
    "GraniteMoeShared": dict(num_local_experts=8, num_experts_per_tok=3, shared_intermediate_size=64,
                             embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                             logits_scaling=8.0),
    "GraniteMoeSWA": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=64, sliding_window=24,
                          layer_types=["full_attention"] + ["sliding_attention"] * 3,
                          layer_rope_theta=[10000.0, 0, 10.0, 10.0]),
    # DeepSeek-V3's routing (sigmoid, correction bias, expert groups, a shared MLP)
    "Glm4Moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_group=4, topk_group=2,
                    first_k_dense_replace=1, routed_scaling_factor=2.5, use_qk_norm=True),
    "Dots1": dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, n_group=2, topk_group=1,
                  n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=False),
    "SolarOpen": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
    # Qwen3-MoE's layers, a RoPE and a window per layer type, a dense layer
    "Mellum": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, sliding_window=24,
                   layer_types=["sliding_attention", "full_attention"] * 2,
                   mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rope_parameters=TWO_ROPES),
    # Apertus's layers, its LM head pruned to the first 90 ids
    "Apertus1p5Text": dict(output_vocab_size=90, tie_word_embeddings=False),
    # parameter-free norms (the embedding too), RoPE by -angle, q/k norms after it, capped logits
    "NanoChat": dict(final_logit_softcapping=3.0, tie_word_embeddings=False),
    "SarvamMoE": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_group=2, topk_group=1),
    # EXAONE 4's attention (windows, the full layers unrotated) with DeepSeek-V3's routing
    "ExaoneMoe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, num_shared_experts=1, n_group=2,
                      topk_group=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=24,
                      layer_types=["sliding_attention", "full_attention"] * 2),
    "FlexOlmo": dict(num_experts=8, num_experts_per_tok=2),  # OLMo 2's layers, OLMoE's experts
    # q/k norms after RoPE, a router `wg`, the block's shared MLP
    "HunYuanMoEV1": dict(num_experts=8, moe_topk=2),
    # RoPE pairs, a float32 router whose choice adds a correction bias, a shared MLP
    "Ernie4_5_Moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, moe_num_shared_experts=1,
                         use_bias=True),
    # whole-projection q/k norms, partial RoPE, a sigmoid router with the block's correction bias
    "MiniMaxM2": dict(num_local_experts=8, num_experts_per_tok=2, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # LayerNorms, biases, the sparsemixer's top-2 routing, a window
    "Phimoe": dict(num_local_experts=8, num_experts_per_tok=2, attention_bias=True, sliding_window=24),
    # parallel layers, RoPE pairs in sliding layers (and the dense prefix), top-k logits' softmax
    "Cohere2Moe": dict(num_experts=8, num_experts_per_tok=2, num_shared_experts=1, sliding_window=24,
                       mlp_layer_types=["dense", "sparse", "sparse", "sparse"], prefix_dense_intermediate_size=96,
                       layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
    # convolution layers (gated short convolutions over each row's last 3 positions) between
    # attention layers with per-head q/k norms
    "Lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], block_auto_adjust_ff_dim=False),
    # LFM2's layers, a dense first one, sigmoid routers choosing with the block's expert bias
    "Lfm2Moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=48),
    # gated DeltaNets (a convolution over 4 positions, a recurrent state per value head) between
    # attention layers gated by q_proj's extra rows, RoPE on a quarter of each head
    "Qwen3_5Text": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                        linear_key_head_dim=16, linear_value_head_dim=24, linear_num_key_heads=2,
                        linear_num_value_heads=4),
    # LFM2's convolutions, sliding and full attention each with its own RoPE, sandwich norms,
    # a gate per attention head
    "Lfm3": dict(layer_types=["conv", "sliding_attention", "conv", "full_attention"], sliding_window=24),
    # DeltaNets (q, k, v projections of their own, beta up to 2) between OLMo 2's post-norm
    # attention layers, without RoPE as released
    "OlmoHybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": None}),
    "Qwen3_5MoeText": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                           shared_expert_intermediate_size=64),
    # Qwen3-Next: those layers with the DeltaNet's projections fused per key head
    "Qwen3Next": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=64),
    # Granite 4.0-H: Mamba2 mixers (a recurrent state per head, B and C per group of heads)
    # between attention layers without RoPE, Granite's multipliers, the dense shared MLP
    "GraniteMoeHybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=0,
                             shared_intermediate_size=96, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16,
                             embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=2.0),
    # Bamba: the same mixers between attention layers rotating half of each head
    "Bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16),
    # Nemotron-H: one block per layer (a Mamba2 mixer, attention without RoPE, a ReLU² MLP)
    "NemotronH": dict(layer_types=["linear_attention", "mlp", "full_attention", "moe"], mamba_num_heads=4,
                      mamba_head_dim=16, n_groups=2, ssm_state_size=16, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1),
    # Falcon-H1: a Mamba2 mixer and attention side by side in every layer, muP multipliers
    "FalconH1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, embedding_multiplier=3.0,
                     lm_head_multiplier=0.5, mlp_multipliers=[0.7, 1.3], key_multiplier=0.8,
                     attention_in_multiplier=0.9, attention_out_multiplier=1.1,
                     ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6], ssm_in_multiplier=1.2, ssm_out_multiplier=0.9),
    # Mamba2: no attention, a Mamba2 mixer per layer (num_heads set from the hidden size below)
    "Mamba2": dict(head_dim=32, n_groups=2, state_size=16),
    # the first Mamba (a state [I, N] per layer), and Falcon Mamba's (dt, B, C RMS-normed)
    "Mamba": dict(state_size=8),
    "FalconMamba": dict(state_size=8),
    # Jamba: those mixers (dt, B, C normed) between NoPE attention layers, MoE in every other layer
    "Jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8),
    # DeepSeek's latent attention (a query LoRA or not; values narrower or wider than q.k):
    # V3's interleaved RoPE and sigmoid routing in groups, V2's complex RoPE and group-limited
    # softmax routing, Youtu-LLM's dense layers, GLM-4.7-Flash's MoE with rotate_half
    "DeepseekV3": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                       n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5),
    "DeepseekV2": dict(q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=24,
                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                       n_group=4, topk_group=1, topk_method="group_limited_greedy", first_k_dense_replace=1),
    "Youtu": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "Glm4MoeLite": dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                        rope_interleave=False, mlp_layer_types=["dense", "sparse", "sparse"]),
    # Mistral 4: that attention below its query scaling, a grouped softmax router
    "Mistral4": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                     n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_group=4, topk_group=2, first_k_dense_replace=1,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                      "original_max_position_embeddings": 1024, "llama_4_scaling_beta": 0.1}),
    # A.X-K1: DeepSeek-V3's attention and MoE, the MoE blocks' output normed
    "AXK1": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                 n_group=2, topk_group=1, first_k_dense_replace=1),
    # MiniCPM3: that attention (rotate_half), scaled embedding rows and residual branches, the
    # final hidden state divided before the LM head
    "MiniCPM3": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     scale_emb=3.0, scale_depth=1.4, dim_model_base=16),
    # Hy3: q/k norms, MiniMax-M2's routing scaled, a shared MLP
    "HYV3": dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
                 router_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"]),
    # AFMoE: q/k norms, RoPE in the sliding layers only, the attention's output gated, sandwich
    # norms, muP's embedding scale; a dense layer, then sigmoid-routed experts with a bias
    "Afmoe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
                  num_dense_layers=1, route_scale=2.5, sliding_window=16, mup_enabled=True,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    # Kolibri-1: EXAONE 4's attention (windows, NoPE full layers), GLM-4's sandwich norms, MoE
    # chosen by logit + bias, weighted by sigmoid
    "Kolibri1": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                     sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                     "full_attention"]),
    # Llama 4: RoPE pairs in float32, L2 q/k norms after it, a NoPE layer; dense and MoE layers
    # (the top-1 expert's input scaled by its sigmoid weight, a shared expert)
    "Llama4Text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96,
                       interleave_moe_layer_step=2, no_rope_layer_interval=2),
}
# latent attention: every head its own keys and values (HF's fails otherwise)
LATENT_ARCHS = ("DeepseekV3", "DeepseekV2", "Youtu", "Glm4MoeLite", "MiniCPM3", "Mistral4", "AXK1")
MODEL_CLASSES = {"Gemma3Text": "Gemma3ForCausalLM", "Qwen3_5Text": "Qwen3_5ForCausalLM",
                 "Qwen3_5MoeText": "Qwen3_5MoeForCausalLM", "GPT2": "GPT2LMHeadModel",
                 "SarvamMoE": "Glm4MoeForCausalLM", "Llama4Text": "Llama4ForCausalLM"}
TIE = 1e-4  # HF top-2 logit gap below which fp32 outputs may part


@pytest.fixture(autouse=True)
def _measurement_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "selfspec_cache"))


def build(rng: random.Random, arch: str, dtype: torch.dtype):
    torch.manual_seed(rng.randrange(10**6))
    heads = rng.choice([4, 8])
    hidden = rng.choice([64, 96])
    config = dict(hidden_size=hidden, intermediate_size=rng.choice([128, 200]),
                  num_hidden_layers=4 if {"layer_types", "attention_types"} & set(ARCHS[arch]) else rng.choice([2, 3]),
                  num_attention_heads=heads,
                  num_key_value_heads=rng.choice([h for h in (1, 2, 4) if heads % h == 0]),
                  vocab_size=rng.choice([97, 300]), max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, **{"tie_word_embeddings": rng.random() < 0.5, **ARCHS[arch]})
    if arch in ("Qwen3", "Gemma", "Gemma2", "Gemma3Text", "Ministral", "SeedOss", "Glm", "Ernie4_5", "Qwen3Moe", "Glm4",
                "Apertus", "HunYuanDenseV1", "Helium", "VaultGemma", "Cwm", "Ministral3", "GptOss", "Glm4Moe", "Dots1",
                "SolarOpen", "ExaoneMoe", "HunYuanMoEV1", "Ernie4_5_Moe", "MiniMaxM2", "SarvamMoE", "Mellum",
                "Apertus1p5Text", "NanoChat", "Qwen3_5Text", "Qwen3_5MoeText", "Qwen3Next", "Lfm3", "NemotronH",
                "Llama4Text",
                "Kolibri1", "Afmoe", "HYV3"):
        config["head_dim"] = hidden // heads
    if arch in LATENT_ARCHS:
        config["num_key_value_heads"] = heads
    if arch in ("Glm4MoeLite", "HYV3"):  # its layer list sets the depth
        config["num_hidden_layers"] = 3
    if arch == "Mamba2":  # its heads fill the mixer's width, expand (2) x hidden
        config["num_heads"] = 2 * hidden // 32
    if arch == "Llama" and rng.random() < 0.3:
        config.update(attention_bias=True, mlp_bias=True)
    model_class = getattr(transformers, MODEL_CLASSES.get(arch, f"{arch}ForCausalLM"))
    model = model_class(getattr(transformers, f"{arch}Config")(**config))
    with torch.no_grad():  # sharp attention, random biases and norms: a wrong op changes tokens
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, Conv1D)):  # GPT-2's Conv1D: weight [in, out]
                sharp = 2.0 if name.endswith(("q_proj", "k_proj", "qkv_proj", "c_attn")) else 1.0
                fan_in = module.weight.shape[0 if isinstance(module, Conv1D) else 1]
                module.weight.normal_(0.0, sharp * fan_in**-0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.5)
        for name, p in model.named_parameters():
            if name.endswith(("wpe.weight", "embed_positions.weight")):  # positions, as strong as the tokens' rows
                p.normal_(0.0, 1.0)
            if "norm" in name or ".ln_" in name or "layer_norm" in name:  # Gemma's norms scale by 1 + w
                p.uniform_(-0.5, 0.5) if "Gemma" in arch else p.uniform_(0.5, 1.5)
            if p.dim() == 3 or name.endswith(("mlp.gate.weight", "mlp.router.weight", "gate.wg.weight",
                                              "feed_forward.gate.weight", "feed_forward.router.weight",
                                              "mixer.gate.weight", "router.gate.weight")):  # routers: decisive
                p.normal_(0.0, (1.0 if p.dim() == 3 else 4.0) * p.shape[-1] ** -0.5)
            if name.endswith(("_proj_bias", "router.bias")):  # GPT-OSS's experts' and router's biases
                p.normal_(0.0, 0.5)
            if name.endswith("sinks"):  # GPT-OSS's attention sinks
                p.normal_(0.0, 2.0)
            if name.endswith(("conv.conv.weight", "conv1d.weight")):  # LFM2's, Qwen 3.5's taps [C, 1, K]
                p.normal_(0.0, p.shape[-1] ** -0.5)
            if name.endswith(("mamba.dt_bias", "mamba.D")):  # Mamba2's steps and skips (HF: ones)
                p.normal_(0.0, 1.0)
            # ERNIE 4.5's, AFMoE's routing
            if name.endswith(("moe_statics.e_score_correction_bias", "mlp.expert_bias")):
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # DeepSeek-V3's, LFM2-MoE's routing
                b.normal_(0.0, 0.2)
    return model.to(dtype).eval(), config


def trim(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def top2_gap(model, sequence: list[int]) -> float:
    with torch.no_grad():
        top = model(torch.tensor([sequence])).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("seed", range(len(ARCHS)))  # each architecture once
def test_random_off_path_case(seed):
    rng = random.Random(seed)
    arch = list(ARCHS)[seed % len(ARCHS)]
    dtype = rng.choices([torch.float32, torch.bfloat16, torch.float16], [4, 1, 1])[0]
    model, config = build(rng, arch, dtype)
    vocab = config["vocab_size"]
    lengths = [rng.choice([1, 5, 17, 90, 300]) for _ in range(rng.choice([1, 2, 3]))]
    rows = []
    for n in lengths:  # repetitive prompts, so prompt lookup drafts
        motif = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 8))]
        rows.append([motif[i % len(motif)] if rng.random() < 0.7 else rng.randrange(3, vocab) for i in range(n)])
    kw = dict(max_new_tokens=rng.choice([3, 16, 32]), do_sample=False)
    eos = [2]
    if rng.random() < 0.3:  # a token the LM head can give (Apertus 1.5's is pruned to fewer ids)
        eos = [2, rng.randrange(3, model.lm_head.out_features)]
        kw["eos_token_id"] = eos
    if dtype == torch.float32:
        kw.update(rng.choice([{}, {}, dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=3),
                              dict(min_new_tokens=3), dict(do_sample=True, top_k=1, temperature=0.7)]))
    kind = rng.choice(["none", "exit", "top"])
    heads = {"none": lambda: False,
             "exit": lambda: random_heads(model, sorted({1, config["num_hidden_layers"] - 1}), seed=seed).to(dtype),
             "top": lambda: random_top_heads(model, depth=rng.choice([1, 2, 3]), seed=seed).to(dtype)}[kind]()
    decode = DecodeConfig(thresholds=rng.choice([0.0, 0.3, 0.9]),
                          lookup=rng.choice(["first", "off", "only"]) if kind != "none" else "first")
    attach_heads(model, heads=heads, decode=decode, engine=EngineConfig(prefill=rng.choice(["hf", "engine"]),
                                                                   row_layout=rng.choice(["auto", "fixed"])))
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(rows):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=mask, pad_token_id=0, assistant="self", **kw)
    got = [trim(row[width:].tolist(), eos) for row in out]
    case = f"{arch} {dtype} lengths {lengths} {kw} heads {kind} {decode.lookup}"

    kw.update(do_sample=False)
    kw.pop("top_k", None), kw.pop("temperature", None)
    if dtype != torch.float32:
        engine = model._selfspec.engine
        assert got == [engine.generate_ar(p, kw["max_new_tokens"], eos_token_ids=eos) for p in rows], case
        return
    if len(rows) > 1 and ("repetition_penalty" in kw or "no_repeat_ngram_size" in kw):
        batched = model.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
        want = [trim(row[width:].tolist(), eos) for row in batched]
    else:
        want = [trim(model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    pad_token_id=0, **kw)[0, len(p):].tolist(), eos) for p in rows]
    for p, g, w in zip(rows, got, want):
        if g != w:
            at = next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
            assert top2_gap(model, p + w[:at]) < TIE, f"{case}: parts from HF at new token {at}"
