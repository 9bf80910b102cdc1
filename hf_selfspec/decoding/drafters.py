"""The drafters behind the protocol of candidates.py: prompt lookup, top-layer draft heads
and exit heads (the draft model is in draft_model.py).

Each one proposes candidates for a budget and hears the committed tokens back; none of
them decides how many rows are verified (policy.py) or touches the model's output.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..engine.interface import StepPrograms
from ..heads.device_drafting import draft_chain_on_device, draft_trees_on_device
from .candidates import Candidate, DraftContext, Proposal, Source
from .lookup import PromptLookup
from .sampling import sample

HEADS_KEY = "head"  # the heads' key in the draft budget (policy.DRAFT_COST)
COPY_KEY = Source.COPY.value


class LookupDrafter:
    """Prompt lookup (lookup.py): the continuation of the longest matching suffix n-gram
    of prompt + output, as a chain of copies (point masses when sampling)."""

    key = COPY_KEY

    def __init__(self, max_ngram: int, min_ngram: int, max_draft: int):
        self.index = PromptLookup(max_ngram, min_ngram, max_draft)

    def start(self, prompt: Sequence[int]) -> None:
        self.index.reset(prompt)

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        tokens = self.index.propose(budget)
        return Proposal(self.key, [Candidate(j - 1, t, Source.COPY, j) for j, t in enumerate(tokens)])

    def accepted(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)


class TopHeadsDrafter:
    """Top-layer draft heads (heads/top.py): from the final hidden state of the row that
    produced the last committed token, a chain (stopping at the first step below its
    confidence threshold) or, in tree cycles, the heads' dynamic tree; when sampling, a
    chain sampled from each step's processed distribution. No decoder-layer pass."""

    key = HEADS_KEY

    def __init__(self, heads, thresholds: Sequence[float], children: int, beam: int, min_prob: float):
        self.heads = heads
        self.thresholds = list(thresholds)
        self.children = children
        self.beam = beam
        self.min_prob = min_prob
        # On an accelerator each head step decided on the host is a sync that stalls the
        # launch queue: draft there with every step on the device and one transfer
        # (device_drafting.py, the same drafts). On a CPU, stopping early saves real work.
        self.one_sync = heads.out_norm.device.type != "cpu"

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def accepted(self, tokens: Sequence[int]) -> None:
        pass

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        root = ctx.committed[-1]
        if ctx.scorer is not None:
            candidates = self._sampled_chain(ctx, budget)
        elif ctx.tree:
            nodes = self._trees(ctx.final_before.reshape(1, -1), [root], [budget], [ctx.eos])[0]
            candidates = [Candidate(n.parent, n.token, Source.HEAD, n.step, n.prob, n.on_chain) for n in nodes]
        else:
            chain = self._chain(ctx.final_before, root, budget)
            candidates = [Candidate(j - 1, token, Source.HEAD, step, conf)
                          for j, (token, conf, step) in enumerate(chain)]
        return Proposal(self.key, candidates, evaluations=1)

    def propose_trees(self, requests: Sequence[tuple[DraftContext, int]]) -> list[Proposal]:
        """`propose` for several sequences' tree cycles at once (a batch): their head steps
        run together (heads.draft_trees); each proposal is the one `propose` gives alone."""
        finals = torch.stack([ctx.final_before for ctx, _ in requests])
        trees = self._trees(finals, [ctx.committed[-1] for ctx, _ in requests],
                            [budget for _, budget in requests], [ctx.eos for ctx, _ in requests])
        return [Proposal(self.key, [Candidate(n.parent, n.token, Source.HEAD, n.step, n.prob, n.on_chain)
                                    for n in nodes], evaluations=1) for nodes in trees]

    def _chain(self, final: torch.Tensor, root: int, budget: int) -> list[tuple[int, float, int]]:
        if self.one_sync:
            return draft_chain_on_device(self.heads, final, root, budget, self.thresholds)
        return self.heads.draft(final, root, budget, self.thresholds)

    def _trees(self, finals: torch.Tensor, roots: list[int], depths: list[int], stops: list) -> list:
        if self.one_sync:
            return draft_trees_on_device(self.heads, finals, roots, depths, self.thresholds, self.children,
                                         self.beam, self.min_prob, stops)
        return self.heads.draft_trees(finals, roots, depths, self.thresholds, self.children, self.beam,
                                      self.min_prob, stops)

    def _sampled_chain(self, ctx: DraftContext, budget: int) -> list[Candidate]:
        heads, scorer = self.heads, ctx.scorer
        h = ctx.final_before.reshape(1, -1)
        prev = torch.tensor([ctx.committed[-1]], device=h.device)
        out: list[Candidate] = []
        for i in range(min(budget, len(heads.steps))):
            h, logits = heads.step_logits(i, h, prev)
            if float(torch.softmax(logits.float(), -1).max()) < self.thresholds[i]:
                break
            q = scorer.draft_distribution(ctx.committed, [c.token for c in out], logits[0], heads.vocab_ids)
            if q is None:
                break
            token = sample(q)
            out.append(Candidate(i - 1, token, Source.HEAD, i, q=q))
            if token in ctx.eos:
                break
            prev = torch.tensor([token], device=h.device)
        return out


