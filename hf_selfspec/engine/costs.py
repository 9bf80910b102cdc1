"""What a step costs on this machine: the products of a row layout (to choose one) and
the verify cost of 1..W rows (what the draft budget plans with, decoding/policy.py); an
engine's figures are its `EngineCosts` (`engine.costs`), measured by explicit calls.

Both are measured once per model, machine and software and cached on disk (cache.py), so a
later process, or a bigger KV cache, measures nothing.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from ..logs import logger
from .attention import KEY_BLOCK
from .layouts import RowLayout

if TYPE_CHECKING:  # annotations only
    from .cache import MeasurementCache
    from .interface import MeasuredEngine

# Interleaved timing rounds per distinct step in `measure_step_costs` (median taken): on a
# 2-core machine a best-of-2 per width gave 4-row costs from 1.0x to 1.4x between runs.
STEP_COST_ROUNDS = 7
# ... but a bigger model's rounds stop after this many seconds (at least MIN_ROUNDS): its
# steps are long enough that noise matters less, and the first call waits for them.
MEASURE_SECONDS = 1.0
MIN_ROUNDS = 2
# ... and a round of steps longer than this is not repeated: each step of it streams the
# weights once or more, a steady measurement (a 0.82B fp32 model's 1..8-row steps take ~1.1 s
# together: one round instead of two halves its first call's wait).
ONE_ROUND_SECONDS = 1.0
# A round of steps this long needs no warm-up round before it (the weights were just read).
LONG_ROUND_SECONDS = 0.5
# Best-of rounds for a layout's products in `gemm_seconds`; one pass over the weights that
# takes longer than LONG_GEMM_SECONDS is not repeated: it streams a gigabyte or more from
# memory, a steady measurement, and a 0.82B fp32 model's first call waited ~0.6 s for the
# repeats of its 0.1-0.2 s passes.
GEMM_REPS = 3
LONG_GEMM_SECONDS = 0.08


@torch.no_grad()
def gemm_seconds(layout: RowLayout, linears: Sequence[torch.nn.Linear], width: int,
                 reps: int = GEMM_REPS, give_up: float = math.inf,
                 per_rows: dict[int, float] | None = None) -> float:
    """Best-of-`reps` seconds of every weight's product for a `width`-row step and an AR
    step (what a decoder takes: the widest verification, and AR where drafts do not pay).
    math.inf as soon as the total passes `give_up` (a candidate that has already lost: on a
    big model each pass reads gigabytes, and the first call waits for it). `per_rows`, if
    given, receives each row count's seconds (see step_costs_from_products)."""
    gen = torch.Generator(device="cpu").manual_seed(0)  # never the user's RNG (sampling seeds)
    total = 0.0
    for n in sorted({1, width}, reverse=True):  # the wide step first: where layouts differ most
        rows = layout.rows(n)
        xs: dict[tuple, torch.Tensor] = {}
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            for lin in linears:
                w = lin.weight
                key = (w.shape[1], w.dtype, w.device)
                if key not in xs:
                    xs[key] = torch.randn(rows, w.shape[1], generator=gen).to(w.device, w.dtype)
                layout.linear(xs[key], lin)
                if total + time.perf_counter() - t0 > give_up:
                    return math.inf
            best = min(best, time.perf_counter() - t0)
            if best > LONG_GEMM_SECONDS:  # a big model: one pass is a steady measurement
                break
        total += best
        if per_rows is not None:
            per_rows[n] = best
    return total


# Prompt rows in `prefill_product_seconds`' probe: enough that both products are bound by
# arithmetic, as a prompt's are, not by reading the weight once.
PREFILL_PROBE_ROWS = 64
# `auto` prefills a 16-bit model with the engine's own steps only where its products are
# this much cheaper than HF's (its chunks add attention and step overheads HF's one pass
# does not have).
PREFILL_SWITCH = 0.6


