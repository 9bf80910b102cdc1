"""LFM2 and its kin: hybrids whose other layers are gated short convolutions
(ShortConvWeights; their maths in mixers.py): LFM2, LFM2-MoE (its sigmoid router with an
expert bias) and LFM3 (a sigmoid gate per attention head, `g_proj`)."""

from __future__ import annotations

from ..checks import _check_short_conv
from ..modules import _attention
from ..weights import ShortConvWeights
from .spec import Family, Mixer, ModelType


def _projections(layer):
    return "conv.", getattr(layer, "conv", None), ("in_proj", "out_proj")


def _check(i: int, layer, config) -> list:
    if _attention(layer) is None:
        _check_short_conv(f"model.layers.{i}.conv.conv", getattr(getattr(layer, "conv", None), "conv", None),
                          config.hidden_size)
    return []


def _build(layer, view) -> dict:
    block = layer.conv
    return {"conv": ShortConvWeights(block.in_proj, block.conv.weight[:, 0], block.conv.bias, block.out_proj)}


SHORT_CONV = Mixer("short_conv", _projections, _check, _build)

FAMILY = Family("short_conv", "gated short convolutions between attention layers (LFM2)", (
    ModelType("lfm2", mixer=SHORT_CONV, eps_attribute="norm_eps"),
    ModelType("lfm2_moe", mixer=SHORT_CONV, eps_attribute="norm_eps", moe="lfm2"),
    ModelType("lfm3", mixer=SHORT_CONV, eps_attribute="norm_eps", head_gate=True),
))
