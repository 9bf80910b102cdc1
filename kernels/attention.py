"""Row-invariant decode attention over a static KV cache: Triton kernel and launcher.

Why a kernel of our own: the engine's promise (docs/architecture.md, the engine) is that a
token's row is computed bit-for-bit the same whether it is decoded alone or verified among
``n`` rows. Library attention picks its tiling, split-K and reduction order from the shape,
so a row's rounding changes with ``n``. Here every (query row, query head) is one program
instance, the key loop uses a block size that is a constant of this module, and nothing
about the launch depends on ``n``: a row's arithmetic is the same sequence of operations
whatever else is in the batch. No autotuning either, for the same reason (an autotuner
keyed on shapes would pick different configs for different ``n``).

Each row sees ``prefix_len[i] + A`` logical keys: key ``j < prefix_len[i]`` is its committed
prefix at slot ``base[i] + j`` (its sequence's KV region; ``base`` 0 when not given), key
``prefix_len[i] + c`` is the slot ``anc[i, c]`` (its tree path in the current block, root
first, its own slot last; absolute; ``-1`` pads and is masked). The key loop runs over
logical keys in fixed blocks of ``BLOCK_KEYS``, and only the address of a key depends on
where it lies, so a tree row computes exactly the chain row at its position (same keys at
the same logical indices, same blocks, same arithmetic) and a row in a region at ``base``
exactly the row of that sequence alone at slot 0. The online softmax follows Triton
tutorial 06 (fused attention) and FlashAttention: a running max ``m``, normaliser ``denom``
and accumulator ``acc`` in fp32.

Triton is imported only when the launcher first runs, so the package imports on machines
without Triton, and on CPU ``TRITON_INTERPRET=1`` can still be set before that import.
"""

from __future__ import annotations

import functools
import math
import os

import torch

# Logical keys per loop iteration. A module constant, never derived from n: this (with one
# program per row and head) is what makes a row's result independent of the batch. 64 keys
# x 128 dims fp32 is 32 KiB of K per iteration, fine for 4 warps.
BLOCK_KEYS = 64
# Fixed launch configuration, for the same reason as BLOCK_KEYS.
NUM_WARPS = 4

_DTYPES = (torch.float32, torch.bfloat16)


