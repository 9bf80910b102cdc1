"""Hybrids whose other layers are gated DeltaNets (GatedDeltaNetWeights; their maths in
mixers.py): Qwen 3.5 (and its MoE; attention gating its output by a sigmoid of more rows of
q_proj, norms by 1 + w; its image-text classes served for their text), Qwen3-Next (two fused
projections holding per key head its q, k, v, z rows and its b, a rows) and OLMo Hybrid."""

from __future__ import annotations

import torch

from ..checks import SILU_NAMES, _check_short_conv
from ..errors import UnsupportedModelError
from ..modules import _attention
from ..weights import FLOAT_DTYPES, GatedDeltaNetWeights
from .spec import Family, Mixer, ModelType

# the DeltaNet's projections, as each family names them: q/k/v (one weight, or three), z
# (the output gate), b (beta), a (the decay), the output; Qwen3-Next's two fused ones hold
# per key head its q, k, v and z rows, and its b and a rows (GatedDeltaNetWeights.grouped)
QWEN3_5_PROJECTIONS = (("in_proj_qkv",), "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
OLMO_HYBRID_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), "g_proj", "b_proj", "a_proj", "o_proj")
QWEN3_NEXT_PROJECTIONS = (("in_proj_qkvz",), None, "in_proj_ba", None, "out_proj")


def _check_delta_net(name: str, block) -> None:
    """Qwen 3.5's (OLMo Hybrid's) gated DeltaNet as GatedDeltaNetWeights reads it: a plain
    depthwise Conv1d without bias over the q/k/v channels, SiLU, float dt_bias / A_log [Hv],
    a gated RMSNorm [dv] (`norm`, OLMo Hybrid's `o_norm`), value heads a multiple of the key
    heads."""
    norm = getattr(block, "norm", None) or getattr(block, "o_norm", None)
    if block is None or norm is None or not all(hasattr(block, a) for a in (
            "conv1d", "dt_bias", "A_log", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")):
        raise UnsupportedModelError(f"{name} is not a gated DeltaNet the engine knows; use plain model.generate()")
    conv = block.conv1d
    _check_short_conv(f"{name}.conv1d", conv, 2 * block.num_k_heads * block.head_k_dim
                      + block.num_v_heads * block.head_v_dim)
    params = (block.dt_bias, block.A_log, getattr(norm, "weight", None))
    if conv.bias is not None or getattr(block, "activation", None) not in SILU_NAMES \
            or block.num_v_heads % block.num_k_heads \
            or any(not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES for p in params) \
            or norm.weight.shape != (block.head_v_dim,):
        raise UnsupportedModelError(
            f"{name}: the engine runs Qwen 3.5's gated DeltaNet with a SiLU convolution without bias, float "
            "dt_bias / A_log and a gated RMSNorm per value head only; use plain model.generate()")


def delta_net(projections: tuple) -> Mixer:
    """The DeltaNet mixer whose projections are named `projections` (q/k/v, z, b, a, out)."""
    qkv_names, z, b, a, out = projections
    names = (*qkv_names, *(name for name in (z, b, a, out) if name is not None))

    def project(layer):
        return "linear_attn.", getattr(layer, "linear_attn", None), names

    def check(i: int, layer, config) -> list:
        if _attention(layer) is None:
            _check_delta_net(f"model.layers.{i}.linear_attn", getattr(layer, "linear_attn", None))
        return []

    def build(layer, view) -> dict:
        block = layer.linear_attn
        gated_norm = block.norm if hasattr(block, "norm") else block.o_norm
        return {"delta": GatedDeltaNetWeights(
            tuple(getattr(block, n) for n in qkv_names), z and getattr(block, z), getattr(block, b),
            a and getattr(block, a),
            block.conv1d.weight[:, 0], block.dt_bias, block.A_log, gated_norm.weight,
            float(gated_norm.variance_epsilon), getattr(block, out), int(block.num_k_heads), int(block.num_v_heads),
            int(block.head_k_dim), int(block.head_v_dim), 2.0 if getattr(block, "allow_neg_eigval", False) else 1.0,
            grouped=z is None)}

    return Mixer("delta_net", project, check, build)


QWEN3_5 = delta_net(QWEN3_5_PROJECTIONS)
# Qwen 3.5: gated attention, norms by 1 + w
_qwen3_5 = {"mixer": QWEN3_5, "gated_attention": True, "norm_plus_one": True}

FAMILY = Family("delta_net", "gated DeltaNets between attention layers (Qwen 3.5, Qwen3-Next, OLMo Hybrid)", (
    ModelType("qwen3_5_text", **_qwen3_5),
    ModelType("qwen3_5", **_qwen3_5, image_text_decoder="language_model"),
    ModelType("qwen3_5_moe_text", **_qwen3_5, moe="softmax"),
    ModelType("qwen3_5_moe", **_qwen3_5, moe="softmax", image_text_decoder="language_model"),
    ModelType("qwen3_next", mixer=delta_net(QWEN3_NEXT_PROJECTIONS), gated_attention=True, norm_plus_one=True,
              moe="softmax"),
    ModelType("olmo_hybrid", mixer=delta_net(OLMO_HYBRID_PROJECTIONS)),
))
