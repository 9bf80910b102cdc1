"""Exit heads: cheap predictors of the model's final greedy token from an early layer.

A head reads the residual stream after `layer` decoder layers (HF's
`output_hidden_states[layer]`, 1 <= layer < num_layers) and scores a reduced vocabulary
V_k (the most frequent greedy targets), optionally plus one reject class ⊥:

    h = RMSNorm(x) * w_in                       # (n, H)  the raw residual stream, normalised
    h = h + up(silu(down(h)))                   # (n, H)  small residual adapter H -> r -> H
    h = RMSNorm(h) * w_out                      # (n, H)  w_out starts as the model's final norm
    logits = h @ E[V_k].T  (| h @ w_rej + b)    # (n, V_k (+1))  E = the model's LM head, frozen

The LM-head rows E[V_k] are not part of a head's weights: `bind(model)` gathers them from
the base model, so head files stay small and always match the model they run on. With
`up` initialised to zero a fresh head is the "logit lens" over V_k.

Confidence is the head's top probability among V_k (softmax over V_k and ⊥), and 0 when
⊥ wins. In training ⊥ is the label of targets outside V_k, so a head says "not mine"
instead of guessing a wrong in-vocabulary token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.layered import rms_norm
from . import checks
from .base import (
    HeadsIdentity,
    final_norm_weight,
    fingerprint,
    lm_head_weight,
    model_name,
    norm_eps,
    weight_probe,
)

if TYPE_CHECKING:  # pragma: no cover
    from .calibrate import Calibration

HEAD_KIND = "exit_head"


class ExitHead(nn.Module):
    """One exit head at `layer`: hidden [n, H] -> logits over V_k (+ reject).

    Args:
        layer: number of decoder layers before the head (reads hidden_states[layer]).
        hidden_size: H of the base model.
        vocab_ids: LongTensor[V_k] of full-vocabulary ids the head can propose.
        adapter_dim: r of the residual adapter.
        reject_class: add the reject class ⊥.
        eps: RMSNorm epsilon (the base model's).
    """

    def __init__(
        self,
        layer: int,
        hidden_size: int,
        vocab_ids: torch.Tensor,
        adapter_dim: int = 256,
        reject_class: bool = True,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long)
        if vocab_ids.ndim != 1 or vocab_ids.numel() == 0:
            raise ValueError("vocab_ids must be a non-empty 1-D tensor of token ids")
        self.layer = int(layer)
        self.hidden_size = int(hidden_size)
        self.adapter_dim = int(adapter_dim)
        self.reject_class = bool(reject_class)
        self.eps = float(eps)
        self.in_norm = nn.Parameter(torch.ones(hidden_size))
        self.down = nn.Linear(hidden_size, adapter_dim, bias=False)
        self.up = nn.Linear(adapter_dim, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)  # start as the logit lens over V_k
        self.out_norm = nn.Parameter(torch.ones(hidden_size))
        self.reject = nn.Linear(hidden_size, 1) if reject_class else None
        if self.reject is not None:
            nn.init.zeros_(self.reject.weight)
            nn.init.constant_(self.reject.bias, -4.0)  # ⊥ starts unlikely
        self.register_buffer("vocab_ids", vocab_ids.clone())
        # [V_k, H] rows of the base model's LM head; gathered by bind(), never saved.
        self.register_buffer("lm_rows", None, persistent=False)

    @property
    def num_classes(self) -> int:
        return self.vocab_ids.numel() + int(self.reject_class)

    @property
    def vocab_size(self) -> int:
        return self.vocab_ids.numel()

    def bind(self, model) -> ExitHead:
        """Gather E[V_k] from `model`'s LM head and move the head to its device and dtype."""
        from hf_selfspec.engine.dispatch import onloaded

        with onloaded(model.get_output_embeddings()):  # (brought in where accelerate offloads it)
            return self._bind(lm_head_weight(model))

    def _bind(self, weight: torch.Tensor) -> ExitHead:
        if int(self.vocab_ids.max()) >= weight.shape[0]:
            raise ValueError(
                f"head at layer {self.layer} proposes token id {int(self.vocab_ids.max())} but "
                f"the model's vocabulary has {weight.shape[0]} tokens"
            )
        if weight.shape[1] != self.hidden_size:
            raise ValueError(
                f"head at layer {self.layer} has hidden size {self.hidden_size}, the model "
                f"{weight.shape[1]}"
            )
        self.to(device=weight.device, dtype=weight.dtype)
        self.lm_rows = weight.detach()[self.vocab_ids.to(weight.device)].contiguous()
        return self

    def init_from_model(self, model) -> ExitHead:
        """Start w_out (and eps) from the model's final norm, then bind: a logit lens."""
        with torch.no_grad():
            self.out_norm.copy_(final_norm_weight(model).float().to(self.out_norm.device))
        self.eps = norm_eps(model, self.eps)
        return self.bind(model)

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        h = rms_norm(hidden, self.in_norm, self.eps)
        h = h + self.up(F.silu(self.down(h)))
        return rms_norm(h, self.out_norm, self.eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, V_k (+1)]; the last column is ⊥ when present."""
        if self.lm_rows is None:
            raise RuntimeError(
                "call bind(model) (or load_heads(source, model)) before using a head"
            )
        h = self._features(hidden.to(self.in_norm.dtype))
        logits = F.linear(h, self.lm_rows)  # (n, V_k)
        if self.reject is not None:
            logits = torch.cat([logits, self.reject(h)], dim=-1)  # (n, V_k + 1)
        return logits

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, H] -> (confidence float32[n], token int64[n] full-vocabulary ids)."""
        logits = self(hidden).float()
        v = self.vocab_size
        best, index = logits[:, :v].max(dim=-1)
        confidence = torch.exp(best - torch.logsumexp(logits, dim=-1))
        if self.reject is not None:
            confidence = torch.where(logits[:, v] > best, torch.zeros_like(confidence), confidence)
        return confidence, self.vocab_ids[index]

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, H] -> (probs float32[n, k], tokens int64[n, k]), best first.

        Probabilities are the head's (softmax over V_k and ⊥), so they sum to <= 1.
        """
        logits = self(hidden).float()
        probs = torch.softmax(logits, dim=-1)[:, : self.vocab_size]
        values, index = probs.topk(min(k, self.vocab_size), dim=-1)
        return values, self.vocab_ids[index]

    @torch.no_grad()
    def distribution(
        self, hidden: torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, H] -> (probs float32[n, V_k] over V_k without ⊥, vocab_ids [V_k]).

        The draft distribution q of speculative sampling at `temperature` (> 0).
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        logits = self(hidden).float()[:, : self.vocab_size]
        return torch.softmax(logits / temperature, dim=-1), self.vocab_ids

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer}, vocab={self.vocab_size}, adapter={self.adapter_dim}, "
            f"reject={self.reject_class}"
        )


@dataclass(kw_only=True)
class ExitHeadsConfig(HeadsIdentity):
    """What an exit-heads repo's config.json says: the base model (HeadsIdentity's fields)
    and the heads: their layers, reduced vocabularies and adapters."""

    KIND: ClassVar[str] = HEAD_KIND
    REQUIRED: ClassVar[tuple[str, ...]] = ("layers", "vocab_sizes", "adapter_dims")
    MIN_LAYERS: ClassVar[int] = 2  # a head reads an early layer, 1 <= layer < num_layers

    layers: list[int]
    vocab_sizes: list[int]
    adapter_dims: list[int]
    reject_class: bool = True
    kind: str = HEAD_KIND

    def _validate_own(self) -> None:
        for name in ("layers", "vocab_sizes", "adapter_dims"):
            checks.need_list(name, getattr(self, name), self.num_layers)
        n = len(self.layers)
        if n == 0:
            raise ValueError("layers is empty: a heads config needs at least one head")
        for name in ("vocab_sizes", "adapter_dims"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, layers has {n}")
        if any(not checks.is_int(layer) or not 1 <= layer < self.num_layers for layer in self.layers):
            raise ValueError(f"layers {self.layers} must be integers in [1, {self.num_layers - 1}]")
        if list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"layers {self.layers} must be strictly increasing (shallow -> deep)")
        if any(not checks.is_int(v) or not 1 <= v <= self.vocab_size for v in self.vocab_sizes):
            raise ValueError(f"vocab_sizes {self.vocab_sizes} must be in [1, {self.vocab_size}]")
        max_r = checks.MAX_ADAPTER_FACTOR * self.hidden_size
        if any(not checks.is_int(r) or not 1 <= r <= max_r for r in self.adapter_dims):
            raise ValueError(
                f"adapter_dims {self.adapter_dims} must be integers in [1, {max_r}] "
                f"({checks.MAX_ADAPTER_FACTOR} x hidden_size)"
            )
        checks.need_bool("reject_class", self.reject_class)


HeadsConfig = ExitHeadsConfig  # the name it had before the other kinds came


class ExitHeads(nn.Module):
    """An ordered (shallow -> deep) set of exit heads for one base model.

    Attributes:
        config: ExitHeadsConfig.
        heads: nn.ModuleList[ExitHead], `heads[i].layer == config.layers[i]`.
        calibration: Calibration or None (confidence -> P(accept), thresholds).
    """

    kind = HEAD_KIND

    def __init__(
        self,
        config: ExitHeadsConfig,
        heads: list[ExitHead] | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        super().__init__()
        config.validate()
        if heads is None:  # empty heads of the right shapes, e.g. to load weights into
            heads = [
                ExitHead(
                    layer,
                    config.hidden_size,
                    torch.zeros(v, dtype=torch.long),
                    r,
                    config.reject_class,
                    config.rms_norm_eps,
                )
                for layer, v, r in zip(config.layers, config.vocab_sizes, config.adapter_dims)
            ]
        if [h.layer for h in heads] != list(config.layers):
            raise ValueError(
                f"head layers {[h.layer for h in heads]} differ from config {config.layers}"
            )
        if calibration is not None and len(calibration.heads) != len(heads):
            raise ValueError(
                f"calibration has {len(calibration.heads)} heads, expected {len(heads)}"
            )
        self.config = config
        self.heads = nn.ModuleList(heads)
        self.calibration = calibration

    @classmethod
    def create(
        cls,
        model,
        layers,
        vocab_ids,
        adapter_dims=256,
        reject_class: bool = True,
        base_model: str | None = None,
    ) -> ExitHeads:
        """Fresh (untrained, logit-lens) heads for `model`.

        Args:
            layers: head layers, strictly increasing.
            vocab_ids: one LongTensor[V_k] per head (or one shared by all heads).
            adapter_dims: r per head or one int.
        """
        from hf_selfspec.engine.layered import text_config

        cfg = text_config(model)
        layers = [int(layer) for layer in layers]
        if isinstance(vocab_ids, torch.Tensor):
            vocab_ids = [vocab_ids] * len(layers)
        if isinstance(adapter_dims, int):
            adapter_dims = [adapter_dims] * len(layers)
        eps = norm_eps(model)
        config = ExitHeadsConfig(
            base_model=base_model or model_name(model),
            base_fingerprint=fingerprint(model),
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            vocab_size=lm_head_weight(model).shape[0],
            layers=layers,
            vocab_sizes=[int(v.numel()) for v in vocab_ids],
            adapter_dims=[int(r) for r in adapter_dims],
            reject_class=reject_class,
            rms_norm_eps=eps,
            base_probe=weight_probe(model),
        )
        heads = [
            ExitHead(layer, cfg.hidden_size, v, r, reject_class, eps).init_from_model(model)
            for layer, v, r in zip(layers, vocab_ids, adapter_dims)
        ]
        return cls(config, heads)

    def bind(self, model) -> ExitHeads:
        for head in self.heads:
            head.bind(model)
        return self

    @property
    def layers(self) -> list[int]:
        return [h.layer for h in self.heads]

    def __len__(self) -> int:
        return len(self.heads)

    def __iter__(self):
        return iter(self.heads)

    def __getitem__(self, index: int) -> ExitHead:
        return self.heads[index]
