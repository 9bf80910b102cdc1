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
The measured verify cost of 1..W rows (`Engine.step_costs`, in AR steps, costs.py) is what
the draft budget plans with; it and `auto`'s layout choice are cached on disk (cache.py).

Programs (all share `run_layers`):
  ar          1 row, all layers, LM head, argmax
  seg[a,b,m]  m rows through layers [a, b)
  verify[c,n] n rows from layer c to the end, LM head, argmax per row
The metadata of a step (positions, KV slots, key limits) lives in one device buffer
written by one copy, so the CUDA-graph executor (runner.py) replays a captured program at
any position. The engine reads the model's own weights, never a copy of them, with one
exception: on the kernel layout a float32 LM head (up to 128M weights) gets an int8 copy
from which a step that needs only its argmax reads a quarter of the LM head's bytes,
exactly (screen.py). Besides, it owns the KV cache (sized to the request, grown and shrunk
by copying) and small buffers.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hf_selfspec.kernels.cpu_rows import NO_BASE, NO_PATH

from ..logs import logger
from . import costs, latent, mixers
from . import screen as screen_lib
from .attention import KEY_BLOCK, select_attention, uses_row_attention, visible_bias
from .cache import MeasurementCache, machine_key
from .compact import CompactWeights, projection_positions
from .devices import GroupedCache, layer_groups
from .layered import (CPU_ONLY_REFUSAL, LayeredModel, UnsupportedModelError, apply_rope, check_engine_prefill, cpu_only,
                      longrope_short_positions, text_decoder)
from .layouts import AUTO_CHOICES, LAYOUTS, RowLayout, choose_layout, row_chunks
from .memory import zeroed
from .meta import StepMeta, StepRows
from .screen import ScreenedArgmax, screen_refusal

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_WIDTH", "STREAMED_WIDTH", "Engine", "EngineConfig", "RowLayout", "StepMeta",
           "StepRows", "row_chunks", "weight_signature"]

# Most rows one step takes (row 0 + drafts): enough room for long copies where they pay
# (docs/benchmarks.md, scripts/bench.py --widths).
DEFAULT_WIDTH = 8
# The width of an engine whose model accelerate streams in (offload): each step reads every
# streamed weight once whatever its rows, so a verify of dozens of rows costs about what one
# row does, and wide draft trees pay (the measured step costs decide how many rows a cycle
# takes; integration.SelfSpecState.step_width).
STREAMED_WIDTH = 32
DEFAULT_CAPACITY = 2048
# A request-sized cache holds whole key blocks. `ensure_capacity(..., release=True)`
# shrinks a cache that is more than SHRINK_RATIO times what a request needs back to
# max(EngineConfig.capacity, that need): a one-off long prompt does not keep its memory.
SHRINK_RATIO = 2
# A batched step (several sequences' rows, engine.supports_batches) takes up to this many
# times the width.
BATCH_ROWS_PER_WIDTH = 8

RowLayoutName = Literal["auto", "kernel", "micro", "fixed"]
ROW_LAYOUTS = ("auto", *LAYOUTS)
# the layouts that were removed (their history: docs/engine_layouts_history.md)
REMOVED_LAYOUTS = ("gemv", "wx", "wx4")
PrefillName = Literal["auto", "hf", "engine"]
ExecutorName = Literal["auto", "eager", "cuda_graphs"]


