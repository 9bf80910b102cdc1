"""GPT-2 and the models with learned absolute positions (OPT, GPT-Neo, GPT-BigCode: the
position's row added to the token's before the first layer, no RoPE) and the ALiBi models
(Bloom, MPT: a per-head slope times the key's position on the scores; Bloom norms its
embedding rows). LayerNorms, plain MLPs, MHA (GPT-BigCode: or one KV head); GPT-2's
projections are transformers' Conv1D, read transposed in place."""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from .spec import Family, ModelType


def _wpe(inner) -> torch.Tensor:
    return inner.wpe.weight


def _opt_positions(inner) -> torch.Tensor:
    """OPT's embed_positions from its row `offset` (2): a view."""
    return inner.embed_positions.weight[inner.embed_positions.offset:]


def _gpt2_scaling(config, scaling: float) -> float:
    return scaling if config.scale_attn_weights else 1.0


def _unscaled(config, scaling: float) -> float:
    """GPT-Neo never scales its attention scores."""
    return 1.0


def _mpt_scaling(config, scaling: float) -> float:
    """Its attention config's scale."""
    return config.attn_config.softmax_scale or scaling


def _mpt_clip_qkv(config):
    """A clip of 0 (falsy) clamps nothing in HF's MPT."""
    return config.attn_config.clip_qkv or None


def _bigcode_kv_heads(config, kv_heads: int) -> int:
    """One KV head where multi_query (StarCoder)."""
    return 1 if config.multi_query else kv_heads


def _bloom_slopes(config) -> torch.Tensor:
    """ALiBi's slope per head [Hq], float32, from HF's own build_alibi_tensor at key position 1."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), config.num_attention_heads, torch.float32)
    return alibi[:, 0, 1].contiguous()


def _mpt_slopes(config) -> torch.Tensor:
    """MPT's build_mpt_alibi_tensor (keys relative to the last one: the softmax is the same for
    any shift) as the step between two keys."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    alibi = build_mpt_alibi_tensor(config.num_attention_heads, 2).float()  # [H, 1, 2]
    return (alibi[:, 0, 1] - alibi[:, 0, 0]).contiguous()


def _gpt_neo_window(config) -> int | None:
    """Its "local" layers' window_size."""
    return config.window_size if "local" in config.attention_layers else None


def _check_gpt2(config) -> None:
    if config.scale_attn_by_inverse_layer_idx:
        raise UnsupportedModelError(
            "scale_attn_by_inverse_layer_idx=True (gpt2): the engine scales every layer's "
            "attention alike; use plain model.generate() for this model")


def _check_opt(config) -> None:
    if not config.do_layer_norm_before or config._remove_final_layer_norm \
            or config.word_embed_proj_dim != config.hidden_size:
        raise UnsupportedModelError(
            "this OPT model norms after its blocks (do_layer_norm_before=False) or projects its "
            "embeddings (word_embed_proj_dim != hidden_size), as OPT-350m does; the engine runs "
            "the other OPT models only: use plain model.generate() for this one")


def _check_bloom(config) -> None:
    if config.apply_residual_connection_post_layernorm or (config.pretraining_tp > 1 and config.slow_but_exact):
        raise UnsupportedModelError(
            "this Bloom model adds its blocks to the normed stream "
            "(apply_residual_connection_post_layernorm=True) or sums its products in "
            "pretraining_tp slices (slow_but_exact=True); use plain model.generate() for it")


_base = {"layer_norm": True, "plain_mlp": True, "mha_only": True, "decoder_attribute": "transformer"}
_learned = dict(_base, positions="learned", position_embedding=_wpe, token_type_embeddings=True)

FAMILY = Family("gpt2", "learned absolute positions or ALiBi; LayerNorms, plain MLPs", (
    ModelType("gpt2", **_learned, conv1d=True, scaling=_gpt2_scaling, check_config=_check_gpt2),
    ModelType("opt", **{**_base, "decoder_attribute": "model.decoder"}, positions="learned",
              position_embedding=_opt_positions, check_config=_check_opt),
    ModelType("gpt_neo", **_learned, scaling=_unscaled, window=_gpt_neo_window),
    ModelType("gpt_bigcode", **_learned, scaling=_gpt2_scaling, kv_heads=_bigcode_kv_heads),
    ModelType("bloom", **_base, positions="alibi", alibi_slopes=_bloom_slopes, check_config=_check_bloom),
    ModelType("mpt", **_base, positions="alibi", alibi_slopes=_mpt_slopes, scaling=_mpt_scaling,
              clip_qkv=_mpt_clip_qkv),
))
