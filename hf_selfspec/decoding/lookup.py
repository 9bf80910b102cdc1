"""Prompt-lookup drafting (PLD) with an incremental n-gram index.

Prompt lookup copies drafts out of the text itself: if the last n tokens occurred before,
the tokens that followed that earlier occurrence are a good guess for what follows now
(Saxena, "Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding; HF's
`PromptLookupCandidateGenerator`). Drafts are only proposals: the verifier decides, so
the drafter never affects exactness, only the acceptance rate.

HF rebuilds every sliding window of the whole sequence on every call (O(L) per step).
Here each n-gram is indexed once, when the token that ends it stops being the last one,
so the work per committed token does not depend on the sequence length.

Complexity, with N = max_ngram - min_ngram + 1 indexed sizes and k drafted tokens:

* `extend` of m tokens: O(m * N * max_ngram) (one tuple key of length <= max_ngram per
  size per token), i.e. amortised O(1) per token in the sequence length.
* `propose`: O(N * max_ngram + k) (one dict look-up per size, then one list slice).
* memory: O(N * L) dict entries for a sequence of L tokens.

Which occurrence wins: the *latest* earlier one, so the copy follows the most recent
context (e.g. the last version of a line being edited). Note that HF's
`PromptLookupCandidateGenerator` takes the *earliest* match instead.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence


def _as_token_list(tokens: Sequence[int]) -> list[int]:
    """Tokens as a list of Python ints; accepts lists, tuples and 1-D tensors/arrays."""
    if hasattr(tokens, "tolist"):  # torch.Tensor / numpy.ndarray: one C-level conversion
        tokens = tokens.tolist()
    out = []
    for t in tokens:
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))  # ints and integer scalars (numpy, 0-d tensors)
        except TypeError:
            raise ValueError(f"tokens must be a flat sequence of ints, got element {t!r}") from None
    return out


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class PromptLookup:
    """Drafter that copies the continuation of the longest matching suffix n-gram.

    For every size n in [min_ngram, max_ngram] the index maps an n-gram to the position
    of its last token, keeping the latest such position. Only n-grams that end strictly
    before the last token are indexed, so any match has at least one continuation token
    and the current suffix never matches itself.

    Args:
        max_ngram: longest suffix tried first.
        min_ngram: shortest suffix tried last (1 = match on a single token).
        max_draft: default number of tokens `propose` returns at most.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 10):
        self.max_ngram = _check_int("max_ngram", max_ngram, 1)
        self.min_ngram = _check_int("min_ngram", min_ngram, 1)
        self.max_draft = _check_int("max_draft", max_draft, 1)
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self._tokens: list[int] = []
        # _index[n]: n-gram tuple -> end position j (inclusive) of its latest occurrence
        # with j < len(tokens) - 1.
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self.reset([])

    def __len__(self) -> int:
        return len(self._tokens)

    def reset(self, tokens: Sequence[int]) -> None:
        """Forget everything and index `tokens` (the prompt). O(len(tokens))."""
        self._tokens = []
        self._index = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and index the n-grams that are no longer the suffix."""
        seq = self._tokens
        for t in _as_token_list(tokens):
            seq.append(t)
            self._index_end(len(seq) - 2)  # the previous last token now has a successor

    def propose(self, max_tokens: int | None = None) -> list[int]:
        """Draft tokens: the continuation of the longest suffix seen before.

        Tries n = max_ngram down to min_ngram; for the first n whose suffix n-gram occurred
        earlier, returns the tokens after its latest earlier occurrence, at most
        `max_tokens` (default `max_draft`) and fewer where the sequence ends first.

        Returns:
            list[int] of length 0..max_tokens; [] when no suffix matches.
        """
        k = self.max_draft if max_tokens is None else _check_int("max_tokens", max_tokens, 0)
        seq = self._tokens
        length = len(seq)
        if k == 0:
            return []
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._index[n].get(tuple(seq[length - n :]))
            if end is not None:
                return seq[end + 1 : end + 1 + k]
        return []

    def _index_end(self, j: int) -> None:
        """Record every indexed n-gram ending at position j (later positions overwrite)."""
        if j < 0:
            return
        seq = self._tokens
        for n in range(self.min_ngram, min(self.max_ngram, j + 1) + 1):
            self._index[n][tuple(seq[j - n + 1 : j + 1])] = j
