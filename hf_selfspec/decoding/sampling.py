"""HF logits processing per block row, and exact speculative sampling over a chain.

`RowScorer` applies the request's own `LogitsProcessorList` (the list HF's generate() built:
min_new_tokens, repetition penalty, temperature, top-k, top-p, ...) to each row of a block
exactly as HF's decoding loop would: row j is scored with input_ids = the (padded) prompt
row + every committed token + the block's first j drafts. Greedy decoding takes the argmax of
these scores; sampling draws from their softmax, p.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over a chain of drafts
x_1..x_k, where x_j was drawn from a draft distribution q_j given the drafts before it:
accept x_j with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection draw the
token from norm(max(p_j - q_j, 0)) and stop; when all k are accepted draw a bonus token from
p_{k+1}. Each committed token is then distributed exactly as p, whatever q is. A head's
q_j is its reduced-vocabulary distribution put through the same processors (so temperature,
top-k, top-p shape the drafts as they shape p); a prompt-lookup copy is a point mass, so it
is accepted with probability p_j(x_j) and a rejection draws from p_j without x_j.

Random numbers come from torch's default generator of the logits' device, so
`torch.manual_seed(...)` before generate() makes the output reproducible. The draws differ
from HF's own sampling loop, so the tokens are not HF's for the same seed; their
distribution is (tests/test_sampling.py).
"""

from __future__ import annotations

import copy
import functools
from typing import Sequence

import torch

# Processors whose output is a function of (input_ids, scores) alone: applied to any row
# with that row's input_ids they give what HF would. Anything else is refused.
ROW_PROCESSORS = frozenset({
    "MinNewTokensLengthLogitsProcessor", "MinLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor",
    "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor",
    "InfNanRemoveLogitsProcessor", "LogitNormalization",
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
    # prefix_allowed_tokens_fn(batch_id, input_ids): by HF's contract a function of the row's
    # tokens (called here for drafted rows too, as HF's assisted decoding calls it)
    "PrefixConstrainedLogitsProcessor",
})
# Warpers whose output on a row depends only on its finite scores, not on token ids or
# input_ids: on a head's logits over its reduced vocabulary they shape q exactly as on the
# full row, where every other token is -inf (zero probability).
ID_FREE_WARPERS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"})
# Processors the greedy loop applies itself (EOS masking before min_new_tokens).
MIN_LENGTH_PROCESSORS = frozenset({"MinNewTokensLengthLogitsProcessor", "MinLengthLogitsProcessor"})


def row_processors(processors: Sequence, row: int, batch: int) -> list:
    """The processors HF built for a batch of `batch` rows, as row `row` alone sees them:
    the scorer calls them with that row's input_ids only ([1, n]). HF's repetition penalty
    holds one prompt_ignore_length per batch row (the row's left padding, which it does not
    penalise); it gets the row's own value, in a shallow copy (the caller's list is untouched).
    HF calls prefix_allowed_tokens_fn with each row's batch index: a row scored alone would
    pass 0, so it is called with `row` instead."""
    rows = []
    for processor in processors:
        if type(processor).__name__ == "PrefixConstrainedLogitsProcessor" and row:
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = functools.partial(
                _as_batch_row, processor._prefix_allowed_tokens_fn, row)
        ignore = getattr(processor, "prompt_ignore_length", None)
        if isinstance(ignore, torch.Tensor) and ignore.dim() == 1 and ignore.shape[0] == batch and batch > 1:
            processor = copy.copy(processor)
            processor.prompt_ignore_length = ignore[row: row + 1]
        rows.append(processor)
    return type(processors)(rows)  # a LogitsProcessorList stays one (it is what gets called)


def _as_batch_row(prefix_allowed_tokens_fn, row: int, _batch_id: int, input_ids: torch.Tensor):
    return prefix_allowed_tokens_fn(row, input_ids)


def unsupported_processors(processors: Sequence) -> list[str]:
    """Class names of the processors a block row cannot be scored with."""
    return [type(p).__name__ for p in processors if type(p).__name__ not in ROW_PROCESSORS]