def validate_row_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: torch.Tensor,
    anc: torch.Tensor,
    scale: float,
    base: torch.Tensor | None = None,
) -> float:
    """Check shapes, dtypes and devices of ``row_attention`` inputs; return ``scale`` as float.

    Raises ``ValueError`` (``TypeError`` for a non-tensor) naming the offending argument. Checks only metadata
    (no device sync), so it is safe inside CUDA-graph capture; slot values are masked in the kernel.
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "prefix_len": prefix_len, "anc": anc}
    if base is not None:
        tensors["base"] = base
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [n, Hq, d], got shape {tuple(q.shape)}")
    n, num_q_heads, head_dim = q.shape
    if n < 1:
        raise ValueError("q must have at least one row (n >= 1)")
    for name in ("k_cache", "v_cache"):
        t = tensors[name]
        if t.dim() != 3:
            raise ValueError(f"{name} must be [Hkv, S, d], got shape {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}"
        )
    num_kv_heads, num_slots, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != head_dim of the cache ({kv_head_dim})")
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two (e.g. 64 or 128), got {head_dim}")
    if num_q_heads < 1:
        raise ValueError(f"q must have at least one query head, got shape {tuple(q.shape)}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if num_slots < 1:
        raise ValueError("the KV cache has no slots (S == 0)")
    if prefix_len.shape != (n,):
        raise ValueError(f"prefix_len must be [n] = [{n}], got shape {tuple(prefix_len.shape)}")
    if anc.dim() != 2 or anc.shape[0] != n or anc.shape[1] < 1:
        raise ValueError(f"anc must be [n, A] = [{n}, A>=1], got shape {tuple(anc.shape)}")
    if base is not None and base.shape != (n,):
        raise ValueError(f"base must be [n] = [{n}], got shape {tuple(base.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    for name in ("k_cache", "v_cache"):
        if tensors[name].dtype != q.dtype:
            raise ValueError(f"{name} dtype {tensors[name].dtype} != q dtype {q.dtype}")
    for name in ("prefix_len", "anc", "base"):
        if name in tensors and tensors[name].dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensors[name].dtype}")
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    for name in ("q", "k_cache", "v_cache"):
        if tensors[name].stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if (n > 1 and prefix_len.stride(0) != 1) or (anc.shape[1] > 1 and anc.stride(1) != 1):
        raise ValueError("prefix_len and anc must be contiguous in their last dimension")
    if isinstance(scale, torch.Tensor) or not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite Python number, got {scale!r}")
    return float(scale)


@functools.cache
def _kernel():
    """Build the Triton kernel on first use (imports Triton lazily; see module docstring)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        prefix_ptr,
        anc_ptr,
        base_ptr,
        out_ptr,
        scale,
        num_slots,
        num_anc,
        group,
        stride_qn,
        stride_qh,
        stride_kh,
        stride_ks,
        stride_vh,
        stride_vs,
        stride_an,
        stride_base,
        stride_on,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        BLOCK_KEYS: tl.constexpr,
        HAS_BASE: tl.constexpr,
    ):
        row = tl.program_id(0)
        q_head = tl.program_id(1)
        kv_head = q_head // group
        dims = tl.arange(0, HEAD_DIM)

        q = tl.load(q_ptr + row * stride_qn + q_head * stride_qh + dims).to(tl.float32)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh

        # Finite start for the running max: a fully masked block then leaves m, denom, acc
        # unchanged (alpha = exp(0) = 1, p = exp(-inf) = 0) instead of producing NaN. This
        # is also why the loop may run past the row's last key (up to prefix + num_anc,
        # the widest row's path): the extra blocks add exactly nothing.
        m = tl.full((), -1.0e30, tl.float32)
        denom = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_DIM,), tl.float32)

        prefix = tl.minimum(tl.load(prefix_ptr + row), num_slots)
        first = 0  # slot of logical key 0: the row's KV region
        if HAS_BASE:
            first = tl.load(base_ptr + row * stride_base)
        # Logical keys [0, prefix + num_anc) in fixed blocks: key j < prefix is the committed
        # prefix at slot first + j, key prefix + c the path slot anc[row, c]. Where a key's
        # value comes from changes its address only, never its place in the blocks.
        for start in range(0, prefix + num_anc, BLOCK_KEYS):
            keys = start + tl.arange(0, BLOCK_KEYS)  # (BLOCK_KEYS,) logical indices
            in_prefix = keys < prefix
            col = keys - prefix
            on_path = (col >= 0) & (col < num_anc)
            path_slots = tl.load(anc_ptr + row * stride_an + col, mask=on_path, other=-1)
            slots = tl.where(in_prefix, first + keys, path_slots)
            valid = (in_prefix | on_path) & (slots >= 0) & (slots < num_slots)
            k = tl.load(
                k_base + slots[:, None] * stride_ks + dims[None, :], mask=valid[:, None], other=0.0
            ).to(tl.float32)
            v = tl.load(
                v_base + slots[:, None] * stride_vs + dims[None, :], mask=valid[:, None], other=0.0
            ).to(tl.float32)
            # Online softmax step (tutorial 06).
            scores = tl.sum(q[None, :] * k, axis=1) * scale  # (BLOCK_KEYS,)
            scores = tl.where(valid, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            alpha = tl.exp(m - m_new)  # rescales what was accumulated under the old max
            p = tl.exp(scores - m_new)  # 0 where masked
            denom = denom * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new

        # A row that saw no key has denom == 0 and acc == 0: return zeros, not NaN.
        out = acc / tl.where(denom > 0, denom, 1.0)
        tl.store(
            out_ptr + row * stride_on + q_head * stride_oh + dims, out.to(out_ptr.dtype.element_ty)
        )

    return row_attention_kernel


def row_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_len: torch.Tensor,
    anc: torch.Tensor,
    scale: float,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-invariant attention of ``n`` query rows over one layer's static KV cache.

    Row ``i`` attends to slots ``base[i] + [0, prefix_len[i])`` plus the slots
    ``anc[i, j] >= 0``, in that logical order. Its output is bit-identical whether it runs
    alone or among other rows, whatever its ``base``, and a tree row (prefix ``P``, path of
    ``c`` slots) is bit-identical to the chain row with prefix ``P + c`` holding the same
    keys and values at slots ``P .. P + c - 1``.

    Args:
        q: ``[n, Hq, d]`` fp32 or bf16 queries; ``d`` a power of two (64, 128, ...).
        k_cache, v_cache: ``[Hkv, S, d]``, same dtype and device as ``q``; ``Hq % Hkv == 0``
            and query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        prefix_len: int32 ``[n]``: length of the committed prefix row ``i`` sees
            (values above ``S`` are clamped to ``S``).
        anc: int32 ``[n, A]``, ``A >= 1``: the slots row ``i`` sees after its prefix (its tree
            path, root first, its own slot last; absolute slots); ``-1`` pads, at the end
            (a ``-1`` inside a path is skipped but keeps its logical place). Slots must be
            distinct and not inside the row's prefix; out-of-range slots are ignored. For a
            chain, pass everything in ``prefix_len`` and ``anc`` all ``-1``.
        scale: multiplies ``q·k`` (usually ``d ** -0.5``).
        base: int32 ``[n]`` or None (all 0): the slot of each row's logical key 0, i.e. of
            its sequence's KV region in a batch. Prefix slots outside the cache are ignored.

    Returns:
        ``[n, Hq, d]`` in ``q.dtype``; softmax and accumulation in fp32. A row that sees no
        key gets zeros.
    """
    scale = validate_row_attention_inputs(q, k_cache, v_cache, prefix_len, anc, scale, base)
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "row_attention on CPU tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is imported"
        )
    try:
        kernel = _kernel()
    except ImportError as err:
        raise ImportError(
            "row_attention needs Triton (pip install 'hf-selfspec[kernels-cpu]'); "
            "row_attention_reference is the pure-PyTorch fallback"
        ) from err

    n, num_q_heads, head_dim = q.shape
    num_kv_heads, num_slots, _ = k_cache.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    grid = (n, num_q_heads)  # one program per (query row, query head)
    kernel[grid](
        q,
        k_cache,
        v_cache,
        prefix_len,
        anc,
        prefix_len if base is None else base,  # not read without HAS_BASE
        out,
        scale,
        num_slots,
        anc.shape[1],
        num_q_heads // num_kv_heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        anc.stride(0),
        0 if base is None else base.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_KEYS=BLOCK_KEYS,
        HAS_BASE=base is not None,
        num_warps=NUM_WARPS,
    )
    return out
