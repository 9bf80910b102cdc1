"""Which rows pay: how many drafts a cycle takes, and which rows of a draft tree are kept.

Costs are in engine-AR steps (one committed token without drafting): the engine measures
the cost of verifying 1..W rows once, on the machine it runs on (`engine.costs.step_costs()`),
because the curve differs a lot between CPUs (docs/benchmarks.md). Drafting adds its own
cost (DRAFT_COST: a top-layer head step is a few percent of a step, a copy ~0).

With a per-draft acceptance rate a (each draft accepted given the previous one was), k
drafts commit 1 + a + a^2 + ... + a^k tokens in expectation; the budget is the k that
maximises expected tokens per unit of cost, and 0 (a plain AR step) when no k beats AR.
`a` is learnt online per drafter (decayed counts of accepted drafts and first rejections).

The guard: a drafter whose budget is 0 is probed with one draft every PROBE_EVERY cycles,
so the controller notices when drafting pays again; on text where drafts are never
accepted a request costs AR plus (probe cost - 1) / PROBE_EVERY of a step.

`select_tree_rows` is the same rule for trees, a pure function of the proposals, the live
rates and the cost curve: rows are taken likeliest first while expected tokens per unit
of verification cost grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .candidates import Candidate, Source
from .tree import DraftTree

# Cost of drafting one token, in AR steps, per drafter kind.
DRAFT_COST = {"head": 0.04, "copy": 0.0}
# Decay of the acceptance counts per cycle: the estimate follows the last ~10 cycles.
DECAY = 0.9
# Prior acceptance before any feedback, and its weight in pseudo-observations.
PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 2.0
# A drafter that does not pay is probed with one draft every this many cycles.
PROBE_EVERY = 16


@dataclass
class AcceptanceTracker:
    """Decayed counts of one drafter's accepted drafts and first rejections."""

    successes: float = PRIOR_ACCEPT * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT
    idle: int = 0  # cycles since the budget last allowed a draft

    @property
    def rate(self) -> float:
        return self.successes / self.trials

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        rejected = 1 if accepted < drafted else 0
        self.successes = DECAY * self.successes + accepted
        self.trials = DECAY * self.trials + accepted + rejected


@dataclass
class ProbabilityCalibration:
    """Decayed sums of a drafter's own probabilities for the rows it put in trees and of
    those rows' acceptances: `scale` turns its probabilities into expected acceptances
    (trained heads' path probabilities over-predict a little on held-out text)."""

    predicted: float = PRIOR_WEIGHT
    observed: float = PRIOR_WEIGHT

    @property
    def scale(self) -> float:
        return min(max(self.observed / self.predicted, 0.2), 2.0)

    def update(self, predicted: float, observed: float) -> None:
        if predicted <= 0.0:
            return
        self.predicted = DECAY * self.predicted + predicted
        self.observed = DECAY * self.observed + observed


def best_drafts(rate: float, max_draft: int, costs: Sequence[float], draft_cost: float) -> int:
    """The k in 0..max_draft with the most expected tokens per unit of cost; costs[n] is
    the cost of verifying n rows in AR steps."""
    best_k, best_value, expected, term = 0, 1.0 / costs[1], 1.0, 1.0
    for k in range(1, min(max_draft, len(costs) - 2) + 1):
        term *= rate
        expected += term
        value = expected / (costs[k + 1] + k * draft_cost)
        if value > best_value + 1e-9:
            best_k, best_value = k, value
    return best_k


@dataclass
class DraftBudget:
    """Per-drafter budgets from the layout's cost curve and live acceptance."""

    costs: Sequence[float]  # verify cost of n rows in AR steps (EngineCosts.step_costs)
    max_draft: int
    adaptive: bool = True  # False: every drafter may always draft max_draft (heads' thresholds decide)
    trackers: dict[str, AcceptanceTracker] = field(default_factory=dict)
    # cost of one draft per drafter, in AR steps (a draft model's: its measured step time)
    draft_costs: dict[str, float] = field(default_factory=lambda: dict(DRAFT_COST))
    calibrations: dict[str, ProbabilityCalibration] = field(default_factory=dict)

    def tracker(self, drafter: str) -> AcceptanceTracker:
        if drafter not in self.trackers:
            self.trackers[drafter] = AcceptanceTracker()
        return self.trackers[drafter]

    def budget(self, drafter: str) -> int:
        """Drafts that maximise expected committed tokens per unit of cost; 0 means a plain
        AR step pays more, except for a one-draft probe every PROBE_EVERY cycles."""
        if not self.adaptive:
            return self.max_draft
        tracker = self.tracker(drafter)
        k = best_drafts(tracker.rate, self.max_draft, self.costs, self.draft_costs.get(drafter, 0.0))
        if k > 0:
            tracker.idle = 0
            return k
        tracker.idle += 1
        if tracker.idle >= PROBE_EVERY and self.max_draft > 0:
            tracker.idle = 0
            return 1
        return 0

    def update(self, drafter: str, drafted: int, accepted: int) -> None:
        self.tracker(drafter).update(drafted, accepted)

    def rate(self, drafter: str) -> float:
        """Live per-draft acceptance estimate of a drafter."""
        return self.tracker(drafter).rate

    def calibration(self, drafter: str) -> ProbabilityCalibration:
        """How a drafter's own probabilities compare with what was accepted (trees)."""
        if drafter not in self.calibrations:
            self.calibrations[drafter] = ProbabilityCalibration()
        return self.calibrations[drafter]


