"""How far a request may reach in the engine: the sliding window HF applies, whether the
engine applies windows on a device, and the positions it serves with the model's own
attention (max_position_embeddings, the window, where queries start being scaled)."""

from __future__ import annotations

import torch

from .families import spec_of


def attention_window(config) -> int | None:
    """The sliding window HF applies in at least one layer, or None (full attention in all).
    Where the config lists layer_types (Qwen2, Qwen3: only layers from max_window_layers on
    slide, and only with use_sliding_window) they decide; otherwise (Mistral) a set
    sliding_window slides every layer; a family's own (ModelType.window: GPT-Neo's)."""
    spec = spec_of(config.model_type)
    if spec.window is not None:
        return spec.window(config)
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


def windows_served(device) -> bool:
    """Whether the engine's attention on `device` applies sliding windows (the CPU's C++ and
    PyTorch attention do; the CUDA kernel does not, so there requests stay within them)."""
    return torch.device(device).type == "cpu"


def served_positions(config, windowed: bool = False) -> int | None:
    """The most positions a request may reach in the engine and get the model's own
    attention: max_position_embeddings, and where a layer slides and the engine does not
    apply windows (`windowed` False: its CUDA attention), at most the window (HF's sliding
    window lets query position q see keys q - window < j <= q: every key while q is below the
    window, so full attention is the model's there). None: no limit."""
    # MPT: its ALiBi tensor spans max_seq_len keys
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None) or None
    scaled_from = query_scaling_positions(config)
    if scaled_from is not None:
        limit = scaled_from if limit is None else min(limit, scaled_from)
    window = None if windowed else attention_window(config)
    if window is None:
        return limit
    return window if limit is None else min(limit, window)


def query_scaling_positions(config) -> int | None:
    """Where a model starts scaling its queries by position (ModelType.query_scaling:
    Ministral 3's, Mistral 4's and Llama 4's), or attending within chunks (Llama 4): below it
    the factor is exactly 1 (one chunk), which the engine serves; None where no query is
    scaled."""
    spec = spec_of(config.model_type)
    return None if spec.query_scaling is None else spec.query_scaling(config)
