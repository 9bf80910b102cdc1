"""Top-layer draft heads: draft the next tokens from the last verified final hidden state.

After a verification the engine holds the final hidden state f (after the final norm) of
the row whose argmax is the token just committed, g. A top draft head chains

    h_0 = f
    h_{i+1} = h_i + MLP_i([norm(h_i); norm(E[tok_i])])      tok_0 = g, tok_i = draft i
    draft_{i+1} = argmax over V of LM_rows(norm(h_{i+1}))

so each draft costs one small MLP and a reduced-vocabulary LM head, and no decoder-layer
pass at all (Medusa's "no extra layers", conditioned on the drafted tokens like EAGLE, but
position-wise). E (input embedding) and the LM-head rows of V are the base model's, frozen,
gathered at bind time and never stored. Trained by self-distillation: step i predicts the
model's own argmax (scripts/head_study.py). Measured figures: docs/head_study.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.layered import rms_norm
from ..engine.versions import version_counter
from . import checks
from .base import HeadsIdentity, final_norm_weight, fingerprint, lm_head_weight, weight_probe

TOP_KIND = "top_draft"
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DraftNode(NamedTuple):
    """One node of a heads' draft tree: `parent` is the index of its parent node in the same
    list (-1: the committed token), `prob` the product of the head probabilities along its
    path (the heads' estimate that the whole path is the model's), `step` its chain step
    (= depth - 1), `on_chain` whether it is on the top-1 chain (`draft`'s tokens)."""

    parent: int
    token: int
    prob: float
    step: int
    on_chain: bool


@dataclass(kw_only=True)
class TopHeadsConfig(HeadsIdentity):
    """config.json of a top-draft heads repo: the base model (HeadsIdentity's fields) and
    the chain: its depth, adapter width, reduced vocabulary and storage dtype."""

    KIND: ClassVar[str] = TOP_KIND
    REQUIRED: ClassVar[tuple[str, ...]] = ("depth", "adapter_dim", "reduced_vocab")

    depth: int  # drafts per cycle the heads can make
    adapter_dim: int
    reduced_vocab: int
    # dtype of the weights in heads.safetensors (they run in the model's dtype)
    storage_dtype: str = "float32"
    kind: str = TOP_KIND

    def _validate_own(self) -> None:
        checks.need_int("depth", self.depth, 1, checks.MAX_DEPTH)
        checks.need_int(
            "adapter_dim", self.adapter_dim, 1, checks.MAX_ADAPTER_FACTOR * self.hidden_size
        )
        if checks.is_int(self.reduced_vocab) and self.reduced_vocab > self.vocab_size:
            raise ValueError(
                f"field 'reduced_vocab' ({self.reduced_vocab}) exceeds vocab_size ({self.vocab_size})"
            )
        checks.need_int("reduced_vocab", self.reduced_vocab, 1, self.vocab_size)
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"field 'storage_dtype' must be one of {sorted(STORAGE_DTYPES)}, got "
                f"{self.storage_dtype!r}"
            )


def likeliest_first(found: list[DraftNode]) -> list[DraftNode]:
    """A tree's nodes in the order they were found (parents first), reordered most likely
    first (ties: shallower, then found earlier), parents renumbered: any prefix is a tree."""
    order = sorted(range(len(found)), key=lambda i: (-found[i].prob, found[i].step))
    position = {old: new for new, old in enumerate(order)}
    return [found[i]._replace(parent=position.get(found[i].parent, -1)) for i in order]


# largest magnitude a float16 holds: weights beyond it are drafted from bfloat16 copies
FLOAT16_MAX = 65504.0


