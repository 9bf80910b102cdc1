"""Hugging Face integration: `attach_heads(model)` and `model.generate(..., assistant="self")`.

`attach_heads` swaps the model's class for a subclass of its own HF class whose
`generate` understands `assistant="self"`; everything else is the HF model untouched.
With `assistant="self"` (a keyword, or an attribute of the GenerationConfig passed or of
`model.generation_config`) the call still goes through HF's own `generate()`
(GenerationConfig merge, max_new_tokens/max_length, stopping criteria, stop strings,
attention mask), which hands the prepared request to our decoding loop as a
`custom_generate` callable; the loop runs the engine and returns HF's output types. Every
option and input is checked before any work: what the engine cannot honour raises a clear
`ValueError` / `NotImplementedError` that says what to drop, never a silently different
result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import numbers
import operator
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .decoding.batch import BatchDecoder, SequenceRequest, batch_obstacle
from .decoding.cycle import DecodeConfig, DecodeResult, SelfSpecDecoder
from .decoding.draft_model import check_draft_model
from .decoding.sampling import (
    MIN_LENGTH_PROCESSORS,
    ROW_PROCESSORS,
    RowScorer,
    row_processors,
    unsupported_processors,
)
from .engine import costs
from .engine.dispatch import is_dispatched
from .engine.errors import UnsupportedModelError
from .engine.layered import (
    TOKEN_TYPE_EMBEDDING_TYPES,
    dispatch_placement,
    attention_window,
    query_scaling_positions,
    served_positions,
    text_config,
    text_decoder,
    windows_served,
)
from .engine.programs import DEFAULT_CAPACITY, Engine, EngineConfig
from .import_hook import after_import
from .logs import logger
from .stats import DecodeStats

ASSISTANT_SELF = "self"
ATTACH_FIRST = ("assistant='self' needs hf_selfspec.attach_heads(model) first (this model has no "
                "self-speculative decoding attached); or drop assistant='self' for plain generate()")


def _is_set(v) -> bool:
    return v is not None and v is not False


def _above_one(v) -> bool:
    return v is not None and v > 1


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


# generate() options the loop does not implement, and what to do instead. Each would
# otherwise be dropped silently by the custom decoding loop HF hands the request to (HF
# itself does not check them for a custom loop), so every one is refused before any work.
_UNSUPPORTED = {
    "num_beams": (_above_one, "beam search is not supported with assistant='self'; drop num_beams"),
    "num_beam_groups": (_above_one, ("group beam search is not supported with assistant='self'; "
                                    "drop num_beam_groups / diversity_penalty")),
    "constraints": (_is_set, "constrained beam search is not supported with assistant='self'; drop constraints"),
    "force_words_ids": (_is_set, ("constrained beam search (force_words_ids) is not supported with "
                                 "assistant='self'; drop force_words_ids")),
    "penalty_alpha": (_is_set, ("contrastive search (penalty_alpha) is not supported with assistant='self'; "
                               "drop penalty_alpha")),
    "dola_layers": (_is_set, "DoLa decoding (dola_layers) is not supported with assistant='self'; drop dola_layers"),
    "watermarking_config": (_is_set, ("watermarking is not supported with assistant='self'; "
                                     "drop watermarking_config")),
    "output_attentions": (bool, "output_attentions is not supported with assistant='self'"),
    "output_hidden_states": (bool, "output_hidden_states is not supported with assistant='self'"),
    "assistant_early_exit": (_is_set, ("assistant_early_exit and assistant='self' are two different drafters; "
                                      "pick one")),
    "use_mtp": (_is_set, ("use_mtp (multi-token prediction drafting) and assistant='self' are two different "
                         "drafters; pick one")),
    "assistant_ensemble_weight": (_is_set, ("assistant_ensemble_weight (lossy ensemble with a draft model) is not "
                                           "supported with assistant='self'; drop it")),
    "speculation_type": (_is_set, ("speculation_type selects HF's own speculative decoding; drop it with "
                                  "assistant='self' (the drafter is DecodeConfig's)")),
}


@dataclass
class SelfSpecState:
    """What `attach_heads` keeps on a model."""

    heads: Any  # ExitHeads or None (prompt lookup only)
    decode_config: DecodeConfig
    engine_config: EngineConfig
    engine: Engine | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    draft_model: Any = None  # the last assistant_model and its engine (own KV cache)
    draft_engine: Engine | None = None
    owner: int | None = None  # thread ident of the call that holds `lock`
    pending: SelfSpecCall | None = None  # the holder's call, until HF has merged its config

    @contextlib.contextmanager
    def serving(self, call: SelfSpecCall | None = None):
        """One call at a time per model (one engine, one KV cache). Another thread waits
        its turn; the thread that already holds the model (a streamer or stopping
        criterion calling generate(assistant="self") on the same model from inside) gets
        a RuntimeError, where waiting on itself would deadlock. `call` waits in `pending`
        for HF's merged GenerationConfig (take_pending)."""
        me = threading.get_ident()
        if self.owner == me:  # only the holder ever writes its own ident here
            raise RuntimeError(
                "generate(assistant='self') was called again on the same model from inside a "
                "running generate(assistant='self') call (a streamer, stopping criterion or "
                "logits processor?). The model decodes one request at a time: run the second "
                "call after the first returns, or on another model (copy.deepcopy(model))"
            )
        with self.lock:
            self.owner, self.pending = me, call
            try:
                yield
            finally:
                self.owner = self.pending = None

    # A copy or pickle of the model carries the heads and configs; the lock is new and the
    # engines (KV caches that view the original's weights) are rebuilt lazily on first use.
    _NOT_COPIED = ("lock", "owner", "pending", "engine", "draft_model", "draft_engine")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._NOT_COPIED}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.lock = threading.Lock()
        self.owner = self.pending = self.engine = self.draft_model = self.draft_engine = None

    def take_pending(self) -> SelfSpecCall | None:
        """The call of the thread that holds the model, once (HF merges one GenerationConfig
        per generate()); None for any other thread, e.g. a plain generate() beside it."""
        if self.owner != threading.get_ident():
            return None
        call, self.pending = self.pending, None
        return call

    def draft_engine_for(self, draft_model, capacity: int) -> Engine:
        """The draft model's engine, with as many KV slots as the main engine, or as its
        max_position_embeddings allow where those are fewer: a draft model of shorter context
        serves every request that fits it (the request is checked against it up front)."""
        limit = served_positions(text_config(draft_model), _windowed(draft_model)) or capacity
        capacity = min(capacity, limit)
        if self.draft_model is not draft_model or not self._current(self.draft_engine, draft_model):
            self.draft_engine = None  # free the old cache first
            self.draft_engine = self._new_engine(draft_model, capacity)
            self.draft_model = draft_model
        else:  # a new request: no slot is in use yet, nothing to copy
            self.draft_engine.ensure_capacity(capacity, keep=0, release=True)
        return self.draft_engine

    def engine_for(self, model, need: int) -> Engine:
        """The model's engine with room for `need` KV slots: built at the first call and
        rebuilt when the model's weights moved (dtype, device, new tensors); otherwise its
        KV cache grows (or shrinks back) to the request, measuring nothing again."""
        _check_positions(model, need, "the model's")
        if not self._current(self.engine, model):
            self.engine = None  # free the old cache first
            if self.heads is not None:  # the heads' copies of the model's weights follow them
                self.heads.bind(model)  # (a dtype / device change, new tensors)
            self.engine = self._new_engine(model, need)
        else:  # a new request: no slot is in use yet, nothing to copy
            self.engine.ensure_capacity(need, keep=0, release=True)
            self.engine.next_request()
        return self.engine

    def step_width(self, model) -> int:
        """Rows per engine step for `model`: EngineConfig.width, or its streamed_width where
        accelerate streams weights in (a step then costs its weights' transfer, nearly
        whatever its rows: wide draft trees pay)."""
        return self.engine_config.streamed_width if _streams_weights(model) else self.engine_config.width

    @staticmethod
    def _current(engine: Engine | None, model) -> bool:
        """Whether `engine` still serves `model` as it is now (not stale)."""
        return engine is not None and engine.view.model is model and not engine.is_stale()

    def _new_engine(self, model, need: int) -> Engine:
        """An engine with `need` KV slots or more: the configured capacity, rounded up to
        256 slots, at most the model's max_position_embeddings. Its executor: the
        configured one, where "auto" means CUDA graphs on a CUDA model (eager with one
        warning where they cannot be set up or captured) and eager elsewhere."""
        from .engine.runner import resolve_executor

        limit = served_positions(text_config(model), _windowed(model)) or need
        capacity = min(-(-max(self.engine_config.capacity, need) // 256) * 256, limit)
        requested = self.engine_config.executor
        # a graph cannot replay accelerate's hooks, which bring offloaded weights in
        streams, width = _streams_weights(model), self.step_width(model)
        device = torch.device("cpu") if streams else model_device(model)
        executor = resolve_executor(requested, device)
        config = replace(self.engine_config, capacity=max(capacity, 2 * width), executor=executor, width=width)
        if requested != "auto" or executor != "cuda_graphs":
            return Engine(model, config)
        try:  # graphs chosen for the caller, not asked for: eager where they cannot be set up
            return Engine(model, config)
        except Exception as err:  # noqa: BLE001 -- any failure of the graph set-up: run eagerly
            warnings.warn(
                f"the CUDA-graph executor could not be set up ({type(err).__name__}: {err}); this "
                "engine runs its step programs eagerly (same results, more host time per step). A "
                "capture that fails later falls back the same way (CudaGraphRunner).",
                RuntimeWarning, stacklevel=2)
            return Engine(model, replace(config, executor="eager"))


def _streams_weights(model) -> bool:
    """Whether accelerate brings some of `model`'s weights in at each forward (offload)."""
    if not is_dispatched(model):
        return False
    placement = dispatch_placement(model)
    return placement is not None and placement.any_offloaded


def model_device(model) -> torch.device:
    """The device `model` computes on: its parameters', or for a model accelerate dispatched
    the execution device of its LM head (offloaded parameters sit on the meta device): where
    the engine's logits and final hidden states are, which the heads read."""
    if is_dispatched(model):
        return dispatch_placement(model).lm_head.device
    return next(model.parameters()).device


def _windowed(model) -> bool:
    """Whether the engine applies `model`'s sliding windows where it runs (layered.windows_served)."""
    return windows_served(model_device(model))


def _check_positions(model, need: int, whose: str) -> None:
    scaled_from = query_scaling_positions(text_config(model))
    if scaled_from is not None and need > scaled_from:
        what = ("scales its NoPE layers' queries by position (attn_temperature_tuning, floor_scale) or "
                "attends within chunks (attention_chunk_size)"
                if text_config(model).model_type == "llama4_text" else
                "scales its queries by position (from original_max_position_embeddings: llama_4_scaling_beta)")
        raise ValueError(
            f"this request needs {need} positions (prompt + max_new_tokens); from position "
            f"{scaled_from} {whose} attention {what}, which hf_selfspec's engine does not: shorten the "
            "prompt or lower max_new_tokens, or run this request with plain model.generate()")
    limit = getattr(text_config(model), "max_position_embeddings", None) or need
    if need > limit:
        raise ValueError(
            f"this request needs {need} positions (prompt + max_new_tokens), "
            f"more than {whose} max_position_embeddings ({limit}); shorten the prompt "
            "or lower max_new_tokens"
        )
    window = attention_window(text_config(model))
    if window is not None and need > window and not _windowed(model):
        raise ValueError(
            f"this request needs {need} positions (prompt + max_new_tokens), more than {whose} "
            f"sliding window ({window}): up to {window} positions the model attends to every earlier "
            "token, as hf_selfspec's CUDA engine does; past it the model sees only the last "
            f"{window}, which the engine applies on the CPU only. Shorten the prompt or lower "
            "max_new_tokens, or run this request with plain model.generate() (no assistant='self')"
        )


def _check_engine_prefill(model, config: EngineConfig, prompt_len: int) -> None:
    """Up front, before any work: layered.check_engine_prefill where the engine prefills."""
    from .engine.layered import check_engine_prefill

    if config.prefill == "engine":
        check_engine_prefill(text_config(model), prompt_len)


_SUBCLASSES: dict[type, type] = {}


def _selfspec_class(base: type) -> type:
    """A subclass of the model's HF class with our generate (one per base class)."""
    if getattr(base, "_is_selfspec_class", False):
        return base
    if base not in _SUBCLASSES:
        # same __name__ so save_pretrained writes the base architecture name
        _SUBCLASSES[base] = type(base.__name__, (base,), {
            "generate": _generate, "_prepare_generation_config": _prepare_generation_config,
            "_is_selfspec_class": True, "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__reduce_ex__": _reduce_attached,
        })
    return _SUBCLASSES[base]


def _reduce_attached(self, protocol):
    """pickle finds a class by module and name, which for our subclass lead to the base
    class: rebuild the subclass from its base instead (copy.deepcopy takes this path too)."""
    return _new_attached, (type(self).__mro__[1],), self.__dict__


def _new_attached(base: type):
    cls = _selfspec_class(base)
    return cls.__new__(cls)


def attach_heads(model, heads=None, *, decode: DecodeConfig | None = None,
                 engine: EngineConfig | None = None, revision: str | None = None):
    """Give an HF causal LM `generate(..., assistant="self")`, in place; returns `model`.

    heads: where the drafts come from, besides prompt lookup:
        None (default): the heads shipped with hf_selfspec (top-layer draft heads) when
            `model` is the embedded default SmolLM2-135M-Instruct; for any other model no
            heads: exact prompt lookup in our engine, with a one-time warning saying how to
            get heads (`hf-selfspec train-heads`, or heads="org/repo").
        a folder or a Hub repo id: heads saved for this model (any kind: config.json says
            which); heads for another model are refused with an error naming both.
        loaded heads (`ExitHeads` / `TopDraftHeads`).
        False: no heads, exact prompt lookup only, and no warning.
    decode: knobs of the speculative loop (DecodeConfig); engine: width / KV capacity.
    revision: the Hub revision of `heads`.

    Greedy output is the model's own greedy output token for token, sampled output follows
    the model's own sampling distribution; the drafters only change the speed.

    Weights mapped from the checkpoint file (how transformers loads safetensors on the CPU)
    are copied once into the process's own memory, which the engine streams faster: the
    same Parameter objects and values, new storage (engine/residence.py).
    """
    from .engine.layered import LayeredModel
    from .engine.residence import move_file_mapped_weights

    _install_attach_first_check()
    _check_attach_arguments(heads, decode, engine)
    # the architecture first: a window is worth mentioning only on a model the engine runs
    LayeredModel.check_supported(model)  # unsupported features or layers fail here, early
    if "generate" in model.__dict__:
        raise ValueError(
            "this model instance has its own generate attribute (loaded with a custom_generate "
            "repo?); load it without custom_generate to attach heads"
        )
    # before the heads bind to the model's embedding: they keep a reference to it
    move_file_mapped_weights(model)
    if heads is not None and heads is not False:
        _check_heads_devices(model)
    loaded = _default_or_no_heads(model, revision) if heads is None else _load_heads(model, heads, revision)
    if loaded is not None and heads is None:
        _check_heads_devices(model)
    if decode is None:
        decode = DecodeConfig(lookup="first" if loaded is not None else "only")
    if engine is None:
        limit = served_positions(text_config(model), _windowed(model)) or DEFAULT_CAPACITY
        engine = EngineConfig(capacity=min(DEFAULT_CAPACITY, limit))
    # validate the pair once, here, with the real heads
    if loaded is not None and decode.lookup != "only" and decode.thresholds is None \
            and getattr(loaded, "calibration", None) is None:
        raise ValueError("the heads carry no calibration.json: pass decode=DecodeConfig(thresholds=...)")
    model.__class__ = _selfspec_class(type(model))
    model._selfspec = SelfSpecState(loaded, decode, engine)
    model.selfspec_stats = None
    return model


def _check_heads_devices(model) -> None:
    """Draft heads read rows of the token embedding and of the LM head in the same product:
    on a model accelerate spreads over several devices both must execute on one."""
    if not is_dispatched(model):
        return
    placement = dispatch_placement(model)
    embedding, head = placement.embedding.device, placement.lm_head.device
    if embedding != head:
        raise UnsupportedModelError(
            f"draft heads read the token embedding and the LM head together, and this device_map runs the "
            f"embedding on {embedding} and the LM head on {head}. Put both on one device in the device_map "
            "(the LM head's entry on the embedding's device), or attach_heads(model, heads=False) to decode "
            "with prompt lookup only")


def _check_attach_arguments(heads, decode, engine) -> None:
    """attach_heads' arguments of the types it takes: another type (heads=True, a dict of
    settings) would fail deep in a path join, or only at the first generate() call."""
    import os

    from .heads import is_heads

    if not (heads is None or heads is False or isinstance(heads, (str, os.PathLike)) or is_heads(heads)):
        raise TypeError(
            f"heads must be a heads folder, a Hub repo id ('org/name'), loaded heads, None (the shipped "
            f"heads for the default model, else prompt lookup) or False (no heads), got {heads!r}")
    for name, value, cls in (("decode", decode, DecodeConfig), ("engine", engine, EngineConfig)):
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{name} must be {'an' if cls is EngineConfig else 'a'} {cls.__name__} or None, got {type(value).__name__} {value!r}: "
                            f"pass hf_selfspec.{cls.__name__}(...)")


_WARNED_NO_HEADS: set[str] = set()


def _default_or_no_heads(model, revision):
    """heads=None: the shipped heads when `model` is the model they were trained for (the
    embedded default), else no heads (exact prompt lookup) and a one-time warning.

    Decided here, before the heads loader runs: the default heads' config.json names the
    dimensions and weight fingerprint of their base model. Another model's dimensions never
    try the heads; equal dimensions with other weights (a fine-tune, another rounding) ask the
    loader, which accepts a near-identical checkpoint or refuses with a ValueError."""
    from .heads import default_heads_path, fingerprint

    folder = default_heads_path()
    base = _read_base(folder / "config.json")
    name = getattr(model.config, "_name_or_path", "") or ""
    if base is not None:
        text = text_config(model)
        dims = (text.num_hidden_layers, text.hidden_size, text.vocab_size)
        if dims == (base.get("num_layers"), base.get("hidden_size"), base.get("vocab_size")):
            if fingerprint(model) == base.get("base_fingerprint"):
                return _load_heads(model, None, revision)  # the default model: errors are real
            try:
                return _load_heads(model, None, revision)
            except ValueError:
                pass  # weights too far from the heads' base: no heads, as for any other model
    key = fingerprint(model)
    if key not in _WARNED_NO_HEADS:
        _WARNED_NO_HEADS.add(key)
        base_name = (base or {}).get("base_model", "the embedded default model")
        warnings.warn(
            f"no heads given and the heads shipped with hf_selfspec are for {base_name}, not for "
            f"{repr(name) if name else 'this ' + type(model).__name__}: assistant='self' drafts with exact prompt lookup only (the model's own "
            "greedy output; faster where the text repeats its context). For more speed get heads "
            f"for this model: train them with `hf-selfspec train-heads {name or 'MODEL'} --out FOLDER --minutes 60` "
            "and attach_heads(model, heads='FOLDER'), or pass published heads (heads='org/repo'). "
            "heads=False attaches without heads and without this warning.",
            UserWarning, stacklevel=3,
        )
    return None


def _read_base(path) -> dict | None:
    """The shipped heads' config.json as a dict, or None where none is shipped / readable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_heads(model, heads, revision):
    """Heads of any kind (config.json says which) from a folder, a Hub id or an object."""
    from .heads import check_compatible, default_heads_path, is_heads, load_heads

    if heads is False:
        return None
    if is_heads(heads):  # loaded heads of any kind (heads/kinds.py)
        heads.config.validate()
        check_compatible(heads.config, model)  # refuses another shape, warns if near-identical
        return heads.bind(model)
    if heads is None:
        heads = default_heads_path()
        if not (heads / "config.json").is_file():
            raise FileNotFoundError(f"no default heads are shipped in {heads}; pass heads=... or heads=False")
    return load_heads(heads, model, revision=revision)  # a folder, or a Hub repo id fetched/cached


def detach_heads(model):
    """Undo `attach_heads`: the model's own class and generate again."""
    cls = type(model)
    if getattr(cls, "_is_selfspec_class", False):
        model.__class__ = cls.__mro__[1]
    model.__dict__.pop("_selfspec", None)
    model.__dict__.pop("selfspec_stats", None)
    return model


class AutoSelfSpecModelForCausalLM:
    """`AutoModelForCausalLM.from_pretrained(...)` + `attach_heads(...)` in one call."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, heads=None, *, decode=None,
                        engine=None, **hf_kwargs):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, **hf_kwargs)
        model.eval()
        return attach_heads(model, heads, decode=decode, engine=engine)


# --------------------------------------------------------------------------- generate


def _generate(self, inputs=None, generation_config=None, *args, assistant=None, **kwargs):
    """HF generate(); with assistant="self" exact self-speculative decoding.

    assistant: "self" here, or left out and set as an attribute of the GenerationConfig
    passed or of `model.generation_config` (which save_pretrained writes to disk); False:
    plain HF generate() even where a config says "self".
    """
    base_generate = super(type(self), self).generate
    if assistant is None:
        assistant = _configured_assistant(self, generation_config)
    if assistant is None or assistant is False:
        return base_generate(inputs, generation_config, *args, **kwargs)
    if assistant != ASSISTANT_SELF:
        raise ValueError(f"assistant must be 'self', False or left out, got {assistant!r}")
    streamer = kwargs.pop("streamer", None)
    try:
        return _generate_self(self, base_generate, inputs, generation_config, args, streamer, kwargs)
    finally:
        if streamer is not None:  # after an error too: a consumer iterating it (a
            streamer.end()        # TextIteratorStreamer in another thread) would wait forever


def _generate_self(model, base_generate, inputs, generation_config, args, streamer, kwargs):
    """generate(assistant="self"): the call checked, then HF's generate() with our loop."""
    state: SelfSpecState | None = model.__dict__.get("_selfspec")
    if state is None:
        raise ValueError(ATTACH_FIRST)
    if args:
        raise ValueError("with assistant='self', pass generate() options as keyword arguments")
    _check_module_hooks(model)
    _check_autocast(model)
    _check_dropout(model)
    if kwargs.get("custom_generate") is not None:
        raise ValueError("assistant='self' cannot be combined with custom_generate")
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("inputs_embeds is not supported with assistant='self': pass input_ids")
    # an image-text model's media, refused before HF's generate() encodes them (the loop's
    # _check_text_inputs refuses any other input it would leave unread)
    _check_text_inputs({name: kwargs.get(name) for name in MEDIA_INPUTS})
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    _check_passed_cache(ids, kwargs.get("attention_mask"), kwargs.get("cache", kwargs.get("past_key_values")))
    _check_input_ids(ids, kwargs.get("attention_mask"))
    if kwargs.get("cache_implementation") == "paged":
        # HF would switch to continuous batching before our loop is reached
        raise ValueError("cache_implementation='paged' (continuous batching) is not supported with "
                         "assistant='self'; drop it")
    call = SelfSpecCall(streamer=streamer, draft_model=kwargs.pop("assistant_model", None),
                        options={name: kwargs.pop(name) for name in HF_DRAFT_OPTIONS if name in kwargs},
                        tokenizer=kwargs.pop("tokenizer", None))
    if call.draft_model is not None:
        check_draft_model(model, call.draft_model)
    # Never in inference mode (HF's generate() turns gradients off itself): the engine, its
    # KV cache and weight copies outlive this call, and tensors made under
    # torch.inference_mode() could not be updated by a later call outside it; the tokens are
    # the same either way.
    with state.serving(call), torch.inference_mode(False):  # serving: one engine (one KV cache) per model
        return base_generate(inputs, generation_config, custom_generate=_decode_loop, selfspec_call=call, **kwargs)


def _check_module_hooks(model) -> None:
    """The engine computes the model's layers itself (only the prompt's prefill may go through
    the model's forward): a forward hook or pre-hook on one of its modules (activation
    steering, a patched norm or LM head) would change the prompt's pass and no decoded token,
    a silently different output. Refused, naming the module. transformers' own hooks are left
    alone: they record outputs, or act in training only. An image-text model's other parts
    (its vision tower) take no part in decoding text."""
    decoding = {id(model)} | {id(m) for part in (text_decoder(model), model.lm_head) for m in part.modules()}
    for name, module in model.named_modules():
        if id(module) not in decoding:
            continue
        for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks)):
            for hook in hooks.values():
                where = getattr(hook, "__module__", None) or type(hook).__module__ or ""
                if not where.startswith("transformers."):
                    raise ValueError(
                        f"{name or 'the model'} has a {kind} ({getattr(hook, '__qualname__', hook)!r}), which "
                        "generate(assistant='self') would apply to the prompt only: its engine computes the "
                        "layers itself, without calling the model's modules. Remove the hook (handle.remove()) "
                        "for this call, or drop assistant='self'")


