"""Top-layer heads through the one repo module (heads/repo.py), under the names older
callers import (scripts/head_study.py, tests)."""

from __future__ import annotations

from pathlib import Path

from .base import check_compatible as check_top_compatible
from .calibrate import ChainCalibration as TopCalibration
from .card import render_card as render_top_card
from .repo import load_heads, read_kind, save_heads
from .top import TOP_KIND, TopDraftHeads


def save_top_heads(heads: TopDraftHeads, folder, thresholds: list[float] | None = None) -> Path:
    """repo.save_heads for top-layer heads (card included)."""
    return save_heads(heads, folder, thresholds=thresholds)


def load_top_heads(folder, model=None) -> TopDraftHeads:
    """repo.load_heads, refusing a folder of another kind."""
    heads = load_heads(folder, model)
    if heads.kind != TOP_KIND:
        raise ValueError(f"{Path(folder) / 'config.json'}: field 'kind' is {heads.kind!r}, "
                         f"not {TOP_KIND!r}")
    return heads


__all__ = ["TopCalibration", "check_top_compatible", "load_top_heads", "read_kind",
           "render_top_card", "save_top_heads"]
