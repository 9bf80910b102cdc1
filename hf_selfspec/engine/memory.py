"""Zeroed tensors that take memory only where written (the KV cache, the hybrids' rings)."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape, dtype, device); on the CPU in an anonymous memory map, whose pages
    the OS maps as zeros on first touch: nothing is written up front, and the slots a
    request never reaches take no resident memory. Writing zeros into a fresh cache faults
    in every page at once, and right after a model of gigabytes was built each fault can be
    slow; numpy.zeros (calloc) asks for huge pages, whose faults then wait for memory
    compaction (figures in docs/changelog.md). The map is page-aligned and
    lives as long as the tensor."""
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    item = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, count * item), dtype=dtype).view(shape)
