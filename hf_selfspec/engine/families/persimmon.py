"""Persimmon (Adept's Persimmon-8B): GPT-NeoX's attention, its q/k/v fused per head with
biases, under LayerNorms with biases, its blocks one after the other. What sets it apart
from the layernorm family's GPT-NeoX: one LayerNorm over a head's width for all query heads
and one for all key heads (`qk_layernorm`, q_layernorm / k_layernorm), applied to each head
before RoPE, which turns the first `partial_rotary_factor` of each head (HF's rotary module
gives tables that narrow: rope.apply_rope leaves the rest); a plain MLP of HF's ReLU²
(dense_h_to_4h / dense_4h_to_h, called as HF's activation module); `final_layernorm` and an
untied LM head, both found by name."""

from __future__ import annotations

from .spec import Family, ModelType

FAMILY = Family("persimmon", "GPT-NeoX's fused attention with q/k LayerNorms, sequential blocks, a ReLU² MLP", (
    # mha_only: its config carries no KV head count of its own (one given to it is not read)
    ModelType("persimmon", layer_norm=True, plain_mlp=True, mha_only=True),
))
