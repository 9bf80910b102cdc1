"""What a step costs on this machine: the products of a row layout (to choose one) and
the verify cost of 1..W rows (what the draft budget plans with, decoding/policy.py).

Both are measured once per model, machine and software and cached on disk (cache.py), so a
later process, or a bigger KV cache, measures nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .attention import KEY_BLOCK
from .layouts import RowLayout

if TYPE_CHECKING:  # annotations only: programs.py imports this module
    from .programs import Engine

# Interleaved timing rounds per distinct step in `measure_step_costs` (median taken): on a
# 2-core machine a best-of-2 per width gave 4-row costs from 1.0x to 1.4x between runs.
STEP_COST_ROUNDS = 7
# Best-of rounds for a layout's products in `gemm_seconds`.
GEMM_REPS = 3


@torch.no_grad()
def gemm_seconds(layout: RowLayout, linears: Sequence[torch.nn.Linear], width: int,
                 reps: int = GEMM_REPS) -> float:
    """Best-of-`reps` seconds of every weight's product for an AR step, a 4-row step and a
    `width`-row step (what a decoder takes: AR where drafts do not pay, a few drafts, long
    copies)."""
    gen = torch.Generator(device="cpu").manual_seed(0)  # never the user's RNG (sampling seeds)
    total = 0.0
    for n in sorted({1, min(4, width), width}):
        rows = layout.rows(n)
        xs: dict[tuple, torch.Tensor] = {}
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for lin in linears:
                w = lin.weight
                key = (w.shape[1], w.dtype, w.device)
                if key not in xs:
                    xs[key] = torch.randn(rows, w.shape[1], generator=gen).to(w.device, w.dtype)
                layout.linear(xs[key], lin)
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def cost_context(engine: Engine) -> int:
    """The key limit the step costs are measured at: two key blocks (a typical chat), or
    what a small cache allows."""
    return min(engine.capacity - engine.width, 2 * KEY_BLOCK - 1)


@torch.no_grad()
def measure_step_costs(engine: Engine) -> tuple[tuple[float, ...], float]:
    """(verify cost of n rows for n = 0..W in units of a 1-row step (index 0 = 1 row),
    seconds of a 1-row step over all layers).

    Steps that run the same programs (same product rows and attention chunks) are timed
    once, as the widest of them; the distinct steps are timed in interleaved rounds and each
    takes its median, so a burst of machine noise cannot make one width look cheap or dear.
    The timing writes KV in the last W slots of the cache, which any later use overwrites
    before reading; more rows never cost less (timing noise is flattened out)."""
    layout = engine.layout
    key = {n: (layout.rows(n), layout.attention_chunks(n)) for n in range(1, engine.width + 1)}
    widest = {k: max(n for n in key if key[n] == k) for k in set(key.values())}
    base = engine.position_limit - engine.width
    limit = cost_context(engine)
    samples: dict[tuple, list[float]] = {k: [] for k in widest}
    h = engine.embed([0] * engine.width)
    for rounds in range(1 + STEP_COST_ROUNDS):  # round 0: warm-up
        for k, n in widest.items():
            meta = engine.make_meta(range(base, base + n), [limit] * n)  # one shared buffer
            t0 = time.perf_counter()
            engine.verify(h[:n], 0, meta)
            if rounds > 0:
                samples[k].append(time.perf_counter() - t0)
    seconds = [statistics.median(samples[key[n]]) for n in range(1, engine.width + 1)]
    costs = [s / seconds[0] for s in seconds]
    for i in range(1, len(costs)):
        costs[i] = max(costs[i], costs[i - 1])
    return tuple([1.0] + costs), seconds[0]


# A cached 1-row step time this many times what a step takes now means the cache was
# measured while the machine was busy (other processes contending for the cores can make
# a step many times slower): its cost curve would plan drafts wrongly for good.
STALE_FACTOR = 3.0
# Below this a step is too short to time reliably against the cache: trusted as cached.
CHECK_ABOVE_SECONDS = 0.005


def measured_while_busy(engine: Engine, cached_one_row: float, reps: int = 3) -> bool:
    """Whether a cached measurement should be taken again: a 1-row step now (median of
    `reps`, after one warm-up) is over STALE_FACTOR times faster than the cached one."""
    if cached_one_row < CHECK_ABOVE_SECONDS:
        return False
    base = engine.position_limit - engine.width
    meta = engine.make_meta([base], [cost_context(engine)])
    h = engine.embed([0])
    times = []
    for rep in range(1 + reps):
        t0 = time.perf_counter()
        engine.verify(h, 0, meta)
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * STALE_FACTOR < cached_one_row
