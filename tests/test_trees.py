"""Draft trees: the trie, and output == the engine's AR output on every branch of a tree
cycle (sibling accepted, copy and head rows merged, compaction with gaps, EOS inside a
branch, the tree full), with real drafters and with trees built from the AR output."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_decoding import prompt, random_heads

from hf_selfspec.decoding.candidates import DraftContext, Source
from hf_selfspec.decoding.cycle import DecodeConfig, DraftPlan, SelfSpecDecoder
from hf_selfspec.decoding.tree import DraftTree
from hf_selfspec.engine.core import Engine, EngineConfig
from hf_selfspec.heads.top import random_top_heads


def test_trie_merges_branches_and_lays_out_rows():
    tree = DraftTree(7, width=8)
    assert tree.add_branch([1, 2, 3], Source.COPY) == [1, 2, 3]
    assert tree.add_branch([1, 2, 9, 4], Source.HEAD) == [1, 2, 4, 5]  # shares rows 1, 2
    assert tree.add_branch([5], Source.HEAD) == [6]
    assert tree.add_branch([6, 7, 8], Source.COPY) == [7]  # full: width 8
    assert tree.room == 0 and tree.add(0, 11, Source.COPY) is None
    assert tree.depth == [0, 1, 2, 3, 3, 4, 1, 1]
    assert not tree.is_chain
    positions, slots, paths = tree.layout(100)
    assert positions == [100, 101, 102, 103, 103, 104, 101, 101]
    assert slots == list(range(100, 108))
    assert paths[5] == [100, 101, 102, 104, 105] and paths[6] == [100, 106]
    # the model's token after each row: 1 after the root, 2 after row 1, 9 after row 2, ...
    model = [1, 2, 9, 0, 4, 0, 0, 0]
    assert tree.walk(model) == [1, 2, 4, 5]
    assert tree.walk([5, 0, 0, 0, 0, 0, 0, 0]) == [6]
    assert tree.walk([3, 0, 0, 0, 0, 0, 0, 0]) == []
    assert tree.add_branch([4, 5, 6], Source.COPY, stop_tokens={4}) == []  # still full
    chain = DraftTree(7, width=4)
    assert chain.add_branch([1, 2, 3, 4], Source.COPY, stop_tokens={2}) == [1, 2]  # EOS ends it
    assert chain.is_chain


@pytest.fixture(scope="module")
def kernel_setup():
    model = tiny_model("llama", seed=0, layers=4)
    engine = Engine(model, EngineConfig(width=8, capacity=400, row_layout="kernel"))
    return model, engine


def tree_context(committed, final, tree=True):
    """A draft context after `committed` (position: as if the prompt were empty)."""
    return DraftContext(list(committed), final, len(committed), frozenset(), tree=tree)


class OracleTrees(SelfSpecDecoder):
    """Builds each cycle's tree from the known AR output: a wrong first branch, then the
    right continuation as a later branch (so the accepted rows sit after a gap), decoys
    hanging off it, optionally the tree filled to the width."""

    def __init__(self, engine, reference, shape, **config):
        super().__init__(engine, None, DecodeConfig(lookup="off", tree="on", adaptive=False, **config))
        self.reference = reference
        self.shape = shape
        self.num_sources = 3  # rows labelled as head steps 0..2 (stats.exits_per_head)

    def draft(self, ctx, budget, policy, stats):
        out = ctx.committed
        tree = DraftTree(out[-1], self.engine.width)
        n = len(out)
        truth = self.reference[n: n + budget]
        if not truth or budget <= 0:
            return DraftPlan(tree, {})
        wrong = (truth[0] + 1) % self.engine.view.vocab_size
        if self.shape == "sibling":  # row 1 wrong (+ a chain under it), the truth as a sibling
            tree.add_branch([wrong, truth[0], wrong], Source.HEAD)
            tree.add_branch(truth[:2], Source.HEAD)
        elif self.shape == "merged":  # two branches sharing the truth's first tokens
            tree.add_branch(truth[:2] + [wrong], Source.COPY)
            tree.add_branch(truth[:4], Source.HEAD)
        elif self.shape == "deep_gap":  # decoys between every accepted row
            parent = 0
            for token in truth[:3]:
                tree.add(parent, (token + 2) % self.engine.view.vocab_size, Source.COPY)
                parent = tree.add(parent, token, Source.HEAD)
        elif self.shape == "full":  # the truth last, after rows that fill most of the width
            for k in range(1, 5):
                tree.add(0, (truth[0] + k) % self.engine.view.vocab_size, Source.COPY)
            tree.add_branch(truth, Source.HEAD)  # cut where the tree is full
        return DraftPlan(tree, {})


@pytest.mark.parametrize("shape", ["sibling", "merged", "deep_gap", "full"])
def test_oracle_trees_equal_engine_ar(kernel_setup, shape):
    """Accepted rows at scattered slots (compaction with gaps), a sibling or a later branch
    accepted, a tree full to the width: the output is the engine's AR output, and the
    accepted path really left the first branch."""
    _, engine = kernel_setup
    for seed, (length, alphabet) in enumerate([(5, 256), (40, 12), (90, 256)]):
        p = prompt(seed, length, alphabet)
        expected = engine.generate_ar(p, 40)
        result = OracleTrees(engine, expected, shape).generate(p, 40)
        assert result.tokens == expected, (shape, seed)
        if shape != "merged":
            assert result.stats.off_chain_cycles > 0
        assert result.stats.accepted > 0


def test_oracle_tree_compaction_is_what_keeps_it_exact(kernel_setup, monkeypatch):
    """Without moving the accepted rows' KV to consecutive slots the output differs: the
    parity test above can fail."""
    _, engine = kernel_setup
    p = prompt(3, 30)
    expected = engine.generate_ar(p, 40)
    monkeypatch.setattr(engine, "move_kv", lambda sources, targets: None)
    assert OracleTrees(engine, expected, "deep_gap").generate(p, 40).tokens != expected


def test_eos_inside_an_accepted_branch_and_min_new_tokens(kernel_setup):
    """An EOS drafted mid-branch ends the text right after it; min_new_tokens masks EOS on
    the rows whose depth is before it (HF semantics), as in AR."""
    _, engine = kernel_setup
    for seed in range(3):
        p = prompt(seed, 20)
        full = engine.generate_ar(p, 40)
        eos = full[7]
        expected = full[: full.index(eos) + 1]
        result = OracleTrees(engine, full, "sibling").generate(p, 40, eos_token_ids=[eos])
        assert result.tokens == expected
        top = random_top_heads(engine.view.model, depth=3)
        config = dict(thresholds=0.0, lookup="first", siblings=3, sibling_min_prob=0.0, adaptive=False)
        tree = SelfSpecDecoder(engine, top, DecodeConfig(tree="on", **config))
        chain = SelfSpecDecoder(engine, top, DecodeConfig(tree="off", **config))
        masked = tree.generate(p, 40, eos_token_ids=[eos], min_new_tokens=12)
        assert masked.tokens == chain.generate(p, 40, eos_token_ids=[eos], min_new_tokens=12).tokens
        assert eos not in masked.tokens[:12] and (masked.tokens[-1] == eos or len(masked.tokens) == 40)


@pytest.mark.parametrize("lookup", ["off", "first", "only", "fallback"])
@pytest.mark.parametrize("siblings, min_prob, thresholds", [(3, 0.0, 0.0), (1, 0.1, 0.0), (2, 0.0, 0.5)])
def test_real_tree_drafts_equal_engine_ar(kernel_setup, lookup, siblings, min_prob, thresholds):
    """Top-layer heads' chain + siblings + the lookup copy, merged, on a repetitive prompt
    (copies hit) and a random one: output == engine AR, and with siblings on, a sibling or
    the other branch is accepted somewhere."""
    model, engine = kernel_setup
    top = random_top_heads(model, depth=3)
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(
        thresholds=thresholds, lookup=lookup, tree="on", siblings=siblings, sibling_min_prob=min_prob,
        adaptive=False))
    off_chain = off_chain_cycles_of_ar_equal_runs(decoder, engine, [(1, 256), (17, 256), (60, 8)], 48)
    if siblings == 3 and lookup in ("off", "first"):
        assert off_chain > 0


def off_chain_cycles_of_ar_equal_runs(decoder, engine, prompts, new_tokens):
    """Generate from each (length, alphabet) prompt, check output == engine AR; returns the
    number of cycles that accepted a row off the chain's positions."""
    off_chain = 0
    for seed, (length, alphabet) in enumerate(prompts):
        p = prompt(seed, length, alphabet)
        r = decoder.generate(p, new_tokens)
        assert r.tokens == engine.generate_ar(p, new_tokens), seed
        assert r.stats.new_tokens == r.stats.accepted + r.stats.cycles + 1
        off_chain += r.stats.off_chain_cycles
    return off_chain


