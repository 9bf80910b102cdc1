"""The hybrids' C++ recurrent state updates (kernels/cpu_states.cpp): Mamba2's and the gated
DeltaNet's, for a step's rows in order, each row's state from its parent's ring row: to
fp32 rounding of a float64 reference, a row's output and state bit for bit the same
whatever the other rows of the call (a tree's siblings, a chain before it), and every bad
argument refused, with words that say what was wrong, before any state is written."""

from __future__ import annotations

import pytest
import torch
from hf_selfspec.kernels.cpu_rows import build_error, cpu_supports_kernel, load_rows_states

pytestmark = pytest.mark.skipif(not cpu_supports_kernel(), reason="the kernel needs an AVX2/FMA CPU")

LAYERS, SLOTS = 2, 7
# a chain from position 0 (parent -1), then a tree: rows 3 and 4 are siblings under row 2
ROWS = [(0, -1), (1, 0), (2, 1), (3, 2), (4, 2)]


@pytest.fixture(scope="module")
def kernels():
    fns = load_rows_states()
    assert fns is not None, f"the kernel did not build on an AVX2 machine: {build_error()}"
    return fns


def mamba2_inputs(gen, heads, p, n, rows=len(ROWS)):
    return (torch.rand(rows, heads, generator=gen), torch.randn(rows, heads, n, generator=gen),
            torch.randn(rows, heads, p, generator=gen), torch.randn(rows, heads, n, generator=gen))


def mamba2_reference(states, layer, rows, decay, dtb, x, c):
    """Per row: state = parent * decay + dtb x^T, out = state . c (float64; writes `states`)."""
    out = []
    for r, (row, parent) in enumerate(rows):
        prev = states[layer, parent].double() if parent >= 0 else 0.0
        s = prev * decay[r].double()[:, None, None] + x[r].double()[:, :, None] * dtb[r].double()[:, None, :]
        states[layer, row] = s.float()
        out.append((s * c[r].double()[:, None, :]).sum(-1))
    return torch.stack(out)


def delta_reference(states, layer, rows, decay, beta, q, k, v):
    """Per row: state = parent * g; kv = state^T k; state += k (v - kv) beta; out = state^T q."""
    out = []
    for r, (row, parent) in enumerate(rows):
        prev = states[layer, parent].double() if parent >= 0 else torch.zeros(states.shape[2:], dtype=torch.float64)
        s = prev * decay[r].double()[:, None, None]
        kv = (s * k[r].double()[:, :, None]).sum(-2)
        delta = (v[r].double() - kv) * beta[r].double()[:, None]
        s = s + k[r].double()[:, :, None] * delta[:, None, :]
        states[layer, row] = s.float()
        out.append((s * q[r].double()[:, :, None]).sum(-2))
    return torch.stack(out)


@pytest.mark.parametrize("heads,p,n", [(3, 5, 16), (4, 8, 13), (2, 1, 7)])  # whole lanes, tails, a tail only
def test_mamba2_matches_float64_reference(kernels, heads, p, n):
    gen = torch.Generator().manual_seed(heads * 100 + n)
    states = torch.randn(LAYERS, SLOTS, heads, p, n, generator=gen)
    expected_states = states.clone()
    inputs = mamba2_inputs(gen, heads, p, n)
    rows = torch.tensor(ROWS)
    out = kernels[0](states, 1, rows, *inputs)
    expected = mamba2_reference(expected_states, 1, ROWS, *inputs)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,dk,dv", [(3, 16, 16), (2, 8, 12), (1, 5, 3)])
