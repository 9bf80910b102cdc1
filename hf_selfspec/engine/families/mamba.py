"""Hybrids whose other layers are Mamba mixers, and the Mambas themselves (their maths in
mixers.py): Mamba2 mixers (Mamba2Weights) in Granite 4.0-H, Bamba, Nemotron-H (layers of ONE
block each: a Mamba2 mixer, attention, an MLP or an MoE block), Falcon-H1 (a Mamba2 mixer
beside the attention in every layer, muP multipliers) and Mamba2; the first Mamba's mixer
(Mamba1Weights) in Mamba, Falcon Mamba and Jamba (between its attention layers)."""

from __future__ import annotations

import functools

import torch

from ..checks import SILU_NAMES, _check_plain_linear, _check_short_conv
from ..errors import UnsupportedModelError
from ..modules import _attention, _mamba1_block, _mamba1_path, _mamba2_block, _one_block
from ..weights import FLOAT_DTYPES, Mamba1Weights, Mamba2Weights, MatrixView
from .granite import granite_multipliers, granite_scaling
from .spec import Family, Mixer, ModelType


def _check_mamba1(name: str, block) -> None:
    """The first Mamba's mixer as Mamba1Weights reads it: a plain depthwise Conv1d over x,
    SiLU, float A_log [I, N] and D [I], dt_proj with its bias."""
    names = ("conv1d", "A_log", "D", "x_proj", "dt_proj", "in_proj", "out_proj", "time_step_rank", "ssm_state_size",
             "intermediate_size")
    if block is None or not all(hasattr(block, a) for a in names):
        raise UnsupportedModelError(f"{name} is not a Mamba mixer the engine knows; use plain model.generate()")
    inner, n = block.intermediate_size, block.ssm_state_size
    _check_short_conv(f"{name}.conv1d", block.conv1d, inner)
    _check_plain_linear(f"{name}.dt_proj", block.dt_proj)  # (a wrapped one named before its bias is read)
    params = (block.A_log, block.D, getattr(block.dt_proj, "bias", None))
    if getattr(block, "activation", None) not in SILU_NAMES \
            or any(not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES for p in params) \
            or block.A_log.shape != (inner, n) or block.D.shape != (inner,):
        raise UnsupportedModelError(
            f"{name}: the engine runs Mamba mixers with a SiLU convolution, float A_log [I, N] and D [I] and a "
            "dt_proj with its bias only; use plain model.generate()")


def _check_mamba2(name: str, block) -> None:
    """A Mamba2 mixer as Mamba2Weights reads it: a plain depthwise Conv1d over x, B and C,
    SiLU, float dt_bias / A_log / D [heads], a gated RMSNorm over the heads' channels in
    whole groups, heads a multiple of the groups."""
    names = ("conv1d", "dt_bias", "A_log", "D", "norm", "num_heads", "head_dim", "ssm_state_size", "n_groups",
             "intermediate_size")
    if block is None or not all(hasattr(block, a) for a in names):
        raise UnsupportedModelError(f"{name} is not a Mamba2 mixer the engine knows; use plain model.generate()")
    inner = block.num_heads * block.head_dim
    _check_short_conv(f"{name}.conv1d", block.conv1d, inner + 2 * block.n_groups * block.ssm_state_size)
    norm_weight = getattr(block.norm, "weight", None)
    group = getattr(block.norm, "group_size", None)
    if isinstance(getattr(block.norm, "n_groups", None), int) and block.norm.n_groups > 0:  # Falcon-H1's
        group = inner // block.norm.n_groups if inner % block.norm.n_groups == 0 else None
    unnormed = type(block.norm) is torch.nn.Identity and getattr(block, "mamba_rms_norm", None) is False
    params = (block.dt_bias, block.A_log, block.D) + (() if unnormed else (norm_weight,))
    if getattr(block, "activation", None) not in SILU_NAMES or block.num_heads % block.n_groups \
            or inner != block.intermediate_size \
            or any(not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES for p in params) \
            or not unnormed and (norm_weight.shape != (inner,) or not isinstance(group, int) or group <= 0
                                 or inner % group):
        raise UnsupportedModelError(
            f"{name}: the engine runs Mamba2 mixers with a SiLU convolution, float dt_bias / A_log / D, heads in "
            "whole groups and a gated RMSNorm over whole groups only; use plain model.generate()")


def _mamba2(block, config, falcon: bool = False) -> Mamba2Weights:
    """A Mamba2 mixer's Mamba2Weights (`falcon`: Falcon-H1's, its norm optional, its muP scales)."""
    norm = block.norm if isinstance(getattr(block.norm, "weight", None), torch.Tensor) else None
    inner = int(block.num_heads) * int(block.head_dim)
    group = (inner // int(block.norm.n_groups) if falcon and norm is not None
             else int(getattr(norm, "group_size", inner)))
    mup = getattr(block, "mup_vector", None) if falcon else None
    return Mamba2Weights(
        block.in_proj, block.conv1d.weight[:, 0], block.conv1d.bias, block.dt_bias, block.A_log, block.D,
        None if norm is None else norm.weight, float(getattr(norm, "variance_epsilon", 0.0)), group,
        block.out_proj, int(block.num_heads), int(block.head_dim), int(block.ssm_state_size), int(block.n_groups),
        tuple(float(b) for b in (block.time_step_limit or (0.0, float("inf")))),
        norm_in_float32=falcon, norm_before_gate=falcon and norm is not None and bool(norm.norm_before_gate),
        in_scale=float(block.ssm_in_multiplier) if falcon else 1.0,
        projection_scale=None if mup is None else mup.view(-1),
        out_scale=float(config.ssm_out_multiplier) if falcon else 1.0)


