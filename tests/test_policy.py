"""Which rows pay (decoding/policy.py), as pure functions: no engine, no model."""

from __future__ import annotations

from hf_selfspec.decoding.candidates import Candidate, Source
from hf_selfspec.decoding.policy import DraftBudget, best_drafts, select_tree_rows


def copy_chain(tokens):
    return [Candidate(j - 1, t, Source.COPY, j) for j, t in enumerate(tokens)]


def heads_tree():
    """A chain 10 -> 11 -> 12 (path probabilities 0.9, 0.8, 0.7) and a sibling 20 of its
    first draft (0.05), likeliest first as the heads return them."""
    return [Candidate(-1, 10, Source.HEAD, 0, 0.9), Candidate(0, 11, Source.HEAD, 1, 0.8),
            Candidate(1, 12, Source.HEAD, 2, 0.7), Candidate(-1, 20, Source.HEAD, 0, 0.05, on_chain=False)]


def select(copy, heads, costs, copy_rate=0.5, heads_rate=0.8, adaptive=True, eos=frozenset()):
    return select_tree_rows(5, 8, copy, heads, copy_rate=copy_rate, heads_rate=heads_rate, heads_scale=1.0,
                            heads_key="head", costs=costs, adaptive=adaptive, eos=eos)


def test_rows_that_ride_free_are_kept_and_dear_rows_are_not():
    flat = [1.0] * 9
    steep = [1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0, 9.0, 9.0]  # a 4th row costs 9 steps
    every = select([], heads_tree(), flat)
    assert every.tree.tokens == [5, 10, 11, 12, 20] and every.branches == {"head": [1, 2, 3]}
    assert every.tree.kinds[1:] == [Source.HEAD] * 4 and every.tree.steps[1:] == [0, 1, 2, 0]
    assert every.tree.predicted == {1: 0.9, 2: 0.8, 3: 0.7, 4: 0.05}
    cheap = select([], heads_tree(), steep)
    assert cheap.tree.tokens == [5, 10, 11] and cheap.branches == {"head": [1, 2]}
    assert select([], heads_tree(), steep, adaptive=False).tree.tokens == every.tree.tokens


def test_the_copy_goes_first_when_it_is_accepted_more_often():
    flat = [1.0] * 9
    copy = copy_chain([30, 31, 32])
    copy_first = select(copy, heads_tree(), flat, copy_rate=0.9, heads_rate=0.5)
    assert copy_first.tree.tokens[:4] == [5, 30, 31, 32] and copy_first.branches["copy"] == [1, 2, 3]
    heads_first = select(copy, heads_tree(), flat, copy_rate=0.5, heads_rate=0.9)
    assert heads_first.tree.tokens[:4] == [5, 10, 11, 12]
    assert set(heads_first.tree.tokens) == {5, 10, 11, 12, 20, 30, 31, 32}  # the copy rides along


def test_a_chain_ends_at_eos_and_a_shared_prefix_is_one_row():
    tree = select(copy_chain([10, 11, 99, 13]), heads_tree(), [1.0] * 9, copy_rate=0.9, heads_rate=0.5,
                  eos=frozenset({99})).tree
    assert tree.tokens[:4] == [5, 10, 11, 99] and 13 not in tree.tokens  # nothing after EOS
    assert tree.tokens.count(10) == 1 and tree.tokens.count(11) == 1  # the heads' rows merged


def test_budget_is_zero_where_no_draft_pays_and_probes_later():
    costs = [1.0, 1.0, 2.0, 3.0, 4.0]  # every extra row costs a whole step
    assert best_drafts(0.99, 3, costs, 0.0) == 0
    assert best_drafts(0.9, 3, [1.0] * 5, 0.0) == 3
    budget = DraftBudget(costs, 3)
    assert [budget.budget("head") for _ in range(16)] == [0] * 15 + [1]  # a one-draft probe
