"""Prefill: a prompt's KV into the engine's cache, through HF's own forward (its KV copied
in) or through the engine's decode programs in W-row chunks (EngineConfig.prefill), and
`auto`'s choice between them (cached on disk with the layout choice). `Prefill` is a part
of `Engine` (core.py) with this one job."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..logs import logger
from . import costs, latent
from .layered import check_engine_prefill, longrope_short_positions

__all__ = ["Prefill"]


class Prefill:
    """How an `Engine` fills its KV cache with a prompt."""

    @torch.no_grad()
    def prefill(self, prompt_ids: Sequence[int], base: int = 0):
        """Fill the KV cache with the prompt (see EngineConfig.prefill), at slots from `base`
        (a sequence's KV region in a batch). Returns (logits [V], final hidden after the
        final norm [H]) of the last prompt row."""
        if self.prefill_mode == "hf":
            return self._prefill_hf(prompt_ids, base)
        return self._prefill_engine(prompt_ids, base)

    @property
    def prefill_mode(self) -> str:
        """How prompts are prefilled: EngineConfig.prefill, with `auto` resolved once
        (cached on disk with the layout choice)."""
        if self._prefill_mode is None:
            self._prefill_mode = self._choose_prefill()
        return self._prefill_mode

    def _choose_prefill(self) -> str:
        if self.config.prefill != "auto":
            return self.config.prefill
        v = self.view
        # the engine's chunks only where HF's own prefill can be slow (16-bit products on
        # the CPU) and they run on the row kernel; not for the hybrids' recurrent mixers,
        # nor for longrope, whose long prompts only HF's prefill rotates as HF does, nor
        # where weights stream in (HF's prefill reads each offloaded layer once)
        if (self.streams_weights or v.device.type != "cpu" or v.dtype not in (torch.float16, torch.bfloat16)
                or self.layout.name != "kernel" or self.mixer_cache is not None
                or longrope_short_positions(v.config)):
            return "hf"
        cached = self._measured.prefill
        if cached is not None:
            return cached
        largest = max((lin for lw in v.layers for lin in lw.linears), key=lambda lin: lin.weight.numel())
        hf, engine = costs.prefill_product_seconds(largest, self.width, self.layout)
        choice = "engine" if engine < costs.PREFILL_SWITCH * hf else "hf"
        logger.info(f"hf_selfspec: prefill {choice!r} (a {costs.PREFILL_PROBE_ROWS}-row prompt chunk's "
                    f"largest product: HF {hf * 1e3:.1f} ms, the row kernel {engine * 1e3:.1f} ms)")
        self._measured.store_prefill(choice)
        return choice

    def _prefill_hf(self, prompt_ids: Sequence[int], base: int = 0):
        from transformers import DynamicCache

        n = len(prompt_ids)
        ids = torch.as_tensor([list(prompt_ids)], dtype=torch.long, device=self.embedding_device)
        cache = DynamicCache(config=self.view.config)
        out = self.view.decoder(input_ids=ids, use_cache=True, **{self._cache_kwarg: cache})
        for li, layer in enumerate(cache.layers):
            if self.view.num_conv_layers and self.view.conv_index[li] >= 0:
                # the hybrids: HF's state holds the convolution's input of the last K positions
                # (zeros before the first); a DeltaNet's or a Mamba's, its recurrent state too
                state, mixer = layer.conv_states[0][0], self.mixer_cache  # [C, K]
                for j in range(1, min(n, state.shape[-1]) + 1):  # the j-th last position
                    row = mixer.row(base, base + n - j)  # (first: a new sequence may grow the rings)
                    mixer.conv[self.view.conv_index[li], row] = state[:, -j]
                if self.view.state_index[li] >= 0:
                    row = mixer.state_row(base, base + n - 1)
                    mixer.states[self.view.state_index[li], row] = layer.recurrent_states[0][0].float()
            if getattr(layer, "keys", None) is None:  # a layer without attention (its mixer's states copied above)
                continue
            if self.view.layers[li].latent is not None:  # HF's cache: the latents and the turned k_rope
                self.k_cache[li][:, base:base + n] = latent.cached_keys(layer.keys[0, 0], layer.values[0, 0])
                continue
            # a sliding layer keeps only its last window - 1 positions: all a later query sees
            kept = layer.keys.shape[-2]
            # Falcon's new architecture caches each KV head repeated for its group of query heads
            step = layer.keys.shape[1] // self.k_cache.shape[1]
            self.k_cache[li][:, base + n - kept:base + n] = layer.keys[0, ::step]
            self.v_cache[li][:, base + n - kept:base + n] = layer.values[0, ::step]
        # after the final norm (Mamba2 keeps a 16-bit model's residual stream in float32:
        # its LM head reads it in the weights' dtype)
        last = out.last_hidden_state[0, -1].to(self.head_device, self.view.dtype)
        return self.view.scale_logits(self.view.lm_head(self.view.head_input(last[None])))[0], last

    def _prefill_engine(self, prompt_ids: Sequence[int], base: int = 0):
        n = len(prompt_ids)
        check_engine_prefill(self.view.config, n)
        for lo in range(0, n, self.width):
            chunk = list(prompt_ids[lo : lo + self.width])
            positions = list(range(lo, lo + len(chunk)))
            meta = (self.make_meta(positions) if base == 0 else
                    self.make_meta(positions, slots=[base + p for p in positions], bases=[base] * len(chunk)))
            meta.prompt = True
            h = self.run_layers(self.embed(chunk), 0, self.view.num_layers, meta)
        logits, final = self.logits(h[-1:])
        return logits[0], final[0]

