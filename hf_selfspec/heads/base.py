"""What every head kind needs to know about its base model: the config identity every
kind's config extends (HeadsIdentity), the final norm and LM head, a weight fingerprint,
and the one compatibility check. (The heads' RMSNorm is the engine's, engine.layered.)

Heads only propose tokens; the model verifies every one of them, so heads for a slightly
different checkpoint cost speed, never exactness. The check therefore refuses only what
cannot work (another shape or vocabulary, or weights so far away that the heads are
another model's) and warns, saying how far, when the weights differ a little:

    dimensions differ                        -> ValueError (refused)
    fingerprint equal                        -> silent
    probe equal up to the model's dtype       -> silent (the same checkpoint in fp16, say)
    probe distance <= MAX_WEIGHT_DISTANCE     -> HeadsMismatchWarning naming the distance
    probe distance >  MAX_WEIGHT_DISTANCE     -> ValueError (another model's weights)
    no probe stored (older top-layer heads)   -> HeadsMismatchWarning (distance unknown)

The probe is a fixed sample of a few hundred base weights (embedding rows, three decoder
layers, the final norm) stored in config.json as `base_probe`; the distance is the relative
distance ||w_model - w_heads|| / ||w_heads|| of each sampled weight, root-mean-square over
them (see weight_distance).
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar, Literal, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from . import checks

# Weight sample of the fingerprint: these many leading values of the first row of each
# sampled matrix, from this many evenly spaced embedding rows and three decoder layers.
_PROBE_VALUES = 16
_PROBE_EMBED_ROWS = 8
# A relative distance of 0.5 means the weights differ by half their own size: no fine-tune
# or quantisation of one checkpoint moves that far, two unrelated models of one shape do
# (independent weights are ~1.4 apart), so beyond it the heads are another model's.
MAX_WEIGHT_DISTANCE = 0.5
# Probe values are stored with 9 significant digits (float32 round-trips); older heads
# stored 6, i.e. a relative rounding of up to 5e-6.
_STORAGE_RTOL = 1e-5


class HeadsMismatchWarning(UserWarning):
    """Heads load on a checkpoint whose weights differ a little from their base model's."""


def final_norm(model) -> nn.Module:
    """The final norm module of an HF causal LM (`model.model.norm`; Phi's final_layernorm,
    GPT-NeoX's final_layer_norm; an image-text model's language model's)."""
    from hf_selfspec.engine.layered import UnsupportedModelError, decoder_final_norm, text_decoder

    decoder = text_decoder(model)
    try:
        return decoder_final_norm(decoder)
    except (UnsupportedModelError, AttributeError):
        raise ValueError(
            f"{type(model).__name__} has no final norm the heads know (model.model.norm, "
            "final_layernorm, final_layer_norm): heads support the causal LMs the engine runs"
        ) from None


def final_norm_weight(model) -> torch.Tensor:
    """The final norm's scale as the engine's `rms_norm` takes it: its weight, or 1 + weight for models
    whose norm scales by (1 + w) (Gemma), in float32 there; ones for a norm without a weight
    (OLMo's LayerNorm). A head's own RMSNorm starts from it."""
    from hf_selfspec.engine.layered import NORM_PLUS_ONE_TYPES, text_config

    norm = final_norm(model)
    if getattr(norm, "weight", None) is None:
        embed = model.get_input_embeddings().weight
        return torch.ones(embed.shape[1], dtype=embed.dtype, device=embed.device)
    weight = norm.weight.detach()
    if getattr(text_config(model), "model_type", None) in NORM_PLUS_ONE_TYPES:
        return 1.0 + weight.float()
    return weight


def norm_eps(model, default: float = 1e-5) -> float:
    """The final norm's epsilon (HF names it variance_epsilon or eps)."""
    norm = final_norm(model)
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", default)))


def lm_head_weight(model) -> torch.Tensor:
    """The LM-head matrix [vocab, hidden] of an HF causal LM."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    return head.weight


def model_name(model) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def model_dims(model) -> dict:
    """The dimensions heads depend on, plus what else the fingerprint hashes."""
    from hf_selfspec.engine.layered import text_config

    cfg = text_config(model)
    return {
        "model_type": getattr(cfg, "model_type", type(model).__name__),
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": getattr(cfg, "num_attention_heads", None),
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
        "vocab_size": int(lm_head_weight(model).shape[0]),
    }


@torch.no_grad()
def probe_parts(model) -> list[torch.Tensor]:
    """The weight sample, one float32 CPU tensor per sampled weight: evenly spaced
    embedding rows, the first row of each matrix of three decoder layers, the final norm."""
    from hf_selfspec.engine.dispatch import onloaded
    from hf_selfspec.engine.layered import decoder_layers, text_decoder

    # (a model accelerate offloads: each part's weights brought in while it is sampled)
    parts = []
    with onloaded(model.get_input_embeddings()):
        embed = model.get_input_embeddings().weight
        rows = torch.linspace(0, embed.shape[0] - 1, _PROBE_EMBED_ROWS).long()
        parts.append(embed[rows.to(embed.device), :_PROBE_VALUES].reshape(-1).float().cpu())
    layers = decoder_layers(text_decoder(model))
    for i in sorted({0, len(layers) // 2, len(layers) - 1}):
        with onloaded(layers[i]):
            parts += [p[0, :_PROBE_VALUES].float().cpu().clone() for _name, p in layers[i].named_parameters()
                      if p.ndim == 2]
    with onloaded(final_norm(model)):
        norm_weight = getattr(final_norm(model), "weight", None)
        if norm_weight is not None:  # OLMo's final LayerNorm has none
            parts.append(norm_weight[:_PROBE_VALUES].float().cpu())
    return [p.detach() for p in parts]


def probe_tensor(model) -> torch.Tensor:
    """The weight sample as one float32 tensor [P] (what the fingerprint hashes)."""
    return torch.cat(probe_parts(model))


def weight_probe(model) -> list[float]:
    """The fingerprint's weight sample as floats (stored in config.json as base_probe)."""
    return [float(f"{v:.9g}") for v in probe_tensor(model).tolist()]


