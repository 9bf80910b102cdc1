"""The fixed-width engine: static KV cache and the step programs `ar`, `seg`, `verify`.

A token's row must be computed bit for bit the same whether it is an AR step (1 real
row), a catch-up of m rows or a verification of n rows: this is what makes speculative
greedy output identical to the engine's own AR output. Libraries choose GEMM kernels by
shape, so the engine fixes the shapes. Six row layouts, chosen per machine by a bitwise
self-test at start-up and, among those that pass, by measured cost (`RowLayout`):

  fixed   every GEMM, norm and elementwise op runs on exactly `width` rows (real rows
          first, padding after). Works with any BLAS; the CUDA-graph layout.
  micro   GEMMs run on chunks of 2 or 3 rows. On MKL (this CPU) the 2- and 3-row GEMM
          path computes each row independently of the others (checked bit for bit on the
          model's own weight shapes at start-up), so a step costs what its real rows cost:
          1-2 rows ~ a GEMV, 8 rows ~ 2x. A 1-row step is padded to 2 rows.
  gemv    x @ W^T with W^T stored contiguous ([in, out], a transposed copy of every weight):
          on MKL, products of 1, 2 and 3 rows compute each row alike (self-tested the same
          way), so a 1-row step needs no padding; GEMMs run on chunks of at most 3 rows.
          Measured on a 2-core AMD EPYC (AVX2, MKL, SmolLM2-135M, all 211 weights): 1 / 2 / 3
          rows 33 / 55 / 68 ms, against micro's 73 (padded) / 73 / 96 ms and HF's 1-row
          F.linear 41 ms. Costs one more copy of the weights in memory.
  wx      W @ x^T (the weight as stored, times the rows as columns), on chunks of 2 or 3
          rows like micro (a 1-row step padded to 2): MKL's tall-skinny path computes each
          column alike for 2 and 3 columns (self-tested the same way; 4+ columns go through
          another kernel, hence the chunks). Measured on the same AMD EPYC, all 211 weights
          of SmolLM2-135M, median of 7 interleaved runs: 2 / 3 / 4 rows 0.76 / 0.87 / 0.84x
          the gemv layout's 1-row step, where F.linear and x @ W^T cost 1.65x for 2 rows.
  wx4     W @ x^T on blocks of exactly 4 or 8 columns (a step padded to whole 4-row
          blocks). MKL's kernel for 4 and 8 columns computes a column bit for bit alike at
          any place of a 4- or 8-column product (self-tested; 2-3 columns and 5-7, 12, 16
          columns round differently, hence the fixed blocks). Measured on the same AMD EPYC,
          all 211 weights, median of 9 interleaved runs, x F.linear's 1-row product: 2 / 3 /
          4 / 8 columns 0.77 / 0.88 / 0.76 / 1.10x. A whole verify step (attention on
          chunks of 4 query rows): 1-4 rows cost one AR step, 8 rows 1.7x (wx: 4 rows 1.7x,
          8 rows 2.9x), so three drafts are free and seven cost 0.7 of a step.

  kernel  our own C++ product (kernels/cpu_rows.cpp: every dot product runs the same
          AVX2 instruction sequence whatever the rows, so it is row-invariant by
          construction, and a step streams each weight once): no padding, 1 row costs one
          weight stream and 8 rows ~1.5x. Measured on the same AMD EPYC, all 211 weights:
          1 / 4 / 8 rows 33-35 / 43-47 / 50-57 ms vs wx4's 42-53 / 71-80 ms. Attention too
          is our C++ kernel (`rows_attention`: each row and head on its own, up to its key
          limit, in one fixed order), and a whole decoder layer is one C++ call
          (`rows_layer`: norms, products, RoPE, KV write, attention, SiLU), so a step makes
          30 calls instead of ~1000 small PyTorch ops (layers with linear biases keep the
          PyTorch ops around the same products). Side by side, SmolLM2 at a 300-token
          context: AR step 28.7 ms fused vs 37.7 ms as PyTorch ops vs 47.3 ms with the
          PyTorch block attention; 4 rows 38.7 vs 47.5 ms. Built once per machine (needs
          AVX2/FMA, a C++ compiler and ninja; float32 models on the CPU).

`auto` measures the GEMMs of the model's own weights for an AR step, a 4-row step and a
`width`-row step in each layout that passes its self-test and takes the cheapest (micro
unless another is more than 10% cheaper, so the choice is stable between runs). The
measured verify cost of 1..W rows (`Engine.step_costs`, in AR steps) is what the draft
budget plans with.

Pad rows reuse row 0's position and write their KV to a trash slot no real row can see.
Attention runs on fixed chunks of query rows (`RowLayout.attention_rows`) and is
row-invariant (see attention.py); in the kernel layout, on each row alone (cpu_rows.cpp).

Programs (all share `run_layers`):
  ar          1 row, all layers, LM head, argmax
  seg[a,b,m]  m rows through layers [a, b)
  verify[c,n] n rows from layer c to the end, LM head, argmax per row
On the CPU the programs run eagerly; the metadata of a step (positions, KV slots, key
limits) lives in one buffer written by one copy, as the CUDA-graph runner will need.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

from hf_selfspec.kernels.cpu_rows import NO_PATH

from .attention import KEY_BLOCK, block_attention, visible_bias
from .layered import LayeredModel, rms_norm, rotate_half
from .runner import triton_attention, uses_row_attention

# Most rows one step takes (row 0 + drafts). Measured with scripts/bench.py --widths
# (SmolLM2-135M, fp32, 2 threads; docs/benchmarks.md): in the micro layout a verify step of
# 1 / 2 / 3 / 4 / 6 / 8 rows costs 1.00 / 1.07 / 1.09 / 1.69 / 1.81 / 2.23x one row, so 8
# rows leave the draft budget (decoding/policy.py) room for long copies where they pay.
DEFAULT_WIDTH = 8
DEFAULT_CAPACITY = 2048
# Interleaved timing rounds per distinct step in `Engine.step_costs` (median taken): on the
# 2-core CI machine a best-of-2 per width gave 4-row costs from 1.0x to 1.4x between runs.
STEP_COST_ROUNDS = 7

RowLayoutName = Literal["auto", "fixed", "micro", "gemv", "wx", "wx4", "kernel"]
ROW_LAYOUTS = ("auto", "fixed", "micro", "gemv", "wx", "wx4", "kernel")
PrefillName = Literal["hf", "engine"]


@dataclass(frozen=True)
class EngineConfig:
    """width: rows per step (fixed for the engine's lifetime);
    capacity: KV slots for prompt + new tokens + one block of drafts."""

    width: int = DEFAULT_WIDTH
    capacity: int = DEFAULT_CAPACITY
    row_layout: RowLayoutName = "auto"  # auto: the cheapest layout whose self-test passes, else fixed
    # "hf": the prompt goes through the HF model's own forward (wide GEMMs, one pass) and
    # its KV is copied into the engine's cache, so the prompt KV and the first new token
    # are exactly those of HF's generate(); "engine": W-row chunks through the decode
    # programs. Speculative and AR decoding always share the prefill, so either is exact.
    prefill: PrefillName = "hf"

    def __post_init__(self):
        if self.prefill not in ("hf", "engine"):
            raise ValueError(f"prefill must be 'hf' or 'engine', got {self.prefill!r}")
        if self.row_layout not in ROW_LAYOUTS:
            raise ValueError(f"row_layout must be one of {ROW_LAYOUTS}, got {self.row_layout!r}")
        if not isinstance(self.width, int) or not 1 <= self.width <= 64:
            raise ValueError(f"width must be an int in [1, 64], got {self.width!r}")
        if not isinstance(self.capacity, int) or self.capacity < 2 * self.width:
            raise ValueError(f"capacity must be an int >= 2*width, got {self.capacity!r}")


@dataclass
class StepMeta:
    """Per-step row metadata. positions/slots/key_limit are device tensors [W] (views of
    one buffer); `rows` is how many rows the GEMMs of this step compute."""

    positions: torch.Tensor  # RoPE position of each row
    slots: torch.Tensor  # KV slot each row writes (pad rows: the trash slot)
    key_limit: torch.Tensor  # last slot each row may attend to
    num_real: int
    rows: int
    biases: list[torch.Tensor]  # per attention chunk: [G*A, nb*KEY_BLOCK] additive masks
    cos: torch.Tensor  # [rows, d]
    sin: torch.Tensor
    # draft trees (kernel layout only): [n, P] int64, row r's path slots after the committed
    # prefix (ancestors then itself, -1 pads; see cpu_rows.cpp rows_attention); [0, 0]: a chain
    path: torch.Tensor = NO_PATH


def row_chunks(rows: int) -> list[tuple[int, int]]:
    """Split `rows` (>= 2) into consecutive chunks of 3 rows and at most two of 2 rows."""
    chunks, lo = [], 0
    while rows - lo > 0:
        left = rows - lo
        size = 2 if left in (2, 4) else 3
        chunks.append((lo, lo + size))
        lo += size
    return chunks


def quad_chunks(rows: int) -> list[tuple[int, int]]:
    """Split `rows` (a multiple of 4) into consecutive chunks of 8 rows and at most one of 4."""
    return [(lo, min(lo + 8, rows)) for lo in range(0, rows, 8)]


def _wx_product(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] times w [out, in] as (w @ x^T)^T, rows back contiguous."""
    return torch.mm(w, x.t()).t().contiguous()


class RowLayout:
    """How many rows a step's GEMMs compute, and in which chunks (see module docstring)."""

    def __init__(self, name: str, width: int, layers: Sequence[torch.nn.Linear] = ()):
        self.name = name
        self.width = width
        # gemv: W^T [in, out] contiguous per weight, keyed by the layer object
        self.transposed: dict[int, torch.Tensor] = (
            {id(layer): layer.weight.detach().t().contiguous() for layer in layers}
            if name == "gemv" else {})
        # query rows per attention call: fixed shapes, so a row's attention never depends
        # on how many rows share the step (micro: 3, as cheap as the 1-3 row GEMMs)
        # (kernel: one row per attention "chunk", each row computed on its own)
        self.attention_rows = width if name == "fixed" else 4 if name == "wx4" else 1 if name == "kernel" else 3
        self._kernel = self.kernel_attention = self.kernel_layer = None
        if name == "kernel":
            from hf_selfspec.kernels.cpu_rows import (
                build_error,
                load_rows_attention,
                load_rows_layer,
                load_rows_linear,
            )

            self._kernel = load_rows_linear()
            self.kernel_attention = load_rows_attention()
            self.kernel_layer = load_rows_layer()
            if self._kernel is None or self.kernel_attention is None:
                raise ValueError(f"row_layout='kernel' is not available here: {build_error()}; "
                                 "use row_layout='auto'")

    def rows(self, num_real: int) -> int:
        if self.name == "fixed":
            return self.width
        if self.name == "wx4":
            return -(-num_real // 4) * 4  # pad to whole 4-column blocks
        if self.name == "kernel":
            return num_real
        return num_real if self.name == "gemv" else max(num_real, 2)  # micro, wx: pad 1 to 2

    def attention_chunks(self, num_real: int) -> int:
        return -(-num_real // self.attention_rows)

    def linear(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        """x [rows, in] -> [rows, out] (+ the layer's bias: Qwen2's q/k/v, Llama with
        attention_bias / mlp_bias), the row-invariant way."""
        if self.name in ("fixed", "micro"):
            return self._product(x, layer)  # nn.Linear adds its bias itself
        y = self._product(x, layer)
        return y if layer.bias is None else y + layer.bias

    def _product(self, x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        if self.name == "gemv":
            wt = self.transposed[id(layer)]
            if x.shape[0] <= 3:
                return x @ wt
            return torch.cat([x[lo:lo + 3] @ wt for lo in range(0, x.shape[0], 3)])
        if self.name == "kernel":
            return self._kernel(x.contiguous(), layer.weight)
        if self.name == "wx4":
            w = layer.weight
            if x.shape[0] <= 8:
                return _wx_product(w, x)
            return torch.cat([_wx_product(w, x[lo:hi]) for lo, hi in quad_chunks(x.shape[0])])
        if self.name == "wx":
            w = layer.weight
            if x.shape[0] <= 3:
                return _wx_product(w, x)
            return torch.cat([_wx_product(w, x[lo:hi]) for lo, hi in row_chunks(x.shape[0])])
        if self.name == "fixed" or x.shape[0] <= 3:
            return layer(x)
        return torch.cat([layer(x[lo:hi]) for lo, hi in row_chunks(x.shape[0])])

    @staticmethod
    def _rows_invariant(layers: list[torch.nn.Linear], product, ref_rows: int,
                        sizes: tuple[int, ...] = (2, 3)) -> bool:
        """Bitwise self-test on the model's own weight shapes: a row's product (as row 0 of
        `ref_rows` rows) must not change in blocks of `sizes` rows, at any place, whatever
        its neighbours."""
        gen = torch.Generator(device="cpu").manual_seed(0)
        for layer in layers:
            w = layer.weight
            x = torch.randn(ref_rows, w.shape[1], generator=gen).to(w.device, w.dtype)
            with torch.no_grad():
                ref = product(layer, x)[0]
                for size in sizes:
                    for place in range(size):
                        block = torch.randn(size, w.shape[1], generator=gen).to(w.device, w.dtype)
                        block[place] = x[0]
                        if not torch.equal(product(layer, block)[place], ref):
                            return False
        return True

    @staticmethod
    def micro_is_row_invariant(layers: list[torch.nn.Linear]) -> bool:
        """F.linear on 2- and 3-row chunks (the micro layout; a 1-row step is padded to 2)."""
        return RowLayout._rows_invariant(layers, lambda layer, x: layer(x), ref_rows=2)

    @staticmethod
    def wx_is_row_invariant(layers: list[torch.nn.Linear]) -> bool:
        """W @ x^T on 2- and 3-row chunks (the wx layout; a 1-row step is padded to 2)."""
        return RowLayout._rows_invariant(
            layers, lambda layer, x: _wx_product(layer.weight.detach(), x), ref_rows=2)

    @staticmethod
    def wx4_is_row_invariant(layers: list[torch.nn.Linear]) -> bool:
        """W @ x^T on 4- and 8-row blocks (the wx4 layout; steps padded to whole 4-row blocks)."""
        return RowLayout._rows_invariant(
            layers, lambda layer, x: _wx_product(layer.weight.detach(), x), ref_rows=4, sizes=(4, 8))

    @staticmethod
    def kernel_is_row_invariant(layers: list[torch.nn.Linear]) -> bool:
        """Our C++ product on 1, 2, 3, 4 and 8 rows (row-invariant by construction; checked
        like the others). False where it cannot be built or the weights are not float32."""
        from hf_selfspec.kernels.cpu_rows import load_rows_linear

        kernel = load_rows_linear()
        if kernel is None or any(lin.weight.dtype != torch.float32 or lin.weight.device.type != "cpu"
                                 or not lin.weight.is_contiguous() for lin in layers):
            return False
        shapes = list({tuple(lin.weight.shape): lin for lin in layers}.values())  # one per shape
        return RowLayout._rows_invariant(
            shapes, lambda layer, x: kernel(x.contiguous(), layer.weight.detach()), ref_rows=1,
            sizes=(2, 3, 4, 8))

    @staticmethod
    def gemv_is_row_invariant(layers: list[torch.nn.Linear]) -> bool:
        """x @ W^T on 1, 2 and 3 rows (the gemv layout)."""
        return RowLayout._rows_invariant(
            layers, lambda layer, x: x @ layer.weight.detach().t().contiguous(), ref_rows=1)


class Engine:
    """Fixed-shape engine over an HF model (weights shared, KV cache owned)."""

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
        self.layout = self._choose_layout()
        # metadata rows: every GEMM row and every attention query row of the widest step
        a = self.layout.attention_rows
        self.meta_rows = max(self.width, -(-self.width // a) * a)
        self._meta_host = torch.zeros(3, self.meta_rows, dtype=torch.long)
        self._meta = torch.zeros(3, self.meta_rows, dtype=torch.long, device=v.device)
        # kernel layout: each decoder layer in one C++ call (cpu_rows.cpp rows_layer), unless
        # a layer has biases (then the PyTorch ops below, with the same C++ products)
        self._fused_layers = self._fused_layer_weights()
        # transformers renamed forward(past_key_values=) to forward(cache=) in 5.x
        params = inspect.signature(model.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _fused_layer_weights(self) -> list[list[torch.Tensor]] | None:
        """Per layer, the weights `rows_layer` takes (see cpu_rows.cpp), or None when the
        layers run as PyTorch ops (another layout, or linear biases)."""
        if self.layout.kernel_layer is None:
            return None
        fused = []
        for lw in self.view.layers:
            linears = (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down)
            if any(lin.bias is not None for lin in linears):
                return None
            w = [lw.input_norm, lw.q.weight, lw.k.weight, lw.v.weight, lw.o.weight, lw.post_norm,
                 lw.gate.weight, lw.up.weight, lw.down.weight]
            if lw.q_norm is not None:
                w += [lw.q_norm, lw.k_norm]
            fused.append([t.detach() for t in w])
        return fused

    def _all_linears(self) -> list[torch.nn.Linear]:
        v = self.view
        return [lin for lw in v.layers for lin in (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down)] + [v.lm_head]

    def _choose_layout(self) -> RowLayout:
        wanted = self.config.row_layout
        if wanted == "fixed" or (wanted == "auto" and self.view.device.type != "cpu"):
            return RowLayout("fixed", self.width)
        lw = self.view.layers[0]
        shapes = [lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down, self.view.lm_head]
        tests = {"micro": RowLayout.micro_is_row_invariant, "gemv": RowLayout.gemv_is_row_invariant,
                 "wx": RowLayout.wx_is_row_invariant, "wx4": RowLayout.wx4_is_row_invariant,
                 # the kernel takes float32 CPU weights stored contiguous: every weight, not
                 # just the tested shapes (a tied or adapted model may hold other views)
                 "kernel": lambda layers: RowLayout.kernel_is_row_invariant(self._all_linears())}
        if wanted in tests:
            if wanted == "kernel" and not tests[wanted](shapes):
                from hf_selfspec.kernels.cpu_rows import build_error

                raise ValueError(
                    "row_layout='kernel' needs a float32 model on an AVX2 CPU and the compiled "
                    f"kernel ({build_error() or 'it built'}); use row_layout='auto'.")
            if not tests[wanted](shapes):
                raise ValueError(
                    f"row_layout={wanted!r} was asked for, but this BLAS does not compute its 1-3 row "
                    "GEMMs row-invariantly; use row_layout='fixed' (or 'auto')."
                )
            return RowLayout(wanted, self.width, self._all_linears())
        passing = [name for name, test in tests.items() if test(shapes)]
        if not passing:
            return RowLayout("fixed", self.width)
        layouts = {name: RowLayout(name, self.width, self._all_linears()) for name in passing}
        if len(layouts) == 1:
            return next(iter(layouts.values()))
        costs = {name: self._gemm_seconds(layout) for name, layout in layouts.items()}
        best = min(costs, key=costs.get)
        # the reference layout stays unless another's products are >10% cheaper: the C++
        # kernel where it passed (its fused layers and row attention save time that products
        # alone do not show: on an AVX-512 Xeon, equal product time, AR step 24.4 vs 35.4 ms
        # with micro), else micro; with neither, the cheapest passing layout
        reference = next((name for name in ("kernel", "micro") if name in costs), best)
        if costs[best] > 0.9 * costs[reference]:
            best = reference
        return layouts[best]

    @torch.no_grad()
    def _gemm_seconds(self, layout: RowLayout, reps: int = 3) -> float:
        """Best-of-`reps` seconds of every weight's product for an AR step, a 4-row step and
        a `width`-row step (what a decoder takes: AR where drafts do not pay, a few drafts,
        long copies)."""
        import time

        linears = self._all_linears()
        v = self.view
        gen = torch.Generator(device="cpu").manual_seed(0)
        total = 0.0
        for n in sorted({1, min(4, self.width), self.width}):
            rows = layout.rows(n)
            xs = {}
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                for lin in linears:
                    k = lin.weight.shape[1]
                    if k not in xs:
                        # a local generator: never consume the user's RNG (sampling seeds)
                        xs[k] = torch.randn(rows, k, generator=gen).to(v.device, v.dtype)
                    layout.linear(xs[k], lin)
                best = min(best, time.perf_counter() - t0)
            total += best
        return total

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

    @property
    def supports_trees(self) -> bool:
        """Whether a step's rows may form a draft tree (`make_meta(..., paths=...)`): the C++
        row attention (kernel layout) visits a row's path slots in depth order, exactly as a
        chain row's keys; the PyTorch block attention sums over masked key blocks, whose
        order a scattered path would change."""
        return self.layout.kernel_attention is not None

    def make_meta(
        self, positions: Sequence[int], key_limits: Sequence[int] | None = None,
        slots: Sequence[int] | None = None, paths: Sequence[Sequence[int]] | None = None,
    ) -> StepMeta:
        """Metadata for a step whose real rows sit at `positions` (chain: slot = position).
        A draft tree gives each row's KV `slots` and its `paths` (the slots of its path
        after the committed prefix, root first, itself last); key limits are the positions."""
        n = len(positions)
        if not 1 <= n <= self.width:
            raise ValueError(f"a step takes 1..{self.width} rows, got {n}")
        limits = positions if key_limits is None else key_limits
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
        # CUDA: the Triton kernel reads limit_t itself (runner.triton_attention); kernel
        # layout: the C++ attention reads it (cpu_rows.cpp); no masks for either
        biases = [] if uses_row_attention(self) or self.layout.kernel_attention else [
            visible_bias(limit_t[c * a:(c + 1) * a], num_keys, self.group)
            for c in range(self.layout.attention_chunks(n))]
        rows = self.layout.rows(n)
        v = self.view
        path = NO_PATH
        if paths is not None:
            if not self.supports_trees:
                raise ValueError(f"draft trees need the kernel row layout (this engine uses "
                                 f"{self.layout.name!r}); decode with chains (DecodeConfig(tree='off'))")
            if len(paths) != n:
                raise ValueError(f"{len(paths)} paths given for {n} rows")
            path = torch.full((n, max(len(p) for p in paths)), -1, dtype=torch.long)
            for r, row_path in enumerate(paths):
                path[r, : len(row_path)] = torch.as_tensor(row_path)
        return StepMeta(
            positions_t, slots_t, limit_t, n, rows, biases,
            v.cos[positions_t[:rows]], v.sin[positions_t[:rows]], path,
        )

    def move_kv(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy every layer's K and V from slot sources[i] to targets[i], in order (a draft
        tree's accepted path, compacted to consecutive positions: targets never overwrite a
        later source when both increase and targets[i] <= sources[i])."""
        for src, dst in zip(sources, targets):
            if src != dst:
                self.k_cache[:, :, dst] = self.k_cache[:, :, src]
                self.v_cache[:, :, dst] = self.v_cache[:, :, src]

    # ---- the maths of a step --------------------------------------------------------------

    def _pad(self, h: torch.Tensor, rows: int) -> torch.Tensor:
        if h.shape[0] == rows:
            return h
        x = torch.zeros(rows, h.shape[1], dtype=h.dtype, device=h.device)
        x[: h.shape[0]] = h
        return x

    def run_layers(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """h [n, H] (the step's real rows) after `start` layers -> [n, H] after `end`
        layers; writes the KV of layers [start, end) at meta.slots."""
        v = self.view
        R, Hq, Hkv, d = meta.rows, v.num_heads, v.num_kv_heads, v.head_dim
        n = h.shape[0]
        if self._fused_layers is not None:  # kernel layout: one C++ call per layer, no padding
            layer, slots, limits = self.layout.kernel_layer, meta.slots[:n], meta.key_limit[:n]
            cos, sin = meta.cos[:n], meta.sin[:n]
            h = h.contiguous()
            for li in range(start, end):
                h = layer(h, self._fused_layers[li], self.k_cache[li], self.v_cache[li], cos, sin,
                          slots, limits, v.eps, v.scaling, meta.path)
            return h
        lin = self.layout.linear
        h = self._pad(h, R)
        cos, sin = meta.cos[None], meta.sin[None]  # [1, R, d]
        slots = meta.slots[:R]
        A = self.layout.attention_rows
        # CUDA: the Triton kernel, which reads the key limits from the metadata buffer, so
        # a captured graph replays at any position (runner.py)
        attend = (triton_attention(self, meta) if uses_row_attention(self)
                  else self._kernel_attention(meta) if self.layout.kernel_attention else None)
        if attend is None:
            QR = max(R, len(meta.biases) * A)  # query rows incl. attention padding
            q_all = torch.zeros(Hq, QR, d, dtype=torch.float32, device=h.device)
            o_all = torch.zeros(Hq, QR, d, dtype=torch.float32, device=h.device)
        for li in range(start, end):
            lw = v.layers[li]
            x = rms_norm(h, lw.input_norm, v.eps)
            q = lin(x, lw.q).view(R, Hq, d)
            k = lin(x, lw.k).view(R, Hkv, d)
            val = lin(x, lw.v).view(R, Hkv, d)
            if lw.q_norm is not None:
                q = rms_norm(q, lw.q_norm, v.eps)
                k = rms_norm(k, lw.k_norm, v.eps)
            q = q.transpose(0, 1)  # [Hq, R, d]
            k = k.transpose(0, 1)  # [Hkv, R, d]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.k_cache[li].index_copy_(1, slots, k)
            self.v_cache[li].index_copy_(1, slots, val.transpose(0, 1))
            if attend is not None:
                o = attend(q, li)  # [R, Hq*d] in h's dtype
            else:
                # attention on chunks of A query rows (fixed shapes)
                q_all[:, :R] = q.float() * v.scaling
                for c, bias in enumerate(meta.biases):
                    qc = q_all[:, c * A:(c + 1) * A].reshape(Hkv, self.group * A, d)
                    oc = block_attention(qc, self.k_cache[li], self.v_cache[li], bias)
                    o_all[:, c * A:(c + 1) * A] = oc.view(Hq, A, d)
                o = o_all[:, :R].to(h.dtype).transpose(0, 1).reshape(R, Hq * d)
            h = h + lin(o, lw.o)
            x = rms_norm(h, lw.post_norm, v.eps)
            h = h + lin(F.silu(lin(x, lw.gate)) * lin(x, lw.up), lw.down)
        return h[:n]

    def _kernel_attention(self, meta: StepMeta):
        """Attention of one step through the C++ row kernel (kernel layout, float32 CPU):
        `attend(q [Hq, R, d], layer) -> o [R, Hq*d]`, row r seeing slots [0, key_limit[r]]
        (row-invariant by construction: kernels/cpu_rows.cpp)."""
        fn, limits = self.layout.kernel_attention, meta.key_limit[:meta.rows]
        k_cache, v_cache, scale, path = self.k_cache, self.v_cache, self.view.scaling, meta.path

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            return fn(q.transpose(0, 1).contiguous(), k_cache[layer], v_cache[layer], limits, scale, path)

        return attend

    def logits(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream after the last layer [n, H] -> (logits [n, V], final hidden
        state after the final norm [n, H]), row-invariantly."""
        v = self.view
        n = h.shape[0]
        x = rms_norm(self._pad(h, self.layout.rows(n)), v.final_norm, v.eps)
        return self.layout.linear(x, v.lm_head)[:n], x[:n]

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Token ids -> hidden [n, H]."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.view.device)
        return self.view.embed_rows(ids)

    # ---- programs ------------------------------------------------------------------------

    @torch.no_grad()
    def seg(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """seg[start, end, m]: advance the step's m rows from layer `start` to `end`."""
        return self.run_layers(h, start, end, meta)

    @torch.no_grad()
    def verify(self, h: torch.Tensor, start: int, meta: StepMeta):
        """verify[start, n]: rows from layer `start` to the end.
        Returns (logits [n, V], argmax [n], final hidden after the final norm [n, H])."""
        h = self.run_layers(h, start, self.view.num_layers, meta)
        logits, final = self.logits(h)
        return logits, logits.argmax(-1), final

    @property
    def step_costs(self) -> tuple[float, ...]:
        """Measured verify cost of n rows (index n = 1..W; index 0 = 1 row) in units of a
        1-row step, measured once per engine.

        Steps that run the same programs (same GEMM rows and attention chunks: in wx4, 1-4
        rows are one 4-row step) are timed once, as the widest of them; the distinct steps
        are timed in interleaved rounds and each takes its median, so a burst of machine
        noise cannot make one width look cheap or dear for the engine's lifetime (the draft
        budget plans with these figures). The timing runs at a context of two key blocks
        (a typical chat), writing KV in the last W slots, which any later use overwrites
        before reading."""
        if getattr(self, "_step_costs", None) is None:
            import statistics
            import time

            layout = self.layout
            key = {n: (layout.rows(n), layout.attention_chunks(n)) for n in range(1, self.width + 1)}
            widest = {k: max(n for n in key if key[n] == k) for k in set(key.values())}
            base = self.capacity - self.width
            limit = min(base, 2 * KEY_BLOCK - 1)
            samples: dict[tuple, list[float]] = {k: [] for k in widest}
            with torch.no_grad():
                h = self.embed([0] * self.width)
                for rounds in range(1 + STEP_COST_ROUNDS):  # round 0: warm-up
                    for k, n in widest.items():
                        meta = self.make_meta(range(base, base + n), [limit] * n)  # one shared buffer
                        t0 = time.perf_counter()
                        self.verify(h[:n], 0, meta)
                        if rounds > 0:
                            samples[k].append(time.perf_counter() - t0)
            seconds = [statistics.median(samples[key[n]]) for n in range(1, self.width + 1)]
            self._one_row_seconds = seconds[0]
            costs = [s / seconds[0] for s in seconds]
            for i in range(1, len(costs)):  # more rows never cost less (timing noise)
                costs[i] = max(costs[i], costs[i - 1])
            self._step_costs = tuple([1.0] + costs)
        return self._step_costs

    @property
    def one_row_seconds(self) -> float:
        """Measured seconds of a 1-row step over all layers (see step_costs)."""
        self.step_costs  # noqa: B018 (measures once)
        return self._one_row_seconds

    @torch.no_grad()
    def prefill(self, prompt_ids: Sequence[int]):
        """Fill the KV cache with the prompt (see EngineConfig.prefill).
        Returns (logits [V], final hidden after the final norm [H]) of the last prompt row."""
        if self.config.prefill == "hf":
            return self._prefill_hf(prompt_ids)
        return self._prefill_engine(prompt_ids)

    def _prefill_hf(self, prompt_ids: Sequence[int]):
        from transformers import DynamicCache

        n = len(prompt_ids)
        ids = torch.as_tensor([list(prompt_ids)], dtype=torch.long, device=self.view.device)
        cache = DynamicCache(config=self.view.config)
        out = self.view.model.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: cache})
        for li, layer in enumerate(cache.layers):
            self.k_cache[li, :, :n] = layer.keys[0]
            self.v_cache[li, :, :n] = layer.values[0]
        last = out.last_hidden_state[0, -1]  # after the final norm
        return self.view.lm_head(last[None])[0], last

    def _prefill_engine(self, prompt_ids: Sequence[int]):
        n = len(prompt_ids)
        for lo in range(0, n, self.width):
            chunk = list(prompt_ids[lo : lo + self.width])
            meta = self.make_meta(range(lo, lo + len(chunk)))
            h = self.run_layers(self.embed(chunk), 0, self.view.num_layers, meta)
        logits, final = self.logits(h[-1:])
        return logits[0], final[0]

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
        if max_new_tokens <= 0:
            return []
        eos = set(eos_token_ids)
        logits, _ = self.prefill(prompt_ids)
        token = int(logits.argmax())
        out = [token]
        position = len(prompt_ids)
        while len(out) < max_new_tokens and token not in eos:
            _, token, _ = self.ar_step(token, position)
            out.append(token)
            position += 1
        return out
