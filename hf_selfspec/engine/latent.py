"""DeepSeek's multi-head latent attention (layered.LatentAttentionWeights) for a step's rows:
each row's queries against the cached latents and its one [latent | k_rope] key, from its
normed input, with HF's products, norms and RoPE forms; and each head's output from its
attention-weighted latent.

The KV cache holds one head per position, [normed latent | turned k_rope], as HF's cache
does; its values are the same tensor (the attention's output columns past the latent are
dropped). Each head's query against it is [k_up_h q_nope_h | q_rope_h], so its score is HF's
q_nope . k_nope + q_rope . k_rope, summed in another order (kv_b's key rows applied to the
query rather than to every cached latent). Every product is the engine layout's
(row-invariant, per head where the weight is per head); the norms and rotations act on each
row alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .norms import rms_norm
from .rope import apply_rope
from .weights import LatentAttentionWeights

if TYPE_CHECKING:
    from .layouts import RowLayout


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


def query_and_key(x: torch.Tensor, block: LatentAttentionWeights, cos: torch.Tensor, sin: torch.Tensor,
                  layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Normed rows x [R, H] -> (q [heads, R, kv_rank + rope]: each head's query against the
    latents, then its turned q_rope; k [1, R, kv_rank + rope]: the row's normed latent, then
    its turned k_rope). `layout` makes the products; cos / sin [R, ...] the rows' RoPE tables."""
    linear, rows, nope, rank = layout.linear, x.shape[0], block.nope_dim, block.kv_rank
    if block.q is not None:
        q = linear(x, block.q)
    else:
        q = linear(rms_norm(linear(x, block.q_a), block.q_a_norm, block.norm_eps), block.q_b)
    q = q.view(rows, len(block.k_up), nope + block.rope_dim)
    compressed = linear(x, block.kv_a)  # [R, kv_rank + rope]
    latent = rms_norm(compressed[:, :rank], block.kv_a_norm, block.norm_eps)
    k = torch.cat((latent[:, None], rotate(compressed[:, None, rank:], cos, sin, block.rope_form)), dim=-1)
    absorbed = layout.linear_heads(q[..., :nope].transpose(0, 1), block.k_up)  # [heads, R, kv_rank]
    q = torch.cat((absorbed, rotate(q[..., nope:], cos, sin, block.rope_form).transpose(0, 1)), dim=-1)
    return q, k.transpose(0, 1)


def heads_output(o: torch.Tensor, block: LatentAttentionWeights, layout: RowLayout) -> torch.Tensor:
    """The attention's output [R, heads*(kv_rank + rope)] (each head's weighted sum of the
    cached [latent | k_rope]) -> [R, heads*v]: each head's latent part times its v_up."""
    rows, heads = o.shape[0], len(block.v_up)
    latent = o.view(rows, heads, -1)[..., :block.kv_rank].transpose(0, 1)  # [heads, R, kv_rank]
    return layout.linear_heads(latent, block.v_up).transpose(0, 1).reshape(rows, -1)


def cached_keys(latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """HF's cache of a layer after its prefill (the normed latents [S, kv_rank], the turned
    k_rope [S, rope]) -> the engine's keys [1, S, kv_rank + rope]."""
    return torch.cat((latent, k_rope), dim=-1)[None]
