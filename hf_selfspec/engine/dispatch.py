"""Models dispatched by accelerate (`from_pretrained(..., device_map=..., offload_folder=...)`).

accelerate places each module on an execution device and, for an offloaded module (its
weights on the CPU or on disk while it executes elsewhere, or on disk while it executes on
the CPU), leaves its parameters on the `meta` device and hooks its forward: the hook's
`pre_forward` brings the weights to the execution device (from accelerate's weights map:
CPU tensors, or the offload folder's files), `post_forward` drops them again.

The engine never calls a module's forward, so it brings an offloaded part's weights the
same way, through the part's own hooks, for exactly as long as one step reads them
(`onloaded`): one part at a time, never a second copy of the model. What a part is made of
(its execution device, whether it streams) is read once from the hooks (`ModelPlacement`).
What the engine cannot run on a dispatched model is refused by `check_dispatch`, by name.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .errors import UnsupportedModelError

META = torch.device("meta")


def _hooks(hook) -> list:
    """The hooks inside one module's `_hf_hook` (a SequentialHook holds several)."""
    if hook is None:
        return []
    inner = getattr(hook, "hooks", None)
    return [h for sub in inner for h in _hooks(sub)] if inner is not None else [hook]


def _align_hooks(module: torch.nn.Module) -> list:
    """accelerate's device hooks (AlignDevicesHook: they carry `execution_device`) of one module."""
    return [h for h in _hooks(getattr(module, "_hf_hook", None)) if hasattr(h, "execution_device")]


def is_dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate's hooks place `model`'s modules (a `device_map` load, dispatch_model,
    cpu_offload, disk_offload)."""
    return any(_align_hooks(m) for m in model.modules())


def _device(value) -> torch.device:
    return torch.device(value if not isinstance(value, int) else f"cuda:{value}")


@dataclass(frozen=True)
class PartPlacement:
    """Where one part of the model (the embedding, a decoder layer, the final norm, the LM
    head) executes, and the modules whose weights accelerate streams in for it (empty: its
    weights stay resident on `device`). `mapped`: on a CPU execution device, each streamed
    parameter as a parameter over the bytes accelerate's offload index names (the
    checkpoint's safetensors file or the offload folder's file, mapped, or the CPU tensor
    accelerate keeps), beside the module's own meta parameter; None where any has no
    such view (a dtype converted at load: then accelerate's hooks copy it in)."""

    device: torch.device
    streamed: tuple[tuple[torch.nn.Module, object], ...] = ()
    mapped: tuple[tuple[torch.nn.Module, str, torch.nn.Parameter], ...] | None = None

    @property
    def offloaded(self) -> bool:
        return bool(self.streamed)

    def onloaded(self) -> contextlib.AbstractContextManager:
        """The part's weights on its execution device inside the block, offloaded again
        after: the mapped views swapped in (no copy), else accelerate's own pre_forward /
        post_forward (new tensors on each entry)."""
        if self.mapped is not None:
            return _swapped(self.mapped)
        return _onloaded(self.streamed)


@contextlib.contextmanager
def _swapped(mapped) -> Iterator[None]:
    held = [(module, name, module._parameters[name]) for module, name, _ in mapped]
    try:
        for module, name, view in mapped:
            module._parameters[name] = view
        yield
    finally:
        for module, name, param in held:
            module._parameters[name] = param


class OffloadFiles:
    """Read-only views of the tensors accelerate's offload index points to, without
    copying: a checkpoint's safetensors file, or an offload folder's `.dat` file, mapped
    copy-on-write (a page is read from the file, or the page cache, when a product reads
    it; nothing is written back). Each view is checked against the parameter it stands
    for (dtype, shape, bytes inside the file) before use: these files are input."""

    def __init__(self):
        self._files: dict[str, tuple[mmap.mmap, dict, int]] = {}

    def view(self, weights_map, name: str, like: torch.Tensor) -> torch.Tensor | None:
        dataset, prefix = getattr(weights_map, "dataset", None), getattr(weights_map, "prefix", "")
        key = prefix + name
        state, index = getattr(dataset, "state_dict", None), getattr(dataset, "index", None)
        if isinstance(state, dict) and key in state:  # accelerate's CPU copy: already in memory
            t = state[key]
            return t if _fits(t, like) and t.device.type == "cpu" else None
        info = index.get(key) if isinstance(index, dict) else None
        if not isinstance(info, dict) or info.get("dtype") != str(like.dtype).removeprefix("torch."):
            return None
        try:
            if info.get("safetensors_file") is not None:
                return self._safetensors_view(str(info["safetensors_file"]), str(info.get("weight_name", key)), like)
            folder = getattr(dataset, "save_folder", None)
            if folder is not None:
                return self._dat_view(os.path.join(folder, f"{key}.dat"), info, like)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, RecursionError):
            return None  # not readable as expected: accelerate's own loader reads it
        return None

    def _safetensors_view(self, path: str, tensor: str, like: torch.Tensor) -> torch.Tensor | None:
        if path not in self._files:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header_len = int.from_bytes(f.read(8), "little")
                if header_len <= 0 or 8 + header_len > size or header_len > _MAX_HEADER:
                    raise ValueError(f"{path}: not a safetensors file")
                header = json.loads(f.read(header_len))
                if not isinstance(header, dict):
                    raise TypeError(f"{path}: not a safetensors header")
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._files[path] = (mapped, header, 8 + header_len)
        mapped, header, start = self._files[path]
        entry = header.get(tensor)
        if (not isinstance(entry, dict) or _SAFETENSORS_DTYPES.get(entry.get("dtype")) != like.dtype
                or list(entry.get("shape", ())) != list(like.shape)):
            return None
        lo, hi = (int(x) for x in entry["data_offsets"])
        return _view(mapped, start + lo, start + hi, like)

    def _dat_view(self, path: str, info: dict, like: torch.Tensor) -> torch.Tensor | None:
        if list(info.get("shape", ())) != list(like.shape) or like.dim() == 0:
            return None
        if path not in self._files:
            with open(path, "rb") as f:
                self._files[path] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), {}, 0)
        mapped = self._files[path][0]
        return _view(mapped, 0, like.numel() * like.element_size(), like)


