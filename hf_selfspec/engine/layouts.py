"""Row layouts: how a step's matrix products keep each row's bits whatever the other rows.

Libraries choose GEMM kernels by shape, so "the same maths at another number of rows" is
not enough: each layout fixes the shapes (or the arithmetic) in its own way, and carries a
bitwise self-test on the model's own weight shapes that the engine runs at start-up. Only a
layout whose self-test passes on this machine is used.

  kernel  our C++ product (kernels/cpu-rows/): every dot product runs the same
          instruction sequence whatever the rows, so it is row-invariant by construction,
          and a step streams each weight once; no padding. Brings the C++ row attention
          and a whole decoder layer in one call (`rows_layer`). Needs an AVX2/FMA/F16C CPU, a
          C++ compiler and fp32/bf16/fp16 weights stored contiguous, or transposed (GPT-2's
          Conv1D), read as stored.
  micro   F.linear on chunks of 2 or 3 rows: on MKL the 2- and 3-row GEMM path computes
          each row independently of the others (the self-test checks it), so a step costs
          what its real rows cost. A 1-row step is padded to 2.
  fixed   every product, norm and elementwise op runs on exactly `width` rows (real rows
          first, zero padding after). Works with any BLAS and dtype; the CUDA-graph layout
          and the fallback where no other passes.

Layouts read the model's own weights (nn.Linear modules) and hold no copy of them. The
measurements behind this set, and the layouts that were dropped, are in
docs/engine_layouts_history.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

Linear = torch.nn.Linear
Product = Callable[[Linear, torch.Tensor], torch.Tensor]


def row_chunks(rows: int) -> list[tuple[int, int]]:
    """Split `rows` (>= 2) into consecutive chunks of 3 rows and at most two of 2 rows."""
    chunks, lo = [], 0
    while rows - lo > 0:
        left = rows - lo
        size = 2 if left in (2, 4) else 3
        chunks.append((lo, lo + size))
        lo += size
    return chunks


def rows_invariant(layers: Sequence[Linear], product: Product, ref_rows: int,
                   sizes: tuple[int, ...] = (2, 3)) -> bool:
    """Bitwise self-test on the model's own weight shapes: a row's product (as row 0 of
    `ref_rows` rows) must not change in blocks of `sizes` rows, at any place, whatever its
    neighbours. Inputs come from a local generator (never the user's RNG) in the weight's
    dtype; a product that raises (e.g. a dtype the BLAS lacks) fails the test."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        with torch.no_grad():
            for layer in layers:
                w = layer.weight
                x = torch.randn(ref_rows, w.shape[1], generator=gen).to(w.device, w.dtype)
                ref = product(layer, x)[0]
                for size in sizes:
                    for place in range(size):
                        block = torch.randn(size, w.shape[1], generator=gen).to(w.device, w.dtype)
                        block[place] = x[0]
                        if not torch.equal(product(layer, block)[place], ref):
                            return False
    except RuntimeError:
        return False
    return True


def one_per_shape(layers: Sequence[Linear]) -> list[Linear]:
    """One layer per (weight shape, dtype): what a self-test needs to see."""
    return list({(tuple(lin.weight.shape), lin.weight.dtype): lin for lin in layers}.values())


class RowLayout:
    """Base class: a layout computes `linear(x [rows, in], layer) -> [rows, out]` so that a
    row's result does not depend on the other rows, given that a step of n real rows runs
    its products on `rows(n)` rows and its attention on chunks of `attention_rows`."""

    name: ClassVar[str]
    # C++ kernels the layout brings (kernel layout only): row attention and a fused layer
    kernel_attention = None
    kernel_attention_alibi = None
    kernel_attention_sinks = None
    kernel_layer = None
    kernel_layers = None

    def __init__(self, width: int):
        self.width = width
        self.attention_rows = self._attention_rows(width)

    @staticmethod
    def _attention_rows(width: int) -> int:
        return 1

    def rows(self, num_real: int) -> int:
        """Rows the products of a step with `num_real` real rows compute (>= num_real)."""
        return num_real

    def attention_chunks(self, num_real: int) -> int:
        return -(-num_real // self.attention_rows)

    def linear(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        """x [rows, in] -> [rows, out], the layer's bias included."""
        raise NotImplementedError

    def linear_heads(self, x: torch.Tensor, layers: Sequence[Linear]) -> torch.Tensor:
        """x [heads, rows, in] -> [heads, rows, out]: head h's rows times layers[h] (bias-free
        views of one weight: latent attention's per-head products), each as `linear`."""
        return torch.stack([self.linear(x[h], layer) for h, layer in enumerate(layers)])

    # ---- start-up self-test ---------------------------------------------------------------

    @classmethod
    def self_test(cls, linears: Sequence[Linear]) -> bool:
        """Whether this layout computes every product of `linears` (the model's own, all of
        them) row-invariantly on this machine. Builds nothing that outlives the call."""
        raise NotImplementedError

    @classmethod
    def refusal(cls, linears: Sequence[Linear]) -> str:
        """The error when this layout was asked for and its self-test failed."""
        return (f"row_layout={cls.name!r} was asked for, but this BLAS does not compute its "
                "1-3 row GEMMs row-invariantly; use row_layout='fixed' (or 'auto').")


class FixedLayout(RowLayout):
    """Every product on exactly `width` rows: one shape per product, any BLAS, any dtype."""

    name = "fixed"

    @staticmethod
    def _attention_rows(width: int) -> int:
        return width

    def rows(self, num_real: int) -> int:
        return self.width

    def linear(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        return layer(x)

    @classmethod
    def self_test(cls, linears: Sequence[Linear]) -> bool:
        """One shape per product by construction, so any deterministic BLAS is row-invariant
        here; what is tested is that the products run at all in the weights' dtype."""
        try:
            with torch.no_grad():
                for lin in one_per_shape(linears):
                    w = lin.weight
                    lin(torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device))
        except RuntimeError:
            return False
        return all(lin.weight.is_floating_point() for lin in linears)

    @classmethod
    def refusal(cls, linears: Sequence[Linear]) -> str:
        dtypes = sorted({str(lin.weight.dtype) for lin in linears})
        devices = sorted({str(lin.weight.device) for lin in linears})
        return (f"no row layout of the engine runs this model's {'/'.join(dtypes)} weights on "
                f"{'/'.join(devices)} (even F.linear failed on them); use plain model.generate()")


class MicroLayout(RowLayout):
    """F.linear on chunks of 2 or 3 rows (a 1-row step padded to 2)."""

    name = "micro"

    @staticmethod
    def _attention_rows(width: int) -> int:
        return 3  # as cheap as the 1-3 row products

    def rows(self, num_real: int) -> int:
        return max(num_real, 2)

    def linear(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        if x.shape[0] <= 3:
            return layer(x)
        return torch.cat([layer(x[lo:hi]) for lo, hi in row_chunks(x.shape[0])])

    @classmethod
    def self_test(cls, linears: Sequence[Linear]) -> bool:
        # the products exactly as `linear` runs them (nn.Linear adds its bias itself)
        return rows_invariant(one_per_shape(linears), lambda layer, x: layer(x), ref_rows=2)


# Weight rows (outputs) the kernel's self-test multiplies (see KernelLayout.self_test):
# several of the kernel's output tiles and thread chunks.
KERNEL_TEST_OUTPUTS = 256


class KernelLayout(RowLayout):
    """The C++ row kernels (kernels/cpu-rows/): products, attention and fused decoder layers."""

    name = "kernel"
    # weight (and KV cache) dtypes the C++ kernels read as stored, widening to float32 in
    # registers: a bf16 model streams half the bytes of an fp32 one, and holds no fp32 copy
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, width: int):
        from hf_selfspec.kernels.cpu_rows import (
            build_error,
            load_rows_attention,
            load_rows_attention_alibi,
            load_rows_attention_sinks,
            load_rows_layer,
            load_rows_layers,
            load_rows_linear,
            load_rows_linear_heads,
            load_rows_linear_t,
        )

        super().__init__(width)
        self._product = load_rows_linear()
        self._product_t = load_rows_linear_t()
        self._heads = load_rows_linear_heads()
        # per list of per-head layers (id -> (the list, its weights as rows_linear_heads
        # takes them, transposed)): made at a block's first product
        self._head_weights: dict[int, tuple] = {}
        self.kernel_attention = load_rows_attention()
        self.kernel_attention_alibi = load_rows_attention_alibi()
        self.kernel_attention_sinks = load_rows_attention_sinks()
        self.kernel_layer = load_rows_layer()
        self.kernel_layers = load_rows_layers()
        if self._product is None or self.kernel_attention is None:
            raise ValueError(f"row_layout='kernel' is not available here: {build_error()}; "
                             "use row_layout='auto'")

    def linear(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        """The product in float32 (x widened exactly), then the bias, then rounded once to
        x's dtype: bf16/fp16 activations stay in the model's dtype, as F.linear's would.
        A weight stored transposed (GPT-2's Conv1D, layered.TransposedLinear) is read in
        place by the transposed product."""
        w = layer.weight
        y = self._product(x.contiguous(), w) if w.is_contiguous() else self._product_t(x.contiguous(), w.t())
        if layer.bias is not None:
            y = y + layer.bias
        return y.to(x.dtype)

    def linear_heads(self, x: torch.Tensor, layers: Sequence[Linear]) -> torch.Tensor:
        """`linear` per head in one C++ call (rows_linear_heads: the heads shared among the
        threads, each head's product rows_linear's or rows_linear_t's bit for bit), the
        float32 products rounded to x's dtype together (each is rounded once either way)."""
        weights = self._head_weights.get(id(layers))
        if weights is None or weights[0] is not layers:  # once per list (a block's k_up / v_up)
            stored = [layer.weight for layer in layers]
            if all(w.is_contiguous() for w in stored):
                weights = (layers, stored, False)
            elif all(_transposed_rows(w) for w in stored):
                weights = (layers, [w.t() for w in stored], True)
            else:  # (no such model: the heads' weights are of one kind)
                weights = (layers, None, False)
            self._head_weights[id(layers)] = weights
        if weights[1] is None or self._heads is None:
            return super().linear_heads(x, layers)
        return self._heads(x.contiguous(), weights[1], weights[2]).to(x.dtype)

    @classmethod
    def self_test(cls, linears: Sequence[Linear]) -> bool:
        """The C++ product on 1, 2, 3, 4 and 8 rows (row-invariant by construction; checked
        like the others). False where it cannot be built, or where any weight is not a
        contiguous CPU tensor of a dtype it reads (it takes the model's storage as is:
        never a converted copy)."""
        from hf_selfspec.kernels.cpu_rows import load_rows_linear, load_rows_linear_t

        if any(lin.weight.dtype not in cls.dtypes or lin.weight.device.type != "cpu"
               or not (lin.weight.is_contiguous() or _transposed_rows(lin.weight)) for lin in linears):
            return False
        kernel, kernel_t = load_rows_linear(), load_rows_linear_t()
        if kernel is None or kernel_t is None:
            return False

        def product(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return kernel(x.contiguous(), w) if w.is_contiguous() else kernel_t(x.contiguous(), w.t())

        # each output is one dot product whose instruction sequence the kernel fixes, whatever
        # the number of outputs: the first KERNEL_TEST_OUTPUTS rows of each weight (a view of
        # the model's storage) exercise the same code as all of them, at a fraction of the
        # cost of streaming every weight 18 times (the LM head dominates at start-up)
        return rows_invariant(
            one_per_shape(linears),
            lambda layer, x: product(layer.weight[:KERNEL_TEST_OUTPUTS], x),
            ref_rows=1, sizes=(2, 3, 4, 8))

    @classmethod
    def refusal(cls, linears: Sequence[Linear]) -> str:
        from hf_selfspec.kernels.cpu_rows import build_error

        dtypes = "/".join(str(d).removeprefix("torch.") for d in cls.dtypes)
        return (f"row_layout='kernel' needs a {dtypes} model on an AVX2 CPU and the compiled "
                f"kernel ({build_error() or 'it built'}); use row_layout='auto'.")


def _transposed_rows(weight: torch.Tensor) -> bool:
    """Whether a weight view [out, in] is the transpose of rows stored [in, >= out] with unit
    stride along out (GPT-2's Conv1D, or a column range of one): rows_linear_t reads it."""
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]


# Every layout by name. `auto` tries AUTO_ORDER on the CPU (the first is the reference the
# others must beat by a margin); where the kernel cannot run, NO_KERNEL_ORDER (which BLAS
# products are cheaper, a few rows in small chunks or always W rows, depends on the BLAS and
# the CPU: MKL on an AMD EPYC runs 2-3 rows dearer than 8); else `fixed`.
LAYOUTS: dict[str, type[RowLayout]] = {cls.name: cls for cls in (KernelLayout, MicroLayout, FixedLayout)}
AUTO_ORDER = ("kernel", "micro")
NO_KERNEL_ORDER = ("micro", "fixed")
AUTO_CHOICES = ("kernel", "micro", "fixed")  # what `auto` may pick (and cache) on the CPU
# `auto` leaves the reference layout only for one whose products are this much cheaper:
# the kernel's fused layers and row attention save time that products alone do not show,
# and a margin keeps the choice stable between runs.
SWITCH_MARGIN = 0.9


def choose_layout(wanted: str, width: int, device: torch.device, linears: Sequence[Linear], *,
                  cached: str | None = None,
                  measure: Callable[[RowLayout, float], float] | None = None) -> RowLayout:
    """The row layout for an engine: `wanted` by name (ValueError when its self-test fails),
    or for `auto` the cheapest passing one on the CPU (fixed on other devices).

    cached: a layout `auto` picked before for the same model, machine and software (the
    measurement cache): taken after its own self-test, with no timing. measure(layout,
    give_up): the seconds of a layout's products (costs.gemm_seconds), called one layout at
    a time; math.inf once they pass `give_up`, the cost at which a candidate can no longer
    replace the first passing layout."""
    if wanted != "auto":
        cls = LAYOUTS[wanted]
        if not cls.self_test(linears):
            raise ValueError(cls.refusal(linears))
        return cls(width)
    if device.type != "cpu":
        return _fallback(width, linears)
    if cached in AUTO_CHOICES and LAYOUTS[cached].self_test(linears):
        return LAYOUTS[cached](width)
    kernel_passes = LAYOUTS["kernel"].self_test(linears)
    order = AUTO_ORDER if kernel_passes else NO_KERNEL_ORDER
    # the reference is the first of `order` whose self-test passes; a later candidate is
    # self-tested only once its products could replace it (a self-test runs every shape's
    # products at several row counts: ~0.4 s on a 0.82B model, wasted on a loser)
    at = next((i for i, name in enumerate(order)
               if (kernel_passes if name == "kernel" else LAYOUTS[name].self_test(linears))), None)
    if at is None:
        return _fallback(width, linears)
    first, rest = order[at], order[at + 1:]
    if not rest or measure is None:
        return LAYOUTS[first](width)
    costs = {first: measure(LAYOUTS[first](width), math.inf)}
    for name in rest:  # one candidate alive at a time
        seconds = measure(LAYOUTS[name](width), SWITCH_MARGIN * costs[first])
        if seconds <= SWITCH_MARGIN * costs[first] and LAYOUTS[name].self_test(linears):
            costs[name] = seconds
    return LAYOUTS[min(costs, key=costs.get)](width)


def _fallback(width: int, linears: Sequence[Linear]) -> RowLayout:
    """`fixed`, where it runs at all (a dtype no product supports: a clear error naming it)."""
    if not FixedLayout.self_test(linears):
        raise ValueError(FixedLayout.refusal(linears))
    return FixedLayout(width)