# A tree step of more rows than this (an engine whose weights stream in: a step costs about
# the same whatever its rows) drafts a wider tree: WIDE_TREE_ROWS_PER_BEAM rows per expanded
# node, WIDE_TREE_CHILDREN tokens per node at least, siblings down to WIDE_TREE_MIN_PROB; the
# rows that pay are still chosen by select_tree_rows on the measured costs.
WIDE_TREE_FROM = 16
WIDE_TREE_ROWS_PER_BEAM = 4
WIDE_TREE_CHILDREN = 6
WIDE_TREE_MIN_PROB = 0.01


def tree_shape(config, width: int) -> tuple[int, int, float]:
    """(children per node, beam, sibling minimum path probability) of the heads' dynamic
    tree for an engine `width` rows wide: the DecodeConfig's (siblings + 1, tree_beam,
    sibling_min_prob), widened on a wide engine so that dozens of candidates compete for
    its rows."""
    children, beam, min_prob = config.siblings + 1, config.tree_beam, config.sibling_min_prob
    if width < WIDE_TREE_FROM:
        return children, beam, min_prob
    return (max(children, WIDE_TREE_CHILDREN), max(beam, width // WIDE_TREE_ROWS_PER_BEAM),
            min(min_prob, WIDE_TREE_MIN_PROB))


@dataclass
class TreeRows:
    """The rows a tree cycle verifies, and each drafter's first-chain rows among them (what
    its live acceptance is updated with)."""

    tree: DraftTree
    branches: dict[str, list[int]]


def select_tree_rows(root: int, width: int, copy: Sequence[Candidate], heads: Sequence[Candidate], *,
                     copy_rate: float, heads_rate: float, heads_scale: float, heads_key: str,
                     costs: Sequence[float], adaptive: bool,
                     eos: frozenset[int] | set[int] = frozenset()) -> TreeRows:
    """Merge a prompt-lookup copy (a chain) and the heads' tree (candidates with path
    probabilities, likeliest first) into one trie of at most `width` rows under `root`.

    When the copy's live rate is at least the heads', its chain goes first (the tokens its
    own budget paid for); otherwise the heads' chain is first. Every other row is weighed by
    its expected acceptance (a head node: its path probability x the heads' live
    calibration `heads_scale`; the copy's j-th token: copy_rate^j), and a branch that
    leaves the first chain (another token at the same depth) only counts where that chain
    is wrong (x its miss rate); a copy that agrees with the heads' whole chain and goes on
    competes with nothing. Rows are added likeliest first, and the tree keeps the number
    of rows that maximises expected tokens per unit of verification cost (`costs[n]`: the
    cost of n rows); with adaptive=False every proposed row is kept. Chains stop after an
    EOS token."""
    tree = DraftTree(root, width)
    heads = list(heads)
    heads_first = not copy or (bool(heads) and copy_rate < heads_rate)
    expected = 1.0
    copy_rows: list[int] = []
    if not heads_first:  # the copy's chain (its policy budget already weighed its cost)
        for j, c in enumerate(copy):
            row = tree.add(copy_rows[-1] if copy_rows else 0, c.token, Source.COPY, j,
                           value=copy_rate ** (j + 1))
            if row is None:
                break
            copy_rows.append(row)
            expected += copy_rate ** (j + 1)
            if c.token in eos:
                break
        first_tokens = [tree.tokens[r] for r in copy_rows]
        miss = 1.0 - copy_rate
    else:
        first_tokens = [c.token for c in heads if c.on_chain]
        miss = 1.0 - heads_rate

    def leaves_first(step: int, token: int, parent_left: bool) -> bool:
        return parent_left or (step < len(first_tokens) and token != first_tokens[step])

    extras = []  # (weight, order, is_copy, index)
    left: list[bool] = []  # per head node: its path leaves the first chain (only the copy's can)
    for i, node in enumerate(heads):
        left.append(not heads_first and leaves_first(node.step, node.token,
                                                     node.parent >= 0 and left[node.parent]))
        extras.append((heads_scale * node.prob * (miss if left[-1] else 1.0), len(extras), False, i))
    if heads_first:
        copy_left = False
        for j, c in enumerate(copy):
            copy_left = leaves_first(j, c.token, copy_left)
            extras.append(((miss if copy_left else 1.0) * copy_rate ** (j + 1), len(extras), True, j))
            if c.token in eos:
                break
    extras.sort(key=lambda e: (-e[0], e[1]))
    best_rows, best_value = len(tree), expected / costs[len(tree)]
    node_rows: dict[int, int] = {}
    for weight, _order, is_copy, index in extras:
        if is_copy:
            if index != len(copy_rows):  # its parent did not make it
                continue
            parent, candidate = (copy_rows[-1] if copy_rows else 0), copy[index]
        else:
            candidate = heads[index]
            if candidate.parent >= 0 and candidate.parent not in node_rows:
                continue
            parent = node_rows[candidate.parent] if candidate.parent >= 0 else 0
        before = len(tree)
        row = tree.add(parent, candidate.token, candidate.source, candidate.step, value=weight)
        if row is None:
            break
        if is_copy:
            copy_rows.append(row)
        else:
            node_rows[index] = row
        if len(tree) > before:
            if not is_copy:
                tree.predicted[row] = candidate.prob
            expected += weight
            value = expected / costs[len(tree)]
            if value > best_value + 1e-9 or not adaptive:
                best_rows, best_value = len(tree), value
    tree.truncate(best_rows)
    branches: dict[str, list[int]] = {}
    if copy_rows:
        branches[Source.COPY.value] = [r for r in copy_rows if r < best_rows]
    if heads:
        chain_rows = [node_rows[i] for i, n in enumerate(heads) if n.on_chain and i in node_rows]
        branches[heads_key] = [r for r in chain_rows if r < best_rows]
    return TreeRows(tree, branches)
