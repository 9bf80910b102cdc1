"""The checks every family shares: a projection is a plain float linear layer (refused by
name otherwise), a convolution a plain depthwise causal one, a GGUF marker a dequantised model."""

from __future__ import annotations

import torch

from .errors import UnsupportedModelError
from .modules import _conv1d_class
from .weights import FLOAT_DTYPES

# HF's ACT2FN names of the gated MLP's activation: SiLU, or GELU's tanh approximation (Gemma)
SILU_NAMES = ("silu", "swish")
GELU_TANH_NAMES = ("gelu_pytorch_tanh",)


def _dequantized_gguf(quantization) -> bool:
    """A quantization_config (dict or object) of method GGUF: transformers' `gguf_file=` loader
    dequantises every block to float weights and only leaves this marker (and its quantizer)
    on the model, so nothing quantized remains; each projection's float dtype is still checked
    (_check_plain_linear), and compact reads pick up the blocks (engine/compact.py)."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) \
        else getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "gguf"


def _check_plain_linear(name: str, module, spec=None) -> None:
    """The engine runs a projection as `x @ weight^T (+ bias)` on the module's own float
    weight (GPT-2's transformers Conv1D: x @ weight + bias; Falcon's FalconLinear, an
    nn.Linear computing the same): a subclass (bitsandbytes, GPTQ, AWQ, LoRA wrappers) or an
    integer weight would be computed wrongly, so refuse it by name (`spec`: the model type's
    registry record, whose conv1d / linear_class name another class than nn.Linear)."""
    weight = getattr(module, "weight", None)
    expected = _conv1d_class() if spec is not None and spec.conv1d else torch.nn.Linear
    if spec is not None and spec.linear_class is not None and type(module) is not torch.nn.Linear:
        expected = spec.linear_class()
    if type(module) is not expected or not isinstance(weight, torch.Tensor) \
            or weight.dtype not in FLOAT_DTYPES:
        kind = type(module).__module__ + "." + type(module).__qualname__
        dtype = getattr(weight, "dtype", None)
        raise UnsupportedModelError(
            f"{name} is a {kind} (weight dtype {dtype}); the engine runs plain "
            f"{expected.__module__}.{expected.__qualname__} projections with float weights "
            f"({', '.join(str(d) for d in FLOAT_DTYPES)}) only. "
            "Quantized or wrapped layers are not supported: use plain model.generate().")


def _check_short_conv(name: str, conv, channels: int) -> None:
    """LFM2's convolution: a plain depthwise, causal nn.Conv1d with a float weight [H, 1, K]
    (the engine convolves each channel over a row's last K positions)."""
    weight = getattr(conv, "weight", None)
    if type(conv) is not torch.nn.Conv1d or not isinstance(weight, torch.Tensor) \
            or weight.dtype not in FLOAT_DTYPES or conv.groups != channels or weight.dim() != 3 \
            or weight.shape[:2] != (channels, 1) or conv.stride != (1,) or conv.dilation != (1,):
        kind = type(conv).__module__ + "." + type(conv).__qualname__
        raise UnsupportedModelError(
            f"{name} is a {kind} (weight {getattr(weight, 'dtype', None)}, shape "
            f"{tuple(getattr(weight, 'shape', ()))}); the engine runs LFM2's plain depthwise "
            f"torch.nn.Conv1d over {channels} channels with float weights only: use plain model.generate()")
