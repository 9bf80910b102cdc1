"""Hugging Face integration: `attach_heads(model)` and `model.generate(..., assistant="self")`.

`attach_heads` swaps the model's class for a subclass of its own HF class whose
`generate` understands `assistant="self"`; everything else is the HF model untouched.
With `assistant="self"` the call still goes through HF's own `generate()` (GenerationConfig
merge, max_new_tokens/max_length, stopping criteria, stop strings, attention mask), which
hands the prepared request to our decoding loop as a `custom_generate` callable; the loop
runs the engine and returns HF's output types. What the engine cannot honour raises a
clear error before any work.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .decoding.cycle import DecodeConfig, DecodeResult, SelfSpecDecoder
from .decoding.draft_model import check_draft_model
from .decoding.sampling import MIN_LENGTH_PROCESSORS, ROW_PROCESSORS, RowScorer, unsupported_processors
from .engine.programs import DEFAULT_CAPACITY, Engine, EngineConfig
from .stats import DecodeStats

ASSISTANT_SELF = "self"

# generate() options the engine does not implement, and what to do instead
_UNSUPPORTED = {
    "num_beams": (lambda v: v is not None and v > 1, "beam search is not supported with assistant='self'; drop num_beams"),
    "num_return_sequences": (lambda v: v is not None and v > 1, "num_return_sequences > 1 is not supported with assistant='self'"),
    "output_attentions": (lambda v: bool(v), "output_attentions is not supported with assistant='self'"),
    "output_hidden_states": (lambda v: bool(v), "output_hidden_states is not supported with assistant='self'"),
    "prompt_lookup_num_tokens": (lambda v: v is not None, "prompt lookup is built into assistant='self' (DecodeConfig.lookup); drop prompt_lookup_num_tokens"),
    "assistant_early_exit": (lambda v: v is not None, "assistant_early_exit and assistant='self' are two different drafters; pick one"),
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

    def draft_engine_for(self, draft_model, capacity: int) -> Engine:
        """The draft model's engine, with at least as many KV slots as the main engine."""
        _check_positions(draft_model, capacity, "the draft model's")
        if self.draft_model is not draft_model or self.draft_engine.capacity < capacity:
            self.draft_engine = None  # free the old cache first
            self.draft_engine = self._new_engine(draft_model, capacity)
            self.draft_model = draft_model
        return self.draft_engine

    def engine_for(self, model, need: int) -> Engine:
        """The model's engine, (re)built with room for `need` KV slots when required."""
        _check_positions(model, need, "the model's")
        if self.engine is None or self.engine.capacity < need:
            self.engine = None  # free the old cache first
            self.engine = self._new_engine(model, need)
        return self.engine

    def _new_engine(self, model, need: int) -> Engine:
        """An engine with `need` KV slots or more: the configured capacity, rounded up to
        256 slots, at most the model's max_position_embeddings."""
        limit = getattr(model.config, "max_position_embeddings", None) or need
        capacity = min(-(-max(self.engine_config.capacity, need) // 256) * 256, limit)
        cfg = EngineConfig(self.engine_config.width, capacity, self.engine_config.row_layout,
                           self.engine_config.prefill)
        return Engine(model, cfg)


def _check_positions(model, need: int, whose: str) -> None:
    limit = getattr(model.config, "max_position_embeddings", None) or need
    if need > limit:
        raise ValueError(
            f"this request needs {need} positions (prompt + max_new_tokens + draft width), "
            f"more than {whose} max_position_embeddings ({limit}); shorten the prompt "
            "or lower max_new_tokens"
        )


_SUBCLASSES: dict[type, type] = {}


def _selfspec_class(base: type) -> type:
    """A subclass of the model's HF class with our generate (one per base class)."""
    if getattr(base, "_is_selfspec_class", False):
        return base
    if base not in _SUBCLASSES:
        # same __name__ so save_pretrained writes the base architecture name
        _SUBCLASSES[base] = type(base.__name__, (base,), {
            "generate": _generate, "_is_selfspec_class": True, "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        })
    return _SUBCLASSES[base]


def attach_heads(model, heads=None, *, decode: DecodeConfig | None = None,
                 engine: EngineConfig | None = None, revision: str | None = None):
    """Give an HF causal LM `generate(..., assistant="self")`, in place; returns `model`.

    heads: a folder, a Hub repo id, loaded `ExitHeads`, None (the heads shipped for the
        embedded default model; an error for any other model), or False (no heads:
        prompt lookup only, for models without trained heads).
    decode: knobs of the speculative loop (DecodeConfig); engine: width / KV capacity.
    """
    from .engine.layered import LayeredModel

    LayeredModel._check_features(model.config, 1)  # unsupported features fail here, early
    if getattr(model.config, "model_type", None) not in ("llama", "mistral", "qwen2", "qwen3"):
        LayeredModel(model, 1)  # raises UnsupportedModelError naming the architecture
    if "generate" in model.__dict__:
        raise ValueError(
            "this model instance has its own generate attribute (loaded with a custom_generate "
            "repo?); load it without custom_generate to attach heads"
        )
    loaded = _load_heads(model, heads, revision)
    if decode is None:
        decode = DecodeConfig(lookup="first" if loaded is not None else "only")
    if engine is None:
        limit = getattr(model.config, "max_position_embeddings", DEFAULT_CAPACITY) or DEFAULT_CAPACITY
        engine = EngineConfig(capacity=min(DEFAULT_CAPACITY, limit))
    # validate the pair once, here, with the real heads
    if loaded is not None and decode.lookup != "only" and decode.thresholds is None \
            and getattr(loaded, "calibration", None) is None:
        raise ValueError("the heads carry no calibration.json: pass decode=DecodeConfig(thresholds=...)")
    model.__class__ = _selfspec_class(type(model))
    model._selfspec = SelfSpecState(loaded, decode, engine)
    model.selfspec_stats = None
    return model


def _load_heads(model, heads, revision):
    """Heads of any kind (config.json says which) from a folder, a Hub id or an object."""
    from .heads import ExitHeads, TopDraftHeads, check_compatible, default_heads_path, load_heads

    if heads is False:
        return None
    if isinstance(heads, (ExitHeads, TopDraftHeads)):
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
    """HF generate(); with assistant="self", exact self-speculative greedy decoding."""
    base_generate = super(type(self), self).generate
    if assistant is None:
        return base_generate(inputs, generation_config, *args, **kwargs)
    if assistant != ASSISTANT_SELF:
        raise ValueError(f"assistant must be 'self' (or left out), got {assistant!r}")
    if args:
        raise ValueError("with assistant='self', pass generate() options as keyword arguments")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("assistant='self' cannot be combined with custom_generate")
    draft_model = kwargs.pop("assistant_model", None)
    if draft_model is not None:
        check_draft_model(self, draft_model)
    streamer = kwargs.pop("streamer", None)
    generation_config, kwargs = _stop_strings_as_criteria(self, generation_config, kwargs)
    state: SelfSpecState = self._selfspec
    with state.lock:  # one engine (one KV cache) per model: serialise concurrent calls
        return base_generate(inputs, generation_config, custom_generate=_decode_loop,
                             selfspec_streamer=streamer, selfspec_draft_model=draft_model, **kwargs)


def _stop_strings_as_criteria(model, generation_config, kwargs):
    """HF drops `tokenizer` for custom decoding loops, so stop strings become an explicit
    StopStringCriteria here (same class HF would build, same stopping token)."""
    import copy

    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
    config = generation_config if generation_config is not None else model.generation_config
    if stop_strings is None and getattr(config, "stop_strings", None):
        stop_strings = config.stop_strings
        generation_config = copy.deepcopy(config)
        generation_config.stop_strings = None
    if stop_strings is None:
        return generation_config, kwargs
    if tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate()")
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria
    return generation_config, kwargs


def _check_request(generation_config, logits_processor) -> bool:
    """Refuse what the loop cannot honour; True when the processors must be applied row by
    row (sampling, or greedy with more than min_new_tokens / min_length)."""
    gc = generation_config
    for name, (bad, message) in _UNSUPPORTED.items():
        if bad(getattr(gc, name, None)):
            raise ValueError(message)
    unsupported = unsupported_processors(logits_processor)
    if unsupported:
        raise NotImplementedError(
            f"these logits processors are not supported with assistant='self': {unsupported} "
            "(supported: processors that depend only on the tokens so far and the scores, "
            f"{sorted(ROW_PROCESSORS)}). Remove the options or processors that create them, "
            "or drop assistant='self'"
        )
    return bool(gc.do_sample) or any(type(p).__name__ not in MIN_LENGTH_PROCESSORS for p in logits_processor)


def _eos_ids(generation_config) -> list[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return [int(e) for e in eos.reshape(-1).tolist()]
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


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
                        "attention_mask must be ones after left padding (no right padding or holes) "
                        "with assistant='self'; pad on the left (tokenizer.padding_side='left')"
                    )
                ids = ids[first:]
            else:
                ids = ids[:0]
        rows.append(ids.tolist())
    return rows


def _decode_loop(model, input_ids, logits_processor=None, stopping_criteria=None,
                 generation_config=None, selfspec_streamer=None, selfspec_draft_model=None,
                 **model_kwargs):
    """The custom_generate callable HF's generate() calls with the prepared request."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    gc = generation_config
    logits_processor = logits_processor if logits_processor is not None else []
    row_processing = _check_request(gc, logits_processor)
    state: SelfSpecState = model._selfspec
    prompt_len = input_ids.shape[1]
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length - prompt_len
    min_new = gc.min_new_tokens or max(0, (gc.min_length or 0) - prompt_len)
    eos = _eos_ids(gc)
    streamer = selfspec_streamer
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("streamers support batch size 1 only (as in HF generate)")
    prompts = _row_prompts(input_ids, model_kwargs.get("attention_mask"))
    for p in prompts:
        if not p:
            raise ValueError("a row of input_ids is empty (all padding): give every row at least one token")
    engine = state.engine_for(model, max(len(p) for p in prompts) + max_new + state.engine_config.width)
    for p in prompts:
        engine.check_capacity(len(p), max_new)
    draft_engine = None
    if selfspec_draft_model is not None:
        draft_engine = state.draft_engine_for(selfspec_draft_model, engine.capacity)
    decoder = SelfSpecDecoder(engine, state.heads, state.decode_config, draft_engine)
    want_logits = bool(gc.output_logits or gc.output_scores) and gc.return_dict_in_generate
    if want_logits and input_ids.shape[0] > 1:
        raise ValueError("output_scores/output_logits with assistant='self' support batch size 1 only")

    results: list[DecodeResult] = []
    if streamer is not None:
        streamer.put(input_ids.cpu())
    for b, p in enumerate(prompts):
        padded = input_ids[b].tolist()

        def stop(out, padded=padded):
            if stopping_criteria is None or not len(stopping_criteria):
                return False
            seq = torch.tensor([padded + out], device=input_ids.device)
            return bool(stopping_criteria(seq, None)[0])

        on_commit = None
        if streamer is not None:
            def on_commit(chunk):
                if chunk:
                    streamer.put(torch.tensor(chunk))
        live = DecodeStats()
        model.selfspec_stats = live  # filled as tokens commit: a streamer may read .sources
        # HF scores a row with the whole padded row as input_ids: so does the scorer
        scorer = (RowScorer(logits_processor, padded, engine.view.vocab_size, engine.view.device)
                  if row_processing else None)
        results.append(decoder.generate(p, max_new, eos, stop=stop, on_commit=on_commit,
                                        min_new_tokens=min_new, collect_logits=want_logits,
                                        stats=live, scorer=scorer, do_sample=bool(gc.do_sample)))
    if streamer is not None:
        streamer.end()

    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    longest = max(len(r.tokens) for r in results)
    new = torch.full((len(results), longest), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for b, r in enumerate(results):
        new[b, : len(r.tokens)] = torch.tensor(r.tokens, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, new], dim=1)
    model.selfspec_stats = results[0].stats if len(results) == 1 else _merge_stats(results)
    if not gc.return_dict_in_generate:
        return sequences
    logits = tuple(row[None] for row in results[0].logits) if want_logits else None
    scores = tuple(row[None] for row in results[0].scores) if want_logits else None
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=scores if gc.output_scores else None,
        logits=logits if gc.output_logits else None,
    )


def _merge_stats(results: list[DecodeResult]) -> DecodeStats:
    merged = DecodeStats(exits_per_head=[0] * len(results[0].stats.exits_per_head))
    for r in results:
        s = r.stats
        merged.prompt_tokens += s.prompt_tokens
        merged.new_tokens += s.new_tokens
        merged.cycles += s.cycles
        merged.drafted += s.drafted
        merged.accepted += s.accepted
        merged.head_evaluations += s.head_evaluations
        merged.exits_per_head = [a + b for a, b in zip(merged.exits_per_head, s.exits_per_head)]
        merged.sources += s.sources
        merged.prefill_time += s.prefill_time
        merged.draft_time += s.draft_time
        merged.verify_time += s.verify_time
        merged.total_time += s.total_time
        merged.lossy = merged.lossy or s.lossy
    return merged
