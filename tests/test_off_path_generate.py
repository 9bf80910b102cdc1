"""generate(..., assistant="self") off the happy path: what a transformers user may pass
besides the documented options. Each case either gives HF's own output (same ids, shape,
dtype and return type) or is refused up front with an error that says what to do; a
consumer of the call's streamer never waits forever.

Cases found broken once, each checked here against HF on a tiny random model without heads
(exact prompt lookup in the engine): a batch stopped row by row by stopping criteria with no
EOS (HF decodes a stopped row on), stop strings and prompt lookup set in
`model.generation_config`, int32 / list / int8 input_ids, a prompt holding the pad id with no
attention mask, a TextIteratorStreamer after a refused call, an attention mask of another
shape, a passed cache holding tokens the ids do not repeat, a stopping criterion reading
`scores`. num_return_sequences with sampling, refused once, decodes HF's expanded batch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import (
    DynamicCache,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)

from hf_selfspec import attach_heads

GREEDY = dict(do_sample=False, pad_token_id=0)


def prompt(seed=0, length=20, batch=1, alphabet=12):
    return torch.randint(3, alphabet, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair():
    """(stock HF model, the same weights attached without heads)."""
    ref = tiny_model("llama", seed=1, layers=2, hidden=64)
    model = tiny_model("llama", seed=1, layers=2, hidden=64)
    attach_heads(model, heads=False)
    return ref, model


def both(pair, ids, **kw):
    """(HF's output, ours) for the same call."""
    ref, model = pair
    return ref.generate(ids, **GREEDY, **kw), model.generate(ids, assistant="self", **GREEDY, **kw)


def char_tokenizer():
    """A tokenizer of the tiny models' 256 ids, one character each (stop strings need one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = Tokenizer(models.WordLevel({chr(0x30 + i): i for i in range(256)}, unk_token="0"))
    tokens.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokens.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokens)


class StopAtToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_batch_rows_stopped_without_eos_decode_on_as_in_hf(pair, monkeypatch):
    """HF pads a row its stopping criteria ended only where an EOS criterion exists; with
    no EOS it decodes that row on until every row has stopped."""
    ref = pair[0]
    ids = prompt(3, 12, batch=3)
    free = ref.generate(ids, max_new_tokens=20, **GREEDY)[:, 12:]
    stop = StoppingCriteriaList([StopAtToken(int(free[0, 3]))])  # rows 0 and 2 stop early, row 1 never
    for m in pair:
        monkeypatch.setattr(m.generation_config, "eos_token_id", None)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, stopping_criteria=stop,
              return_dict_in_generate=True, output_logits=True)
    expected, got = both(pair, ids, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.logits) == len(expected.logits) == 20
    for a, b in zip(expected.logits, got.logits):
        assert torch.allclose(a, b, atol=1e-4)
    # with an EOS the stopped rows are padded, as HF pads them
    expected, got = both(pair, ids, eos_token_id=5, **kw)
    assert torch.equal(got.sequences, expected.sequences)


def test_a_text_generation_pipeline_passes_assistant_self(pair):
    """pipeline("text-generation") forwards assistant="self" to generate(): the same text as
    the plain pipeline (greedy), for one prompt and a batch of two."""
    from transformers import pipeline

    ref, model = pair
    tokenizer = char_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = "0", "left"
    plain = pipeline("text-generation", model=ref, tokenizer=tokenizer)
    ours = pipeline("text-generation", model=model, tokenizer=tokenizer)
    for texts in (["123456789:;<=>123456789"], ["123456789:;<=>123456789", "::;;<<==>>"]):
        kw = dict(max_new_tokens=12, do_sample=False, batch_size=len(texts))
        expected = [r[0]["generated_text"] for r in plain(texts, **kw)]
        model.selfspec_stats = None
        assert [r[0]["generated_text"] for r in ours(texts, assistant="self", **kw)] == expected
        assert model.selfspec_stats is not None  # our loop ran


def test_repetition_penalty_on_a_left_padded_batch(pair):
    """HF's repetition penalty holds each batch row's padding length (it does not penalise
    the pad id there); every row is scored alone here, with its own length: HF's batch
    output, and each row HF's output for that prompt alone. Found failing once with HF's
    "Incompatible `prompt_ignore_length` batch size" from deep inside."""
    ref = pair[0]
    ids = prompt(6, 14, batch=3)
    mask = torch.ones_like(ids)
    mask[0, :5], mask[2, :9] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=16, repetition_penalty=1.4)
    expected, got = both(pair, ids, **kw)
    assert torch.equal(got, expected)
    for b in range(3):
        alone = ids[b: b + 1, int((mask[b] == 0).sum()):]
        assert got[b, 14:].tolist() == ref.generate(alone, max_new_tokens=16, repetition_penalty=1.4,
                                                    **GREEDY)[0, alone.shape[1]:].tolist()


class StopRowAtItsToken(StoppingCriteria):
    """Row i stops at its own token tokens[i] (a criterion that indexes the batch's rows)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __call__(self, input_ids, scores, **kwargs):
        return torch.stack([input_ids[i, -1] == t for i, t in enumerate(self.tokens)])


def test_a_criterion_indexing_the_batch_rows_answers_for_each_row(pair):
    """HF's criteria get the batch and answer per row index: a criterion with a stop token per
    row stops each row at its own token, with EOS padding as in HF."""
    ref = pair[0]
    ids = prompt(5, 10, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    free = ref.generate(ids, attention_mask=mask, max_new_tokens=12, **GREEDY)[:, 10:]
    stop = StoppingCriteriaList([StopRowAtItsToken([int(free[0, 4]), int(free[1, 2])])])
    expected, got = both(pair, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=2, stopping_criteria=stop)
    assert expected.shape[1] < 22, "the criterion stopped no row in HF: pick other tokens"
    assert torch.equal(got, expected)


def test_a_forward_hook_on_the_model_is_refused(pair):
    """A hook on one of the model's modules (activation steering) changes HF's every step, but
    only the prompt's pass of ours: refused up front, naming the module. transformers' own
    output-recording hooks (installed by a forward with output_hidden_states) are no hook
    of the user's."""
    ref, model = pair
    ids = prompt(6)
    model(ids, output_hidden_states=True)  # transformers installs its recording hooks
    expected, got = both(pair, ids, max_new_tokens=8)
    assert torch.equal(got, expected)
    engine = model._selfspec.engine
    handle = model.model.layers[0].register_forward_hook(lambda module, args, out: out)
    try:
        with pytest.raises(ValueError, match=r"model\.layers\.0 has a forward hook .*\(handle\.remove\(\)"):
            model.generate(ids, assistant="self", max_new_tokens=8, **GREEDY)
    finally:
        handle.remove()
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: None)
    try:
        with pytest.raises(ValueError, match="lm_head has a forward pre-hook"):
            model.generate(ids, assistant="self", max_new_tokens=8, **GREEDY)
    finally:
        handle.remove()
    assert model._selfspec.engine is engine
    assert torch.equal(model.generate(ids, assistant="self", max_new_tokens=8, **GREEDY), expected)


def test_autocast_is_refused_not_ignored(pair):
    """Under torch.autocast HF computes in bfloat16; the engine would silently compute in the
    model's float32: refused, and autocast turned off again is no refusal."""
    ref, model = pair
    ids = prompt(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"torch.autocast is on for cpu: .*model.to\(torch.bfloat16\)"):
            model.generate(ids, assistant="self", max_new_tokens=4, **GREEDY)
        with torch.autocast("cpu", enabled=False):
            expected, got = both(pair, ids, max_new_tokens=4)
    assert torch.equal(got, expected)


def test_stop_strings_and_prompt_lookup_set_in_model_generation_config(pair, monkeypatch):
    """HF fills what a call leaves unset from model.generation_config: stop strings and
    HF's prompt-lookup knob there work as they do as keywords."""
    ref, model = pair
    ids = prompt(0)
    tokenizer = char_tokenizer()
    free = ref.generate(ids, max_new_tokens=20, **GREEDY)[0, 20:].tolist()
    for m in pair:
        monkeypatch.setattr(m.generation_config, "stop_strings", [tokenizer.decode(free[5:7])])
    expected, got = both(pair, ids, max_new_tokens=20, tokenizer=tokenizer)
    assert torch.equal(got, expected) and got.shape[1] < 40
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids, max_new_tokens=20, assistant="self", **GREEDY)
    for m in pair:
        monkeypatch.setattr(m.generation_config, "stop_strings", None)
        monkeypatch.setattr(m.generation_config, "prompt_lookup_num_tokens", 3)
    expected, got = both(pair, ids, max_new_tokens=20)
    assert torch.equal(got, expected)
    config = GenerationConfig(max_new_tokens=20, **GREEDY)
    assert torch.equal(model.generate(ids, generation_config=config, assistant="self"), expected)


def test_input_ids_hf_takes_give_its_output_others_are_refused(pair):
    model = pair[1]
    ids = prompt(0)
    expected, got = both(pair, ids.int(), max_new_tokens=6)
    assert got.dtype == expected.dtype == torch.long and torch.equal(got, expected)
    for bad, error, words in ((ids.tolist(), TypeError, "torch tensor"), (ids.to(torch.int8), ValueError, "torch.long"),
                              (ids.to(torch.uint8), ValueError, "torch.long")):
        with pytest.raises(error, match=words):
            model.generate(bad, max_new_tokens=6, assistant="self", **GREEDY)
    # the pad id inside a prompt with no attention mask: HF infers a mask with a hole there
    holed = ids.clone()
    holed[0, 5] = GREEDY["pad_token_id"]
    with pytest.raises(ValueError, match="pad_token_id"):
        model.generate(holed, max_new_tokens=6, assistant="self", **GREEDY)
    expected, got = both(pair, holed, attention_mask=torch.ones_like(holed), max_new_tokens=6)
    assert torch.equal(got, expected)


class Raise(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise KeyError("a stopping criterion failed")


def test_a_failed_call_ends_its_streamer(pair):
    """A consumer iterating a TextIteratorStreamer in another thread would wait forever on
    a call that raised before its end()."""
    model = pair[1]
    ids = prompt(0)
    refused = TextIteratorStreamer(None, timeout=5)  # nothing is decoded: no tokenizer needed
    with pytest.raises(ValueError, match="beam search"):
        model.generate(ids, max_new_tokens=6, num_beams=2, streamer=refused, assistant="self", **GREEDY)
    assert "".join(refused) == ""  # without end(): queue.Empty after the timeout
    failed = TextIteratorStreamer(char_tokenizer(), timeout=5)
    with pytest.raises(KeyError):
        model.generate(ids, max_new_tokens=6, stopping_criteria=StoppingCriteriaList([Raise()]),
                       streamer=failed, assistant="self", **GREEDY)
    assert isinstance("".join(failed), str)


def test_num_return_sequences_when_sampling(pair):
    """HF expands the batch before our loop: each prompt's sequences are sampled apart."""
    ref, model = pair
    ids = torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt(1, 15)], dim=1)
    ids = torch.cat([ids, prompt(2)])
    kw = dict(attention_mask=(ids != 0).long(), num_return_sequences=3, max_new_tokens=8, do_sample=True,
              pad_token_id=0)
    expected = ref.generate(ids, top_k=1, **kw)  # sampling from one token: comparable with HF
    got = model.generate(ids, top_k=1, assistant="self", **kw)
    assert got.shape == (6, 28) and torch.equal(got, expected)
    runs = []
    for seed in (1, 1):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, temperature=1.5, assistant="self", **kw))
    assert torch.equal(runs[0], runs[1]) and len({tuple(r) for r in runs[0][:, 20:].tolist()}) > 1


