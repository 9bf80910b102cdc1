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


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    """(stock HF model, the same weights with heads attached from a saved folder)."""
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


def test_default_heads_refused_for_another_model():
    model = tiny_model("llama", seed=2, layers=4)
    with pytest.raises((ValueError, FileNotFoundError)):
        attach_heads(model)


def test_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="gpt2"):
        attach_heads(model, heads=False)


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
    with pytest.raises(ValueError):
        model.generate(ids, max_new_tokens=4, assistant="self")


def test_custom_generate_folder_on_a_stock_model():
    """model.generate(custom_generate=<folder>, trust_remote_code=True) on an untouched
    HF model gives HF greedy's tokens."""
    from pathlib import Path

    folder = str(Path(__file__).resolve().parent.parent)  # the repo root holds custom_generate/
    ref = tiny_model("llama", seed=6, layers=4)
    stock = tiny_model("llama", seed=6, layers=4)
    ids = prompt(11)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    with pytest.warns(UserWarning, match="prompt lookup only"):
        got = stock.generate(ids, custom_generate=folder, trust_remote_code=True, **kw)
    assert torch.equal(got, expected)
