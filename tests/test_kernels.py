"""Row-invariant decode attention: Triton kernel vs the PyTorch reference, and the invariant.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (slow: cases are
few and small, chosen to cover head_dim 64/128, MHA/GQA, chains/trees, fp32/bf16).
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first triton import (the launcher imports triton lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the Triton kernel cannot run")

from hf_selfspec.kernels.attention import row_attention
from hf_selfspec.kernels.reference import row_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: both sides accumulate in fp32, only the summation order differs.
# bf16: inputs and output are bf16; one bf16 ulp at |x| ~ 1 is 2**-8.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def make_case(n, q_heads, kv_heads, head_dim, dtype, layout, seed, max_prefix=300, block=8):
    """Random queries, cache and row metadata.

    layout: "prefix" — a chain with everything in prefix_len, anc all -1;
            "chain"  — committed prefix + the row's ancestors in the current block;
            "tree"   — committed prefix + the row's path in a random tree over the block.
    Block slots live after every row's prefix, so no slot is listed twice for a row.
    """
    gen = torch.Generator().manual_seed(seed)
    num_slots = max_prefix + block + 5
    q = torch.randn(n, q_heads, head_dim, generator=gen)
    k_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen)
    # Per-row prefix lengths (odd ones, not multiples of the key block), 1 and max included.
    prefix_len = torch.randint(1, max_prefix + 1, (n,), generator=gen, dtype=torch.int32)
    prefix_len[0] = 1
    if n > 1:
        prefix_len[-1] = max_prefix
    anc = torch.full((n, block), -1, dtype=torch.int32)
    if layout != "prefix":
        first = max_prefix  # block slots are [max_prefix, max_prefix + block)
        if layout == "chain":
            parent = list(range(-1, block - 1))
        else:
            parent = [-1] + [
                int(torch.randint(-1, j, (1,), generator=gen)) for j in range(1, block)
            ]
        for i in range(n):
            node, path = i % block, []
            while node >= 0:  # walk up to the root: the row's path, its own slot included
                path.append(first + node)
                node = parent[node]
            anc[i, : len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
    tensors = [t.to(DEVICE) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype))]
    return (*tensors, prefix_len.to(DEVICE), anc.to(DEVICE), head_dim**-0.5)


CASES = [
    # n, Hq, Hkv, d, dtype, layout
    pytest.param(1, 4, 2, 64, torch.float32, "chain", id="fp32-d64-gqa2-chain-n1"),
    pytest.param(5, 2, 2, 64, torch.float32, "prefix", id="fp32-d64-mha-prefix-n5"),
    pytest.param(16, 2, 2, 128, torch.float32, "tree", id="fp32-d128-mha-tree-n16"),
    pytest.param(7, 4, 1, 128, torch.float32, "tree", id="fp32-d128-gqa4-tree-n7"),
    pytest.param(3, 2, 2, 128, torch.bfloat16, "chain", id="bf16-d128-mha-chain-n3"),
    pytest.param(16, 4, 2, 64, torch.bfloat16, "tree", id="bf16-d64-gqa2-tree-n16"),
]


@pytest.mark.parametrize("n, q_heads, kv_heads, head_dim, dtype, layout", CASES)
def test_matches_reference(n, q_heads, kv_heads, head_dim, dtype, layout):
    args = make_case(n, q_heads, kv_heads, head_dim, dtype, layout, seed=n)
    out = row_attention(*args)
    ref = row_attention_reference(*args)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])


@pytest.mark.parametrize(
    "head_dim, dtype", [(64, torch.float32), (128, torch.bfloat16)], ids=["fp32-d64", "bf16-d128"]
)
def test_row_alone_equals_row_among_16(head_dim, dtype):
    """The fixed-width promise: row i of a 16-row call is bit-equal to a 1-row call."""
    case = make_case(16, 2, 1, head_dim, dtype, "tree", seed=3)
    q, k_cache, v_cache, prefix_len, anc, scale = case
    batch = row_attention(q, k_cache, v_cache, prefix_len, anc, scale)
    for i in range(16):
        sl = slice(i, i + 1)
        alone = row_attention(q[sl], k_cache, v_cache, prefix_len[sl], anc[sl], scale)
        assert torch.equal(alone[0], batch[i]), f"row {i} differs between n=1 and n=16"


def test_row_sees_only_its_keys():
    """Only anc slots (not the whole block) count: changing another row's slot is invisible."""
    q, k_cache, v_cache, prefix_len, anc, scale = make_case(4, 2, 2, 64, torch.float32, "tree", 5)
    out = row_attention(q, k_cache, v_cache, prefix_len, anc, scale)
    seen = set(anc[0][anc[0] >= 0].tolist()) | set(range(int(prefix_len[0])))
    unseen = next(s for s in range(k_cache.shape[1]) if s not in seen)
    k2, v2 = k_cache.clone(), v_cache.clone()
    k2[:, unseen] += 5.0
    v2[:, unseen] += 5.0
    out2 = row_attention(q[:1], k2, v2, prefix_len[:1], anc[:1], scale)
    assert torch.equal(out2[0], out[0])