def _check_autocast(model) -> None:
    """Under torch.autocast HF's generate computes in the autocast dtype (other tokens than
    the model's own dtype gives); the engine runs its own kernels in the model's dtype and
    would ignore it. Refused rather than silently computed otherwise."""
    param, device = next(model.parameters()), model_device(model)
    if torch.is_autocast_enabled(device.type):
        raise ValueError(
            f"torch.autocast is on for {device.type}: generate(assistant='self') runs the model in its own "
            f"dtype ({param.dtype}) and would ignore it. Cast the model instead (model.to(torch.bfloat16)), or "
            "call generate() outside the autocast block")


def _check_dropout(model) -> None:
    """A model in training mode with active dropout: HF's forward (the prompt's prefill)
    drops activations at random, the engine's steps never do, so the tokens would differ
    from HF's and from run to run. Refused before any work. A model in training mode
    without active dropout (every rate 0) computes what eval mode does, and decodes."""
    if not any(module.training for module in model.modules()):
        return
    active = [name or "the model" for name, module in model.named_modules()
              if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and module.p > 0]
    # attention dropout is applied functionally (no module to find): its rate is the config's
    rates = [getattr(config, "attention_dropout", None) for config in (model.config, getattr(model.config, "text_config", None))]
    rate = next((r for r in rates if isinstance(r, numbers.Real) and r > 0), None)
    if active or rate is not None:
        where = (f"dropout in {', '.join(active[:3])}{' ...' if len(active) > 3 else ''}" if active
                 else f"attention_dropout={rate} in its config")
        raise ValueError(
            f"the model is in training mode with active dropout ({where}): generate(assistant='self') "
            "decodes without dropout, so its tokens would differ from HF's generate() in this mode. "
            "Call model.eval() before generating (and model.train() afterwards to go on training)")


