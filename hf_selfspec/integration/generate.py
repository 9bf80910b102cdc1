"""The attached class's generate(): assistant='self' (a keyword, or set in a GenerationConfig)
checks the call, then runs HF's own generate() with our decoding loop as its custom_generate;
anything else is HF's generate() untouched. Also HF's GenerationConfig merge, where the call's
stop strings and drafting options are taken over, and the hook that makes assistant='self' on
a model never attached fail with ATTACH_FIRST rather than HF's generic error or nothing."""

from __future__ import annotations

import torch

from ..decoding.draft_model import check_draft_model
from ..import_hook import after_import
from .checks import (
    MEDIA_INPUTS,
    _check_autocast,
    _check_dropout,
    _check_input_ids,
    _check_module_hooks,
    _check_passed_cache,
    _check_text_inputs,
)
from .decode_loop import _decode_loop
from .options import HF_DRAFT_OPTIONS, SelfSpecCall
from .state import SelfSpecState

ASSISTANT_SELF = "self"
ATTACH_FIRST = ("assistant='self' needs hf_selfspec.attach_heads(model) first (this model has no "
                "self-speculative decoding attached); or drop assistant='self' for plain generate()")


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
