"""The Triton source of kernels/fused.py (imported on first launch, so that importing the
package never imports Triton; see fused.py for what the kernels compute and why)."""

import triton
import triton.language as tl


@triton.jit
def rounded(x, ref_ptr, IS_BF16: tl.constexpr):
    """fp32 x -> the nearest value of ref_ptr's dtype (ties to even), kept in fp32: what
    a PyTorch op in that dtype stores. bf16 by hand (the hardware's cvt.rn): the
    interpreter's fp32 -> bf16 cast truncates, and the CPU tests must see GPU bits."""
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        out = x.to(ref_ptr.dtype.element_ty).to(tl.float32)
    return out


@triton.jit
def add_rms_norm_kernel(h_ptr, delta_ptr, w_ptr, h_out_ptr, x_out_ptr, hidden, eps,
                        stride_h, stride_d, stride_ho, stride_xo,
                        BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, IS_BF16: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = h_out_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        # the residual add: one rounding to the model's dtype, as torch's h + delta
        delta = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        h = rounded(h + delta, h_out_ptr, IS_BF16)
        tl.store(h_out_ptr + row * stride_ho + cols, h.to(dtype), mask=mask)
    # fp32 statistics, as HF's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), to the dtype,
    # then weight * x in the dtype (values already of the dtype: the stores are exact)
    mean = tl.sum(h * h, axis=0) / hidden
    inv = 1.0 / tl.sqrt_rn(mean + eps)
    x = rounded(h * inv, h_out_ptr, IS_BF16)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_out_ptr + row * stride_xo + cols, rounded(w * x, h_out_ptr, IS_BF16).to(dtype), mask=mask)


@triton.jit
def rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr,
                         k_cache_ptr, v_cache_ptr, num_q_heads,
                         stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                         stride_cr, stride_sr, stride_or, stride_oh,
                         stride_kch, stride_kcs, stride_vch, stride_vcs,
                         HEAD_DIM: tl.constexpr, IS_BF16: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)  # [0, Hq): a query head; [Hq, Hq + Hkv): a KV head
    dims = tl.arange(0, HEAD_DIM)
    half = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + row * stride_cr + dims).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sr + dims).to(tl.float32)
    if head < num_q_heads:
        base = q_ptr + row * stride_qr + head * stride_qh
    else:
        base = k_ptr + row * stride_kr + (head - num_q_heads) * stride_kh
    x = tl.load(base + dims).to(tl.float32)
    xr = tl.load(base + partner).to(tl.float32)
    rotated = tl.where(dims < half, -xr, xr)  # rotate_half(x)
    # x * cos + rotate_half(x) * sin, each op rounded to the dtype as torch rounds it
    out = rounded(rounded(x * cos, q_out_ptr, IS_BF16) + rounded(rotated * sin, q_out_ptr, IS_BF16),
                  q_out_ptr, IS_BF16).to(dtype)
    if head < num_q_heads:
        tl.store(q_out_ptr + row * stride_or + head * stride_oh + dims, out)
    else:
        kv = head - num_q_heads
        slot = tl.load(slot_ptr + row)
        tl.store(k_cache_ptr + kv * stride_kch + slot * stride_kcs + dims, out)
        value = tl.load(v_ptr + row * stride_vr + kv * stride_vh + dims)
        tl.store(v_cache_ptr + kv * stride_vch + slot * stride_vcs + dims, value)