@torch.no_grad()
def prefill_product_seconds(linear: torch.nn.Linear, width: int, layout: RowLayout) -> tuple[float, float]:
    """Best-of-3 seconds of PREFILL_PROBE_ROWS prompt rows through `linear` (16-bit, CPU):
    (as HF's forward computes a prompt: one product in the weight's dtype, as the engine's
    prefill does: `layout`'s products of `width`-row chunks). PyTorch's float16 products on a
    CPU without float16 arithmetic widen every block and are several times slower than the
    row kernel's; its bfloat16 ones (AVX-512 BF16) are faster."""
    gen = torch.Generator(device="cpu").manual_seed(0)  # never the user's RNG (sampling seeds)
    x = torch.randn(PREFILL_PROBE_ROWS, linear.weight.shape[1], generator=gen).to(linear.weight.dtype)
    chunks = [x[lo:lo + width] for lo in range(0, PREFILL_PROBE_ROWS, width)]

    def best(run) -> float:
        run()  # warm-up: the weight's first read
        seconds = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            seconds = min(seconds, time.perf_counter() - t0)
        return seconds

    hf = best(lambda: linear(x))
    engine = best(lambda: [layout.linear(chunk, linear) for chunk in chunks])
    return hf, engine


# A step-cost round estimated longer than this (a model of hundreds of megabytes or more:
# each of its 1..W-row steps streams every weight) is not timed: the curve comes from the
# products the layout choice has just timed (step_costs_from_products), which on such a
# model are nearly all of a step. Timing took a 0.82B fp32 model's first call ~1.1 s, a
# 0.49B bf16 model's 2 s, where the estimate is within a tenth of the timed curve.
ESTIMATE_ABOVE_SECONDS = 0.25


def step_costs_from_products(width: int, products: dict[int, float]) -> tuple[tuple[float, ...], float] | None:
    """`measure_step_costs`' result estimated from the products of a 1-row and a `width`-row
    step (gemm_seconds' per_rows; linear in between), where timing the steps themselves
    would take over ESTIMATE_ABOVE_SECONDS; None where it would not (or the products are
    unknown). Attention, norms and the rest of a step, a few percent of a big model's step,
    are left out of the curve; the 1-row seconds are the products'."""
    one, wide = products.get(1), products.get(width)
    if one is None or wide is None or not 0.0 < one < math.inf or not wide < math.inf:
        return None
    if width * (one + wide) / 2 <= ESTIMATE_ABOVE_SECONDS:
        return None
    wide = max(wide, one)  # more rows never cost less (timing noise flattened out)
    curve = [1.0 + (wide / one - 1.0) * (n - 1) / max(1, width - 1) for n in range(1, width + 1)]
    return tuple([1.0] + curve), one


def cost_context(engine: MeasuredEngine) -> int:
    """The key limit the step costs are measured at: two key blocks (a typical chat), or
    what a small cache allows."""
    return min(engine.capacity - engine.width, 2 * KEY_BLOCK - 1)


def median_seconds(engine: MeasuredEngine, steps: dict, rounds: int) -> dict:
    """Median seconds of each step (an `engine.verify` from layer 0 of the (hidden, meta)
    that `steps[key]()` returns, or the call `steps[key]()` returns), timed in interleaved
    rounds so that a burst of machine noise cannot make one step look cheap or dear. Round 0
    warms up, unless its steps are long (the weights were just read); the rounds stop after
    MEASURE_SECONDS once MIN_ROUNDS are in, or after one round longer than ONE_ROUND_SECONDS.
    Each meta is made just before its step (steps may share the engine's metadata buffer)."""
    samples: dict = {k: [] for k in steps}
    started = time.perf_counter()
    for round_ in range(1 + rounds):
        timed = {}
        for k, make in steps.items():
            made = make()
            if not callable(made):
                h, meta = made
                made = functools.partial(engine.verify, h, 0, meta, logits=False)
            t0 = time.perf_counter()
            made()
            timed[k] = time.perf_counter() - t0
        if round_ > 0 or sum(timed.values()) > LONG_ROUND_SECONDS:
            for k, seconds in timed.items():
                samples[k].append(seconds)
        if sum(timed.values()) > ONE_ROUND_SECONDS:
            break
        if len(next(iter(samples.values()))) >= MIN_ROUNDS and time.perf_counter() - started > MEASURE_SECONDS:
            break
    return {k: statistics.median(v) for k, v in samples.items()}


