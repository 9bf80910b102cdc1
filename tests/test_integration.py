"""generate(..., assistant="self") against HF greedy, for every generate() option it
honours, and a clear error for every one it does not."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_selfspec
from hf_selfspec import DecodeConfig, attach_heads, detach_heads
from hf_selfspec.heads import ExitHeads, save_heads

GREEDY = dict(do_sample=False, pad_token_id=0)


def make_heads(model, layers=(1, 3)):
    heads = ExitHeads.create(model, list(layers), torch.arange(model.config.vocab_size), adapter_dims=16)
    return heads


def prompt(seed=0, length=30, alphabet=24):
    return torch.randint(3, alphabet, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama", "qwen3", "granite"])
def pair(request, tmp_path_factory):
    """(stock HF model, the same weights with heads attached from a saved folder; Granite:
    its logits are divided by logits_scaling, which the scores and logits compared here show)."""
    ref = tiny_model(request.param, seed=1, layers=4)
    model = tiny_model(request.param, seed=1, layers=4)
    folder = tmp_path_factory.mktemp("heads")
    save_heads(make_heads(model), folder)
    attach_heads(model, str(folder), decode=DecodeConfig(thresholds=0.0, lookup="first"))
    return ref, model


def both(pair, ids, **kw):
    ref, model = pair
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY, **kw)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **GREEDY, **kw)
    return expected, got


@pytest.mark.parametrize("seed", range(3))
def test_same_tokens_as_hf_greedy(pair, seed):
    expected, got = both(pair, prompt(seed), max_new_tokens=40)
    assert torch.equal(expected, got)
    stats = pair[1].selfspec_stats
    assert stats.new_tokens == 40 and len(stats.sources) == 40
    assert stats.cycles > 0 and stats.drafted >= stats.accepted


def test_without_assistant_the_model_is_plain_hf(pair):
    ref, model = pair
    ids = prompt(5)
    a = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, **GREEDY)
    b = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, **GREEDY)
    assert torch.equal(a, b)
    assert type(model).__name__ == type(ref).__name__ and isinstance(model, type(ref))


def test_eos_int_list_max_length_and_min_new_tokens(pair):
    ref, model = pair
    ids = prompt(2)
    free = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, **GREEDY)[0, 30:].tolist()
    eos = free[6]
    for kw in (dict(eos_token_id=eos), dict(eos_token_id=[10_000 % 256, eos]), dict(max_length=45),
               dict(eos_token_id=eos, min_new_tokens=12), dict(eos_token_id=eos, max_new_tokens=5)):
        kw.setdefault("max_new_tokens", 30) if "max_length" not in kw else None
        expected, got = both(pair, ids, **kw)
        assert torch.equal(expected, got), kw


class Collect(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_exactly_the_new_tokens(pair):
    ref, model = pair
    ids = prompt(3)
    streamer = Collect()
    out = model.generate(ids, max_new_tokens=25, assistant="self", streamer=streamer, **GREEDY)
    assert streamer.puts[0] == ids[0].tolist()
    assert [t for chunk in streamer.puts[1:] for t in chunk] == out[0, ids.shape[1]:].tolist()
    assert streamer.ended


class StopAtToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_stop_where_hf_stops(pair):
    ref, model = pair
    ids = prompt(4)
    free = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, **GREEDY)[0, 30:].tolist()
    for token in free[3:8]:
        crit = StoppingCriteriaList([StopAtToken(token)])
        expected, got = both(pair, ids, max_new_tokens=30, stopping_criteria=crit)
        assert torch.equal(expected, got)


def test_return_dict_with_logits_and_scores(pair):
    ref, model = pair
    ids = prompt(6)
    kw = dict(max_new_tokens=12, return_dict_in_generate=True, output_logits=True, output_scores=True)
    expected, got = both(pair, ids, **kw)
    assert torch.equal(expected.sequences, got.sequences)
    assert len(got.logits) == len(got.scores) == 12
    for a, b in zip(expected.logits, got.logits):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def test_batch_rows_with_left_padding(pair):
    ref, model = pair
    a, b = prompt(7, 20)[0].tolist(), prompt(8, 12)[0].tolist()
    ids = torch.tensor([a, [0] * 8 + b])
    mask = torch.tensor([[1] * 20, [0] * 8 + [1] * 12])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=15, assistant="self", **GREEDY)
    for row, p in zip(out, (a, b)):
        single = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=15, **GREEDY)
        assert row[20:].tolist() == single[0, len(p):].tolist()
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=mask.flip(1), max_new_tokens=5, assistant="self", **GREEDY)


def test_concurrent_calls_are_correct(pair):
    ref, model = pair
    prompts = [prompt(s) for s in range(4)]
    expected = [ref.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=20, **GREEDY) for p in prompts]
    results = [None] * 4

    def run(i):
        results[i] = model.generate(prompts[i], max_new_tokens=20, assistant="self", **GREEDY)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(e, r) for e, r in zip(expected, results))


@pytest.mark.parametrize("kw,error,match", [
    (dict(assistant="other"), ValueError, "assistant must be 'self'"),
    (dict(assistant="self", logits_processor="custom"), NotImplementedError, "HalveScores"),
    (dict(assistant="self", num_beams=2), ValueError, "beam search"),
    (dict(assistant="self", do_sample=True, guidance_scale=1.5), NotImplementedError, "ClassifierFreeGuidance"),
    (dict(assistant="self", max_new_tokens=5000), ValueError, "max_position_embeddings"),
])
def test_unsupported_options_are_clear_errors(pair, kw, error, match):
    from transformers import LogitsProcessor, LogitsProcessorList

    class HalveScores(LogitsProcessor):  # a user's own processor: unknown to the loop
        def __call__(self, input_ids, scores):
            return scores / 2

    ref, model = pair
    kw.setdefault("max_new_tokens", 5)
    if kw.get("logits_processor") == "custom":
        kw["logits_processor"] = LogitsProcessorList([HalveScores()])
    with pytest.raises(error, match=match):
        model.generate(prompt(0), **{**GREEDY, **kw})


def test_heads_of_another_model_are_refused(tmp_path):
    other = tiny_model("llama", seed=2, layers=4)
    save_heads(make_heads(other), tmp_path)
    model = tiny_model("llama", seed=3, layers=4)
    with pytest.raises(ValueError):
        attach_heads(model, str(tmp_path))
    assert not hasattr(model, "_selfspec")


def _any_model(kind, seed):
    return _mistral(None, seed) if kind == "mistral" else tiny_model(kind, seed=seed, layers=4)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "granite", "olmo2", "gemma2",
                                  "olmo3", "lfm2", "qwen3_5", "granite4h", "deepseek_v3"])
def test_no_heads_argument_on_another_model_runs_prompt_lookup_and_warns_once(kind, tmp_path):
    """attach_heads(model) / from_pretrained(path) without heads on a model the shipped heads
    are not for: exact prompt lookup, one warning that says how to get heads."""
    import warnings

    stock = _any_model(kind, 2)
    stock.save_pretrained(tmp_path)
    with pytest.warns(UserWarning) as caught:
        model = hf_selfspec.AutoSelfSpecModelForCausalLM.from_pretrained(tmp_path)
    message = " ".join(str(w.message) for w in caught)
    for words in ("prompt lookup only", "hf-selfspec train-heads", "heads='org/repo'", "heads=False"):
        assert words in message, message
    assert model._selfspec.heads is None and model._selfspec.decode_config.lookup == "only"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second attach of the same model is silent
        attach_heads(_any_model(kind, 2))
        attach_heads(_any_model(kind, 2), heads=False)
    ids = prompt(12)
    expected = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, **GREEDY)
    assert torch.equal(model.generate(ids, max_new_tokens=24, assistant="self", **GREEDY), expected)


def test_unsupported_architecture():
    from transformers import RwkvConfig, RwkvForCausalLM

    model = RwkvForCausalLM(RwkvConfig(num_hidden_layers=2, hidden_size=32, vocab_size=64, attention_hidden_size=32,
                                       intermediate_size=64))  # RWKV: not served
    with pytest.raises(ValueError, match="rwkv") as refused:
        attach_heads(model, heads=False)
    # the cause and what to do lead; the list of supported types comes last
    assert str(refused.value).startswith("RwkvForCausalLM (model_type='rwkv') is not a model type "
                                         "hf_selfspec runs: use plain model.generate()")


def test_auto_class_and_detach(tmp_path):
    stock = tiny_model("qwen3", seed=4, layers=4)
    stock.save_pretrained(tmp_path / "model")
    heads_dir = tmp_path / "heads"
    save_heads(make_heads(stock), heads_dir)
    model = hf_selfspec.AutoSelfSpecModelForCausalLM.from_pretrained(
        tmp_path / "model", heads=str(heads_dir), decode=DecodeConfig(thresholds=0.0))
    assert isinstance(model, type(stock))
    ids = prompt(9)
    expected = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, **GREEDY)
    assert torch.equal(model.generate(ids, max_new_tokens=16, assistant="self", **GREEDY), expected)
    model.save_pretrained(tmp_path / "resaved")  # architectures name unchanged
    import json
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    detach_heads(model)
    with pytest.raises(ValueError, match="attach_heads"):
        model.generate(ids, max_new_tokens=4, assistant="self")


def test_custom_generate_folder_on_a_stock_model(monkeypatch):
    """model.generate(custom_generate=<folder>, trust_remote_code=True) on an untouched
    HF model gives HF greedy's tokens."""
    from pathlib import Path

    from hf_selfspec.integration import attach

    # the no-heads warning comes once per model weights and process: an earlier test of
    # the same tiny model may have had it
    monkeypatch.setattr(attach, "_WARNED_NO_HEADS", set())

    folder = str(Path(__file__).resolve().parent.parent)  # the repo root holds custom_generate/
    ref = tiny_model("llama", seed=6, layers=4)
    stock = tiny_model("llama", seed=6, layers=4)
    ids = prompt(11)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    with pytest.warns(UserWarning, match="prompt lookup only"):
        got = stock.generate(ids, custom_generate=folder, trust_remote_code=True, **kw)
    assert torch.equal(got, expected)


