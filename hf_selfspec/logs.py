"""The package's logger: a child of transformers' library logger, so that
`transformers.logging.set_verbosity_info()` (or TRANSFORMERS_VERBOSITY=info) shows what the
engine does (its build, the row layout chosen, a kernel that is not used) and the same
handlers and levels apply as for transformers' own messages."""

from __future__ import annotations

from transformers.utils import logging

logger = logging.get_logger("transformers.hf_selfspec")