def test_delta_matches_float64_reference(kernels, heads, dk, dv):
    gen = torch.Generator().manual_seed(heads * 100 + dv)
    states = torch.randn(LAYERS, SLOTS, heads, dk, dv, generator=gen)
    expected_states = states.clone()
    inputs = (torch.rand(len(ROWS), heads, generator=gen), torch.rand(len(ROWS), heads, generator=gen),
              torch.randn(len(ROWS), heads, dk, generator=gen), torch.randn(len(ROWS), heads, dk, generator=gen),
              torch.randn(len(ROWS), heads, dv, generator=gen))
    out = kernels[1](states, 0, torch.tensor(ROWS), *inputs)
    expected = delta_reference(expected_states, 0, ROWS, *inputs)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", [0, 1])
def test_a_row_is_bit_identical_whatever_the_other_rows(kernels, which):
    """Row 4 (a sibling of row 3 under row 2) computed in the whole call, and alone after
    its parent's state was written by a call of the chain only: the same bits, out and state."""
    gen = torch.Generator().manual_seed(7 + which)
    heads, a, b = 4, 8, 24
    if which == 0:
        inputs = mamba2_inputs(gen, heads, a, b)
    else:
        inputs = (torch.rand(len(ROWS), heads, generator=gen), torch.rand(len(ROWS), heads, generator=gen),
                  torch.randn(len(ROWS), heads, a, generator=gen), torch.randn(len(ROWS), heads, a, generator=gen),
                  torch.randn(len(ROWS), heads, b, generator=gen))
    together = torch.zeros(LAYERS, SLOTS, heads, a, b)
    out = kernels[which](together, 1, torch.tensor(ROWS), *inputs)
    apart = torch.zeros_like(together)
    kernels[which](apart, 1, torch.tensor(ROWS[:3]), *(t[:3].contiguous() for t in inputs))
    alone = kernels[which](apart, 1, torch.tensor(ROWS[4:]), *(t[4:].contiguous() for t in inputs))
    assert torch.equal(alone[0], out[4])
    assert torch.equal(apart[1, 4], together[1, 4])


def test_bad_arguments_are_refused_before_any_write(kernels):
    mamba2, delta = kernels
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(LAYERS, SLOTS, 2, 4, 8, generator=gen)
    before = states.clone()
    decay, dtb, x, c = mamba2_inputs(gen, 2, 4, 8)
    rows = torch.tensor(ROWS)
    bad = [
        ((states.double(), 0, rows, decay, dtb, x, c), "states must be a contiguous float32"),
        ((states.transpose(3, 4), 0, rows, decay, dtb, x, c), "states must be a contiguous float32"),
        ((states, 2, rows, decay, dtb, x, c), "layer 2 outside the 2"),
        ((states, 0, rows.int(), decay, dtb, x, c), "rows must be a contiguous int64"),
        ((states, 0, rows[:4], decay, dtb, x, c), r"rows must be a contiguous int64 CPU tensor \[5, 2\]"),
        ((states, 0, torch.tensor([[0, -1], [1, 0], [2, 1], [3, 2], [7, 2]]), decay, dtb, x, c),
         r"row 4 names ring rows \(7, 2\) outside the 7"),
        ((states, 0, torch.tensor([[0, -2], [1, 0], [2, 1], [3, 2], [4, 2]]), decay, dtb, x, c),
         r"row 0 names ring rows \(0, -2\)"),
        ((states, 0, rows, decay, dtb[:, :, :4].contiguous(), x, c), "must match states"),
        ((states, 0, rows, decay, dtb, x.half(), c), "x must be a contiguous float32"),
    ]
    for args, words in bad:
        with pytest.raises(RuntimeError, match=words):
            mamba2(*args)
    with pytest.raises(RuntimeError, match="v must be a contiguous float32"):
        delta(torch.randn(1, 2, 1, 4, 4), 0, torch.tensor([[0, -1]]), torch.rand(1, 1), torch.rand(1, 1),
              torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 8)[:, :, ::2])
    with pytest.raises(RuntimeError, match="must match states"):
        delta(torch.randn(1, 2, 1, 4, 4), 0, torch.tensor([[0, -1]]), torch.rand(1, 1), torch.rand(1, 1),
              torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 5))
    assert torch.equal(states, before)
