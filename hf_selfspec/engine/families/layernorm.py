"""The LayerNorm families: their norm modules (mean subtracted; with weight and bias, weight
only (Cohere) or neither (OLMo)) called as HF calls them, their layers run as PyTorch ops
around the engine's products. StableLM, OLMo 1 (q/k/v clamped), Phi, StarCoder 2, Nemotron,
Jais 2, NanoChat (q/k norms after RoPE, a soft cap on the logits), Cohere and Cohere 2 (RoPE
turning adjacent pairs, logits scaled; Cohere 2 rotates its sliding layers only; its MoE),
GPT-NeoX, GPT-J and CodeGen (their q/k/v fused) and Falcon: many with parallel blocks (the
attention and the MLP of one input). GPT-2 and the ALiBi models are gpt2.py's."""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..weights import RowSlice
from .moe import olmo_clip_qkv
from .spec import Family, ModelType


def _shared(config) -> str:
    return "shared"


def _stablelm_parallel(config) -> str | None:
    return "shared" if config.use_parallel_residual else None


def _gpt_neox_parallel(config) -> str | None:
    return "two" if config.use_parallel_residual else None


def _falcon_parallel(config) -> str | None:
    """Falcon-40B / 180B: ln_attn and ln_mlp."""
    if config.parallel_attn:
        return "two" if config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2 else "shared"
    return None


def _check_qk_layernorm(config) -> None:
    """StableLM's per-head LayerNorms, Phi's shared one."""
    for flag in ("qk_layernorm",):
        if getattr(config, flag, False):
            raise UnsupportedModelError(
                f"{flag}=True ({config.model_type}): the engine does not implement these q/k "
                "LayerNorms; use plain model.generate() for this model")


def _check_falcon(config) -> None:
    if config.alibi or (config.new_decoder_architecture and not config.parallel_attn):
        raise UnsupportedModelError(
            "this Falcon model biases its attention by distance (alibi=True, as Falcon-RW) or is a "
            "new-architecture model without parallel blocks; the engine runs Falcon's RoPE models: "
            "use plain model.generate() for this one")


def _falcon_linear():
    from transformers.models.falcon.modeling_falcon import FalconLinear

    return FalconLinear


def _falcon_kv_heads(config, kv_heads: int) -> int:
    """One KV head (Falcon-7B), or num_kv_heads (new architecture)."""
    return config.num_kv_heads if config.new_decoder_architecture or not config.multi_query else 1


def _falcon_attention(attn, view) -> dict:
    config = view.config
    if not config.new_decoder_architecture and config.multi_query:
        # Falcon-7B: all query heads' rows, then one key head's, one value head's
        qd, kvd = view.num_heads * view.head_dim, view.head_dim
        q, k, v = (RowSlice(attn.query_key_value, lo, hi) for lo, hi in ((0, qd), (qd, qd + kvd),
                                                                          (qd + kvd, qd + 2 * kvd)))
        return {"q": q, "k": k, "v": v}
    # GPT-NeoX's form (Falcon's MHA): per head, its q, k and v rows; Falcon's new architecture:
    # per KV head, its group's query rows, then its k and v rows
    return {"q": None, "k": None, "v": None, "qkv": attn.query_key_value,
            "qkv_layout": "grouped" if config.new_decoder_architecture else "per_head"}


def _codegen_attention(attn, view) -> dict:
    """q, v, k rows per shard of 4 (`qkv_layout`)."""
    return {"q": None, "k": None, "v": None, "qkv": attn.qkv_proj, "qkv_layout": "shards"}


def _cohere_multipliers(config) -> dict:
    """Cohere multiplies its logits by logit_scale."""
    return {"logit_scale": float(config.logit_scale)}


def _nanochat_embedding_norm(inner):
    """Its (parameter-free) final norm also norms the embedding rows."""
    return inner.norm


_ln = {"layer_norm": True}
_plain = {"layer_norm": True, "plain_mlp": True}
_cohere = {"layer_norm": True, "rope_pairs": True, "parallel_form": _shared, "multipliers": _cohere_multipliers}
# GPT-J, CodeGen: MHA, token types, RoPE of pairs from a (sin, cos) module, parallel blocks summed first
_gptj = dict(_plain, mha_only=True, token_type_embeddings=True, rope_pairs=True, rope_half_tables=True,
             rope_sin_cos_swapped=True, parallel_form=_shared, parallel_sum_first=True,
             decoder_attribute="transformer")

FAMILY = Family("layernorm", "LayerNorm modules called as HF calls them; parallel blocks", (
    ModelType("stablelm", **_ln, parallel_form=_stablelm_parallel, check_config=_check_qk_layernorm),
    ModelType("olmo", **_ln, clip_qkv=olmo_clip_qkv),
    ModelType("phi", **_plain, parallel_form=_shared, parallel_sum_first=True, check_config=_check_qk_layernorm),
    ModelType("starcoder2", **_plain),
    ModelType("nemotron", **_plain),
    ModelType("jais2", **_plain),
    ModelType("nanochat", **_plain, qk_norm_after_rope=True, rope_sin_negated=True, logits_softcap=True,
              embedding_norm=_nanochat_embedding_norm),
    ModelType("cohere", **_cohere),
    ModelType("cohere2", **_cohere, rotated_layers="sliding"),
    ModelType("cohere2_moe", **_cohere, rotated_layers="sliding", moe="cohere2"),
    ModelType("gpt_neox", **_plain, mha_only=True, parallel_form=_gpt_neox_parallel, parallel_sum_first=True,
              decoder_attribute="gpt_neox"),
    ModelType("gptj", **_gptj),
    ModelType("codegen", **_gptj, read_attention=_codegen_attention),
    ModelType("falcon", **_plain, linear_class=_falcon_linear, kv_heads=_falcon_kv_heads,
              read_attention=_falcon_attention, parallel_form=_falcon_parallel, parallel_sum_first=True,
              check_config=_check_falcon, decoder_attribute="transformer"),
))
