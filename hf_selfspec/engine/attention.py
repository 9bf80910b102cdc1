"""The engine's attention backends, all row-invariant: a row's output depends only on its
own query and the keys it may see, never on how many rows share the step.

  BlockAttention   plain PyTorch (any CPU layout without the C++ kernel): fixed chunks of
                   query rows against fixed key blocks with an online softmax (below).
  CppRowAttention  the C++ `rows_attention` (kernel layout, kernels/cpu-rows/attention.cpp): each row
                   and head on its own, up to its key limit, in one fixed order; follows
                   a draft tree's path slots and a batch's KV regions.
  TritonAttention  the Triton `row_attention` (CUDA, kernels/attention.py): each (row, head)
                   reads its prefix length from the device metadata buffer, so a captured
                   CUDA graph replays at any position; keys visited by logical index, so
                   it follows tree paths and KV regions with the chain row's arithmetic.

Every backend binds to one step: `backend.bind(engine, meta)` returns
`attend(q [Hq, R, d] after RoPE, layer) -> o [R, Hq*d]` in q's dtype; the step's KV is
already written at meta.slots when it is called.

Why not SDPA for the block path: libraries pick kernels and reduction orders by shape, so
the result for a row would depend on how many rows and keys share the call. Here every
reduction has a fixed shape: keys are visited in blocks of `KEY_BLOCK` slots at absolute
offsets (block b = slots [b*KEY_BLOCK, (b+1)*KEY_BLOCK)), with an online softmax. A block
that a row cannot see contributes exactly nothing (its scores are -inf: the running max is
unchanged, the rescale factor is exp(0) = 1 and the added terms are 0), so a row's output
is bit-identical whatever the number of blocks the widest row of the step needs, and
whatever the other rows are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .layered import soft_cap

if TYPE_CHECKING:  # annotations only
    from .interface import AttentionHost
    from .meta import StepMeta

# Keys per block. Fixed for the engine's lifetime (never chosen from the rows), large
# enough that chat contexts take 1-3 blocks (few ops per layer), small enough that the
# masked tail of the last block is cheap.
KEY_BLOCK = 256

Attend = Callable[[torch.Tensor, int], torch.Tensor]


def visible_bias(key_limit: torch.Tensor, num_keys: int, group: int, window: int = 0) -> torch.Tensor:
    """Additive mask [group*W, num_keys]: 0 where slot <= key_limit[row] (and, with a sliding
    window, slot > key_limit[row] - window, as HF's sliding mask), -inf elsewhere.

    key_limit: int64 [W], the last slot each row may see (its own position for a chain).
    Rows are laid out group-major to match `block_attention`'s query layout.
    """
    slots = torch.arange(num_keys, device=key_limit.device)
    hidden = slots[None, :] > key_limit[:, None]  # [W, K]
    if window:
        hidden |= slots[None, :] <= key_limit[:, None] - window
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=key_limit.device)
    bias.masked_fill_(hidden, float("-inf"))
    return bias.repeat(group, 1)  # [G*W, K]


def block_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias: torch.Tensor, softcap: float | None = None,
    alibi: torch.Tensor | None = None, sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Online-softmax attention over fixed key blocks.

    q:        [Hkv, G*W, d] fp32 (fp64 for an fp64 model), already scaled by 1/sqrt(d)
              (query head h = kv*G + g)
    k_cache:  [Hkv, S, d]   one layer's keys, in the model's dtype (S a multiple of KEY_BLOCK)
    v_cache:  [Hkv, S, d]
    bias:     [G*W, nb*KEY_BLOCK] from `visible_bias`; nb = blocks the widest row needs
    returns   [Hkv, G*W, d] in q's dtype

    A bf16/fp16 cache is widened block by block (exact, elementwise), so the softmax and
    the sums run in q's dtype whatever the model's. softcap: each score s becomes
    softcap * tanh(s / softcap) before the mask (Gemma 2); None: as it is. alibi:
    [Hkv, G*W, >= nb*KEY_BLOCK] (Bloom, MPT): each row's head's slope times the key slot's
    index (= its position here), added to each score after the mask. sink: [Hkv, G*W, 1]
    (GPT-OSS, Granite-SWA): each row's head's sink, one more logit in the softmax's
    denominator (its value 0), taken relative to the larger of it and the scores' maximum.
    """
    num_blocks = bias.shape[1] // KEY_BLOCK
    acc = l_sum = m_max = None
    for b in range(num_blocks):
        lo, hi = b * KEY_BLOCK, (b + 1) * KEY_BLOCK
        keys = k_cache[:, lo:hi].to(q.dtype)  # no copy when the dtypes agree
        values = v_cache[:, lo:hi].to(q.dtype)
        scores = soft_cap(torch.matmul(q, keys.transpose(1, 2)), softcap) + bias[:, lo:hi]  # [Hkv, GW, B]
        if alibi is not None:
            scores = scores + alibi[:, :, lo:hi]
        # a block a sliding window hides from a row entirely has no finite score: its
        # maximum floors at -1e30, so its exponentials are 0 (a visible score is above)
        block_max = scores.amax(-1, keepdim=True).clamp_min(-1e30)
        if b == 0:
            m_max = block_max
            p = torch.exp(scores - m_max)
            l_sum = p.sum(-1, keepdim=True)
            acc = torch.matmul(p, values)
            continue
        m_new = torch.maximum(m_max, block_max)
        rescale = torch.exp(m_max - m_new)
        p = torch.exp(scores - m_new)
        l_sum = l_sum * rescale + p.sum(-1, keepdim=True)
        acc = acc * rescale + torch.matmul(p, values)
        m_max = m_new
    if sink is not None:
        top = torch.maximum(m_max, sink)
        rescale = torch.exp(m_max - top)
        return acc * rescale / (l_sum * rescale + torch.exp(sink - top))
    return acc / l_sum


class BlockAttention:
    """`block_attention` on fixed chunks of `attention_rows` query rows (the layout's), so a
    row's attention call has the same shape whatever the number of real rows."""

    name = "block"
    needs_masks = True  # make_meta builds one visible_bias per chunk
    supports_trees = False  # a scattered path would change the masked blocks' summation order
    supports_batches = False  # blocks sit at absolute slots: a region's base would shift them

    def bind(self, engine: AttentionHost, meta: StepMeta) -> Attend:
        v = engine.view
        R, Hq, Hkv, d, group = meta.rows, v.num_heads, v.num_kv_heads, v.head_dim, engine.group
        A = engine.layout.attention_rows
        # fp32 softmax for fp32/bf16/fp16 models (as HF's eager attention); fp64 stays fp64
        dtype = torch.promote_types(v.dtype, torch.float32)
        QR = max(R, len(meta.biases) * A)  # query rows incl. attention padding
        q_all = torch.zeros(Hq, QR, d, dtype=dtype, device=v.device)
        o_all = torch.zeros(Hq, QR, d, dtype=dtype, device=v.device)
        k_cache, v_cache, scaling = engine.k_cache, engine.v_cache, v.scaling
        softcap = v.attention_softcap
        # ALiBi, once per step for every layer and chunk: each chunk row's head's slope (head
        # kv*G + g, block_attention's row layout) times each key slot's index
        alibi = None
        if v.alibi_slopes is not None and meta.biases:
            slopes = v.alibi_slopes.to(dtype).view(Hkv, group, 1, 1).expand(Hkv, group, A, 1).reshape(Hkv, group * A, 1)
            alibi = slopes * torch.arange(meta.biases[0].shape[1], dtype=dtype, device=v.device)
        layer_sinks = v.layer_sinks

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            q_all[:, :R] = q.to(dtype) * scaling
            # the masks of this layer's window (meta.biases: full attention)
            biases = meta.window_biases[v.layer_window[layer]] if v.layer_window[layer] else meta.biases
            sink = None
            if layer_sinks is not None:  # each chunk row's head's sink, block_attention's row layout
                sink = layer_sinks[layer].to(dtype).view(Hkv, group, 1, 1).expand(Hkv, group, A, 1) \
                    .reshape(Hkv, group * A, 1)
            for c, bias in enumerate(biases):
                qc = q_all[:, c * A:(c + 1) * A].reshape(Hkv, group * A, d)
                oc = block_attention(qc, k_cache[layer], v_cache[layer], bias, softcap, alibi, sink)
                o_all[:, c * A:(c + 1) * A] = oc.view(Hq, A, d)
            return o_all[:, :R].to(q.dtype).transpose(0, 1).reshape(R, Hq * d)

        return attend


class CppRowAttention:
    """The C++ `rows_attention` (CPU; fp32/bf16/fp16 caches): row r sees slots [0, key_limit[r]], or its
    committed prefix plus its tree path (row-invariant by construction: kernels/cpu-rows/attention.cpp)."""

    name = "cpp_rows"
    needs_masks = False
    supports_trees = True
    supports_batches = True  # a base slot per row: several sequences' KV regions in one step

    def __init__(self, kernel, kernel_alibi=None, kernel_sinks=None):
        self.kernel = kernel  # load_rows_attention()
        self.kernel_alibi = kernel_alibi  # load_rows_attention_alibi()
        self.kernel_sinks = kernel_sinks  # load_rows_attention_sinks()

    def bind(self, engine: AttentionHost, meta: StepMeta) -> Attend:
        fn, limits = self.kernel, meta.key_limit[:meta.rows]
        k_cache, v_cache, scale, path = engine.k_cache, engine.v_cache, engine.view.scaling, meta.path
        base, softcap, windows = meta.base, engine.view.attention_softcap or 0.0, engine.view.layer_window
        slopes = engine.view.alibi_slopes
        if slopes is not None:  # Bloom: the same call with each head's ALiBi slope
            kernel_alibi = self.kernel_alibi

            def fn(*args):
                return kernel_alibi(*args, slopes)
        layer_sinks = engine.view.layer_sinks
        kernel_sinks = self.kernel_sinks

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            # float32 out (bf16/fp16 q and caches widened exactly): back to q's dtype
            args = (q.transpose(0, 1).contiguous(), k_cache[layer], v_cache[layer], limits, scale, path, base,
                    softcap, windows[layer])
            if layer_sinks is not None:  # GPT-OSS: the layer's sink per head, in float32
                return kernel_sinks(*args, layer_sinks[layer].float()).to(q.dtype)
            return fn(*args).to(q.dtype)

        return attend


class TritonAttention:
    """`hf_selfspec.kernels.row_attention` on CUDA. Row r sees logical keys 0..key_limit[r]:
    the first ones its committed prefix at slots base[r] + j, the last c_r its tree path's
    slots (meta.path, absolute), visited in that logical order in fixed key blocks, so a
    tree row is bit-identical to the chain row at its position and a row in a batch to its
    sequence alone at slot 0 (kernels/attention.py). The prefix length comes from the
    device metadata (no host value), so the launch is the same at every position and
    inside a CUDA graph. Pad rows (those writing the trash slot) see no key and get zeros:
    their attention would be dropped anyway, and an AR step has W-1 of them. The per-step
    kernel arguments (paths and bases on the device, prefix lengths) are built once per
    step, not once per layer."""

    name = "triton"
    needs_masks = False  # the kernel reads key_limit itself
    supports_trees = True  # meta.path: each row's path slots after its prefix
    supports_batches = True  # meta.base: each row's keys from its sequence's region

    def __init__(self, batches: bool = True):
        # False where the engine's row layout cannot take a step wider than the width
        # (select_attention): the kernel itself takes any rows at any bases
        self.supports_batches = batches

    def bind(self, engine: AttentionHost, meta: StepMeta) -> Attend:
        from hf_selfspec.kernels.attention import row_attention

        rows = meta.rows
        anc, base = triton_row_keys(meta.path, meta.base, rows, meta.slots.device)
        pad = meta.slots[:rows] == engine.trash_slot
        limit = meta.key_limit[:rows] + 1
        if meta.path.numel():  # a tree: the last c_r of a row's keys are its path slots
            limit = limit - (anc >= 0).sum(1)
        prefix_len = torch.where(pad, 0, limit).to(torch.int32)  # [R]
        k_cache, v_cache, scale = engine.k_cache, engine.v_cache, engine.view.scaling

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            o = row_attention(q.transpose(0, 1), k_cache[layer], v_cache[layer], prefix_len,
                              anc, scale, base)  # [R, Hq, d]
            return o.reshape(rows, -1)

        return attend


def triton_row_keys(path: torch.Tensor, base: torch.Tensor, rows: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`row_attention`'s (anc int32 [rows, A], base int32 [rows] or None) on `device` from a
    step's meta.path ([n, P], -1 padded; [0, 0] for chains) and meta.base ([n] or empty).

    A chain without bases needs no host data: anc is all -1, made on the device. Otherwise
    paths and bases go over in ONE copy (column 0 the base, then the path; rows n..rows-1
    are pad rows: base 0, no path). A path already on the device as int32 [rows, A] (the
    CUDA-graph runner's static buffer) is used as it is."""
    if not base.numel() and path.device == device and path.dtype == torch.int32 and path.shape[0] == rows:
        return path, None
    if not base.numel() and not path.numel():
        return torch.full((rows, 1), -1, dtype=torch.int32, device=device), None
    n, width = max(path.shape[0], base.shape[0]), max(path.shape[1], 1)
    host = torch.full((rows, 1 + width), -1, dtype=torch.int32)
    host[:, 0] = 0
    if base.numel():
        host[:n, 0] = base
    if path.numel():
        host[:n, 1:1 + path.shape[1]] = path
    keys = host.to(device)
    return keys[:, 1:], (keys[:, 0] if base.numel() else None)


def select_attention(device: torch.device, layout) -> BlockAttention | CppRowAttention | TritonAttention:
    """The backend for an engine on `device` with row layout `layout`: Triton on CUDA (with
    batched steps where the layout takes steps wider than its width), the C++ rows where
    the layout brought them (kernel), else the PyTorch block attention."""
    if device.type == "cuda":
        # a batched step holds up to BATCH_ROWS_PER_WIDTH times the width: only a layout
        # that computes every one of those rows can take it (the fixed layout pads or cuts
        # every product to exactly the width)
        wide = 2 * layout.width
        return TritonAttention(batches=layout.rows(wide) >= wide)
    if layout.kernel_attention is not None:
        return CppRowAttention(layout.kernel_attention, layout.kernel_attention_alibi,
                               layout.kernel_attention_sinks)
    return BlockAttention()


def uses_row_attention(engine: AttentionHost) -> bool:
    """Whether the engine's attention is the Triton kernel (CUDA) rather than a CPU backend."""
    return isinstance(engine.attention, TritonAttention)


def triton_attention(engine: AttentionHost, meta: StepMeta) -> Attend:
    """`TritonAttention().bind(engine, meta)` (the hook the CUDA tests call directly)."""
    return TritonAttention().bind(engine, meta)
