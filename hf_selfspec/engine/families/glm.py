"""Llama's layers with RoPE turning adjacent pairs of a head's dimensions, not its two halves
(their rotary modules give the halves' tables, interleaved as their apply_rotary_pos_emb
does): GLM, GLM-4 (its blocks' output norms), ERNIE 4.5 and Helium (its RMSNorm's scale in
float32)."""

from __future__ import annotations

from .spec import Family, ModelType

_pairs = {"rope_pairs": True, "rope_half_tables": True}

FAMILY = Family("glm", "Llama's layers, RoPE turning adjacent pairs", (
    ModelType("glm", **_pairs),
    ModelType("glm4", **_pairs),
    ModelType("ernie4_5", **_pairs),
    ModelType("helium", **_pairs, norm_scale_in_float32=True),
))
