"""Compact weights: float32 projections read as the exact quantized blocks they hold.

A float32 model dequantized from one of GGUF's block formats (a GGUF file loaded through
transformers' `gguf_file=`; the embedded default model is a Q4_1 file) holds, in every block
of 32 weights of a matrix row, only the values its format gives: m + d q with q in 0..15
(Q4_1), d (q - 8) (Q4_0) or d q with q in -128..127 (Q8_0). The row kernel's `rows_compact`
(kernels/cpu-rows/compact.cpp) finds such a d (and m) for every block, keeps the
matrix only where every weight comes back bit for bit, and its products then read 24 / 20 / 36
bytes per 32 weights instead of 128, with every output the float32 product's bit for bit. A
decode step streams its weights once, so it reads a fifth to a quarter of the bytes.

The compact forms are the engine's own memory beside the model's weights (`copy_bytes`,
0.16-0.28 of the projections they stand for) and are made again when a weight changes:
new storage, dtype or device rebuilds the engine (`weight_signature`); an in-place update
moves the tensor's version counter, which `refresh` compares at every request. (Writes
through `.data` move no counter: a model edited that way must be given to `attach_heads`
again.) Matrices without such a form (any trained float32 or 16-bit model, other GGUF
formats) stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .versions import version_counter

CompactKernel = Callable[[torch.Tensor], torch.Tensor]
# where q, k, v, o, gate, up and down sit among the weights rows_layer takes for one layer
PROJECTIONS = (1, 2, 3, 4, 6, 7, 8)


def projection_positions(count: int, per_layer: int) -> list[int]:
    """The positions of every layer's projections in a flat `rows_layers` weight list of
    `count` weights, `per_layer` per layer, layer by layer."""
    return [layer * per_layer + j for layer in range(count // per_layer) for j in PROJECTIONS]


class CompactWeights:
    """The compact forms of some of a layer list's float32 CPU matrices.

    `weights` is the flat list `rows_layers` takes; `indices` the positions in it of the
    projections that may be read compactly. `kernel_weights` is that list with every
    encodable projection replaced by its compact form (uint8 [O, K / 32 * (24, 20 or 36)])."""

    def __init__(self, weights: Sequence[torch.Tensor], indices: Sequence[int], kernel: CompactKernel):
        self.kernel = kernel
        self.source = list(weights)
        self.indices = [i for i in indices if _may_compact(self.source[i])]
        self.kernel_weights = list(self.source)
        self._versions: dict[int, int] = {}
        for i in self.indices:
            self._encode(i)

    def _encode(self, i: int) -> None:
        w = self.source[i]
        self._versions[i] = version_counter(w)
        packed = self.kernel(w)
        self.kernel_weights[i] = packed if packed.numel() > 0 else w

    def _held(self) -> list[int]:
        """The positions whose matrix is read compactly now."""
        return [i for i in self.indices if self.kernel_weights[i] is not self.source[i]]

    @property
    def count(self) -> int:
        """How many matrices are read compactly."""
        return len(self._held())

    @property
    def copy_bytes(self) -> int:
        """Bytes of the compact forms (memory beyond the model's own)."""
        return sum(self.kernel_weights[i].numel() for i in self._held())

    @property
    def read_bytes_saved(self) -> int:
        """Bytes a step no longer streams: the float32 matrices minus their compact forms."""
        return sum(self.source[i].numel() * 4 - self.kernel_weights[i].numel() for i in self._held())

    def refresh(self) -> int:
        """Encode again every matrix updated in place since it was encoded (its version
        counter moved: an optimizer step, `load_state_dict`, `copy_` under no_grad).
        Returns how many were."""
        changed = [i for i in self.indices if version_counter(self.source[i]) != self._versions[i]]
        for i in changed:
            self._encode(i)
        return len(changed)


def _may_compact(t: torch.Tensor) -> bool:
    # 2-D float32 CPU matrices with whole blocks of 32 columns: what rows_compact takes
    return (t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and t.shape[1] % 32 == 0 and t.numel() > 0)
