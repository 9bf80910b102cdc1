"""Where the model's weights live: file-mapped checkpoint pages moved into process memory.

transformers loads a safetensors checkpoint by mapping the file privately: every weight is
a view of page-cache pages. The engine's steps stream all the weights once per step, and
they stream such pages measurably slower than the process's own (anonymous) memory
(figures in docs/changelog.md). `move_file_mapped_weights` copies each
file-mapped parameter and buffer once into fresh memory and points the same Parameter at
it: values, names, Parameter objects and tying are unchanged, and once nothing refers to the
mapping any more the file's pages leave the process (no second copy stays resident).

Linux only (it reads /proc/self/maps); elsewhere, or for CUDA tensors, nothing moves.
"""

from __future__ import annotations

import bisect
import logging
import mmap
from pathlib import Path

import torch

logger = logging.getLogger("hf_selfspec")

MAPS = Path("/proc/self/maps")
# Models whose file-mapped weights exceed this stay mapped: the copy's fresh memory can be
# slow to touch on a VM (seconds per GiB right after other large allocations), and a first
# call must not wait for it.
MAX_MOVE_BYTES = 2 << 30


def file_mapped_ranges(maps: Path = MAPS) -> list[tuple[int, int]]:
    """Sorted [start, end) address ranges of this process's private file mappings (a
    checkpoint mapped by safetensors, but also shared libraries); [] where the maps cannot
    be read. Shared mappings (shared memory between processes) are left out: moving a
    tensor out of one would end the sharing."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    ranges = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[4] == "0" or not fields[1].endswith("p"):
            continue  # anonymous, or shared
        start, end = fields[0].split("-")
        ranges.append((int(start, 16), int(end, 16)))
    ranges.sort()
    return ranges


def _inside(ranges: list[tuple[int, int]], starts: list[int], lo: int, hi: int) -> bool:
    i = bisect.bisect_right(starts, lo) - 1
    return i >= 0 and ranges[i][0] <= lo and hi <= ranges[i][1]


def _tensor_slots(model: torch.nn.Module):
    """(module, kind, name, tensor) for every parameter and buffer, each module's own."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                yield module, "param", name, p
        for name, b in module._buffers.items():
            if b is not None:
                yield module, "buffer", name, b


@torch.no_grad()
def move_file_mapped_weights(model: torch.nn.Module, max_bytes: int = MAX_MOVE_BYTES,
                             ranges: list[tuple[int, int]] | None = None) -> int:
    """Copy every contiguous CPU parameter or buffer of `model` that lies in a private file
    mapping into fresh process memory, in place (`param.data` / the module's buffer
    replaced; tied weights stay tied). Views (a tensor that is not its whole storage) are
    left as they are, and so is everything when the file-mapped bytes exceed `max_bytes`.
    Returns the bytes moved."""
    ranges = file_mapped_ranges() if ranges is None else ranges
    if not ranges:
        return 0
    starts = [lo for lo, _ in ranges]
    movable: dict[int, list] = {}  # data_ptr -> the slots holding that tensor
    for slot in _tensor_slots(model):
        t = slot[3]
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes == 0 or not _inside(ranges, starts, t.data_ptr(), t.data_ptr() + nbytes):
            continue
        # only a tensor that is its whole storage: a view shares bytes with others
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != nbytes or not t.is_contiguous():
            continue
        movable.setdefault(t.data_ptr(), []).append(slot)
    movable = {lo: slots for lo, slots in movable.items()
               if len({(tuple(s[3].shape), s[3].dtype) for s in slots}) == 1}
    size = {lo: slots[0][3].numel() * slots[0][3].element_size() for lo, slots in movable.items()}
    total = sum(size.values())
    if total == 0 or total > max_bytes:
        if total:
            logger.info("hf_selfspec: %.2f GB of weights are mapped from files; over %.2f GB they stay mapped",
                        total / 1e9, max_bytes / 1e9)
        return 0
    arena = _anonymous_arena(sum(_aligned(n) for n in size.values()))
    offset = 0
    for lo in sorted(movable):  # the checkpoint's own order
        slots = movable[lo]
        old = slots[0][3]
        nbytes = size[lo]
        # a storage of its own per tensor (no two parameters share one: save_pretrained
        # would see shared tensors), all views of one private anonymous mapping
        new = torch.frombuffer(arena, dtype=torch.uint8, count=nbytes, offset=offset).view(old.dtype).view(old.shape)
        new.copy_(old)
        offset += _aligned(nbytes)
        for module, kind, name, t in slots:
            if kind == "param":
                t.data = new  # the same Parameter object (tied weights: the same one)
            else:
                module._buffers[name] = new
    return total


PAGE = 4096


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _anonymous_arena(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` (one region: measured faster to stream than
    one allocation per tensor); it is unmapped when the last tensor viewing it is freed."""
    return mmap.mmap(-1, max(nbytes, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