# safetensors' dtype names the engine maps (others: accelerate's loader)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on its JSON header


def _fits(t: torch.Tensor, like: torch.Tensor) -> bool:
    return t.dtype == like.dtype and tuple(t.shape) == tuple(like.shape)


def _view(mapped: mmap.mmap, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor | None:
    nbytes = like.numel() * like.element_size()
    if lo < 0 or hi - lo != nbytes or hi > len(mapped) or lo % like.element_size():
        return None
    return torch.frombuffer(mapped, dtype=like.dtype, count=like.numel(), offset=lo).view(like.shape)


def _mapped_views(streamed, device: torch.device, files: OffloadFiles):
    """Every streamed parameter's view (PartPlacement.mapped), or None."""
    if device.type != "cpu":
        return None  # (a copy to the execution device is needed anyway: accelerate's hooks)
    out = []
    for module, hook in streamed:
        if getattr(hook, "offload_buffers", False) and any(True for _ in module.buffers(recurse=False)):
            return None
        for name, param in module.named_parameters(recurse=False):
            view = files.view(getattr(hook, "weights_map", None), name, param)
            if view is None:
                return None
            out.append((module, name, torch.nn.Parameter(view, requires_grad=False)))
    return tuple(out)


@contextlib.contextmanager
def _onloaded(streamed) -> Iterator[None]:
    done = []
    try:
        for module, hook in streamed:
            hook.pre_forward(module)
            done.append((module, hook))
        yield
    finally:
        for module, hook in reversed(done):
            hook.post_forward(module, None)


def onloaded(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    """`module`'s weights readable inside the block, where accelerate offloads them (one
    part at a time: the caller reads it, then lets it go; PartPlacement.onloaded); nothing
    to do for resident weights."""
    streamed = [(m, h) for m in module.modules() for h in _align_hooks(m) if getattr(h, "offload", False)]
    if not streamed:
        return contextlib.nullcontext()
    return _part(module, type(module).__name__, None, OffloadFiles()).onloaded()


def _part(module: torch.nn.Module, name: str, fallback: torch.device | None,
          files: OffloadFiles | None = None) -> PartPlacement:
    """The placement of `module` and everything under it; refuses a part split across devices."""
    devices: set[torch.device] = set()
    streamed = []
    for sub in module.modules():
        for hook in _align_hooks(sub):
            if hook.execution_device is not None:
                devices.add(_device(hook.execution_device))
            if getattr(hook, "offload", False):
                if getattr(hook, "place_submodules", False) and any(True for _ in sub.children()):
                    raise UnsupportedModelError(
                        f"{name} is offloaded as part of a bigger block (accelerate hook on "
                        f"{type(sub).__name__} with place_submodules): the engine brings weights in one "
                        "decoder layer at a time; load with a device_map that names each layer "
                        "(device_map='auto' does), or use plain generate()")
                streamed.append((sub, hook))
        if not _align_hooks(sub):  # (a hooked module's inputs and weights go to its execution device)
            devices.update(p.device for p in sub.parameters(recurse=False) if p.device != META)
    held = [p for p in module.parameters() if p.device == META]
    covered = {id(p) for sub, _ in streamed for p in sub.parameters(recurse=False)}
    if any(id(p) not in covered for p in held):
        raise UnsupportedModelError(
            f"{name} has weights on the meta device that no accelerate hook brings in (a model made "
            "with init_empty_weights and never loaded?): load its weights, or use plain generate()")
    devices.discard(META)
    if len(devices) > 1:
        raise UnsupportedModelError(
            f"{name} is split across devices ({', '.join(sorted(map(str, devices)))}): the engine runs "
            "each decoder layer on one device. Load with a device_map whose entries are whole layers "
            "(device_map='auto' with no_split_module_classes does), or use plain generate()")
    device = next(iter(devices)) if devices else fallback
    if device is None:
        raise UnsupportedModelError(f"{name}: accelerate's hooks name no execution device for it; "
                                    "use plain generate()")
    mapped = None if not streamed or files is None else _mapped_views(streamed, device, files)
    return PartPlacement(device, tuple(streamed), mapped)


@dataclass(frozen=True)
class ModelPlacement:
    """Each part's placement, as accelerate dispatched the model."""

    embedding: PartPlacement
    layers: tuple[PartPlacement, ...]
    final_norm: PartPlacement
    lm_head: PartPlacement

    @property
    def parts(self) -> tuple[PartPlacement, ...]:
        return (self.embedding, *self.layers, self.final_norm, self.lm_head)

    @property
    def devices(self) -> list[torch.device]:
        return sorted({p.device for p in self.parts}, key=str)

    @property
    def main_device(self) -> torch.device:
        """Where the first decoder layer executes: where a step's metadata is made."""
        return self.layers[0].device

    @property
    def layer_devices(self) -> list[torch.device]:
        return [p.device for p in self.layers]

    @property
    def offloaded_layers(self) -> int:
        return sum(p.offloaded for p in self.layers)

    @property
    def any_offloaded(self) -> bool:
        return any(p.offloaded for p in self.parts)

    def key(self) -> str:
        """What the engine's measurements depend on (engine/cache.py): the devices and which
        parts stream their weights."""
        marks = "".join("s" if p.offloaded else "r" for p in self.parts)
        devices = self.devices
        if len(devices) > 1:  # which part executes where
            marks += ":" + "".join(str(devices.index(p.device)) for p in self.parts)
        return f"{'+'.join(map(str, devices))}:{marks}"

    def describe(self) -> str:
        parts = [f"{self.offloaded_layers} of {len(self.layers)} decoder layers offloaded"]
        for name, p in (("embedding", self.embedding), ("final norm", self.final_norm), ("LM head", self.lm_head)):
            if p.offloaded:
                parts.append(f"{name} offloaded")
        return f"{', '.join(parts)}; executing on {', '.join(map(str, self.devices))}"


def model_placement(model: torch.nn.Module, parts: tuple, map_files: bool = False) -> ModelPlacement | None:
    """The placement of a dispatched model's parts (embedding, decoder layers, final norm,
    LM head: the modules in `parts`); None for a model accelerate did not dispatch (all its
    weights resident where they are). map_files: find each streamed weight's zero-copy view
    (PartPlacement.mapped; what an engine reads), not only where it executes."""
    if not is_dispatched(model):
        return None
    check_dispatch(model)
    embedding, layers, final_norm, lm_head = parts
    files = OffloadFiles() if map_files else None
    device = _part(layers[0], "decoder layer 0", None).device
    return ModelPlacement(
        embedding=_part(embedding, "the embedding", device, files),
        layers=tuple(_part(layer, f"decoder layer {i}", device, files) for i, layer in enumerate(layers)),
        final_norm=_part(final_norm, "the final norm", device, files),
        lm_head=_part(lm_head, "the LM head", device, files))


def check_dispatch(model: torch.nn.Module) -> None:
    """Refuse, by name and with what to do, a dispatched model the engine cannot run: a
    tensor-parallel plan, quantized weights that accelerate streams in."""
    tp = getattr(model, "_tp_size", None) or getattr(model, "tp_size", None)
    if (isinstance(tp, int) and tp > 1) or getattr(model, "_device_mesh", None) is not None:
        raise UnsupportedModelError(
            f"this model is split by a tensor-parallel plan (tp_size={tp}): the engine runs whole "
            "matrices on one device per layer. Load it with device_map='auto' (layers spread over "
            "devices, offloaded where they do not fit) instead of tp_plan, or use plain generate()")
    for module in model.modules():
        for hook in _align_hooks(module):
            weights = getattr(hook, "weights_map", None) if getattr(hook, "offload", False) else None
            if weights is None:
                continue
            for name, _ in module.named_parameters(recurse=False):
                dtype = _stored_dtype(weights, name)
                if dtype is not None and not dtype.is_floating_point:
                    raise UnsupportedModelError(
                        f"{type(module).__name__} streams quantized {dtype} weights from accelerate's "
                        "offload: the engine runs float weights only. Load the model unquantized (a "
                        "float dtype) or use plain generate()")


def _stored_dtype(weights, name: str) -> torch.dtype | None:
    """The dtype accelerate's weights map holds for `name`, without loading it where the map
    says (its disk index); None where it cannot tell."""
    dataset = getattr(weights, "dataset", None)
    prefix = getattr(weights, "prefix", "")
    index = getattr(dataset, "index", None)
    state = getattr(dataset, "state_dict", None)
    key = prefix + name
    if isinstance(state, dict) and key in state:
        return state[key].dtype
    if isinstance(index, dict) and key in index:
        dtype = str(index[key].get("dtype", ""))
        return getattr(torch, dtype, None) if dtype else None
    if isinstance(weights, dict) and name in weights:
        return weights[name].dtype
    return None
