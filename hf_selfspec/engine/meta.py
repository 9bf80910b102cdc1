"""Per-step row metadata (`StepMeta`): what every attention backend and executor reads.

Its own module so that the engine (core.py, metadata.py), the attention backends (attention.py)
and the CUDA-graph executor (cuda_graphs.py) can all name it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from hf_selfspec.kernels.cpu_rows import NO_BASE, NO_PATH


@dataclass
class StepMeta:
    """Per-step row metadata. positions/slots/key_limit are device tensors [W] (views of
    one buffer); `rows` is how many rows the products of this step compute."""

    positions: torch.Tensor  # RoPE position of each row
    slots: torch.Tensor  # KV slot each row writes (pad rows: the trash slot)
    key_limit: torch.Tensor  # last slot each row may attend to
    num_real: int
    rows: int
    biases: list[torch.Tensor]  # per attention chunk: [G*A, nb*KEY_BLOCK] additive masks
    cos: torch.Tensor  # [rows, d]
    sin: torch.Tensor
    # draft trees (C++ row attention only): [n, P] int64, row r's path slots after the
    # committed prefix (ancestors then itself, -1 pads; see kernels/cpu-rows/attention.cpp);
    # [0, 0]: a chain
    path: torch.Tensor = NO_PATH
    # batched steps (C++ row attention only): [n] int64, the slot of each row's logical key 0
    # (its sequence's KV region); [0]: every row's keys start at slot 0
    base: torch.Tensor = NO_BASE
    # models with a RoPE per layer type (Gemma 3: its sliding layers' own base): the other
    # tables' cos/sin at the rows' positions, LayeredModel.rope_tables[1:] in order
    extra_cos: tuple[torch.Tensor, ...] = ()
    extra_sin: tuple[torch.Tensor, ...] = ()
    # the block attention's masks per sliding window of the model's layers (window -> masks
    # per chunk, as `biases`); empty where no layer slides or the backend reads limits itself
    window_biases: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # the hybrids' convolution layers (mixers.MixerCache.step_rows): the ring row
    # each row writes [rows], and its 1st .. (K-1)th predecessors' [rows, K - 1]; None for a
    # model without them
    conv_rows: torch.Tensor | None = None
    conv_sources: torch.Tensor | None = None
    # their DeltaNet and Mamba layers: per real row (its ring row, its parent's or -1 before
    # position 0), host ints
    recurrent_rows: tuple[tuple[int, int], ...] | None = None
    # the same as an int64 CPU tensor [real rows, 2] (the C++ state updates read it)
    recurrent_index: torch.Tensor | None = None
    # rows of a prompt (the engine's own prefill): Mamba2 bounds their time steps by the
    # model's time_step_limit there, as HF's chunked prefill does (its decode steps do not)
    prompt: bool = False
    # this step's metadata on the other devices of a model over several (`on`), by device
    copies: dict = field(default_factory=dict, repr=False, compare=False)

    def on(self, device: torch.device) -> StepMeta:
        """This step's metadata for layers executing on `device`: the device tensors copied
        there once per step (a model accelerate spreads over several devices); the host
        tensors (paths, bases, recurrent rows) as they are."""
        if device == self.positions.device:
            return self
        found = self.copies.get(device)
        if found is None:
            def to(t):
                return None if t is None else t.to(device, non_blocking=True)

            found = replace(
                self, positions=to(self.positions), slots=to(self.slots), key_limit=to(self.key_limit),
                biases=[to(b) for b in self.biases], cos=to(self.cos), sin=to(self.sin),
                extra_cos=tuple(map(to, self.extra_cos)), extra_sin=tuple(map(to, self.extra_sin)),
                window_biases={w: [to(b) for b in bs] for w, bs in self.window_biases.items()},
                conv_rows=to(self.conv_rows), conv_sources=to(self.conv_sources), copies={})
            self.copies[device] = found
        return found


@dataclass
class StepRows:
    """The rows of one step on the host, before `Engine.rows_meta` makes their `StepMeta`:
    RoPE positions and key limits are logical (the sequence's own), KV slots and path slots
    absolute; `bases` (None: all 0) gives each row's first slot, its sequence's KV region.
    `concat` lays the rows of several sequences side by side in one step (a batch)."""

    positions: list[int]
    slots: list[int]
    limits: list[int]
    paths: list[list[int]] | None = None
    bases: list[int] | None = None

    def __len__(self) -> int:
        return len(self.positions)

    @staticmethod
    def concat(parts: Sequence[StepRows]) -> StepRows:
        trees = any(p.paths is not None for p in parts)
        regions = any(p.bases is not None for p in parts)
        rows = StepRows([], [], [], [] if trees else None, [] if regions else None)
        for p in parts:
            rows.positions += p.positions
            rows.slots += p.slots
            rows.limits += p.limits
            if trees:  # a chain's row r sees its prefix only: an empty path
                rows.paths += p.paths if p.paths is not None else [[] for _ in p.positions]
            if regions:
                rows.bases += p.bases if p.bases is not None else [0] * len(p)
        return rows
