"""What every request reports: why it was fast or not (model.selfspec_stats; docs/usage.md)."""

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
    """What one `generate(..., assistant="self")` call did and where its time went:
    `model.selfspec_stats` after the call (filled live while it runs, so a streamer can
    read `sources`). Times are wall-clock seconds. For a batch, the sums over its rows.

    prompt_tokens:    prompt length (unpadded)
    new_tokens:       tokens generated
    cycles:           verification cycles: model passes that committed tokens (an AR step
                      is a cycle with no drafts)
    drafted:          draft tokens proposed to the model (heads, prompt-lookup copies, a
                      draft model)
    accepted:         drafts the model verified (the exact rule: its own token)
    head_evaluations: head calls spent drafting: exit heads, one per head run on a row;
                      top-layer draft heads, one per drafting call (a chain or a tree)
    exits_per_head:   drafts per head: exit heads, the head a row exited at (0 =
                      shallowest); top-layer draft heads, the draft step k (headK)
    sources:          per new token, where it came from: "model" (the model's own token,
                      after a verification), "copy" (an accepted prompt-lookup draft),
                      "headK" (an accepted draft of head K), "draft_model"
    prefill_time:     the prompt's pass through the model
    draft_time:       drafting (heads, lookup, draft model)
    verify_time:      the model's verification passes
    total_time:       the whole decode, prefill included (what tokens_per_second divides)
    build_time:       building the engine in this call (row-layout self-test, KV cache,
                      step-cost measurement: the first call, or a request larger than the
                      KV cache), NOT part of total_time or tokens_per_second
    lossy:            a lossy acceptance rule was on (DecodeConfig.lossy_top_k > 1): the
                      output is not the model's own greedy output
    off_chain_cycles: draft trees only: cycles whose accepted path left the tree's first
                      branch (a sibling or the other drafter's branch won: tokens a chain
                      would not have committed)

    Derived: tokens_per_second (new_tokens / total_time), tau (new_tokens / cycles: tokens
    per model pass), acceptance (accepted / drafted), decode_time (total minus prefill),
    host_time (decode time neither drafting nor verifying). `summary()` is one line of
    these; `as_dict()` all of them, rounded, for JSON.
    """

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
    lossy: bool = False
    off_chain_cycles: int = 0
    build_time: float = 0.0

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
            "build_time": round(self.build_time, 4),
        }

    def summary(self) -> str:
        """One line: tokens, time and tokens/s (engine build excluded, shown apart), prefill,
        cycles, tau, accepted / drafted, token sources."""
        build = f" (+ engine build {self.build_time:.2f} s, once)" if self.build_time > 0 else ""
        return (
            ("LOSSY: " if self.lossy else "") + f"{self.new_tokens} tokens in {self.total_time:.2f} s "
            f"({self.tokens_per_second:.1f} tok/s){build}, "
            f"prefill {self.prefill_time:.2f} s, {self.cycles} cycles, tau {self.tau:.2f}, "
            f"accepted {self.accepted}/{self.drafted} drafts, sources {self.source_counts()}"
        )
