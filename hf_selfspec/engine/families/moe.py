"""Sparse MoE models with attention layers of Llama's kind (MoEWeights; their routers'
forms in moe_forms.py): Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo, Mixtral, HunYuan-MoE, PhiMoE's
sparsemixer, GPT-OSS (attention sinks, experts stored [in, out]), DeepSeek-V3's sigmoid
routing (GLM-4.5, dots.llm1, Solar Open, K-EXAONE, Sarvam), MiniMax-M2, Hy3, ERNIE 4.5 MoE,
Llama 4 (RoPE in complex pairs, q/k L2 norms after it), Kolibri-1, AFMoE, Mellum. The Granite
MoEs are granite.py's, the latent-attention MoEs latent.py's, the hybrids' MoEs theirs."""

from __future__ import annotations

from ..errors import UnsupportedModelError
from .spec import Family, ModelType


def olmo_clip_qkv(config):
    """OLMo clamps q, k and v to [-clip_qkv, clip_qkv] after their products."""
    return getattr(config, "clip_qkv", None)


def _check_mellum(config) -> None:
    if any((params or {}).get("partial_rotary_factor", 1.0) != 1.0
           for params in (getattr(config, "rope_parameters", None) or {}).values()):
        raise UnsupportedModelError(
            "partial_rotary_factor below 1 (mellum): HF's Mellum attention rotates whole heads and "
            "cannot run these tables; the engine does not guess: use a full rotary configuration")


def _llama4_limits(config) -> int | None:
    """Llama 4's NoPE layers' queries times 1 + attn_scale * log1p(floor((p + 1) /
    floor_scale)), exactly 1 while p + 1 < floor_scale; its chunked layers attend within
    chunks of attention_chunk_size positions, all one chunk (causal attention) below it."""
    limits = []
    if config.attn_temperature_tuning and not all(config.no_rope_layers):
        limits.append(int(config.floor_scale) - 1)
    if config.attention_chunk_size and "chunked_attention" in (config.layer_types or ()):
        limits.append(int(config.attention_chunk_size))
    return min(limits, default=None)


def _afmoe_multipliers(config) -> dict:
    """muP: the embedding rows times sqrt(hidden)."""
    return {"embedding_multiplier": config.hidden_size**0.5} if config.mup_enabled else {}


FAMILY = Family("moe", "sparse MoE blocks after Llama-like attention", (
    ModelType("qwen3_moe", moe="softmax"),
    ModelType("olmoe", moe="softmax", clip_qkv=olmo_clip_qkv),
    ModelType("mixtral", moe="mixtral"),
    ModelType("qwen2_moe", moe="softmax"),
    ModelType("flex_olmo", moe="softmax"),
    ModelType("gpt_oss", moe="gpt_oss", attention_sinks=True, rope_half_width=True, norm_scale_in_float32=True),
    ModelType("glm4_moe", moe="sigmoid_grouped"),
    ModelType("dots1", moe="sigmoid_grouped"),
    ModelType("solar_open", moe="sigmoid_grouped"),
    ModelType("exaone_moe", moe="sigmoid_grouped", rotated_layers="sliding_or_no_window"),
    ModelType("sarvam_moe", moe="sigmoid_grouped"),
    ModelType("hunyuan_v1_moe", moe="hunyuan", qk_norm_after_rope=True),
    ModelType("ernie4_5_moe", moe="ernie", rope_pairs=True, rope_half_tables=True),
    ModelType("minimax_m2", moe="minimax"),
    ModelType("hy_v3", moe="hy_v3"),
    ModelType("phimoe", moe="phimoe", layer_norm=True),
    ModelType("mellum", moe="softmax", check_config=_check_mellum),
    ModelType("llama4_text", moe="llama4", rope_pairs=True, qk_norm_after_rope=True, rope_complex_pairs=True,
              rope_float32=True, query_scaling=_llama4_limits),
    ModelType("kolibri1", moe="kolibri1", rotated_layers="sliding_or_no_window"),
    ModelType("afmoe", moe="afmoe", rotated_layers="local", out_gate=True, multipliers=_afmoe_multipliers),
))