def test_logits_of_tree_cycles_are_the_committed_rows(kernel_setup):
    """collect_logits returns, for each new token, the logits of the row that produced it
    (the accepted path's rows, not the tree's first rows)."""
    _, engine = kernel_setup
    p = prompt(4, 30)
    a = SelfSpecDecoder(engine, None, DecodeConfig(lookup="off", tree="off")).generate(p, 30, collect_logits=True)
    b = OracleTrees(engine, a.tokens, "sibling").generate(p, 30, collect_logits=True)
    assert a.tokens == b.tokens and b.stats.off_chain_cycles > 0
    for la, lb, token in zip(a.logits, b.logits, b.tokens):
        assert int(lb.argmax()) == token
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)


def test_tree_on_where_trees_cannot_be_used_is_refused(kernel_setup):
    model, engine = kernel_setup
    top = random_top_heads(model, depth=2)
    other = Engine(model, EngineConfig(width=8, capacity=400, row_layout="fixed"))
    with pytest.raises(ValueError, match="row layout has no tree attention"):
        SelfSpecDecoder(other, top, DecodeConfig(tree="on", thresholds=0.0))
    with pytest.raises(ValueError, match="exit heads"):
        SelfSpecDecoder(engine, random_heads(model, [1, 3]), DecodeConfig(tree="on", thresholds=0.0))
    with pytest.raises(ValueError, match="lossy"):
        SelfSpecDecoder(engine, top, DecodeConfig(tree="on", thresholds=0.0, lossy_top_k=2))
    with pytest.raises(ValueError, match="greedy option"):
        SelfSpecDecoder(engine, top, DecodeConfig(tree="on", thresholds=0.0)).generate([5, 6], 5, do_sample=True)
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from hf_selfspec.decoding.sampling import RowScorer

    def penalty(p):  # a processor whose score depends on the row's history (its path in a tree)
        return RowScorer(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)]), p,
                         model.config.vocab_size, torch.device("cpu"))
    with pytest.raises(ValueError, match="logits processors"):
        SelfSpecDecoder(engine, top, DecodeConfig(tree="on", thresholds=0.0)).generate(
            [5, 6], 5, scorer=penalty([5, 6]))
    p = prompt(2, 20)  # auto (the default): chains with processors, same tokens as without trees
    auto_out = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0)).generate(p, 24, scorer=penalty(p))
    chain_out = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0, tree="off")).generate(
        p, 24, scorer=penalty(p))
    assert auto_out.tokens == chain_out.tokens
    with pytest.raises(ValueError, match="tree must be"):
        DecodeConfig(tree="yes")
    with pytest.raises(ValueError, match=r"C\+\+ or Triton row attention"):
        other.make_meta([3, 4], slots=[3, 4], paths=[[3], [3, 4]])
    # auto: chains there, with the same output
    auto = SelfSpecDecoder(other, top, DecodeConfig(thresholds=0.0, tree="auto"))
    assert not auto.use_tree and SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0, tree="auto")).use_tree
    assert SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0)).use_tree  # default: auto
    assert not SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0, tree="off")).use_tree
    p = prompt(1, 12)
    assert auto.generate(p, 20).tokens == other.generate_ar(p, 20)


