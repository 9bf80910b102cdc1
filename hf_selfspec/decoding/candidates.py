"""The drafter protocol: what every drafter proposes and what it is told back.

In the spirit of transformers' `CandidateGenerator` (`get_candidates`,
`update_candidate_strategy`): a drafter proposes candidate rows for a budget and hears
which tokens were committed. A proposal is a tree of candidates (a chain is a tree with
one path), each with its source and, where the drafter has one, its probability; which
rows are verified is decided elsewhere (policy.py), from the proposals, the drafters' live
acceptance and the engine's measured step costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, Sequence

import torch


class Source(str, Enum):
    """Where a committed token came from (its label in `DecodeStats.sources`)."""

    MODEL = "model"  # the model's own token: a correction or the bonus after the drafts
    HEAD = "head"  # a draft head (labelled head0, head1, ... by head / chain step)
    COPY = "copy"  # a prompt-lookup copy
    DRAFT_MODEL = "draft_model"  # a smaller draft model


def source_label(source: Source, step: int = 0) -> str:
    """The stats label of a token: "head{step}" for head drafts, else the source's name."""
    return f"head{step}" if source is Source.HEAD else source.value


@dataclass(frozen=True)
class Candidate:
    """One proposed row. `parent` is the index of the parent candidate in the same proposal
    (-1: the last committed token); parents come before their children."""

    parent: int
    token: int
    source: Source
    step: int = 0  # depth - 1 (for heads: which head / chain step drafted it)
    prob: float = 1.0  # the drafter's own probability that the whole path is the model's
    on_chain: bool = True  # on the drafter's first (top-1) chain
    q: torch.Tensor | None = None  # sampling: the distribution [V] the draft was drawn from


@dataclass
class Proposal:
    """A drafter's candidates for one cycle.

    `rows` (exit heads only): the cycle's rows with their hidden states partly computed
    (the climb through the heads' layers), reused by the verification instead of starting
    again from the embeddings."""

    drafter: str  # the drafter's key in the draft budget (its live acceptance)
    candidates: list[Candidate] = field(default_factory=list)
    evaluations: int = 0  # head evaluations spent on it (DecodeStats.head_evaluations)
    rows: object | None = None  # drafters.PartialRows

    def chain(self) -> list[Candidate]:
        """The candidates on the first chain, in order."""
        return [c for c in self.candidates if c.on_chain]


@dataclass
class DraftContext:
    """What a drafter may read in a cycle."""

    committed: list[int]  # new tokens so far; the last one is the root of this cycle's rows
    final_before: torch.Tensor  # [H] final hidden state of the row that produced committed[-1]
    position: int  # position of the root row
    eos: frozenset[int]
    tree: bool = False  # a tree may be proposed (else a chain)
    scorer: object | None = None  # sampling.RowScorer when sampling: drafts are sampled
    room: int = 1 << 30  # KV slots left from `position` on: at most this many rows this cycle


class Drafter(Protocol):
    """One drafter: `start` once per request, then each cycle `propose` (at most `budget`
    drafts deep) and `accepted` (the tokens committed this cycle, whoever drafted them)."""

    key: str

    def start(self, prompt: Sequence[int]) -> None: ...

    def propose(self, ctx: DraftContext, budget: int) -> Proposal: ...

    def accepted(self, tokens: Sequence[int]) -> None: ...
