"""Greedy self-speculative decoding: draft -> verify -> commit, one cycle at a time.

A cycle works on a block of rows at consecutive positions P, P+1, ...: row 0 is the last
committed token (its KV is not in the cache yet), row j > 0 is the j-th draft.

  draft_block   Exit heads: for each draft position the newest row climbs the heads
                shallow -> deep, running only as deep as the head being evaluated, and the
                first head whose confidence passes its threshold drafts the next token
                (lazy catch-up: a row computes layer l only once the older rows of the
                block have their KV there; the rows below it are advanced together in one
                `seg` pass, so every head sees the exact hidden state of the exact prefix).
                Top-layer draft heads: a chain of drafts from the final hidden state of the
                row that produced row 0's token (kept from the last verification), no
                layer pass. Prompt lookup may instead supply the drafts as copies. Drafted
                rows enter at depth 0; a draft budget (policy.py) caps how many pay.
  verify_block  All rows are brought to the block depth D and `verify[D, n]` gives the
                model's argmax after every row.
  commit        The longest prefix of drafts equal to the model's argmax is accepted, then
                the model's token at the first mismatch (or the bonus token after the last
                draft). Rejected rows' KV is simply overwritten by later cycles.

Every row of the main model is computed by fixed-width programs, so the committed tokens
are exactly the engine's AR output (`Engine.generate_ar`), whatever is drafted.

With `do_sample=True` the heads sample their drafts from their (processed) distributions
and commit follows speculative sampling (sampling.py): each token is distributed exactly as
the model's own processed distribution. A `RowScorer` applies HF logits processors to every
row, in greedy and sampling mode alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from ..engine.programs import Engine
from ..stats import SOURCE_COPY, SOURCE_MODEL, DecodeStats, head_source
from .draft_model import SOURCE_DRAFT_MODEL, DraftModelDrafter
from .lookup import PromptLookup
from .policy import DraftBudget
from .sampling import RowScorer, sample, speculative_tokens
from .tree import DraftTree

LookupMode = Literal["off", "only", "first", "fallback"]
LOOKUP_MODES = ("off", "only", "first", "fallback")
TreeMode = Literal["auto", "on", "off"]
TREE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class DecodeConfig:
    """Knobs of the greedy speculative loop, validated here once.

    max_draft:  drafts per cycle (None: width - 1, the most one verification can take)
    lookup:     prompt lookup: "off"; "only" (exact PLD, no heads); "first" (copy when the
                n-gram index has a match, else heads); "fallback" (heads, copy when no head
                drafts)
    thresholds: head confidence thresholds (one per head, or one for all); None = the
                heads' calibrated thresholds
    gamma:      stop drafting when the predicted probability that every draft so far is
                accepted (product of calibrated acceptances) falls below gamma; 0 = never
    adaptive:   True: the draft budget follows live acceptance and the measured step costs
                (policy.py), so where drafts do not pay the loop takes plain AR steps (with
                a one-draft probe every 16 cycles); False: draft whatever the thresholds
                allow, up to max_draft, and in trees keep every row the drafters propose
                (to measure heads, or force branches in tests)
    lossy_top_k: LOSSY, opt-in. 1 (default) = exact: a draft is accepted only when it is the
                model's token. k > 1 accepts a draft that is among the model's top-k at its
                position, so the output is no longer the model's greedy output (it is still
                a text the model ranks top-k at every token). Greedy only.
    draft_confidence: with a draft model (classical speculative decoding), stop drafting at
                the first token whose draft-model probability is below this (HF's
                assistant_confidence_threshold); 0 = draft up to the budget.
    tree:       draft trees (tree.py): the top-layer heads' dynamic tree (at each step the
                `tree_beam` likeliest nodes, by path probability, are expanded by their
                `siblings` + 1 likeliest next tokens; nodes off the heads' top-1 chain need
                path probability >= sibling_min_prob) and the prompt-lookup copy, merged as
                a trie and verified in one pass, rows kept only while they pay on the
                measured step costs.
                "auto" (default): trees where the engine supports them (kernel row layout)
                and decoding is exact greedy with top-layer heads and/or lookup, chains
                elsewhere (sampling, exit heads, a draft model, other layouts). "on": trees,
                and an error where they cannot be used; "off": chains.
                Measured (scripts/bench.py, 12 prompts, side by side, all identical): on a
                2-core Intel Xeon trees 2.26-2.27x HF greedy vs 2.11-2.14x for chains in two
                runs (chat, code, summarize +3-14%; adversarial copies -4 to -12%); on a 2-core
                AMD EPYC, before the tree fixes of 2026-12-04, 3.04-3.12x vs 3.06-3.07x.
    """

    max_draft: int | None = None
    lookup: LookupMode = "first"
    thresholds: float | tuple[float, ...] | None = None
    gamma: float = 0.0
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 1
    adaptive: bool = True
    lossy_top_k: int = 1
    draft_confidence: float = 0.4
    tree: TreeMode = "auto"
    siblings: int = 3
    sibling_min_prob: float = 0.05
    tree_beam: int = 4

    def __post_init__(self):
        if self.tree not in TREE_MODES:
            raise ValueError(f"tree must be one of {TREE_MODES}, got {self.tree!r}")
        if not isinstance(self.siblings, int) or self.siblings < 0:
            raise ValueError(f"siblings must be a non-negative int, got {self.siblings!r}")
        if not 0.0 <= self.sibling_min_prob <= 1.0:
            raise ValueError(f"sibling_min_prob must be in [0, 1], got {self.sibling_min_prob!r}")
        if not isinstance(self.tree_beam, int) or self.tree_beam < 1:
            raise ValueError(f"tree_beam must be a positive int, got {self.tree_beam!r}")
        if self.lookup not in LOOKUP_MODES:
            raise ValueError(f"lookup must be one of {LOOKUP_MODES}, got {self.lookup!r}")
        if self.max_draft is not None and (not isinstance(self.max_draft, int) or self.max_draft < 0):
            raise ValueError(f"max_draft must be a non-negative int or None, got {self.max_draft!r}")
        if not isinstance(self.lossy_top_k, int) or self.lossy_top_k < 1:
            raise ValueError(f"lossy_top_k must be an int >= 1 (1 = exact), got {self.lossy_top_k!r}")
        if not 0.0 <= self.draft_confidence <= 1.0:
            raise ValueError(f"draft_confidence must be in [0, 1], got {self.draft_confidence!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma!r}")
        if isinstance(self.thresholds, (list, tuple)):
            object.__setattr__(self, "thresholds", tuple(float(t) for t in self.thresholds))


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens only
    stats: DecodeStats
    logits: list[torch.Tensor] | None = None  # [V] raw logits behind each new token
    scores: list[torch.Tensor] | None = None  # [V] the same after min_new_tokens masking


StopFn = Callable[[list[int]], bool]  # new tokens so far -> stop after the last one?
CommitFn = Callable[[list[int]], None]  # receives each chunk of committed tokens


class _Block:
    """Rows of one cycle: tokens, how they were drafted, hidden states and depths."""

    def __init__(self, engine: Engine, first_token: int, position: int):
        self.engine = engine
        self.position = position
        self.tokens = [first_token]
        self.sources: list[str] = [SOURCE_MODEL]
        self.hidden = torch.zeros(engine.width, engine.view.hidden_size, dtype=engine.view.dtype,
                                  device=engine.view.device)
        self.hidden[0] = engine.view.embed[first_token]
        self.depth = [0]  # layers computed for each row (never increasing with the row)
        self.final_before: torch.Tensor | None = None  # [H] final hidden of the row before row 0
        self.q: list[torch.Tensor | None] = [None]  # sampling: the distribution each draft came from
        self.committed: list[int] = []  # the tokens committed before this block (row 0 = the last)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, source: str, q: torch.Tensor | None = None) -> None:
        self.hidden[len(self.tokens)] = self.engine.view.embed[token]
        self.tokens.append(token)
        self.sources.append(source)
        self.depth.append(0)
        self.q.append(q)

    @property
    def drafts(self) -> list[int]:
        return self.tokens[1:]

    def advance(self, first: int, last: int, end: int) -> None:
        """One seg pass: rows [first, last), all at the same depth, to layer `end`."""
        start = self.depth[first]
        rows = slice(first, last)
        meta = self.engine.make_meta(range(self.position + first, self.position + last))
        self.hidden[rows] = self.engine.seg(self.hidden[rows], start, end, meta)
        for r in range(first, last):
            self.depth[r] = end

    def climb(self, layer: int) -> None:
        """Bring the newest row to `layer` (lazy catch-up).

        A row may only compute layer l once every older row of the block has its KV at
        layer l. Depths never increase with the row index, so the rows below `layer` are a
        suffix of the block: the shallowest run of equal depth is advanced together up to
        the depth of the row before it (merging the runs) until the newest row is there.
        """
        newest = len(self.tokens) - 1
        while self.depth[newest] < layer:
            depth = self.depth[newest]
            first = newest
            while first > 0 and self.depth[first - 1] == depth:
                first -= 1
            target = layer if first == 0 else min(layer, self.depth[first - 1])
            self.advance(first, newest + 1, target)

    @property
    def max_depth(self) -> int:
        return self.depth[0]


class SelfSpecDecoder:
    """Speculative decoding over an `Engine`, drafting with exit heads or top-layer draft
    heads (`heads`; None for lookup-only / plain AR), or with a smaller draft model in its
    own engine (`draft_engine`, which then replaces the heads), and/or prompt lookup."""

    def __init__(self, engine: Engine, heads=None, config: DecodeConfig | None = None,
                 draft_engine: Engine | None = None):
        self.engine = engine
        self.config = config or DecodeConfig()
        # an explicit draft model always drafts (with lookup "only", where no copy is found)
        self.draft_engine = draft_engine
        if draft_engine is not None:
            if draft_engine.view.vocab_size != engine.view.vocab_size:
                raise ValueError(
                    f"the draft model has {draft_engine.view.vocab_size} output tokens, the model "
                    f"{engine.view.vocab_size}: it must use the same tokenizer"
                )
            heads = None  # the draft model is the drafter
        self.heads = heads
        self._drafter_key = "draft_model" if self.draft_engine is not None else "head"
        self._drafter: DraftModelDrafter | None = None
        # lookup "only" is exact PLD: the heads are not consulted
        use_heads = heads is not None and self.config.lookup != "only"
        # top-layer draft heads draft from the last final hidden state (no layer passes)
        self.top = heads if use_heads and getattr(heads, "kind", None) == "top_draft" else None
        self.head_list = list(heads.heads) if use_heads and self.top is None else []
        self.num_sources = self.top.config.depth if self.top is not None else len(self.head_list)
        for head in self.head_list:
            if not 1 <= head.layer < engine.view.num_layers:
                raise ValueError(
                    f"an exit head reads layer {head.layer}, but the model has "
                    f"{engine.view.num_layers} layers"
                )
        self.thresholds = self._resolve_thresholds()
        width = engine.width
        max_draft = width - 1 if self.config.max_draft is None else self.config.max_draft
        if max_draft > width - 1:
            raise ValueError(f"max_draft={max_draft} does not fit the engine width {width} (max {width - 1})")
        self.max_draft = max_draft
        use_lookup = self.config.lookup != "off"
        self.lookup = (
            PromptLookup(self.config.lookup_max_ngram, self.config.lookup_min_ngram, max(max_draft, 1))
            if use_lookup else None
        )
        self.tree_reason = self._tree_obstacle()
        if self.config.tree == "on" and self.tree_reason is not None:
            raise ValueError(f"tree='on' cannot be used here: {self.tree_reason}; use tree='auto' or 'off'")
        self.use_tree = self.config.tree != "off" and self.tree_reason is None

    def _tree_obstacle(self) -> str | None:
        """Why draft trees cannot be used with this engine and drafter (None: they can)."""
        if not self.engine.supports_trees:
            return f"the engine's {self.engine.layout.name!r} row layout has no tree attention (needs 'kernel')"
        if self.head_list:
            return "exit heads climb layers row by row (trees take top-layer heads and/or prompt lookup)"
        if self.draft_engine is not None:
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

    # ---- phases -------------------------------------------------------------------------

    def _draft_from_heads(self, block: _Block, budget: int, eos: set[int], stats: DecodeStats,
                          scorer: RowScorer | None = None):
        """Add head drafts to `block` until no head passes, the budget is spent, an EOS is
        drafted, or the predicted acceptance of the whole chain falls under gamma. With a
        scorer (sampling) a head that passes samples its draft from its processed q."""
        gamma = self.config.gamma
        chain_prob = 1.0
        calibration = getattr(self.heads, "calibration", None)
        while len(block) - 1 < budget:
            drafted = False
            for k, head in enumerate(self.head_list):
                block.climb(head.layer)
                newest = len(block) - 1
                conf, token = head.propose(block.hidden[newest : newest + 1])
                stats.head_evaluations += 1
                conf_value = float(conf[0])
                if conf_value >= self.thresholds[k] and conf_value > 0.0:
                    if gamma > 0.0 and calibration is not None:
                        chain_prob *= float(calibration.accept_prob(k, conf[:1])[0])
                        if chain_prob < gamma:
                            return
                    q = None
                    if scorer is not None:
                        reduced = head(block.hidden[newest: newest + 1])[0, : head.vocab_size]
                        q = scorer.draft_distribution(block.committed, block.drafts, reduced, head.vocab_ids)
                        if q is None:
                            return
                        token = torch.tensor([sample(q)])
                    block.add(int(token[0]), head_source(k), q)
                    stats.exits_per_head[k] += 1
                    drafted = True
                    break
            if not drafted or block.tokens[-1] in eos:
                return

    def _draft_from_top(self, block: _Block, budget: int, eos: set[int], scorer: RowScorer | None,
                        stats: DecodeStats) -> None:
        """A chain from the top-layer draft heads: argmax drafts, or (scorer given) drafts
        sampled from each step's processed distribution."""
        if scorer is None:
            drafted = self.top.draft(block.final_before, block.tokens[0], budget, self.thresholds)
            for token, _conf, step in drafted:
                block.add(token, head_source(step))
                stats.exits_per_head[step] += 1
                if token in eos:
                    break
            return
        top = self.top
        h = block.final_before.reshape(1, -1)
        prev = torch.tensor([block.tokens[0]], device=h.device)
        for i in range(min(budget, len(top.steps))):
            h, logits = top.step_logits(i, h, prev)
            if float(torch.softmax(logits.float(), -1).max()) < self.thresholds[i]:
                break
            q = scorer.draft_distribution(block.committed, block.drafts, logits[0], top.vocab_ids)
            if q is None:
                break
            token = sample(q)
            block.add(token, head_source(i), q)
            stats.exits_per_head[i] += 1
            if token in eos:
                break
            prev = torch.tensor([token], device=h.device)

    def draft_block(self, block: _Block, budget: int, eos: set[int], stats: DecodeStats,
                    policy: DraftBudget, scorer: RowScorer | None = None) -> None:
        """Fill the block with drafts: copies from prompt lookup and/or head drafts, at
        most `budget`, and at most what the policy expects to pay for each drafter.
        `scorer` is given when sampling: head drafts are then sampled."""
        mode = self.config.lookup
        copies: list[int] = []
        copy_budget = min(budget, policy.budget(SOURCE_COPY))
        has_heads = bool(self.head_list) or self.top is not None or self._drafter is not None
        head_budget = min(budget, policy.budget(self._drafter_key))
        if self.lookup is not None and copy_budget > 0 and mode in ("only", "first"):
            copies = self.lookup.propose(copy_budget)
            # "first": a copy pre-empts the heads only while copies are accepted at least
            # as often as head drafts on this text (live rates, policy.py); when the heads
            # do not pay this cycle (budget 0), a copy that pays is drafted whatever their
            # rate (else neither drafts and the copy's rate could never recover)
            if (copies and mode == "first" and has_heads and head_budget > 0
                    and policy.rate(SOURCE_COPY) < policy.rate(self._drafter_key)):
                copies = []
        if not copies and self.head_list and mode != "only":
            self._draft_from_heads(block, head_budget, eos, stats, scorer)
        if not copies and self.top is not None and head_budget > 0:
            self._draft_from_top(block, head_budget, eos, scorer, stats)
            stats.head_evaluations += 1
        if not copies and self._drafter is not None and head_budget > 0:
            drafts, qs = self._drafter.propose(block.committed, head_budget, eos, scorer)
            for token, q in zip(drafts, qs):
                block.add(token, SOURCE_DRAFT_MODEL, q)
        if len(block) == 1 and not copies and self.lookup is not None and mode == "fallback" and copy_budget > 0:
            copies = self.lookup.propose(copy_budget)
        for token in copies:
            block.add(token, SOURCE_COPY)
            if token in eos:
                break
        stats.drafted += len(block) - 1

    def verify_block(self, block: _Block, masked_rows: int, eos: list[int], scorer: RowScorer | None = None):
        """The model's token after every row of the block: (argmax [n] host ints, logits
        [n, V], scores [n, V], final hidden states [n, H]). Without a scorer the first
        `masked_rows` rows may not end the text (min_new_tokens): their EOS logits are -inf
        before the argmax, as HF's MinNewTokensLengthLogitsProcessor does; with one, the
        scores are the request's processors applied row by row (and the argmax theirs)."""
        depth = block.max_depth
        block.climb(depth)
        n = len(block)
        meta = self.engine.make_meta(range(block.position, block.position + n))
        logits, argmax, final = self.engine.verify(block.hidden[:n], depth, meta)
        if scorer is not None:
            scores = scorer.scores(block.committed, block.drafts, logits)
            return scores.argmax(-1).tolist(), logits, scores, final
        if masked_rows > 0 and eos:
            scores = logits.clone()
            scores[:masked_rows, eos] = float("-inf")
            return scores.argmax(-1).tolist(), logits, scores, final
        return argmax.tolist(), logits, logits, final

    @staticmethod
    def accepted_tokens(block: _Block, model_tokens: list[int],
                        lossy_topk: list[list[int]] | None = None) -> tuple[list[int], list[str]]:
        """Longest verified prefix of drafts + the model's token after it. LOSSY when
        `lossy_topk` (the model's top-k per row) is given: a draft in it is accepted."""
        tokens, sources = [], []
        for j in range(1, len(block)):
            if block.tokens[j] != model_tokens[j - 1] and (
                    lossy_topk is None or block.tokens[j] not in lossy_topk[j - 1]):
                break
            tokens.append(block.tokens[j])
            sources.append(block.sources[j])
        tokens.append(model_tokens[len(tokens)])
        sources.append(SOURCE_MODEL)
        return tokens, sources

    @staticmethod
    def sampled_tokens(block: _Block, scores: torch.Tensor) -> tuple[list[int], list[str]]:
        """Speculative sampling: the accepted drafts + the token drawn after them."""
        m, token = speculative_tokens(torch.softmax(scores, -1), block.drafts, block.q[1:])
        return block.drafts[:m] + [token], block.sources[1: m + 1] + [SOURCE_MODEL]

    # ---- draft trees ----------------------------------------------------------------------

    def draft_tree(self, out: list[int], final_before: torch.Tensor, budget: int, eos: set[int],
                   stats: DecodeStats, policy: DraftBudget) -> tuple[DraftTree, dict[str, list[int]]]:
        """A tree from the last committed token (tree.py). The top-layer heads propose a
        dynamic tree (`TopDraftHeads.draft_tree`: the `tree_beam` likeliest nodes of each
        step expanded by their `siblings + 1` likeliest next tokens), each node weighed by
        its path probability times the heads' live calibration; the lookup copy proposes a
        chain, its j-th token weighed by rate^j. When the copy's live acceptance is at least
        the heads', its chain goes first, as many tokens as the policy pays for alone; the
        rest are extra rows, likeliest first (a branch that leaves the first chain only
        counts where that chain is wrong: x its miss rate). The tree keeps the number of
        rows that maximises expected tokens per verification cost on the engine's measured
        step-cost curve (rows that ride in a step of about the same cost are taken, rows
        that widen it are not; with adaptive=False every proposed row is kept). Returns the tree and each drafter's chain rows (the heads'
        top-1 chain, the copy) for the policy's feedback."""
        tree = DraftTree(out[-1], min(self.engine.width, self.max_draft + 1))
        branches: dict[str, list[int]] = {}
        if budget <= 0:
            return tree, branches
        mode = self.config.lookup
        copies: list[int] = []
        copy_budget = min(budget, policy.budget(SOURCE_COPY))
        if self.lookup is not None and copy_budget > 0 and mode != "fallback":
            copies = self.lookup.propose(copy_budget)
        nodes = []
        head_budget = min(budget, policy.budget(self._drafter_key))
        # a copy that goes first (its live rate is at least the heads') and fills the tree
        # leaves no row for the heads: they are not evaluated (on long copies, ~4% of the time)
        copy_fills = (len(copies) >= tree.width - 1
                      and policy.rate(SOURCE_COPY) >= policy.rate(self._drafter_key))
        if self.top is not None and head_budget > 0 and not copy_fills:
            nodes = self.top.draft_tree(final_before, out[-1], min(budget, tree.width - 1), self.thresholds,
                                        self.config.siblings + 1, self.config.tree_beam,
                                        self.config.sibling_min_prob, eos)
            stats.head_evaluations += 1
        if self.lookup is not None and copy_budget > 0 and mode == "fallback" and not nodes:
            copies = self.lookup.propose(copy_budget)
        head_chain = [n.token for n in nodes if n.on_chain]
        heads_first = not copies or (nodes and policy.rate(SOURCE_COPY) < policy.rate(self._drafter_key))
        expected = 1.0
        extras = []  # (weight, order, kind, index, token, source)
        copy_rows: list[int] = []
        if not heads_first:  # the copy's chain (its policy budget already weighed its cost)
            rate = policy.rate(SOURCE_COPY)
            for j, token in enumerate(copies):
                row = tree.add(copy_rows[-1] if copy_rows else 0, token, SOURCE_COPY)
                if row is None:
                    break
                copy_rows.append(row)
                expected += rate ** (j + 1)
                if token in eos:
                    break
            first_tokens = [tree.tokens[r] for r in copy_rows]
            miss = 1.0 - rate
        else:
            first_tokens = head_chain
            miss = 1.0 - policy.rate(self._drafter_key)
        # a branch that leaves the first chain (a different token at the same depth) competes
        # with it: from there on it is only needed (and right) when the first chain is wrong
        # there. Where it agrees with the whole first chain and goes past its end (a copy the
        # heads' short chain began), nothing competes with its further rows.
        def leaves_first(step: int, token: int, parent_left: bool) -> bool:
            return parent_left or (step < len(first_tokens) and token != first_tokens[step])

        scale = policy.calibration(self._drafter_key).scale
        left = []  # per head node: its path leaves the first chain (only the copy's can)
        for i, node in enumerate(nodes):
            left.append(not heads_first and leaves_first(node.step, node.token,
                                                         node.parent >= 0 and left[node.parent]))
            weight = scale * node.prob * (miss if left[-1] else 1.0)
            extras.append((weight, len(extras), "head", i, node.token, head_source(node.step)))
        if heads_first:
            rate, copy_left = policy.rate(SOURCE_COPY), False
            for j, token in enumerate(copies):
                copy_left = leaves_first(j, token, copy_left)
                weight = miss if copy_left else 1.0
                extras.append((weight * rate ** (j + 1), len(extras), SOURCE_COPY, j, token, SOURCE_COPY))
                if token in eos:
                    break
        extras.sort(key=lambda e: (-e[0], e[1]))
        costs = policy.costs
        best_rows, best_value = len(tree), expected / costs[len(tree)]
        node_rows: dict[int, int] = {}
        for weight, _order, kind, index, token, source in extras:
            if kind == SOURCE_COPY:
                if index != len(copy_rows):  # its parent did not make it
                    continue
                parent = copy_rows[-1] if copy_rows else 0
            else:
                parent_node = nodes[index].parent
                if parent_node >= 0 and parent_node not in node_rows:
                    continue
                parent = node_rows[parent_node] if parent_node >= 0 else 0
            before = len(tree)
            row = tree.add(parent, token, source)
            if row is None:
                break
            if kind == SOURCE_COPY:
                copy_rows.append(row)
            else:
                node_rows[index] = row
            if len(tree) > before:
                if kind != SOURCE_COPY:
                    tree.predicted[row] = nodes[index].prob
                expected += weight
                value = expected / costs[len(tree)]
                # adaptive=False (to measure the drafters): every row they propose is kept
                if value > best_value + 1e-9 or not policy.adaptive:
                    best_rows, best_value = len(tree), value
        tree.truncate(best_rows)
        if copy_rows:
            branches[SOURCE_COPY] = [r for r in copy_rows if r < best_rows]
        if nodes:
            chain_rows = [node_rows[i] for i, n in enumerate(nodes) if n.on_chain and i in node_rows]
            branches[self._drafter_key] = [r for r in chain_rows if r < best_rows]
        for row in range(1, len(tree)):
            if tree.sources[row] != SOURCE_COPY:
                stats.exits_per_head[int(tree.sources[row][len("head"):])] += 1
        stats.drafted += len(tree) - 1
        return tree, branches

    def verify_tree(self, tree: DraftTree, position: int, masked_rows: int, eos: list[int]):
        """The model's token after every row of the tree, as `verify_block`: (argmax [n],
        logits [n, V], scores [n, V], final hidden [n, H]). Rows at depth < masked_rows
        may not end the text (min_new_tokens)."""
        engine = self.engine
        positions, slots, paths = tree.layout(position)
        meta = (engine.make_meta(positions) if tree.is_chain
                else engine.make_meta(positions, slots=slots, paths=paths))
        logits, argmax, final = engine.verify(engine.embed(tree.tokens), 0, meta)
        if masked_rows > 0 and eos:
            scores = logits.clone()
            masked = torch.tensor([d < masked_rows for d in tree.depth], device=scores.device)
            scores[masked.nonzero()[:, 0][:, None], torch.tensor(eos, device=scores.device)] = float("-inf")
            return scores.argmax(-1).tolist(), logits, scores, final
        return argmax.tolist(), logits, logits, final

    def commit_tree(self, tree: DraftTree, position: int, model_tokens: list[int]):
        """Walk the tree with the model's tokens; move the accepted rows' KV to consecutive
        slots. Returns (tokens, sources, rows of the committed tokens' logits)."""
        accepted = tree.walk(model_tokens)
        self.engine.move_kv([position + r for r in accepted],
                            [position + 1 + j for j in range(len(accepted))])
        last = accepted[-1] if accepted else 0
        tokens = [tree.tokens[r] for r in accepted] + [model_tokens[last]]
        sources = [tree.sources[r] for r in accepted] + [SOURCE_MODEL]
        return tokens, sources, [0] + accepted

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
        """Greedy decoding; returns exactly `Engine.generate_ar`'s tokens (truncated after
        the first EOS, at max_new_tokens, or after the token where `stop` returns True).
        EOS cannot be produced before `min_new_tokens` new tokens (HF semantics).
        `stats`, if given, is filled live (its `sources` grow before each `on_commit`).

        scorer: HF logits processors applied to every row (then `min_new_tokens` is theirs
        to enforce, e.g. HF's MinNewTokensLengthLogitsProcessor, and is ignored here).
        do_sample: exact speculative sampling from the softmax of the scores."""
        engine = self.engine
        prompt_ids = list(prompt_ids)
        engine.check_capacity(len(prompt_ids), max_new_tokens)
        if stats is None:
            stats = DecodeStats()
        stats.prompt_tokens = len(prompt_ids)
        stats.lossy = self.config.lossy_top_k > 1
        stats.exits_per_head = [0] * self.num_sources
        out: list[int] = []
        t_start = time.perf_counter()
        if max_new_tokens <= 0:
            return DecodeResult(out, stats)
        eos = set(int(e) for e in eos_token_ids)
        eos_list = sorted(eos)
        if do_sample and self.config.lossy_top_k > 1:
            raise ValueError("lossy_top_k > 1 is a greedy option; sampling is exact only (set lossy_top_k=1)")
        if do_sample and scorer is None:
            from transformers import LogitsProcessorList

            scorer = RowScorer(LogitsProcessorList(), prompt_ids, engine.view.vocab_size, engine.view.device)
        if scorer is not None:
            min_new_tokens = 0
        logits, final_before = engine.prefill(prompt_ids)
        scores = logits
        if scorer is not None:
            scores = scorer.scores([], [], logits[None])[0]
        elif min_new_tokens > 0 and eos_list:
            scores = logits.clone()
            scores[eos_list] = float("-inf")
        first = sample(torch.softmax(scores, -1)) if do_sample else int(scores.argmax())
        kept_logits = [logits] if collect_logits else None
        kept_scores = [scores] if collect_logits else None
        stats.prefill_time = time.perf_counter() - t_start
        if self.lookup is not None:
            self.lookup.reset(prompt_ids)
        self._drafter = None
        if self.draft_engine is not None:
            self.draft_engine.check_capacity(len(prompt_ids), max_new_tokens)
            self._drafter = DraftModelDrafter(self.draft_engine, self.config.draft_confidence, prompt_ids)
        done = self._commit(out, stats, [first], [SOURCE_MODEL], max_new_tokens, eos, stop, on_commit)
        position = len(prompt_ids)
        costs = engine.step_costs if self.config.adaptive else (1.0,) * (engine.width + 1)
        policy = DraftBudget(costs, self.max_draft, self.config.adaptive)
        if self._drafter is not None:  # a draft-model token costs its step, in main-model steps
            policy.draft_costs["draft_model"] = (
                self.draft_engine.one_row_seconds / engine.one_row_seconds if self.config.adaptive else 0.0)
        # logits processors score a row from its history, which in a tree is its path, not
        # the rows before it: sampling and processors verify chains
        use_tree = self.use_tree and not do_sample and scorer is None
        if self.config.tree == "on" and (do_sample or scorer is not None):
            raise ValueError("tree='on' is a greedy option without logits processors: speculative "
                             "sampling and logits processors verify chains (use tree='auto' or 'off')")
        while not done and use_tree:
            budget = min(self.max_draft, max_new_tokens - len(out) - 1)
            t0 = time.perf_counter()
            tree, branches = self.draft_tree(out, final_before, budget, eos, stats, policy)
            t1 = time.perf_counter()
            masked_rows = max(0, min_new_tokens - len(out))
            model_tokens, logits, scores, finals = self.verify_tree(tree, position, masked_rows, eos_list)
            tokens, sources, rows = self.commit_tree(tree, position, model_tokens)
            stats.verify_time += time.perf_counter() - t1
            stats.draft_time += t1 - t0
            stats.cycles += 1
            final_before = finals[rows[-1]]
            stats.accepted += len(tokens) - 1
            stats.off_chain_cycles += any(tree.depth[r] != r for r in rows)
            accepted = set(rows)
            for drafter, branch in branches.items():
                policy.update(drafter, len(branch), sum(r in accepted for r in branch))
            if tree.predicted:
                policy.calibration(self._drafter_key).update(
                    sum(tree.predicted.values()), sum(r in accepted for r in tree.predicted))
            position += len(tokens)
            before = len(out)
            done = self._commit(out, stats, tokens, sources, max_new_tokens, eos, stop, on_commit)
            if collect_logits:
                kept = rows[: len(out) - before]
                kept_logits.extend(logits[kept])
                kept_scores.extend(scores[kept])
        while not done:
            block = _Block(engine, out[-1], position)
            block.final_before = final_before  # final hidden of the row that produced out[-1]
            block.committed = out
            budget = min(self.max_draft, max_new_tokens - len(out) - 1)
            t0 = time.perf_counter()
            self.draft_block(block, budget, eos, stats, policy, scorer if do_sample else None)
            t1 = time.perf_counter()
            masked_rows = max(0, min_new_tokens - len(out))
            model_tokens, logits, scores, finals = self.verify_block(block, masked_rows, eos_list, scorer)
            if do_sample:
                tokens, sources = self.sampled_tokens(block, scores)
            elif self.config.lossy_top_k > 1 and len(block) > 1:
                topk = scores[: len(block) - 1].topk(self.config.lossy_top_k, -1).indices.tolist()
                tokens, sources = self.accepted_tokens(block, model_tokens, topk)
            else:
                tokens, sources = self.accepted_tokens(block, model_tokens)
            stats.verify_time += time.perf_counter() - t1
            stats.draft_time += t1 - t0
            stats.cycles += 1
            final_before = finals[len(tokens) - 1]
            stats.accepted += len(tokens) - 1
            if len(block) > 1:
                drafter = SOURCE_COPY if block.sources[1] == SOURCE_COPY else self._drafter_key
                policy.update(drafter, len(block) - 1, len(tokens) - 1)
            position += len(tokens)
            before = len(out)
            done = self._commit(out, stats, tokens, sources, max_new_tokens, eos, stop, on_commit)
            if collect_logits:
                kept = len(out) - before
                kept_logits.extend(logits[:kept])
                kept_scores.extend(scores[:kept])
        stats.new_tokens = len(out)
        stats.total_time = time.perf_counter() - t_start
        return DecodeResult(out, stats, kept_logits, kept_scores)

    def _commit(self, out, stats, tokens, sources, max_new_tokens, eos, stop, on_commit) -> bool:
        """Append tokens one by one, stopping exactly where AR would. True when done."""
        done = False
        kept = 0
        for token in tokens:
            out.append(token)
            stats.sources.append(sources[kept])
            kept += 1
            if token in eos or len(out) >= max_new_tokens or (stop is not None and stop(out)):
                done = True
                break
        if self.lookup is not None:
            self.lookup.extend(tokens[:kept])
        if on_commit is not None:
            on_commit(tokens[:kept])
        return done
