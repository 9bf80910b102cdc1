"""What every request reports: why it was fast or not (DESIGN.md section 7)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Source labels of output tokens.
SOURCE_MODEL = "model"  # the model's own token (correction or bonus after verification)
SOURCE_COPY = "copy"  # a prompt-lookup draft the model accepted


def head_source(index: int) -> str:
    """Source label of a draft from head `index` (0 = shallowest) that was accepted."""
    return f"head{index}"


@dataclass
class DecodeStats:
    """Per-request statistics. Times in seconds."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    head_evaluations: int = 0
    exits_per_head: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    lossy: bool = False  # True when a lossy acceptance rule was on (not the model's own output)
    # draft trees: cycles whose accepted path left the tree's first branch (a sibling or the
    # other drafter's branch won: tokens a chain would not have committed)
    off_chain_cycles: int = 0

    @property
    def decode_time(self) -> float:
        return max(self.total_time - self.prefill_time, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.total_time, 1e-9)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification cycle (accepted drafts + 1)."""
        return self.new_tokens / max(self.cycles, 1)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def host_time(self) -> float:
        """Decode time spent neither drafting nor verifying (bookkeeping, stopping checks)."""
        return max(self.decode_time - self.draft_time - self.verify_time, 0.0)

    def source_counts(self) -> dict[str, int]:
        return dict(Counter(self.sources))

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "tokens_per_second": round(self.tokens_per_second, 3),
            "prefill_time": round(self.prefill_time, 4),
            "cycles": self.cycles,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": round(self.tau, 3),
            "acceptance": round(self.acceptance, 3),
            "head_evaluations": self.head_evaluations,
            "exits_per_head": list(self.exits_per_head),
            "source_counts": self.source_counts(),
            "draft_time": round(self.draft_time, 4),
            "verify_time": round(self.verify_time, 4),
            "host_time": round(self.host_time, 4),
            "total_time": round(self.total_time, 4),
            "lossy": self.lossy,
            "off_chain_cycles": self.off_chain_cycles,
        }

    def summary(self) -> str:
        return (
            ("LOSSY: " if self.lossy else "") + f"{self.new_tokens} tokens in {self.total_time:.2f} s ({self.tokens_per_second:.1f} tok/s), "
            f"prefill {self.prefill_time:.2f} s, {self.cycles} cycles, tau {self.tau:.2f}, "
            f"accepted {self.accepted}/{self.drafted} drafts, sources {self.source_counts()}"
        )
