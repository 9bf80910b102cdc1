"""The kind table: every kind of heads, by the "kind" string of its config.json.

    kind         config class      heads class      calibration        drafter (decoding)  card
    "exit_head"  ExitHeadsConfig   ExitHeads        Calibration        ExitHeadsDrafter    EXIT_CARD
    "top_draft"  TopHeadsConfig    TopDraftHeads    ChainCalibration   TopHeadsDrafter     TOP_CARD

The repo loader (repo.py) reads and writes every kind through its entry; the decoder gets
its drafter from `make_drafter`, the one factory, and the model card its form from
`render_card`, through the same entry. A new kind is one entry here (its config extends
base.HeadsIdentity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .base import HeadsIdentity
from .calibrate import Calibration, ChainCalibration
from .card import EXIT_CARD, TOP_CARD, CardForm, render
from .exit import HEAD_KIND, ExitHeads, ExitHeadsConfig
from .top import STORAGE_DTYPES, TOP_KIND, TopDraftHeads, TopHeadsConfig


@dataclass(frozen=True)
class HeadKind:
    """How one kind of heads is read, written and drafted with."""

    name: str
    config: type[HeadsIdentity]  # from_dict, validate, to_dict
    module: type  # the heads, built from a config alone: Module(config)
    weights_dtype: Callable[[Any], torch.dtype]  # config -> dtype of the stored floats
    # thresholds the heads draft with: one per head (exit heads) or chain step (top)
    sources: Callable[[Any], int]  # config -> count
    calibration: type  # from_dict(calibration.json data, sources) -> calibration
    # (heads, thresholds or None) -> the calibration to save
    calibration_of: Callable[[Any, list[float] | None], Any]
    # (engine, heads, thresholds, DecodeConfig) -> the decoder's drafter for these heads
    drafter: Callable[[Any, Any, list[float], Any], Any]
    card: CardForm  # README.md of a saved repo: template, tags, figures

    def read_calibration(self, data, config):
        """calibration.json's data, checked against the config (ValueError naming the field)."""
        return self.calibration.from_dict(data, self.sources(config))


def _exit_calibration(heads, thresholds):
    """Exit heads save their Calibration; without one the identity map, threshold 0.6
    (labelled uncalibrated in calibration.json)."""
    if thresholds is not None:
        raise ValueError("thresholds= is for top-layer heads; exit heads save their Calibration")
    return heads.calibration or Calibration.uncalibrated(len(heads))


def _chain_calibration(heads, thresholds):
    """Top-layer heads save per-step thresholds: the ones given, else the heads' own, else
    0 (always draft)."""
    if thresholds is None:
        thresholds = (heads.calibration.thresholds if heads.calibration is not None
                      else [0.0] * heads.config.depth)
    return ChainCalibration(thresholds)


def _exit_drafter(engine, heads, thresholds, config):
    """Exit heads climb the layers of the newest row (decoding/drafters.py)."""
    from ..decoding.drafters import ExitHeadsDrafter

    return ExitHeadsDrafter(engine, heads, thresholds, config.gamma)


def _top_drafter(engine, heads, thresholds, config):
    """Top-layer heads draft chains, or trees of the decode config's shape."""
    from ..decoding.drafters import TopHeadsDrafter
    from ..decoding.policy import tree_shape

    children, beam, min_prob = tree_shape(config, engine.width)
    return TopHeadsDrafter(heads, thresholds, children, beam, min_prob)


KINDS: dict[str, HeadKind] = {
    HEAD_KIND: HeadKind(
        HEAD_KIND, ExitHeadsConfig, ExitHeads,
        weights_dtype=lambda config: torch.float32,
        sources=lambda config: len(config.layers),
        calibration=Calibration,
        calibration_of=_exit_calibration,
        drafter=_exit_drafter,
        card=EXIT_CARD),
    TOP_KIND: HeadKind(
        TOP_KIND, TopHeadsConfig, TopDraftHeads,
        weights_dtype=lambda config: STORAGE_DTYPES[config.storage_dtype],
        sources=lambda config: config.depth,
        calibration=ChainCalibration,
        calibration_of=_chain_calibration,
        drafter=_top_drafter,
        card=TOP_CARD),
}


def kind_named(name) -> HeadKind:
    """The entry of kind `name`; ValueError naming the kinds there are."""
    if not isinstance(name, str) or name not in KINDS:
        raise ValueError(f"field 'kind' must be one of {sorted(KINDS)}, got {name!r}")
    return KINDS[name]


def is_heads(value) -> bool:
    """Whether `value` is loaded heads of some kind (an instance of a kind's heads class)."""
    return isinstance(value, tuple(kind.module for kind in KINDS.values()))


def kind_of(heads) -> HeadKind:
    """The entry of loaded heads, by their `kind` string; ValueError naming the kinds there
    are for an object of no known kind."""
    name = getattr(heads, "kind", None)
    if not isinstance(name, str) or name not in KINDS:
        raise ValueError(f"{type(heads).__name__} with kind {name!r} are not heads of a known kind "
                         f"(one of {sorted(KINDS)})")
    return KINDS[name]


def make_drafter(engine, heads, thresholds: list[float], config):
    """The one drafter factory: the drafter of `heads`, whatever their kind, over `engine`
    with per-source `thresholds` and the DecodeConfig `config`."""
    return kind_of(heads).drafter(engine, heads, thresholds, config)


def render_card(heads) -> str:
    """README.md text (the model card) of `heads`, whatever their kind."""
    return render(heads, kind_of(heads).card)
