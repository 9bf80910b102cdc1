"""Exit heads: the module (kinds), the Hub repo format (repo), training and calibration."""

from .calibrate import Calibration, HeadCalibration, isotonic_fit
from .kinds import ExitHead, ExitHeads, HeadsConfig
from .repo import (
    check_compatible,
    default_heads_path,
    exit_heads_path,
    fingerprint,
    load_heads,
    push_heads,
    render_card,
    save_heads,
)

__all__ = [
    "Calibration",
    "ExitHead",
    "ExitHeads",
    "HeadCalibration",
    "HeadsConfig",
    "check_compatible",
    "default_heads_path",
    "exit_heads_path",
    "fingerprint",
    "isotonic_fit",
    "load_heads",
    "push_heads",
    "render_card",
    "save_heads",
]