def _mamba2_projections(layer):
    if _one_block(layer) in ("mlp", "moe"):  # a Nemotron-H layer without a token mixer
        return "", None, ()
    return ("mixer." if _one_block(layer) else "mamba."), _mamba2_block(layer), ("in_proj", "out_proj")


def _mamba2_check(i: int, layer, config, beside: bool = False) -> list:
    if _mamba2_block(layer) is None:
        return []
    name = f"model.layers.{i}.{'mixer' if _one_block(layer) else 'mamba'}"
    _check_mamba2(name, _mamba2_block(layer))
    if beside:  # beside the attention: its projections too
        return [(f"{name}.{n}", getattr(_mamba2_block(layer), n, None)) for n in ("in_proj", "out_proj")]
    return []


def _mamba2_build(layer, view, falcon: bool = False) -> dict:
    return {"mamba": _mamba2(_mamba2_block(layer), view.config, falcon)}


def _falcon_h1_beside(layer, view) -> dict:
    return {"mamba": _mamba2(layer.mamba, view.config, falcon=True)}


def _mamba1_projections(layer):
    if _one_block(layer) in ("mlp", "moe"):
        return "", None, ()
    return _mamba1_path(layer), _mamba1_block(layer), ("in_proj", "x_proj", "dt_proj", "out_proj")


def _mamba1_check(i: int, layer, config) -> list:
    if _attention(layer) is None:
        _check_mamba1(f"model.layers.{i}.{_mamba1_path(layer)[:-1]}", _mamba1_block(layer))
    return []


def _mamba1_build(layer, view, normed: bool = False) -> dict:
    """Mamba, Falcon Mamba, Jamba (`normed`: dt, B and C normed by the mixer's own modules)."""
    block = _mamba1_block(layer)
    norms = (block.dt_layernorm, block.b_layernorm, block.c_layernorm) if normed else None
    return {"mamba1": Mamba1Weights(
        block.in_proj, block.conv1d.weight[:, 0], block.conv1d.bias, block.x_proj,
        MatrixView(block.dt_proj.weight), block.dt_proj.bias, block.A_log, block.D, block.out_proj,
        int(block.time_step_rank), int(block.ssm_state_size), norms)}


def _falcon_h1_multipliers(config) -> dict:
    """Falcon-H1's muP: the embedding rows, the logits, the attention's input, its k
    projection and its output, the MLP's gate product (before the activation) and output."""
    gate, down = (float(m) for m in config.mlp_multipliers)
    return {"embedding_multiplier": float(config.embedding_multiplier),
                "logit_scale": float(config.lm_head_multiplier),
                "attention_in_multiplier": float(config.attention_in_multiplier),
                "key_multiplier": float(config.key_multiplier),
                "attention_out_multiplier": float(config.attention_out_multiplier),
                "mlp_gate_multiplier": gate, "mlp_down_multiplier": down}


MAMBA2 = Mixer("mamba2", _mamba2_projections, _mamba2_check, _mamba2_build)
FALCON_H1 = Mixer("mamba2", _mamba2_projections, functools.partial(_mamba2_check, beside=True),
                  functools.partial(_mamba2_build, falcon=True), build_beside=_falcon_h1_beside)
MAMBA1 = Mixer("mamba1", _mamba1_projections, _mamba1_check, _mamba1_build)
MAMBA1_NORMED = Mixer("mamba1", _mamba1_projections, _mamba1_check, functools.partial(_mamba1_build, normed=True))
# the attention-free Mambas: layers of one mixer each, no positions, the backbone's stack
_mamba = {"one_block_layers": True, "attention_free": True, "positions": "none", "eps_attribute": "layer_norm_epsilon",
              "decoder_attribute": "backbone"}

FAMILY = Family("mamba", "Mamba mixers, alone or between attention layers (Granite 4.0-H, Nemotron-H, Jamba)", (
    ModelType("granitemoehybrid", mixer=MAMBA2, moe="granite", multipliers=granite_multipliers,
              scaling=granite_scaling),
    ModelType("bamba", mixer=MAMBA2),
    ModelType("nemotron_h", mixer=MAMBA2, one_block_layers=True, positions="none", moe="nemotron_h",
              eps_attribute="layer_norm_epsilon", norm_scale_in_float32=True),
    ModelType("falcon_h1", mixer=FALCON_H1, multipliers=_falcon_h1_multipliers),
    ModelType("mamba2", mixer=MAMBA2, **_mamba),
    ModelType("mamba", mixer=MAMBA1, **_mamba),
    ModelType("falcon_mamba", mixer=MAMBA1_NORMED, **_mamba),
    ModelType("jamba", mixer=MAMBA1_NORMED, positions="none", moe="jamba"),
))