def test_trie_truncate_keeps_a_tree():
    tree = DraftTree(7, width=8)
    tree.add_branch([1, 2, 3], Source.COPY)
    tree.add_branch([4, 5], Source.HEAD)
    tree.truncate(5)
    assert tree.tokens == [7, 1, 2, 3, 4] and tree.children[4] == {} and tree.children[0] == {1: 1, 4: 4}
    assert tree.add(4, 5, Source.HEAD) == 5


def test_extra_rows_are_taken_only_where_the_step_cost_pays(kernel_setup):
    """Siblings ride along while a step of more rows costs about the same, and are left out
    where one more row would make the step dear (the engine's measured cost curve)."""
    from hf_selfspec.decoding.policy import DraftBudget
    from hf_selfspec.stats import DecodeStats

    model, engine = kernel_setup
    top = random_top_heads(model, depth=3)
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0, lookup="off", tree="on",
                                                        sibling_min_prob=0.0))
    final = torch.randn(model.config.hidden_size)
    sizes = {}
    for name, costs in {"flat": [1.0] * 9, "steep": [1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0, 9.0]}.items():
        for adaptive in (True, False):
            stats = DecodeStats(exits_per_head=[0, 0, 0])
            policy = DraftBudget(costs, 7, adaptive=adaptive)
            tree = decoder.draft(tree_context([5, 6], final), 7, policy, stats).tree
            sizes[name, adaptive] = len(tree)
    # the whole width when rows are free, else 3 drafts; adaptive=False keeps every row
    assert sizes == {("flat", True): 8, ("steep", True): 4, ("flat", False): 8, ("steep", False): 8}


