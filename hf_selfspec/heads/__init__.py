"""Draft heads of every kind behind one repo format.

    base        model identity (fingerprint, weight probe, final norm, LM head), RMSNorm,
                the one compatibility check, the protocols decoding relies on
    kinds       exit heads (ExitHeads, kind "exit_head")
    top         top-layer draft heads (TopDraftHeads, kind "top_draft")
    calibrate   confidence -> P(accept) maps and thresholds
    checks      field checks of untrusted config / calibration files
    card        the model card of every kind (huggingface_hub ModelCard)
    repo        save / load / push of every kind; config.json's "kind" says which
    train       training exit heads by self-distillation
"""

from .base import (
    DraftCalibration,
    ExitHeadsProtocol,
    HeadsMismatchWarning,
    TopHeadsProtocol,
    check_compatible,
    fingerprint,
    weight_probe,
)
from .calibrate import Calibration, ChainCalibration, HeadCalibration, isotonic_fit
from .card import render_card
from .kinds import ExitHead, ExitHeads, HeadsConfig
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
    "Calibration",
    "ChainCalibration",
    "DraftCalibration",
    "ExitHead",
    "ExitHeads",
    "ExitHeadsProtocol",
    "HeadCalibration",
    "HeadsConfig",
    "HeadsMismatchWarning",
    "TopDraftHeads",
    "TopHeadsConfig",
    "TopHeadsProtocol",
    "check_compatible",
    "default_heads_path",
    "exit_heads_path",
    "fingerprint",
    "isotonic_fit",
    "load_heads",
    "push_heads",
    "read_kind",
    "render_card",
    "resolve_heads_folder",
    "save_heads",
    "weight_probe",
]
