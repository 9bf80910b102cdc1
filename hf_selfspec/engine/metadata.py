"""A step's rows and metadata: what the engine's steps can take (trees, batches, how many
rows) and `make_meta`, which writes a step's positions, KV slots and key limits into one
device buffer with one copy (`meta_buffer`: the CUDA-graph executor reads it inside its
graphs) and builds the `StepMeta` (meta.py) the layers read. `StepMetadata` is a part of
`Engine` (core.py) with this one job."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_selfspec.kernels.cpu_rows import NO_BASE, NO_PATH

from .attention import KEY_BLOCK, visible_bias
from .config import BATCH_ROWS_PER_WIDTH
from .meta import StepMeta, StepRows

__all__ = ["StepMetadata"]


class StepMetadata:
    """What steps an `Engine` takes, and their metadata."""

    @property
    def meta_buffer(self) -> torch.Tensor:
        """The device buffer [3, rows] of the last step's metadata that `make_meta` writes
        with one copy: row 0 the positions, row 1 the KV slots, row 2 the key limits (pad
        rows: row 0's position and limit, the trash slot). A CUDA graph reads its step's
        metadata from here (cuda_graphs.py), so one capture serves every position. The
        tensor is replaced only by a batched step wider than any before (CPU only)."""
        return self._meta

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

