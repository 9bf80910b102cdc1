"""Token mixers other than attention, row-invariant as the attention backends are: LFM2's
gated short convolution, Qwen 3.5's gated DeltaNet, Mamba2 (Granite 4.0-H, Bamba,
Nemotron-H, Falcon-H1, Mamba2) and the first Mamba.

All convolve a projection of each row over its last K positions; the DeltaNet and the
Mambas also carry a recurrent state ([Hv, dk, dv], [Hm, dh, N], [I, N]) from row to row
(on the kernel layout the DeltaNet's and Mamba2's updates run in C++: cpu_states.cpp).
`MixerCache` keeps both per sequence over its last few slots only (a ring: a state per position would cost megabytes
per position), and a step names each row's ring rows: where it writes, its predecessors'
(its draft tree path's rows, else its sequence's committed ones) and its parent's state
(StepMeta.conv_rows / conv_sources / recurrent_rows). Rows are processed in step order,
which puts every tree row after its parent; each row's arithmetic is that of a lone row,
so its outputs never depend on the other rows of its step.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_selfspec.kernels.cpu_rows import load_rows_states

from .memory import zeroed

if TYPE_CHECKING:  # annotations only
    from .interface import MixerHost
    from .meta import StepMeta
    from .weights import GatedDeltaNetWeights, Mamba1Weights, Mamba2Weights, ShortConvWeights


def causal_conv(cache: torch.Tensor, values: torch.Tensor, kernel: torch.Tensor, bias: torch.Tensor | None,
                meta: StepMeta) -> torch.Tensor:
    """Writes the rows' `values` [R, C] at their ring rows of one layer's convolution inputs
    (MixerCache.conv[layer]), then convolves each row over its predecessors' and its own in
    float32, oldest first, each tap's product added in turn (a row's sum never depends on
    the others); plus `bias`. Returns float32 [R, C]."""
    cache.index_copy_(0, meta.conv_rows, values)
    sources = meta.conv_sources
    kernel = kernel.float()  # [C, K]; its last column weighs the row itself
    taps = kernel.shape[1]
    y = values.float() * kernel[:, 0] if taps == 1 else cache[sources[:, taps - 2]].float() * kernel[:, 0]
    for j in range(1, taps):  # the next predecessor, ..., the row itself
        y = y + (cache[sources[:, taps - 2 - j]] if j < taps - 1 else values).float() * kernel[:, j]
    return y if bias is None else y + bias.float()


def short_conv(engine: MixerHost, x: torch.Tensor, conv: ShortConvWeights, layer: int, meta: StepMeta) -> torch.Tensor:
    """LFM2's gated short convolution (ShortConvWeights) of the normed rows x [R, H]: B * x
    convolved as HF's conv1d, rounded to the model's dtype, gated by C, then out_proj."""
    H = engine.view.hidden_size
    bcx = engine.layout.linear(x, conv.in_proj)  # [R, 3H]: B, C, x
    bx = bcx[:, :H] * bcx[:, 2 * H:]
    y = causal_conv(engine.mixer_cache.conv[engine.view.conv_index[layer]], bx, conv.kernel, conv.bias, meta)
    return engine.layout.linear(bcx[:, H:2 * H] * y.to(x.dtype), conv.out_proj)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """HF's l2norm (FLA's): x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def delta_net(
    engine: MixerHost, x: torch.Tensor, net: GatedDeltaNetWeights, layer: int, meta: StepMeta
) -> torch.Tensor:
    """Qwen 3.5's (Qwen3-Next's, OLMo Hybrid's) gated DeltaNet (GatedDeltaNetWeights) of the
    normed rows x [R, H], with HF's single-token decode arithmetic per row
    (torch_recurrent_gated_delta_rule), each row's state from its parent's
    (meta.recurrent_rows), written at its own ring row."""
    v, lin = engine.view, engine.layout.linear
    R, dtype = x.shape[0], x.dtype
    hk, hv, dk, dv = net.num_k_heads, net.num_v_heads, net.k_dim, net.v_dim
    cache = engine.mixer_cache
    if net.grouped:  # Qwen3-Next: regrouped as HF's fix_query_key_value_ordering does
        share = hv // hk
        fused = lin(x, net.in_qkv[0]).view(R, hk, 2 * dk + 2 * share * dv)
        q, k, val, z = fused.split([dk, dk, share * dv, share * dv], dim=-1)
        qkv = torch.cat((q.reshape(R, -1), k.reshape(R, -1), val.reshape(R, -1)), dim=-1)
        z = z.reshape(R, hv * dv)
        b_a = lin(x, net.in_b).view(R, hk, 2 * share)
        b, a = b_a[..., :share].reshape(R, hv), b_a[..., share:].reshape(R, hv)
    elif len(net.in_qkv) > 1:
        qkv = torch.cat([lin(x, part) for part in net.in_qkv], dim=-1)
    else:
        qkv = lin(x, net.in_qkv[0])
    mixed = causal_conv(cache.conv[v.conv_index[layer]], qkv, net.kernel, None, meta)
    mixed = F.silu(mixed.to(dtype))  # HF: the convolution's output in the weights' dtype, then SiLU
    q = mixed[:, :hk * dk].reshape(R, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].reshape(R, hk, dk)
    val = mixed[:, 2 * hk * dk:].reshape(R, hv, dv)
    if not net.grouped:
        z, b, a = lin(x, net.in_z), lin(x, net.in_b), lin(x, net.in_a)
    beta = torch.sigmoid(b)
    beta = (beta if net.beta_scale == 1.0 else beta * net.beta_scale).float()  # OLMo Hybrid: * 2 in the model's dtype
    decay = (-net.a_log.float().exp() * F.softplus(a.float() + net.dt_bias)).exp()  # [R, Hv]
    if hv != hk:  # each key head serves hv / hk consecutive value heads
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    q = _l2norm(q.float())
    q = q / (dk**0.5)
    k = _l2norm(k.float())
    val = val.float()
    out = torch.zeros(R, hv, dv, dtype=torch.float32, device=x.device)
    index = v.state_index[layer]
    if cache.kernels is not None:  # the C++ update (cpu_states.cpp): one pass over each state
        real = len(meta.recurrent_rows)
        out[:real] = cache.kernels[1](cache.states, index, meta.recurrent_index, decay[:real].contiguous(),
                                      beta[:real].contiguous(), q[:real].contiguous(), k[:real].contiguous(),
                                      val[:real].contiguous())
    else:  # HF's ops at batch 1, row by row
        for r, (row, parent) in enumerate(meta.recurrent_rows):
            state = cache.read_state(index, parent)
            state = state * decay[r][:, None, None]
            kv_mem = (state * k[r][:, :, None]).sum(dim=-2)
            delta = (val[r] - kv_mem) * beta[r][:, None]
            state = state + k[r][:, :, None] * delta[:, None, :]
            out[r] = (state * q[r][:, :, None]).sum(dim=-2)
            cache.states[index, row] = state
    core = out.to(dtype).float()  # HF rounds the output to the model's dtype before its norm
    core = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + net.norm_eps)
    gated = (net.norm_weight * core.to(dtype)) * F.silu(z.view(R, hv, dv).float())
    return lin(gated.to(dtype).reshape(R, hv * dv), net.out_proj)


