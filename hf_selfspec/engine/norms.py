"""The norms of the engine's layers, as HF computes them: RMSNorm (Llama's, Gemma's 1 + w,
Helium's float32 scale) and Gemma 2's soft cap."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False,
             scale_in_float32: bool = False) -> torch.Tensor:
    """RMSNorm exactly as HF's LlamaRMSNorm computes it (fp32 statistics); plus_one: as
    Gemma's, x * (1 + w) in float32, rounded to x's dtype after; scale_in_float32: as
    Helium's, x * w in float32, rounded after (the same as Llama's in float32)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (x32 * (1.0 + weight.float())).to(dtype)
    if scale_in_float32:
        return (weight.float() * x32).to(dtype)
    return weight * x32.to(dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft cap: cap * tanh(x / cap), as HF computes it (None: x)."""
    return x if cap is None else torch.tanh(x / cap) * cap
