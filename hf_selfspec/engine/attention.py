"""Row-invariant attention over the static KV cache, in plain PyTorch (the CPU path).

Why not SDPA: libraries pick kernels and reduction orders by shape, so the result for a
row would depend on how many rows and keys share the call. Here every reduction has a
fixed shape: keys are visited in blocks of `KEY_BLOCK` slots at absolute offsets
(block b = slots [b*KEY_BLOCK, (b+1)*KEY_BLOCK)), with an online softmax. A block that a
row cannot see contributes exactly nothing (its scores are -inf: the running max is
unchanged, the rescale factor is exp(0) = 1 and the added terms are 0), so a row's output
is bit-identical whatever the number of blocks the widest row of the step needs, and
whatever the other rows are. The GPU path uses the Triton kernel in `hf_selfspec.kernels` (`kernels/`),
the CPU `kernel` row layout the C++ `rows_attention` (kernels/cpu_rows.cpp).
"""

from __future__ import annotations

import torch

# Keys per block. Fixed for the engine's lifetime (never chosen from the rows), large
# enough that chat contexts take 1-3 blocks (few ops per layer), small enough that the
# masked tail of the last block is cheap.
KEY_BLOCK = 256


def visible_bias(key_limit: torch.Tensor, num_keys: int, group: int) -> torch.Tensor:
    """Additive mask [group*W, num_keys]: 0 where slot <= key_limit[row], -inf elsewhere.

    key_limit: int64 [W], the last slot each row may see (its own position for a chain).
    Rows are laid out group-major to match `block_attention`'s query layout.
    """
    slots = torch.arange(num_keys, device=key_limit.device)
    hidden = slots[None, :] > key_limit[:, None]  # [W, K]
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=key_limit.device)
    bias.masked_fill_(hidden, float("-inf"))
    return bias.repeat(group, 1)  # [G*W, K]


def block_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Online-softmax attention over fixed key blocks.

    q:        [Hkv, G*W, d] fp32, already scaled by 1/sqrt(d) (query head h = kv*G + g)
    k_cache:  [Hkv, S, d]   one layer's keys (S a multiple of KEY_BLOCK)
    v_cache:  [Hkv, S, d]
    bias:     [G*W, nb*KEY_BLOCK] from `visible_bias`; nb = blocks the widest row needs
    returns   [Hkv, G*W, d]
    """
    num_blocks = bias.shape[1] // KEY_BLOCK
    acc = l_sum = m_max = None
    for b in range(num_blocks):
        lo, hi = b * KEY_BLOCK, (b + 1) * KEY_BLOCK
        scores = torch.matmul(q, k_cache[:, lo:hi].transpose(1, 2)) + bias[:, lo:hi]  # [Hkv, GW, B]
        block_max = scores.amax(-1, keepdim=True)
        if b == 0:  # block 0 holds slot 0, which every row sees: block_max is finite
            m_max = block_max
            p = torch.exp(scores - m_max)
            l_sum = p.sum(-1, keepdim=True)
            acc = torch.matmul(p, v_cache[:, lo:hi])
            continue
        m_new = torch.maximum(m_max, block_max)
        rescale = torch.exp(m_max - m_new)
        p = torch.exp(scores - m_new)
        l_sum = l_sum * rescale + p.sum(-1, keepdim=True)
        acc = acc * rescale + torch.matmul(p, v_cache[:, lo:hi])
        m_max = m_new
    return acc / l_sum