def _check_passed_cache(ids, attention_mask, cache) -> None:
    """The loop decodes from input_ids alone, in its engine's own KV cache: a passed cache
    (past_key_values) is not read. That is HF's output where the ids hold the whole sequence
    (HF's rule: the attention mask as long as the ids) and the cache a prefix of them; where
    the cache holds tokens the ids do not repeat (only the new tokens passed), it is not."""
    seen = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    if not seen or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    mask_length = attention_mask.shape[-1] if isinstance(attention_mask, torch.Tensor) else ids.shape[1]
    if mask_length != ids.shape[1] or seen >= ids.shape[1]:
        raise ValueError(
            f"the past_key_values passed hold {seen} tokens that input_ids ({ids.shape[1]} tokens) do not "
            "repeat: generate(assistant='self') decodes from input_ids alone, in its own KV cache. Pass "
            "the whole sequence as input_ids (with its attention_mask), and past_key_values may be dropped")


def _check_input_ids(ids, attention_mask) -> None:
    """input_ids as HF's forward takes them: a 2-D tensor of int64 (or int32) ids, and an
    attention mask of the same shape. HF fails deep inside (an AttributeError, an
    IndexError, an embedding's dtype error, a shape mismatch in the forward) for the rest;
    the loop would cut the rows' prompts at the wrong places with a mask of another shape."""
    if ids is None:
        return  # HF starts from the BOS token
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch tensor [batch, length], got a {type(ids).__name__}: pass "
                         "tokenizer(text, return_tensors='pt').input_ids or torch.tensor([ids])")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be integer token ids of dtype torch.long (or torch.int32), got "
                         f"{ids.dtype}: pass input_ids.long()")
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a 2-D tensor [batch, length >= 1], got shape {tuple(ids.shape)}"
                         + (": add the batch dimension (ids[None])" if ids.dim() == 1 else ""))
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} and input_ids "
                         f"{tuple(ids.shape)}: pass the attention_mask the tokenizer returned with these ids")
    for name, t in (("input_ids", ids), ("attention_mask", attention_mask)):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":  # no values to read
            raise ValueError(f"{name} is on the meta device, which holds no values: pass it on the "
                             "model's device (.to(model.device))")