@torch.no_grad()
def measure_step_costs(engine: MeasuredEngine) -> tuple[tuple[float, ...], float]:
    """(verify cost of n rows for n = 0..W in units of a 1-row step (index 0 = 1 row),
    seconds of a 1-row step over all layers).

    Steps that run the same programs (same product rows and attention chunks) are timed
    once, as the widest of them; the distinct steps are timed in interleaved rounds and each
    takes its median, so a burst of machine noise cannot make one width look cheap or dear.
    The timing writes KV in the last W slots of the cache, which any later use overwrites
    before reading; more rows never cost less (relative_costs: timing noise is averaged out)."""
    layout = engine.layout
    sizes = timed_sizes(engine.width)
    key = {n: (layout.rows(n), layout.attention_chunks(n)) for n in sizes}
    widest = {k: max(n for n in key if key[n] == k) for k in set(key.values())}
    base = engine.position_limit - engine.width
    limit = cost_context(engine)
    h = engine.embed([0] * engine.width)
    medians = median_seconds(engine, {
        k: (lambda n=n: (h[:n], engine.make_meta(range(base, base + n), [limit] * n))) for k, n in widest.items()},
        STEP_COST_ROUNDS)
    seconds = interpolated({n: medians[key[n]] for n in sizes}, engine.width)
    costs = relative_costs(seconds)
    return tuple([1.0] + costs), seconds[0]


# An engine wider than this (a streamed model's: STREAMED_WIDTH) times the step sizes of
# WIDE_TIMED_SIZES only, the others interpolated: each size is a whole step, and a wide
# engine's steps read weights that stream in.
WIDE_FROM = 9
WIDE_TIMED_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def timed_sizes(width: int) -> list[int]:
    """The step sizes measure_step_costs times for an engine `width` rows wide."""
    if width < WIDE_FROM:
        return list(range(1, width + 1))
    return sorted({n for n in WIDE_TIMED_SIZES if n < width} | {width})


def interpolated(seconds: dict[int, float], width: int) -> list[float]:
    """Seconds of every step size 1..width, linear between the timed sizes in `seconds`."""
    sizes = sorted(seconds)
    out = []
    for n in range(1, width + 1):
        hi = next(m for m in sizes if m >= n)
        lo = max((m for m in sizes if m <= n), default=hi)
        share = 0.0 if hi == lo else (n - lo) / (hi - lo)
        out.append(seconds[lo] + share * (seconds[hi] - seconds[lo]))
    return out


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): a width
    measured dear by a burst of noise is averaged with the cheaper widths after it, where a
    running maximum would carry it into every wider step."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def relative_costs(seconds: Sequence[float]) -> list[float]:
    """Seconds of steps of increasing size -> their cost in units of the first: more rows
    never cost less (non_decreasing), and nothing costs less than the first step."""
    return [1.0] + [max(1.0, c) for c in non_decreasing([s / seconds[0] for s in seconds])[1:]]


# A cached 1-row step time this many times what a step takes now means the cache was
# measured while the machine was busy (other processes contending for the cores can make
# a step many times slower): its cost curve would plan drafts wrongly for good.
STALE_FACTOR = 3.0
# Below this a step is too short to time reliably against the cache: trusted as cached.
CHECK_ABOVE_SECONDS = 0.005
# ... and above this it is timed once, with no warm-up: it streams the weights from memory
# (no cache to warm), and noise can only make it slower, which keeps the cached figure; a
# 0.82B fp32 model's engine build spent 0.4 s of every process's first call on four steps.
ONE_TIMING_ABOVE_SECONDS = 0.05


def measured_while_busy(engine: MeasuredEngine, cached_one_row: float, reps: int = 3) -> bool:
    """Whether a cached measurement should be taken again: a 1-row step now (median of
    `reps`, after one warm-up; one timing of a long step) is over STALE_FACTOR times faster
    than the cached one."""
    if cached_one_row < CHECK_ABOVE_SECONDS:
        return False
    base = engine.position_limit - engine.width
    meta = engine.make_meta([base], [cost_context(engine)])
    h = engine.embed([0])
    warm_up, reps = (0, 1) if cached_one_row > ONE_TIMING_ABOVE_SECONDS else (1, reps)
    times = []
    for rep in range(warm_up + reps):
        t0 = time.perf_counter()
        engine.verify(h, 0, meta, logits=False)
        if rep >= warm_up:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * STALE_FACTOR < cached_one_row


