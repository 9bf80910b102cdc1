"""The engine's interface: what each of its users needs from it, named.

`Engine` (core.py) implements every protocol here; its users annotate against these, never
against `Engine`, and import nothing from core.py, so no module of the package imports the
engine's module back (not even for annotations):

  SequenceEngine  one sequence's decoder (decoding/cycle.py): prefill, step rows and their
                  metadata, verify, KV moves, capacity, the step costs (`costs`). A KV
                  region of a batch's engine (regions.KVRegion) implements it too, in the
                  sequence's own slot numbers.
  BatchEngine     a batch's decoder (decoding/batch.py): a SequenceEngine whose steps take
                  several sequences' rows, and whose cache `plan_regions` sizes.
  StepPrograms    drafters that run layers or whole steps of an engine (decoding/drafters.py,
                  decoding/draft_model.py): metadata, seg, verify, embed, prefill.
  StepCosts       what a step costs (costs.EngineCosts): measured by explicit calls.
  AttentionHost   what an attention backend binds to (attention.py): the KV cache and the
                  model's attention geometry.
  MeasuredEngine  what the cost model times (costs.py): an AttentionHost with StepPrograms.
  GraphHost       what the CUDA-graph executor captures and replays (cuda_graphs.py).
  MixerHost       what the hybrids' mixers read (mixers.py).

The protocols are structural (typing.Protocol): a class implements one by having its
members; `runtime_checkable` ones can be checked with isinstance (members present, not
their signatures).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # annotations only (none of these imports this module)
    from .layered import LayeredModel
    from .layouts import RowLayout
    from .meta import StepMeta, StepRows

__all__ = ["AttentionHost", "BatchEngine", "GraphHost", "MeasuredEngine", "MixerHost", "SequenceEngine",
           "StepCosts", "StepPrograms"]

# (logits [n, V] or None, argmax [n], final hidden after the final norm [n, H])
VerifyOutput = tuple[Any, torch.Tensor, torch.Tensor]


@runtime_checkable
class StepCosts(Protocol):
    """What a step costs, in 1-row steps (costs.EngineCosts). Each figure is measured (or
    read from the disk cache) at its first call, never as a side effect of reading an
    attribute: a caller that wants the measurement outside a timed loop calls it first."""

    def step_costs(self) -> tuple[float, ...]:
        """Verify cost of n = 0..W rows (index 0 = 1 row)."""
        ...

    def one_row_seconds(self) -> float:
        """Seconds of a 1-row step over all layers."""
        ...

    def step_costs_at(self, context: int, batched: bool = False) -> tuple[float, ...]:
        """`step_costs` (or a batched step's curve) for rows that see about `context` keys."""
        ...

    def observe_step(self, rows: int, seconds: float, context: int = 0) -> None:
        """A decode step of `rows` rows took `seconds` (watched for busy cores)."""
        ...


@runtime_checkable
class SequenceEngine(Protocol):
    """What one sequence's speculative decoder uses (decoding/cycle.py SelfSpecDecoder):
    implemented by `Engine` (slots from 0) and by `regions.KVRegion` (a batch's region)."""

    @property
    def width(self) -> int:
        """Most rows a step of this sequence takes."""
        ...

    @property
    def view(self) -> LayeredModel:
        """The model's layers as the engine reads them (layered.LayeredModel)."""
        ...

    @property
    def layout(self) -> RowLayout:
        """The engine's row layout (layouts.py)."""
        ...

    @property
    def head_device(self) -> torch.device:
        """Where the LM head's outputs (logits, argmax) are."""
        ...

    @property
    def supports_trees(self) -> bool:
        """Whether a step's rows may form a draft tree."""
        ...

    @property
    def position_limit(self) -> int:
        """Positions the sequence may reach."""
        ...

    @property
    def costs(self) -> StepCosts:
        """What a step costs (shared by every sequence of an engine)."""
        ...

    def check_capacity(self, prompt_len: int, max_new_tokens: int, draft_rows: int | None = None) -> None:
        """Raise before any work where prompt + max_new + draft rows do not fit."""
        ...

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's KV into the cache -> (logits [V], final hidden [H]) of its last row."""
        ...

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Token ids -> hidden [n, H]."""
        ...

    def step_rows(self, positions: Sequence[int], slots: Sequence[int] | None = None,
                  paths: Sequence[Sequence[int]] | None = None) -> StepRows:
        """The host rows of a step of this sequence (chain, or a tree's slots and paths)."""
        ...

    def rows_meta(self, rows: StepRows) -> StepMeta:
        """The step metadata of host rows (this sequence's, or several concatenated)."""
        ...

    def verify(self, h: torch.Tensor, start: int, meta: StepMeta, logits: bool = True) -> VerifyOutput:
        """Rows from layer `start` to the end -> (logits or None, argmax, final hidden)."""
        ...

    def move_kv(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy the KV (and mixer states) of slots `sources` to `targets`, in order."""
        ...


@runtime_checkable
class BatchEngine(SequenceEngine, Protocol):
    """What a batch's decoder uses (decoding/batch.py, regions.plan_regions): steps that
    hold several sequences' rows, each sequence in its own KV region."""

    @property
    def supports_batches(self) -> bool:
        """Whether one step may hold several sequences' rows."""
        ...

    @property
    def max_step_rows(self) -> int:
        """Most rows one (batched) step takes."""
        ...

    @property
    def trash_slot(self) -> int:
        """The slot pad rows write (after every usable slot)."""
        ...

    def ensure_capacity(self, need: int, *, keep: int | None = None, release: bool = False) -> None:
        """Room for `need` KV slots (grown or shrunk by copying)."""
        ...


@runtime_checkable
class StepPrograms(Protocol):
    """An engine's step programs, for drafters that run its layers themselves
    (decoding/drafters.py, decoding/draft_model.py) and for the CUDA-graph executor."""

    @property
    def width(self) -> int:
        ...

    @property
    def view(self) -> LayeredModel:
        ...

    @property
    def costs(self) -> StepCosts:
        ...

    def check_capacity(self, prompt_len: int, max_new_tokens: int, draft_rows: int | None = None) -> None:
        ...

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def make_meta(self, positions: Sequence[int], key_limits: Sequence[int] | None = None,
                  slots: Sequence[int] | None = None, paths: Sequence[Sequence[int]] | None = None,
                  bases: Sequence[int] | None = None) -> StepMeta:
        """Write a step's metadata (positions, KV slots, key limits) and return its StepMeta."""
        ...

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        ...

    def seg(self, h: torch.Tensor, start: int, end: int, meta: StepMeta) -> torch.Tensor:
        """The step's rows from layer `start` to `end`."""
        ...

    def verify(self, h: torch.Tensor, start: int, meta: StepMeta, logits: bool = True) -> VerifyOutput:
        ...

    def ar_step(self, token: int, position: int, logits: bool = True) -> tuple[Any, int, torch.Tensor]:
        """One real row through all layers -> (logits [V] or None, next token, final hidden [H])."""
        ...


class AttentionHost(Protocol):
    """What an attention backend's `bind(engine, meta)` reads (attention.py)."""

    view: LayeredModel
    layout: RowLayout
    attention: Any  # the backend itself (attention.select_attention)
    k_cache: Any  # [layers, Hkv, slots, d] (or devices.GroupedCache across devices)
    v_cache: Any
    num_slots: int  # the cache's slots, the trash slot and block padding included
    trash_slot: int
    group: int  # query heads per KV head


class MeasuredEngine(AttentionHost, Protocol):
    """What the cost model times (costs.py): steps and the attention alone."""

    width: int
    capacity: int

    @property
    def position_limit(self) -> int:
        ...

    @property
    def supports_batches(self) -> bool:
        ...

    @property
    def max_step_rows(self) -> int:
        ...

    def make_meta(self, positions: Sequence[int], key_limits: Sequence[int] | None = None,
                  slots: Sequence[int] | None = None, paths: Sequence[Sequence[int]] | None = None,
                  bases: Sequence[int] | None = None) -> StepMeta:
        ...

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        ...

    def verify(self, h: torch.Tensor, start: int, meta: StepMeta, logits: bool = True) -> VerifyOutput:
        ...


class GraphHost(AttentionHost, StepPrograms, Protocol):
    """What the CUDA-graph executor captures and replays (cuda_graphs.py): the step programs
    (its graph bodies call the class's own `seg` and `verify`), the model's geometry, and the
    device buffer each step's metadata is written to."""

    @property
    def meta_buffer(self) -> torch.Tensor:
        """[3, rows] on the device: positions, KV slots, key limits of the last step."""
        ...


class MixerHost(Protocol):
    """What the hybrids' token mixers read (mixers.py): the model, the layout's products,
    the width, and the mixers' own cache of convolution inputs and recurrent states."""

    width: int
    view: LayeredModel
    layout: RowLayout
    mixer_cache: Any  # mixers.MixerCache (None on a model without mixers)