class PartialRows:
    """The rows of an exit-heads chain with their hidden states computed part of the way:
    row 0 is the last committed token, row j > 0 the j-th draft, at consecutive positions
    from `position`. `depth[j]` counts the layers computed for row j (never increasing
    with j). The verification continues from here (`finish`)."""

    def __init__(self, engine: StepPrograms, first_token: int, position: int):
        self.engine = engine
        self.position = position
        self.tokens = [first_token]
        self.hidden = torch.zeros(engine.width, engine.view.hidden_size, dtype=engine.view.dtype,
                                  device=engine.view.device)
        self.hidden[0] = engine.view.embed_row(first_token)
        self.depth = [0]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int) -> None:
        self.hidden[len(self.tokens)] = self.engine.view.embed_row(token)
        self.tokens.append(token)
        self.depth.append(0)

    def advance(self, first: int, last: int, end: int) -> None:
        """One seg pass: rows [first, last), all at the same depth, to layer `end`."""
        rows = slice(first, last)
        meta = self.engine.make_meta(range(self.position + first, self.position + last))
        self.hidden[rows] = self.engine.seg(self.hidden[rows], self.depth[first], end, meta)
        for r in range(first, last):
            self.depth[r] = end

    def climb(self, layer: int) -> None:
        """Bring the newest row to `layer` (lazy catch-up).

        A row may only compute layer l once every older row has its KV at layer l. Depths
        never increase with the row index, so the rows below `layer` are a suffix: the
        shallowest run of equal depth is advanced together up to the depth of the row
        before it (merging the runs) until the newest row is there."""
        newest = len(self.tokens) - 1
        while self.depth[newest] < layer:
            depth = self.depth[newest]
            first = newest
            while first > 0 and self.depth[first - 1] == depth:
                first -= 1
            target = layer if first == 0 else min(layer, self.depth[first - 1])
            self.advance(first, newest + 1, target)

    def finish(self) -> tuple[torch.Tensor, int]:
        """Every row brought to the deepest row's depth: (hidden [n, H], that depth)."""
        depth = self.depth[0]
        self.climb(depth)
        return self.hidden[: len(self.tokens)], depth


class ExitHeadsDrafter:
    """Exit heads on early layers (heads/kinds.py): for each draft the newest row climbs
    the heads shallow -> deep, running only as deep as the head being evaluated, and the
    first head whose confidence passes its threshold drafts (lazy catch-up: every head sees
    the exact hidden state of the exact prefix). Stops when no head passes, at the budget,
    at EOS, or when the predicted acceptance of the whole chain falls under `gamma`. When
    sampling, a passing head samples its draft from its processed distribution."""

    key = HEADS_KEY

    def __init__(self, engine: StepPrograms, heads, thresholds: Sequence[float], gamma: float):
        self.engine = engine
        self.heads = heads
        self.head_list = list(heads.heads)
        self.thresholds = list(thresholds)
        self.gamma = gamma
        for head in self.head_list:
            if not 1 <= head.layer < engine.view.num_layers:
                raise ValueError(f"an exit head reads layer {head.layer}, but the model has "
                                 f"{engine.view.num_layers} layers")

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def accepted(self, tokens: Sequence[int]) -> None:
        pass

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        rows = PartialRows(self.engine, ctx.committed[-1], ctx.position)
        proposal = Proposal(self.key, rows=rows)
        calibration = getattr(self.heads, "calibration", None)
        chain_prob = 1.0
        while len(rows) - 1 < budget:
            drafted = None
            for k, head in enumerate(self.head_list):
                rows.climb(head.layer)
                newest = len(rows) - 1
                conf, token = head.propose(rows.hidden[newest: newest + 1])
                proposal.evaluations += 1
                conf_value = float(conf[0])
                if conf_value < self.thresholds[k] or conf_value <= 0.0:
                    continue
                if self.gamma > 0.0 and calibration is not None:
                    chain_prob *= float(calibration.accept_prob(k, conf[:1])[0])
                    if chain_prob < self.gamma:
                        return proposal
                q = None
                if ctx.scorer is not None:
                    reduced = head(rows.hidden[newest: newest + 1])[0, : head.vocab_size]
                    q = ctx.scorer.draft_distribution(ctx.committed, rows.tokens[1:], reduced, head.vocab_ids)
                    if q is None:
                        return proposal
                    token = torch.tensor([sample(q)])
                drafted = int(token[0])
                proposal.candidates.append(Candidate(len(rows) - 2, drafted, Source.HEAD, k, conf_value, q=q))
                rows.add(drafted)
                break
            if drafted is None or drafted in ctx.eos:
                return proposal
        return proposal