@dataclass(frozen=True)
class EngineConfig:
    """width: rows per step (fixed for the engine's lifetime);
    capacity: KV slots for prompt + new tokens + one block of drafts at start (the engine
    grows its cache for a longer request and shrinks it back to this size, see
    `Engine.ensure_capacity`)."""

    width: int = DEFAULT_WIDTH
    capacity: int = DEFAULT_CAPACITY
    # the width of the engine of a model whose weights accelerate streams in (offload)
    streamed_width: int = STREAMED_WIDTH
    row_layout: RowLayoutName = "auto"  # auto: the cheapest layout whose self-test passes, else fixed
    # "hf": the prompt goes through the HF model's own forward (wide GEMMs, one pass) and
    # its KV is copied into the engine's cache, so the prompt KV and the first new token
    # are exactly those of HF's generate(); "engine": W-row chunks through the decode
    # programs. Speculative and AR decoding always share the prefill, so either is exact.
    # "auto": "hf", except a 16-bit model on the CPU with the row kernel, where the engine's
    # chunks are taken if their products measure clearly cheaper than HF's (PyTorch's
    # float16 products on most CPUs: Engine.prefill_mode); float32 is always "hf" (its
    # promise is HF's greedy tokens, first token included).
    prefill: PrefillName = "auto"
    # cache `auto`'s layout choice and the step costs on disk (engine/cache.py); off: a
    # process measures them again (HF_SELFSPEC_NO_CACHE=1 turns it off everywhere)
    measurement_cache: bool = True
    # "cuda_graphs": the programs are captured once per key and replayed (runner.py; CUDA
    # and the fixed layout only); "eager": every op from Python; "auto": generate() builds a
    # CUDA model's engine with graphs (eager with one warning where they cannot be set up)
    # and any other eagerly; an Engine built directly with "auto" runs eagerly
    executor: ExecutorName = "auto"

    def __post_init__(self):
        if self.prefill not in ("auto", "hf", "engine"):
            raise ValueError(f"prefill must be 'auto', 'hf' or 'engine', got {self.prefill!r}")
        if self.row_layout not in ROW_LAYOUTS:
            removed = (f" ({self.row_layout!r} was removed; see docs/engine_layouts_history.md)"
                       if self.row_layout in REMOVED_LAYOUTS else "")
            raise ValueError(f"row_layout must be one of {ROW_LAYOUTS}, got {self.row_layout!r}{removed}")
        for name in ("width", "streamed_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"{name} must be an int in [1, 64], got {value!r}")
        if not isinstance(self.capacity, int) or self.capacity < 2 * self.width:
            raise ValueError(f"capacity must be an int >= 2*width, got {self.capacity!r}")
        if self.measurement_cache not in (True, False):
            raise ValueError(f"measurement_cache must be True or False, got {self.measurement_cache!r}")
        if self.executor not in ("auto", "eager", "cuda_graphs"):
            raise ValueError(f"executor must be 'auto', 'eager' or 'cuda_graphs', got {self.executor!r}")


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


def _whole_blocks(slots: int) -> int:
    return -(-slots // KEY_BLOCK) * KEY_BLOCK


class Engine:
    """Fixed-shape engine over an HF model (weights shared, KV cache owned)."""

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
        # kernel layout: a step's decoder layers in one C++ call (cpu_rows.cpp rows_layers),
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
        self._step_costs: tuple[float, ...] | None = None
        self._batch_costs: tuple[float, ...] | None = None
        self._attention_seconds: float | None = None
        self.contention = costs.ContentionWatch()
        self._one_row_seconds: float | None = None
        self.k_cache = self.v_cache = None
        self._allocate(self.config.capacity)
        # the hybrids (LFM2, Qwen 3.5, the Mambas): the convolutions' inputs and the recurrent
        # states of each sequence's last slots (mixers.MixerCache)
        self.mixer_cache = mixers.MixerCache(self) if v.num_conv_layers else None
        # the Triton fused small kernels (kernels/fused.py: residual add + RMSNorm, RoPE + KV
        # write) in the PyTorch-ops layers; opt-in (off by default) until a GPU run has checked
        # them (scripts/gpu_check.py compares them with the unfused ops). RMSNorm's sum runs
        # in another order than torch's, so an engine uses one or the other for all its steps
        self.fused_small_ops = False
        self.graphs = None  # the CUDA-graph executor, when built with one
        if self.config.executor == "cuda_graphs":
            from .runner import CudaGraphRunner  # runner.py never imports this module

            self.graphs = CudaGraphRunner(self)
            self.graphs.attach()

    def _fused_layer_weights(self) -> list[list[torch.Tensor]] | None:
        """Per layer, the weights `rows_layer(s)` takes (see cpu_rows.cpp), or None when the
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

    # ---- capacity -----------------------------------------------------------------------

    def _allocate(self, capacity: int, keep: int = 0) -> None:
        """A KV cache of `capacity` usable slots (+ the trash slot pad rows write, rounded up
        to whole key blocks), with the first `keep` slots of the current cache copied in."""
        v = self.view
        num_slots = _whole_blocks(capacity + 1)
        shape = (v.num_layers, v.num_kv_heads, num_slots, v.head_dim)
        old_k, old_v = self.k_cache, self.v_cache
        self.k_cache = self.v_cache = None  # the caller's references keep the old ones alive
        if self.several_devices:  # one tensor per run of layers, on its device
            k_cache = GroupedCache(self.groups, [zeroed((g.hi - g.lo, *shape[1:]), v.dtype, g.device)
                                                 for g in self.groups])
            v_cache = k_cache if v.values_are_keys else GroupedCache(
                self.groups, [zeroed((g.hi - g.lo, *shape[1:]), v.dtype, g.device) for g in self.groups])
            if keep and old_k is not None:
                k_cache.keep(old_k, keep)
                if v_cache is not k_cache:
                    v_cache.keep(old_v, keep)
        else:
            k_cache = zeroed(shape, v.dtype, v.device)
            # latent attention: the values are the keys' own tensor (LatentAttentionWeights)
            v_cache = k_cache if v.values_are_keys else zeroed(shape, v.dtype, v.device)
            if keep and old_k is not None:
                k_cache[:, :, :keep] = old_k[:, :, :keep]
                if v_cache is not k_cache:
                    v_cache[:, :, :keep] = old_v[:, :, :keep]
        del old_k, old_v
        self.k_cache, self.v_cache = k_cache, v_cache
        self.capacity = capacity
        self.num_slots = num_slots
        self.trash_slot = capacity
        # RoPE tables for the positions one sequence can reach: a batch's cache holds several
        # sequences' regions, more slots than any sequence has positions
        positions = min(capacity, getattr(v.config, "max_position_embeddings", None) or capacity)
        if v.max_positions != positions:
            v.set_max_positions(positions)
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()  # captured programs read the old cache's addresses

    @property
    def position_limit(self) -> int:
        """Positions a sequence may reach in this cache: its slots, at most the RoPE table's
        (a batch's cache has more slots than any one sequence has positions)."""
        return min(self.capacity, self.view.max_positions)

    def capacity_for(self, need: int) -> int:
        """The capacity a cache for `need` slots gets: whole key blocks (the trash slot
        included), at most the model's max_position_embeddings (never below `need`)."""
        limit = getattr(self.view.config, "max_position_embeddings", None)
        capacity = _whole_blocks(need + 1) - 1
        return max(need, min(capacity, limit)) if limit else capacity

    def ensure_capacity(self, need: int, *, keep: int | None = None, release: bool = False) -> None:
        """Room for `need` KV slots: a shorter cache grows to `capacity_for(need)` by copying
        its first `keep` slots (default: all it has; 0 when no slot is in use yet) into a new
        one; nothing is measured again. With `release`, a cache more than SHRINK_RATIO times
        `capacity_for(need)` shrinks back to max(EngineConfig.capacity, that), so a one-off
        long request does not keep its memory."""
        if not isinstance(need, int) or need < 1:
            raise ValueError(f"need must be a positive int, got {need!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 0):
            raise ValueError(f"keep must be None or an int >= 0, got {keep!r}")
        if keep == 0 and self.mixer_cache is not None:  # a new request: no sequence's state is kept
            self.mixer_cache.new_request()
        target = self.capacity
        wanted = self.capacity_for(need)
        if need > self.capacity:
            target = wanted
        elif release and self.capacity > SHRINK_RATIO * wanted and self.capacity > self.config.capacity:
            target = max(self.config.capacity, wanted)
        if target != self.capacity:
            kept = self.capacity if keep is None else keep
            self._allocate(target, keep=min(kept, self.capacity, target))

    def check_capacity(self, prompt_len: int, max_new_tokens: int, draft_rows: int | None = None) -> None:
        """prompt + max_new + `draft_rows` (default: the width) must fit the KV cache; raise
        before any work otherwise. The speculative loop passes draft_rows=0: it drafts fewer
        rows near the end of the cache, so it needs only the slots AR decoding needs."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty: pass at least one input token")
        rows = self.width if draft_rows is None else draft_rows
        need = prompt_len + max_new_tokens + rows
        if need > self.capacity:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + draft rows "
                f"({rows}) = {need} exceeds the engine's KV capacity ({self.capacity}). "
                "Shorten the prompt, lower max_new_tokens, or call engine.ensure_capacity(need)."
            )
        if need > self.position_limit:  # the RoPE table stops at the model's positions
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + draft rows "
                f"({rows}) = {need} exceeds the positions this engine can rotate "
                f"({self.position_limit}: the model's max_position_embeddings). Shorten the prompt "
                "or lower max_new_tokens."
            )

    def is_stale(self) -> bool:
        """Whether the model's parameters changed storage, dtype, device or shape since the
        engine was built (`model.to(...)`, `load_state_dict(..., assign=True)`): then the
        engine must be rebuilt (SelfSpecState.engine_for does)."""
        return weight_signature(self.view.model) != self._signature

    # ---- metadata -----------------------------------------------------------------------

    @property
    def streams_weights(self) -> bool:
        """Whether accelerate brings some of the weights in at each step (offload)."""
        return self.view.placement is not None and self.view.placement.any_offloaded

    @property
    def supports_trees(self) -> bool:
        """Whether a step's rows may form a draft tree (`make_meta(..., paths=...)`): the C++
        row attention (kernel layout) and the Triton one (CUDA) visit a row's path slots in
        depth order, exactly as a chain row's keys; the PyTorch block attention sums over
        masked key blocks, whose order a scattered path would change."""
        return self.attention.supports_trees

    @property
    def supports_batches(self) -> bool:
        """Whether one step may hold the rows of several sequences, each in its own KV
        region (`make_meta(..., bases=...)`, up to `max_step_rows` rows): the C++ row
        attention reads each row's keys from its region's first slot with the arithmetic of
        a sequence at slot 0; the block attention's key blocks sit at absolute slots."""
        return getattr(self.attention, "supports_batches", False) and self.graphs is None

    @property
    def max_step_rows(self) -> int:
        """Most rows one step takes: the width, or for a batched step BATCH_ROWS_PER_WIDTH
        times it."""
        return self.width * (BATCH_ROWS_PER_WIDTH if self.supports_batches else 1)

    def step_rows(self, positions: Sequence[int], slots: Sequence[int] | None = None,
                  paths: Sequence[Sequence[int]] | None = None) -> StepRows:
        """The host rows of one sequence's step at slots [0, capacity): chain rows at
        `positions` (slot = position), or a tree's `slots` and `paths` (see make_meta)."""
        positions = list(positions)
        return StepRows(positions, positions if slots is None else list(slots), positions,
                        None if paths is None else [list(p) for p in paths])

    def rows_meta(self, rows: StepRows) -> StepMeta:
        """`make_meta` for host rows (one sequence's, or several concatenated)."""
        return self.make_meta(rows.positions, rows.limits, rows.slots, rows.paths, rows.bases)

    def make_meta(
        self, positions: Sequence[int], key_limits: Sequence[int] | None = None,
        slots: Sequence[int] | None = None, paths: Sequence[Sequence[int]] | None = None,
        bases: Sequence[int] | None = None,
    ) -> StepMeta:
        """Metadata for a step whose real rows sit at `positions` (chain: slot = position).
        A draft tree gives each row's KV `slots` and its `paths` (the slots of its path
        after the committed prefix, root first, itself last); key limits are the positions.
        A batched step gives each row's `bases` (the first slot of its sequence's KV region:
        its keys j <= limit sit at base + j; slots and path slots stay absolute)."""
        n = len(positions)
        most = self.width if bases is None else self.max_step_rows
        if not 1 <= n <= most:
            raise ValueError(f"a step takes 1..{most} rows, got {n}")
        if bases is not None and not self.supports_batches:
            raise ValueError(f"batched steps need a row attention that reads each sequence's KV region "
                             f"and products of any row count (the kernel layout on the CPU; this engine "
                             f"uses {self.layout.name!r} on {self.view.device.type})")
        limits = positions if key_limits is None else key_limits
        if n > self._meta_host.shape[1]:  # a batched step wider than any before (CPU only)
            self._meta_host = torch.zeros(3, n, dtype=torch.long)
            self._meta = torch.zeros(3, n, dtype=torch.long, device=self.view.device)
        host = self._meta_host
        host[0, :n] = torch.as_tensor(positions)
        host[0, n:] = positions[0]
        host[1, :n] = host[0, :n] if slots is None else torch.as_tensor(slots)
        host[1, n:] = self.trash_slot
        host[2, :n] = torch.as_tensor(limits)
        host[2, n:] = positions[0]
        self._meta.copy_(host)
        positions_t, slots_t, limit_t = self._meta[0], self._meta[1], self._meta[2]
        num_keys = (max(limits) // KEY_BLOCK + 1) * KEY_BLOCK
        a = self.layout.attention_rows
        # the block attention takes one mask per chunk of query rows; the Triton and C++
        # row attentions read limit_t themselves
        chunks = range(self.layout.attention_chunks(n))
        biases = [] if not self.attention.needs_masks else [
            visible_bias(limit_t[c * a:(c + 1) * a], num_keys, self.group) for c in chunks]
        window_biases = {} if not self.attention.needs_masks else {
            w: [visible_bias(limit_t[c * a:(c + 1) * a], num_keys, self.group, w) for c in chunks]
            for w in self._windows}
        rows = self.layout.rows(n)
        v = self.view
        path = NO_PATH
        if paths is not None:
            if not self.supports_trees:
                raise ValueError(f"draft trees need the C++ or Triton row attention (this engine uses "
                                 f"{self.layout.name!r} on {self.view.device.type}); decode with chains "
                                 "(DecodeConfig(tree='off'))")
            if len(paths) != n:
                raise ValueError(f"{len(paths)} paths given for {n} rows")
            path = torch.full((n, max(len(p) for p in paths)), -1, dtype=torch.long)
            for r, row_path in enumerate(paths):
                path[r, : len(row_path)] = torch.as_tensor(row_path)
        base = NO_BASE if bases is None else torch.as_tensor(list(bases), dtype=torch.long)
        if len(base) not in (0, n):
            raise ValueError(f"{len(base)} bases given for {n} rows")
        at = positions_t[:rows]
        extra = v.rope_tables[1:]
        conv_rows = conv_sources = recurrent_rows = None
        if self.mixer_cache is not None:  # the hybrids: the rows' ring rows (MixerCache)
            writes, sources, recurrent = self.mixer_cache.step_rows(positions, host[1, :n].tolist(), paths, bases,
                                                                    rows)
            conv_rows, conv_sources = writes.to(v.device), sources.to(v.device)
            recurrent_rows = recurrent or None  # (empty without DeltaNets)
        return StepMeta(
            positions_t, slots_t, limit_t, n, rows, biases, v.cos[at], v.sin[at], path, base,
            tuple(c[at] for c, _ in extra), tuple(s[at] for _, s in extra), window_biases, conv_rows, conv_sources,
            recurrent_rows, None if not recurrent_rows else torch.tensor(recurrent_rows, dtype=torch.long),
        )

    def move_kv(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy every layer's K and V from slot sources[i] to targets[i], in order (a draft
        tree's accepted path, compacted to consecutive positions: targets never overwrite a
        later source when both increase and targets[i] <= sources[i])."""
        for src, dst in zip(sources, targets):
            if src != dst and self.several_devices:
                self.k_cache.copy_slot(src, dst)
                if self.v_cache is not self.k_cache:
                    self.v_cache.copy_slot(src, dst)
            elif src != dst:
                self.k_cache[:, :, dst] = self.k_cache[:, :, src]
                if self.v_cache is not self.k_cache:  # (latent attention: one tensor)
                    self.v_cache[:, :, dst] = self.v_cache[:, :, src]
        if self.mixer_cache is not None:
            self.mixer_cache.move(sources, targets)

    # ---- the maths of a step --------------------------------------------------------------

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
            return fused[:, :, 0], fused[:, :, 1], fused[:, :, 2], None
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

    @property
    def _costs_name(self) -> str:
        """The name step costs are cached under: the layout's, marked where compact weights
        (compact.py) change what a step reads."""
        return self.layout.name if self.compact is None else f"{self.layout.name}+compact"

    @property
    def step_costs(self) -> tuple[float, ...]:
        """Verify cost of n rows (index n = 1..W; index 0 = 1 row) in units of a 1-row step:
        measured once per model, machine and software (costs.measure_step_costs; on a model
        of gigabytes, estimated from the layout choice's product timings), cached on
        disk (cache.py; measured again when a step now is several times faster than the
        cached one, i.e. the cache was measured on a busy machine) and kept when the KV cache
        grows."""
        if self._step_costs is None:
            context = costs.cost_context(self)
            found = self._measured.step_costs(self._costs_name, context)
            with self._timing_steps():
                if found is not None and costs.measured_while_busy(self, found[1]):
                    found = None  # measured on a busy machine: measure again and store
                if found is None:
                    # (the layout choice timed the float32 products, not compact ones, nor
                    # the transfer of weights accelerate streams in: those steps are timed)
                    estimated = None if self.compact is not None or self.streams_weights \
                        else costs.step_costs_from_products(self.width, self._products_seconds)
                    found = estimated or costs.measure_step_costs(self)
                    self._measured.store_step_costs(self._costs_name, context, *found)
            self._step_costs, self._one_row_seconds = found
        return self._step_costs

    @property
    def batch_costs(self) -> tuple[float, ...]:
        """Verify cost of n = 0..max_step_rows rows of a batched step (index 0 = 1 row), in
        1-row steps: `step_costs` up to the width, then batched steps measured at multiples
        of it (costs.measure_batch_costs; cached on disk like step_costs)."""
        if not self.supports_batches:
            return self.step_costs
        if self._batch_costs is None:
            context = costs.cost_context(self)
            found = self._measured.batch_costs(self._costs_name, context)
            if found is None or found[0][-1] != self.max_step_rows:
                with self._timing_steps():
                    found = costs.measure_batch_costs(self)
                self._measured.store_batch_costs(self._costs_name, context, *found)
            self._batch_costs = costs.batch_cost_curve(self.step_costs, self.width, *found, self.max_step_rows)
        return self._batch_costs

    def _timing_steps(self):
        """Around steps that only time the engine: LFM2's / Qwen 3.5's rows then go to rings
        of their own, never over a sequence's (a measurement may come mid-request)."""
        return contextlib.nullcontext() if self.mixer_cache is None else self.mixer_cache.scratch()

    @property
    def has_batch_costs(self) -> bool:
        """Whether `batch_costs` is known in this engine (read from the disk cache or
        measured), so that asking for it costs nothing."""
        return self._batch_costs is not None

    @property
    def attention_seconds(self) -> float:
        """Seconds of attention per row and key of a step, all layers (measured once per
        model and machine: costs.measure_attention_seconds; cached on disk)."""
        if self._attention_seconds is None:
            context = costs.cost_context(self)
            found = self._measured.attention_seconds(self._costs_name, context)
            if found is None:
                with self._timing_steps():
                    found = costs.measure_attention_seconds(self)
                self._measured.store_attention_seconds(self._costs_name, context, found)
            self._attention_seconds = found
        return self._attention_seconds

    @property
    def times_steps_cheaply(self) -> bool:
        """Whether a round of step timing is cheap on this model (under
        costs.ESTIMATE_ABOVE_SECONDS): then the attention per row and key is measured for any
        request (once; cached on disk), not only for long ones, and a short request plans with
        its rows' cheaper attention. On a model of gigabytes the first call does without it."""
        return self.one_row_seconds * self.width <= costs.ESTIMATE_ABOVE_SECONDS

    def step_costs_at(self, context: int, batched: bool = False) -> tuple[float, ...]:
        """`step_costs` (or `batch_costs`) for rows that see about `context` keys: every row's
        attention grows with the keys, so more rows cost relatively more than the measured
        curve says beyond the context it was measured at, and less before it (where the
        attention cost is measured cheaply: `times_steps_cheaply`)."""
        curve = self.batch_costs if batched else self.step_costs
        extra = context - costs.cost_context(self)
        if extra == 0 or (extra < 0 and not self.times_steps_cheaply):
            return curve
        return costs.costs_at(curve, self.one_row_seconds, self.attention_seconds, extra)

    def observe_step(self, rows: int, seconds: float, context: int = 0) -> None:
        """A decode step of `rows` rows whose rows see about `context` keys took `seconds`:
        on the kernel layout, steps several times slower than measured, several in a row,
        turn on the kernels' work-sharing pool (costs.ContentionWatch: other processes are
        busy on the cores)."""
        if self.layout.kernel_layer is None or self._step_costs is None:
            return
        curve = self._step_costs if rows <= self.width else self._batch_costs
        expected = None
        extra_keys = max(0, context - costs.cost_context(self))
        if curve is not None and rows < len(curve) and (extra_keys == 0 or self._attention_seconds is not None):
            expected = curve[rows] * self._one_row_seconds + rows * extra_keys * (self._attention_seconds or 0.0)
        if self.contention.observe(expected, seconds):
            logger.warning(
                "hf_selfspec: decode steps ran over %.0fx slower than measured: other processes are busy on "
                "the cores, so the row kernels now share their work in their own thread pool "
                "(HF_SELFSPEC_ROWS_POOL=1 starts that way; the tokens are the same)", costs.CONTENDED_FACTOR)

    @property
    def one_row_seconds(self) -> float:
        """Measured seconds of a 1-row step over all layers (see step_costs)."""
        self.step_costs  # noqa: B018 (measures once)
        return self._one_row_seconds

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
