"""The CPU row kernel (selfspec_kernels/cpu_rows.cpp): x @ w^T to fp32 rounding, and a row's
result bit for bit the same whatever the other rows (the engine's `kernel` layout)."""

from __future__ import annotations

import pytest
import torch

from selfspec_kernels.cpu_rows import build_error, cpu_supports_kernel, load_rows_linear, rows_linear_reference

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
