"""Batched self-speculative decoding: the sequences of a batch share one engine step a cycle.

Each sequence has its own KV region in the engine's cache (engine/regions.py), its own
drafters (the lookup index of its own text), its own live acceptance and its own request
(max_new_tokens, EOS, stopping criteria, logits processors). A cycle:

  draft    every live sequence drafts its rows as it would alone (cycle.py `draft_cycle`)
  share    the step's budget (`share_rows`): rows of all sequences are weighed by their
           expected acceptance, and the step keeps, per sequence, the prefix of its rows
           that maximises expected committed tokens per unit of the measured cost of a
           batched step of that many rows (`engine.costs.batch_costs()`)
  verify   one engine step over every kept row, each attending to its own sequence's keys
  accept   per sequence (`finish_cycle`): walk, KV compaction in its region, commit

A finished sequence leaves the step. Every row is computed by row-invariant programs over
its own region, so each sequence's tokens are bitwise those it gets decoded alone (and,
greedy, the engine's AR output), whatever its neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.interface import BatchEngine
from ..engine.meta import StepRows
from ..engine.regions import plan_regions
from ..stats import DecodeStats
from .config import DecodeConfig
from .cycle import CommitFn, Cycle, DecodeResult, SelfSpecDecoder, SequenceRun, StopFn, TreeRequest
from .draft_model import DraftModelDrafter
from .drafters import ExitHeadsDrafter, TopHeadsDrafter
from .sampling import RowScorer
from .tree import DraftTree


def share_rows(trees: Sequence[DraftTree], costs: Sequence[float], most: int, adaptive: bool = True) -> list[int]:
    """Rows kept per tree (a prefix of each: parents precede children) for one step.

    Every tree keeps its root (its sequence's next token is committed whatever is drafted).
    Then rows are taken one at a time, always the next row of the tree whose next row is
    likeliest to be accepted (`DraftTree.value`), and the step keeps the count with the most
    expected committed tokens per unit of cost (`costs[n]`: n rows). At most `most` rows;
    with adaptive=False every row that fits is kept."""
    kept = [1] * len(trees)
    total = len(trees)
    if total > most:
        raise ValueError(f"{total} sequences do not fit a step of {most} rows")
    expected = float(total)
    best, best_value = list(kept), expected / costs[total]
    while total < most:
        b = max((i for i, t in enumerate(trees) if kept[i] < len(t)),
                key=lambda i: trees[i].value[kept[i]], default=None)
        if b is None:
            break
        expected += trees[b].value[kept[b]]
        kept[b] += 1
        total += 1
        value = expected / costs[total]
        if value > best_value + 1e-9 or not adaptive:
            best, best_value = list(kept), value
    return best


def batch_obstacle(engine: BatchEngine, decoder: SelfSpecDecoder) -> str | None:
    """Why this engine and drafter cannot decode a batch in shared steps (None: they can;
    otherwise the batch is decoded sequence after sequence, with the same output)."""
    if not engine.supports_batches:
        return f"the engine's {engine.layout.name!r} row layout on {engine.view.device.type} has no batched steps"
    if isinstance(decoder.drafter, ExitHeadsDrafter):
        return "exit heads climb layers row by row"
    if isinstance(decoder.drafter, DraftModelDrafter):
        return "a draft model drafts in its own engine"
    return None


@dataclass
class SequenceRequest:
    """One sequence of a batch: its prompt and what decides its end and its scores."""

    prompt: list[int]
    stop: StopFn | None = None
    on_commit: CommitFn | None = None
    scorer: RowScorer | None = None
    stats: DecodeStats | None = None
    max_new_tokens: int | None = None  # None: the batch's
    min_new_tokens: int | None = None


class BatchDecoder:
    """Decodes several sequences together in one engine (see module docstring)."""

    def __init__(self, engine: BatchEngine, heads=None, config: DecodeConfig | None = None):
        self.engine = engine
        self.heads = heads
        self.config = config or DecodeConfig()
        probe = SelfSpecDecoder(engine, heads, self.config)  # validates the config once
        reason = batch_obstacle(engine, probe)
        if reason is not None:
            raise ValueError(f"this batch cannot share engine steps: {reason}")

    @torch.no_grad()
    def generate(self, requests: Sequence[SequenceRequest], max_new_tokens: int,
                 eos_token_ids: Sequence[int] = (), min_new_tokens: int = 0, collect_logits: bool = False,
                 do_sample: bool = False) -> list[DecodeResult]:
        """Decode every request; result b is what `SelfSpecDecoder.generate` returns for
        request b alone (greedy: bitwise; sampling: the same distribution)."""
        engine = self.engine
        if not requests:
            return []
        for r in requests:
            if len(r.prompt) < 1:
                raise ValueError("a prompt of the batch is empty: pass at least one token per sequence")
        max_new = [max_new_tokens if r.max_new_tokens is None else r.max_new_tokens for r in requests]
        min_new = [min_new_tokens if r.min_new_tokens is None else r.min_new_tokens for r in requests]
        limit = getattr(engine.view.config, "max_position_embeddings", None)
        needs = [len(r.prompt) + max(m, 0) + engine.width for r, m in zip(requests, max_new)]
        if limit:
            needs = [min(n, limit) for n in needs]
        regions = plan_regions(engine, needs)
        context = sum(len(r.prompt) for r in requests) // len(requests)
        costs = (engine.costs.step_costs_at(context, batched=True) if self.config.adaptive
                 else (1.0,) * (engine.max_step_rows + 1))
        decoders = [SelfSpecDecoder(region, self.heads, self.config) for region in regions]
        runs = [d.begin(r.prompt, m, eos_token_ids, r.stop, r.on_commit, lo, collect_logits, r.stats, r.scorer,
                        do_sample) for d, r, m, lo in zip(decoders, requests, max_new, min_new)]
        # at most half a step of sequences per step, so that each can draft
        group = max(1, engine.max_step_rows // 2)
        while True:
            live = [b for b, run in enumerate(runs) if not run.done]
            if not live:
                break
            for lo in range(0, len(live), group):
                self._step(live[lo:lo + group], decoders, runs, costs)
        return [d.result(run) for d, run in zip(decoders, runs)]

    @staticmethod
    def _draft(live: list[int], decoders: list[SelfSpecDecoder], runs: list[SequenceRun]) -> list[Cycle]:
        """Every live sequence's cycle, as `draft_cycle` drafts it alone; top-layer heads
        drafting trees for several sequences run their head steps together (one read of
        the heads' weights per step: drafters.TopHeadsDrafter.propose_trees)."""
        t0 = time.perf_counter()
        cycles: dict[int, Cycle] = {}
        requests: dict[int, TreeRequest] = {}
        for b in live:
            decoder, run = decoders[b], runs[b]
            if run.tree and isinstance(decoder.drafter, TopHeadsDrafter):
                ctx, budget = decoder.cycle_context(run)
                requests[b] = decoder.tree_request(ctx, budget, run.policy, run.stats)
            else:
                cycles[b] = decoder.draft_cycle(run)
        asking = [b for b, r in requests.items() if r.heads_depth > 0]
        proposals = {}
        if asking:
            found = decoders[asking[0]].drafter.propose_trees(
                [(requests[b].ctx, requests[b].heads_depth) for b in asking])
            proposals = dict(zip(asking, found))
        for b, request in requests.items():
            run, proposal = runs[b], proposals.get(b)
            if proposal is not None:
                run.stats.head_evaluations += proposal.evaluations
            plan = decoders[b].tree_plan(request, proposal.candidates if proposal else [], run.policy, run.stats)
            cycles[b] = Cycle(request.ctx, plan, 0.0)
        seconds = (time.perf_counter() - t0) / len(live)  # drafting shared: each its part
        for cycle in cycles.values():
            cycle.draft_seconds = seconds
        return [cycles[b] for b in live]

    def _step(self, live: list[int], decoders: list[SelfSpecDecoder], runs: list[SequenceRun],
              costs: Sequence[float]) -> None:
        """One cycle of the `live` sequences: draft each, share the step, one engine step,
        finish each."""
        engine = self.engine
        cycles = self._draft(live, decoders, runs)
        kept = share_rows([c.plan.tree for c in cycles], costs, engine.max_step_rows, self.config.adaptive)
        for cycle, n in zip(cycles, kept):
            _truncate(cycle, n)
        inputs = [decoders[b].step_input(c) for b, c in zip(live, cycles)]
        hidden = torch.cat([h for h, _, _ in inputs])
        rows = StepRows.concat([r for _, _, r in inputs])
        t0 = time.perf_counter()
        logits, argmax, finals = engine.verify(
            hidden, 0, engine.rows_meta(rows), logits=any(decoders[b].needs_logits(runs[b]) for b in live))
        engine.costs.observe_step(len(rows), time.perf_counter() - t0, sum(runs[b].position for b in live) // len(live))
        seconds = (time.perf_counter() - t0) / len(live)
        lo = 0
        for b, cycle, n in zip(live, cycles, kept):
            decoders[b].finish_cycle(runs[b], cycle, None if logits is None else logits[lo:lo + n],
                                     argmax[lo:lo + n], finals[lo:lo + n], seconds)
            lo += n


def _truncate(cycle: Cycle, rows: int) -> None:
    """Keep the plan's first `rows` rows (and its drafters' branch rows among them)."""
    plan = cycle.plan
    if rows >= len(plan.tree):
        return
    plan.tree.truncate(rows)
    plan.branches = {k: [r for r in v if r < rows] for k, v in plan.branches.items()}
