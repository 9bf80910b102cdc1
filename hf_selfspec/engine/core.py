"""The fixed-shape engine: static KV cache and the step programs `ar`, `seg`, `verify`.

A token's row must be computed bit for bit the same whether it is an AR step (1 real
row), a catch-up of m rows or a verification of n rows: this is what makes speculative
greedy output identical to the engine's own AR output. Libraries choose kernels by shape,
so the engine fixes what a row's arithmetic depends on in three places:

  products   a row layout (layouts.py: kernel, micro, fixed), chosen per machine by a
             bitwise self-test at start-up and, among those that pass, by measured cost
  attention  a row-invariant backend (attention.py: C++ rows, block attention, Triton)
  the rest   norms, RoPE and elementwise ops act on each row alone

Pad rows reuse row 0's position and write their KV to a trash slot no real row can see.
The measured verify cost of 1..W rows (`engine.costs.step_costs()`, in AR steps,
costs.EngineCosts) is what the draft budget plans with; it and `auto`'s layout choice are
cached on disk (cache.py).

Programs (all share `run_layers`):
  ar          1 row, all layers, LM head, argmax
  seg[a,b,m]  m rows through layers [a, b)
  verify[c,n] n rows from layer c to the end, LM head, argmax per row
The metadata of a step (positions, KV slots, key limits) lives in one device buffer
written by one copy (`meta_buffer`), so the CUDA-graph executor (cuda_graphs.py) replays a
captured program at any position. The engine reads the model's own weights, never a copy
of them, with one exception: on the kernel layout a float32 LM head (up to 128M weights)
gets an int8 copy from which a step that needs only its argmax reads a quarter of the LM
head's bytes, exactly (screen.py). Besides, it owns the KV cache (sized to the request,
grown and shrunk by copying) and small buffers.

`Engine` is built here (the view of the model, the layout choice, the kernel's weights,
the screen) from parts with one job each: kv_cache.py (the KV cache and its capacity),
metadata.py (a step's rows and metadata), execution.py (the layers and the LM head),
prefill.py (a prompt's KV), costs.EngineCosts (what a step costs, `engine.costs`). Its
users annotate against the protocols of interface.py, never against `Engine`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence

import torch

from ..logs import logger
from . import costs, mixers
from . import screen as screen_lib
from .attention import select_attention, uses_row_attention
from .cache import MeasurementCache, machine_key
from .compact import CompactWeights, projection_positions
from .config import DEFAULT_CAPACITY, DEFAULT_WIDTH, STREAMED_WIDTH, EngineConfig
from .devices import layer_groups
from .execution import LayerExecution
from .kv_cache import KVCacheSlots
from .layered import CPU_ONLY_REFUSAL, LayeredModel, UnsupportedModelError, cpu_only, text_decoder
from .layouts import AUTO_CHOICES, LAYOUTS, RowLayout, choose_layout, row_chunks
from .memory import zeroed
from .meta import StepMeta, StepRows
from .metadata import StepMetadata
from .prefill import Prefill
from .screen import ScreenedArgmax, screen_refusal

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_WIDTH", "STREAMED_WIDTH", "Engine", "EngineConfig", "RowLayout", "StepMeta",
           "StepRows", "row_chunks", "weight_signature", "zeroed"]



def weight_signature(model: torch.nn.Module) -> tuple:
    """Storage, dtype, device and shape of every parameter the engine reads: a change means
    the engine's view (and its cache dtype, RoPE tables, layout) is stale. In-place edits
    of the same tensors keep the signature (and need no rebuild: the engine reads them).
    Buffers the engine reads count too: DeepSeek-V3-style routers' e_score_correction_bias,
    LFM2-MoE's expert_bias (the rotary modules' are read into tables at build and do not)."""
    decoder = text_decoder(model)
    params = list(decoder.parameters()) + list(model.lm_head.parameters()) + [
        b for name, b in decoder.named_buffers() if name.endswith(("e_score_correction_bias", "expert_bias"))]
    return tuple((p.data_ptr(), p.dtype, p.device, tuple(p.shape)) for p in params)



class Engine(KVCacheSlots, StepMetadata, LayerExecution, Prefill):
    """Fixed-shape engine over an HF model (weights shared, KV cache owned). Implements
    every protocol of interface.py (SequenceEngine, BatchEngine, StepPrograms, ...)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.width = self.config.width
        self.view = LayeredModel(model, self.config.capacity)
        v = self.view
        self.group = v.num_heads // v.num_kv_heads
        # the devices accelerate runs the parts on (one for an undispatched model): runs of
        # layers on one device each keep their KV cache there (devices.py), and rows move
        # to the next run's device, to the final norm's and to the LM head's
        placement = v.placement
        self.groups = layer_groups(placement.layer_devices if placement is not None else [v.device] * v.num_layers)
        self.several_devices = len(self.groups) > 1
        self._group_of = [g for g in self.groups for _ in range(g.lo, g.hi)]
        self.embedding_device = v.device if placement is None else placement.embedding.device
        self.norm_device = v.device if placement is None else placement.final_norm.device
        self.head_device = v.device if placement is None else placement.lm_head.device
        if self.several_devices and self.config.executor == "cuda_graphs":
            raise ValueError("the CUDA-graph executor runs a model on one device; this one executes on "
                             f"{', '.join(str(g.device) for g in self.groups)}: use EngineConfig(executor='eager')")
        self._identity_rope: dict = {}  # _no_rotation's tables, per dtype
        self._signature = weight_signature(model)
        self._measured = MeasurementCache(machine_key(v, self.width), tuple(LAYOUTS), self.width,
                                          enabled=self.config.measurement_cache)
        self.layout = self._choose_layout()
        self._prefill_mode: str | None = None  # EngineConfig.prefill resolved (prefill_mode)
        self.attention = select_attention(v.device, self.layout)
        if uses_row_attention(self) and cpu_only(v.config, v.decoder):
            raise UnsupportedModelError(CPU_ONLY_REFUSAL)
        # metadata rows: every product row and every attention query row of the widest step
        a = self.layout.attention_rows
        self.meta_rows = max(self.width, -(-self.width // a) * a)
        self._meta_host = torch.zeros(3, self.meta_rows, dtype=torch.long)
        self._meta = torch.zeros(3, self.meta_rows, dtype=torch.long, device=v.device)
        self._all_rotary = all(v.rope_layers)
        self._uniform_layers = len(set(zip(v.layer_rope, v.layer_window))) == 1
        self._windows = sorted(set(v.layer_window) - {0})  # the sliding windows among the layers
        self._inputs_normed = all(lw.norms_inputs_only for lw in v.layers)
        if not self._all_rotary:  # made now, not inside a CUDA graph's capture
            for dtype in {v.cos.dtype, torch.float32}:
                self._no_rotation(self.meta_rows, dtype)
        # kernel layout: a step's decoder layers in one C++ call (kernels/cpu-rows/layers.cpp rows_layers),
        # unless a layer has biases (then the PyTorch ops below, with the same C++ products)
        self._no_norm = torch.empty(0, dtype=v.dtype, device=v.device)
        fused = self._fused_layer_weights()
        # what rows_layers takes: every layer's weights in turn, and how many per layer
        self._fused_weights = None if fused is None else [t for layer in fused for t in layer]
        self._fused_per_layer = 0 if fused is None else len(fused[0])
        # float32 projections that hold exact GGUF blocks (a model dequantized from a Q4_1,
        # Q4_0 or Q8_0 file) are read in that form: the same outputs from a fifth to a
        # quarter of the bytes (compact.py)
        self.compact = self._compact_weights()
        if self.compact is not None:
            self._fused_weights = self.compact.kernel_weights
        self.screen = None
        self._screen_deferred = False  # a big LM head's screen waits for the second request
        self._make_screen(first_request=True)
        # transformers renamed forward(past_key_values=) to forward(cache=) in 5.x
        params = inspect.signature(v.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.k_cache = self.v_cache = None
        self._allocate(self.config.capacity)
        # the hybrids (LFM2, Qwen 3.5, the Mambas): the convolutions' inputs and the recurrent
        # states of each sequence's last slots (mixers.MixerCache)
        self.mixer_cache = mixers.MixerCache(self) if v.num_conv_layers else None
        # what a step costs: measured by explicit calls (engine.costs.step_costs(), ...)
        self.costs = costs.EngineCosts(
            self, self._measured, self._costs_name(),
            # (the layout choice timed the float32 products, not compact ones, nor the
            # transfer of weights accelerate streams in: those steps are timed)
            None if self.compact is not None or self.streams_weights else self._products_seconds,
            self._timing_steps)
        # the Triton fused small kernels (kernels/fused.py: residual add + RMSNorm, RoPE + KV
        # write) in the PyTorch-ops layers; opt-in (off by default) until a GPU run has checked
        # them (scripts/gpu_check.py compares them with the unfused ops). RMSNorm's sum runs
        # in another order than torch's, so an engine uses one or the other for all its steps
        self.fused_small_ops = False
        self.graphs = None  # the CUDA-graph executor, when built with one
        if self.config.executor == "cuda_graphs":
            from .cuda_graphs import CudaGraphRunner  # cuda_graphs.py never imports this module

            self.graphs = CudaGraphRunner(self)
            self.graphs.attach()

    def _fused_layer_weights(self) -> list[list[torch.Tensor]] | None:
        """Per layer, the weights `rows_layer(s)` takes (see kernels/cpu-rows/layers.cpp), or None when the
        layers run as PyTorch ops (another layout). Detached views of the model's own
        parameters: the same storage, no copy. With linear biases anywhere (Qwen2's q/k/v),
        every layer gives all 20: its 13 weights and norms, then its 7 projections' biases
        (an empty tensor where it has none)."""
        if self.layout.kernel_layers is None or not self.view.rms_sequential_gated:
            return None
        biased = any(lin.bias is not None for lw in self.view.layers for lin in lw.linears)
        fused = []
        for li, lw in enumerate(self.view.layers):
            # a norm (or bias) the layer does not have goes as an empty tensor (rows_layer skips it)
            w = [lw.input_norm, lw.q.weight, lw.k.weight, lw.v.weight, lw.o.weight, lw.post_norm,
                 lw.gate.weight, lw.up.weight, lw.down.weight]
            if lw.q_norm is not None or not lw.norms_inputs_only or biased:
                w += [lw.q_norm, lw.k_norm]
            if not lw.norms_inputs_only or biased:
                w += [lw.attn_out_norm, lw.mlp_out_norm]
            if biased:
                w += [lin.bias for lin in (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down)]
            # a layer accelerate offloads runs as ops (run_layers): empty tensors hold its place
            streamed = li in self.view.streamed_layers
            fused.append([self._no_norm if t is None or streamed else t.detach() for t in w])
        return fused

    def _make_screen(self, first_request: bool = False) -> None:
        """The LM head's argmax screen (screen.py) on the kernel layout, where it applies;
        at the engine's first request only for a copy of up to EAGER_COPY_BYTES (a bigger
        one is made by `next_request`)."""
        from hf_selfspec.kernels.cpu_rows import load_rows_screen

        head, placement = self.view.lm_head, self.view.placement
        if placement is not None and placement.lm_head.offloaded:  # (a copy of a streamed head: no)
            return
        if self.layout.kernel_layers is None or screen_refusal(head.weight, head.bias) is not None:
            return
        if self.view.logits_transformed:
            # the argmax of the scaled (Granite) or capped (Gemma 2) logits: the transform can
            # round two logits to one value, where HF's argmax takes the lower id; the screen
            # ranks the untransformed ones
            return
        kernel = load_rows_screen()
        if kernel is None:
            return
        self._screen_deferred = first_request and head.weight.numel() > screen_lib.EAGER_COPY_BYTES
        if not self._screen_deferred:
            self.screen = ScreenedArgmax(head.weight, kernel)

    def next_request(self) -> None:
        """A request after the first: make what the first deferred (a big LM head's screen),
        and encode again the compact weights of matrices updated in place since."""
        if self._screen_deferred:
            self._make_screen()
        if self.compact is not None:  # (its kernel_weights, which the steps read, in place)
            self.compact.refresh()

    def _compact_weights(self) -> CompactWeights | None:
        """The layers' projections in compact form where they have one (float32 CPU weights
        on the kernel layout); None where none has."""
        if self._fused_weights is None or self.view.dtype != torch.float32 or self.view.device.type != "cpu":
            return None
        from hf_selfspec.kernels.cpu_rows import load_rows_compact

        kernel = load_rows_compact()
        if kernel is None:
            return None
        projections = projection_positions(len(self._fused_weights), self._fused_per_layer)
        compact = CompactWeights(self._fused_weights, projections, kernel)
        return compact if compact.count else None

    def _all_linears(self) -> list[torch.nn.Linear]:
        """Every projection whose weights are resident: on a model accelerate offloads, the
        streamed layers' and LM head's are left out (their weights are on the meta device
        between steps; `_choose_layout` brings one streamed layer in for its tests)."""
        v = self.view
        placement = v.placement
        resident = [lw for i, lw in enumerate(v.layers) if i not in v.streamed_layers]
        head = [] if placement is not None and placement.lm_head.offloaded else [v.lm_head]
        return [lin for lw in resident for lin in lw.linears] + head

    def _choose_layout(self) -> RowLayout:
        """The configured layout, or `auto`'s choice (cached on disk with what it depends on).
        On a model with offloaded layers, the self-tests and timings see the resident
        projections and one streamed layer's, brought in for the choice."""
        v = self.view
        if not v.streamed_layers:
            return self._choose_layout_of(self._all_linears())
        first = min(v.streamed_layers)
        with v.layer_weights(first) as lw:
            return self._choose_layout_of(self._all_linears() + list(lw.linears))

    def _choose_layout_of(self, linears: list[torch.nn.Linear]) -> RowLayout:
        wanted, v = self.config.row_layout, self.view
        cached = self._measured.layout if wanted == "auto" else None
        timed: dict[str, dict[int, float]] = {}  # each timed layout's products per row count

        def measure(candidate: RowLayout, give_up: float) -> float:
            timed[candidate.name] = {}
            return costs.gemm_seconds(candidate, linears, self.width, give_up=give_up,
                                      per_rows=timed[candidate.name])

        layout = choose_layout(wanted, self.width, v.device, linears, cached=cached, measure=measure)
        self._products_seconds = timed.get(layout.name, {})
        if wanted == "auto" and v.device.type == "cpu" and layout.name in AUTO_CHOICES and layout.name != cached:
            self._measured.store_layout(layout.name)
        if v.device.type == "cpu" and layout.name != "kernel":
            from hf_selfspec.kernels.cpu_rows import build_error

            missing = build_error()
            if wanted != "auto":
                reason = f"EngineConfig(row_layout={wanted!r})"
            else:
                reason = missing or "its bitwise self-test failed or another layout measured faster"
            # without the kernel a step is BLAS products and PyTorch ops: speculation then
            # barely pays (docs/usage.md, "The first call, and the C++ kernel")
            effect = ("the same tokens, at about plain generate()'s speed (slower on a model of "
                      "gigabytes) instead of several times faster" if missing else "the same tokens")
            logger.warning_once(f"hf_selfspec: the C++ row kernel is not used ({reason}); the engine runs "
                                f"the {layout.name!r} row layout instead ({effect})")
        logger.info(f"hf_selfspec: row layout {layout.name!r}" + (" (cached choice)" if layout.name == cached else ""))
        return layout


    def is_stale(self) -> bool:
        """Whether the model's parameters changed storage, dtype, device or shape since the
        engine was built (`model.to(...)`, `load_state_dict(..., assign=True)`): then the
        engine must be rebuilt (SelfSpecState.engine_for does)."""
        return weight_signature(self.view.model) != self._signature

    @property
    def fused_per_layer(self) -> int:
        """Weight tensors per decoder layer in the kernel layout's fused list (0: no fused list)."""
        return self._fused_per_layer

    @property
    def streams_weights(self) -> bool:
        """Whether accelerate brings some of the weights in at each step (offload)."""
        return self.view.placement is not None and self.view.placement.any_offloaded

    def _costs_name(self) -> str:
        """The name step costs are cached under: the layout's, marked where compact weights
        (compact.py) change what a step reads."""
        return self.layout.name if self.compact is None else f"{self.layout.name}+compact"

    def _timing_steps(self):
        """Around steps that only time the engine: LFM2's / Qwen 3.5's rows then go to rings
        of their own, never over a sequence's (a measurement may come mid-request)."""
        return contextlib.nullcontext() if self.mixer_cache is None else self.mixer_cache.scratch()

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Token ids -> hidden [n, H]."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.embedding_device)
        return self.view.embed_rows(ids)

    # ---- programs ------------------------------------------------------------------------

    @torch.no_grad()
    def seg(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """seg[start, end, m]: advance the step's m rows from layer `start` to `end`."""
        return self.run_layers(h, start, end, meta)

    @torch.no_grad()
    def verify(self, h: torch.Tensor, start: int, meta: StepMeta, logits: bool = True):
        """verify[start, n]: rows from layer `start` to the end.
        Returns (logits [n, V], argmax [n], final hidden after the final norm [n, H]).
        logits=False: a caller that reads only the argmax; the logits may then be None
        (`argmax_only`)."""
        h = self.run_layers(h, start, self.view.num_layers, meta)
        if not logits:
            return self.argmax_only(h)
        out, final = self.logits(h)
        return out, out.argmax(-1), final


    @torch.no_grad()
    def ar_step(self, token: int, position: int, logits: bool = True):
        """ar: one real row (the last committed token at `position`) through all layers.
        Returns (logits [V], next token id, final hidden [H]); logits=False: the logits may
        be None (`argmax_only`)."""
        meta = self.make_meta([position])
        out, argmax, h = self.verify(self.embed([token]), 0, meta, logits)
        return None if out is None else out[0], int(argmax[0]), h[0]

    @torch.no_grad()
    def generate_ar(
        self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
    ) -> list[int]:
        """The engine's own greedy AR decoding: the reference every speculative path must
        match token for token. Stops after an EOS id (included) or max_new_tokens."""
        self.check_capacity(len(prompt_ids), max_new_tokens)
        if max_new_tokens <= 0:
            return []
        eos = set(eos_token_ids)
        logits, _ = self.prefill(prompt_ids)
        token = int(logits.argmax())
        out = [token]
        position = len(prompt_ids)
        while len(out) < max_new_tokens and token not in eos:
            _, token, _ = self.ar_step(token, position, logits=False)
            out.append(token)
            position += 1
        return out
