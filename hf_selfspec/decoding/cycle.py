"""Self-speculative decoding: one loop of draft -> verify -> accept -> commit.

Each cycle works on rows under the last committed token (row 0, whose KV is not in the
cache yet):

  draft    The drafters (candidates.py: top-layer heads, exit heads, a draft model, prompt
           lookup) propose candidates; the policy (policy.py) decides from their live
           acceptance and the engine's measured step costs which rows pay. The rows form a
           `DraftTree`; a chain is a tree with one path.
  verify   One engine step computes every row (exit heads' rows continue from the layers
           their climb already computed) and gives the model's scores after each row.
  accept   Greedy: walk the tree while a child holds the model's token (for a chain, the
           longest prefix of drafts equal to the model's tokens) and move the accepted
           rows' KV to consecutive slots. Sampling: speculative sampling (sampling.py).
           Then the model's own token at the first mismatch, or the bonus after the last.
  commit   Tokens are appended one by one, stopping exactly where AR decoding would; the
           drafters and the policy hear what was accepted.

Every row of the main model is computed with row-invariant programs, so the committed
tokens are exactly the engine's AR output (`Engine.generate_ar`), whatever is drafted;
with `do_sample=True` each token is distributed exactly as the model's processed
distribution. A `RowScorer` applies HF logits processors to every row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..engine.interface import SequenceEngine, StepPrograms
from ..engine.meta import StepRows
from ..heads.kinds import kind_of, make_drafter
from ..stats import DecodeStats
from .candidates import Candidate, DraftContext, Proposal, Source
from .config import DecodeConfig
from .draft_model import DraftModelDrafter
from .drafters import (
    COPY_KEY,
    HEADS_KEY,
    ExitHeadsDrafter,
    LookupDrafter,
    PartialRows,
)
from .policy import DraftBudget, select_tree_rows
from .sampling import RowScorer, sample, speculative_tokens
from .tree import DraftTree

MODEL_LABEL = Source.MODEL.value


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens only
    stats: DecodeStats
    logits: list[torch.Tensor] | None = None  # [V] raw logits behind each new token
    scores: list[torch.Tensor] | None = None  # [V] the same after min_new_tokens masking / processors


@dataclass
class DraftPlan:
    """The rows one cycle verifies: `tree` (a chain or a trie), each drafter's first-chain
    rows among them (`branches`, for its live acceptance), and for exit heads the rows'
    partly computed hidden states."""

    tree: DraftTree
    branches: dict[str, list[int]]
    rows: PartialRows | None = None


@dataclass
class Verified:
    """The model's view of a plan's rows: its token after each row ([n] host ints), raw
    logits [n, V], scores [n, V] (after min_new_tokens masking or logits processors) and
    the final hidden states [n, H]."""

    tokens: list[int]
    logits: torch.Tensor
    scores: torch.Tensor
    finals: torch.Tensor


StopFn = Callable[[list[int]], bool]  # new tokens so far -> stop after the last one?
CommitFn = Callable[[list[int]], None]  # receives each chunk of committed tokens


@dataclass
class SequenceRun:
    """One sequence's request and decoding state between cycles."""

    max_new_tokens: int
    eos: frozenset[int]
    stop: StopFn | None
    on_commit: CommitFn | None
    min_new_tokens: int
    scorer: RowScorer | None
    do_sample: bool
    stats: DecodeStats
    t_start: float
    out: list[int] = field(default_factory=list)  # new tokens so far
    position: int = 0  # the last committed token's position (its KV is not in the cache yet)
    final_before: torch.Tensor | None = None  # final hidden state of the row that produced it
    policy: DraftBudget | None = None
    tree: bool = False  # this request's cycles draft trees
    done: bool = False
    kept_logits: list[torch.Tensor] | None = None  # collect_logits: one per new token
    kept_scores: list[torch.Tensor] | None = None


