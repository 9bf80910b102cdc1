"""`version_counter(t)`: the in-place update counter that the engine's weight copies (the
screen's int8 rows, the compact blocks, the top heads' float16 copies) compare to know
when to make their copy again.

An inference tensor (one created under `torch.inference_mode()`: a model or heads loaded
inside such a block) has no version counter: reading `t._version` raises. Such a tensor can
only be updated in place inside inference mode, which the copies cannot see; it counts as
never updated (version 0), so its copy is made once, as for a frozen weight.
"""

from __future__ import annotations

import torch


def version_counter(t: torch.Tensor) -> int:
    """`t._version`, or 0 for an inference tensor (no counter: see the module docstring)."""
    if t.is_inference():
        return 0
    return t._version