@pytest.mark.parametrize("tree", ["off", "on"])
def test_a_paying_copy_is_drafted_when_the_heads_do_not_pay(kernel_setup, tree):
    """lookup="first": the heads' higher live rate must not silence a copy that pays when
    the heads themselves get no budget this cycle (else nothing drafts, the copy's rate is
    never updated and the loop is stuck in AR steps on copyable text: measured on an
    adversarial prompt, tau 1.2 instead of 2.8). Both the chain and the tree cycle."""
    from hf_selfspec.decoding.policy import DraftBudget
    from hf_selfspec.stats import DecodeStats

    model, engine = kernel_setup
    top = random_top_heads(model, depth=3)
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0, lookup="first", tree=tree))
    text = [5, 6, 7, 8, 9, 5, 6]
    decoder.lookup.start(text)
    assert decoder.lookup.index.propose(3) == [7, 8, 9]
    # flat verification costs: any copy pays; a head draft costs a whole step: heads never pay
    policy = DraftBudget([1.0] * 9, 7, draft_costs={"head": 1.0, "copy": 0.0})
    policy.tracker("head").successes, policy.tracker("head").trials = 9.0, 10.0  # rate 0.9
    policy.tracker("copy").successes, policy.tracker("copy").trials = 3.0, 10.0  # rate 0.3
    assert policy.rate("copy") < policy.rate("head")
    stats = DecodeStats(exits_per_head=[0, 0, 0])
    final = torch.randn(model.config.hidden_size)
    plan = decoder.draft(tree_context(text, final, tree == "on"), 7, policy, stats)
    assert plan.tree.tokens[1:4] == [7, 8, 9] and set(plan.branches) == {"copy"}
    assert set(plan.tree.kinds[1:]) == {Source.COPY}


def test_a_copy_that_extends_the_heads_chain_is_not_cut_short(kernel_setup):
    """The heads go first (higher live rate) and their 3 drafts are the copy's first 3
    tokens: the copy's further rows compete with nothing, so they are weighed by the copy's
    own rate (not by the heads' miss rate) and kept where the step cost pays for them.
    (Weighed by the heads' 0.1 miss rate they were dropped: trees cut adversarial copies
    short.) A copy that leaves the heads' chain still competes with it from there on."""
    from hf_selfspec.decoding.policy import DraftBudget
    from hf_selfspec.stats import DecodeStats

    model, engine = kernel_setup
    top = random_top_heads(model, depth=3)
    with torch.no_grad():  # confident heads: their chain's path probability is ~1 (trained heads'
        top.out_norm.mul_(1000.0)  # nodes are weighed by it), the siblings' ~0
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0, lookup="first", tree="on",
                                                        sibling_min_prob=1.0))
    final = torch.randn(model.config.hidden_size)
    chain = top.draft(final, 6, 3, decoder.thresholds)
    heads_tokens = [t for t, _c, _s in chain]
    assert len(heads_tokens) == 3
    costs = [1.0] * 5 + [1.03, 1.06, 1.09, 1.12]  # rows beyond 4 cost 3% each

    def tree_for(after):  # the copy proposes `after` (the text after the last "5 6")
        text = [5, 6] + after + [5, 6]
        decoder.lookup.start(text)
        policy = DraftBudget(costs, 7, draft_costs={"head": 0.0, "copy": 0.0})
        policy.tracker("head").successes, policy.tracker("head").trials = 9.0, 10.0  # rate 0.9
        policy.tracker("copy").successes, policy.tracker("copy").trials = 8.0, 10.0  # rate 0.8
        assert decoder.lookup.index.propose(min(7, policy.budget("copy")))[:len(after)] == after
        plan = decoder.draft(tree_context(text, final), 7, policy, DecodeStats(exits_per_head=[0, 0, 0]))
        return plan.tree, plan.branches

    extension = [t for t in range(40, 60) if t not in heads_tokens][:4]
    tree, branches = tree_for(heads_tokens + extension)
    assert tree.tokens[1:] == heads_tokens + extension and tree.is_chain
    assert len(branches["copy"]) == 7
    # a copy that leaves the heads' chain at its second token: its rows compete (x 0.1)
    other = next(t for t in range(40, 60) if t not in heads_tokens + extension)
    tree, branches = tree_for(heads_tokens[:1] + [other] + extension[:2])
    assert tree.tokens[1:] == heads_tokens  # none of its own rows pays
    assert branches["copy"] == [1]  # it shares the heads' first row (credited to both)


