"""How many drafts a cycle should take: measured step cost vs live acceptance, with a guard.

Costs are in engine-AR steps (one committed token without drafting): the engine measures
the cost of verifying 1..W rows once, on the machine it runs on (`Engine.step_costs`),
because the curve differs a lot between CPUs: on a 2-core Intel AVX-512 machine (micro
layout) 2 / 3 / 4 / 8 rows cost 1.07 / 1.09 / 1.69 / 2.23x one row; on a 2-core AMD EPYC
(AVX2) 2 / 3 rows cost ~1.4 / 1.7x in the gemv layout, 1.00 / 1.11x in the wx layout, and
in the wx4 layout (which the engine picks there) 2-4 rows cost one row and 8 rows ~1.7x.
Drafting adds its own cost: a top-layer
head step ~3-5% of a step (scripts/head_study.py draft_cost), a copy ~0.

With a per-draft acceptance rate a (each draft accepted given the previous one was), k
drafts commit 1 + a + a^2 + ... + a^k tokens in expectation; the budget is the k that
maximises expected tokens per unit of cost, and 0 (a plain AR step) when no k beats AR.
`a` is learnt online per drafter (decayed counts of accepted drafts and first rejections).

The guard: a drafter whose budget is 0 is probed with one draft every PROBE_EVERY cycles,
so the controller notices when drafting pays again; on text where drafts are never
accepted a request costs AR plus (probe cost - 1) / PROBE_EVERY of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

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
    those rows' acceptances: `scale` turns its probabilities into expected acceptances (the
    shipped heads' path probabilities over-predict by ~7% on held-out own replies)."""

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

    costs: Sequence[float]  # verify cost of n rows in AR steps (Engine.step_costs)
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
