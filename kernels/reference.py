"""PyTorch reference for row-invariant decode attention (what the Triton kernel must match).

Deliberately plain: for each query row, gather the keys it may see (the committed prefix
``[0, prefix_len[i])`` followed by the slots listed in ``anc[i]``), then a softmax in fp32.
Slow and obviously right; used by the tests and as the fallback where Triton is missing.
"""

from __future__ import annotations

import torch

from .attention import validate_row_attention_inputs


def row_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: torch.Tensor,
    anc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``n`` query rows over a static KV cache, each row with its own key set.

    Args:
        q: ``[n, Hq, d]`` fp32 or bf16 queries.
        k_cache, v_cache: ``[Hkv, S, d]`` one layer's static cache, same dtype as ``q``;
            query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA; MHA when equal).
        prefix_len: int32 ``[n]``; row ``i`` sees slots ``[0, prefix_len[i])``.
        anc: int32 ``[n, A]``; row ``i`` also sees the slots ``anc[i, j] >= 0`` (its tree
            path, including its own slot); ``-1`` is padding.
        scale: multiplies ``q·k`` before the softmax.

    Returns:
        ``[n, Hq, d]`` in ``q.dtype``. A row that sees no key gets zeros.
    """
    scale = validate_row_attention_inputs(q, k_cache, v_cache, prefix_len, anc, scale)
    n, num_q_heads, _ = q.shape
    num_kv_heads, num_slots, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(n):
        # Same key set as the kernel: prefix (clamped to the cache) then valid ancestor slots.
        prefix = torch.arange(min(int(prefix_len[i]), num_slots), device=q.device)
        path = anc[i][(anc[i] >= 0) & (anc[i] < num_slots)].long()
        slots = torch.cat([prefix, path])  # (L,)
        if slots.numel() == 0:
            continue
        k = k_cache[:, slots].float().repeat_interleave(group, dim=0)  # (Hq, L, d)
        v = v_cache[:, slots].float().repeat_interleave(group, dim=0)  # (Hq, L, d)
        scores = torch.einsum("hd,hld->hl", q[i].float(), k) * scale  # (Hq, L)
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", probs, v)
    return out.to(q.dtype)
