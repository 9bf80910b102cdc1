"""The exact argmax of a float32 LM head from an int8 copy: a quarter of its bytes per step.

A greedy step needs only each row's argmax over the vocabulary, and on the CPU the LM head
is a fifth of the bytes a small model's step streams (SmolLM2-135M: 113 of 538 MB). Each
token's row w_v is stored as integers q_v in [-127, 127] and a float32 scale s_v = max|w_v| /
127; the row kernel computes d_v = x . q_v (float32 arithmetic in the kernel's fixed order)
and z_v = s_v d_v. For every token

    |z32_v - z_v| <= |x . (w_v - s_v q_v)| + s_v |x . q_v - d_v| + |z32_v - x . w_v|
                  <= ||x|| (e_v + gamma_K (s_v ||q_v|| + ||w_v||)) + u |z_v|
                   = ||x|| c_v + u |z_v|

(Cauchy-Schwarz; e_v = ||w_v - s_v q_v|| computed exactly when the copy is made; gamma_K = K u
/ (1 - K u) bounds the rounding of any K-term float32 sum of products, whatever its order,
u = 2^-24; the last term is z's own rounding). With b_v = c_v times a small safety factor, the
true argmax v* has z_v* + b_v* ||x|| >= max_u (z_u - b_u ||x||), so only the tokens passing that
test can be it: on SmolLM2's hidden states a handful per row (a bound from the worst row for
every token would keep hundreds). Their float32 logits, computed by the same kernel from the
float32 rows (a dot product does not depend on which other rows are computed), decide, ties
to the lowest id as torch.argmax does. The result is torch.argmax of the float32 logits,
always: where the screen cannot say (a non-finite value, or too many candidates), the caller
computes the float32 logits as before. The whole screen is one C++ call (kernels/cpu-rows/screen.cpp
`rows_screen`).

Where the CPU has AVX-512 VNNI, x is quantised too, to 16-bit integers (x_q = round(x / s_x),
s_x = max|x| / L, L about 2^15), and d_v = s_x (x_q . q_v), the integer product exact: a row
then costs about half what the float32 product's widenings and FMAs cost. Since x . (s_v q_v) - s_v s_x
(x_q . q_v) = s_v q_v . (x - s_x x_q), each token's bound gains s_v ||q_v|| ||x - s_x x_q||
(`qnorm` >= s_v ||q_v|| here, the kernel computes an upper bound of ||x - s_x x_q|| per row),
and z_v has up to three roundings instead of one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .versions import version_counter

UNIT_ROUNDOFF = 2.0 ** -24  # float32
# a row with more candidates than this is decided by the full float32 logits: each candidate
# costs one float32 row (2.3 KB on SmolLM2), the full logits all 49,152 of them, so even a few
# hundred candidates are far cheaper (rows of near-flat distributions have 100-200)
MAX_CANDIDATES = 512
# slack on each token's bound for the float32 rounding of ||x||
SAFETY = 1.001
# the int8 copy is made only up to this size: it is memory beyond the model's own (a
# quarter of the float32 LM head's). Big-vocabulary small models need the most from it:
# Qwen2.5-0.5B's head is 130 MiB of int8, Qwen3-0.6B's 148, Gemma-3-270M's 160, Llama-3.2-1B's
# 250, Gemma-3-1B's 288, where the float32 head is half or more of what a step reads
MAX_COPY_BYTES = 320 * 2 ** 20
# ... and one over this size not at the engine's first request but at its second: making it
# writes fresh pages, whose first touch right after a big model was built is slow (the
# first call would pay it; the figures are in docs/changelog.md)
EAGER_COPY_BYTES = 32 * 2 ** 20

# the row kernel's rows_screen(x, q, scale, bound, qnorm, w, max_candidates) -> argmax [n]
# (-1: none)
ScreenKernel = Callable[..., torch.Tensor]


def screen_refusal(weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why an LM head cannot be screened (None: it can)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return "the screen serves float32 LM heads on the CPU"
    if bias is not None:
        return "the LM head has a bias"
    if weight.dim() != 2 or not weight.is_contiguous():
        return "the LM head weight is not a contiguous matrix"
    if weight.numel() > MAX_COPY_BYTES:
        return f"an int8 copy of the LM head would take over {MAX_COPY_BYTES >> 20} MiB"
    return None


# rows quantised per chunk of about this many weights (4 MiB of float32 temporaries: they
# stay in cache and their memory is reused; 32 MiB ones took twice as long)
CHUNK_ELEMENTS = 1 << 20


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w [V, K] float32 (finite) -> (q [V, K] int8, scale [V] float32, bound [V] float32,
    qnorm [V] float32): q_v = round(w_v / s_v) with s_v = max|w_v| / 127 (a zero row: q_v = 0,
    s_v = 0), b_v >= the per-unit-||x|| bound c_v of the module docstring and qnorm_v >= s_v
    ||q_v|| (what a quantised x's error is multiplied by).
    Computed in float32: e_v = ||w_v - s_v q_v|| there is within (1 + gamma_K) of the exact
    norm of the float32 difference, which is within u (|w_v| + |s_v q_v|) of the exact one per
    element, so adding 2 u (||w_v|| + s_v ||q_v||) and the factor (1 + gamma_K)^2 covers it."""
    k = w.shape[1]
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    bound = torch.empty_like(scale)
    qnorm = torch.empty_like(scale)
    rows = max(1, CHUNK_ELEMENTS // max(1, k))
    for lo in range(0, w.shape[0], rows):
        part = w[lo:lo + rows].float()
        s = part.abs().amax(dim=1) / 127.0
        whole = torch.round(part / torch.where(s > 0, s, 1.0)[:, None]).clamp_(-127, 127)
        scale[lo:lo + rows] = s
        q[lo:lo + rows] = whole
        dequantized = whole * s[:, None]
        error = (part - dequantized).norm(dim=1)
        w_norm, q_norm = part.norm(dim=1), dequantized.norm(dim=1)  # s_v ||q_v||, in float32
        c = (error + 2 * UNIT_ROUNDOFF * (w_norm + q_norm)) * (1 + gamma) ** 2 \
            + gamma * (q_norm + w_norm) * (1 + gamma)
        # (1 + 2 gamma): ||x|| computed in float32; SAFETY: this float32 arithmetic
        bound[lo:lo + rows] = c * (1 + 2 * gamma) * SAFETY
        # s_v ||q_v|| from float32 products and a float32 norm: within (1 + gamma_K)(1 + u)
        qnorm[lo:lo + rows] = q_norm * (1 + 2 * gamma) * SAFETY
    return q, scale, bound, qnorm


class ScreenedArgmax:
    """argmax(x @ weight.T) for float32 rows x [n, K], reading an int8 copy of `weight`
    [V, K] and the float32 rows of the few tokens the bound cannot rule out; `kernel` is the
    row kernel's rows_screen."""

    def __init__(self, weight: torch.Tensor, kernel: ScreenKernel):
        refusal = screen_refusal(weight, None)
        if refusal is not None:
            raise ValueError(refusal)
        self.weight = weight
        self.kernel = kernel
        self.rows: tuple[torch.Tensor, ...] | None = None  # quantize_rows(weight)
        self._version = -1
        self._refresh()

    @property
    def copy_bytes(self) -> int:
        """Bytes of the copy (memory beyond the model's own)."""
        return 0 if self.rows is None else sum(t.numel() * t.element_size() for t in self.rows)

    def _refresh(self) -> bool:
        """(Re)make the int8 copy and the bounds after the weight changed in place (its
        version counter moved); False where it cannot be screened (NaN / inf: no copy)."""
        w = self.weight.detach()
        self._version = version_counter(self.weight)
        self.rows = None
        low, high = (float(t) for t in torch.aminmax(w))
        if not (math.isfinite(low) and math.isfinite(high)):
            return False
        self.rows = quantize_rows(w)
        return True

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [n, K] float32 -> argmax [n] (long), or None where the caller must compute the
        float32 logits (screening not possible now)."""
        if version_counter(self.weight) != self._version and not self._refresh():
            return None
        if self.rows is None:
            return None
        out = self.kernel(x.contiguous(), *self.rows, self.weight.detach(), MAX_CANDIDATES)
        return None if bool((out < 0).any()) else out