def mamba2(engine: MixerHost, x: torch.Tensor, net: Mamba2Weights, layer: int, meta: StepMeta) -> torch.Tensor:
    """A Mamba2 mixer (Mamba2Weights) of the normed rows x [R, H], with HF's
    single-token decode arithmetic per row (mamba2_selective_state_update, at batch 1:
    the same ops in the same dtypes, its bmm included), each row's state from its parent's
    (meta.recurrent_rows), written at its own ring row."""
    v, lin = engine.view, engine.layout.linear
    R, dtype = x.shape[0], x.dtype
    heads, dh, n, groups = net.num_heads, net.head_dim, net.state_size, net.num_groups
    inner, channels = heads * dh, net.kernel.shape[0]
    cache = engine.mixer_cache
    zxbcdt = lin(x if net.in_scale == 1.0 else x * net.in_scale, net.in_proj)  # [R, I + channels + Hm]
    if net.projection_scale is not None:  # Falcon-H1's muP vector over the columns
        zxbcdt = zxbcdt * net.projection_scale
    z, xbc, dt = zxbcdt[:, :inner], zxbcdt[:, inner:inner + channels], zxbcdt[:, inner + channels:]
    xbc = F.silu(causal_conv(cache.conv[v.conv_index[layer]], xbc, net.kernel, net.conv_bias, meta).to(dtype))
    xs = xbc[:, :inner].reshape(R, heads, dh)
    per_group = heads // groups  # head h reads group h // per_group's B and C
    b = xbc[:, inner:inner + groups * n].reshape(R, groups, 1, n).expand(R, groups, per_group, n).reshape(R, heads, n)
    c = xbc[:, inner + groups * n:].reshape(R, groups, 1, n).expand(R, groups, per_group, n).reshape(R, heads, n, 1)
    dt = F.softplus(dt + net.dt_bias.to(dtype))  # [R, Hm], the model's dtype
    if meta.prompt and net.dt_limit != (0.0, float("inf")):  # as HF's chunked prefill (Nemotron-H: >= time_step_min)
        dt = dt.clamp(*net.dt_limit)
    decay = torch.exp(dt.float() * -torch.exp(net.a_log.float()))  # exp(dt A) [R, Hm]
    dtb = dt[:, :, None] * b  # [R, Hm, N], rounded to the model's dtype as HF's dB
    index = v.state_index[layer]
    out = torch.zeros(R, heads, dh, dtype=dtype, device=x.device)
    if cache.kernels is not None:  # the C++ update (cpu_states.cpp): one pass over each state, no [dh, N] temporaries
        real = len(meta.recurrent_rows)
        out[:real] = cache.kernels[0](cache.states, index, meta.recurrent_index, decay[:real].contiguous(),
                                      dtb[:real].float().contiguous(), xs[:real].float().contiguous(),
                                      c[:real, :, :, 0].float().contiguous()).to(dtype)
    else:  # HF's ops at batch 1, row by row: (dt B) x in the model's dtype, its bmm
        dbx = dtb[:, :, None, :] * xs[..., None]  # [R, Hm, dh, N]
        for r, (row, parent) in enumerate(meta.recurrent_rows):
            state = cache.read_state(index, parent) * decay[r][:, None, None] + dbx[r]
            cache.states[index, row] = state
            torch.bmm(state.to(dtype), c[r], out=out[r][..., None])
    y = (out + xs * net.d[:, None]).to(dtype).reshape(R, inner)
    if net.norm_weight is None:  # Falcon-H1 without its norm: gated in the model's dtype
        y = lin(y * F.silu(z), net.out_proj)
    else:
        y = lin(_gated_norm(y, z, net), net.out_proj)
    return y if net.out_scale == 1.0 else y * net.out_scale


