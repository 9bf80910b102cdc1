"""How many drafts a cycle should take: measured step cost vs live acceptance, with a guard.

Costs are in engine-AR steps (one committed token without drafting). In the engine's micro
row layout (MKL, this CPU) a step's GEMMs run in chunks of 2-3 rows; a 1-row step is
padded to 2 rows, so AR already pays for a chunk. Measured on SmolLM2-135M fp32
(scripts/bench.py --widths, 2 threads, verify over 30 layers): 2 rows 1.07x, 3 rows 1.09x,
4 rows 1.69x, 6 rows 1.81x, 8 rows 2.23x one row. Drafting adds its own cost: a top-layer
head step ~3% of a step (scripts/head_study.py draft_cost), a copy ~0. In the fixed layout
(W rows always, CUDA) every step costs the same.

With a per-draft acceptance rate a (each draft accepted given the previous one was), k
drafts commit 1 + a + a^2 + ... + a^k tokens in expectation; the budget is the k that
maximises expected tokens per unit of cost, and 0 (a plain AR step) when no k beats AR.
`a` is learnt online per drafter (decayed counts of accepted drafts and first rejections).

The guard: a drafter whose budget is 0 is probed with one draft every PROBE_EVERY cycles,
so the controller notices when drafting pays again; on text where drafts are never
accepted a request costs AR plus ~(probe cost / PROBE_EVERY) ~ 0.6%.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.programs import row_chunks

# Verification cost of n rows (index n) in engine-AR steps, micro layout (measured, above).
MICRO_ROW_COST = (1.0, 1.0, 1.07, 1.09, 1.69, 1.75, 1.81, 2.02, 2.23)
# Beyond the table: each further GEMM chunk adds ~this much (measured slope 6 -> 8 rows).
CHUNK_COST = 0.42
# Cost of drafting one token, in AR steps, per drafter kind.
DRAFT_COST = {"head": 0.03, "copy": 0.0}
# Decay of the acceptance counts per cycle: the estimate follows the last ~10 cycles.
DECAY = 0.9
# Prior acceptance before any feedback, and its weight in pseudo-observations.
PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 2.0
# A drafter that does not pay is probed with one draft every this many cycles.
PROBE_EVERY = 16


def step_cost(rows: int, layout: str) -> float:
    """Cost of verifying `rows` rows, in engine-AR steps."""
    if layout == "fixed":
        return 1.0
    if rows < len(MICRO_ROW_COST):
        return MICRO_ROW_COST[max(rows, 1)]
    extra = len(row_chunks(rows)) - len(row_chunks(len(MICRO_ROW_COST) - 1))
    return MICRO_ROW_COST[-1] + CHUNK_COST * extra


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


def best_drafts(rate: float, max_draft: int, layout: str, draft_cost: float) -> int:
    """The k in 0..max_draft with the most expected tokens per unit of cost."""
    best_k, best_value, expected, term = 0, 1.0 / step_cost(1, layout), 1.0, 1.0
    for k in range(1, max_draft + 1):
        term *= rate
        expected += term
        value = expected / (step_cost(k + 1, layout) + k * draft_cost)
        if value > best_value + 1e-9:
            best_k, best_value = k, value
    return best_k


@dataclass
class DraftBudget:
    """Per-drafter budgets from the layout's cost curve and live acceptance."""

    layout: str
    max_draft: int
    adaptive: bool = True  # False: every drafter may always draft max_draft (heads' thresholds decide)
    trackers: dict[str, AcceptanceTracker] = field(default_factory=dict)

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
        k = best_drafts(tracker.rate, self.max_draft, self.layout, DRAFT_COST.get(drafter, 0.0))
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