@dataclass
class TreeRequest:
    """A tree cycle between its two halves (`tree_request`, `tree_plan`): what the heads
    are asked for goes between them (alone, or batched with other sequences')."""

    ctx: DraftContext
    width: int
    copies: list[Candidate]
    copy_budget: int
    heads_depth: int  # 0: the heads are not evaluated this cycle


@dataclass
class Cycle:
    """One cycle's drafting: its context, the rows to verify and the seconds it took."""

    ctx: DraftContext
    plan: DraftPlan
    draft_seconds: float


class SelfSpecDecoder:
    """Speculative decoding over an `Engine`. Drafters: the `heads` (top-layer draft heads
    or exit heads; None for prompt lookup only / plain AR), or a smaller draft model in its
    own engine (`draft_engine`, which then replaces the heads), and/or prompt lookup."""

    def __init__(self, engine: SequenceEngine, heads=None, config: DecodeConfig | None = None,
                 draft_engine: StepPrograms | None = None):
        self.engine = engine
        self.config = config or DecodeConfig()
        width = engine.width
        self.max_draft = width - 1 if self.config.max_draft is None else self.config.max_draft
        if self.max_draft > width - 1:
            raise ValueError(f"max_draft={self.max_draft} does not fit the engine width {width} "
                             f"(max {width - 1})")
        if draft_engine is not None and draft_engine.view.vocab_size != engine.view.vocab_size:
            raise ValueError(f"the draft model has {draft_engine.view.vocab_size} output tokens, the "
                             f"model {engine.view.vocab_size}: it must use the same tokenizer")
        self.draft_engine = draft_engine
        # an explicit draft model always drafts (with lookup "only", where no copy is found);
        # lookup "only" is exact PLD: the heads are not consulted
        self.heads = None if draft_engine is not None else heads
        use_heads = self.heads is not None and self.config.lookup != "only"
        # the heads' kind (heads/kinds.py) says how many thresholds they take and builds their drafter
        self.num_sources = kind_of(self.heads).sources(self.heads.config) if use_heads else 0
        self.thresholds = self._resolve_thresholds()
        self.drafter = None  # the drafter besides prompt lookup
        if draft_engine is not None:
            self.drafter = DraftModelDrafter(draft_engine, self.config.draft_confidence)
        elif use_heads:
            self.drafter = make_drafter(engine, self.heads, self.thresholds, self.config)
        self.lookup = None
        if self.config.lookup != "off":
            self.lookup = LookupDrafter(self.config.lookup_max_ngram, self.config.lookup_min_ngram,
                                        max(self.max_draft, 1))
        self.tree_reason = self._tree_obstacle()
        if self.config.tree == "on" and self.tree_reason is not None:
            raise ValueError(f"tree='on' cannot be used here: {self.tree_reason}; use tree='auto' or 'off'")
        self.use_tree = self.config.tree != "off" and self.tree_reason is None
        # set to a list to record the loop's events, what a replay of these decodes needs
        # (scripts/record_traces.py): ("prompt", prompt length), ("draft", drafter key,
        # budget), ("verify", position, parent of each row, committed rows, committed
        # tokens). None (the default) records nothing: one attribute test per event
        self.trace: list | None = None

    def _tree_obstacle(self) -> str | None:
        """Why draft trees cannot be used with this engine and drafter (None: they can)."""
        if not self.engine.supports_trees:
            return f"the engine's {self.engine.layout.name!r} row layout has no tree attention (needs 'kernel')"
        if isinstance(self.drafter, ExitHeadsDrafter):
            return "exit heads climb layers row by row (trees take top-layer heads and/or prompt lookup)"
        if isinstance(self.drafter, DraftModelDrafter):
            return "a draft model drafts chains"
        if self.config.lossy_top_k > 1:
            return "lossy acceptance is a chain rule"
        return None

    def _resolve_thresholds(self) -> list[float]:
        n = self.num_sources
        given = self.config.thresholds
        if given is None:
            if n == 0:
                return []
            calibration = getattr(self.heads, "calibration", None)
            if calibration is None:
                raise ValueError(
                    "these heads carry no calibration: pass thresholds=... in DecodeConfig "
                    "(or calibrate them with hf_selfspec.heads.Calibration.fit)"
                )
            return [float(t) for t in calibration.thresholds]
        if isinstance(given, tuple):
            if len(given) != n:
                raise ValueError(f"{len(given)} thresholds given for {n} heads")
            return list(given)
        return [float(given)] * n

    # ---- the loop ------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        stop: StopFn | None = None,
        on_commit: CommitFn | None = None,
        min_new_tokens: int = 0,
        collect_logits: bool = False,
        stats: DecodeStats | None = None,
        scorer: RowScorer | None = None,
        do_sample: bool = False,
    ) -> DecodeResult:
        """Decode after `prompt_ids`; greedy returns exactly `Engine.generate_ar`'s tokens
        (truncated after the first EOS, at max_new_tokens, or after the token where `stop`
        returns True). EOS cannot be produced before `min_new_tokens` new tokens (HF
        semantics). `stats`, if given, is filled live (its `sources` grow before each
        `on_commit`).

        scorer: HF logits processors applied to every row (then `min_new_tokens` is theirs
        to enforce, e.g. HF's MinNewTokensLengthLogitsProcessor, and is ignored here).
        do_sample: exact speculative sampling from the softmax of the scores."""
        run = self.begin(prompt_ids, max_new_tokens, eos_token_ids, stop, on_commit, min_new_tokens,
                         collect_logits, stats, scorer, do_sample)
        engine = self.engine
        while not run.done:
            cycle = self.draft_cycle(run)
            hidden, depth, rows = self.step_input(cycle)
            t0 = time.perf_counter()
            logits, argmax, finals = engine.verify(hidden, depth, engine.rows_meta(rows),
                                                   logits=self.needs_logits(run))
            seconds = time.perf_counter() - t0
            if depth == 0:
                engine.costs.observe_step(len(rows), seconds, cycle.ctx.position)
            self.finish_cycle(run, cycle, logits, argmax, finals, seconds)
        return self.result(run)

    # The phases of `generate`, one sequence's each: a batch (batch.py) runs every sequence's
    # draft_cycle, one engine step over all their rows, then every finish_cycle.

    def begin(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = (),
              stop: StopFn | None = None, on_commit: CommitFn | None = None, min_new_tokens: int = 0,
              collect_logits: bool = False, stats: DecodeStats | None = None,
              scorer: RowScorer | None = None, do_sample: bool = False) -> SequenceRun:
        """Check the request, prefill the prompt and commit the first token (`generate`)."""
        engine = self.engine
        prompt_ids = list(prompt_ids)
        engine.check_capacity(len(prompt_ids), max_new_tokens, draft_rows=0)
        stats = stats if stats is not None else DecodeStats()
        stats.prompt_tokens = len(prompt_ids)
        if self.trace is not None:
            self.trace.append(("prompt", len(prompt_ids)))
        stats.lossy = self.config.lossy_top_k > 1
        stats.exits_per_head = [0] * self.num_sources
        run = SequenceRun(max_new_tokens, frozenset(int(e) for e in eos_token_ids), stop, on_commit,
                          min_new_tokens, scorer, do_sample, stats, time.perf_counter())
        if max_new_tokens <= 0:
            run.done = True
            return run
        if do_sample and self.config.lossy_top_k > 1:
            raise ValueError("lossy_top_k > 1 is a greedy option; sampling is exact only (set lossy_top_k=1)")
        # logits processors score a row from its history, which in a tree is its path, not
        # the rows before it: sampling and processors verify chains
        if self.config.tree == "on" and (do_sample or scorer is not None):
            raise ValueError("tree='on' is a greedy option without logits processors: speculative "
                             "sampling and logits processors verify chains (use tree='auto' or 'off')")
        if do_sample and scorer is None:
            from transformers import LogitsProcessorList

            run.scorer = RowScorer(LogitsProcessorList(), prompt_ids, engine.view.vocab_size, engine.head_device)
        if run.scorer is not None:
            run.min_new_tokens = 0
        if self.draft_engine is not None:
            self.draft_engine.check_capacity(len(prompt_ids), max_new_tokens, draft_rows=0)

        # prefill: the prompt's KV, the first token from its last row
        logits, run.final_before = engine.prefill(prompt_ids)
        scores = self._first_scores(logits, run.scorer, run.min_new_tokens, run.eos)
        first = sample(torch.softmax(scores, -1)) if do_sample else int(scores.argmax())
        if collect_logits:
            run.kept_logits, run.kept_scores = [logits], [scores]
        stats.prefill_time = time.perf_counter() - run.t_start
        for drafter in self._drafters():
            drafter.start(prompt_ids)
        run.done = self._commit(run, [first], [MODEL_LABEL])
        run.position = len(prompt_ids)
        run.policy = self._new_policy(len(prompt_ids))
        run.tree = self.use_tree and not do_sample and run.scorer is None
        return run

    def draft_cycle(self, run: SequenceRun) -> Cycle:
        """This cycle's context and drafted rows (at most what the cache and the request
        leave room for; near the end of the cache, the model's position range, fewer)."""
        t0 = time.perf_counter()
        ctx, budget = self.cycle_context(run)
        plan = self.draft(ctx, budget, run.policy, run.stats)
        return Cycle(ctx, plan, time.perf_counter() - t0)

    def cycle_context(self, run: SequenceRun) -> tuple[DraftContext, int]:
        """The next cycle's drafting context and its most drafts."""
        room = self.engine.position_limit - run.position
        budget = min(self.max_draft, run.max_new_tokens - len(run.out) - 1, room - 1)
        ctx = DraftContext(run.out, run.final_before, run.position, run.eos, run.tree,
                           run.scorer if run.do_sample else None, room)
        return ctx, budget

    def step_input(self, cycle: Cycle) -> tuple[torch.Tensor, int, StepRows]:
        """The cycle's rows for one engine step: hidden states [n, H] after `depth` layers
        (exit heads' rows continue from their climb) and their host metadata."""
        engine, tree, position = self.engine, cycle.plan.tree, cycle.ctx.position
        if cycle.plan.rows is not None:
            hidden, depth = cycle.plan.rows.finish()
        else:
            hidden, depth = engine.embed(tree.tokens), 0
        if tree.is_chain:
            return hidden, depth, engine.step_rows(range(position, position + len(tree)))
        positions, slots, paths = tree.layout(position)
        return hidden, depth, engine.step_rows(positions, slots, paths)

    def needs_logits(self, run: SequenceRun) -> bool:
        """Whether this cycle reads the model's logits, not only each row's argmax: sampling,
        logits processors, kept logits, lossy acceptance (top-k), or an EOS still masked by
        min_new_tokens."""
        return (run.do_sample or run.scorer is not None or run.kept_logits is not None
                or self.config.lossy_top_k > 1 or (len(run.out) < run.min_new_tokens and bool(run.eos)))

    def finish_cycle(self, run: SequenceRun, cycle: Cycle, logits: torch.Tensor | None, argmax: torch.Tensor,
                     finals: torch.Tensor, verify_seconds: float) -> None:
        """The model's view of the cycle's rows (logits, argmax, final hidden states [n, ...]
        from the engine step): accept, feed back, commit."""
        plan, stats = cycle.plan, run.stats
        tree = plan.tree
        stats.drafted += len(tree) - 1
        for row in range(1, len(tree)):
            if tree.kinds[row] is Source.HEAD:
                stats.exits_per_head[tree.steps[row]] += 1
        t0 = time.perf_counter()
        verified = self.scored(plan, cycle.ctx, max(0, run.min_new_tokens - len(run.out)), run.scorer,
                               logits, argmax, finals)
        tokens, labels, rows = self.accept(plan, verified, run.position, run.do_sample)
        stats.draft_time += cycle.draft_seconds
        stats.verify_time += verify_seconds + time.perf_counter() - t0
        stats.cycles += 1
        stats.accepted += len(tokens) - 1
        stats.off_chain_cycles += any(tree.depth[r] != r for r in rows)
        self._feedback(run.policy, plan, rows)
        run.final_before = verified.finals[rows[-1]]
        position = run.position
        run.position += len(tokens)
        before = len(run.out)
        run.done = self._commit(run, tokens, labels)
        if self.trace is not None:
            self.trace.append(("verify", position, list(tree.parent), list(rows), len(run.out) - before))
        if run.kept_logits is not None:
            kept = rows[: len(run.out) - before]
            run.kept_logits.extend(verified.logits[kept])
            run.kept_scores.extend(verified.scores[kept])

    def result(self, run: SequenceRun) -> DecodeResult:
        run.stats.new_tokens = len(run.out)
        run.stats.total_time = time.perf_counter() - run.t_start
        return DecodeResult(run.out, run.stats, run.kept_logits, run.kept_scores)

    def _drafters(self):
        return [d for d in (self.drafter, self.lookup) if d is not None]

    def _new_policy(self, context: int) -> DraftBudget:
        """The request's draft budget, on the step costs at its prompt's length (a long
        prompt makes every row's attention, and so more rows, cost more)."""
        engine = self.engine
        costs = engine.costs.step_costs_at(context) if self.config.adaptive else (1.0,) * (engine.width + 1)
        policy = DraftBudget(costs, self.max_draft, self.config.adaptive)
        if isinstance(self.drafter, DraftModelDrafter):  # a draft token costs its step, in main-model steps
            policy.draft_costs[self.drafter.key] = (
                self.draft_engine.costs.one_row_seconds() / engine.costs.one_row_seconds()
                if self.config.adaptive else 0.0)
        return policy

    @staticmethod
    def _first_scores(logits, scorer, min_new_tokens, eos) -> torch.Tensor:
        if scorer is not None:
            return scorer.scores([], [], logits[None])[0]
        if min_new_tokens > 0 and eos:
            scores = logits.clone()
            scores[sorted(eos)] = float("-inf")
            return scores
        return logits

    # ---- draft ---------------------------------------------------------------------------

    def draft(self, ctx: DraftContext, budget: int, policy: DraftBudget, stats: DecodeStats) -> DraftPlan:
        """This cycle's rows: at most `budget` drafts, as many as the policy expects to pay."""
        if ctx.tree:
            return self._plan_tree(ctx, budget, policy, stats)
        return self._plan_chain(ctx, budget, policy, stats)

    def _propose(self, drafter, ctx: DraftContext, budget: int, stats: DecodeStats) -> Proposal:
        proposal = drafter.propose(ctx, budget)
        stats.head_evaluations += proposal.evaluations
        if self.trace is not None:
            self.trace.append(("draft", proposal.drafter, budget))
        return proposal

    def _plan_chain(self, ctx: DraftContext, budget: int, policy: DraftBudget, stats: DecodeStats) -> DraftPlan:
        """One drafter's chain. Lookup "only" / "first" copies when the n-gram index has a
        match ("first": only while copies are accepted at least as often as the other
        drafter's drafts, or when that drafter gets no budget this cycle: else neither
        drafts and the copy's live rate could never recover); "fallback" copies when the
        other drafter proposed nothing."""
        mode, drafter = self.config.lookup, self.drafter
        copy_budget = min(budget, policy.budget(COPY_KEY))
        head_budget = min(budget, policy.budget(drafter.key if drafter is not None else HEADS_KEY))
        copies: list[Candidate] = []
        if self.lookup is not None and copy_budget > 0 and mode in ("only", "first"):
            copies = self._propose(self.lookup, ctx, copy_budget, stats).candidates
            if (copies and mode == "first" and drafter is not None and head_budget > 0
                    and policy.rate(COPY_KEY) < policy.rate(drafter.key)):
                copies = []
        proposal = None
        if not copies and drafter is not None and head_budget > 0:
            proposal = self._propose(drafter, ctx, head_budget, stats)
        if (not copies and self.lookup is not None and mode == "fallback" and copy_budget > 0
                and not (proposal and proposal.candidates)):
            copies = self._propose(self.lookup, ctx, copy_budget, stats).candidates
        tree = DraftTree(ctx.committed[-1], min(self.engine.width, ctx.room))
        rows = proposal.rows if proposal is not None else None
        chosen = copies or (proposal.candidates if proposal is not None else [])
        rate = policy.rate(COPY_KEY if copies else drafter.key) if chosen else 0.0
        for candidate in chosen:
            tree.add(len(tree) - 1, candidate.token, candidate.source, candidate.step, candidate.q,
                     value=rate ** len(tree))
            if rows is not None and len(rows) < len(tree):  # a copy after the heads' rows
                rows.add(candidate.token)
            if candidate.token in ctx.eos:
                break
        branches = {}
        if len(tree) > 1:
            branches[COPY_KEY if copies else drafter.key] = list(range(1, len(tree)))
        return DraftPlan(tree, branches, rows)

    def _plan_tree(self, ctx: DraftContext, budget: int, policy: DraftBudget, stats: DecodeStats) -> DraftPlan:
        """The heads' dynamic tree and the lookup copy merged as a trie, rows kept where
        they pay (policy.select_tree_rows). A copy that goes first (its live rate is at
        least the heads') and fills the tree leaves no row for the heads: they are not
        evaluated."""
        request = self.tree_request(ctx, budget, policy, stats)
        heads: list[Candidate] = []
        if request.heads_depth > 0:
            heads = self._propose(self.drafter, ctx, request.heads_depth, stats).candidates
        return self.tree_plan(request, heads, policy, stats)

    def tree_request(self, ctx: DraftContext, budget: int, policy: DraftBudget, stats: DecodeStats) -> TreeRequest:
        """A tree cycle's first half: the lookup copy and how deep the heads draft (0: not
        evaluated this cycle)."""
        width = min(self.engine.width, self.max_draft + 1, ctx.room)
        if budget <= 0:
            return TreeRequest(ctx, width, [], 0, 0)
        mode = self.config.lookup
        copy_budget = min(budget, policy.budget(COPY_KEY))
        copies: list[Candidate] = []
        if self.lookup is not None and copy_budget > 0 and mode != "fallback":
            copies = self._propose(self.lookup, ctx, copy_budget, stats).candidates
        head_budget = min(budget, policy.budget(HEADS_KEY))
        copy_fills = len(copies) >= width - 1 and policy.rate(COPY_KEY) >= policy.rate(HEADS_KEY)
        depth = min(budget, width - 1) if self.drafter is not None and head_budget > 0 and not copy_fills else 0
        return TreeRequest(ctx, width, copies, copy_budget, depth)

    def tree_plan(self, request: TreeRequest, heads: list[Candidate], policy: DraftBudget,
                  stats: DecodeStats) -> DraftPlan:
        """A tree cycle's second half, given the heads' candidates: the fallback copy, then
        the rows that pay."""
        ctx, copies = request.ctx, request.copies
        if (self.lookup is not None and request.copy_budget > 0 and self.config.lookup == "fallback"
                and not heads):
            copies = self._propose(self.lookup, ctx, request.copy_budget, stats).candidates
        selected = select_tree_rows(
            ctx.committed[-1], request.width, copies, heads, copy_rate=policy.rate(COPY_KEY),
            heads_rate=policy.rate(HEADS_KEY), heads_scale=policy.calibration(HEADS_KEY).scale,
            heads_key=HEADS_KEY, costs=policy.costs, adaptive=policy.adaptive, eos=ctx.eos)
        return DraftPlan(selected.tree, selected.branches)

    # ---- verify --------------------------------------------------------------------------

    def scored(self, plan: DraftPlan, ctx: DraftContext, masked_rows: int, scorer: RowScorer | None,
               logits: torch.Tensor, argmax: torch.Tensor, finals: torch.Tensor) -> Verified:
        """The model's tokens after the plan's rows, from the engine step's outputs. Without a
        scorer, rows at depth < `masked_rows` may not end the text (min_new_tokens): their
        EOS logits are -inf before the argmax, as HF's MinNewTokensLengthLogitsProcessor
        does; with one, the scores are the request's processors applied row by row (chains
        only)."""
        tree = plan.tree
        if scorer is not None:
            scores = scorer.scores(ctx.committed, tree.drafts, logits)
            return Verified(scores.argmax(-1).tolist(), logits, scores, finals)
        if masked_rows > 0 and ctx.eos:
            scores = logits.clone()
            masked = torch.tensor([d < masked_rows for d in tree.depth], device=scores.device).nonzero()[:, 0]
            scores[masked[:, None], torch.tensor(sorted(ctx.eos), device=scores.device)] = float("-inf")
            return Verified(scores.argmax(-1).tolist(), logits, scores, finals)
        return Verified(argmax.tolist(), logits, logits, finals)

    # ---- accept --------------------------------------------------------------------------

    def accept(self, plan: DraftPlan, verified: Verified, position: int,
               do_sample: bool = False) -> tuple[list[int], list[str], list[int]]:
        """The committed tokens, their source labels and the rows whose scores produced
        them (row 0 first; the last row's final state feeds the next cycle's heads)."""
        tree = plan.tree
        if do_sample:
            m, token = speculative_tokens(torch.softmax(verified.scores, -1), tree.drafts, tree.q[1:])
            accepted = list(range(1, m + 1))
        elif self.config.lossy_top_k > 1 and len(tree) > 1:
            # LOSSY (opt-in): a draft among the model's top-k at its row is accepted
            topk = verified.scores[: len(tree) - 1].topk(self.config.lossy_top_k, -1).indices.tolist()
            m = 0
            while m < len(tree) - 1 and (tree.tokens[m + 1] == verified.tokens[m] or tree.tokens[m + 1] in topk[m]):
                m += 1
            accepted, token = list(range(1, m + 1)), verified.tokens[m]
        else:
            accepted = tree.walk(verified.tokens)
            token = verified.tokens[accepted[-1] if accepted else 0]
            # the accepted rows' KV to consecutive slots (a no-op for a chain)
            self.engine.move_kv([position + r for r in accepted],
                                [position + 1 + j for j in range(len(accepted))])
        tokens = [tree.tokens[r] for r in accepted] + [token]
        labels = [tree.label(r) for r in accepted] + [MODEL_LABEL]
        return tokens, labels, [0] + accepted

    # ---- commit --------------------------------------------------------------------------

    @staticmethod
    def _feedback(policy: DraftBudget, plan: DraftPlan, rows: list[int]) -> None:
        """Each drafter's live acceptance (its first-chain rows) and the heads' calibration
        (their path probabilities against what was accepted)."""
        accepted = set(rows)
        for drafter, branch in plan.branches.items():
            policy.update(drafter, len(branch), sum(r in accepted for r in branch))
        predicted = plan.tree.predicted
        if predicted:
            policy.calibration(HEADS_KEY).update(sum(predicted.values()), sum(r in accepted for r in predicted))

    def _commit(self, run: SequenceRun, tokens: list[int], labels: list[str]) -> bool:
        """Append tokens one by one, stopping exactly where AR would. True when done."""
        done = False
        kept = 0
        out, stop = run.out, run.stop
        for token in tokens:
            out.append(token)
            run.stats.sources.append(labels[kept])
            kept += 1
            if token in run.eos or len(out) >= run.max_new_tokens or (stop is not None and stop(out)):
                done = True
                break
        for drafter in self._drafters():
            drafter.accepted(tokens[:kept])
        if run.on_commit is not None:
            run.on_commit(tokens[:kept])
        return done
