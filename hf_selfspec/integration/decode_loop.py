"""The decoding loop HF's generate() calls with the prepared request (`_decode_loop`, the
custom_generate callable): the request checked, the engine built or reused, each row decoded
(a batch sharing engine steps where it can, else row by row: the same tokens), and the
results laid out as HF's own (sequences padded as HF pads them, scores per step, stats)."""

from __future__ import annotations

import time

import torch

from ..decoding.batch import BatchDecoder, SequenceRequest, batch_obstacle
from ..decoding.cycle import DecodeResult, SelfSpecDecoder
from ..decoding.sampling import RowScorer, row_processors
from ..engine import costs
from ..engine.layered import served_positions, text_config
from ..logs import logger
from ..stats import DecodeStats
from .checks import _check_request, _check_text_inputs, _check_token_ids
from .options import SelfSpecCall, _eos_ids, _per_call_config, _token_count
from .placement import _check_engine_prefill, _check_positions, _windowed
from .state import SelfSpecState


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
    engine.costs.step_costs()  # measured once per engine, here rather than mid-decode
    # the attention per row-key: for rows past the measured context, or for any request
    # where it is cheap to measure (then a short one plans with its rows' cheaper attention)
    if need > costs.cost_context(engine) or engine.costs.times_steps_cheaply():
        engine.costs.attention_seconds()
    draft_engine = None
    if selfspec_draft_model is not None:
        draft_engine = state.draft_engine_for(selfspec_draft_model, engine.capacity)
        draft_engine.costs.step_costs()
    decoder = SelfSpecDecoder(engine, state.heads, config, draft_engine)
    # a batch shares engine steps (decoding/batch.py) where the engine and drafter allow it,
    # else its sequences are decoded one after the other: the same tokens either way
    batched = len(prompts) > 1 and draft_engine is None and batch_obstacle(engine, decoder) is None
    measured_batch = batched and not engine.costs.has_batch_costs
    if batched:  # measured once per machine and model (cached on disk): build time, not decoding
        engine.costs.batch_costs()
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
