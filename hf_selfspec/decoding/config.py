"""DecodeConfig: the knobs of the speculative loop, validated once, here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LookupMode = Literal["off", "only", "first", "fallback"]
LOOKUP_MODES = ("off", "only", "first", "fallback")
TreeMode = Literal["auto", "on", "off"]
TREE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class DecodeConfig:
    """Knobs of the speculative loop (decoding/cycle.py).

    max_draft:  drafts per cycle (None: width - 1, the most one verification can take)
    lookup:     prompt lookup: "off"; "only" (exact PLD, no heads); "first" (copy when the
                n-gram index has a match and copies are accepted at least as often as head
                drafts, else heads); "fallback" (heads, copy when no head drafts)
    lookup_max_ngram / lookup_min_ngram: the longest / shortest suffix n-gram prompt lookup
                matches (longest tried first)
    thresholds: head confidence thresholds (one per head, or one for all); None = the
                heads' calibrated thresholds
    gamma:      exit heads: stop drafting when the predicted probability that every draft so
                far is accepted (product of calibrated acceptances) falls below gamma;
                0 = never
    adaptive:   True: the draft budget follows live acceptance and the measured step costs
                (policy.py), so where drafts do not pay the loop takes plain AR steps (with
                a one-draft probe every 16 cycles); False: draft whatever the thresholds
                allow, up to max_draft, and in trees keep every row the drafters propose
                (to measure heads, or force branches in tests)
    lossy_top_k: LOSSY, opt-in. 1 (default) = exact: a draft is accepted only when it is the
                model's token. k > 1 accepts a draft that is among the model's top-k at its
                position, so the output is no longer the model's greedy output (it is still
                a text the model ranks top-k at every token). Greedy chains only.
    draft_confidence: with a draft model (classical speculative decoding), stop drafting at
                the first token whose draft-model probability is below this (HF's
                assistant_confidence_threshold); 0 = draft up to the budget.
    tree:       draft trees (tree.py): the top-layer heads' dynamic tree (at each step the
                `tree_beam` likeliest nodes, by path probability, are expanded by their
                `siblings` + 1 likeliest next tokens; nodes off the heads' top-1 chain need
                path probability >= sibling_min_prob) and the prompt-lookup copy, merged as
                a trie and verified in one pass, rows kept only while they pay on the
                measured step costs (policy.select_tree_rows).
                "auto" (default): trees where the engine supports them (kernel row layout)
                and decoding is exact greedy with top-layer heads and/or lookup, chains
                elsewhere (sampling, logits processors, exit heads, a draft model, other
                layouts). "on": trees, and an error where they cannot be used; "off": chains.
                Measured against chains: docs/head_study.md.
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