def fingerprint(model) -> str:
    """sha256 hex over the model's dimensions and a fixed sample of its weights.

    Weights are rounded to bfloat16 first, so the fp32 and bf16 loads of one checkpoint
    share a fingerprint. Cheap: a few hundred values are copied to the CPU.
    """
    h = hashlib.sha256(json.dumps(model_dims(model), sort_keys=True).encode())
    probe = probe_tensor(model).to(torch.bfloat16).view(torch.int16).numpy()
    h.update(probe.tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- identity

FORMAT_VERSION = 1  # of every kind's config.json


@dataclass(kw_only=True)
class HeadsIdentity:
    """The config.json fields every head kind shares, and their checks: which base model
    (name, fingerprint, weight probe, dimensions), its RMSNorm epsilon, the kind, the
    format version and free-form training provenance. Each kind's config extends it with
    its own fields (`KIND`, `REQUIRED` and `_validate_own`); `from_dict` / `to_dict` /
    `validate` are this class's for every kind."""

    KIND: ClassVar[str] = ""  # the kind's "kind" string
    REQUIRED: ClassVar[tuple[str, ...]] = ()  # the kind's own fields a config.json must hold
    MIN_LAYERS: ClassVar[int] = 1  # the fewest base-model layers the kind works with

    base_model: str
    base_fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    kind: str = ""
    format_version: int = FORMAT_VERSION
    # Free-form provenance for the model card: data, positions, time, measured agreement.
    training: dict = field(default_factory=dict)
    # The fingerprint's weight sample: says how far another checkpoint of the same shape
    # is from the heads' base model (see check_compatible). Heads saved before it existed
    # have none and load on a near-identical checkpoint with a warning.
    base_probe: list[float] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError naming the first field of a wrong type, shape or range.

        Sizes are bounded by the config's own dimensions (checked against the base model
        by check_compatible before anything is allocated) and by checks.MAX_*."""
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"heads format_version {self.format_version!r} is not supported (this "
                f"hf_selfspec reads version {FORMAT_VERSION}); upgrade hf_selfspec or re-save the heads"
            )
        if self.kind != self.KIND:
            raise ValueError(
                f"heads kind {self.kind!r} is not supported here (this config class reads {self.KIND!r})"
            )
        checks.need_model_identity(self, min_layers=self.MIN_LAYERS)
        self._validate_own()
        checks.need_number("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0, open_lo=True)
        checks.need_list("base_probe", self.base_probe, checks.MAX_PROBE)
        if not all(checks.is_number(v) for v in self.base_probe):
            raise ValueError("field 'base_probe' must hold finite numbers only")
        checks.need_dict("training", self.training)

    def _validate_own(self) -> None:
        """The kind's own fields (ValueError naming the field)."""

    def to_dict(self) -> dict:
        """The config.json fields: the base model's identity, the kind's own fields, then
        the shared rest (the long probe and provenance last)."""
        data = asdict(self)
        shared = [f.name for f in fields(HeadsIdentity)]
        own = [k for k in data if k not in shared]
        return {k: data[k] for k in [*shared[:5], *own, *shared[5:]]}

    @classmethod
    def from_dict(cls, data: dict):
        """Build and validate; ValueError on missing or malformed fields (unknown keys ignored)."""
        checks.need_object(data, "a heads config")
        checks.need_fields(data, checks.IDENTITY_FIELDS + cls.REQUIRED)
        names = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in data.items() if k in names})
        config.validate()
        return config