def _configured_assistant(model, generation_config):
    """`assistant` of the GenerationConfig passed, else of the model's own (a custom
    GenerationConfig entry: save_pretrained writes it, and HF reads it back from a model's
    own generation_config.json, though not from one it derived from the model config)."""
    for config in (generation_config, getattr(model, "generation_config", None)):
        value = getattr(config, "assistant", None) if config is not None else None
        if value is not None:
            return value
    return None


def _install_attach_first_check() -> None:
    """A model that was never attached (or was detached) has HF's own generate(): there
    assistant='self' as a keyword fails with HF's generic "model_kwargs are not used", and
    in a GenerationConfig it is silently ignored. Both raise ATTACH_FIRST instead. The hook
    sits on HF's GenerationConfig preparation and acts only on those two requests, which
    HF would refuse or drop; every other call is untouched. Installed as soon as HF's
    generation module is loaded (import_hook.after_import, below: importing the package does
    not import HF's generation stack), and again by attach_heads (a no-op then)."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin._prepare_generation_config
    if getattr(original, "_selfspec_hook", False):
        return

    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        config, model_kwargs = original(self, generation_config, *args, **kwargs)
        if "_selfspec" not in self.__dict__ and ASSISTANT_SELF in (
                model_kwargs.get("assistant"), getattr(config, "assistant", None)):
            raise ValueError(ATTACH_FIRST)
        return config, model_kwargs

    _prepare_generation_config._selfspec_hook = True
    _prepare_generation_config.__doc__ = original.__doc__
    GenerationMixin._prepare_generation_config = _prepare_generation_config


after_import("transformers.generation.utils", _install_attach_first_check)


def _with_stop_strings(stopping_criteria, call: SelfSpecCall):
    """HF's stopping criteria plus the StopStringCriteria HF would have built for the call's
    stop strings (same class, same stopping token): HF hands a custom loop no tokenizer."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    if not call.stop_strings:
        return stopping_criteria
    if call.tokenizer is None:
        raise ValueError("stop_strings (passed, or set in the model's generation_config) need the model's "
                         "tokenizer: pass tokenizer=... to generate()")
    criteria = StoppingCriteriaList(stopping_criteria or [])
    criteria.append(StopStringCriteria(tokenizer=call.tokenizer, stop_strings=call.stop_strings))
    return criteria


