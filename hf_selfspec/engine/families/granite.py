"""Granite and its kin: Llama's layers with four multipliers (the embedding rows scaled,
attention scores scaled by attention_multiplier, each block's output joining the residual
stream scaled, the logits divided): Granite, HyperCLOVAX (its logits multiplied by
logits_scaling; Peri-LN output norms), Granite-SWA (attention sinks, a RoPE base per layer)
and the Granite MoEs (the softmax of the float32 top-k logits; GraniteMoeShared's shared MLP).
Granite 4.0-H, a Mamba hybrid, is mamba.py's."""

from __future__ import annotations

from .spec import Family, ModelType


def granite_multipliers(config) -> dict:
    return {"embedding_multiplier": float(config.embedding_multiplier),
                "residual_multiplier": float(config.residual_multiplier),
                "logits_scaling": float(config.logits_scaling)}


def granite_scaling(config, scaling: float) -> float:
    return float(config.attention_multiplier)


def _hyperclovax_multipliers(config) -> dict:
    """Granite's, its logits multiplied by logits_scaling (not divided)."""
    return {"embedding_multiplier": float(config.embedding_multiplier),
                "residual_multiplier": float(config.residual_multiplier), "logit_scale": float(config.logits_scaling)}


_granite = {"multipliers": granite_multipliers, "scaling": granite_scaling}
# Granite-SWA: attention sinks, a RoPE base per layer (0: NoPE), one rotary module per base
_swa = {"attention_sinks": True, "rope_per_layer_theta": True, "rotated_layers": "layer_theta"}

FAMILY = Family("granite", "Llama's layers with Granite's four multipliers", (
    ModelType("granite", **_granite),
    ModelType("hyperclovax", multipliers=_hyperclovax_multipliers, scaling=granite_scaling),
    ModelType("granite_swa", **_granite, **_swa),
    ModelType("granitemoe", **_granite, moe="granite"),
    ModelType("granitemoeshared", **_granite, moe="granite"),
    ModelType("granitemoe_swa", **_granite, **_swa, moe="granite"),
))
