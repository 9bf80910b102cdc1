"""The exact argmax of a float32 LM head from a float16 copy: half its bytes per step.

A greedy step needs only each row's argmax over the vocabulary, and on the CPU the LM head
is a fifth of the bytes a small model's step streams (SmolLM2-135M: 113 of 538 MB). The
row kernel computes z16 = x . w16 (the weights rounded to float16, widened exactly, float32
arithmetic in the kernel's fixed order) and a bound b on |z32 - z16| for every token:

    |z32_v - z16_v| <= |x . (w_v - w16_v)| + err(z32_v) + err(z16_v)
                    <= ||x|| ||w_v - w16_v|| + gamma_K (||x|| ||w_v|| + ||x|| ||w16_v||)

(Cauchy-Schwarz; gamma_K = K u / (1 - K u) bounds the rounding of any K-term float32 sum
of products, whatever its order, u = 2^-24), and rounding to float16 moves each weight by
at most 2^-11 |w| (normal range) or 2^-25 (subnormal), so ||w_v - w16_v|| <= 2^-11 ||w_v||
+ 2^-25 sqrt(K): b needs only the largest row norm. The true argmax v* then has z16_v* >=
max(z16) - 2b, so only the tokens within 2b of the best z16 can be it; their float32
logits, computed by the same kernel from the float32 rows (a dot product does not depend on
which other rows are computed), decide, ties to the lowest id as torch.argmax does. The
result is torch.argmax of the float32 logits, always: where the screen cannot say (a
non-finite value, or too many tokens within the bound), the caller computes the float32
logits as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

FLOAT16_MAX = 65504.0
UNIT_ROUNDOFF = 2.0 ** -24  # float32
# a row with more tokens within the bound than this is decided by the full float32 logits
MAX_CANDIDATES = 64
# slack on the bound for the float32 rounding of ||x|| and of the threshold itself
SAFETY = 1.001
RELATIVE_SLACK = 1e-6
# the float16 copy is made only up to this size: it is memory beyond the model's own, and
# making a big one writes fresh pages, whose first touch can cost a big model's first call
# more than its faster steps win back soon (docs/benchmarks_2026-12-05.md, session 5)
MAX_COPY_BYTES = 64 * 2 ** 20

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# the row kernel's rows_screen(x, half, coefficient, slack, max_candidates): the product and
# each row's candidates in one call (count, then ids; -1: not screenable)
Candidates = Callable[[torch.Tensor, torch.Tensor, float, float, int], torch.Tensor]


def screen_refusal(weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why an LM head cannot be screened (None: it can)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return "the screen serves float32 LM heads on the CPU"
    if bias is not None:
        return "the LM head has a bias"
    if weight.dim() != 2 or not weight.is_contiguous():
        return "the LM head weight is not a contiguous matrix"
    if weight.numel() * 2 > MAX_COPY_BYTES:
        return f"a float16 copy of the LM head would take over {MAX_COPY_BYTES >> 20} MiB"
    return None


class ScreenedArgmax:
    """argmax(x @ weight.T) for float32 rows x [n, K], reading a float16 copy of `weight`
    [V, K] and the float32 rows of the few tokens the bound cannot rule out. `product` is
    the row kernel's rows_linear (float32 / float16 weights, float32 x); `candidates` its
    rows_screen, which finds each row's candidates in C++ (without it, PyTorch operations on
    the product's logits do; the same tokens either way)."""

    def __init__(self, weight: torch.Tensor, product: Product, candidates: Candidates | None = None):
        refusal = screen_refusal(weight, None)
        if refusal is not None:
            raise ValueError(refusal)
        self.weight = weight
        self.product = product
        self.candidates = candidates
        self.half: torch.Tensor | None = None
        self.coefficient = 0.0
        self._version = -1
        self._refresh()

    def _refresh(self) -> bool:
        """(Re)make the float16 copy and the bound after the weight changed in place
        (its version counter moved); False where it cannot be screened (then no copy)."""
        w = self.weight.detach()
        self._version = self.weight._version
        self.half = None
        low, high = (float(t) for t in torch.aminmax(w))
        if not (math.isfinite(low) and math.isfinite(high)) or max(-low, high) > FLOAT16_MAX * (1 - 2.0 ** -12):
            # NaN / inf in w, or a weight float16 rounds to inf
            return False
        half = w.to(torch.float16)
        k = w.shape[1]
        gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
        # the largest row norm, computed in float32: within a factor (1 + gamma) of the exact one
        norm = float(torch.linalg.vector_norm(w, dim=1).max()) * (1 + 2 * gamma)
        rounding = 2.0 ** -11 * norm + 2.0 ** -25 * math.sqrt(k)  # >= ||w_v - w16_v||
        # ||w16_v|| <= ||w_v|| + ||w_v - w16_v||
        worst = rounding + gamma * (2 * norm + rounding)
        self.half = half
        # twice the bound per unit of ||x||: the distance to the best z16 a token may lie at
        self.coefficient = 2.0 * worst * (1 + 2 * gamma) * SAFETY  # (1 + 2 gamma): ||x|| in float32
        return True

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [n, K] float32 -> argmax [n] (long), or None where the caller must compute the
        float32 logits (screening not possible now)."""
        if self.weight._version != self._version and not self._refresh():
            return None
        if self.half is None:
            return None
        x = x.contiguous()
        per_row = self._candidates(x)
        if per_row is None or any(not c or len(c) > MAX_CANDIDATES for c in per_row):
            return None
        if all(len(c) == 1 for c in per_row):
            return torch.tensor([c[0] for c in per_row], dtype=torch.long)
        tokens = sorted({v for c in per_row for v in c})
        column = {v: i for i, v in enumerate(tokens)}
        exact = self.product(x, self.weight.detach()[torch.tensor(tokens)]).tolist()  # [n, |tokens|]
        out = []
        for r, candidates in enumerate(per_row):
            values = exact[r]
            # ascending ids: the first of equal maxima is the lowest id, as torch.argmax
            out.append(max(candidates, key=lambda v: (values[column[v]], -v)))
        return torch.tensor(out, dtype=torch.long)

    def _candidates(self, x: torch.Tensor) -> list[list[int]] | None:
        """Each row's tokens within the bound of its best float16 logit, ascending (None:
        a row cannot be screened)."""
        if self.candidates is not None:
            found = self.candidates(x, self.half, self.coefficient, RELATIVE_SLACK, MAX_CANDIDATES)
            counts = found[:, 0].tolist()
            if min(counts) < 1:
                return None
            if max(counts) == 1:
                return [[v] for v in found[:, 1].tolist()]
            return [row[1:1 + c] for row, c in zip(found.tolist(), counts)]
        z = self.product(x, self.half)  # [n, V]
        best = z.amax(dim=1)
        threshold = best - (self.coefficient * x.norm(dim=1) + RELATIVE_SLACK * best.abs())
        hits = (z >= threshold[:, None]).nonzero().tolist()  # NaN anywhere: no hit in its row
        per_row: list[list[int]] = [[] for _ in range(x.shape[0])]
        for r, v in hits:
            per_row[r].append(v)
        return per_row