def _fused_step(weight: torch.Tensor):
    """The C++ row kernel's whole draft step (kernels/cpu_rows.py `rows_draft_step`) for
    float32 CPU weights, where it builds; None otherwise."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    from hf_selfspec.kernels.cpu_rows import load_rows_draft_step

    return load_rows_draft_step()


def _fast_linear(weight: torch.Tensor):
    """x [n, K] @ w[O, K]^T through the C++ row kernel for float32 CPU weights, where it
    builds (kernels/cpu_rows.py); None otherwise (F.linear is used). The kernel also takes
    16-bit weights with float32 x (widened exactly in registers, float32 arithmetic)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    kernel = load_rows_linear()
    if kernel is None:
        return None
    return lambda x, w: kernel(x.contiguous(), w.contiguous())


class TopDraftStep(nn.Module):
    """One chained step: (state h [n, H], token embedding e [n, H]) -> next state."""

    def __init__(self, hidden: int, adapter: int, eps: float):
        super().__init__()
        self.eps = eps
        self.h_norm = nn.Parameter(torch.ones(hidden))
        self.e_norm = nn.Parameter(torch.ones(hidden))
        self.down = nn.Linear(2 * hidden, adapter, bias=False)
        self.up = nn.Linear(adapter, hidden, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor, e: torch.Tensor, linear=F.linear) -> torch.Tensor:
        # (the engine's RMSNorm, on inputs in the heads' dtype: a norm's output is in its weight's)
        x = torch.cat([rms_norm(h.to(self.h_norm.dtype), self.h_norm, self.eps),
                       rms_norm(e.to(self.e_norm.dtype), self.e_norm, self.eps)], dim=-1)
        return h + linear(F.silu(linear(x, self.down.weight)), self.up.weight)


