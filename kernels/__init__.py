"""Kernels for exact self-speculative decoding.

``row_attention`` (Triton) and ``row_attention_reference`` (PyTorch) compute decode
attention whose per-row result does not depend on how many rows share the call. Importing
this package does not import Triton; the launcher does so on first use.
``cpu_rows.load_rows_linear()`` compiles (once per machine) and returns the CPU row kernel:
x @ W^T with a row's result independent of the other rows (the engine's `kernel` layout).
"""

from .attention import row_attention
from .reference import row_attention_reference

__all__ = ["row_attention", "row_attention_reference"]