def _prepare_generation_config(self, generation_config, *args, **kwargs):
    """HF's GenerationConfig merge; for the generate(assistant="self") call this thread is
    serving, the merged config's stop strings and drafting options then move to that call
    (SelfSpecCall.take_from). After HF's merge, because it fills every field a call leaves
    unset from model.generation_config, which is where these may sit too."""
    config, model_kwargs = super(type(self), self)._prepare_generation_config(generation_config, *args, **kwargs)
    state = self.__dict__.get("_selfspec")
    call = state.take_pending() if state is not None else None
    if call is not None:
        call.take_from(config)
    return config, model_kwargs


# image-text models' inputs beside the text (HF's generate() turns pixel_values into
# mm_encoder_outputs before the loop is reached)
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "image_sizes", "input_features", "mm_encoder_outputs")
# what HF's generate() passes the loop beside the prompt, all read or rebuilt by the engine
_ENGINE_MODEL_INPUTS = frozenset({"attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep",
                                  "position_ids", "cache_position"})


def _check_text_inputs(model_kwargs: dict, model_type: str | None = None) -> None:
    """The engine decodes text: another input the model's forward would read (an image-text
    model's pixel_values, ...) would be silently dropped, so it is refused by name (an empty
    container, as HF's own mm_encoder_outputs={}, holds nothing).
    token_type_ids all 0 (a tokenizer's for plain text; Gemma 3's processor marking no image)
    are the text's own, except for the models that add the embedding of each type, 0
    included, to their rows (GPT-2 and its kin: TOKEN_TYPE_EMBEDDING_TYPES)."""
    for name, value in model_kwargs.items():
        if name in _ENGINE_MODEL_INPUTS or value is None:
            continue
        if name == "token_type_ids" and isinstance(value, torch.Tensor) and not bool(value.any()) \
                and model_type not in TOKEN_TYPE_EMBEDDING_TYPES:
            continue
        if isinstance(value, torch.Tensor) or (isinstance(value, (dict, list, tuple)) and value):
            raise ValueError(
                f"{name} is not supported with assistant='self': the engine decodes text only, and "
                "plain model.generate() would read it (an image, ...). Drop it, or drop "
                "assistant='self' for this call")


