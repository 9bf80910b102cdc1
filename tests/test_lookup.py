"""PromptLookup: the incremental index must agree with a brute-force scan, token by token."""

from __future__ import annotations

import random

import pytest
import torch

from hf_selfspec.decoding.lookup import PromptLookup


def brute_force_propose(tokens, max_ngram, min_ngram, k):
    """Reference: rescan the whole sequence; longest suffix first, latest earlier match wins."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        # end position j of a match must satisfy j <= length - 2 (a continuation exists)
        for j in range(length - 2, n - 2, -1):
            if tokens[j - n + 1 : j + 1] == suffix:
                return tokens[j + 1 : j + 1 + k]
    return []


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_streams(seed):
    rng = random.Random(seed)
    alphabet = rng.randint(2, 6)  # small alphabet: many repeats, many overlapping matches
    max_ngram = rng.randint(1, 4)
    min_ngram = rng.randint(1, max_ngram)
    max_draft = rng.randint(1, 6)
    lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=max_draft)

    ref = [rng.randrange(alphabet) for _ in range(rng.randint(0, 8))]
    lookup.reset(ref)
    for _ in range(30):
        k = rng.choice([None, 0, 1, 3, 8])
        want = brute_force_propose(ref, max_ngram, min_ngram, max_draft if k is None else k)
        assert lookup.propose(k) == want, (ref, k)
        chunk = [rng.randrange(alphabet) for _ in range(rng.randint(0, 4))]
        lookup.extend(chunk)  # chunks of 0..4 tokens, like accepted drafts + bonus
        ref += chunk
        assert len(lookup) == len(ref)


def test_empty_and_too_short():
    lookup = PromptLookup(max_ngram=3, min_ngram=2)
    assert lookup.propose() == []
    lookup.reset([5])
    assert lookup.propose() == []
    lookup.reset([5, 5])  # a 2-gram needs an earlier end position: none yet
    assert lookup.propose() == []
    lookup.extend([5])  # [5, 5, 5]: suffix (5, 5) ended at position 1
    assert lookup.propose() == [5]


def test_no_match():
    lookup = PromptLookup(max_ngram=2, min_ngram=1)
    lookup.reset([1, 2, 3, 4, 5])
    assert lookup.propose() == []


def test_longest_suffix_wins_over_later_shorter_match():
    # suffix (1, 2): 2-gram at 0..1 continues with 9; the 1-gram "2" also occurs later (->7)
    lookup = PromptLookup(max_ngram=2, min_ngram=1)
    lookup.reset([1, 2, 9, 3, 2, 7, 1, 2])
    assert lookup.propose() == [9, 3, 2, 7, 1, 2]
    only_unigrams = PromptLookup(max_ngram=1)
    only_unigrams.reset([1, 2, 9, 3, 2, 7, 1, 2])
    assert only_unigrams.propose() == [7, 1, 2]


def test_latest_occurrence_wins():
    lookup = PromptLookup(max_ngram=2, min_ngram=2, max_draft=2)
    lookup.reset([4, 5, 1, 1, 4, 5, 2, 2, 4, 5])
    assert lookup.propose() == [2, 2]


def test_continuation_truncated_at_end_of_sequence():
    lookup = PromptLookup(max_ngram=2, max_draft=10)
    lookup.reset([7, 8, 1, 7, 8])
    assert lookup.propose() == [1, 7, 8]  # only three tokens follow the earlier (7, 8)
    assert lookup.propose(2) == [1, 7]
    assert lookup.propose(0) == []


def test_extend_after_propose_updates_index():
    lookup = PromptLookup(max_ngram=2, max_draft=3)
    lookup.reset([1, 2, 3])
    assert lookup.propose() == []
    lookup.extend([1, 2])  # [1, 2, 3, 1, 2]
    assert lookup.propose() == [3, 1, 2]
    lookup.extend([4])  # the drafted 3 was rejected, 4 committed instead
    assert lookup.propose() == []
    lookup.extend([1, 2])  # (1, 2) now last seen at 3..4, followed by 4
    assert lookup.propose() == [4, 1, 2]
    lookup.extend([])
    assert lookup.propose() == [4, 1, 2]


def test_reset_forgets_previous_sequence():
    lookup = PromptLookup(max_ngram=1)
    lookup.reset([1, 2, 1])
    assert lookup.propose() == [2, 1]
    lookup.reset([3, 1])
    assert lookup.propose() == []
    assert len(lookup) == 2


def test_accepts_tensors_and_integer_scalars():
    lookup = PromptLookup(max_ngram=2)
    lookup.reset(torch.tensor([1, 2, 3]))
    lookup.extend(torch.tensor([1, 2]))
    lookup.extend([torch.tensor(3)])
    assert lookup.propose() == [1, 2, 3]
    with pytest.raises(ValueError):
        lookup.extend(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError):
        lookup.extend([1.0])
    with pytest.raises(ValueError):
        lookup.extend([True])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_ngram": 0},
        {"min_ngram": 0},
        {"max_draft": 0},
        {"max_ngram": 2, "min_ngram": 3},
        {"max_ngram": 2.0},
        {"max_draft": True},
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        PromptLookup(**kwargs)


def test_bad_max_tokens_raises():
    lookup = PromptLookup()
    with pytest.raises(ValueError):
        lookup.propose(-1)
