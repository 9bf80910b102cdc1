"""Token mixers other than attention, row-invariant as the attention backends are: LFM2's
gated short convolution and Qwen 3.5's gated DeltaNet.

Both convolve a projection of each row over its last K positions. The engine keeps that
projection per KV slot (Engine.conv_cache, one row of channels per slot and convolution
layer, grown and compacted with the KV), and a step names each row's predecessors'
slots (StepMeta.conv_sources: its draft tree path's rows, else its sequence's committed
ones), so a row's convolution reads exactly what it would read decoding alone.

The DeltaNet also carries a recurrent state [Hv, dk, dv] from row to row. A state per KV
slot would cost megabytes per slot, so `RecurrentStates` keeps, per sequence (KV region)
and DeltaNet layer, a ring of the states of its last few slots: a step's rows read their
parent's state (the row before them in the step, in the tree, or the last committed one)
and write their own. Rows are processed in step order, which puts every tree row after
its parent; each row's arithmetic is that of a lone row, so a row's state and output never
depend on the other rows of its step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # annotations only: programs.py imports this module
    from .layered import GatedDeltaNetWeights, ShortConvWeights
    from .meta import StepMeta
    from .programs import Engine


def conv_sources(taps: int, zero_slot: int, positions: Sequence[int], paths: Sequence[Sequence[int]] | None,
                 bases: Sequence[int] | None, rows: int) -> torch.Tensor:
    """[rows, taps - 1] int64 (host): row r's k-th predecessor (k = 1 .. taps-1) is its path's
    (a draft tree's row: path[-1 - k], the path ending at the row itself) while the path
    reaches back that far, else its sequence's committed token at position p - k (slot
    base + p - k: committed tokens and chain rows sit at their positions); `zero_slot`
    before position 0 and for the pad rows past the real ones."""
    sources = torch.full((rows, taps - 1), zero_slot, dtype=torch.long)
    for r, position in enumerate(positions):
        path = paths[r] if paths is not None else ()
        base = bases[r] if bases is not None else 0
        for k in range(1, taps):
            if k < len(path):
                sources[r, k - 1] = path[-1 - k]
            elif position - k >= 0:
                sources[r, k - 1] = base + position - k
    return sources


def causal_conv(cache: torch.Tensor, values: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None,
                sources: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Writes the rows' `values` [R, C] at their `slots` of one layer's conv cache [S, C],
    then convolves each row over its predecessors' (`sources` [R, K-1]) and its own in
    float32, oldest first, each tap's product added in turn (a row's sum never depends on
    the others); plus `bias`. Returns float32 [R, C]."""
    cache.index_copy_(0, slots, values)
    kernel = kernel.float()  # [C, K]; its last column weighs the row itself
    taps = kernel.shape[1]
    y = values.float() * kernel[:, 0] if taps == 1 else cache[sources[:, taps - 2]].float() * kernel[:, 0]
    for j in range(1, taps):  # the next predecessor, ..., the row itself
        y = y + (cache[sources[:, taps - 2 - j]] if j < taps - 1 else values).float() * kernel[:, j]
    return y if bias is None else y + bias.float()


