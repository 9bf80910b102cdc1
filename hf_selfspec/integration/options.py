"""generate()'s options as assistant='self' reads them: HF's defaults (what is no request),
HF's drafting options mapped onto this call's DecodeConfig (SelfSpecCall carries them, with
the streamer, draft model and stop strings, past HF's GenerationConfig merge), and counts
and token ids read from whatever types HF itself takes there."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..decoding.cycle import DecodeConfig


@functools.lru_cache(maxsize=1)
def _hf_defaults() -> dict:
    """HF's default GenerationConfig values. transformers 5 leaves unset fields None in a
    GenerationConfig() and fills them from `_get_default_generation_params()` when generate()
    merges the config (num_assistant_tokens 20, assistant_confidence_threshold 0.4, ...), so
    the merged config the loop sees holds those: they are defaults, not a request."""
    from transformers import GenerationConfig

    config = GenerationConfig()
    defaults = dict(vars(config))
    params = getattr(config, "_get_default_generation_params", None)
    if callable(params):
        defaults.update({k: v for k, v in params().items() if defaults.get(k) is None})
    return defaults


def _hf_default(name: str):
    """HF's default value of a GenerationConfig field (what generate() fills in when unset)."""
    return _hf_defaults().get(name)


# HF's names for the drafting knobs, honoured per call (as generate() keywords, or in the
# GenerationConfig when they differ from HF's defaults), mapped onto DecodeConfig:
#   num_assistant_tokens           drafts per cycle (max_draft; at most the engine width - 1)
#   assistant_confidence_threshold a draft model's confidence stop (draft_confidence), or the
#                                  heads' confidence threshold (thresholds, every head)
#   prompt_lookup_num_tokens       prompt lookup on (mode "first" with heads, "only" without)
#                                  with at most this many drafts per cycle
#   max_matching_ngram_size        the longest n-gram prompt lookup matches (lookup_max_ngram)
#   num_assistant_tokens_schedule  "constant" only (the draft budget adapts by itself)
HF_DRAFT_OPTIONS = ("num_assistant_tokens", "assistant_confidence_threshold", "prompt_lookup_num_tokens",
                    "max_matching_ngram_size", "num_assistant_tokens_schedule")


@dataclass
class SelfSpecCall:
    """What one generate(assistant="self") call hands its decoding loop besides the request
    HF prepares: the streamer and draft model (kept from HF, which would run its own
    streaming and assisted decoding with them), the HF drafting options, and stop strings
    with their tokenizer (HF hands a custom loop no tokenizer, so the loop builds their
    StopStringCriteria itself)."""

    streamer: Any = None
    draft_model: Any = None
    options: dict = field(default_factory=dict)  # HF drafting options: keywords first
    tokenizer: Any = None
    stop_strings: Any = None

    def take_from(self, config) -> None:
        """Move the stop strings and HF drafting options out of HF's merged GenerationConfig
        (the call's keywords and config, then model.generation_config, then HF's defaults),
        so that HF neither asks for a tokenizer nor switches to its own prompt lookup; values
        equal to HF's defaults are no request."""
        self.stop_strings, config.stop_strings = config.stop_strings, None
        for name in HF_DRAFT_OPTIONS:
            value, default = getattr(config, name, None), _hf_default(name)
            if name not in self.options and value is not None and value != default:
                self.options[name] = value
            setattr(config, name, default)


def _per_call_config(config: DecodeConfig, options: dict, width: int, draft_model: bool) -> DecodeConfig:
    """`config` with this call's HF-named drafting options applied (validated here)."""
    def integer(name, low):
        value = options[name]
        try:
            count = None if isinstance(value, bool) else _whole_number(value, name)
        except ValueError:
            count = None
        if count is None or count < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        return count

    changes = {}
    schedule = options.get("num_assistant_tokens_schedule")
    if schedule is not None and schedule != "constant":
        raise ValueError(f"num_assistant_tokens_schedule={schedule!r} does not apply to assistant='self' "
                         "(its draft budget adapts to live acceptance and measured step costs): drop it "
                         "or use 'constant'")
    if "num_assistant_tokens" in options:
        changes["max_draft"] = min(integer("num_assistant_tokens", 0), width - 1)
    if "prompt_lookup_num_tokens" in options:
        n = integer("prompt_lookup_num_tokens", 1)
        if config.lookup == "off":
            changes["lookup"] = "first" if not draft_model else "fallback"
        changes.setdefault("max_draft", min(n, width - 1))
    if "max_matching_ngram_size" in options:
        n = integer("max_matching_ngram_size", 1)
        changes["lookup_max_ngram"] = n
        changes["lookup_min_ngram"] = min(config.lookup_min_ngram, n)
    if "assistant_confidence_threshold" in options:
        value = options["assistant_confidence_threshold"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"assistant_confidence_threshold must be a number in [0, 1], got {value!r}")
        changes["draft_confidence" if draft_model else "thresholds"] = float(value)
    return dataclasses.replace(config, **changes) if changes else config


def _eos_ids(generation_config) -> list[int]:
    """The EOS ids as ints, from whatever HF takes there (it makes a tensor of them): an int,
    a list or tuple, a tensor, a numpy integer or array, whole floats."""
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    ids = torch.as_tensor(eos).reshape(-1).tolist()
    for e in ids:
        if isinstance(e, bool) or not float(e).is_integer():
            raise ValueError(f"eos_token_id must be token ids (ints), got {eos!r}")
    return [int(e) for e in ids]


def _token_count(gc, name: str) -> int | None:
    """The GenerationConfig's `name` (max_new_tokens, max_length, ...) as an int: HF's own
    loop also takes a numpy integer, a one-element integer tensor or a whole float there."""
    value = getattr(gc, name, None)
    return None if value is None else _whole_number(value, name)


def _whole_number(value, name: str) -> int:
    """`value` as an int where it is a whole number (a numpy integer, a one-element tensor,
    a whole float: what HF's own code takes for a count), else a ValueError naming `name`."""
    if isinstance(value, int):
        return value
    try:
        return operator.index(value)  # numpy integers, one-element integer tensors
    except TypeError:
        pass
    whole = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    if whole and float(value).is_integer():
        return int(float(value))
    raise ValueError(f"{name} must be a whole number of tokens, got {value!r}")
