"""The engine's configuration (`EngineConfig`) and the sizes it defaults to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .layouts import LAYOUTS

__all__ = ["BATCH_ROWS_PER_WIDTH", "DEFAULT_CAPACITY", "DEFAULT_WIDTH", "ROW_LAYOUTS", "SHRINK_RATIO",
           "STREAMED_WIDTH", "EngineConfig"]

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
    # "cuda_graphs": the programs are captured once per key and replayed (cuda_graphs.py; CUDA
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