def weight_distance(config: HeadsIdentity, model) -> float | None:
    """How far `model`'s weights are from the heads' base model: per sampled weight the
    relative distance ||probe_model - base_probe|| / ||base_probe||, root-mean-square over
    the sampled weights (so the final norm's values near 1 do not swamp the matrices').
    None without a stored probe; inf when the probes cannot be compared (another layout)."""
    if not config.base_probe:
        return None
    parts = probe_parts(model)
    stored = torch.tensor(config.base_probe, dtype=torch.float64)
    if stored.numel() != sum(p.numel() for p in parts):
        return float("inf")
    squares = []
    for found, base in zip(parts, stored.split([p.numel() for p in parts])):
        found = found.double()
        scale = max(float(base.norm()), float(found.norm()), 1e-30)
        squares.append((float((found - base).norm()) / scale) ** 2)
    return math.sqrt(sum(squares) / len(squares))


def _same_up_to_dtype(config: HeadsIdentity, model) -> bool:
    """The stored probe equals the model's up to rounding to the model's dtype (the same
    checkpoint loaded in fp16 has another fingerprint, though not other weights)."""
    probe = probe_tensor(model).numpy().astype(np.float64)
    stored = np.asarray(config.base_probe, dtype=np.float64)
    if stored.shape != probe.shape:
        return False
    dtype = lm_head_weight(model).dtype
    rtol = max(torch.finfo(dtype).eps if dtype.is_floating_point else 0.0, _STORAGE_RTOL)
    atol = 1e-3 * rtol * max(float(np.abs(stored).max()), 1e-30)  # fp16 subnormals
    return bool(np.all(np.abs(probe - stored) <= rtol * np.abs(stored) + atol))


def check_compatible(config: HeadsIdentity, model) -> None:
    """Refuse heads that cannot fit `model`; warn (HeadsMismatchWarning) when they were
    trained on slightly different weights. See the module docstring for the rule.

    Raises:
        ValueError: another layer count, hidden size or vocabulary, or weights further
            than MAX_WEIGHT_DISTANCE from the heads' base model.
    """
    dims = model_dims(model)
    advice = (
        f"Load the heads with the model they were trained for ('{config.base_model}'), "
        "or train heads for this model (hf-selfspec train-heads)."
    )
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if dims[key] != getattr(config, key):
            raise ValueError(
                f"These heads are for '{config.base_model}' ({key}={getattr(config, key)}), but "
                f"the model '{model_name(model)}' has {key}={dims[key]}. {advice}"
            )
    found = fingerprint(model)
    if found == config.base_fingerprint:
        return
    which = (
        f"These heads are for '{config.base_model}' (fingerprint {config.base_fingerprint[:12]}), "
        f"but the model '{model_name(model)}' has other weights (fingerprint {found[:12]})"
    )
    distance = weight_distance(config, model)
    if distance is None:
        warnings.warn(
            f"{which}. The heads store no weight probe, so how far cannot be said; they load "
            "anyway: outputs stay exact (the model verifies every draft), drafts may be "
            "accepted less often. Re-save the heads to record a probe.",
            HeadsMismatchWarning,
            stacklevel=3,
        )
        return
    if distance > MAX_WEIGHT_DISTANCE:
        what = "another parameter layout" if distance == float("inf") else (
            f"relative weight distance {distance:.3g} > {MAX_WEIGHT_DISTANCE}")
        raise ValueError(f"{which}: {what}. {advice}")
    if _same_up_to_dtype(config, model):
        return
    warnings.warn(
        f"{which}: relative weight distance {distance:.2e} on the fingerprint's weight sample. "
        "The heads load: outputs stay exact (the model verifies every draft); drafts may be "
        "accepted less often the further the weights are.",
        HeadsMismatchWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- protocol


@runtime_checkable
class DraftCalibration(Protocol):
    """Per head (exit heads) or per chain step (top-layer heads): draft thresholds and the
    calibrated P(accept) of a confidence."""

    @property
    def thresholds(self) -> list[float]: ...

    def accept_prob(self, index: int, confidence): ...


class TopHeadsProtocol(Protocol):
    """What decoding uses of top-layer draft heads (`kind == "top_draft"`)."""

    kind: Literal["top_draft"]
    vocab_ids: torch.Tensor  # [V] full-vocabulary ids of the reduced vocabulary
    steps: nn.ModuleList  # one per chain step; len == config.depth
    calibration: DraftCalibration | None

    def step_logits(self, i: int, h: torch.Tensor, tokens: torch.Tensor): ...

    def draft(self, final_hidden, token: int, max_tokens: int, thresholds): ...

    def draft_tree(self, final_hidden, token: int, depth: int, thresholds, children: int,
                   beam: int, min_prob: float, stop_tokens=frozenset()): ...

    def draft_trees(self, final_hidden, tokens: list[int], depths: list[int], thresholds, children: int,
                    beam: int, min_prob: float, stop_tokens: list): ...


class ExitHeadsProtocol(Protocol):
    """What decoding uses of exit heads (`kind == "exit_head"`): `heads[i]` reads the
    residual after `heads[i].layer` layers and has `.propose(hidden)`, `.vocab_size`,
    `.vocab_ids`."""

    kind: Literal["exit_head"]
    heads: nn.ModuleList
    calibration: DraftCalibration | None