def mamba1(engine: MixerHost, x: torch.Tensor, net: Mamba1Weights, layer: int, meta: StepMeta) -> torch.Tensor:
    """The first Mamba's mixer (Mamba1Weights) of the normed rows x [R, H], with HF's
    single-token decode arithmetic per row (mamba_selective_state_update at batch 1), each
    row's state [I, N] from its parent's (meta.recurrent_rows), written at its own ring row."""
    v, lin = engine.view, engine.layout.linear
    R, dtype = x.shape[0], x.dtype
    inner, n = net.state_shape
    cache = engine.mixer_cache
    xz = lin(x, net.in_proj)  # [R, 2I]: x, z
    xs = F.silu(causal_conv(cache.conv[v.conv_index[layer]], xz[:, :inner], net.kernel, net.conv_bias, meta).to(dtype))
    projected = lin(xs, net.x_proj)  # [R, rank + 2N]
    low, b, c = projected[:, :net.rank], projected[:, net.rank:net.rank + n], projected[:, net.rank + n:]
    if net.norms is not None:  # Falcon Mamba: dt's input, B and C RMS-normed (HF's own modules)
        low, b, c = (norm(t) for norm, t in zip(net.norms, (low, b, c)))
    dt = F.softplus(lin(low.contiguous(), net.dt_weight) + net.dt_bias.float().to(dtype))  # [R, I]
    decay = torch.exp(dt.float()[:, :, None] * -torch.exp(net.a_log.float()))  # exp(dt A) [R, I, N], float32
    dbx = (dt.float()[:, :, None] * b.float()[:, None, :]) * xs.float()[:, :, None]  # (dt B) x, float32
    out = torch.zeros(R, inner, dtype=dtype, device=x.device)
    index = v.state_index[layer]
    for r, (row, parent) in enumerate(meta.recurrent_rows):
        state = cache.read_state(index, parent) * decay[r] + dbx[r]
        cache.states[index, row] = state
        out[r] = torch.matmul(state.to(dtype)[None], c[r, :, None][None])[0, :, 0]  # HF's [1, I, N] @ [1, N, 1]
    y = (out + xs * net.d) * F.silu(xz[:, inner:])
    return lin(y.to(dtype), net.out_proj)


