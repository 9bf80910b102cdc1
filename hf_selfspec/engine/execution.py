"""The maths of a step: a step's rows through decoder layers (`run_layers`) and the LM head
(`logits`, `argmax_only`), row-invariantly. On the kernel layout a run of alike layers is
one C++ call (kernels/cpu-rows/layers.cpp rows_layers); otherwise each layer runs as PyTorch ops with the
layout's products (layouts.py) and the engine's attention backend (attention.py), an
offloaded layer's weights brought in for the step, a hybrid's mixers from mixers.py.
`LayerExecution` is a part of `Engine` (core.py) with this one job."""

from __future__ import annotations

import torch

from . import latent, mixers
from .layered import apply_rope
from .meta import StepMeta

__all__ = ["LayerExecution"]


class LayerExecution:
    """How an `Engine` computes a step's rows."""

    def _pad(self, h: torch.Tensor, rows: int) -> torch.Tensor:
        if h.shape[0] == rows:
            return h
        x = torch.zeros(rows, h.shape[1], dtype=h.dtype, device=h.device)
        x[: h.shape[0]] = h
        return x

    def run_layers(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """h [n, H] (the step's real rows) after `start` layers -> [n, H] after `end`
        layers; writes the KV of layers [start, end) at meta.slots. On the kernel layout the
        resident layers run as C++ calls; a layer accelerate offloads always runs as
        PyTorch ops with its weights brought in for the step (the same way at every step, so
        AR and speculative rows compute it alike)."""
        v = self.view
        if self.several_devices:
            return self._run_groups(h, start, end, meta)
        if start == 0:  # GPT-2: the tokens' rows plus their positions'; Bloom: normed
            h = v.first_layer_input(h, meta.positions)
        return self._run_span(h, start, end, meta)

    def _run_groups(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """`run_layers` on a model over several devices: each run of layers on its device,
        with the step's metadata there; the rows move where the device changes, as
        accelerate's hooks move a forward's."""
        if start == 0:
            h = self.view.first_layer_input(h.to(meta.positions.device), meta.positions)
        for group in self.groups:
            lo, hi = max(start, group.lo), min(end, group.hi)
            if lo < hi:
                h = self._run_span(h.to(group.device), lo, hi, meta.on(group.device))
        return h

    def _run_span(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """Layers [start, end), all on one device (h and meta there)."""
        v = self.view
        if self._fused_weights is None:
            return self._run_ops(h, start, end, meta)
        streamed = v.streamed_layers
        if not streamed:  # (a resident model: no per-layer look at the placement per step)
            return self._run_kernel(h, start, end, meta)
        lo = start
        while lo < end:  # runs of resident layers (C++) and of streamed ones (ops)
            hi = lo + 1
            while hi < end and (hi in streamed) == (lo in streamed):
                hi += 1
            h = (self._run_ops if lo in streamed else self._run_kernel)(h, lo, hi, meta)
            lo = hi
        return h

    def _run_kernel(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """Layers [start, end) on the kernel layout: one C++ call per run of alike layers, no
        padding; h [n, H] -> [n, H]."""
        v = self.view
        n = h.shape[0]
        slots, limits = meta.slots[:n], meta.key_limit[:n]
        # rows_layers computes in float32 (bf16/fp16 weights and caches widened in
        # registers); the residual stream rounds to the model's dtype at EVERY layer
        # boundary, so a row's bits never depend on where a seg ends (AR: one run of all
        # layers; a chain: several segs), as with the PyTorch layers in that dtype
        dtype = h.dtype
        h = h.float().contiguous()
        offset, softcap = 1.0 if v.norm_plus_one else 0.0, v.attention_softcap or 0.0
        # one call unless layers differ in RoPE (SmolLM3's unrotated, Gemma 3's per type)
        # or window (the sliding layers of Gemma 2/3, Qwen2, ...); each table widened once
        widened: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        weights, k_cache, v_cache, first = self._fused_weights, self.k_cache, self.v_cache, 0
        if self.several_devices:  # the run's group: its own cache tensors, its layers' weights
            group, per = self._group_of[start], self._fused_per_layer
            weights, first = weights[group.lo * per:group.hi * per], group.lo
            k_cache, v_cache = k_cache.group_tensor(group), v_cache.group_tensor(group)
        for lo, hi, table, window in self._layer_runs(start, end):
            if table not in widened:
                widened[table] = self._float_tables(meta, table, n)
            c, s = widened[table]
            h = self.layout.kernel_layers(h, weights, self._fused_per_layer, k_cache,
                                          v_cache, c, s, slots, limits, v.eps, v.scaling,
                                          v.residual_multiplier, meta.path, meta.base, lo - first, hi - first,
                                          offset, v.gelu, softcap, window, v.rope_pairs)
        return h.to(dtype)

    def _run_ops(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """Layers [start, end) as PyTorch ops with the layout's products, on the step's rows
        padded as the layout needs; h [n, H] -> [n, H]."""
        v = self.view
        n = h.shape[0]
        h = self._pad(h, meta.rows)
        attend = self.attention.bind(self, meta)  # attention.py: row-invariant backends
        if self.fused_small_ops and v.cos.shape[-1] == v.head_dim and self._inputs_normed \
                and v.rms_sequential_gated and not (v.norm_plus_one or v.gelu or v.rope_pairs):
            # the Triton RoPE rotates all of d; its add + norm fuses the Llama form's norms
            return self._run_layers_fused(h, start, end, meta, attend)[:n]
        streamed = v.streamed_layers
        for li in range(start, end):
            if li in streamed:  # an offloaded layer: its weights brought in for the step
                with v.layer_weights(li) as lw:
                    h = self._layer_step(h, lw, li, meta, attend, n)
            else:
                h = self._layer_step(h, v.layers[li], li, meta, attend, n)
        return h[:n]

    def _layer_step(self, h: torch.Tensor, lw, li: int, meta: StepMeta, attend, n: int) -> torch.Tensor:
        """Decoder layer `li` (weights `lw`) on the step's padded rows h [R, H]."""
        v = self.view
        if lw.has_mixer:  # (a Nemotron-H MLP layer has none; its token-mixer layers no MLP)
            x = h if lw.input_norm is None else v.norm(h, lw.input_norm)
            if lw.conv is not None:  # LFM2's convolution in place of attention (then the same MLP)
                o = mixers.short_conv(self, x, lw.conv, li, meta)
            elif lw.delta is not None:  # Qwen 3.5's / OLMo Hybrid's DeltaNet
                o = mixers.delta_net(self, x, lw.delta, li, meta)
            elif lw.mamba is not None and lw.o is not None:  # Falcon-H1: Mamba2 and attention, summed
                a = self._attention_block(x * v.attention_in_multiplier, lw, li, meta, attend)
                o = mixers.mamba2(self, x, lw.mamba, li, meta) + a * v.attention_out_multiplier
            elif lw.mamba is not None:  # Granite 4.0-H's, Bamba's, Nemotron-H's Mamba2 mixer
                o = mixers.mamba2(self, x, lw.mamba, li, meta)
            elif lw.mamba1 is not None:  # Mamba's, Falcon Mamba's mixer
                o = mixers.mamba1(self, x, lw.mamba1, li, meta)
            else:
                o = self._attention_block(x, lw, li, meta, attend)
            if v.parallel is not None:  # both blocks read this layer's input (LayerWeights)
                m = self._mlp(x if v.parallel == "shared" else v.norm(h, lw.post_norm), lw, n)
                return (o + m) + h if v.parallel_sum_first else (h + o) + m
            if lw.attn_out_norm is not None:
                o = v.norm(o, lw.attn_out_norm)
            h = h + v.residual(o)
        if not lw.has_mlp:
            return h
        x = h if lw.post_norm is None else v.norm(h, lw.post_norm)
        m = self._mlp(x, lw, n)
        if lw.mlp_out_norm is not None:
            m = v.norm(m, lw.mlp_out_norm)
        return h + v.residual(m)

    def _attention_block(self, x: torch.Tensor, lw, li: int, meta: StepMeta, attend) -> torch.Tensor:
        """Layer `li`'s attention of its normed rows x [R, H], o_proj applied; writes the
        rows' KV at meta.slots."""
        v, lin, R = self.view, self.layout.linear, meta.rows
        cos, sin = self._rope_tables(meta, li, R)
        if lw.latent is not None:  # DeepSeek's latent attention: one key (and value) per row
            q, k = latent.query_and_key(x, lw.latent, cos, sin, self.layout)
            self.k_cache[li].index_copy_(1, meta.slots[:R], k)
            return lin(latent.heads_output(attend(q, li), lw.latent, self.layout), lw.o)
        cos, sin = cos[None], sin[None]  # [1, R, d]
        q, k, val, gate = self._qkv(x, lw, R)
        q = q.transpose(0, 1)  # [Hq, R, d]
        k = k.transpose(0, 1)  # [Hkv, R, d]
        q, k = apply_rope(q, cos, sin, v.rope_pairs), apply_rope(k, cos, sin, v.rope_pairs)
        if v.qk_norm_after_rope and lw.q_norm is not None:  # HunYuan; Llama 4's RoPE layers
            q, k = v.norm(q, lw.q_norm), v.norm(k, lw.k_norm)
        slots = meta.slots[:R]
        self.k_cache[li].index_copy_(1, slots, k)
        self.v_cache[li].index_copy_(1, slots, val.transpose(0, 1))
        o = attend(q, li)  # attention [R, Hq*d] in x's dtype
        if lw.out_gate is not None:  # AFMoE: gated per element
            o = o * torch.sigmoid(lin(x, lw.out_gate))
        if lw.head_gate is not None:  # LFM3: each head's output scaled by its own gate
            o = (o.view(R, v.num_heads, v.head_dim) * torch.sigmoid(lin(x, lw.head_gate))[..., None]).view(R, -1)
        return lin(o if gate is None else o * torch.sigmoid(gate), lw.o)  # Qwen 3.5: gated per element

    def _layer_runs(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Layers [start, end) as maximal runs (lo, hi, table, window) of layers with one
        RoPE table (LayeredModel.layer_rope: -1 none) and one sliding window (0: none): one
        run for most models."""
        v = self.view
        if self._uniform_layers:  # no loop over the layers per step
            return [(start, end, v.layer_rope[0], v.layer_window[0])]
        runs: list[tuple[int, int, int, int]] = []
        for li in range(start, end):
            kind = (v.layer_rope[li], v.layer_window[li])
            if runs and runs[-1][2:] == kind:
                runs[-1] = (runs[-1][0], li + 1, *kind)
            else:
                runs.append((li, li + 1, *kind))
        return runs

    def _float_tables(self, meta: StepMeta, table: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_table_rows` in float32, contiguous (what rows_layers reads)."""
        if table < 0:  # made in float32 at build
            return self._no_rotation(rows, torch.float32, meta.cos.device)
        cos, sin = self._table_rows(meta, table, rows)
        return cos.float().contiguous(), sin.float().contiguous()

    def _no_rotation(self, rows: int, dtype: torch.dtype, device: torch.device | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos = 1, sin = 0 for `rows` rows: apply_rope(q, cos, sin) is q bit for bit (a
        zero may change sign), so a layer without RoPE runs the same programs as the others."""
        device = self.view.device if device is None else device
        table = self._identity_rope.get((dtype, device))
        if table is None or table[0].shape[0] < rows:  # made at build for the widest step
            shape = (max(rows, self.meta_rows), self.view.cos.shape[-1])
            table = (torch.ones(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            self._identity_rope[(dtype, device)] = table
        return table[0][:rows], table[1][:rows]

    def _rope_tables(self, meta: StepMeta, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin [rows, d] layer `layer` rotates q and k by in this step."""
        return self._table_rows(meta, self.view.layer_rope[layer], rows)

    def _table_rows(self, meta: StepMeta, table: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin [rows, d] of RoPE table `table` in this step (LayeredModel.layer_rope:
        0 the first, k > 0 a layer type's own, Gemma 3's sliding layers; -1 no rotation)."""
        if table == 0:
            return meta.cos[:rows], meta.sin[:rows]
        if table > 0:
            return meta.extra_cos[table - 1][:rows], meta.extra_sin[table - 1][:rows]
        return self._no_rotation(rows, meta.cos.dtype, meta.cos.device)

    def _qkv(self, x: torch.Tensor, lw, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                             torch.Tensor | None]:
        """A layer's q [R, Hq, d], k and v [R, Hkv, d] from its normed input x [R, H]
        (q/k norms applied: Qwen3's on each head, OLMo 2's on the whole projection), and the
        gate [R, Hq*d] of its attention's output (Qwen 3.5: q_proj's rows after each head's
        q rows; None for every other model)."""
        v, lin = self.view, self.layout.linear
        if v.gated_attention:
            both = lin(x, lw.q).view(rows, v.num_heads, 2 * v.head_dim)
            q = v.norm(both[..., :v.head_dim], lw.q_norm)
            k = v.norm(lin(x, lw.k).view(rows, v.num_kv_heads, v.head_dim), lw.k_norm)
            val = lin(x, lw.v).view(rows, v.num_kv_heads, v.head_dim)
            return q, k, val, both[..., v.head_dim:].reshape(rows, -1)
        if lw.qkv_layout == "grouped":  # Falcon's new architecture: per KV head, its query heads, k, v
            group = v.num_heads // v.num_kv_heads
            fused = lin(x, lw.qkv).view(rows, v.num_kv_heads, group + 2, v.head_dim)
            q = fused[:, :, :group].reshape(rows, v.num_heads, v.head_dim)
            return q, fused[:, :, group], fused[:, :, group + 1], None
        if lw.qkv_layout == "shards":  # CodeGen: per shard of 4, its query, value and key rows
            fused = lin(x, lw.qkv).view(rows, 4, 3, -1)
            q, val, k = (fused[:, :, i].reshape(rows, v.num_heads, v.head_dim) for i in range(3))
            return q, k, val, None
        if lw.qkv is not None:  # GPT-NeoX: one product, each head's q, k, v rows in turn
            fused = lin(x, lw.qkv).view(rows, v.num_heads, 3, v.head_dim)
            q, k = fused[:, :, 0], fused[:, :, 1]
            if lw.q_norm is not None:  # Persimmon: each head's q and k LayerNormed (HF's modules) before RoPE
                q, k = v.norm(q, lw.q_norm), v.norm(k, lw.k_norm)
            return q, k, fused[:, :, 2], None
        q, k, val = lin(x, lw.q), lin(x, lw.k), lin(x, lw.v)
        if v.key_multiplier != 1.0:  # Falcon-H1's muP
            k = k * v.key_multiplier
        whole = isinstance(lw.q_norm, torch.Tensor) and lw.q_norm.shape[-1] != v.head_dim
        if whole:
            q, k = v.norm(q, lw.q_norm), v.norm(k, lw.k_norm)
        if v.clip_qkv is not None:  # OLMo, OLMoE: clamped after OLMoE's norms, before RoPE
            q, k, val = (t.clamp(-v.clip_qkv, v.clip_qkv) for t in (q, k, val))
        q = q.view(rows, v.num_heads, v.head_dim)
        k = k.view(rows, v.num_kv_heads, v.head_dim)
        val = val.view(rows, v.num_kv_heads, v.head_dim)
        if lw.q_norm is not None and not whole and not v.qk_norm_after_rope:  # each head (Cohere's: a module)
            q = v.norm(q, lw.q_norm)
            k = v.norm(k, lw.k_norm)
        return q, k, val, None

    def _mlp(self, x: torch.Tensor, lw, real_rows: int | None = None) -> torch.Tensor:
        """The MLP (or MoE block) of x's rows; an MoE block routes the first `real_rows` only
        (the rest pad the block: routed, they would read experts no row needs)."""
        lin = self.layout.linear
        if lw.moe is not None:
            return self._moe(x, lw.moe, x.shape[0] if real_rows is None else real_rows)
        if lw.gate is None:  # a plain MLP (Phi, StarCoder 2, GPT-NeoX): HF's own activation
            return lin(lw.act(lin(x, lw.up)), lw.down)
        v = self.view
        if v.mlp_gate_multiplier != 1.0 or v.mlp_down_multiplier != 1.0:  # Falcon-H1's muP
            gate = lin(x, lw.gate) * v.mlp_gate_multiplier
            return lin(v.act_mul(gate, lin(x, lw.up)), lw.down) * v.mlp_down_multiplier
        return lin(v.act_mul(lin(x, lw.gate), lin(x, lw.up)), lw.down)

    def _moe(self, x: torch.Tensor, moe, real_rows: int) -> torch.Tensor:
        """An MoE block on the rows x [R, H] (MoEWeights' maths; rows from real_rows on are
        padding, left zero). Every expert a real row picks runs on all R rows, each product
        the same [R, H] block as the layer's others (so a row's result is its own whatever
        the layout), and its output is added to the rows that picked it only."""
        lin = self.layout.linear
        logits = lin(x.float() if moe.router_input_float32 else x, moe.router)[:real_rows]  # [n, E]
        top, chosen = moe.route(logits, x.dtype)  # routing.py: this model's router
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():  # ascending, as HF's loop
            rows, slot = torch.where(chosen == expert)
            inputs = x
            if moe.weights_scale_inputs:  # Llama 4: each row enters the expert times its weight
                scale = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
                scale[rows, 0] = top[rows, slot].to(x.dtype)
                inputs = x * scale
            gate_up = lin(inputs, moe.gate_up[expert])
            if moe.gate_fn is not None:  # GPT-OSS: HF's own clamped SwiGLU of its interleaved gate/up
                hidden = moe.gate_fn(gate_up)
            elif not moe.gated:  # Nemotron-H: act(up x)
                hidden = moe.act(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                hidden = moe.act(gate) * up
            y = lin(hidden, moe.down[expert])[rows]
            if not moe.weights_scale_inputs:
                y = y * top[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if moe.shared is not None:  # Qwen2-MoE: its shared expert, sigmoid-gated, added last
            gate, up, down = moe.shared
            shared = (lin(moe.act(lin(x, up)), down) if gate is None  # Nemotron-H's: ungated
                      else lin(self.view.act_mul(lin(x, gate), lin(x, up)), down))
            out = out + (shared if moe.shared_gate is None else torch.sigmoid(lin(x, moe.shared_gate)) * shared)
            if moe.shared_average:  # Cohere 2 MoE's "average"
                out = out / 2
        return out

    def _run_layers_fused(self, h: torch.Tensor, start: int, end: int, meta: StepMeta, attend) -> torch.Tensor:
        """`run_layers`' PyTorch-ops branch with the fused Triton kernels (fused_small_ops):
        h [R, H] padded. The MLP's output is added inside the next layer's input norm, and
        after the last layer of the range by the same add, so a row's bits do not depend on
        where a seg ends."""
        from hf_selfspec.kernels.fused import add_rms_norm, rope_kv_write

        v, lin = self.view, self.layout.linear
        R = meta.rows
        slots = meta.slots[:R]
        pending = None  # the previous layer's MLP output, not yet added to h
        for li in range(start, end):
            lw = v.layers[li]
            cos, sin = self._rope_tables(meta, li, R)
            h, x = add_rms_norm(h, lw.input_norm, v.eps, pending)
            q, k, val, _ = self._qkv(x, lw, R)
            q = rope_kv_write(q, k, val, cos, sin, slots, self.k_cache[li], self.v_cache[li])  # [R, Hq, d]
            o = attend(q.transpose(0, 1), li)  # [R, Hq*d]
            h, x = add_rms_norm(h, lw.post_norm, v.eps, v.residual(lin(o, lw.o)))
            pending = v.residual(self._mlp(x, lw))
        return h if pending is None else h + pending

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream after the last layer [n, H] -> (logits [n, V], final hidden
        state after the final norm [n, H]), row-invariantly."""
        v = self.view
        n = h.shape[0]
        if v.head_streamed:
            with v.head_weights():  # (brought in where accelerate offloads them)
                return self._logits(h, n)
        return self._logits(h, n)

    def _logits(self, h: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.view
        x = v.norm(self._pad(h.to(self.norm_device), self.layout.rows(n)), v.final_norm).to(self.head_device)
        return v.scale_logits(self.layout.linear(v.head_input(x), v.lm_head)[:n]), x[:n]

    def argmax_only(self, h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """`logits` for a step that needs only each row's argmax: -> (None, argmax [n],
        final hidden [n, H]) from the LM head's screen, or (logits, argmax, final) where
        there is no screen or it cannot decide. The argmax is the float32 logits' either way."""
        if self.screen is not None:
            v = self.view
            if v.head_streamed:
                with v.head_weights():
                    final = v.norm(h, v.final_norm)
            else:
                final = v.norm(h, v.final_norm)  # (the screen is the CPU's: one device)
            argmax = self.screen.argmax(v.head_input(final))
            if argmax is not None:
                return None, argmax, final
        logits, final = self.logits(h)
        return logits, logits.argmax(-1), final

