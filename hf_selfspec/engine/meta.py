"""Per-step row metadata (`StepMeta`): what every attention backend and executor reads.

Its own module so that the programs (programs.py), the attention backends (attention.py)
and the CUDA-graph executor (runner.py) can all name it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_selfspec.kernels.cpu_rows import NO_PATH


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
    # committed prefix (ancestors then itself, -1 pads; see cpu_rows.cpp rows_attention);
    # [0, 0]: a chain
    path: torch.Tensor = NO_PATH