@torch.no_grad()
def measure_attention_seconds(engine: MeasuredEngine) -> float:
    """Seconds per row and per key of a step's attention over all layers: the engine's
    attention alone (the backend its steps use) for W rows at the key limit `cost_context`
    and at a four times longer one, over every layer, in interleaved rounds (medians); 0.0
    where the cache is too short to tell. A step of n rows at key limit L then costs about
    its measured cost + n (L - cost_context) of this (`EngineCosts.step_costs_at`). Timing the
    attention alone keeps a big model's weights out of it: a whole step there streams
    gigabytes, and the difference of two such steps is mostly noise."""
    low = cost_context(engine)
    high = min(engine.position_limit - engine.width - 1, 4 * (low + 1) - 1)
    if high < 2 * low:
        return 0.0
    v, n = engine.view, engine.width
    base = engine.position_limit - n
    gen = torch.Generator(device="cpu").manual_seed(0)  # never the user's RNG
    q = torch.randn(v.num_heads, n, v.head_dim, generator=gen).to(v.device, v.dtype)

    def attention_at(limit: int):
        attend = engine.attention.bind(engine, engine.make_meta(range(base, base + n), [limit] * n))

        def run():
            for layer in range(v.num_layers):
                attend(q, layer)
            if v.device.type == "cuda":
                torch.cuda.synchronize(v.device)
        return run

    medians = median_seconds(engine, {limit: (lambda limit=limit: attention_at(limit)) for limit in (low, high)},
                             ATTENTION_ROUNDS)
    extra = medians[high] - medians[low]
    return max(0.0, extra / (n * (high - low)))


def costs_at(curve: Sequence[float], one_row_seconds: float, per_row_key: float, extra_keys: int) -> tuple[float, ...]:
    """A cost curve (index n: n rows, in 1-row steps, measured at the key limit
    `cost_context`) for steps whose rows see `extra_keys` more keys (fewer where negative):
    each row's attention adds `per_row_key` seconds per key, so n rows cost more relative to
    one at a longer context and less at a shorter one (never below the cost of fewer rows;
    fewer keys save at most half a step)."""
    extra = max(extra_keys * per_row_key, -0.5 * one_row_seconds)
    if extra == 0.0:
        return tuple(curve)
    one = one_row_seconds + extra
    out = [1.0]
    for n, c in enumerate(curve[1:], start=1):
        out.append(max(out[-1], (c * one_row_seconds + n * extra) / one))
    return tuple(out)


# Interleaved rounds of `measure_attention_seconds` (milliseconds each on a CPU).
ATTENTION_ROUNDS = 5

# Batched steps: rows measured (multiples of the width; interpolated in between) and rounds.
BATCH_COST_MULTIPLES = (1, 2, 3, 4, 6, 8)
BATCH_COST_ROUNDS = 5