def _check_request(generation_config, logits_processor) -> bool:
    """Refuse what the loop cannot honour; True when the processors must be applied row by
    row (sampling, or greedy with more than min_new_tokens / min_length)."""
    from transformers.generation.configuration_utils import GenerationMode

    gc = generation_config
    for name, (bad, message) in _UNSUPPORTED.items():
        if bad(getattr(gc, name, None)):
            raise ValueError(message)
    mode = gc.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):  # a mode added to HF later
        raise ValueError(f"generation mode {mode.value!r} is not supported with assistant='self': "
                         "only greedy decoding and sampling (do_sample=True)")
    if getattr(gc, "token_healing", False):
        raise ValueError("token_healing is not supported with assistant='self'; drop it")
    unsupported = unsupported_processors(logits_processor)
    if unsupported:
        raise NotImplementedError(
            f"these logits processors are not supported with assistant='self': {unsupported} "
            "(supported: processors that depend only on the tokens so far and the scores, "
            f"{sorted(ROW_PROCESSORS)}). Remove the options or processors that create them, "
            "or drop assistant='self'"
        )
    return bool(gc.do_sample) or any(type(p).__name__ not in MIN_LENGTH_PROCESSORS for p in logits_processor)


def _check_token_ids(model, input_ids: torch.Tensor, eos: list[int], pad) -> None:
    """Every id the request names must be a token of the model: an id outside [0, V) would
    fail deep in an embedding lookup or a logits index (HF itself fails there too)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    head = model.get_output_embeddings()
    out_vocab = head.weight.shape[0] if head is not None else vocab
    if input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"input_ids hold the token id {bad}, outside this model's vocabulary "
                             f"[0, {vocab}): check the tokenizer matches the model")
    for e in eos:
        if not 0 <= e < out_vocab:
            raise ValueError(f"eos_token_id {e} is outside this model's vocabulary [0, {out_vocab}): "
                             "pass the model's own end-of-sequence id (tokenizer.eos_token_id)")
    if pad is not None:  # an int, a tensor or a numpy integer, as HF takes it
        pad_ids = torch.as_tensor(pad).reshape(-1).tolist()
        for p in pad_ids:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < vocab:
                raise ValueError(f"pad_token_id {p!r} is not a token id of this model [0, {vocab}): "
                                 "pass one, e.g. tokenizer.pad_token_id or tokenizer.eos_token_id")


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


def _row_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Unpadded prompt of each row; only left padding is accepted."""
    rows = []
    for b in range(input_ids.shape[0]):
        ids = input_ids[b]
        if attention_mask is not None:
            mask = attention_mask[b].bool()
            if mask.any():
                first = int(mask.nonzero()[0])
                if not bool(mask[first:].all()):
                    raise ValueError(
                        f"row {b}: attention_mask must be ones after left padding (no right padding or "
                        "holes) with assistant='self'; pad on the left (tokenizer.padding_side='left'). "
                        "Passed no attention_mask? HF masks every token equal to pad_token_id: where "
                        "the prompt itself holds that id, pass attention_mask (the tokenizer's)"
                    )
                ids = ids[first:]
            else:
                ids = ids[:0]
        rows.append(ids.tolist())
    return rows


