"""Rotary position embeddings as the engine applies them: HF's own rotary module's tables
(every RoPE type of the served models), laid out for the engine's rotation of halves or
adjacent pairs, and which layers HF rotates. A model type's RoPE facts are its registry
record's (families/spec.py ModelType: rope_pairs, rope_half_tables, ...)."""

from __future__ import annotations

import inspect

import torch

from .families import spec_of


def rope_type(config) -> str:
    """The RoPE variant of the config ("default", "linear", "dynamic", "longrope", ...)."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def longrope_short_positions(config) -> int | None:
    """For "longrope" RoPE, the longest forward HF computes with the short factors
    (original_max_position_embeddings); None for any other RoPE."""
    if rope_type(config) != "longrope":
        return None
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("original_max_position_embeddings") \
        or getattr(config, "original_max_position_embeddings", None)


def check_engine_prefill(config, prompt_len: int) -> None:
    """Refuse a prompt the engine's own prefill (EngineConfig.prefill='engine') cannot rotate
    as HF does: "longrope" RoPE rotates a prompt longer than original_max_position_embeddings
    with its long factors at every position, which only HF's own prefill gives (the engine's
    RoPE table has one rotation per position)."""
    short = longrope_short_positions(config)
    if short and prompt_len > short:
        raise ValueError(
            f"this prompt ({prompt_len} tokens) is longer than the model's longrope "
            f"original_max_position_embeddings ({short}), which HF rotates with the long factors "
            "at every position; EngineConfig(prefill='engine') cannot reproduce that: use "
            "prefill='hf' or 'auto' (the default) or a shorter prompt")



def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's and ERNIE 4.5's rotate_half: (-x[2j + 1], x[2j]) interleaved."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over x's last dimension, or where the tables are
    narrower (partial rotary: Phi-4-mini's partial_rotary_factor) over its first
    cos.shape[-1] dimensions, the rest unchanged, as HF's apply_rotary_pos_emb. pairs: the
    rotation turns adjacent pairs (rotate_pairs; the tables hold each angle twice in a row).
    Tables of another dtype than x (Llama 4's float32 ones for a 16-bit model) turn x in
    their dtype, rounded to x's after, as HF's float32 complex product."""
    if cos.dtype != x.dtype:
        return apply_rope(x.to(cos.dtype), cos, sin, pairs).to(x.dtype)
    rotate = rotate_pairs if pairs else rotate_half
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate(x) * sin
    turned = x[..., :rot]
    return torch.cat((turned * cos + rotate(turned) * sin, x[..., rot:]), dim=-1)



def rotates(attention, config) -> bool:
    """Whether HF rotates this attention module's q and k: SmolLM3's modules say so
    (`use_rope`); EXAONE 4 leaves its full-attention layers unrotated where the model has a
    sliding window (its "global NoPE"), Cohere 2 its full-attention layers always; a layer
    without attention (LFM2's convolutions, Qwen 3.5's DeltaNets) rotates nothing."""
    spec = spec_of(config.model_type)
    if attention is None or spec.positions in ("learned", "alibi"):
        return False
    if spec.rotated_layers == "local":  # its sliding (local) layers only
        return bool(attention.is_local_attention)
    if hasattr(attention, "use_rope"):
        return bool(attention.use_rope)
    if spec.rotated_layers == "sliding_or_no_window":
        return getattr(attention, "sliding_window", None) is None or bool(attention.is_sliding)
    if spec.rotated_layers == "sliding":  # Cohere 2 MoE: its dense prefix layers may force RoPE
        return attention.sliding_window is not None or bool(getattr(attention, "force_rope", False))
    if spec.rotated_layers == "layer_theta":  # Granite-SWA: a base of 0 is NoPE
        return bool(config.layer_rope_theta[attention.layer_idx])
    return True


def rope_layer_types(inner, config) -> tuple | None:
    """The layer types whose RoPE differs, in first-seen layer order, where HF's rotary
    module takes a layer type (Gemma 3); Granite-SWA's distinct nonzero RoPE bases in its
    rotary_embs' (ascending) order; None where one RoPE serves every layer."""
    if spec_of(config.model_type).rope_per_layer_theta:
        return tuple(sorted({theta for theta in config.layer_rope_theta if theta}))
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        return None
    # LFM3's rotary module holds the attention layers' types only (not its convolutions')
    rotated = getattr(rotary, "layer_types", None)
    return tuple(t for t in dict.fromkeys(config.layer_types) if rotated is None or t in rotated)