def test_row_with_only_its_own_slot():
    """prefix_len 0 and a single ancestor: attention to one key returns its value exactly."""
    q, k_cache, v_cache, _, _, scale = make_case(2, 2, 1, 64, torch.float32, "prefix", 7)
    prefix_len = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    anc = torch.tensor([[4, -1], [-1, 9]], dtype=torch.int32, device=DEVICE)
    out = row_attention(q, k_cache, v_cache, prefix_len, anc, scale)
    torch.testing.assert_close(out[0], v_cache[:, 4].expand(2, -1), atol=0, rtol=0)
    torch.testing.assert_close(out[1], v_cache[:, 9].expand(2, -1), atol=0, rtol=0)


def _bad_inputs():
    q, k, v, p, a, s = make_case(2, 4, 2, 64, torch.float32, "tree", seed=1, max_prefix=20)
    return {
        "q 2-d": ((q[:, 0], k, v, p, a, s), "q must be"),
        "heads not a multiple": ((q[:, :3], k, v, p, a, s), "multiple of KV heads"),
        "no query heads": ((q[:, :0], k, v, p, a, s), "at least one query head"),
        "no kv heads": ((q, k[:0], v[:0], p, a, s), "multiple of KV heads"),
        "no rows": ((q[:0], k, v, p[:0], a[:0], s), "at least one row"),
        "no slots": ((q, k[:, :0], v[:, :0], p, a, s), "no slots"),
        "head_dim 0": ((q[..., :0], k[..., :0], v[..., :0], p, a, s), "power of two"),
        "head_dim not pow2": ((q[..., :48], k[..., :48], v[..., :48], p, a, s), "power of two"),
        "head_dim mismatch": ((q, k[..., :32], v[..., :32], p, a, s), "head_dim"),
        "k/v shapes": ((q, k, v[:, :5], p, a, s), "shapes differ"),
        "fp16": ((q.half(), k.half(), v.half(), p, a, s), "float32 or bfloat16"),
        "cache dtype": ((q, k.bfloat16(), v, p, a, s), "k_cache dtype"),
        "prefix int64": ((q, k, v, p.long(), a, s), "prefix_len must be int32"),
        "prefix shape": ((q, k, v, p[:1], a, s), "prefix_len must be"),
        "anc 1-d": ((q, k, v, p, a[:, 0], s), "anc must be"),
        "anc empty": ((q, k, v, p, a[:, :0], s), "anc must be"),
        "scale nan": ((q, k, v, p, a, float("nan")), "scale"),
    }


@pytest.mark.parametrize("fn", [row_attention, row_attention_reference], ids=["kernel", "ref"])
def test_wrong_input_raises(fn):
    for name, (args, message) in _bad_inputs().items():
        with pytest.raises(ValueError, match=message):
            fn(*args)
            pytest.fail(f"no ValueError for {name}")


def test_package_imports_without_triton():
    """Importing hf_selfspec.kernels must not import triton (it is optional)."""
    code = "import sys, hf_selfspec.kernels; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