def test_assistant_self_in_a_generation_config(pair, tmp_path):
    """assistant="self" in a GenerationConfig passed to generate(), or in the model's own
    generation_config (which save_pretrained writes), selects self-speculative decoding;
    assistant=False is plain HF generate() there. A model never attached says to attach."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    ref, model = pair
    ids = prompt(13)
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, **GREEDY)
    model.selfspec_stats = None
    config = GenerationConfig(assistant="self", max_new_tokens=20, **GREEDY)
    assert torch.equal(model.generate(ids, generation_config=config), expected)
    assert model.selfspec_stats is not None and model.selfspec_stats.new_tokens == 20

    stock = tiny_model("llama", seed=7, layers=4)
    stock.generation_config.assistant = "self"
    # as a Hub model's own generation_config.json (HF drops custom entries on load only from
    # a config it derived from the model config)
    stock.generation_config._from_model_config = False
    stock.save_pretrained(tmp_path)
    attached = hf_selfspec.AutoSelfSpecModelForCausalLM.from_pretrained(tmp_path, heads=False)
    assert attached.generation_config.assistant == "self"
    expected = tiny_model("llama", seed=7, layers=4).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, **GREEDY)
    assert torch.equal(attached.generate(ids, max_new_tokens=20, **GREEDY), expected)
    assert attached.selfspec_stats.new_tokens == 20
    attached.selfspec_stats = None
    assert torch.equal(attached.generate(ids, max_new_tokens=20, assistant=False, **GREEDY), expected)
    assert attached.selfspec_stats is None  # plain HF: our loop did not run

    never = AutoModelForCausalLM.from_pretrained(tmp_path)  # the saved config says "self"
    with pytest.raises(ValueError, match=r"attach_heads\(model\) first"):
        never.generate(ids, max_new_tokens=4, **GREEDY)
    with pytest.raises(ValueError, match=r"attach_heads\(model\) first"):
        tiny_model("llama", seed=7, layers=4).generate(ids, max_new_tokens=4, assistant="self", **GREEDY)


def _mistral(window, seed=0):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                           sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return MistralForCausalLM(config).eval()


def _serves_past_window(windowed, stock, ids, fits: int, window: int) -> None:
    """`windowed` (attached) equals `stock` (the same weights, plain HF) for `fits` new tokens
    (prompt + fits = window positions) and for 3 * window more: past the window the engine
    on the CPU applies it, as HF does."""
    stock.load_state_dict(windowed.state_dict())
    for new in (fits, fits + 1, fits + 3 * window):
        expected = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **GREEDY)
        assert torch.equal(windowed.generate(ids, max_new_tokens=new, assistant="self", **GREEDY), expected)


def test_a_sliding_window_model_serves_requests_within_and_past_its_window():
    """A window shorter than the context: a request of up to `window` positions is the
    windowed model's own greedy output (its attention is full there), and so is a longer one
    (the engine's CPU attention applies the window). A Qwen2 window in some layers alike; a
    window as long as the context never binds."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    windowed = _mistral(16)
    attach_heads(windowed, heads=False)
    _serves_past_window(windowed, _mistral(16), prompt(14, length=6), fits=10, window=16)

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_window_layers=1,
                         use_sliding_window=True, sliding_window=32)
    torch.manual_seed(3)
    qwen2 = Qwen2ForCausalLM(config).eval()
    attach_heads(qwen2, heads=False)
    _serves_past_window(qwen2, Qwen2ForCausalLM(config).eval(), prompt(15, length=12), fits=20, window=32)
    long_window = _mistral(None)
    long_window.config.sliding_window = 2048  # as long as the context: it never binds
    attach_heads(long_window, heads=False)


