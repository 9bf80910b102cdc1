"""DeepSeek's multi-head latent attention (layered.LatentAttentionWeights) for a step's rows:
each row's q, k and v per head from its normed input, with HF's products, norms and RoPE in
HF's order, so the attention that follows sees the keys and values HF's expand_kv makes.

The products are the engine layout's (row-invariant); the norms and rotations act on each
row alone. Keys and values go into the engine's ordinary per-head KV cache, in heads of its
width: columns a head does not fill are zeros (a zero column of q and k adds exactly 0 to a
score; a zero column of v gives a zero output column, dropped by `heads_output`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .layered import LatentAttentionWeights, apply_rope, rms_norm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str) -> torch.Tensor:
    """The rope columns x [R, heads, r] turned by the rows' tables cos / sin [R, r] ([R, r/2]
    for "complex"), as HF's module for this form turns them (LatentAttentionWeights.rope_form)."""
    cos, sin = cos[:, None], sin[:, None]
    if form == "half":
        return apply_rope(x, cos, sin)
    if form == "pairs_to_half":
        # HF: (x_even c - x_odd s, x_odd c + x_even s), the evens' results first: the same
        # products and sums as rotate_half on the columns reordered evens-then-odds
        return apply_rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)
    # "complex" (DeepSeek-V2): each pair (a, b) times (c + i s) in float32, as torch's complex
    # product computes it (ac - bs, as + bc), written back as pairs in x's dtype
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


def qkv(x: torch.Tensor, block: LatentAttentionWeights, cos: torch.Tensor, sin: torch.Tensor, heads: int,
        width: int, linear: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed rows x [R, H] -> q [heads, R, width] (its rope columns turned), k [heads, R,
    width] (likewise), v [R, heads, width], each zero-padded to the cache's head `width`.
    `linear(x, module)` is the layout's product; cos / sin [R, ...] the rows' RoPE tables."""
    rows, nope, rope = x.shape[0], block.nope_dim, block.rope_dim
    if block.q is not None:
        q = linear(x, block.q)
    else:
        q = linear(rms_norm(linear(x, block.q_a), block.q_a_norm, block.norm_eps), block.q_b)
    q = q.view(rows, heads, nope + rope)
    compressed = linear(x, block.kv_a)  # [R, kv_rank + rope]
    latent = rms_norm(compressed[:, :block.kv_rank], block.kv_a_norm, block.norm_eps)
    kv = linear(latent, block.kv_b).view(rows, heads, nope + block.v_dim)
    q = torch.cat((q[..., :nope], rotate(q[..., nope:], cos, sin, block.rope_form)), dim=-1)
    if width > nope + rope:
        q = F.pad(q, (0, width - nope - rope))
    k, v = _keys_values(kv, rotate(compressed[:, None, block.kv_rank:], cos, sin, block.rope_form), block, width)
    return q.transpose(0, 1), k.transpose(0, 1), v


def cached_keys_values(latent: torch.Tensor, k_rope: torch.Tensor, block: LatentAttentionWeights,
                       heads: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cache of a layer after its prefill (the normed latents [S, kv_rank] and the turned
    k_rope [S, rope] of S positions) -> keys and values [heads, S, width], as HF's expand_kv
    makes them from it (its kv_b_proj on all the positions)."""
    kv = block.kv_b(latent).view(latent.shape[0], heads, block.nope_dim + block.v_dim)
    k, v = _keys_values(kv, k_rope[:, None], block, width)
    return k.transpose(0, 1), v.transpose(0, 1)


def _keys_values(kv: torch.Tensor, k_rope: torch.Tensor, block: LatentAttentionWeights,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b's output [R, heads, nope + v] and the turned k_rope [R, 1, rope] -> k and v [R,
    heads, width]: k = [k_nope | k_rope] (k_rope the same in every head), zero-padded."""
    rows, heads, nope = kv.shape[0], kv.shape[1], block.nope_dim
    k = torch.cat((kv[..., :nope], k_rope.expand(rows, heads, block.rope_dim)), dim=-1)
    if width > k.shape[-1]:
        k = F.pad(k, (0, width - k.shape[-1]))
    v = kv[..., nope:]
    if width > block.v_dim:
        v = F.pad(v, (0, width - block.v_dim))
    return k, v


def heads_output(o: torch.Tensor, block: LatentAttentionWeights, heads: int, width: int) -> torch.Tensor:
    """The attention's output [R, heads*width] -> [R, heads*v_dim]: each head's value columns."""
    if width == block.v_dim:
        return o
    return o.view(o.shape[0], heads, width)[..., :block.v_dim].reshape(o.shape[0], heads * block.v_dim)
