"""Draft heads of every kind behind one repo format.

    base        model identity (fingerprint, weight probe, final norm, LM head), the config
                identity every kind's config extends (HeadsIdentity), the one
                compatibility check, the protocols decoding relies on
    exit        exit heads (ExitHeads, kind "exit_head")
    top         top-layer draft heads (TopDraftHeads, kind "top_draft")
    kinds       the kind table: kind -> config, heads, calibration, drafter (make_drafter)
    calibrate   confidence -> P(accept) maps and thresholds
    checks      field checks of untrusted config / calibration files
    card        the model card of every kind (huggingface_hub ModelCard)
    repo        save / load / push of every kind; config.json's "kind" says which
    train       training exit heads by self-distillation
"""

from .base import (
    DraftCalibration,
    ExitHeadsProtocol,
    HeadsIdentity,
    HeadsMismatchWarning,
    TopHeadsProtocol,
    check_compatible,
    fingerprint,
    weight_probe,
)
from .calibrate import Calibration, ChainCalibration, HeadCalibration, isotonic_fit
from .exit import ExitHead, ExitHeads, ExitHeadsConfig, HeadsConfig
from .kinds import KINDS, HeadKind, is_heads, kind_named, kind_of, make_drafter, render_card
from .repo import (
    default_heads_path,
    exit_heads_path,
    load_heads,
    push_heads,
    read_kind,
    resolve_heads_folder,
    save_heads,
)
from .top import TopDraftHeads, TopHeadsConfig

__all__ = [
    "KINDS",
    "Calibration",
    "ChainCalibration",
    "DraftCalibration",
    "ExitHead",
    "ExitHeads",
    "ExitHeadsConfig",
    "ExitHeadsProtocol",
    "HeadCalibration",
    "HeadKind",
    "HeadsConfig",
    "HeadsIdentity",
    "HeadsMismatchWarning",
    "TopDraftHeads",
    "TopHeadsConfig",
    "TopHeadsProtocol",
    "check_compatible",
    "default_heads_path",
    "exit_heads_path",
    "fingerprint",
    "is_heads",
    "isotonic_fit",
    "kind_named",
    "kind_of",
    "load_heads",
    "make_drafter",
    "push_heads",
    "read_kind",
    "render_card",
    "resolve_heads_folder",
    "save_heads",
    "weight_probe",
]
