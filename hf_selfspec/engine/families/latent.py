"""Multi-head latent attention (LatentAttentionWeights; its maths in engine/latent.py):
DeepSeek-V3's (Youtu-LLM, GLM-4.7-Flash, Sarvam-105B, A.X-K1 and Mistral 4 below its query
scaling), DeepSeek-V2's (its RoPE in complex numbers, in float32) and MiniCPM3's (rotate_half;
each block's output scaled, the final hidden state divided), with their MoE forms:
DeepSeek-V3's sigmoid routing, the softmax routings of DeepSeek-V2 and Mistral 4."""

from __future__ import annotations

import functools
import math

import torch

from ..errors import UnsupportedModelError
from ..weights import FLOAT_DTYPES, LatentAttentionWeights, MatrixView
from .llama import llama4_scaling_positions
from .spec import Family, ModelType


def _check_latent(name: str, attn, num_heads: int) -> None:
    """A latent attention block as LatentAttentionWeights reads it: its dims, projections of
    the widths they imply, RMSNorms (float weights, one eps) of the query and KV latents, an
    even number of rotated columns."""
    dims = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "scaling")
    if attn is None or not all(isinstance(getattr(attn, a, None), (int, float)) for a in dims):
        raise UnsupportedModelError(f"{name} is not a latent attention block the engine knows; "
                                    "use plain model.generate()")
    nope, rope, v, rank = (int(getattr(attn, a)) for a in dims[:4])
    lora = getattr(attn, "q_a_proj", None) is not None
    norms = [getattr(attn, "kv_a_layernorm", None)] + ([getattr(attn, "q_a_layernorm", None)] if lora else [])
    q_out = getattr(getattr(attn, "q_b_proj" if lora else "q_proj", None), "out_features", None)
    kv_a, kv_b = getattr(attn, "kv_a_proj_with_mqa", None), getattr(attn, "kv_b_proj", None)
    eps = getattr(norms[0], "variance_epsilon", None)
    fits = (rope % 2 == 0 and q_out == num_heads * (nope + rope) and isinstance(eps, float)
            and getattr(attn, "num_key_value_groups", 1) == 1
            and getattr(kv_a, "out_features", None) == rank + rope
            and getattr(kv_b, "in_features", None) == rank
            and getattr(kv_b, "out_features", None) == num_heads * (nope + v)
            and all(isinstance(getattr(n, "weight", None), torch.Tensor) and n.weight.dtype in FLOAT_DTYPES
                    and n.weight.dim() == 1 and getattr(n, "variance_epsilon", None) == eps for n in norms)
            and norms[0].weight.shape[0] == rank)
    if not fits:
        raise UnsupportedModelError(
            f"{name}: the engine runs latent attention with q (or q_a / q_b) of heads x (nope + rope) rows, "
            "kv_a_proj_with_mqa of kv_lora_rank + rope rows, kv_b_proj of heads x (nope + v) rows, RMSNorms of one "
            "eps on the latents, an even rope width and num_key_value_heads == num_attention_heads (HF's own "
            "latent attention fails otherwise) only; use plain model.generate()")


def check_latent(name: str, attn, config) -> None:
    _check_latent(name, attn, config.num_attention_heads)


def read_latent(attn, view, complex_rope: bool = False) -> dict:
    """A latent attention module's LatentAttentionWeights (_check_latent has passed;
    complex_rope: DeepSeek-V2's RoPE in complex numbers), in place of q, k and v."""
    config = view.config
    lora = getattr(attn, "q_a_proj", None) is not None
    nope, v_dim, rows = int(attn.qk_nope_head_dim), int(attn.v_head_dim), attn.kv_b_proj.weight
    per_head = nope + v_dim  # kv_b's rows: per head, its k_nope rows then its v rows
    k_up = [MatrixView(rows[h * per_head:h * per_head + nope].t()) for h in range(view.num_heads)]
    v_up = [MatrixView(rows[h * per_head + nope:(h + 1) * per_head]) for h in range(view.num_heads)]
    if complex_rope:
        form = "complex"
    else:
        form = "pairs_to_half" if getattr(config, "rope_interleave", False) else "half"
    return {"q": None, "k": None, "v": None, "latent": LatentAttentionWeights(
        q=None if lora else attn.q_proj, q_a=attn.q_a_proj if lora else None,
        q_a_norm=attn.q_a_layernorm.weight if lora else None, q_b=attn.q_b_proj if lora else None,
        kv_a=attn.kv_a_proj_with_mqa, kv_a_norm=attn.kv_a_layernorm.weight, k_up=k_up, v_up=v_up,
        nope_dim=nope, rope_dim=int(attn.qk_rope_head_dim),
        kv_rank=int(attn.kv_lora_rank), norm_eps=float(attn.kv_a_layernorm.variance_epsilon), rope_form=form)}


def _minicpm3_multipliers(config) -> dict:
    """Each block's output scaled before it joins h, as its layers compute it; the final
    hidden state divided by logits_scaling before the LM head."""
    return {"residual_multiplier": config.scale_depth / math.sqrt(config.num_hidden_layers),
                "head_input_divisor": float(config.logits_scaling)}


_latent = {"latent_attention": True, "read_attention": read_latent, "check_attention": check_latent}

FAMILY = Family("latent", "multi-head latent attention (DeepSeek-V2 / V3 and their kin)", (
    ModelType("deepseek_v3", **_latent, moe="sigmoid_grouped"),
    ModelType("deepseek_v2", **{**_latent, "read_attention": functools.partial(read_latent, complex_rope=True)},
              moe="deepseek_v2", rope_float32=True),
    ModelType("youtu", **_latent),
    ModelType("glm4_moe_lite", **_latent, moe="sigmoid_grouped"),
    ModelType("minicpm3", **_latent, multipliers=_minicpm3_multipliers),
    ModelType("mistral4", **_latent, moe="mistral4", query_scaling=llama4_scaling_positions),
    ModelType("axk1", **_latent, moe="sigmoid_grouped"),
    ModelType("sarvam_mla", **_latent, moe="sigmoid_grouped"),
))
