"""The fixed-width engine: static KV cache and the step programs `ar`, `seg`, `verify`.

Every GEMM, norm and elementwise op of a step runs on exactly `width` rows: real rows
first, padding after (pad rows reuse row 0's position and write their KV to a trash slot
no real row can see). Only KV writes and attention treat rows individually, and attention
is row-invariant (see attention.py). So a token's row is computed bit for bit the same
whether it is an AR step (1 real row), a catch-up of m rows or a verification of n rows:
this is what makes speculative greedy output identical to the engine's own AR output.

Programs (all share `run_layers`):
  ar          1 row, all layers, LM head, argmax
  seg[a,b,m]  m rows through layers [a, b)
  verify[c,n] n rows from layer c to the end, LM head, argmax per row
On the CPU the programs run eagerly; the metadata of a step (positions, KV slots, key
limits) lives in one buffer written by one copy, as the CUDA-graph runner will need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .attention import KEY_BLOCK, block_attention, visible_bias
from .layered import LayeredModel, rms_norm, rotate_half

# Rows per step on this CPU. Measured with scripts/bench_engine.py --widths (SmolLM2-135M,
# fp32, 2 threads): see README "Width". 8 rows cost ~1.2x one row, 16 rows ~1.8x.
DEFAULT_WIDTH = 8
DEFAULT_CAPACITY = 2048


@dataclass(frozen=True)
class EngineConfig:
    """width: rows per step (fixed for the engine's lifetime);
    capacity: KV slots for prompt + new tokens + one block of drafts."""

    width: int = DEFAULT_WIDTH
    capacity: int = DEFAULT_CAPACITY

    def __post_init__(self):
        if not isinstance(self.width, int) or not 1 <= self.width <= 64:
            raise ValueError(f"width must be an int in [1, 64], got {self.width!r}")
        if not isinstance(self.capacity, int) or self.capacity < 2 * self.width:
            raise ValueError(f"capacity must be an int >= 2*width, got {self.capacity!r}")


@dataclass
class StepMeta:
    """Per-step row metadata, device tensors of shape [W] (views of one buffer)."""

    positions: torch.Tensor  # RoPE position of each row
    slots: torch.Tensor  # KV slot each row writes (pad rows: the trash slot)
    key_limit: torch.Tensor  # last slot each row may attend to
    num_real: int
    bias: torch.Tensor  # [G*W, nb*KEY_BLOCK] additive attention mask
    cos: torch.Tensor  # [W, d]
    sin: torch.Tensor


class Engine:
    """Fixed-width engine over an HF model (weights shared, KV cache owned)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.width = self.config.width
        self.capacity = self.config.capacity
        self.view = LayeredModel(model, self.capacity)
        v = self.view
        self.group = v.num_heads // v.num_kv_heads
        # slot `capacity` is the trash slot for pad rows; round up to whole key blocks
        self.num_slots = -(-(self.capacity + 1) // KEY_BLOCK) * KEY_BLOCK
        self.trash_slot = self.capacity
        shape = (v.num_layers, v.num_kv_heads, self.num_slots, v.head_dim)
        self.k_cache = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.v_cache = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self._meta_host = torch.zeros(3, self.width, dtype=torch.long)
        self._meta = torch.zeros(3, self.width, dtype=torch.long, device=v.device)

    # ---- capacity -----------------------------------------------------------------------

    def check_capacity(self, prompt_len: int, max_new_tokens: int) -> None:
        """prompt + max_new + W must fit the KV cache; raise before any work otherwise."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty: pass at least one input token")
        need = prompt_len + max_new_tokens + self.width
        if need > self.capacity:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + draft width "
                f"({self.width}) = {need} exceeds the engine's KV capacity ({self.capacity}). "
                "Shorten the prompt, lower max_new_tokens, or attach with a larger capacity."
            )

    # ---- metadata -----------------------------------------------------------------------

    def make_meta(
        self, positions: Sequence[int], key_limits: Sequence[int] | None = None
    ) -> StepMeta:
        """Metadata for a step whose real rows sit at `positions` (chain: slot = position)."""
        n = len(positions)
        if not 1 <= n <= self.width:
            raise ValueError(f"a step takes 1..{self.width} rows, got {n}")
        limits = positions if key_limits is None else key_limits
        host = self._meta_host
        host[0, :n] = torch.as_tensor(positions)
        host[0, n:] = positions[0]
        host[1, :n] = host[0, :n]
        host[1, n:] = self.trash_slot
        host[2, :n] = torch.as_tensor(limits)
        host[2, n:] = positions[0]
        self._meta.copy_(host)
        positions_t, slots_t, limit_t = self._meta[0], self._meta[1], self._meta[2]
        num_blocks = max(limits) // KEY_BLOCK + 1
        bias = visible_bias(limit_t, num_blocks * KEY_BLOCK, self.group)
        v = self.view
        return StepMeta(
            positions_t, slots_t, limit_t, n, bias, v.cos[positions_t], v.sin[positions_t]
        )

    # ---- the maths of a step --------------------------------------------------------------

    def run_layers(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """h [W, H] after `start` layers -> [W, H] after `end` layers; writes KV of layers
        [start, end) at meta.slots."""
        v = self.view
        W, Hq, Hkv, d = self.width, v.num_heads, v.num_kv_heads, v.head_dim
        cos, sin = meta.cos[None], meta.sin[None]  # [1, W, d]
        for li in range(start, end):
            lw = v.layers[li]
            x = rms_norm(h, lw.input_norm, v.eps)
            q = lw.q(x).view(W, Hq, d)
            k = lw.k(x).view(W, Hkv, d)
            val = lw.v(x).view(W, Hkv, d)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, v.eps)
                k = rms_norm(k, lw.k_norm, v.eps)
            q = q.transpose(0, 1)  # [Hq, W, d]
            k = k.transpose(0, 1)  # [Hkv, W, d]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.k_cache[li].index_copy_(1, meta.slots, k)
            self.v_cache[li].index_copy_(1, meta.slots, val.transpose(0, 1))
            qg = (q.float() * v.scaling).reshape(Hkv, self.group * W, d)  # [Hkv, G*W, d]
            o = block_attention(qg, self.k_cache[li], self.v_cache[li], meta.bias)
            o = o.to(h.dtype).view(Hq, W, d).transpose(0, 1).reshape(W, Hq * d)
            h = h + lw.o(o)
            x = rms_norm(h, lw.post_norm, v.eps)
            h = h + lw.down(F.silu(lw.gate(x)) * lw.up(x))
        return h

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Up to W token ids -> hidden [W, H] (pad rows embed token 0)."""
        ids = torch.zeros(self.width, dtype=torch.long)
        ids[: len(token_ids)] = torch.as_tensor(token_ids)
        return self.view.embed_rows(ids.to(self.view.device))

    # ---- programs ------------------------------------------------------------------------

    @torch.no_grad()
    def seg(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """seg[start, end, m]: advance the block's rows from layer `start` to `end`."""
        return self.run_layers(h, start, end, meta)

    @torch.no_grad()
    def verify(self, h: torch.Tensor, start: int, meta: StepMeta):
        """verify[start, n]: rows from layer `start` to the end.
        Returns (logits [W, V], argmax [W], final hidden [W, H])."""
        h = self.run_layers(h, start, self.view.num_layers, meta)
        logits = self.view.logits(h)
        return logits, logits.argmax(-1), h

    @torch.no_grad()
    def prefill(self, prompt_ids: Sequence[int]):
        """Run the prompt through the same fixed-width programs, W rows per chunk, so the
        prompt's KV is computed with exactly the decode operators.
        Returns (logits [V], final hidden [H]) of the last prompt row."""
        n = len(prompt_ids)
        for lo in range(0, n, self.width):
            chunk = list(prompt_ids[lo : lo + self.width])
            meta = self.make_meta(range(lo, lo + len(chunk)))
            h = self.run_layers(self.embed(chunk), 0, self.view.num_layers, meta)
        last = (n - 1) % self.width
        # logits of the whole block (fixed width), then the last real row
        logits = self.view.logits(h)
        return logits[last], h[last]

    @torch.no_grad()
    def ar_step(self, token: int, position: int):
        """ar: one real row (the last committed token at `position`) through all layers.
        Returns (logits [V], next token id, final hidden [H])."""
        meta = self.make_meta([position])
        logits, argmax, h = self.verify(self.embed([token]), 0, meta)
        return logits[0], int(argmax[0]), h[0]

    @torch.no_grad()
    def generate_ar(
        self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """The engine's own greedy AR decoding: the reference every speculative path must
        match token for token. Stops after an EOS id (included) or max_new_tokens."""
        self.check_capacity(len(prompt_ids), max_new_tokens)
        eos = set(eos_token_ids)
        logits, _ = self.prefill(prompt_ids)
        token = int(logits.argmax())
        out = [token]
        position = len(prompt_ids)
        while len(out) < max_new_tokens and token not in eos:
            _, token, _ = self.ar_step(token, position)
            out.append(token)
            position += 1
        return out[:max_new_tokens] if max_new_tokens > 0 else []
