"""The checks of a generate(assistant='self') call: what the engine cannot honour (options,
generation modes, logits processors, inputs beside the text, hooks, autocast, dropout, a
passed KV cache, malformed ids) is refused before any work with an error that says what to
drop, never computed into a silently different result."""

from __future__ import annotations

import numbers

import torch

from ..decoding.sampling import MIN_LENGTH_PROCESSORS, ROW_PROCESSORS, unsupported_processors
from ..engine.layered import TOKEN_TYPE_EMBEDDING_TYPES, text_decoder
from .placement import model_device


def _is_set(v) -> bool:
    return v is not None and v is not False


def _above_one(v) -> bool:
    return v is not None and v > 1


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
    rates = [getattr(config, "attention_dropout", None)
             for config in (model.config, getattr(model.config, "text_config", None))]
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
