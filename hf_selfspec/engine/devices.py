"""A model whose decoder layers execute on several devices (accelerate's `device_map` over
GPUs): the layers as runs of consecutive layers on one device (`LayerGroup`), and the KV
cache as one tensor per run on that run's device (`GroupedCache`).

A model on one device has one group, and its cache stays the single [L, Hkv, S, d] tensor
the kernels take whole; only a model that changes device between layers gets a
`GroupedCache`, which reads like that tensor where the engine reads it per layer
(`cache[layer]`) and copies slots group by group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerGroup:
    """Decoder layers [lo, hi), all executing on `device`."""

    lo: int
    hi: int
    device: torch.device


def layer_groups(devices: Sequence[torch.device]) -> tuple[LayerGroup, ...]:
    """Maximal runs of consecutive layers on one device, from each layer's device."""
    groups: list[LayerGroup] = []
    for i, device in enumerate(devices):
        if groups and groups[-1].device == device:
            groups[-1] = LayerGroup(groups[-1].lo, i + 1, device)
        else:
            groups.append(LayerGroup(i, i + 1, device))
    return tuple(groups)


class GroupedCache:
    """One cache ([L, Hkv, S, d] as the engine reads it) kept as one tensor per layer group,
    each on its group's device. `cache[layer]` is that layer's [Hkv, S, d] on its device."""

    def __init__(self, groups: Sequence[LayerGroup], tensors: Sequence[torch.Tensor]):
        self.groups = tuple(groups)
        self.tensors = tuple(tensors)
        self._where = [(g, t) for g, t in zip(self.groups, self.tensors) for _ in range(g.lo, g.hi)]
        first = self.tensors[0]
        self.shape = (len(self._where), *first.shape[1:])
        self.dtype = first.dtype

    def __getitem__(self, layer: int) -> torch.Tensor:
        if not isinstance(layer, int):
            raise TypeError(f"a grouped KV cache is read one layer at a time (cache[layer]), got {layer!r}")
        group, tensor = self._where[layer]
        return tensor[layer - group.lo]

    def group_tensor(self, group: LayerGroup) -> torch.Tensor:
        """The [hi - lo, Hkv, S, d] tensor of `group`'s layers."""
        return self.tensors[self.groups.index(group)]

    def copy_slot(self, source: int, target: int) -> None:
        """Every layer's entry at slot `source` copied to slot `target`."""
        for tensor in self.tensors:
            tensor[:, :, target] = tensor[:, :, source]

    def keep(self, old: GroupedCache, slots: int) -> None:
        """The first `slots` slots of `old` (a cache of the same groups) copied in."""
        for new, was in zip(self.tensors, old.tensors):
            new[:, :, :slots] = was[:, :, :slots]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