def _decode_loop(model, input_ids, logits_processor=None, stopping_criteria=None,
                 generation_config=None, selfspec_call: SelfSpecCall | None = None, **model_kwargs):
    """The custom_generate callable HF's generate() calls with the prepared request."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    gc = generation_config
    call = selfspec_call if selfspec_call is not None else SelfSpecCall()
    selfspec_draft_model = call.draft_model
    logits_processor = logits_processor if logits_processor is not None else []
    # every check first, then the engine: a bad request costs no work
    row_processing = _check_request(gc, logits_processor)
    _check_text_inputs(model_kwargs, getattr(model.config, "model_type", None))
    stopping_criteria = _with_stop_strings(stopping_criteria, call)
    state: SelfSpecState = model._selfspec
    # this call's drafting options (bad values refused here, before any work)
    width = state.step_width(model)
    config = _per_call_config(state.decode_config, call.options, width, selfspec_draft_model is not None)
    if gc.do_sample and config.lossy_top_k > 1:  # the loop's own check would come after the build
        raise ValueError("lossy_top_k > 1 is a greedy option; sampling is exact only (set lossy_top_k=1)")
    prompt_len = input_ids.shape[1]
    max_new_tokens, min_new_tokens = _token_count(gc, "max_new_tokens"), _token_count(gc, "min_new_tokens")
    max_new = max_new_tokens if max_new_tokens is not None else _token_count(gc, "max_length") - prompt_len
    min_new = min_new_tokens or max(0, (_token_count(gc, "min_length") or 0) - prompt_len)
    eos = _eos_ids(gc)
    _check_token_ids(model, input_ids, eos, gc.pad_token_id)
    streamer = call.streamer
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("streamers support batch size 1 only (as in HF generate)")
    want_logits = bool(gc.output_logits or gc.output_scores) and gc.return_dict_in_generate
    prompts = _row_prompts(input_ids, model_kwargs.get("attention_mask"))
    for p in prompts:
        if not p:
            raise ValueError("a row of input_ids is empty (all padding): give every row at least one token")
    need = max(len(p) for p in prompts) + max_new  # positions plain greedy needs
    _check_positions(model, need, "the model's")
    if selfspec_draft_model is not None:  # its engine holds the same sequence
        _check_positions(selfspec_draft_model, need, "the draft model's")
    _check_engine_prefill(model, state.engine_config, max(len(p) for p in prompts))

    # the engine (built on the first call, or rebuilt for a larger request): its build time
    # and step-cost measurement are reported as stats.build_time, not as decoding time
    started, engine_before, draft_before = time.perf_counter(), state.engine, state.draft_engine
    limit = served_positions(text_config(model), _windowed(model)) or need + width
    engine = state.engine_for(model, min(need + width, limit))
    getattr(engine, "step_costs", None)  # measured once per engine, here rather than mid-decode
    # the attention per row-key: for rows past the measured context, or for any request
    # where it is cheap to measure (then a short one plans with its rows' cheaper attention)
    if need > costs.cost_context(engine) or getattr(engine, "times_steps_cheaply", False):
        getattr(engine, "attention_seconds", None)
    draft_engine = None
    if selfspec_draft_model is not None:
        draft_engine = state.draft_engine_for(selfspec_draft_model, engine.capacity)
        getattr(draft_engine, "step_costs", None)
    decoder = SelfSpecDecoder(engine, state.heads, config, draft_engine)
    # a batch shares engine steps (decoding/batch.py) where the engine and drafter allow it,
    # else its sequences are decoded one after the other: the same tokens either way
    batched = len(prompts) > 1 and draft_engine is None and batch_obstacle(engine, decoder) is None
    measured_batch = batched and not engine.has_batch_costs
    if batched:  # measured once per machine and model (cached on disk): build time, not decoding
        getattr(engine, "batch_costs", None)
    built = (engine is not engine_before or measured_batch
             or (draft_engine is not None and draft_engine is not draft_before))
    build_time = time.perf_counter() - started if built else 0.0
    if built:
        logger.info(f"hf_selfspec: engine built in {build_time:.1f} s ({engine.layout.name!r} row layout, "
                    f"{engine.capacity} KV slots, width {engine.width})")

    if streamer is not None:
        streamer.put(input_ids.cpu())
    # HF passes its criteria the scores so far where it keeps them, else None
    scores_for_criteria = NoScores() if gc.return_dict_in_generate and gc.output_scores else None
    requests, stats = [], []
    batch = input_ids.shape[0]
    for b, p in enumerate(prompts):
        padded = input_ids[b].tolist()

        def stop(out, padded=padded, b=b):
            if stopping_criteria is None or not len(stopping_criteria):
                return False
            # HF asks the criteria about the whole batch and row b answers for sequence b; the
            # rows here advance apart, so every row of the batch criteria see is this row's
            # sequence (a view) and its answer is read at b: a criterion that indexes its rows
            # (per-row stop ids) answers for the right one
            seq = torch.tensor([padded + out], device=input_ids.device).expand(batch, -1)
            return bool(stopping_criteria(seq, scores_for_criteria)[b])

        on_commit = None
        if streamer is not None:
            def on_commit(chunk):
                if chunk:
                    streamer.put(torch.tensor(chunk))
        live = DecodeStats(build_time=build_time if b == 0 else 0.0)
        if b == 0:
            model.selfspec_stats = live  # filled as tokens commit: a streamer may read .sources
        # HF scores a row with the whole padded row as input_ids: so does the scorer
        scorer = (RowScorer(row_processors(logits_processor, b, batch), padded, engine.view.vocab_size,
                            engine.head_device) if row_processing else None)
        requests.append(SequenceRequest(p, stop, on_commit, scorer, live))
        stats.append(live)
    wall = time.perf_counter()
    if batched:
        results = BatchDecoder(engine, state.heads, config).generate(
            requests, max_new, eos, min_new_tokens=min_new, collect_logits=want_logits,
            do_sample=bool(gc.do_sample))
    else:
        results: list[DecodeResult] = [
            decoder.generate(r.prompt, max_new, eos, stop=r.stop, on_commit=r.on_commit, min_new_tokens=min_new,
                             collect_logits=want_logits, stats=r.stats, scorer=r.scorer,
                             do_sample=bool(gc.do_sample))
            for r in requests]
    for r, live in zip(results, stats):
        r.stats.build_time = live.build_time
    if len(results) > 1 and not _pads_stopped_rows(stopping_criteria):
        def decode_more(b, tokens, n):  # row b on from its prompt and `tokens`, for n tokens
            scorer = (RowScorer(row_processors(logits_processor, b, batch), input_ids[b].tolist() + tokens,
                                engine.view.vocab_size, engine.head_device) if row_processing else None)
            return decoder.generate(prompts[b] + tokens, n, eos, collect_logits=want_logits, scorer=scorer,
                                    do_sample=bool(gc.do_sample))
        results = _decode_stopped_rows_on(results, decode_more)
    wall = time.perf_counter() - wall

    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    longest = max(len(r.tokens) for r in results)
    # new tokens as int64 whatever the prompt's integer dtype: HF's argmax tokens are, and
    # its torch.cat promotes an int32 prompt to them
    new = torch.full((len(results), longest), int(pad), dtype=torch.long, device=input_ids.device)
    for b, r in enumerate(results):
        new[b, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
    sequences = torch.cat([input_ids, new], dim=1)
    model.selfspec_stats = results[0].stats if len(results) == 1 else _merge_stats(results, wall)
    if not gc.return_dict_in_generate:
        return sequences
    logits = _per_step([r.logits for r in results], longest) if want_logits else None
    scores = _per_step([r.scores for r in results], longest) if want_logits else None
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=scores if gc.output_scores else None,
        logits=logits if gc.output_logits else None,
    )


class NoScores:
    """The `scores` a stopping criterion gets where HF would pass the scores so far
    (return_dict_in_generate with output_scores): the loop checks the criteria token by
    token as it commits several verified tokens, without a scores tuple to hand them. A
    criterion that reads it gets this error rather than a deep TypeError or another stop."""

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(
            "a stopping criterion read `scores`, which generate(assistant='self') does not pass to "
            "stopping criteria (HF's own criteria do not read them): decide from input_ids, or "
            "drop assistant='self' for this call")

    __getitem__ = __len__ = __iter__ = __bool__ = __getattr__ = _refuse


def _pads_stopped_rows(stopping_criteria) -> bool:
    """HF's rule: a row of a batch that its stopping criteria ended is padded only where one
    of the criteria is an EOS criterion (has `eos_token_id`); otherwise HF decodes that row on
    with the batch until every row has stopped."""
    return any(hasattr(c, "eos_token_id") for c in stopping_criteria or ())


def _decode_stopped_rows_on(results: list[DecodeResult], decode_more) -> list[DecodeResult]:
    """Each row shorter than the batch's longest (its stopping criteria ended it) decoded on
    to that length without stopping, as HF decodes it where nothing pads it.
    decode_more(b, tokens, n): row b's next n tokens after its prompt and `tokens`."""
    longest = max(len(r.tokens) for r in results)
    out = []
    for b, r in enumerate(results):
        if len(r.tokens) < longest:
            more = decode_more(b, r.tokens, longest - len(r.tokens))
            stats = _merge_stats([r, more], r.stats.total_time + more.stats.total_time)
            stats.prompt_tokens = r.stats.prompt_tokens
            r = DecodeResult(r.tokens + more.tokens, stats,
                             None if r.logits is None else r.logits + more.logits,
                             None if r.scores is None else r.scores + more.scores)
        out.append(r)
    return out


