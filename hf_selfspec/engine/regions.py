"""KV regions: several sequences in one engine, each in its own slots of the KV cache.

A batch decodes in one engine: sequence b owns slots [base_b, base_b + capacity_b) of the
cache (its prompt, its committed tokens and its draft rows), and a step may hold the rows of
every live sequence (`StepRows.concat`). The C++ row attention reads a row's keys from its
region's first slot with the arithmetic of a sequence at slot 0, and every other operation
is per row, so a sequence's rows are bit-identical to those it computes decoded alone.

`KVRegion` gives one sequence's decoder (decoding/cycle.py) the engine surface it uses,
`interface.SequenceEngine`, in the sequence's own slot numbers: prefill, step rows, KV
moves and its capacity. The engine implements the same protocol (base 0, the whole cache),
so a decoder runs unchanged on either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .interface import BatchEngine, SequenceEngine, StepCosts
from .meta import StepMeta, StepRows


class KVRegion(SequenceEngine):
    """Slots [base, base + capacity) of `engine`'s KV cache, for one sequence: implements
    `SequenceEngine` (interface.py) explicitly, every member its own (tests/test_engine.py
    checks that none is left to the protocol)."""

    def __init__(self, engine: BatchEngine, base: int, capacity: int):
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
    def head_device(self) -> torch.device:
        return self.engine.head_device

    @property
    def supports_trees(self) -> bool:
        return self.engine.supports_trees

    @property
    def costs(self) -> StepCosts:
        return self.engine.costs

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.engine.embed(token_ids)

    def verify(self, h: torch.Tensor, start: int, meta: StepMeta, logits: bool = True):
        return self.engine.verify(h, start, meta, logits)

    def rows_meta(self, rows: StepRows) -> StepMeta:
        return self.engine.rows_meta(rows)

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


def plan_regions(engine: BatchEngine, needs: Sequence[int]) -> list[KVRegion]:
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