def short_conv(engine: Engine, x: torch.Tensor, conv: ShortConvWeights, layer: int, meta: StepMeta,
               slots: torch.Tensor) -> torch.Tensor:
    """LFM2's gated short convolution (ShortConvWeights) of the normed rows x [R, H]: B * x
    convolved as HF's conv1d, rounded to the model's dtype, gated by C, then out_proj."""
    H = engine.view.hidden_size
    bcx = engine.layout.linear(x, conv.in_proj)  # [R, 3H]: B, C, x
    bx = bcx[:, :H] * bcx[:, 2 * H:]
    y = causal_conv(engine.conv_cache[engine.view.conv_index[layer]], bx, conv.kernel, conv.bias,
                    meta.conv_sources, slots)
    return engine.layout.linear(bcx[:, H:2 * H] * y.to(x.dtype), conv.out_proj)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """HF's l2norm (FLA's): x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def delta_net(engine: Engine, x: torch.Tensor, net: GatedDeltaNetWeights, layer: int, meta: StepMeta,
              slots: torch.Tensor) -> torch.Tensor:
    """Qwen 3.5's gated DeltaNet (GatedDeltaNetWeights) of the normed rows x [R, H], with HF's
    single-token decode arithmetic per row (torch_recurrent_gated_delta_rule), each row's
    state from its parent's (meta.recurrent_rows), written to the ring at its slot."""
    v, lin = engine.view, engine.layout.linear
    R, dtype = x.shape[0], x.dtype
    hk, hv, dk, dv = net.num_k_heads, net.num_v_heads, net.k_dim, net.v_dim
    mixed = causal_conv(engine.conv_cache[v.conv_index[layer]], lin(x, net.in_qkv), net.kernel, None,
                        meta.conv_sources, slots)
    mixed = F.silu(mixed.to(dtype))  # HF: the convolution's output in the weights' dtype, then SiLU
    q = mixed[:, :hk * dk].reshape(R, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].reshape(R, hk, dk)
    val = mixed[:, 2 * hk * dk:].reshape(R, hv, dv)
    z = lin(x, net.in_z)
    beta = torch.sigmoid(lin(x, net.in_b)).float()
    decay = (-net.a_log.float().exp() * F.softplus(lin(x, net.in_a).float() + net.dt_bias)).exp()  # [R, Hv]
    if hv != hk:  # each key head serves hv / hk consecutive value heads
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    q = _l2norm(q.float())
    q = q / (dk**0.5)
    k = _l2norm(k.float())
    val = val.float()
    out = torch.zeros(R, hv, dv, dtype=torch.float32, device=x.device)
    states, index = engine.recurrent, v.delta_index[layer]
    for r, (slot, parent, base) in enumerate(meta.recurrent_rows):
        state = states.read(index, base, parent)
        state = state * decay[r][:, None, None]
        kv_mem = (state * k[r][:, :, None]).sum(dim=-2)
        delta = (val[r] - kv_mem) * beta[r][:, None]
        state = state + k[r][:, :, None] * delta[:, None, :]
        out[r] = (state * q[r][:, :, None]).sum(dim=-2)
        states.write(index, base, slot, state)
    core = out.to(dtype).float()  # HF rounds the output to the model's dtype before its norm
    core = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + net.norm_eps)
    gated = (net.norm_weight * core.to(dtype)) * F.silu(z.view(R, hv, dv).float())
    return lin(gated.to(dtype).reshape(R, hv * dv), net.out_proj)


class RecurrentStates:
    """The DeltaNet layers' recurrent states (float32 [Hv, dk, dv]) of each sequence's last
    `ring` slots: a ring per KV region (keyed by its first slot), slot s at s - base mod
    ring. A step's rows and their parents span at most width + 1 consecutive positions,
    so `ring` = width + 4 never lets a row overwrite a state another row still reads."""

    def __init__(self, layers: int, heads: int, k_dim: int, v_dim: int, ring: int, device: torch.device):
        self.shape = (layers, ring, heads, k_dim, v_dim)
        self.ring = ring
        self.device = device
        self._zero = torch.zeros(heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self._rings: dict[int, torch.Tensor] = {}
        self._bases: list[int] = []  # sorted

    def _region(self, base: int) -> torch.Tensor:
        ring = self._rings.get(base)
        if ring is None:
            ring = self._rings[base] = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
            bisect.insort(self._bases, base)
        return ring

    def read(self, layer: int, base: int, slot: int) -> torch.Tensor:
        """The state after `slot` (a negative slot: before position 0, zeros)."""
        return self._zero if slot < 0 else self._region(base)[layer, (slot - base) % self.ring]

    def write(self, layer: int, base: int, slot: int, state: torch.Tensor) -> None:
        self._region(base)[layer, (slot - base) % self.ring] = state

    def move(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Engine.move_kv's compaction for the states (absolute slots, each in its region)."""
        for src, dst in zip(sources, targets):
            if src != dst:
                base = self._bases[bisect.bisect_right(self._bases, src) - 1]
                ring = self._rings[base]
                ring[:, (dst - base) % self.ring] = ring[:, (src - base) % self.ring]

    def clear(self) -> None:
        self._rings.clear()
        self._bases.clear()