def _per_step(rows: list[list[torch.Tensor]], steps: int) -> tuple[torch.Tensor, ...]:
    """HF's layout of output_scores / output_logits: one [batch, V] tensor per new token.
    A row that ended earlier (EOS, its stopping criteria) has zeros after its last token,
    where HF has the scores of the pad tokens it keeps feeding: its sequence there is pad."""
    out = []
    for t in range(steps):
        step = torch.zeros(len(rows), rows[0][0].shape[-1], dtype=rows[0][0].dtype, device=rows[0][0].device)
        for b, row in enumerate(rows):
            if t < len(row):
                step[b] = row[t]
        out.append(step)
    return tuple(out)


def _merge_stats(results: list[DecodeResult], wall: float) -> DecodeStats:
    """One DecodeStats for a batch: sums over its sequences, but total_time is the whole
    call's (`wall`): in a batch the sequences' decodes overlap."""
    merged = DecodeStats(exits_per_head=[0] * len(results[0].stats.exits_per_head))
    for r in results:
        s = r.stats
        for name in ("prompt_tokens", "new_tokens", "cycles", "drafted", "accepted", "head_evaluations",
                     "off_chain_cycles", "prefill_time", "draft_time", "verify_time", "total_time",
                     "build_time"):
            setattr(merged, name, getattr(merged, name) + getattr(s, name))
        merged.exits_per_head = [a + b for a, b in zip(merged.exits_per_head, s.exits_per_head)]
        merged.sources += s.sources
        merged.lossy = merged.lossy or s.lossy
    merged.total_time = wall
    return merged