def _gated_norm(y: torch.Tensor, z: torch.Tensor, net: Mamba2Weights) -> torch.Tensor:
    """HF's gated RMSNorm of a Mamba2 mixer's output y [R, I] by z, per group of channels:
    y * silu(z) in float32, normed, then weight * (rounded) (Granite 4.0-H, Bamba,
    Nemotron-H); Falcon-H1's: weight * norm in float32, gated before or after the norm."""
    R, inner = y.shape
    gated = y.float() if net.norm_before_gate else y.float() * F.silu(z.float())
    grouped = gated.view(R, inner // net.norm_group, net.norm_group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + net.norm_eps)
    if not net.norm_in_float32:
        return (net.norm_weight * grouped.view(R, inner).to(y.dtype)).to(y.dtype)
    normed = (net.norm_weight.view(-1, net.norm_group) * grouped).view(R, inner)
    return (normed * F.silu(z.float()) if net.norm_before_gate else normed).to(y.dtype)


class MixerCache:
    """What the convolution, DeltaNet and Mamba layers carry from step to step, for each
    sequence (KV region, keyed by its first slot) and only over its last few slots: the
    convolutions' inputs (`conv` [conv layers, rows, C], the model's dtype) over `ring` =
    width + K + 1 slots, and the recurrent states (`states` [DeltaNet / Mamba layers, rows,
    *state shape], float32, a megabyte or more each at Qwen3.5-0.8B's or Granite-4.0-H-1B's
    size) over `state_ring` = width + 2 slots.
    Slot s of the sequence at `base` is conv row 2 + region * ring + (s - base) mod ring
    (row 0 stays zero: what a convolution reads before position 0; row 1 takes the pad
    rows' writes) and state row region * state_ring + (s - base) mod state_ring.

    A step's rows sit after its sequence's last committed position, at most `width` of
    them, and reach back at most K - 1 positions (a state: 1) before its first row; the
    rings are longer than that span, so no row overwrites what a row still reads (a
    DeltaNet ring of width - 1 makes the random sweep part from HF). HF keeps the last K
    inputs and one state per layer; the engine keeps a few more, never one per position."""

    ZERO, TRASH = 0, 1

    def __init__(self, engine: MixerHost):
        v = engine.view
        self.taps = v.conv_taps
        self.ring = engine.width + self.taps + 1
        self.state_ring = engine.width + 2
        self._conv_shape = (v.num_conv_layers, v.conv_channels)
        self._state_shape = None if v.state_shape is None else (v.num_state_layers, *v.state_shape)
        self.dtype, self.device = v.dtype, v.device
        # the C++ state updates where the engine runs the C++ rows (its kernel layout), else
        # the PyTorch ops (HF's own, row by row)
        self.kernels = load_rows_states() if engine.layout.kernel_layers is not None else None
        self._regions: dict[int, int] = {}  # first slot -> region index
        self.conv = self.states = None
        self._zero_state = None if v.state_shape is None else torch.zeros(v.state_shape, device=self.device)
        self._allocate(1)

    def _allocate(self, regions: int) -> None:
        """Room for `regions` sequences, the rings already in use copied. Zeroed lazily
        (memory.zeroed): a region's pages take memory when a sequence first writes them
        (Granite-4.0-H-1B's states are 540 MB a region)."""
        layers, channels = self._conv_shape
        conv = zeroed((layers, 2 + regions * self.ring, channels), self.dtype, self.device)
        states = None if self._state_shape is None else zeroed(
            (self._state_shape[0], regions * self.state_ring, *self._state_shape[1:]), torch.float32, self.device)
        if self.conv is not None:
            conv[:, :self.conv.shape[1]] = self.conv
            if states is not None:
                states[:, :self.states.shape[1]] = self.states
        self.conv, self.states = conv, states

    def new_request(self) -> None:
        """No sequence's rows are kept (their rings are reused from the first)."""
        self._regions.clear()

    def _region(self, base: int) -> int:
        region = self._regions.get(base)
        if region is None:
            region = self._regions[base] = len(self._regions)
            if 2 + (region + 1) * self.ring > self.conv.shape[1]:
                self._allocate(2 * (region + 1))
        return region

    @contextlib.contextmanager
    def scratch(self) -> Iterator[None]:
        """Steps that only time the engine (costs.py) write to rings of their own, made for
        them and dropped after, so a measurement mid-request leaves every sequence's rows as
        they were and its memory is given back (growing the sequences' rings by a region for
        it kept a region of states, up to gigabytes, for the engine's life)."""
        saved = self._regions, self.conv, self.states
        self._regions, self.conv, self.states = {}, None, None
        self._allocate(1)
        try:
            yield
        finally:
            self._regions, self.conv, self.states = saved

    def row(self, base: int, slot: int) -> int:
        """The conv row of `slot` of the sequence whose KV region starts at `base`."""
        return 2 + self._region(base) * self.ring + (slot - base) % self.ring

    def state_row(self, base: int, slot: int) -> int:
        """The state row of `slot` of the sequence whose KV region starts at `base`."""
        return self._region(base) * self.state_ring + (slot - base) % self.state_ring

    def step_rows(self, positions: Sequence[int], slots: Sequence[int], paths: Sequence[Sequence[int]] | None,
                  bases: Sequence[int] | None, rows: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """For a step's `rows` rows (the real ones at `positions` / `slots`): the conv row each
        writes [rows] (pad rows: TRASH), the conv rows of each one's 1st .. (K-1)th
        predecessor [rows, K-1] (its draft tree path's rows while the path reaches back that
        far, the path ending at the row itself; else its sequence's committed token at
        position p - k, at slot base + p - k; ZERO before position 0 and for pad rows), and
        per real row (its state row, its parent's or -1 before position 0)."""
        writes = torch.full((rows,), self.TRASH, dtype=torch.long)
        sources = torch.full((rows, self.taps - 1), self.ZERO, dtype=torch.long)
        recurrent = []
        for r, (position, slot) in enumerate(zip(positions, slots)):
            path = paths[r] if paths is not None else ()
            base = bases[r] if bases is not None else 0
            writes[r] = self.row(base, slot)
            # the 1st .. (K-1)th predecessor's slot (at least the 1st: a state's parent)
            before = [path[-1 - k] if k < len(path) else base + position - k if position - k >= 0 else None
                      for k in range(1, max(self.taps, 2))]
            for k, source in enumerate(before[:self.taps - 1]):
                if source is not None:
                    sources[r, k] = self.row(base, source)
            if self._state_shape is not None:
                parent = before[0]
                recurrent.append((self.state_row(base, slot), -1 if parent is None else self.state_row(base, parent)))
        return writes, sources, tuple(recurrent)

    def move(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Engine.move_kv's compaction (absolute slots, each in its sequence's region)."""
        bases = sorted(self._regions)  # each region's slots run from its base to the next one's
        for src, dst in zip(sources, targets):
            if src != dst and bases:
                base = bases[max(bisect.bisect_right(bases, src) - 1, 0)]
                self.conv[:, self.row(base, dst)] = self.conv[:, self.row(base, src)]
                if self.states is not None:
                    self.states[:, self.state_row(base, dst)] = self.states[:, self.state_row(base, src)]

    def read_state(self, layer: int, row: int) -> torch.Tensor:
        """The recurrent state at state row `row` (-1: before position 0, zeros)."""
        return self._zero_state if row < 0 else self.states[layer, row]
