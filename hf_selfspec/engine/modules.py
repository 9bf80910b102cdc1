"""Where an HF decoder layer holds its parts: its attention or token mixer, its MLP or MoE
block, their projections and norms, as each family names them (GPT-NeoX `attention`, GPT-2
`attn` and `h`, OPT's MLP in the layer itself, Nemotron-H's one `mixer`, ...). Lookups by
attribute only: no model type is named here."""

from __future__ import annotations

import torch

from .errors import UnsupportedModelError
from .weights import TransposedLinear

# the projections an attention block may hold: separate q/k/v, Phi-3's fused rows, Phi's
# `dense` output, GPT-NeoX's q/k/v fused per head
ATTENTION_PROJECTIONS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("qkv_proj", "o_proj"),
                         ("q_proj", "k_proj", "v_proj", "dense"), ("query_key_value", "dense"),
                         ("c_attn", "c_proj"), ("q_proj", "k_proj", "v_proj", "out_proj"), ("qkv_proj", "out_proj"),
                         ("Wqkv", "out_proj"), ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                         ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
# and an MLP: gated (separate or Phi-3's fused gate/up), or plain (Phi, StarCoder 2, GPT-NeoX,
# Arcee, Apertus)
MLP_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"), ("fc1", "fc2"),
                   ("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("up_proj", "down_proj"),
                   ("fc_in", "fc_out"), ("w1", "w3", "w2"), ("input_linear", "output_linear"))


def _projection_names(module, options) -> tuple[str, ...]:
    """The first of `options` (names of projections) the block holds all of; the first
    option where none fits (its missing projection is then refused by name)."""
    for names in options:
        if all(getattr(module, name, None) is not None for name in names):
            return names
    return options[0]


def _one_block(layer) -> str | None:
    """A Nemotron-H layer's one block's type ("linear_attention", "full_attention", "mlp",
    "moe"; its `mixer`), or "linear_attention" for a Mamba2 / Mamba block (a `mixer` with
    A_log, no block_type); None for a layer of a token mixer and an MLP."""
    kind = getattr(layer, "block_type", None)
    if hasattr(layer, "mixer") and not isinstance(kind, str) and hasattr(layer.mixer, "A_log"):
        return "linear_attention"
    return kind if hasattr(layer, "mixer") and isinstance(kind, str) else None


def _mlp_path(layer) -> str:
    """Where a decoder layer holds its MLP or MoE block: "mlp." (Granite MoE:
    "block_sparse_moe."; a dense Granite 4.0 layer, whose block_sparse_moe is None: its
    "shared_mlp."; a Nemotron-H MLP layer: "mixer."), or "" where the layer holds the MLP's
    projections itself (OPT's fc1 / fc2)."""
    if _one_block(layer) is not None:
        return "mixer."
    for name in ("mlp", "block_sparse_moe", "ffn", "feed_forward", "shared_mlp"):  # MPT: ffn, LFM2: feed_forward
        if getattr(layer, name, None) is not None:
            return name + "."
    return ""


def _mlp_block(layer):
    """A decoder layer's MLP or MoE block (the layer itself for OPT: `_mlp_path`); None for a
    Nemotron-H layer whose one block is a token mixer."""
    if _one_block(layer) is not None:
        return layer.mixer if _one_block(layer) in ("mlp", "moe") else None
    path = _mlp_path(layer)
    return getattr(layer, path[:-1]) if path else layer


def _attention(layer):
    """A decoder layer's attention block (GPT-NeoX names it `attention`, GPT-2 `attn`; GPT-Neo's
    `attn` holds it as `attention`); None for LFM2's convolution and Qwen 3.5's DeltaNet layers."""
    if _one_block(layer) is not None:  # Nemotron-H: its attention layers' one block
        return layer.mixer if _one_block(layer) == "full_attention" else None
    for name in ("self_attn", "attention", "attn", "self_attention"):
        if hasattr(layer, name):
            block = getattr(layer, name)
            return block.attention if name == "attn" and hasattr(block, "attention") else block
    return None


def _attention_name(layer) -> str:
    """Where `_attention` finds the block, as a module path ("attn.attention": GPT-Neo)."""
    if _one_block(layer) is not None:
        return "mixer"
    name = next((name for name in ("self_attn", "attention", "attn", "self_attention") if hasattr(layer, name)),
                "self_attn")
    return "attn.attention" if name == "attn" and hasattr(layer.attn, "attention") else name


def decoder_layers(inner) -> torch.nn.ModuleList | None:
    """The decoder's layer stack (GPT-2 names it `h`, MPT `blocks`)."""
    for name in ("layers", "h", "blocks"):
        if getattr(inner, name, None) is not None:
            return getattr(inner, name)
    return None


def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    return Conv1D

def _mamba1_path(layer) -> str:
    """Where a layer holds its first-Mamba mixer: "mamba." (Jamba) or "mixer." (Mamba)."""
    return "mamba." if hasattr(layer, "mamba") else "mixer."


def _mamba1_block(layer):
    """A layer's first-Mamba mixer (Jamba: `mamba`; Mamba, Falcon Mamba: `mixer`), or None."""
    return getattr(layer, _mamba1_path(layer)[:-1], None)


def _mamba2_block(layer):
    """A layer's Mamba2 mixer (Granite 4.0-H, Bamba: `mamba`; Nemotron-H: its one block), or None."""
    if _one_block(layer) is not None:
        return layer.mixer if _one_block(layer) == "linear_attention" else None
    return getattr(layer, "mamba", None)

def _first_held(module, names: tuple[str, ...]) -> str:
    """The first of `names` the module holds (the first where it holds none)."""
    return next((name for name in names if hasattr(module, name)), names[0])


def _as_linear(module):
    """A projection as the engine's linear layer: an nn.Linear itself, a Conv1D (GPT-2) as
    its TransposedLinear."""
    return TransposedLinear(module) if isinstance(module, _conv1d_class()) else module


def _router(block):
    """An MoE block's router (Granite MoE names it `router`)."""
    return getattr(block, "gate", None) if hasattr(block, "gate") else getattr(block, "router", None)



def _layer_window(attention, config_window: int) -> int:
    """The sliding window of one attention module (0: none): its own `sliding_window` where
    it holds one (Qwen2, Gemma 2/3, OLMo 3, Ministral: set on sliding layers only; EXAONE 4:
    on every layer, applied where `is_sliding`), else the config's (Mistral, Phi-3)."""
    if attention is None:  # a convolution or DeltaNet layer
        return 0
    if getattr(attention, "attention_type", None) in ("global", "local"):  # GPT-Neo's layers
        return config_window if attention.attention_type == "local" else 0
    if not getattr(attention, "is_sliding", True):
        return 0
    return int(getattr(attention, "sliding_window", config_window) or 0)



def _embedding(inner):
    """The decoder's token embedding (GPT-NeoX: embed_in, GPT-2: wte)."""
    for name in ("embed_tokens", "embed_in", "wte", "word_embeddings", "embeddings"):
        if hasattr(inner, name):
            return getattr(inner, name)
    raise UnsupportedModelError(f"{type(inner).__name__} has no token embedding the engine knows")


def decoder_final_norm(inner):
    """The decoder's final norm module (Phi: final_layernorm, GPT-NeoX: final_layer_norm;
    LFM2's embedding_norm norms the last layer's output, not the embedding rows)."""
    for name in ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "embedding_norm"):
        if getattr(inner, name, None) is not None:
            return getattr(inner, name)
    raise UnsupportedModelError(f"{type(inner).__name__} has no final norm the engine knows")

