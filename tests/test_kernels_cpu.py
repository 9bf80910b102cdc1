"""The CPU row kernels (kernels/cpu_rows.cpp): x @ w^T and attention over the KV
cache to fp32 rounding, and a row's result bit for bit the same whatever the other rows
(the engine's `kernel` layout)."""

from __future__ import annotations

import pytest
import torch

from hf_selfspec.kernels.cpu_rows import (
    build_error,
    cpu_supports_kernel,
    load_rows_attention,
    load_rows_linear,
    NO_PATH,
    rows_attention_reference,
    rows_linear_reference,
)

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
    for r in (1, 2, 3, 4, 5, 6, 7, 8, 11):
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
    for r in (2, 3, 4, 5, 6, 7, 8, 9, 16):
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
    return lambda q, k, v, limit, scale, path=NO_PATH: fn(q, k, v, limit, scale, path)


def _cache(gen, hkv, slots, d):
    return torch.randn(hkv, slots, d, generator=gen), torch.randn(hkv, slots, d, generator=gen)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 4, 16), (4, 2, 12), (2, 1, 128)])
def test_attention_matches_float64_reference(attention, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * 100 + d)
    k, v = _cache(gen, hkv, 600, d)
    for limits in ([0], [5], [3, 4, 5, 6], [255, 256, 257], [599, 17, 300, 1, 2, 3, 4, 598]):
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
    for limit in (0, 3, 254, 255, 256, 700):
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


@pytest.mark.parametrize("pos0", [1, 4, 7, 255, 300])
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


def test_attention_tree_matches_float64_reference(attention):
    gen = torch.Generator().manual_seed(3)
    k, v = _cache(gen, 2, 300, 16)
    q = torch.randn(4, 4, 16, generator=gen)
    path = torch.tensor([[100, -1, -1], [100, 102, -1], [100, 103, -1], [100, 103, 105]])
    lim = torch.tensor([100, 101, 101, 102])
    o = attention(q, k, v, lim, 0.25, path)
    torch.testing.assert_close(o, rows_attention_reference(q, k, v, lim, 0.25, path), rtol=1e-5, atol=1e-5)


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