@torch.no_grad()
def measure_batch_costs(engine: MeasuredEngine) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(rows, verify cost of that many rows in 1-row steps) for batched steps of 1 row and
    of the width times BATCH_COST_MULTIPLES rows, up to `engine.max_step_rows`: every row
    at the key limit `cost_context` (one sequence's rows or several, the same work), its KV
    written to the trash slot. Interleaved rounds, medians, never decreasing."""
    limit = cost_context(engine)
    sizes = sorted({1, *(engine.width * m for m in BATCH_COST_MULTIPLES if engine.width * m <= engine.max_step_rows)})
    h = engine.embed([0] * sizes[-1])
    position = min(limit, engine.position_limit - 1)
    medians = median_seconds(engine, {
        n: (lambda n=n: (h[:n], engine.make_meta([position] * n, [limit] * n, [engine.trash_slot] * n,
                                                bases=[0] * n))) for n in sizes},
        BATCH_COST_ROUNDS)
    seconds = [medians[n] for n in sizes]
    return tuple(sizes), tuple(relative_costs(seconds))


def batch_cost_curve(step_costs: Sequence[float], width: int, rows: Sequence[int], costs: Sequence[float],
                     most: int) -> tuple[float, ...]:
    """Cost of n = 0..most rows in 1-row steps (index 0 = 1 row): the step-cost curve up to
    the width, then the batched measurements scaled to meet it at the width, linear in
    between measured sizes (and past the last one)."""
    curve = list(step_costs[: width + 1])
    at_width = step_costs[width]
    scale = at_width / costs[rows.index(width)] if width in rows else 1.0
    points = [(n, c * scale) for n, c in zip(rows, costs) if n >= width]
    for n in range(width + 1, most + 1):
        hi = next((i for i, (m, _) in enumerate(points) if m >= n), len(points) - 1)
        lo = max(hi - 1, 0)
        (n0, c0), (n1, c1) = points[lo], points[hi]
        value = c1 if n1 == n0 else c0 + (c1 - c0) * (n - n0) / (n1 - n0)
        curve.append(max(value, curve[-1]))
    return tuple(curve)


# Other processes busy on the cores: a step this many times slower than its measured cost,
# SLOW_STEPS_IN_A_ROW times in a row, switches the C++ kernels from torch's OpenMP team to
# their own work-sharing pool for the rest of the process. On such a machine an OpenMP
# barrier waits for threads the OS has not scheduled (steps measured up to 30x slower on
# the 2-core Xeon), while the pool lets the running threads take the waiting ones' work
# (2.5-10x faster there); on idle cores the pool is 0-7% slower, so it is not the default.
CONTENDED_FACTOR = 3.0
SLOW_STEPS_IN_A_ROW = 3


class ContentionWatch:
    """Watches an engine's step times (`EngineCosts.observe_step`) for a machine whose cores
    other processes keep busy, and then turns on the kernels' work-sharing pool (once; the
    results are bit for bit the same either way)."""

    def __init__(self) -> None:
        self.slow_in_a_row = 0
        self.switched = False

    def observe(self, expected_seconds: float | None, seconds: float) -> bool:
        """Count a step of `seconds` against its measured `expected_seconds`; True when
        this step switched the kernels to the pool."""
        if self.switched or expected_seconds is None:
            return False
        self.slow_in_a_row = self.slow_in_a_row + 1 if seconds > CONTENDED_FACTOR * expected_seconds else 0
        if self.slow_in_a_row < SLOW_STEPS_IN_A_ROW:
            return False
        self.switched = True
        from hf_selfspec.kernels.cpu_rows import use_work_pool

        return use_work_pool(True) is False  # it was off: now on


class EngineCosts:
    """What a step of one engine costs, measured by explicit calls: `step_costs()`,
    `batch_costs()`, `attention_seconds()` and `one_row_seconds()` each measure (or read the
    disk cache, cache.py) at their first call and keep the figure for the engine's lifetime
    (the KV cache growing measures nothing again); `has_step_costs` / `has_batch_costs`
    say, without measuring, whether a figure is known. A caller that must not measure
    inside a timed loop calls them before it (integration.py does, as build time).

    `name` is what the figures are cached under (the layout's, marked where compact weights
    change what a step reads); `products` the layout choice's product seconds per row count
    (a big model's step costs are estimated from them), or None where they do not tell
    (compact weights, or weights accelerate streams in: those steps are timed); `timing`
    a context manager around steps that only time the engine (the hybrids' rows then go to
    scratch rings, never a sequence's: a measurement may come mid-request)."""

    def __init__(self, engine: MeasuredEngine, measured: MeasurementCache, name: str,
                 products: dict[int, float] | None, timing: Callable[[], AbstractContextManager]):
        self.engine = engine
        self.measured = measured
        self.name = name
        self.products = products
        self.timing = timing
        self.contention = ContentionWatch()
        self._step_costs: tuple[float, ...] | None = None
        self._batch_costs: tuple[float, ...] | None = None
        self._attention_seconds: float | None = None
        self._one_row_seconds: float | None = None

    @property
    def has_step_costs(self) -> bool:
        """Whether `step_costs` is known (measured or read from the disk cache): asking for
        it costs nothing."""
        return self._step_costs is not None

    @property
    def has_batch_costs(self) -> bool:
        """Whether `batch_costs` is known, so that asking for it costs nothing."""
        return self._batch_costs is not None

    def step_costs(self) -> tuple[float, ...]:
        """Verify cost of n rows (index n = 1..W; index 0 = 1 row) in units of a 1-row step:
        measured once per model, machine and software (measure_step_costs; on a model of
        gigabytes, estimated from the layout choice's product timings), cached on disk
        (cache.py; measured again when a step now is several times faster than the cached
        one, i.e. the cache was measured on a busy machine) and kept when the KV cache
        grows."""
        if self._step_costs is None:
            engine = self.engine
            context = cost_context(engine)
            found = self.measured.step_costs(self.name, context)
            with self.timing():
                if found is not None and measured_while_busy(engine, found[1]):
                    found = None  # measured on a busy machine: measure again and store
                if found is None:
                    # (the layout choice timed the float32 products, not compact ones, nor
                    # the transfer of weights accelerate streams in: those steps are timed)
                    estimated = None if self.products is None \
                        else step_costs_from_products(engine.width, self.products)
                    found = estimated or measure_step_costs(engine)
                    self.measured.store_step_costs(self.name, context, *found)
            self._step_costs, self._one_row_seconds = found
        return self._step_costs

    def one_row_seconds(self) -> float:
        """Measured seconds of a 1-row step over all layers (measured with step_costs)."""
        self.step_costs()
        return self._one_row_seconds

    def batch_costs(self) -> tuple[float, ...]:
        """Verify cost of n = 0..max_step_rows rows of a batched step (index 0 = 1 row), in
        1-row steps: `step_costs` up to the width, then batched steps measured at multiples
        of it (measure_batch_costs; cached on disk like step_costs). An engine without
        batched steps: `step_costs`."""
        engine = self.engine
        if not engine.supports_batches:
            return self.step_costs()
        if self._batch_costs is None:
            context = cost_context(engine)
            found = self.measured.batch_costs(self.name, context)
            if found is None or found[0][-1] != engine.max_step_rows:
                with self.timing():
                    found = measure_batch_costs(engine)
                self.measured.store_batch_costs(self.name, context, *found)
            self._batch_costs = batch_cost_curve(self.step_costs(), engine.width, *found, engine.max_step_rows)
        return self._batch_costs

    def attention_seconds(self) -> float:
        """Seconds of attention per row and key of a step, all layers (measured once per
        model and machine: measure_attention_seconds; cached on disk)."""
        if self._attention_seconds is None:
            context = cost_context(self.engine)
            found = self.measured.attention_seconds(self.name, context)
            if found is None:
                with self.timing():
                    found = measure_attention_seconds(self.engine)
                self.measured.store_attention_seconds(self.name, context, found)
            self._attention_seconds = found
        return self._attention_seconds

    def times_steps_cheaply(self) -> bool:
        """Whether a round of step timing is cheap on this model (under
        ESTIMATE_ABOVE_SECONDS; measures the step costs): then the attention per row and key
        is measured for any request (once; cached on disk), not only for long ones, and a
        short request plans with its rows' cheaper attention. On a model of gigabytes the
        first call does without it."""
        return self.one_row_seconds() * self.engine.width <= ESTIMATE_ABOVE_SECONDS

    def step_costs_at(self, context: int, batched: bool = False) -> tuple[float, ...]:
        """`step_costs` (or `batch_costs`) for rows that see about `context` keys: every row's
        attention grows with the keys, so more rows cost relatively more than the measured
        curve says beyond the context it was measured at, and less before it (where the
        attention cost is measured cheaply: `times_steps_cheaply`)."""
        curve = self.batch_costs() if batched else self.step_costs()
        extra = context - cost_context(self.engine)
        if extra == 0 or (extra < 0 and not self.times_steps_cheaply()):
            return curve
        return costs_at(curve, self.one_row_seconds(), self.attention_seconds(), extra)

    def observe_step(self, rows: int, seconds: float, context: int = 0) -> None:
        """A decode step of `rows` rows whose rows see about `context` keys took `seconds`:
        on the kernel layout, steps several times slower than measured, several in a row,
        turn on the kernels' work-sharing pool (ContentionWatch: other processes are busy
        on the cores). Measures nothing."""
        engine = self.engine
        if engine.layout.kernel_layer is None or self._step_costs is None:
            return
        curve = self._step_costs if rows <= engine.width else self._batch_costs
        expected = None
        extra_keys = max(0, context - cost_context(engine))
        if curve is not None and rows < len(curve) and (extra_keys == 0 or self._attention_seconds is not None):
            expected = curve[rows] * self._one_row_seconds + rows * extra_keys * (self._attention_seconds or 0.0)
        if self.contention.observe(expected, seconds):
            logger.warning(
                "hf_selfspec: decode steps ran over %.0fx slower than measured: other processes are busy on "
                "the cores, so the row kernels now share their work in their own thread pool "
                "(HF_SELFSPEC_ROWS_POOL=1 starts that way; the tokens are the same)", CONTENDED_FACTOR)