def test_heads_dynamic_tree_nodes():
    """TopDraftHeads.draft_tree: likeliest first, parents first, each node's probability the
    product of the head probabilities along its path (recomputed here step by step), the
    top-1 chain = `draft`'s chain, only the `beam` likeliest nodes of a step expanded, and
    thresholds / min_prob / stop tokens limiting the tree as documented."""
    model = tiny_model("llama", seed=0, layers=2)
    top = random_top_heads(model, depth=3)
    final = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    nodes = top.draft_tree(final, 6, 3, [0.0] * 3, children=3, beam=2, min_prob=0.0)
    assert [n.step for n in nodes].count(0) == 3 and len(nodes) == 3 + 2 * 3 + 2 * 3
    assert all(a.prob >= b.prob for a, b in zip(nodes, nodes[1:]))
    with torch.no_grad():
        for i, node in enumerate(nodes):
            assert node.parent < i and (node.parent == -1) == (node.step == 0)
            path = [node]
            while path[-1].parent >= 0:
                path.append(nodes[path[-1].parent])
            path.reverse()
            h, prev, prob = final.reshape(1, -1), torch.tensor([6]), 1.0
            for step, n in enumerate(path):
                h, logits = top.step_logits(step, h, prev)
                prob *= float(torch.softmax(logits.float(), -1)[0, n.token])
                prev = torch.tensor([n.token])
            assert prob == pytest.approx(node.prob, rel=1e-4)
    chain = [n.token for n in nodes if n.on_chain]
    assert chain == [t for t, _c, _s in top.draft(final, 6, 3, [0.0] * 3)]
    for step in (0, 1):  # the parents of step + 1 are the 2 likeliest nodes of step
        likeliest = sorted((n.prob, i) for i, n in enumerate(nodes) if n.step == step)[-2:]
        assert {n.parent for n in nodes if n.step == step + 1} == {i for _p, i in likeliest}
    assert {n.step for n in top.draft_tree(final, 6, 3, [0.0, 1.01, 0.0], 3, 2, 0.0)} == {0}
    only_chain = top.draft_tree(final, 6, 3, [0.0] * 3, children=3, beam=2, min_prob=1.0)
    assert [n.token for n in only_chain] == chain and all(n.on_chain for n in only_chain)
    stopped = top.draft_tree(final, 6, 3, [0.0] * 3, 3, 2, 0.0, stop_tokens={chain[0]})
    first = next(i for i, n in enumerate(stopped) if n.on_chain)
    assert not any(n.parent == first for n in stopped)


@pytest.mark.parametrize("beam", [1, 2, 8])
def test_dynamic_trees_equal_engine_ar(kernel_setup, beam):
    """Heads' trees of every beam width (1: siblings of the chain only; 8: every node
    expanded), rows off the top-1 chain at any depth: output == engine AR."""
    model, engine = kernel_setup
    top = random_top_heads(model, depth=3)
    with torch.no_grad():  # flatter heads: more nodes above min_prob
        top.out_norm.mul_(0.5)
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(
        thresholds=0.0, lookup="off", tree="on", siblings=3, sibling_min_prob=0.0, tree_beam=beam,
        adaptive=False))
    assert off_chain_cycles_of_ar_equal_runs(decoder, engine, [(1, 256), (17, 256), (40, 8)], 40) > 0


def test_tree_rows_follow_the_heads_calibration(kernel_setup):
    """The heads' path probabilities are scaled by their live calibration (accepted rows /
    predicted): heads found over-confident get fewer rows on the same cost curve."""
    from hf_selfspec.decoding.policy import DraftBudget, ProbabilityCalibration
    from hf_selfspec.stats import DecodeStats

    calibration = ProbabilityCalibration()
    assert calibration.scale == 1.0
    for _ in range(50):
        calibration.update(2.0, 0.5)
    assert calibration.scale == pytest.approx(0.25, abs=0.01)
    model, engine = kernel_setup
    top = random_top_heads(model, depth=3)
    with torch.no_grad():
        top.out_norm.mul_(3.0)
    decoder = SelfSpecDecoder(engine, top, DecodeConfig(thresholds=0.0, lookup="off", tree="on",
                                                        sibling_min_prob=0.0))
    final = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    costs = [1.0, 1.0] + [1.0 + 0.04 * n for n in range(1, 8)]
    sizes = {}
    for observed in (0.2, 2.0):
        policy = DraftBudget(costs, 7)
        for _ in range(50):
            policy.calibration("head").update(1.0, observed)
        tree = decoder.draft(tree_context([5, 6], final), 7, policy, DecodeStats(exits_per_head=[0, 0, 0])).tree
        sizes[observed] = len(tree)
    assert sizes[0.2] < sizes[2.0], sizes