class ReadScores(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return scores[-1].argmax(-1) == 5


def test_what_the_loop_cannot_read_is_refused_clearly(pair):
    """A mask of another shape than the ids, a passed cache holding tokens the ids do not
    repeat (HF decodes on from it), a stopping criterion that reads the scores."""
    ref, model = pair
    ids = prompt(0)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model.generate(ids, attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=4,
                       assistant="self", **GREEDY)

    def cache_of(m, n):  # a DynamicCache holding the first n prompt tokens
        cache = DynamicCache()
        m(ids[:, :n], past_key_values=cache, use_cache=True)
        return cache

    with pytest.raises(ValueError, match="do not repeat"):
        model.generate(ids[:, 10:], past_key_values=cache_of(model, 10), max_new_tokens=4, assistant="self", **GREEDY)
    expected = ref.generate(ids, past_key_values=cache_of(ref, 10), max_new_tokens=4, **GREEDY)
    got = model.generate(ids, past_key_values=cache_of(model, 10), max_new_tokens=4, assistant="self", **GREEDY)
    assert torch.equal(got, expected)  # the whole sequence passed: the cache is a prefix of it
    with pytest.raises(NotImplementedError, match="read `scores`"):
        model.generate(ids, max_new_tokens=4, stopping_criteria=StoppingCriteriaList([ReadScores()]),
                       return_dict_in_generate=True, output_scores=True, assistant="self", **GREEDY)


def test_token_counts_hf_takes_give_its_output(pair):
    """max_new_tokens / max_length as a numpy integer, a one-element tensor or a whole float:
    HF's loop takes them, so do we; a fractional count is refused naming the option."""
    import numpy as np

    ids = prompt(seed=3)
    for kw in (dict(max_new_tokens=np.int64(7)), dict(max_new_tokens=torch.tensor(7)),
               dict(max_new_tokens=7.0), dict(max_length=np.float32(30.0))):
        ref, ours = both(pair, ids, **kw)
        assert torch.equal(ref, ours), kw
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number of tokens, got 7.5"):
        pair[1].generate(ids, assistant="self", max_new_tokens=7.5, **GREEDY)


def test_sampling_with_lossy_acceptance_is_refused_before_the_engine_is_built():
    """lossy_top_k > 1 is a greedy option: a sampled call is refused before any work (no
    engine built), not by the decoding loop after the build."""
    from hf_selfspec import DecodeConfig

    model = tiny_model("llama", seed=2, layers=2, hidden=64)
    attach_heads(model, heads=False, decode=DecodeConfig(lossy_top_k=2))
    with pytest.raises(ValueError, match="lossy_top_k > 1 is a greedy option"):
        model.generate(prompt(seed=1), assistant="self", do_sample=True, max_new_tokens=4, pad_token_id=0)
    assert model._selfspec.engine is None


def test_special_token_ids_as_numpy_or_floats_give_hf_output(pair):
    """eos_token_id / pad_token_id as a numpy integer or array, or a whole float: HF makes a
    tensor of them, so do we."""
    import numpy as np

    ids = prompt(seed=3)
    stop = int(pair[0].generate(ids, max_new_tokens=5, **GREEDY)[0, -1])
    batch = prompt(seed=4, length=12, batch=2)
    mask = torch.ones_like(batch)
    mask[0, :2] = 0
    for inputs, kw in ((ids, dict(eos_token_id=np.int64(stop))), (ids, dict(eos_token_id=np.array([stop, 2]))),
                       (ids, dict(eos_token_id=float(stop))),
                       (batch, dict(attention_mask=mask, eos_token_id=stop, pad_token_id=np.int64(1)))):
        kw = {**GREEDY, "max_new_tokens": 10, **kw}
        expected = pair[0].generate(inputs, **kw)
        assert torch.equal(pair[1].generate(inputs, assistant="self", **kw), expected), kw


def test_heads_follow_a_dtype_change_after_attach():
    """attach_heads with heads, one call, then model.to(bfloat16): the engine is rebuilt and
    the heads bound again to the bf16 weights, so drafting runs (no float32 kernel on bf16
    states) and the output equals the engine's own bf16 AR decoding."""
    from hf_selfspec import DecodeConfig
    from hf_selfspec.heads.repo import fingerprint
    from hf_selfspec.heads.top import TopDraftHeads, TopHeadsConfig

    model = tiny_model("llama", seed=2, layers=2, hidden=64)
    cfg = model.config
    config = TopHeadsConfig(base_model="tiny", base_fingerprint=fingerprint(model),
                            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                            vocab_size=cfg.vocab_size, depth=2, adapter_dim=16, reduced_vocab=cfg.vocab_size)
    heads = TopDraftHeads(config, torch.arange(cfg.vocab_size)).init_from_model(model)
    attach_heads(model, heads, decode=DecodeConfig(lookup="off", thresholds=0.0, adaptive=False,
                                                     draft_confidence=0.0))
    ids = prompt(seed=4, length=24)
    model.generate(ids, assistant="self", max_new_tokens=8, **GREEDY)
    model.to(torch.bfloat16)
    out = model.generate(ids, assistant="self", max_new_tokens=24, **GREEDY)
    assert model.selfspec_stats.drafted > 0
    assert heads.lm_rows.dtype == torch.bfloat16
    reference = model._selfspec.engine.generate_ar(ids[0].tolist(), 24)
    assert out[0, ids.shape[1]:].tolist() == reference
