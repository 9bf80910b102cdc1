"""Llama and the models shaped like it: RMSNorms on the blocks' inputs, q/k/v/o projections,
a gated SiLU MLP, RoPE turning halves. Mistral, Ministral (3), Qwen2, Qwen3 (q/k norms),
SmolLM3 (layers without RoPE), Phi-3 (fused q/k/v and gate/up projections read as row
ranges; partial rotary), EXAONE 3 / 4 (EXAONE 4: full-attention layers unrotated where the
model slides), InternLM 3, Seed-OSS, IQuest-Coder, CWM; OLMo 2 / 3 (norms on the blocks'
outputs); HunYuan (q/k norms after RoPE); Arcee and Apertus (a plain MLP)."""

from __future__ import annotations

from .spec import Family, ModelType


def llama4_scaling_positions(config) -> int | None:
    """Where Ministral 3 and Mistral 4 start scaling their queries by position (Llama 4's
    attention temperature, 1 + beta * log(1 + floor(p / original_max_position_embeddings)),
    after RoPE): below original_max_position_embeddings the factor is exactly 1; None where
    beta is 0."""
    params = getattr(config, "rope_parameters", None) or {}
    if not params.get("llama_4_scaling_beta"):
        return None
    return int(params["original_max_position_embeddings"])

FAMILY = Family("llama", "Llama's layers (RMSNorm, q/k/v/o, gated MLP, RoPE of halves)", (
    ModelType("llama"),
    ModelType("mistral"),
    ModelType("ministral"),
    ModelType("ministral3", query_scaling=llama4_scaling_positions),
    ModelType("qwen2"),
    ModelType("qwen3"),
    ModelType("smollm3"),
    ModelType("phi3"),
    ModelType("exaone"),
    ModelType("exaone4", rotated_layers="sliding_or_no_window"),
    ModelType("internlm3"),
    ModelType("seed_oss"),
    ModelType("iquestcoder"),
    ModelType("cwm"),
    ModelType("olmo2"),
    ModelType("olmo3"),
    ModelType("hunyuan_v1_dense", qk_norm_after_rope=True),
    ModelType("arcee", plain_mlp=True),
    ModelType("apertus", plain_mlp=True),
    ModelType("apertus1p5_text", plain_mlp=True),
))
