"""Where a model computes (its device; whether accelerate streams weights in) and what the
engine serves there: the positions a request may need, refused up front past the model's
limits (max_position_embeddings, query scaling, a sliding window the device cannot apply)."""

from __future__ import annotations

import torch

from ..engine.core import EngineConfig
from ..engine.dispatch import is_dispatched
from ..engine.layered import (
    attention_window,
    dispatch_placement,
    query_scaling_positions,
    text_config,
    windows_served,
)


def _streams_weights(model) -> bool:
    """Whether accelerate brings some of `model`'s weights in at each forward (offload)."""
    if not is_dispatched(model):
        return False
    placement = dispatch_placement(model)
    return placement is not None and placement.any_offloaded


def model_device(model) -> torch.device:
    """The device `model` computes on: its parameters', or for a model accelerate dispatched
    the execution device of its LM head (offloaded parameters sit on the meta device): where
    the engine's logits and final hidden states are, which the heads read."""
    if is_dispatched(model):
        return dispatch_placement(model).lm_head.device
    return next(model.parameters()).device


def _windowed(model) -> bool:
    """Whether the engine applies `model`'s sliding windows where it runs (layered.windows_served)."""
    return windows_served(model_device(model))


def _check_positions(model, need: int, whose: str) -> None:
    scaled_from = query_scaling_positions(text_config(model))
    if scaled_from is not None and need > scaled_from:
        what = ("scales its NoPE layers' queries by position (attn_temperature_tuning, floor_scale) or "
                "attends within chunks (attention_chunk_size)"
                if text_config(model).model_type == "llama4_text" else
                "scales its queries by position (from original_max_position_embeddings: llama_4_scaling_beta)")
        raise ValueError(
            f"this request needs {need} positions (prompt + max_new_tokens); from position "
            f"{scaled_from} {whose} attention {what}, which hf_selfspec's engine does not: shorten the "
            "prompt or lower max_new_tokens, or run this request with plain model.generate()")
    limit = getattr(text_config(model), "max_position_embeddings", None) or need
    if need > limit:
        raise ValueError(
            f"this request needs {need} positions (prompt + max_new_tokens), "
            f"more than {whose} max_position_embeddings ({limit}); shorten the prompt "
            "or lower max_new_tokens"
        )
    window = attention_window(text_config(model))
    if window is not None and need > window and not _windowed(model):
        raise ValueError(
            f"this request needs {need} positions (prompt + max_new_tokens), more than {whose} "
            f"sliding window ({window}): up to {window} positions the model attends to every earlier "
            "token, as hf_selfspec's CUDA engine does; past it the model sees only the last "
            f"{window}, which the engine applies on the CPU only. Shorten the prompt or lower "
            "max_new_tokens, or run this request with plain model.generate() (no assistant='self')"
        )


def _check_engine_prefill(model, config: EngineConfig, prompt_len: int) -> None:
    """Up front, before any work: layered.check_engine_prefill where the engine prefills."""
    from ..engine.layered import check_engine_prefill

    if config.prefill == "engine":
        check_engine_prefill(text_config(model), prompt_len)
