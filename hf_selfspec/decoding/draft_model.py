"""Classical speculative decoding's drafter: a smaller model with the same tokenizer.

The draft model runs in its own `Engine` (own static KV cache). Its cache always holds a
prefix of prompt + committed tokens + its own latest drafts (`seen`); before drafting it
catches up on the committed tokens it has not seen (the model's correction or bonus token,
and copies accepted from prompt lookup), all in one multi-row pass, then drafts greedily,
one AR step per further draft, until its confidence (top probability) falls below a
threshold, an EOS is drafted or the budget is spent (HF's assistant_confidence_threshold).
Drafts it made that were accepted need no second pass: they are already in its cache.

Whatever it drafts, the main model verifies every row, so the output is exactly the main
model's (greedy: its greedy tokens; sampling: speculative sampling with the draft model's
processed distribution as q).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..engine.interface import StepPrograms
from .candidates import Candidate, DraftContext, Proposal, Source

SOURCE_DRAFT_MODEL = Source.DRAFT_MODEL.value  # source label of an accepted draft-model token


def check_draft_model(model, draft_model) -> None:
    """Refuse, before any work, a draft model the engine cannot run or that cannot share
    the main model's token ids."""
    if draft_model is model:
        return
    from ..engine.layered import SUPPORTED_MODEL_TYPES, LayeredModel, text_config

    LayeredModel._check_features(text_config(draft_model), 1)
    if getattr(draft_model.config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        LayeredModel(draft_model, 1)  # raises UnsupportedModelError naming the architecture
    main_vocab = model.get_output_embeddings().weight.shape[0]
    draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
    if main_vocab != draft_vocab:
        raise ValueError(
            f"the draft model has {draft_vocab} output tokens, the model {main_vocab}: a draft model "
            "must use the same tokenizer (same token ids); pick a smaller model of the same family"
        )
    if draft_model.device != model.device:
        raise ValueError(f"the draft model is on {draft_model.device}, the model on {model.device}: "
                         "put both on the same device")


class DraftModelDrafter:
    """Drafts from a smaller model in its own engine; one instance per request."""

    key = SOURCE_DRAFT_MODEL  # its key in the draft budget

    def __init__(self, engine: StepPrograms, confidence: float):
        self.engine = engine
        self.confidence = confidence
        self.start([])

    def start(self, prompt: Sequence[int]) -> None:
        """A new request: forget the draft cache's contents."""
        self.prompt = list(prompt)
        self.seen: list[int] = []  # tokens whose KV is in the draft cache, positions 0..len-1
        self._logits: torch.Tensor | None = None  # [V] logits after seen[-1]
        self._committed = 0  # leading tokens of `seen` that are committed (never change)

    def accepted(self, tokens: Sequence[int]) -> None:
        pass  # the next proposal catches the draft cache up on the committed tokens

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        """Up to `budget` drafts after the committed tokens (a chain)."""
        drafts, qs = self.draft(ctx.committed, budget, ctx.eos, ctx.scorer)
        return Proposal(self.key, [Candidate(j - 1, t, Source.DRAFT_MODEL, j, q=q)
                                   for j, (t, q) in enumerate(zip(drafts, qs))])

    def _catch_up(self, committed: Sequence[int]) -> None:
        """Bring the draft cache to prompt + `committed` (the tokens committed so far)."""
        if not self.seen:  # a new request: prompt + first token through the engine's prefill
            self.seen = self.prompt + list(committed)
            self._logits, _ = self.engine.prefill(self.seen)
            self._committed = len(self.seen)
            return
        P = len(self.prompt)
        total = P + len(committed)
        common = self._committed  # committed tokens never change: compare only the drafts
        limit = min(len(self.seen), total)
        while common < limit and self.seen[common] == committed[common - P]:
            common += 1
        if common == total == len(self.seen):
            return
        self._committed = total
        if common == total:  # every token seen, but logits were taken further on
            common -= 1
        engine, width = self.engine, self.engine.width
        new = list(committed[common - P:])
        for lo in range(0, len(new), width):
            chunk = new[lo: lo + width]
            start = common + lo
            meta = engine.make_meta(range(start, start + len(chunk)))
            logits, _, _ = engine.verify(engine.embed(chunk), 0, meta)
            self._logits = logits[-1]
        del self.seen[common:]
        self.seen.extend(new)

    @torch.no_grad()
    def draft(self, committed: Sequence[int], budget: int, eos: set[int] | frozenset[int],
              scorer=None) -> tuple[list[int], list[torch.Tensor | None]]:
        """Up to `budget` drafts after prompt + `committed`. Greedy: argmax drafts. With a
        scorer (sampling): each draft is sampled from the draft model's distribution
        processed like the main model's; returns (drafts, q per draft)."""
        from .sampling import sample

        drafts: list[int] = []
        qs: list[torch.Tensor | None] = []
        if budget <= 0:
            return drafts, qs
        self._catch_up(committed)
        engine = self.engine
        while True:
            logits = self._logits
            if scorer is None:
                conf, token = torch.softmax(logits.float(), -1).max(-1)
                if float(conf) < self.confidence:
                    break
                token, q = int(token), None
            else:
                q = scorer.draft_distribution(committed, drafts, logits, None)
                if q is None or float(q.max()) < self.confidence:
                    break
                token = sample(q)
            drafts.append(token)
            qs.append(q)
            if len(drafts) >= budget or token in eos:
                break
            # one AR step of the draft model (engine.verify: no second argmax to the host)
            logits, _, _ = engine.verify(engine.embed([token]), 0, engine.make_meta([len(self.seen)]))
            self._logits = logits[0]
            self.seen.append(token)
        return drafts, qs