class TopDraftHeads(nn.Module):
    """A chain of `depth` top draft steps sharing one output norm and LM-head rows."""

    kind = TOP_KIND

    def __init__(self, config: TopHeadsConfig, vocab_ids: torch.Tensor | None = None):
        """Heads of the config's shapes (weights as initialised: load a state dict or
        `init_from_model`); vocab_ids [reduced_vocab] full-vocabulary ids."""
        super().__init__()
        config.validate()
        self.config = config
        H, r, eps = config.hidden_size, config.adapter_dim, config.rms_norm_eps
        self.steps = nn.ModuleList([TopDraftStep(H, r, eps) for _ in range(config.depth)])
        self.out_norm = nn.Parameter(torch.ones(H))
        if vocab_ids is None:
            vocab_ids = torch.zeros(config.reduced_vocab, dtype=torch.long)
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).clone())
        self.register_buffer("lm_rows", None, persistent=False)  # [V, H], from the model
        self.register_buffer("embed", None, persistent=False)  # [vocab, H], the model's
        self.calibration = None
        self.heads = []  # no exit heads: the decoder drafts with `draft`
        # 16-bit copies drafting reads on the row kernel: {name: ((data_ptr, version), copy)}
        self._draft_copies: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}

    # ---- binding ---------------------------------------------------------------------

    def bind(self, model) -> TopDraftHeads:
        """Gather the LM-head rows of the reduced vocabulary and the input embeddings from
        `model`, and move the heads to its device and dtype. Where accelerate offloads the
        LM head or the embedding, they are read while brought in: the reduced rows are the
        heads' own copy as always; the embedding the heads keep is a view of the mapped
        file (or, where accelerate's hooks must copy it in, that copy)."""
        from hf_selfspec.engine.dispatch import onloaded

        with onloaded(model.get_output_embeddings()), onloaded(model.get_input_embeddings()):
            return self._bind(lm_head_weight(model), model.get_input_embeddings().weight)

    def _bind(self, lm: torch.Tensor, emb: torch.Tensor) -> TopDraftHeads:
        if lm.shape[1] != self.config.hidden_size:
            raise ValueError(f"heads have hidden size {self.config.hidden_size}, the model {lm.shape[1]}")
        if int(self.vocab_ids.max()) >= lm.shape[0]:
            raise ValueError("heads propose token ids outside the model's vocabulary")
        self.to(device=lm.device, dtype=lm.dtype)
        self._draft_copies.clear()
        self.lm_rows = lm.detach()[self.vocab_ids.to(lm.device)].contiguous()
        self.embed = emb.detach()
        if self.out_norm.device != lm.device:
            self.to(lm.device)
        self._fast_linear = _fast_linear(lm)
        self._fused_step = _fused_step(lm)
        return self

    # A pickle or copy (torch.save(model), copy.deepcopy, a worker process) cannot carry the
    # row kernel's entry points, and the 16-bit drafting copies are keyed by this process's
    # addresses: both are found again from the bound LM-head rows.
    def __getstate__(self):
        state = {k: v for k, v in super().__getstate__().items() if k not in ("_fast_linear", "_fused_step")}
        state["_draft_copies"] = {}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if self.lm_rows is not None:
            self._fast_linear = _fast_linear(self.lm_rows)
            self._fused_step = _fused_step(self.lm_rows)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .half() / ... give the weights new storage: drafting copies start again
        self._draft_copies.clear()
        return super()._apply(fn, *args, **kwargs)

    def init_from_model(self, model) -> TopDraftHeads:
        """Start the output norm from the model's final norm, then bind. Heads made for this
        very model (same fingerprint) record its weight probe in their config."""
        norm = final_norm_weight(model)
        with torch.no_grad():
            self.out_norm.copy_(norm.to(self.out_norm.dtype))
        if not self.config.base_probe and self.config.base_fingerprint == fingerprint(model):
            self.config.base_probe = weight_probe(model)
        return self.bind(model)

    def deepened(self, depth: int) -> TopDraftHeads:
        """The same heads with `depth` > config.depth steps, bound like these: the new steps
        start as copies of the last one (a step maps (state, token) to the next state at
        any depth, so the last step is the closest warm start for training them)."""
        if depth <= self.config.depth:
            raise ValueError(f"depth {depth} is not deeper than the heads' {self.config.depth}")
        cfg = TopHeadsConfig.from_dict({**self.config.to_dict(), "depth": depth, "training": {}})
        deeper = TopDraftHeads(cfg, self.vocab_ids).to(device=self.out_norm.device, dtype=self.out_norm.dtype)
        state = self.state_dict()
        last = f"steps.{self.config.depth - 1}."
        for i in range(self.config.depth, depth):
            for key in [k for k in state if k.startswith(last)]:
                state[f"steps.{i}." + key[len(last):]] = state[key].clone()
        deeper.load_state_dict(state, strict=True)
        deeper.lm_rows, deeper.embed = self.lm_rows, self.embed
        deeper._fast_linear = getattr(self, "_fast_linear", None)
        deeper._fused_step = getattr(self, "_fused_step", None)
        return deeper

    # ---- maths -----------------------------------------------------------------------

    def step_logits(self, i: int, h: torch.Tensor, tokens: torch.Tensor):
        """Step i: state h [n, H], previous tokens [n] -> (next state, logits [n, V]).
        Drafting (no autograd) on a float32 CPU model runs the products through the C++
        row kernel, which is faster than F.linear there for the LM-head product, most of
        a draft's cost (docs/head_study.md), and reads 16-bit copies of the step weights
        and LM-head rows (`_draft_weight`): drafting streams these bytes every step, and
        a draft is only a proposal (the model verifies it), so their rounding can change
        which tokens are proposed, never the output."""
        fast = getattr(self, "_fast_linear", None)
        step = self.steps[i]
        if fast is None or torch.is_grad_enabled():
            h = step(h, F.embedding(tokens, self.embed))
            normed = rms_norm(h.to(self.out_norm.dtype), self.out_norm, self.config.rms_norm_eps)
            return h, F.linear(normed, self.lm_rows)
        x = torch.cat([rms_norm(h.to(step.h_norm.dtype), step.h_norm, step.eps),
                       rms_norm(F.embedding(tokens, self.embed).to(step.e_norm.dtype), step.e_norm, step.eps)],
                      dim=-1)
        down = self._draft_weight(f"steps.{i}.down", step.down.weight)
        up = self._draft_weight(f"steps.{i}.up", step.up.weight)
        h = h + fast(F.silu(fast(x, down)), up)
        normed = rms_norm(h.to(self.out_norm.dtype), self.out_norm, self.config.rms_norm_eps)
        return h, fast(normed, self._draft_weight("lm_rows", self.lm_rows))

    def step_top(self, i: int, h: torch.Tensor, tokens: torch.Tensor, k: int):
        """Step i's next state and its k likeliest tokens: state h [n, H], previous tokens
        [n] -> (next state [n, H], probabilities [n, k] (softmax over the reduced
        vocabulary, float32), indices [n, k] into it, likeliest first). Drafting on a float32
        CPU model runs the whole step as one C++ call on the 16-bit copies `step_logits`
        reads (its own rounding: a draft is a proposal); elsewhere `step_logits`."""
        fused = getattr(self, "_fused_step", None)
        if fused is None or torch.is_grad_enabled():
            h, logits = self.step_logits(i, h, tokens)
            probs, index = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
            return h, probs, index
        step = self.steps[i]
        h, probs, index = fused(
            h.contiguous(), F.embedding(tokens, self.embed).contiguous(), step.h_norm, step.e_norm,
            self._draft_weight(f"steps.{i}.down", step.down.weight),
            self._draft_weight(f"steps.{i}.up", step.up.weight),
            self.out_norm, self._draft_weight("lm_rows", self.lm_rows), step.eps, self.config.rms_norm_eps, k)
        return h, probs, index

    def _draft_weight(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` as drafting reads it: a float16 copy (exact for heads stored in float16,
        the shipped heads' storage), bfloat16 where a magnitude exceeds float16's range.
        The copy is made again whenever the weight changes (new storage, or an in-place
        update such as a training step bumps its version)."""
        key = (weight.data_ptr(), version_counter(weight))
        found = self._draft_copies.get(name)
        if found is not None and found[0] == key:
            return found[1]
        w = weight.detach()
        dtype = torch.float16 if float(w.abs().max()) <= FLOAT16_MAX else torch.bfloat16
        copy = w.to(dtype).contiguous()
        self._draft_copies[name] = (key, copy)
        return copy

    @torch.no_grad()
    def draft(self, final_hidden: torch.Tensor, token: int, max_tokens: int,
              thresholds: list[float]) -> list[tuple[int, float, int]]:
        """Chain up to `max_tokens` drafts after `token`, from the final hidden state
        [H] of the row that produced it; stop at the first step whose confidence is
        below its threshold. Returns [(token, confidence, step)]."""
        out = []
        h = final_hidden.reshape(1, -1)
        prev = torch.tensor([token], device=h.device)
        for i in range(min(max_tokens, len(self.steps))):
            h, conf, index = self.step_top(i, h, prev, 1)
            conf_value = float(conf)
            if conf_value < thresholds[i]:
                break
            prev = self.vocab_ids[index].reshape(1)
            out.append((int(prev), conf_value, i))
        return out

    @torch.no_grad()
    def draft_tree(self, final_hidden: torch.Tensor, token: int, depth: int, thresholds: list[float],
                   children: int, beam: int, min_prob: float,
                   stop_tokens: frozenset[int] | set[int] = frozenset()) -> list[DraftNode]:
        """A dynamic draft tree (EAGLE-2's): at each chain step the `beam` most likely nodes
        so far (path probability, the product of the head probabilities along the path) are
        expanded at once (one batched head step) by their `children` most likely next
        tokens. A node is not expanded when its best next token's head probability is below
        the step's threshold (as `draft` stops its chain), nor after a stop token; a child
        other than the top-1 chain's is kept only with path probability >= min_prob.
        Returns the nodes most likely first (a parent before its children): taking any
        prefix of the list gives a tree."""
        return self.draft_trees(final_hidden.reshape(1, -1), [token], [depth], thresholds, children, beam,
                                min_prob, [stop_tokens])[0]

    @torch.no_grad()
    def draft_trees(self, final_hidden: torch.Tensor, tokens: list[int], depths: list[int],
                    thresholds: list[float], children: int, beam: int, min_prob: float,
                    stop_tokens: list[frozenset[int] | set[int]]) -> list[list[DraftNode]]:
        """`draft_tree` for several sequences at once (a batch): final_hidden [B, H], one
        root token, depth and stop set each. Each head step runs on the frontier rows of
        every sequence together (the heads' weights and LM-head rows read once per step);
        each sequence's tree is the one `draft_tree` gives it alone."""
        depths = [min(d, len(self.steps)) for d in depths]
        owner = [b for b, d in enumerate(depths) if d > 0]  # the sequence of each row of h
        h = final_hidden[owner]
        step_tokens = torch.tensor([tokens[b] for b in owner], dtype=torch.long, device=h.device)
        # (node index, path probability, on the top-1 chain)
        frontiers = [[(-1, 1.0, True)] if d > 0 else [] for d in depths]
        nodes: list[list[DraftNode]] = [[] for _ in tokens]
        k = min(children, self.lm_rows.shape[0])
        for step in range(max(depths, default=0)):
            if not owner:
                break
            h, top_p, top_i = self.step_top(step, h, step_tokens, k)
            top_tokens = self.vocab_ids[top_i].tolist()
            top_p = top_p.tolist()
            keep_rows, keep_tokens, keep_owner = [], [], []
            lo = 0
            while lo < len(owner):  # each sequence's rows are consecutive
                b = owner[lo]
                hi = lo + len(frontiers[b])
                expanded = []  # (path probability, node index, row of h)
                for row, (parent, prob, on_chain) in zip(range(lo, hi), frontiers[b]):
                    if top_p[row][0] < thresholds[step]:
                        continue
                    for c in range(k):
                        path = prob * top_p[row][c]
                        chain = on_chain and c == 0
                        if not chain and path < min_prob:
                            break  # children are sorted: the rest are less likely still
                        nodes[b].append(DraftNode(parent, top_tokens[row][c], path, step, chain))
                        if top_tokens[row][c] not in stop_tokens[b]:
                            expanded.append((path, len(nodes[b]) - 1, row))
                lo = hi
                if not expanded or step + 1 >= depths[b]:
                    frontiers[b] = []
                    continue
                expanded.sort(key=lambda e: -e[0])
                expanded = expanded[:beam]
                keep_rows += [row for _p, _n, row in expanded]
                keep_tokens += [nodes[b][n].token for _p, n, _r in expanded]
                keep_owner += [b] * len(expanded)
                frontiers[b] = [(n, p, nodes[b][n].on_chain) for p, n, _r in expanded]
            if not keep_rows:
                break
            h = h[torch.tensor(keep_rows, device=h.device)]
            step_tokens = torch.tensor(keep_tokens, device=h.device)
            owner = keep_owner
        return [likeliest_first(found) for found in nodes]


def random_top_heads(model, depth: int = 2, seed: int = 0, adapter: int = 16, scale: float = 0.3) -> TopDraftHeads:
    """Top heads over the whole vocabulary whose step 0 is the untrained logit lens of the
    final state (often right) and whose later steps are random (confident, mostly wrong), so
    chains break and trees branch: for tests and device checks of the decode loop, never for
    drafting in earnest."""
    cfg, vocab = model.config, model.get_output_embeddings().out_features  # the logits' width
    config = TopHeadsConfig(base_model="random", base_fingerprint=fingerprint(model),
                            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                            vocab_size=vocab, depth=depth, adapter_dim=adapter, reduced_vocab=vocab)
    heads = TopDraftHeads(config, torch.arange(vocab)).init_from_model(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for step in heads.steps[1:]:
            for p in (step.down.weight, step.up.weight):
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return heads
