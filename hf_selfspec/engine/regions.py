"""KV regions: several sequences in one engine, each in its own slots of the KV cache.

A batch decodes in one engine: sequence b owns slots [base_b, base_b + capacity_b) of the
cache (its prompt, its committed tokens and its draft rows), and a step may hold the rows of
every live sequence (`StepRows.concat`). The C++ row attention reads a row's keys from its
region's first slot with the arithmetic of a sequence at slot 0, and every other operation
is per row, so a sequence's rows are bit-identical to those it computes decoded alone.

`KVRegion` gives one sequence's decoder (decoding/cycle.py) the engine surface it uses,
in the sequence's own slot numbers: prefill, step rows, KV moves and its capacity. The
engine's own surface (base 0, the whole cache) is the same, so a decoder runs unchanged on
either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .meta import StepRows

if TYPE_CHECKING:  # annotations only: programs.py never imports this module
    from .programs import Engine


class KVRegion:
    """Slots [base, base + capacity) of `engine`'s KV cache, for one sequence."""

    def __init__(self, engine: Engine, base: int, capacity: int):
        if not engine.supports_batches:
            raise ValueError("KV regions need an engine whose steps take several sequences "
                             "(engine.supports_batches: the kernel row layout on the CPU)")
        if base < 0 or capacity < 1 or base + capacity > engine.trash_slot:
            raise ValueError(f"region [{base}, {base + capacity}) is outside the engine's "
                             f"{engine.trash_slot} usable slots")
        self.engine = engine
        self.base = base
        self.capacity = capacity

    # what a decoder reads from its engine, unchanged
    @property
    def width(self) -> int:
        return self.engine.width

    @property
    def view(self):
        return self.engine.view

    @property
    def layout(self):
        return self.engine.layout

    @property
    def supports_trees(self) -> bool:
        return self.engine.supports_trees

    @property
    def step_costs(self) -> tuple[float, ...]:
        return self.engine.step_costs

    @property
    def one_row_seconds(self) -> float:
        return self.engine.one_row_seconds

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.engine.embed(token_ids)

    def verify(self, h: torch.Tensor, start: int, meta, logits: bool = True):
        return self.engine.verify(h, start, meta, logits)

    def rows_meta(self, rows: StepRows):
        return self.engine.rows_meta(rows)

    def observe_step(self, rows: int, seconds: float, context: int = 0) -> None:
        self.engine.observe_step(rows, seconds, context)

    def step_costs_at(self, context: int, batched: bool = False) -> tuple[float, ...]:
        return self.engine.step_costs_at(context, batched)

    # in the region's own slot numbers
    @property
    def position_limit(self) -> int:
        return self.capacity

    def check_capacity(self, prompt_len: int, max_new_tokens: int, draft_rows: int | None = None) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt is empty: pass at least one input token")
        rows = self.width if draft_rows is None else draft_rows
        if prompt_len + max_new_tokens + rows > self.capacity:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + draft rows "
                             f"({rows}) exceeds this sequence's KV region ({self.capacity} slots)")

    def prefill(self, prompt_ids: Sequence[int]):
        return self.engine.prefill(prompt_ids, base=self.base)

    def step_rows(self, positions: Sequence[int], slots: Sequence[int] | None = None,
                  paths: Sequence[Sequence[int]] | None = None) -> StepRows:
        """The region's rows as the engine's: slots and path slots moved by `base`, RoPE
        positions and key limits the sequence's own."""
        rows = self.engine.step_rows(positions, slots, paths)
        b = self.base
        rows.slots = [b + s for s in rows.slots]
        if rows.paths is not None:
            rows.paths = [[b + s for s in p] for p in rows.paths]
        rows.bases = [b] * len(rows)
        return rows

    def move_kv(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        b = self.base
        self.engine.move_kv([b + s for s in sources], [b + t for t in targets])


def plan_regions(engine: Engine, needs: Sequence[int]) -> list[KVRegion]:
    """One region per sequence, `needs[b]` slots each, packed from slot 0; the engine's
    cache grows to hold them all (nothing in it is kept: call before any prefill)."""
    most = getattr(engine.view.config, "max_position_embeddings", None)
    if most and max(needs) > most:
        raise ValueError(f"a sequence's KV region ({max(needs)} slots) is longer than the model's "
                         f"max_position_embeddings ({most})")
    engine.ensure_capacity(sum(needs), keep=0)
    regions, base = [], 0
    for need in needs:
        regions.append(KVRegion(engine, base, need))
        base += need
    return regions
