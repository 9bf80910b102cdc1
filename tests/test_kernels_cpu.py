"""The CPU row kernels (kernels/cpu-rows/, in sections): x @ w^T, attention over the KV cache and a
whole decoder layer to fp32 rounding, with float32, bfloat16 and float16 weights and
caches, a row's result bit for bit the same whatever the other rows (the engine's `kernel`
layout); every bad argument refused with words that say what was wrong (the build lock: see
test_user_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_selfspec.kernels.cpu_rows import (
    NO_BASE,
    NO_PATH,
    build_directory,
    build_error,
    cpu_supports_kernel,
    load_rows_attention,
    load_rows_attention_alibi,
    load_rows_attention_sinks,
    load_rows_layer,
    load_rows_layers,
    load_rows_linear,
    load_rows_linear_heads,
    load_rows_linear_t,
    rows_attention_reference,
    rows_linear_reference,
    use_avx512,
    use_work_pool,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not cpu_supports_kernel(), reason="the kernel needs an AVX2/FMA CPU")


@pytest.fixture(scope="module")
def kernel():
    fn = load_rows_linear()
    assert fn is not None, f"the kernel did not build on an AVX2 machine: {build_error()}"
    return fn


@pytest.mark.parametrize("k", [1, 7, 8, 13, 16, 100, 576])  # tails of 8 and 16
@pytest.mark.parametrize("o", [1, 5, 64, 1000])  # tails of the weight-row tiles and thread splits
def test_matches_float64_reference(kernel, k, o):
    gen = torch.Generator().manual_seed(k * 1000 + o)
    w = torch.randn(o, k, generator=gen)
    for r in (1, 2, 3, 4, 5, 6, 7, 8, 11, 17, 22):  # > 16 rows: the 3 x 4 blocks
        x = torch.randn(r, k, generator=gen)
        y = kernel(x, w)
        assert y.shape == (r, o)
        torch.testing.assert_close(y, rows_linear_reference(x, w), rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("k, o", [(576, 1536), (1536, 576), (100, 333)])
def test_a_row_is_bit_identical_whatever_the_other_rows(kernel, k, o):
    gen = torch.Generator().manual_seed(o)
    w = torch.randn(o, k, generator=gen)
    row = torch.randn(1, k, generator=gen)
    alone = kernel(row, w)[0]
    for r in (2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 19, 24, 33):
        for place in {0, r // 2, r - 1}:
            x = torch.randn(r, k, generator=gen)
            x[place] = row[0]
            assert torch.equal(kernel(x, w)[place], alone), (r, place)


def test_bad_input_is_refused(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.randn(8, 2).t(), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="x \\[R, K\\]"):
        kernel(torch.randn(2, 8), torch.randn(4, 9))


@pytest.fixture(scope="module")
def attention():
    fn = load_rows_attention()
    assert fn is not None, f"the kernel did not build on an AVX2 machine: {build_error()}"
    return lambda q, k, v, limit, scale, path=NO_PATH, base=NO_BASE, softcap=0.0, window=0: fn(
        q, k, v, limit, scale, path, base, softcap, window)


def _cache(gen, hkv, slots, d):
    return torch.randn(hkv, slots, d, generator=gen), torch.randn(hkv, slots, d, generator=gen)


# 576: a latent head
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 16), (4, 2, 12), (2, 1, 128), (16, 1, 576)])
def test_attention_matches_float64_reference(attention, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * 100 + d)
    k, v = _cache(gen, hkv, 1100, d)
    # past 512 keys a row's keys are summed in chunks of 512, then merged: 1, 2 and 3 chunks
    for limits in ([0], [5], [3, 4, 5, 6], [255, 256, 257], [599, 17, 300, 1, 2, 3, 4, 598],
                   [510, 511, 512, 513], [1023, 1024, 1099, 40]):
        q = torch.randn(len(limits), hq, d, generator=gen)
        lim = torch.tensor(limits)
        o = attention(q, k, v, lim, d ** -0.5)
        assert o.shape == (len(limits), hq * d)
        torch.testing.assert_close(o, rows_attention_reference(q, k, v, lim, d ** -0.5),
                                   rtol=1e-5, atol=1e-5)


def test_attention_row_is_bit_identical_whatever_the_other_rows(attention):
    """A row's output depends on its query, its key limit and the cache up to that limit
    only: not on the number of rows, their places or how far the others see."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 9, 3, 64
    k, v = _cache(gen, hkv, 1100, d)
    q_row = torch.randn(1, hq, d, generator=gen)
    for limit in (0, 3, 254, 255, 256, 511, 512, 700, 1024):
        alone = attention(q_row, k, v, torch.tensor([limit]), 0.125)[0]
        for r in (2, 3, 4, 5, 8, 9):
            for place in {0, r // 2, r - 1}:
                q = torch.randn(r, hq, d, generator=gen)
                q[place] = q_row[0]
                lim = torch.randint(0, 1100, (r,), generator=gen)
                lim[place] = limit
                assert torch.equal(attention(q, k, v, lim, 0.125)[place], alone), (limit, r, place)
        # slots past the limit are never read
        k2, v2 = k.clone(), v.clone()
        k2[:, limit + 1:] = float("nan")
        v2[:, limit + 1:] = float("nan")
        assert torch.equal(attention(q_row, k2, v2, torch.tensor([limit]), 0.125)[0], alone)


def test_attention_bad_input_is_refused(attention):
    gen = torch.Generator().manual_seed(0)
    k, v = _cache(gen, 2, 16, 8)
    q = torch.randn(2, 4, 8, generator=gen)
    with pytest.raises(RuntimeError, match="outside the cache"):
        attention(q, k, v, torch.tensor([3, 16]), 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        attention(q, k, v, torch.tensor([3, 4], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        attention(torch.randn(2, 3, 8), k, v, torch.tensor([3, 4]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        attention(q.double(), k, v, torch.tensor([3, 4]), 1.0)


def _tree_case(gen, pos0, depth, hkv=3, d=64, slots=700):
    """A cache where a chain row at position pos0 + depth sees slots [0, pos0 + depth], and
    the same keys and values laid out as a tree: the prefix in place, the path's keys at
    scattered slots (what a draft tree's rows write), everything else NaN."""
    k, v = _cache(gen, hkv, slots, d)
    chain_k, chain_v = k.clone(), v.clone()
    path = sorted(torch.randperm(slots - pos0 - 1, generator=gen)[:depth] + pos0 + 1)
    path = [pos0] + [int(s) for s in path]  # row 0 of a tree sits at slot pos0
    tree_k = torch.full_like(k, float("nan"))
    tree_v = torch.full_like(v, float("nan"))
    tree_k[:, :pos0], tree_v[:, :pos0] = k[:, :pos0], v[:, :pos0]
    for i, slot in enumerate(path):
        tree_k[:, slot], tree_v[:, slot] = chain_k[:, pos0 + i], chain_v[:, pos0 + i]
    return chain_k, chain_v, tree_k, tree_v, path


@pytest.mark.parametrize("pos0", [1, 4, 7, 255, 300, 508])  # 508: paths across a 512-key chunk
def test_attention_tree_row_is_bit_identical_to_the_chain_row(attention, pos0):
    """A tree row sees the committed prefix plus its own path's slots, in depth order, and
    computes exactly what the chain row at the same position computes (same keys, same
    order, same arithmetic); slots off its path (other branches, NaN here) are never read."""
    gen = torch.Generator().manual_seed(pos0)
    hq, d = 9, 64
    for depth in range(0, 7):
        chain_k, chain_v, tree_k, tree_v, path = _tree_case(gen, pos0, depth)
        q = torch.randn(3, hq, d, generator=gen)
        chain = attention(q, chain_k, chain_v, torch.tensor([pos0 + depth] * 3), 0.125)
        table = torch.full((3, 8), -1, dtype=torch.long)
        table[:, : depth + 1] = torch.tensor(path)
        tree = attention(q, tree_k, tree_v, torch.tensor([pos0 + depth] * 3), 0.125, table)
        assert torch.equal(tree, chain), (pos0, depth)
        # mixed with chain rows (no path) in one call: each row as alone
        table[1] = -1
        mixed = attention(q, chain_k, chain_v, torch.tensor([pos0 + depth] * 3), 0.125,
                          torch.where(table >= 0, torch.arange(pos0, pos0 + 8), -1))
        assert torch.equal(mixed, chain)


@pytest.mark.parametrize("d", [64, 12, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_scores_are_the_same_whichever_dot_product_computes_them(attention, d, dtype):
    """Contiguous keys go through the 8-key and 4-key dot products in tiles (a 16-bit cache's
    tile widened once for all rows and heads), path keys one at a time (`dot`, widened in
    registers): a row whose every key is a path slot equals the row that sees them
    contiguous, bit for bit, so all of them compute each score and weighted sum alike (d 12:
    the scalar tails too; 37 and 130 keys: more than one tile)."""
    gen = torch.Generator().manual_seed(d)
    for L in (1, 5, 8, 13, 37, 130, 600):
        k = torch.randn(3, 640, d, generator=gen).to(dtype)
        v = torch.randn(3, 640, d, generator=gen).to(dtype)
        q = torch.randn(2, 9, d, generator=gen)
        contiguous = attention(q, k, v, torch.tensor([L - 1] * 2), 0.125)
        path = torch.arange(L).repeat(2, 1)
        as_path = attention(q, k, v, torch.tensor([L - 1] * 2), 0.125, path)
        assert torch.equal(as_path, contiguous), (d, L)


def test_attention_soft_cap_matches_float64_reference(attention):
    """softcap > 0 (Gemma 2): every score s becomes softcap * tanh(s / softcap) before the
    softmax, on contiguous and tree keys, over several key chunks; a row alone computes what
    it computes among others."""
    gen = torch.Generator().manual_seed(5)
    k, v = _cache(gen, 2, 1100, 16)
    q = 3 * torch.randn(6, 4, 16, generator=gen)  # scores of several units: the cap matters
    lim = torch.tensor([0, 7, 300, 511, 700, 1099])
    o = attention(q, k, v, lim, 0.25, softcap=2.0)
    torch.testing.assert_close(o, rows_attention_reference(q, k, v, lim, 0.25, softcap=2.0), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(o, attention(q, k, v, lim, 0.25), rtol=1e-3, atol=1e-3)
    alone = attention(q[3:4].contiguous(), k, v, lim[3:4], 0.25, softcap=2.0)
    assert torch.equal(alone[0], o[3])
    path = torch.tensor([[100, -1], [100, 102]])
    tree = attention(q[:2].contiguous(), k, v, torch.tensor([100, 101]), 0.25, path, softcap=2.0)
    torch.testing.assert_close(tree, rows_attention_reference(q[:2], k, v, torch.tensor([100, 101]), 0.25, path,
                                                              softcap=2.0), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        attention(q, k, v, lim, 0.25, softcap=-1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_alibi_matches_float64_reference(dtype):
    """rows_attention_alibi: each score plus its head's slope times the logical key index
    (Bloom's ALiBi), for chains across key chunks, tree rows (their path keys at their own
    positions), rows of several sequences (base), with a window; a row alone == among others,
    and slopes of zero == rows_attention bit for bit."""
    alibi, plain = load_rows_attention_alibi(), load_rows_attention()
    gen = torch.Generator().manual_seed(12)
    k, v = (t.to(dtype) for t in _cache(gen, 2, 1200, 16))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    q = torch.randn(6, 4, 16, generator=gen)
    lim = torch.tensor([0, 5, 40, 530, 700, 1099])
    for window in (0, 40):
        o = alibi(q, k, v, lim, 0.25, NO_PATH, NO_BASE, 0.0, window, slopes)
        torch.testing.assert_close(o, rows_attention_reference(q, k, v, lim, 0.25, window=window, slopes=slopes),
                                   rtol=1e-4, atol=1e-4)
        for r in (0, 3, 5):
            alone = alibi(q[r:r + 1].contiguous(), k, v, lim[r:r + 1], 0.25, NO_PATH, NO_BASE, 0.0, window, slopes)
            assert torch.equal(alone[0], o[r])
    zero = alibi(q, k, v, lim, 0.25, NO_PATH, NO_BASE, 0.0, 0, torch.zeros(4))
    assert torch.equal(zero, plain(q, k, v, lim, 0.25, NO_PATH, NO_BASE, 0.0, 0))
    q3, lim, base = _tree_and_batch_rows_match_reference(alibi, gen, k, v, slopes=slopes)
    with pytest.raises(RuntimeError, match=r"slopes must be a contiguous float32 CPU tensor \[Hq\] = \[4\]"):
        alibi(q3, k, v, lim, 0.25, NO_PATH, base, 0.0, 0, torch.zeros(3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_sinks_match_float64_reference(dtype):
    """rows_attention_sinks: one more logit per head in the softmax's denominator (GPT-OSS),
    sinks below and far above the scores (the exponentials taken relative to the larger),
    for chains across key chunks, tree rows, rows of several sequences (base), with a window
    and a soft cap; a row alone == among others; the kernel refuses bad sinks."""
    sinks_fn = load_rows_attention_sinks()
    gen = torch.Generator().manual_seed(13)
    k, v = (t.to(dtype) for t in _cache(gen, 2, 1200, 16))
    q = torch.randn(6, 4, 16, generator=gen)
    lim = torch.tensor([0, 5, 40, 530, 700, 1099])
    for sinks in (torch.tensor([-3.0, 0.0, 1.5, 4.0]), torch.tensor([200.0, -200.0, 60.0, 2.0])):
        for window, softcap in ((0, 0.0), (40, 2.0)):
            o = sinks_fn(q, k, v, lim, 0.25, NO_PATH, NO_BASE, softcap, window, sinks)
            torch.testing.assert_close(o, rows_attention_reference(q, k, v, lim, 0.25, softcap=softcap, window=window,
                                                                   sinks=sinks), rtol=1e-4, atol=1e-4)
            for r in (0, 3, 5):
                alone = sinks_fn(q[r:r + 1].contiguous(), k, v, lim[r:r + 1], 0.25, NO_PATH, NO_BASE, softcap, window,
                                 sinks)
                assert torch.equal(alone[0], o[r])
    q3, lim, base = _tree_and_batch_rows_match_reference(sinks_fn, gen, k, v, sinks=sinks)
    with pytest.raises(RuntimeError, match=r"sinks must be a contiguous float32 CPU tensor \[Hq\] = \[4\]"):
        sinks_fn(q3, k, v, lim, 0.25, NO_PATH, base, 0.0, 0, torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="sinks must be finite"):
        sinks_fn(q3, k, v, lim, 0.25, NO_PATH, base, 0.0, 0, torch.tensor([0.0, float("nan"), 0.0, 0.0]))


def _tree_and_batch_rows_match_reference(fn, gen, k, v, **extra):
    """fn (rows_attention_alibi / _sinks, its last argument extra's one value) on 3 tree rows
    (their path keys at their own positions) and 3 rows of several sequences (base) equals
    the float64 reference; -> (q, limit, base) of the batch, for further calls."""
    (value,) = extra.values()
    q3 = torch.randn(3, 4, 16, generator=gen)
    path = torch.tensor([[100, -1, -1], [100, 102, -1], [100, 103, 105]])
    lim = torch.tensor([100, 101, 102])
    tree = fn(q3, k, v, lim, 0.25, path, NO_BASE, 0.0, 0, value)
    torch.testing.assert_close(tree, rows_attention_reference(q3, k, v, lim, 0.25, path, **extra),
                               rtol=1e-4, atol=1e-4)
    base = torch.tensor([0, 300, 600])
    lim = torch.tensor([20, 250, 590])
    batched = fn(q3, k, v, lim, 0.25, NO_PATH, base, 0.0, 0, value)
    torch.testing.assert_close(batched, rows_attention_reference(q3, k, v, lim, 0.25, None, base, **extra),
                               rtol=1e-4, atol=1e-4)
    return q3, lim, base


def test_attention_sliding_window_matches_float64_reference(attention):
    """window > 0: row r sees only its logical keys j > limit[r] - window: rows within the
    window, past it inside one key chunk, across a chunk edge, with whole chunks before the
    window skipped (limit 1099, window 40); tree rows whose path reaches below the window
    (window 2, paths of 3); rows of several sequences (base) alike; a row alone == among
    others."""
    gen = torch.Generator().manual_seed(9)
    k, v = _cache(gen, 2, 1200, 16)
    for window in (1, 2, 40, 600):
        q = torch.randn(7, 4, 16, generator=gen)
        lim = torch.tensor([0, 5, 39, 40, 530, 700, 1099])
        o = attention(q, k, v, lim, 0.25, window=window)
        torch.testing.assert_close(o, rows_attention_reference(q, k, v, lim, 0.25, window=window),
                                   rtol=1e-5, atol=1e-5)
        for r in (0, 4, 6):
            assert torch.equal(attention(q[r:r + 1].contiguous(), k, v, lim[r:r + 1], 0.25, window=window)[0], o[r])
    q = torch.randn(3, 4, 16, generator=gen)
    path = torch.tensor([[100, -1, -1], [100, 102, -1], [100, 103, 105]])
    lim = torch.tensor([100, 101, 102])
    tree = attention(q, k, v, lim, 0.25, path, window=2)
    torch.testing.assert_close(tree, rows_attention_reference(q, k, v, lim, 0.25, path, window=2), rtol=1e-5,
                               atol=1e-5)
    base = torch.tensor([0, 300, 600])
    lim = torch.tensor([20, 250, 590])
    batched = attention(q, k, v, lim, 0.25, NO_PATH, base, window=30)
    torch.testing.assert_close(batched, rows_attention_reference(q, k, v, lim, 0.25, None, base, window=30),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        attention(q, k, v, lim, 0.25, window=-1)


def test_attention_tree_matches_float64_reference(attention):
    gen = torch.Generator().manual_seed(3)
    k, v = _cache(gen, 2, 300, 16)
    q = torch.randn(4, 4, 16, generator=gen)
    path = torch.tensor([[100, -1, -1], [100, 102, -1], [100, 103, -1], [100, 103, 105]])
    lim = torch.tensor([100, 101, 101, 102])
    o = attention(q, k, v, lim, 0.25, path)
    torch.testing.assert_close(o, rows_attention_reference(q, k, v, lim, 0.25, path), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_rows_with_a_base_equal_the_sequence_alone(attention, dtype):
    """Batches: rows of three sequences, each in its own KV region (base), chains and a
    tree path mixed in one call, each row bit-identical to its sequence decoded alone at
    slot 0 (the keys copied there), and the region's neighbours (NaN) never read."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 9, 3, 64
    bases, lengths = [0, 300, 320], [257, 5, 600]  # 600: two key chunks
    k = torch.full((hkv, 1100, d), float("nan"))
    v = torch.full((hkv, 1100, d), float("nan"))
    alone = []
    for b, n in zip(bases, lengths):
        ka, va = (t.to(dtype) for t in _cache(gen, hkv, n + 8, d))
        k[:, b:b + n + 8], v[:, b:b + n + 8] = ka.float(), va.float()
        alone.append((ka, va))
    k, v = k.to(dtype), v.to(dtype)
    # per sequence: a chain row at its last position and a tree row (path after the prefix)
    q = torch.randn(6, hq, d, generator=gen)
    rows_seq = [0, 0, 1, 1, 2, 2]
    limit = torch.tensor([lengths[s] - 1 + i % 2 * 2 for i, s in enumerate(rows_seq)])
    path = torch.full((6, 3), -1, dtype=torch.long)
    for i, s in enumerate(rows_seq):
        if i % 2:  # two path slots after the prefix [0, lengths - 1]: slots n + 1 and n + 3
            path[i, :2] = torch.tensor([lengths[s] + 1, lengths[s] + 3])
    base = torch.tensor([bases[s] for s in rows_seq])
    batched = attention(q, k, v, limit, 0.125, path + torch.where(path >= 0, base[:, None], 0), base)
    assert not batched.isnan().any()
    for i, s in enumerate(rows_seq):
        ka, va = alone[s]
        one = attention(q[i:i + 1], ka, va, limit[i:i + 1], 0.125, path[i:i + 1])
        assert torch.equal(batched[i], one[0]), i
    torch.testing.assert_close(
        batched, rows_attention_reference(q, k.float().nan_to_num(), v.float().nan_to_num(), limit, 0.125,
                                          path + torch.where(path >= 0, base[:, None], 0), base),
        rtol=1e-5, atol=1e-5)


def test_attention_bad_base_is_refused(attention):
    gen = torch.Generator().manual_seed(0)
    k, v = _cache(gen, 2, 16, 8)
    q = torch.randn(2, 4, 8, generator=gen)
    lim = torch.tensor([3, 4])
    with pytest.raises(RuntimeError, match="keys are outside the cache"):
        attention(q, k, v, lim, 1.0, NO_PATH, torch.tensor([0, 12]))
    with pytest.raises(RuntimeError, match="keys are outside the cache"):
        attention(q, k, v, lim, 1.0, NO_PATH, torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="base int64"):
        attention(q, k, v, lim, 1.0, NO_PATH, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="base int64"):
        attention(q, k, v, lim, 1.0, NO_PATH, torch.tensor([0.0, 1.0]))


def test_attention_bad_tree_path_is_refused(attention):
    gen = torch.Generator().manual_seed(0)
    k, v = _cache(gen, 2, 16, 8)
    q = torch.randn(2, 4, 8, generator=gen)
    with pytest.raises(RuntimeError, match="path slot is outside"):
        attention(q, k, v, torch.tensor([3, 4]), 1.0, torch.tensor([[3, 16], [4, -1]]))
    with pytest.raises(RuntimeError, match="longer than its keys"):
        attention(q, k, v, torch.tensor([0, 4]), 1.0, torch.tensor([[0, 5], [4, -1]]))
    with pytest.raises(RuntimeError, match="path int64"):
        attention(q, k, v, torch.tensor([3, 4]), 1.0, torch.tensor([[3], [4], [5]]))


# ---- argument validation: each bad argument raises with words that say what was wrong ----

@pytest.fixture(scope="module")
def kernel_t():
    fn = load_rows_linear_t()
    assert fn is not None, f"the kernel did not build on an AVX2 machine: {build_error()}"
    return fn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, o", [(1, 1), (3, 5), (13, 37), (64, 1000), (768, 2304), (3072, 768)])
def test_transposed_product_matches_float64_and_is_row_invariant(kernel_t, dtype, k, o):
    """rows_linear_t(x, wt) for weights stored [K, O] (GPT-2's Conv1D): each output one FMA
    chain over k, so a row's bits are its own for any R and place, and a column's are the
    same read from a column slice (there it may fall in the 8-lane part or the tail)."""
    gen = torch.Generator().manual_seed(k * 7 + o)
    wt = torch.randn(k, o, generator=gen).to(dtype)
    row = torch.randn(1, k, generator=gen)
    alone = kernel_t(row, wt)[0]
    for r in (1, 2, 3, 5, 8, 17):
        x = torch.randn(r, k, generator=gen)
        y = kernel_t(x, wt)
        reference = (x.double() @ wt.double()).float()
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * k ** 0.5)
        for place in {0, r // 2, r - 1}:
            x[place] = row[0]
            assert torch.equal(kernel_t(x, wt)[place], alone), (r, place)
    for lo, hi in {(min(3, o - 1), o), (0, max(1, o - 5)), (min(9, o - 1), o)}:
        assert torch.equal(kernel_t(row, wt[:, lo:hi])[0], alone[lo:hi]), (lo, hi)


def test_transposed_product_bad_arguments_are_refused(kernel_t):
    x, wt = torch.randn(2, 8), torch.randn(8, 4)
    cases = [
        ((x.double(), wt), "x must be float32, bfloat16 or float16"),
        ((x, wt.to(torch.int32)), "wt must be a 2-D float32/bfloat16/float16 CPU tensor"),
        ((x, torch.randn(4, 8).t()), "unit column stride"),
        ((x, wt[None]), "wt must be a 2-D"),
        ((torch.randn(0, 8), wt), "empty input"),
        ((x, torch.randn(8, 0)), "empty input"),
        ((x, torch.randn(9, 4)), "must share K"),
        ((x, wt.to("meta")), "CPU tensor"),
    ]
    for args, words in cases:
        _bad(kernel_t, args, words)


@pytest.mark.parametrize("pool", [False, True], ids=["openmp", "pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_products_equal_each_heads_product(kernel, kernel_t, dtype, pool):
    """rows_linear_heads (latent attention's per-head products, views of one weight): head
    h's rows == rows_linear / rows_linear_t of them alone, bit for bit, for 1 to 33 rows (the
    16-bit paired-row tiles from 32), in torch's team and in the work pool; bad arguments
    refused with the reason."""
    heads = load_rows_linear_heads()
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(7 * 40, 20, generator=gen).to(dtype)  # per head 40 rows: 16 "key", 24 "value"
    up = [weight[h * 40 + 16:(h + 1) * 40] for h in range(7)]  # [24, 20] each, contiguous
    down = [weight[h * 40:h * 40 + 16] for h in range(7)]  # wt [K=16, O=20] each
    try:
        use_work_pool(pool)
        for rows in (1, 3, 33):
            x = torch.randn(7, rows, 20, generator=gen).to(dtype)
            expected = torch.stack([kernel(x[h], up[h]) for h in range(7)])
            assert torch.equal(heads(x, up, False), expected), rows
            xt = torch.randn(7, rows, 16, generator=gen)
            expected = torch.stack([kernel_t(xt[h], down[h]) for h in range(7)])
            assert torch.equal(heads(xt, down, True), expected), rows
    finally:
        use_work_pool(False)
    x = torch.randn(7, 2, 20)
    cases = [((x[:, :, :8], up, False), "contiguous"), ((x, up[:6], False), "one weight per head"),
             ((x, [w.float() for w in up[:6]] + [up[6].double()], False), "one float dtype"),
             ((x, [w.t() for w in up], False), "w \\[O, K\\] contiguous"),
             ((x, up, True), "wt \\[K, O\\] with unit column stride"), ((x[:0], up, False), "empty x")]
    for args, words in cases:
        _bad(heads, args, words)


def _bad(fn, args, words):
    with pytest.raises(RuntimeError, match=words):
        fn(*args)


def test_linear_bad_arguments_are_refused(kernel):
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    cases = [
        ((x.double(), w), "x must be float32, bfloat16 or float16"),
        ((x, w.to(torch.int32)), "w must be float32, bfloat16 or float16"),
        ((x, torch.randn(4, 16)[:, ::2]), "w must be contiguous"),
        ((x[0], w), "x must be 2-D"),
        ((x, w[None]), "w must be 2-D"),
        ((torch.randn(0, 8), w), "empty input"),
        ((torch.randn(2, 0), torch.randn(4, 0)), "empty input"),
        ((x, torch.randn(0, 8)), "empty input"),
        ((x, torch.randn(4, 9)), "must share K"),
        ((x.to("meta"), w), "x must be a CPU tensor"),
        ((x, w.to("meta")), "w must be a CPU tensor"),
    ]
    for args, words in cases:
        _bad(kernel, args, words)


def test_attention_bad_arguments_are_refused(attention):
    gen = torch.Generator().manual_seed(0)
    k, v = _cache(gen, 2, 16, 8)
    q = torch.randn(2, 4, 8, generator=gen)
    lim = torch.tensor([3, 4])
    cases = [
        ((torch.randn(2, 0, 8), k, v, lim, 1.0), "empty q"),
        ((torch.randn(0, 4, 8), k, v, torch.zeros(0, dtype=torch.long), 1.0), "empty q"),
        ((torch.randn(2, 4, 0), torch.randn(2, 16, 0), torch.randn(2, 16, 0), lim, 1.0), "empty cache"),
        ((q, torch.randn(0, 16, 8), torch.randn(0, 16, 8), lim, 1.0), "empty cache"),
        ((q, torch.randn(2, 0, 8), torch.randn(2, 0, 8), lim, 1.0), "empty cache"),
        ((torch.randn(2, 3, 8), k, v, lim, 1.0), "multiple of KV heads"),
        ((q, k, v[:, :8], lim, 1.0), "both be \\[Hkv, S, d\\]"),
        ((q, k, v.double(), lim, 1.0), "k and v caches must both be float32"),
        ((q, k.bfloat16(), v, lim, 1.0), "k and v caches must both be float32"),
        ((q, k[..., :4].contiguous(), v[..., :4].contiguous(), lim, 1.0), "the same d"),
        ((q[:, :, :4], k[..., ::2], v[..., ::2], lim, 1.0), "caches must be contiguous"),
        ((q.transpose(0, 1), torch.randn(2, 16, 8), torch.randn(2, 16, 8), lim, 1.0), "q must be contiguous"),
        ((torch.randn(2, 4, 1032), torch.randn(2, 16, 1032), torch.randn(2, 16, 1032), lim, 1.0), "head_dim <= 1024"),
        ((q, k, v, torch.tensor([3]), 1.0), "limit must be int64 \\[R\\] with R = 2"),
        ((q, k, v, lim[None], 1.0), "limit must be int64 \\[R\\]"),
        ((q, k, v, torch.tensor([-1, 4]), 1.0), "key limit is outside the cache"),
        ((q, k, v, lim, float("nan")), "scale must be finite"),
        ((q, k, v, lim, float("inf")), "scale must be finite"),
        ((q.to("meta"), k, v, lim, 1.0), "q must be a CPU tensor"),
        ((q, k.to("meta"), v.to("meta"), lim, 1.0), "caches must be CPU tensors"),
        ((q, k, v, lim.to("meta"), 1.0), "limit must be a CPU tensor"),
        ((q, k, v, lim, 1.0, torch.tensor([[3, 16], [4, -1]])), "path slot is outside"),
        ((q, k, v, lim, 1.0, torch.tensor([[3, 4], [4, -1]], dtype=torch.int32)), "path int64"),
        ((q, k, v, lim, 1.0, torch.zeros(2, 0).long().to("meta")), "path int64 \\[R, P\\] must be a CPU"),
    ]
    for args, words in cases:
        _bad(attention, args, words)


# ---- a decoder layer --------------------------------------------------------------------

@pytest.fixture(scope="module")
def layer():
    fn = load_rows_layer()
    assert fn is not None, f"the kernel did not build on an AVX2 machine: {build_error()}"
    return fn


def _layer_case(gen, H=76, Hq=4, Hkv=2, d=12, inter=150, S=40, R=3, qk_norm=False, out_norms=False, gemma=False,
                pairs=False, biases=None, dtype=torch.float32, cache_dtype=torch.float32):
    """Random weights (dtype), cache (cache_dtype) and R chain rows at slots 20.. of a
    cache whose slots before them hold earlier keys. out_norms: OLMo 2's form (no input or
    post norm, q/k norms over the whole projection, the blocks' outputs normed); gemma: Gemma
    2/3's (all four norms and per-head q/k norms, scaling by 1 + w around 0; GELU; scores
    soft-capped at 2; a sliding window of 9 keys); pairs: RoPE turning adjacent pairs (GLM,
    ERNIE 4.5), its tables each angle twice in a row; biases: the projections (of q, k, v, o,
    gate, up, down) given a bias, the others an empty tensor (the 20-weight form)."""
    def mat(o, i):
        return (torch.randn(o, i, generator=gen) / i ** 0.5).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    w = [norm(H), mat(Hq * d, H), mat(Hkv * d, H), mat(Hkv * d, H), mat(H, Hq * d), norm(H),
         mat(inter, H), mat(inter, H), mat(H, inter)]
    if qk_norm:
        w += [norm(d), norm(d)]
    if out_norms:
        none = torch.empty(0, dtype=dtype)
        w[0], w[5] = none, none
        w += [norm(Hq * d), norm(Hkv * d), norm(H), norm(H)]
    if gemma:
        w += [norm(d), norm(d), norm(H), norm(H)]
        for i in (0, 5, 9, 10, 11, 12):  # weights around 0: the norms scale by 1 + w
            w[i] = w[i] - 1
    if biases is not None:  # the 20-weight form: absent norms empty, then the 7 biases
        none = torch.empty(0, dtype=dtype)
        w += [none] * (13 - len(w))
        sizes = dict(q=Hq * d, k=Hkv * d, v=Hkv * d, o=H, gate=inter, up=inter, down=H)
        w += [(0.5 * torch.randn(n, generator=gen)).to(dtype) if name in biases else none
              for name, n in sizes.items()]
    k_cache = torch.randn(Hkv, S, d, generator=gen).to(cache_dtype)
    v_cache = torch.randn(Hkv, S, d, generator=gen).to(cache_dtype)
    h = torch.randn(R, H, generator=gen)
    pos = torch.arange(20, 20 + R)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos[:, None].float() * inv[None]
    ang = ang.repeat_interleave(2, -1) if pairs else torch.cat([ang, ang], -1)
    if gemma:
        h = 4 * h  # scores of several units: the cap matters
    return dict(h=h, weights=w, k_cache=k_cache, v_cache=v_cache, cos=ang.cos(), sin=ang.sin(),
                slots=pos.clone(), limit=pos.clone(), eps=1e-5, scale=d ** -0.5, residual_scale=1.0, path=NO_PATH,
                base=NO_BASE, norm_offset=1.0 if gemma else 0.0, gelu=gemma, softcap=2.0 if gemma else 0.0,
                window=9 if gemma else 0, rope_pairs=pairs)


def _call(layer, case, **changes):
    c = {**case, **changes}
    return layer(c["h"], c["weights"], c["k_cache"], c["v_cache"], c["cos"], c["sin"], c["slots"],
                 c["limit"], c["eps"], c["scale"], c["residual_scale"], c["path"], c["base"], *_layer_form(c))


def _layer_form(case) -> tuple:
    """rows_layer(s)'s last arguments: norm_offset, gelu, softcap, window, rope_pairs."""
    return case["norm_offset"], case["gelu"], case["softcap"], case["window"], case["rope_pairs"]


def _layer_reference(case):
    """What rows_layer computes, in float64 (the cache written in its own dtype)."""
    c = case
    eps, W = c["eps"], [t.double() for t in c["weights"]]
    Hkv, S, d = c["k_cache"].shape
    R, H = c["h"].shape
    Hq = W[1].shape[0] // d

    def rms(x, g):  # an empty weight: no norm; Gemma's scale by 1 + w
        return x if g.numel() == 0 else (g + c["norm_offset"]) * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))

    bias = dict(zip((1, 2, 3, 4, 6, 7, 8), W[13:20])) if len(W) == 20 else {}

    def lin(x, i):  # projection i, plus its bias where the 20-weight form gives one
        y = x @ W[i].T
        return y + bias[i] if i in bias and bias[i].numel() else y

    def rope(t):  # on the first cos.shape[-1] dimensions of each head (partial rotary)
        r = c["cos"].shape[-1]
        turned, half = t[..., :r], r // 2
        if c["rope_pairs"]:  # (-x[2j + 1], x[2j]) interleaved
            rot = torch.stack([-turned[..., 1::2], turned[..., 0::2]], -1).flatten(-2)
        else:
            rot = torch.cat([-turned[..., half:], turned[..., :half]], -1)
        return torch.cat([turned * c["cos"].double()[:, None] + rot * c["sin"].double()[:, None], t[..., r:]], -1)

    h = c["h"].double()
    x = rms(h, W[0])
    q, k, v = lin(x, 1), lin(x, 2), lin(x, 3).view(R, Hkv, d)
    whole = len(W) > 9 and W[9].numel() == Hq * d  # OLMo 2: over the whole projection
    if whole:
        q, k = rms(q, W[9]), rms(k, W[10])
    q, k = q.view(R, Hq, d), k.view(R, Hkv, d)
    if len(W) > 9 and not whole and W[9].numel():
        q, k = rms(q, W[9]), rms(k, W[10])
    q, k = rope(q), rope(k)
    kc, vc = c["k_cache"].double().clone(), c["v_cache"].double().clone()
    for r in range(R):  # the kernel stores its float32 K/V rounded to the cache dtype
        kc[:, c["slots"][r]] = k[r].float().to(c["k_cache"].dtype).double()
        vc[:, c["slots"][r]] = v[r].float().to(c["v_cache"].dtype).double()
    o = rows_attention_reference(q, kc, vc, c["limit"], c["scale"], c["path"], c["base"], c["softcap"], c["window"])
    no_norm = W[0].new_empty(0)
    attn_norm, mlp_norm = (W[11], W[12]) if len(W) >= 13 else (no_norm, no_norm)
    h1 = h + rms(lin(o, 4), attn_norm) * c["residual_scale"]
    x = rms(h1, W[5])
    act = F.gelu(lin(x, 6), approximate="tanh") if c["gelu"] else F.silu(lin(x, 6))
    return h1 + rms(lin(act * lin(x, 7), 8), mlp_norm) * c["residual_scale"]


LAYER_SHAPES = [  # odd shapes (hidden, intermediate not multiples of 8 / 16), d 12 and 64
    dict(H=76, Hq=4, Hkv=2, d=12, inter=150),
    dict(H=100, Hq=3, Hkv=1, d=64, inter=37, qk_norm=True),
    dict(H=76, Hq=4, Hkv=2, d=12, inter=150, out_norms=True),
    dict(H=76, Hq=4, Hkv=2, d=12, inter=150, gemma=True),
    dict(H=76, Hq=4, Hkv=2, d=12, inter=150, pairs=True),
    dict(H=76, Hq=4, Hkv=2, d=12, inter=150, biases=("q", "k", "v")),  # Qwen2's
    dict(H=100, Hq=3, Hkv=1, d=64, inter=37, qk_norm=True, biases=("q", "k", "v", "o", "gate", "up", "down")),
]
LAYER_IDS = ["d12", "d64-qknorm", "d12-output-norms", "d12-gemma", "d12-rope-pairs", "d12-qkv-biases",
             "d64-qknorm-all-biases"]


@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=LAYER_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual_scale", [1.0, 0.22])  # 0.22: Granite's residual_multiplier
def test_layer_matches_float64_reference(layer, shape, dtype, cache_dtype, residual_scale):
    gen = torch.Generator().manual_seed(11)
    case = _layer_case(gen, R=5, dtype=dtype, cache_dtype=cache_dtype, **shape)
    case["residual_scale"] = residual_scale
    k0 = case["k_cache"].clone()
    out = _call(layer, case)
    assert out.dtype == torch.float32 and out.shape == case["h"].shape
    ref = _layer_reference({**case, "k_cache": k0, "v_cache": case["v_cache"]})
    tol = 1e-4 if cache_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=LAYER_IDS)
def test_layer_partial_rotary_matches_float64_reference(layer, shape):
    """cos/sin narrower than the head (partial rotary): RoPE on each head's first rot
    dimensions, the rest as they are; a row still equals itself alone."""
    gen = torch.Generator().manual_seed(13)
    case = _layer_case(gen, R=5, **shape)
    rot = shape["d"] // 2 if shape["d"] % 4 == 0 else shape["d"] - 2
    case["cos"], case["sin"] = case["cos"][:, :rot].contiguous(), case["sin"][:, :rot].contiguous()
    k0, v0 = case["k_cache"].clone(), case["v_cache"].clone()
    out = _call(layer, case)
    ref = _layer_reference({**case, "k_cache": k0, "v_cache": v0})
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    alone = _call(layer, case, h=case["h"][2:3], cos=case["cos"][2:3], sin=case["sin"][2:3],
                  slots=case["slots"][2:3], limit=case["limit"][2:3])
    assert torch.equal(alone[0], out[2])


@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=LAYER_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_half_weights_equal_their_float32_widening(layer, shape, dtype):
    """bf16 / fp16 weights are widened exactly in registers and then computed as float32:
    bit for bit the float32 kernel on the widened weights."""
    gen = torch.Generator().manual_seed(5)
    case = _layer_case(gen, R=4, dtype=dtype, **shape)
    wide = {**case, "weights": [t.float() for t in case["weights"]], "k_cache": case["k_cache"].clone(),
            "v_cache": case["v_cache"].clone()}
    assert torch.equal(_call(layer, case), _call(layer, wide))
    assert torch.equal(case["k_cache"], wide["k_cache"]) and torch.equal(case["v_cache"], wide["v_cache"])


@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=LAYER_IDS)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "fp16", "bf16-fp32cache"])
def test_layer_row_is_bit_identical_whatever_the_other_rows(layer, shape, dtype, cache_dtype):
    """Row i of an N-row call (chain rows at slots 20.., row i seeing the rows before it)
    equals row i run alone on the cache the N-row call left, and writes the same K/V bits."""
    for n in range(1, 10):
        gen = torch.Generator().manual_seed(100 + n)
        case = _layer_case(gen, R=n, dtype=dtype, cache_dtype=cache_dtype, **shape)
        out = _call(layer, case)
        after_k, after_v = case["k_cache"].clone(), case["v_cache"].clone()
        for i in range(n):
            one = slice(i, i + 1)
            alone = _call(layer, case, h=case["h"][one], cos=case["cos"][one], sin=case["sin"][one],
                          slots=case["slots"][one], limit=case["limit"][one])
            assert torch.equal(alone[0], out[i]), (n, i)
            assert torch.equal(case["k_cache"], after_k) and torch.equal(case["v_cache"], after_v), (n, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_all_layers_in_one_call_equal_one_call_per_layer(layer, dtype):
    """rows_layers over layers [start, end) is rows_layer layer after layer, bit for bit (a
    16-bit model's residual rounded to its dtype after each layer), caches included; it
    refuses layer ranges and caches that do not fit its weights."""
    layers = load_rows_layers()
    gen = torch.Generator().manual_seed(7)
    cases = [_layer_case(gen, R=4, dtype=dtype, cache_dtype=dtype, qk_norm=True) for _ in range(3)]
    flat = [t for c in cases for t in c["weights"]]
    k_all = torch.stack([c["k_cache"] for c in cases])
    v_all = torch.stack([c["v_cache"] for c in cases])
    c0 = cases[0]
    args = (c0["cos"], c0["sin"], c0["slots"], c0["limit"], c0["eps"], c0["scale"], c0["residual_scale"], c0["path"],
            c0["base"])
    form = _layer_form(c0)
    h = c0["h"]
    k_ref, v_ref = k_all.clone(), v_all.clone()
    expected = h
    for li in (1, 2):
        expected = layer(expected, cases[li]["weights"], k_ref[li], v_ref[li], *args, *form)
        if dtype != torch.float32:
            expected = expected.to(dtype).float()
    got = layers(h, flat, 11, k_all, v_all, *args, 1, 3, *form)
    assert torch.equal(got, expected)
    assert torch.equal(k_all, k_ref) and torch.equal(v_all, v_ref)
    with pytest.raises(RuntimeError, match="outside the 3 given"):
        layers(h, flat, 11, k_all, v_all, *args, 2, 4, *form)
    with pytest.raises(RuntimeError, match="whole layers"):
        layers(h, flat[:-1], 11, k_all, v_all, *args, 0, 1, *form)
    with pytest.raises(RuntimeError, match=r"\[L, Hkv, S, d\] with L = 3"):
        layers(h, flat, 11, k_all[:2], v_all[:2], *args, 0, 1, *form)


def test_layer_bad_arguments_are_refused_before_any_write(layer):
    gen = torch.Generator().manual_seed(0)
    case = _layer_case(gen, R=2, qk_norm=True)
    w = case["weights"]
    k0, v0 = case["k_cache"].clone(), case["v_cache"].clone()

    def swap(i, t):
        return [t if j == i else x for j, x in enumerate(w)]

    cases = [
        (dict(weights=w[:8]), "9 weights, 11 with q/k norms, 13 with output norms or 20 with biases"),
        (dict(norm_offset=0.5), "norm_offset must be 0 or 1"),
        (dict(weights=w + [w[0]]), "9 weights, 11 with q/k norms, 13 with output norms or 20"),
        (dict(weights=w + [w[0][:0]] * 2 + [w[1][0]] + [w[0][:0]] * 6), "q bias weight must be \\[48\\] or empty"),
        (dict(weights=w + [w[0], w[0][:-1]]), "MLP output norm weight must be \\[76\\] or empty"),
        (dict(weights=swap(9, w[9][:0])), "q norm and k norm must both be given or both be empty"),
        (dict(weights=swap(9, torch.cat([w[9]] * 2))), "q norm weight must be \\[12\\]"),
        (dict(h=case["h"].double()), "h must be \\[R, H\\] float32"),
        (dict(h=case["h"][:0], cos=case["cos"][:0], sin=case["sin"][:0], slots=case["slots"][:0],
              limit=case["limit"][:0]), "empty h"),
        (dict(weights=swap(1, w[1][:-1])), "q weight must be \\[Hq \\* d, H\\]"),
        (dict(weights=swap(1, w[1][:12])), "multiple of KV heads"),
        (dict(weights=swap(2, w[2][:-12])), "k weight must be"),
        (dict(weights=swap(3, w[3][:, :-1].contiguous())), "v weight must be"),
        (dict(weights=swap(4, w[4][:-1])), "o weight must be"),
        (dict(weights=swap(5, w[5][:-1])), "post norm weight must be"),
        (dict(weights=swap(7, w[7][:-1])), "up weight must be"),
        (dict(weights=swap(8, w[8][:, :-1].contiguous())), "down weight must be"),
        (dict(weights=swap(10, w[10][:-1])), "k norm weight must be"),
        (dict(weights=swap(0, w[0][None])), "input norm weight must be"),
        (dict(weights=swap(6, w[6].bfloat16())), "share one dtype"),
        (dict(weights=swap(6, w[6].double())), "gate weight must be float32, bfloat16 or float16"),
        (dict(weights=swap(4, w[4].t())), "o weight must be contiguous"),
        (dict(weights=swap(4, w[4].to("meta"))), "o weight must be a CPU tensor"),
        (dict(k_cache=case["k_cache"][:, :, :11].contiguous(), v_cache=case["v_cache"][:, :, :11].contiguous()),
         "even head_dim"),
        (dict(v_cache=case["v_cache"][:, :5].contiguous()), "both be \\[Hkv, S, d\\]"),
        (dict(k_cache=case["k_cache"][:0], v_cache=case["v_cache"][:0]), "empty cache"),
        (dict(cos=case["cos"][:1]), "cos/sin must be \\[R, rot\\]"),
        (dict(sin=case["sin"][:, :6].contiguous()), "cos/sin must be \\[R, rot\\]"),
        (dict(cos=case["cos"][:, :5].contiguous(), sin=case["sin"][:, :5].contiguous()), "rot even"),
        (dict(sin=case["sin"].double()), "cos/sin must be"),
        (dict(slots=torch.tensor([20, 40])), "slot is outside the cache"),
        (dict(slots=torch.tensor([-1, 21])), "slot is outside the cache"),
        (dict(slots=case["slots"].int()), "slots must be int64"),
        (dict(slots=case["slots"][:1]), "slots must be int64 \\[R\\] with R = 2"),
        (dict(limit=torch.tensor([20, 40])), "key limit is outside the cache"),
        (dict(path=torch.tensor([[20, 99], [21, -1]])), "path slot is outside"),
        (dict(eps=float("nan")), "eps must be finite"),
        (dict(eps=-1.0), "eps must be finite and >= 0"),
        (dict(scale=float("inf")), "scale must be finite"),
        (dict(residual_scale=float("nan")), "residual_scale must be finite"),
    ]
    for changes, words in cases:
        with pytest.raises(RuntimeError, match=words):
            _call(layer, case, **changes)
        assert torch.equal(case["k_cache"], k0) and torch.equal(case["v_cache"], v0), words


# ---- bf16 / fp16 weights and caches ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k, o", [(7, 5), (13, 333), (100, 64), (576, 1000)])
def test_half_weights_match_float64_reference(kernel, dtype, k, o):
    gen = torch.Generator().manual_seed(k + o)
    w = torch.randn(o, k, generator=gen).to(dtype)
    for r in (1, 2, 3, 4, 5, 8, 9, 11, 17):
        x = torch.randn(r, k, generator=gen)
        y = kernel(x, w)
        assert y.dtype == torch.float32 and y.shape == (r, o)
        torch.testing.assert_close(y, rows_linear_reference(x, w.float()), rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, o", [(13, 333), (100, 5), (1536, 77)])
def test_half_weights_rows_are_bit_identical(kernel, dtype, k, o):
    """Row invariance in every weight dtype (N = 1..9 and 17: the 1-8 row tiles and the
    many-row path), and bf16 / fp16 weights bit for bit their float32 widening (fp16
    subnormals included: F16C widens them exactly as torch does)."""
    gen = torch.Generator().manual_seed(k * 7 + o)
    w = torch.randn(o, k, generator=gen)
    w[::3] *= 1e-5  # fp16 subnormals (below 6.1e-5)
    w = w.to(dtype)
    row = torch.randn(1, k, generator=gen)
    alone = kernel(row, w)[0]
    assert torch.equal(alone, kernel(row, w.float())[0])
    for n in (*range(2, 10), 17):
        x = torch.randn(n, k, generator=gen)
        for place in {0, n // 2, n - 1}:
            x[place] = row[0]
            assert torch.equal(kernel(x, w)[place], alone), (n, place)
        assert torch.equal(kernel(x, w), kernel(x, w.float()))
    # half-precision activations are widened exactly first
    xh = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    assert torch.equal(kernel(xh, w), kernel(xh.float(), w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 12), (2, 1, 128), (3, 3, 20)])
def test_attention_half_cache(attention, dtype, hq, hkv, d):
    """A bf16 / fp16 cache: within fp32 rounding of the float64 reference on the same
    (widened) cache, bit for bit the float32 kernel on the widened cache, and each row
    bit-identical alone and among N = 2..9 rows (chains and tree paths)."""
    gen = torch.Generator().manual_seed(hq * 10 + d)
    k, v = (t.to(dtype) for t in _cache(gen, hkv, 300, d))
    q = torch.randn(9, hq, d, generator=gen)
    lim = torch.tensor([0, 5, 7, 8, 100, 255, 256, 290, 299])
    path = torch.full((9, 4), -1, dtype=torch.long)
    path[3, :2] = torch.tensor([7, 8])
    path[7, :3] = torch.tensor([288, 295, 299])  # after its prefix [0, 287]
    for p in (NO_PATH, path):
        o = attention(q, k, v, lim, d ** -0.5, p)
        assert o.dtype == torch.float32
        torch.testing.assert_close(o, rows_attention_reference(q, k.float(), v.float(), lim, d ** -0.5, p),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(o, attention(q, k.float(), v.float(), lim, d ** -0.5, p))
        for n in range(1, 10):
            part = attention(q[:n], k, v, lim[:n], d ** -0.5, p[:n] if p.shape[1] else p)
            assert torch.equal(part, o[:n]), n
            one = attention(q[n - 1:n], k, v, lim[n - 1:n], d ** -0.5, p[n - 1:n] if p.shape[1] else p)
            assert torch.equal(one[0], o[n - 1]), n


# ---- threads: the work-sharing pool computes the same bits as OpenMP ---------------------

def test_work_pool_gives_the_same_bits(kernel, attention, layer):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(1000, 576, generator=gen).bfloat16()
    x = torch.randn(11, 576, generator=gen)
    k, v = _cache(gen, 3, 300, 64)
    q = torch.randn(5, 9, 64, generator=gen)
    lim = torch.tensor([0, 7, 100, 250, 299])
    case = _layer_case(gen, R=6, **LAYER_SHAPES[1])
    threads = torch.get_num_threads()
    results = {}
    try:
        torch.set_num_threads(2)
        for pool in (False, True):
            use_work_pool(pool)
            assert use_work_pool() is pool
            c = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
            results[pool] = [kernel(x, w), kernel(x[:1], w), attention(q, k, v, lim, 0.125),
                             _call(layer, c), c["k_cache"]]
    finally:
        use_work_pool(False)
        torch.set_num_threads(threads)
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)
    assert torch.equal(results[True][1][0], results[True][0][0])


# ---- AVX-512 paired rows compute the same bits as the 8-lane tiles -------------------------

def _has_avx512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f" {f}" in flags for f in ("avx512f", "avx512dq", "avx512bw", "avx512vl"))


@pytest.mark.skipif(not _has_avx512(), reason="the paired-row tiles need AVX-512 F/DQ/BW/VL")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_avx512_rows_give_the_same_bits(kernel, layer, dtype):
    gen = torch.Generator().manual_seed(13)
    try:
        assert use_avx512() is True  # the default on this CPU
        for K in (576, 77, 8):  # a K % 8 tail through the scalar fma in both paths
            w = torch.randn(131, K, generator=gen).to(dtype)
            x = torch.randn(37, K, generator=gen)
            for R in (6, 7, 8, 9, 16, 17, 32, 33, 37):  # paired from 32 rows; odd R: the spare half of the last pair
                out = {}
                for wide in (False, True):
                    assert use_avx512(wide) is wide
                    out[wide] = kernel(x[:R].contiguous(), w)
                assert torch.equal(out[False], out[True]), (K, R)
                assert torch.equal(out[True][R - 1], kernel(x[R - 1:R].contiguous(), w)[0])  # row-invariant
        case = _layer_case(gen, R=32, S=64, dtype=dtype, **LAYER_SHAPES[1])
        layers = {}
        for wide in (False, True):
            use_avx512(wide)
            c = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
            layers[wide] = _call(layer, c)
        assert torch.equal(layers[False], layers[True])
    finally:
        use_avx512(True)


# ---- one build folder per Python environment; a build is announced ------------------------

def test_each_python_environment_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two virtual environments sharing torch's extension folder would rebuild the kernel
    (~1 min, in an engine's first call) each time the other had used it: the folder is
    keyed by the environment. Whether a load compiles (and says so) is read from it."""
    import sys

    from hf_selfspec.kernels.cpu_rows import (
        NAME,
        SOURCES,
        STATES_SOURCE,
        _build_needed,
        kernel_sources,
    )

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = build_directory()
    assert here.is_dir() and tmp_path in here.parents and here.name.startswith(NAME + "_")
    assert build_directory() == here
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert build_directory() != here
    sources = kernel_sources()
    assert sources[-1] == STATES_SOURCE.read_text() and len(sources) == len(SOURCES)
    assert _build_needed(here, sources)  # nothing built
    (here / f"{NAME}.so").write_bytes(b"")
    rows_only = "\n".join(sources[:-1])
    (here / "main.cpp").write_text("#include <torch/extension.h>\n" + rows_only + "\n// bindings")
    assert _build_needed(here, sources)  # the recurrent-state source is part of the module too
    (here / "main.cpp").write_text("#include <torch/extension.h>\n" + "\n".join(sources) + "\n// bindings")
    assert not _build_needed(here, sources)
    (here / "main.cpp").write_text("#include <torch/extension.h>\n// the sources of an older version")
    assert _build_needed(here, sources)


def test_every_section_is_compiled_and_an_edit_to_any_rebuilds(tmp_path, monkeypatch):
    """The C++ sections of kernels/cpu-rows/ are compiled as one unit in the order of
    SECTIONS: every file of the folder is listed there (a file left out would not be
    compiled), and an edit to any source (a section or cpu_states.cpp) makes the next load
    rebuild and changes source_digest()."""
    import shutil

    from hf_selfspec.kernels import cpu_rows

    files = sorted(p.name for p in cpu_rows.SOURCE_DIR.iterdir() if p.is_file())
    assert files == sorted(cpu_rows.SECTIONS) and len(set(cpu_rows.SECTIONS)) == len(cpu_rows.SECTIONS)
    assert cpu_rows.SECTIONS[0] == "common.h"  # the includes and what every section uses
    assert cpu_rows.SOURCES[-1] == cpu_rows.STATES_SOURCE and cpu_rows.SOURCE == cpu_rows.SOURCES[0]
    sources = cpu_rows.kernel_sources()
    built = tmp_path / "built"
    built.mkdir()
    (built / f"{cpu_rows.NAME}.so").write_bytes(b"")
    (built / "main.cpp").write_text("#include <torch/extension.h>\n" + "\n".join(sources) + "\n// bindings")
    assert not cpu_rows._build_needed(built, sources)
    copies = []
    for path in cpu_rows.SOURCES:
        copy = tmp_path / "src" / path.parent.name / path.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        copies.append(copy)
    digest = cpu_rows.source_digest()
    monkeypatch.setattr(cpu_rows, "SOURCES", tuple(copies))
    assert cpu_rows.source_digest() == digest
    for copy in copies:
        text = copy.read_text()
        copy.write_text(text.replace("\n", "\n// an edit\n", 1))
        assert cpu_rows._build_needed(built, cpu_rows.kernel_sources()), copy.name
        assert cpu_rows.source_digest() != digest, copy.name
        copy.write_text(text)
    assert cpu_rows.source_digest() == digest


# ---- a kernel that cannot be built says why in one line -----------------------------------

def test_a_missing_or_failing_compiler_is_named(tmp_path):
    """No compiler, or one whose compile fails: load_rows_linear() is None and build_error()
    says what to fix (a failed compile: the compiler's own error line, not ninja's "build
    stopped"); a fresh process with an empty extension folder, so nothing cached is loaded."""
    import subprocess
    import sys

    fake = tmp_path / "fake-c++"  # answers --version like g++, fails every compile
    fake.write_text('#!/bin/sh\ncase "$*" in *--version*|*-v*) exec g++ "$@";; esac\n'
                    'echo "cpu_rows.cpp:1:1: error: simulated compile failure" >&2; exit 1\n')
    fake.chmod(0o755)
    code = ("import os\nfrom hf_selfspec.kernels import cpu_rows\n"
            "for cxx in ('/nonexistent/c++', os.environ['FAKE_CXX']):\n"
            "    os.environ['CXX'] = cxx\n    cpu_rows._load_module.cache_clear()\n"
            "    print(cpu_rows.load_rows_linear() is None, '|', cpu_rows.build_error())\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "FAKE_CXX": str(fake)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    lines = [line for line in out.stdout.splitlines() if "|" in line]
    assert len(lines) == 2, out.stderr[-2000:]
    assert lines[0].startswith("True | no C++ compiler ('/nonexistent/c++': not found")
    assert "install one (g++ or clang++)" in lines[0]
    assert lines[1] == "True | RuntimeError: cpu_rows.cpp:1:1: error: simulated compile failure"
