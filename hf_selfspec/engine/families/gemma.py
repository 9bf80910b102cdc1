"""Gemma 1-3 and VaultGemma: RMSNorms scaling by 1 + w (in float32), GELU-gated MLPs (tanh
approximation), scaled embeddings; Gemma 2 and 3 (and VaultGemma, Gemma 2 without the blocks'
output norms) norm both sides of each block, scale queries by query_pre_attn_scalar and
soft-cap attention scores and logits (Gemma 3's caps None, a RoPE per layer type); Gemma 3's
image-text class is served for its text decoder."""

from __future__ import annotations

from .spec import Family, ModelType


def _query_pre_attn_scaling(config, scaling: float) -> float:
    return float(config.query_pre_attn_scalar) ** -0.5


_later = {"norm_plus_one": True, "gemma_later": True, "logits_softcap": True, "scaling": _query_pre_attn_scaling}

FAMILY = Family("gemma", "Gemma's norms by 1 + w, GELU-gated MLPs, soft caps", (
    ModelType("gemma", norm_plus_one=True),
    ModelType("gemma2", **_later),
    ModelType("gemma3_text", **_later),
    # the image-text class: its text config is gemma3_text's
    ModelType("gemma3", image_text_decoder="language_model"),
    ModelType("vaultgemma", **_later),
))
