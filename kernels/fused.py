"""Row-invariant fused small kernels of a decode step: RMSNorm (+ the residual add feeding
it) and RoPE + KV-cache write, in Triton.

Why: on a GPU the products and attention of a graph-captured decode step are a minority of
its kernels; the rest are ~30 small elementwise / copy / reduction kernels per layer
(norms, RoPE, KV writes, residual adds: docs/gpu.md, "kernels of one `ar` replay"). These
two kernels replace most of them: per layer one `add_rms_norm` before attention, one
`rope_kv_write`, one `add_rms_norm` after it.

Row invariance (docs/architecture.md): every program handles one row (RMSNorm) or one (row,
head) (RoPE), the reduction of a row runs over a block whose size depends only on the
hidden size, and the launch configuration is a constant of this module; so a row's bits do
not depend on the other rows or on their number.

Agreement with the PyTorch ops the engine uses (engine/layered.py `rms_norm`,
`rotate_half`), with floating-point contraction off (`enable_fp_fusion=False`: a product
and a sum are never fused into one FMA, as separate PyTorch ops never are):
  - the residual add: the same operation (sum in fp32, one rounding to the dtype): exact;
  - RoPE `q * cos + rotate_half(q) * sin` in the model's dtype: each product and the sum
    rounded to the dtype as PyTorch rounds each op's result: exact;
  - RMSNorm: its mean of squares is a sum over the row in another order than PyTorch's
    (whose order depends on the shape), so the result matches to a tolerance, not bits
    (tests/test_triton_fused.py states it per dtype). The engine therefore uses one or the
    other for every row of every step, never a mix, so its own invariants hold either way.

Triton is imported on first launch (as in attention.py); on CPU tensors the launchers need
the interpreter (TRITON_INTERPRET=1 set before triton is imported).
"""

from __future__ import annotations

import functools
import os

import torch

# Fixed launch configuration: never derived from the number of rows (row invariance).
NUM_WARPS = 4
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_triton(device: torch.device, name: str) -> None:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 in "
                         "the environment before triton is imported")


def _options() -> dict:
    """Launch options: no fp contraction (see the module docstring). The interpreter
    computes op by op anyway and does not take the option."""
    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@functools.cache
def _kernels():
    from . import _fused_triton

    return _fused_triton.add_rms_norm_kernel, _fused_triton.rope_kv_write_kernel


def add_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of `h` [R, H] (after adding `delta` [R, H], the residual branch,
    when given). Returns (the rows that were normalised [R, H]: `h + delta`, or `h` itself
    without delta; their norm `weight * rms_norm(.)` [R, H]), both in `h`'s dtype."""
    if h.dim() != 2 or weight.shape != (h.shape[1],):
        raise ValueError(f"h must be [R, H] and weight [H], got {tuple(h.shape)} and {tuple(weight.shape)}")
    if h.dtype not in _DTYPES or weight.dtype != h.dtype:
        raise ValueError(f"h and weight must share a float dtype, got {h.dtype} and {weight.dtype}")
    if delta is not None and (delta.shape != h.shape or delta.dtype != h.dtype):
        raise ValueError(f"delta must match h, got {tuple(delta.shape)} {delta.dtype}")
    if h.stride(1) != 1 or weight.stride(0) != 1 or (delta is not None and delta.stride(1) != 1):
        raise ValueError("h, delta and weight must be contiguous along the hidden dimension")
    _check_triton(h.device, "add_rms_norm")
    import triton

    norm_kernel, _ = _kernels()
    rows, hidden = h.shape
    x = torch.empty_like(h, memory_format=torch.contiguous_format)
    h_out = h if delta is None else torch.empty_like(x)
    norm_kernel[(rows,)](
        h, h if delta is None else delta, weight, h_out, x, hidden, float(eps),
        h.stride(0), 0 if delta is None else delta.stride(0), h_out.stride(0), x.stride(0),
        BLOCK=triton.next_power_of_2(hidden), HAS_DELTA=delta is not None, IS_BF16=h.dtype == torch.bfloat16,
        num_warps=NUM_WARPS,
        **_options())
    return h_out, x


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """RoPE of the query and key heads of R rows, and the KV-cache write, in one launch.

    q [R, Hq, d], k and v [R, Hkv, d] (last dimension contiguous); cos, sin [R, d] (each
    row's position); slots int64 [R]: the cache slot each row's K and V go to; k_cache,
    v_cache [Hkv, S, d] (one layer's). Returns the rotated queries [R, Hq, d]; writes
    k_cache[:, slots[r]] = RoPE(k[r]) and v_cache[:, slots[r]] = v[r]."""
    rows, num_q, dim = q.shape
    num_kv = k.shape[1]
    if k.shape != (rows, num_kv, dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [R, Hkv, d] = [{rows}, Hkv, {dim}], got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if cos.shape != (rows, dim) or sin.shape != (rows, dim) or slots.shape != (rows,):
        raise ValueError(f"cos and sin must be [R, d] = [{rows}, {dim}] and slots [R], got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}, {tuple(slots.shape)}")
    if dim & (dim - 1) or dim < 2:
        raise ValueError(f"head_dim must be a power of two, got {dim}")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[0] != num_kv or k_cache.shape[2] != dim:
        raise ValueError(f"k_cache and v_cache must be [Hkv, S, d] = [{num_kv}, S, {dim}], got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if len({q.dtype, k.dtype, v.dtype, cos.dtype, sin.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError("q, k, v, cos, sin and the caches must share one dtype")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, v_cache)):
        raise ValueError("every tensor must be contiguous in its last (head_dim) dimension")
    _check_triton(q.device, "rope_kv_write")
    _, rope_kernel = _kernels()
    q_out = torch.empty(rows, num_q, dim, dtype=q.dtype, device=q.device)
    rope_kernel[(rows, num_q + num_kv)](
        q, k, v, cos, sin, slots, q_out, k_cache, v_cache, num_q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEAD_DIM=dim, IS_BF16=q.dtype == torch.bfloat16, num_warps=NUM_WARPS, **_options())
    return q_out
