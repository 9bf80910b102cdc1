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
model's own argmax (scripts/head_study.py).

On a CPU whose engine verifies 1-4 rows for about the cost of one step (the wx4 row
layout; 1-3 rows in micro or wx), a chain of up to three drafts from these heads is nearly
free: any acceptance is a gain.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

TOP_KIND = "top_draft"
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype)


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


@dataclass
class TopHeadsConfig:
    """config.json of a top-draft heads repo."""

    base_model: str
    base_fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    depth: int  # drafts per cycle the heads can make
    adapter_dim: int
    reduced_vocab: int
    rms_norm_eps: float = 1e-5
    # dtype of the weights in heads.safetensors (they run in the model's dtype): the shipped
    # heads are stored as float16, which leaves their drafts' own-eval tau unchanged (1.843)
    storage_dtype: str = "float32"
    kind: str = TOP_KIND
    format_version: int = 1
    training: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.kind != TOP_KIND:
            raise ValueError(f"kind must be {TOP_KIND!r}, got {self.kind!r}")
        for name in ("num_layers", "hidden_size", "vocab_size", "depth", "adapter_dim", "reduced_vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.reduced_vocab > self.vocab_size:
            raise ValueError("reduced_vocab exceeds vocab_size")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {self.storage_dtype!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TopHeadsConfig:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        cfg = cls(**known)
        cfg.validate()
        return cfg


def _fast_linear(weight: torch.Tensor):
    """x [n, K] @ w[O, K]^T through the C++ row kernel for float32 CPU weights, where it
    builds (kernels/cpu_rows.py); None otherwise (F.linear is used)."""
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
        x = torch.cat([_norm(h, self.h_norm, self.eps), _norm(e, self.e_norm, self.eps)], dim=-1)
        return h + linear(F.silu(linear(x, self.down.weight)), self.up.weight)


class TopDraftHeads(nn.Module):
    """A chain of `depth` top draft steps sharing one output norm and LM-head rows."""

    kind = TOP_KIND

    def __init__(self, config: TopHeadsConfig, vocab_ids: torch.Tensor | None = None):
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

    # ---- binding ---------------------------------------------------------------------

    def bind(self, model) -> TopDraftHeads:
        lm = model.get_output_embeddings().weight
        emb = model.get_input_embeddings().weight
        if lm.shape[1] != self.config.hidden_size:
            raise ValueError(f"heads have hidden size {self.config.hidden_size}, the model {lm.shape[1]}")
        if int(self.vocab_ids.max()) >= lm.shape[0]:
            raise ValueError("heads propose token ids outside the model's vocabulary")
        self.to(device=lm.device, dtype=lm.dtype)
        self.lm_rows = lm.detach()[self.vocab_ids.to(lm.device)].contiguous()
        self.embed = emb.detach()
        if self.out_norm.device != lm.device:
            self.to(lm.device)
        self._fast_linear = _fast_linear(lm)
        return self

    def init_from_model(self, model) -> TopDraftHeads:
        norm = model.model.norm.weight.detach()
        with torch.no_grad():
            self.out_norm.copy_(norm.to(self.out_norm.dtype))
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
        return deeper

    # ---- maths -----------------------------------------------------------------------

    def step_logits(self, i: int, h: torch.Tensor, tokens: torch.Tensor):
        """Step i: state h [n, H], previous tokens [n] -> (next state, logits [n, V]).
        Drafting (no autograd) on a float32 CPU model runs the products through the C++
        row kernel: one 8,192-row LM-head product took 0.8 ms there vs 1.9-2.4 ms with
        F.linear (2-core AMD EPYC), most of a draft's cost."""
        fast = getattr(self, "_fast_linear", None)
        linear = fast if fast is not None and not torch.is_grad_enabled() else F.linear
        h = self.steps[i](h, F.embedding(tokens, self.embed), linear)
        logits = linear(_norm(h, self.out_norm, self.config.rms_norm_eps), self.lm_rows)
        return h, logits

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
            h, logits = self.step_logits(i, h, prev)
            conf, index = torch.softmax(logits.float(), dim=-1)[0].max(dim=-1)
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
        prefix of the list gives a tree. On held-out own replies (scripts/head_study.py
        dyn-trees, beam 4, children 4) the shipped heads' first 3 nodes accept 2.015 tokens
        per cycle vs 1.924 for their chain of 3, the first 7 nodes 2.312."""
        h = final_hidden.reshape(1, -1)
        tokens = torch.tensor([token], device=h.device)
        frontier = [(-1, 1.0, True)]  # (node index, path probability, on the top-1 chain)
        nodes: list[DraftNode] = []
        k = min(children, self.lm_rows.shape[0])
        depth = min(depth, len(self.steps))
        for step in range(depth):
            h, logits = self.step_logits(step, h, tokens)
            top_p, top_i = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
            top_tokens = self.vocab_ids[top_i].tolist()
            top_p = top_p.tolist()
            expanded = []  # (path probability, node index, frontier row)
            for row, (parent, prob, on_chain) in enumerate(frontier):
                if top_p[row][0] < thresholds[step]:
                    continue
                for c in range(k):
                    path = prob * top_p[row][c]
                    chain = on_chain and c == 0
                    if not chain and path < min_prob:
                        break  # children are sorted: the rest are less likely still
                    nodes.append(DraftNode(parent, top_tokens[row][c], path, step, chain))
                    if top_tokens[row][c] not in stop_tokens:
                        expanded.append((path, len(nodes) - 1, row))
            if not expanded or step + 1 >= depth:
                break
            expanded.sort(key=lambda e: -e[0])
            expanded = expanded[:beam]
            rows = torch.tensor([row for _p, _n, row in expanded], device=h.device)
            h = h[rows]
            tokens = torch.tensor([nodes[n].token for _p, n, _r in expanded], device=h.device)
            frontier = [(n, p, nodes[n].on_chain) for p, n, _r in expanded]
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].prob, nodes[i].step))
        position = {old: new for new, old in enumerate(order)}
        return [nodes[i]._replace(parent=position.get(nodes[i].parent, -1)) for i in order]
