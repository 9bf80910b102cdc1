"""How many drafts a cycle should take: measured step cost vs live acceptance.

A verification of n rows costs `step_cost(n)` AR steps. In the engine's micro row layout
(MKL, this CPU) a step's GEMMs run in chunks of 2-3 rows and each chunk re-reads the
weights, so 1-3 rows cost one step and every further chunk adds ~CHUNK_COST: measured on
SmolLM2-135M fp32 (scripts/bench.py --widths, 1 thread): 1-3 rows 1.0x, 4 rows 1.57x,
6 rows 1.70x, 8 rows 2.13x. In the fixed layout every step costs the same.

With a per-draft acceptance rate a (each draft accepted given the previous one was), k
drafts commit 1 + a + a^2 + ... + a^k tokens in expectation; the budget is the k that
maximises expected tokens per unit of step cost. `a` is learnt online per drafter
(decayed counts of accepted drafts and first rejections).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.programs import row_chunks

# Extra cost of each GEMM chunk beyond the first, in AR steps (measured, see above).
CHUNK_COST = 0.55
# Decay of the acceptance counts per cycle: the estimate follows the last ~10 cycles.
DECAY = 0.9
# Prior acceptance before any feedback, and its weight in pseudo-observations.
PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 2.0


def step_cost(rows: int, layout: str) -> float:
    """Cost of a step of `rows` rows in AR steps."""
    if layout == "fixed":
        return 1.0
    return 1.0 + CHUNK_COST * (len(row_chunks(max(rows, 2))) - 1)


@dataclass
class AcceptanceTracker:
    """Decayed counts of one drafter's accepted drafts and first rejections."""

    successes: float = PRIOR_ACCEPT * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT

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
class DraftBudget:
    """Per-drafter budgets from the layout's cost curve and live acceptance."""

    layout: str
    max_draft: int
    trackers: dict[str, AcceptanceTracker] = field(default_factory=dict)

    def tracker(self, drafter: str) -> AcceptanceTracker:
        if drafter not in self.trackers:
            self.trackers[drafter] = AcceptanceTracker()
        return self.trackers[drafter]

    def budget(self, drafter: str) -> int:
        """Drafts that maximise expected committed tokens per unit of verification cost."""
        a = self.tracker(drafter).rate
        best_k, best_value, expected, term = 0, 1.0, 1.0, 1.0
        for k in range(1, self.max_draft + 1):
            term *= a
            expected += term
            value = expected / step_cost(k + 1, self.layout)
            if value > best_value + 1e-9:
                best_k, best_value = k, value
        return best_k

    def update(self, drafter: str, drafted: int, accepted: int) -> None:
        self.tracker(drafter).update(drafted, accepted)

    def rate(self, drafter: str) -> float:
        """Live per-draft acceptance estimate of a drafter."""
        return self.tracker(drafter).rate