def identity_tables(max_positions: int, head_dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0 at every position: a model without RoPE."""
    return (torch.ones(max_positions, head_dim, dtype=dtype, device=device),
            torch.zeros(max_positions, head_dim, dtype=dtype, device=device))


def rope_tables(view, inner, max_positions: int, layer_type: str | None = None):
    """cos/sin for positions [0, max_positions) from the HF rotary module itself, so
    every RoPE variant the HF model supports gives the same tables (`view`: the
    LayeredModel, its config, device, dtype, head_dim and rope_types).

    Two variants make HF's tables depend on the length of the forward pass, not only on
    the position; the tables below are the ones HF's greedy generate() uses for a
    request of up to max_position_embeddings positions:
    - "dynamic" rescales past max_position_embeddings (never served here) and keeps the
      rescaled frequencies until a shorter forward resets them: one 1-position call
      resets a module that an earlier long HF call left rescaled.
    - "longrope" uses its short factors while a forward's length is at most
      original_max_position_embeddings and its long factors for all positions of a longer
      one. Its decode steps rotate position p with the long factors exactly when
      p >= original_max_position_embeddings: so short factors below, long from there.
      A prompt past that length has long factors at every position, which HF's own
      prefill (EngineConfig.prefill="hf", and "auto" always for longrope) gives the
      prompt's keys; generate() refuses such a prompt with prefill="engine"."""
    spec = spec_of(view.config.model_type)
    if not spec.rope:  # no RoPE (learned positions, ALiBi, NoPE): tables that rotate nothing
        return identity_tables(max_positions, view.head_dim, view.dtype, view.device)
    positions = torch.arange(max_positions, device=view.device)[None]
    probe = torch.zeros(1, device=view.device, dtype=view.dtype)
    # LFM2-MoE names its rotary module pos_emb; OLMo Hybrid may have none (NoPE)
    rotary = inner.rotary_emb if hasattr(inner, "rotary_emb") else inner.pos_emb
    if rotary is None:
        return identity_tables(max_positions, view.head_dim, view.dtype, view.device)
    kind = {} if layer_type is None else {"layer_type": layer_type}
    if spec.rope_per_layer_theta:  # layer_type: a RoPE base, its own module
        rotary, kind = inner.rotary_embs[view.rope_types.index(layer_type)], {}
    with torch.no_grad():
        if rope_type(view.config) == "dynamic":
            rotary(probe, positions[:, :1], **kind)
        tables = rotary(probe, positions, **kind)
        if isinstance(tables, torch.Tensor) and tables.is_complex():  # DeepSeek-V2, Llama 4: each angle once, complex
            tables = (tables.real, tables.imag)
            if spec.rope_complex_pairs:  # its complex product turns adjacent pairs
                tables = tuple(t.repeat_interleave(2, dim=-1) for t in tables)
        cos, sin = tables
        if spec.rope_sin_negated:  # its rotate_half is (x2, -x1): the turn by -angle
            sin = -sin
        if spec.rope_half_width:  # the angles once: both halves turn by them
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if spec.rope_sin_cos_swapped:
            # its rotary module returns (sin, cos), one column per angle: laid out here as
            # the other pair models' modules give them (the angles twice, in halves), which
            # the interleaving below turns into GPT-J's repeat_interleave
            cos, sin = sin.repeat(1, 1, 2), cos.repeat(1, 1, 2)
        short = longrope_short_positions(view.config)
        if short is not None and short < max_positions:
            cos[:, :short], sin[:, :short] = rotary(probe, positions[:, :short])
    cos, sin = cos[0], sin[0]
    if spec.rope_half_tables:  # as their apply_rotary_pos_emb
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    # in the model's dtype (OLMo 2's rotary module returns float32 tables for any model);
    # DeepSeek-V2 and Llama 4 rotate in float32 whatever the model's dtype
    dtype = torch.float32 if spec.rope_float32 else view.dtype
    return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


def all_rope_tables(view, inner, max_positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (cos, sin) per RoPE the layers use (rope_types' order; one for most models)."""
    if view.rope_types is None:
        return [rope_tables(view, inner, max_positions)]
    if not view.rope_types:  # Granite-SWA without RoPE in any layer: tables that rotate nothing
        return [identity_tables(max_positions, view.head_dim, view.dtype, view.device)]
    return [rope_tables(view, inner, max_positions, kind) for kind in view.rope_types]