def test_a_request_plain_greedy_serves_near_the_end_of_the_positions():
    """max_position_embeddings 48, a 6-token prompt and 40 new tokens: HF serves it, so must
    we (drafting less where a full block of drafts would not fit); one more token than the
    positions is a clear error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(10)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    stock = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(stock.state_dict())
    attach_heads(model, heads=False)
    ids = prompt(3, length=6, alphabet=8)  # few distinct tokens: prompt lookup drafts
    for new in (40, 42):
        expected = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **GREEDY)
        assert torch.equal(model.generate(ids, max_new_tokens=new, assistant="self", **GREEDY), expected)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(ids, max_new_tokens=43, assistant="self", **GREEDY)


def test_first_call_reports_the_engine_build_apart(monkeypatch):
    """The engine build is stats.build_time, not decoding time: tokens/s of the first call
    is the decoding speed. The loop's clock jumps 1000 s inside the build (no sleep, no
    wall-clock bound): the jump must show in build_time and not in total_time."""
    import time
    import types

    from hf_selfspec.integration import SelfSpecState, decode_loop

    build, jump = SelfSpecState._new_engine, {"s": 0.0}
    monkeypatch.setattr(decode_loop, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + jump["s"]))

    def slow_build(self, model, need):
        jump["s"] += 1000.0
        return build(self, model, need)

    monkeypatch.setattr(SelfSpecState, "_new_engine", slow_build)
    model = attach_heads(tiny_model("llama", seed=9, layers=4), heads=False)
    ids = prompt(15)
    model.generate(ids, max_new_tokens=8, assistant="self", **GREEDY)
    first = model.selfspec_stats
    assert first.build_time >= 1000.0 and first.total_time < 1000.0
    assert "engine build" in first.summary() and first.as_dict()["build_time"] >= 1000.0
    model.generate(ids, max_new_tokens=8, assistant="self", **GREEDY)
    assert model.selfspec_stats.build_time == 0.0 and "engine build" not in model.selfspec_stats.summary()


def test_hf_named_drafting_options_per_call():
    """HF's names for the drafting knobs work per call, as keywords or in a GenerationConfig
    (num_assistant_tokens caps the drafts of a cycle, prompt_lookup_num_tokens turns prompt
    lookup on with that cap, max_matching_ngram_size, assistant_confidence_threshold); the
    output stays HF's greedy output; bad values are refused before any work."""
    from transformers import GenerationConfig

    stock = tiny_model("llama", seed=3, layers=4)
    model = tiny_model("llama", seed=3, layers=4)
    attach_heads(model, heads=False, decode=DecodeConfig(lookup="off"))  # no drafter at all
    ids = prompt(5, length=40, alphabet=6)  # repetitive: prompt lookup copies
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=30, **GREEDY)
    expected = stock.generate(ids, **kw)

    def run(**options):
        out = model.generate(ids, assistant="self", **kw, **options)
        assert torch.equal(out, expected), options
        return model.selfspec_stats

    assert run().drafted == 0  # lookup off as attached
    capped = run(prompt_lookup_num_tokens=2, max_matching_ngram_size=2)
    assert capped.drafted > 0 and capped.drafted <= 2 * capped.cycles
    assert run(prompt_lookup_num_tokens=5, num_assistant_tokens=0).drafted == 0
    assert run(prompt_lookup_num_tokens=5, assistant_confidence_threshold=0.9).drafted > 0
    import numpy as np  # counts as HF's own code takes them: numpy integers, whole floats

    numpy_capped = run(prompt_lookup_num_tokens=np.int64(2), max_matching_ngram_size=2.0)
    assert 0 < numpy_capped.drafted <= 2 * numpy_capped.cycles
    config = GenerationConfig(prompt_lookup_num_tokens=3, max_new_tokens=30, **GREEDY)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, assistant="self")
    assert torch.equal(out, expected) and 0 < model.selfspec_stats.drafted <= 3 * model.selfspec_stats.cycles
    assert model._selfspec.decode_config.lookup == "off"  # per call: the attached config is untouched
    for bad, words in [(dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens must be an int >= 1"),
                       (dict(num_assistant_tokens=-1), "num_assistant_tokens must be an int >= 0"),
                       (dict(num_assistant_tokens=2.5), "num_assistant_tokens must be an int >= 0"),
                       (dict(assistant_confidence_threshold=2.0), "assistant_confidence_threshold"),
                       (dict(num_assistant_tokens_schedule="heuristic"), "num_assistant_tokens_schedule")]:
        with pytest.raises(ValueError, match=words):
            model.generate(ids, assistant="self", **kw, **bad)


def test_hf_filled_defaults_are_no_drafting_request():
    """generate() fills the fields a config leaves unset with HF's defaults
    (num_assistant_tokens 20, assistant_confidence_threshold 0.4 in transformers 5) before
    the loop sees the config: those are no request, so the attached DecodeConfig (here the
    heads' thresholds) reaches the decoder unchanged; a value the caller passes still does."""
    from hf_selfspec.integration import SelfSpecCall

    model = tiny_model("llama", seed=3, layers=2)
    merged, _ = model._prepare_generation_config(None)
    call = SelfSpecCall()
    call.take_from(merged)
    assert call.options == {}
    merged, _ = model._prepare_generation_config(None, assistant_confidence_threshold=0.3)
    call = SelfSpecCall()
    call.take_from(merged)
    assert call.options == {"assistant_confidence_threshold": 0.3}


def test_engine_build_and_layout_are_logged_through_transformers_logging():
    """transformers.logging.set_verbosity_info() shows the engine's build and its row
    layout (the package logs under transformers' library logger)."""
    import logging as std_logging

    from transformers.utils import logging

    records = []
    handler = std_logging.Handler()
    handler.emit = records.append
    ours = logging.get_logger("transformers.hf_selfspec")
    ours.addHandler(handler)
    before = logging.get_verbosity()
    logging.set_verbosity_info()
    try:
        model = tiny_model("llama", seed=3, layers=2)
        attach_heads(model, heads=False)
        ids = torch.tensor([[5, 6, 7, 8]])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                       assistant="self", pad_token_id=0)
    finally:
        logging.set_verbosity(before)
        ours.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert any("engine built in" in m for m in messages), messages
    assert any("row layout" in m for m in messages), messages