class RowScorer:
    """The request's logits processors applied row by row, as HF's loop applies them."""

    def __init__(self, processors, prompt_row: Sequence[int], vocab_size: int, device):
        self.processors = processors
        self.prompt_row = [int(t) for t in prompt_row]
        self.vocab_size = vocab_size
        self.device = device
        # a head's q can be shaped on its reduced vocabulary alone (a sixth of the full row
        # here): only ID_FREE_WARPERS, so no processor reads token ids or input_ids
        self.id_free = all(type(p).__name__ in ID_FREE_WARPERS for p in processors)

    def _ids(self, committed: Sequence[int], drafts: Sequence[int]) -> torch.Tensor:
        return torch.tensor([self.prompt_row + list(committed) + list(drafts)], device=self.device)

    def scores(self, committed: Sequence[int], drafts: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """logits [n, V] of rows 0..n-1 (row j follows drafts[:j]) -> processed scores [n, V] fp32."""
        n = logits.shape[0]
        ids = self._ids(committed, drafts[: n - 1])
        base = len(self.prompt_row) + len(committed)
        rows = [self.processors(ids[:, : base + j], logits[j: j + 1].float().clone()) for j in range(n)]
        return rows[0] if n == 1 else torch.cat(rows)

    def draft_distribution(self, committed: Sequence[int], drafts: Sequence[int],
                           reduced_logits: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor | None:
        """A head's q after `drafts`: its logits over V_k [V_k] placed in the full vocabulary
        (vocab_ids None: logits over the full vocabulary already),
        processed like the model's, softmaxed -> [V]; None when the processors leave it no
        token (then the head does not draft)."""
        if vocab_ids is not None and self.id_free:
            # q need not be the model's p, only the distribution the draft is drawn from (the
            # acceptance test reads the same q): warped on V_k alone, placed in [V] below
            scored = self.processors(None, reduced_logits.float().reshape(1, -1).clone())
        else:
            if vocab_ids is None:  # logits over the whole vocabulary (a draft model)
                full = reduced_logits.float().reshape(1, -1).clone()
            else:
                full = torch.full((1, self.vocab_size), float("-inf"), device=self.device)
                full[0, vocab_ids] = reduced_logits.float()
            scored, vocab_ids = self.processors(self._ids(committed, drafts), full), None
        if not bool(torch.isfinite(scored).any()):
            return None
        probs = torch.softmax(scored[0], dim=-1)
        if vocab_ids is None:
            return probs
        q = torch.zeros(self.vocab_size, device=probs.device)
        q[vocab_ids] = probs
        return q


def sample(probs: torch.Tensor) -> int:
    """One token from a [V] vector of non-negative weights (not necessarily normalised), by
    inverting their cumulative sum at one uniform draw: token i is drawn with probability
    w_i / sum(w), and a zero weight spans an empty interval, so it is never drawn. One
    float64 cumsum over V costs a fraction of torch.multinomial's set-up for a single
    sample over a large vocabulary."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, device=probs.device) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True))
    if token >= len(cdf):  # u rounded up to the total: the last token of positive weight
        token = int(torch.nonzero(probs).max())
    return token


def accept_drafts(p: torch.Tensor, drafts: Sequence[int], q_rows: Sequence[torch.Tensor | None]) -> list[bool]:
    """Speculative acceptance test of every draft at once: draft j is accepted with
    probability min(1, p_j(x_j) / q_j(x_j)) (q_j = None: a point mass, q_j(x_j) = 1).
    p [n, V] probabilities of the block's rows; the caller keeps the prefix up to the first
    False."""
    k = len(drafts)
    index = torch.tensor(list(drafts), device=p.device)
    px = p[torch.arange(k, device=p.device), index]
    qx = torch.stack([torch.ones((), device=p.device) if q is None else q[x]
                      for q, x in zip(q_rows, drafts)])
    u = torch.rand(k, device=p.device)
    return (u * qx < px).tolist()


def residual(p: torch.Tensor, q: torch.Tensor | None, rejected: int) -> torch.Tensor:
    """norm(max(p - q, 0)) (unnormalised weights) after draft `rejected` was refused."""
    if q is None:
        r = p.clone()
        r[rejected] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    if not bool(r.sum() > 0):  # p == q on its support: a rejection has probability 0
        return p
    return r


def speculative_tokens(p: torch.Tensor, drafts: Sequence[int],
                       q_rows: Sequence[torch.Tensor | None]) -> tuple[int, int]:
    """Accepted drafts m and the token after them: (m, token), committed = drafts[:m] + [token]."""
    k = len(drafts)
    m = k
    if k:
        accepted = accept_drafts(p[:k], drafts, q_rows)
        m = accepted.index(False) if False in accepted else k
    if m < k:
        return m, sample(residual(p[m], q_rows[m], drafts[m]))
    return m, sample(p[k])
