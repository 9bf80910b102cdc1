"""Bad input to generate(..., assistant="self"): a clear error before any work, never a
hang, never a silently different result.

Each bad case names the input, the error type and the words of its message, and checks
that no engine was built for it (the checks run before any work). Re-entrant calls raise
instead of deadlocking; an attached model survives copy.deepcopy and pickle. A seeded
property test draws random generate() kwargs (valid and invalid) and checks every call
either equals HF's own output for the same kwargs or raises a clear ValueError /
NotImplementedError.
"""

from __future__ import annotations

import copy
import pickle
import random
import re

import pytest
import torch
from conftest import tiny_model
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from hf_selfspec import DecodeConfig, attach_heads
from hf_selfspec.heads import ExitHeads

GREEDY = dict(do_sample=False, pad_token_id=0)
VOCAB = 256


def prompt(seed=0, length=20, alphabet=12):
    return torch.randint(3, alphabet, (1, length), generator=torch.Generator().manual_seed(seed))


def attached(seed):
    """(stock model, the same weights with exit heads that always draft)."""
    ref = tiny_model("llama", seed=seed, layers=4)
    model = tiny_model("llama", seed=seed, layers=4)
    heads = ExitHeads.create(model, [1, 3], torch.arange(VOCAB), adapter_dims=16)
    attach_heads(model, heads, decode=DecodeConfig(thresholds=0.0, lookup="first"))
    return ref, model


class HalveScores(LogitsProcessor):  # a user's own processor: unknown to the loop
    def __call__(self, input_ids, scores):
        return scores / 2


class Nothing(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


IDS = prompt(1)
BAD_CASES = [
    # (name, generate() arguments, error type, words of the message)
    ("id >= V", dict(input_ids=torch.tensor([[5, 6, VOCAB]])), ValueError, "outside this model's vocabulary"),
    ("negative id", dict(input_ids=torch.tensor([[5, -1, 6]])), ValueError, "outside this model's vocabulary"),
    ("1-D ids", dict(input_ids=torch.tensor([5, 6, 7])), ValueError, "ids[None]"),
    ("no ids", dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "2-D tensor"),
    ("float ids", dict(input_ids=torch.tensor([[5.0, 6.0]])), ValueError, "integer token ids"),
    ("ids without values", dict(input_ids=torch.tensor([[5, 6]], device="meta")), ValueError,
     "input_ids is on the meta device"),
    ("a mask without values", dict(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.ones(1, 2, device="meta")),
     ValueError, "attention_mask is on the meta device"),
    ("eos >= V with min_new_tokens", dict(eos_token_id=VOCAB + 5, min_new_tokens=3), ValueError,
     f"eos_token_id {VOCAB + 5} is outside"),
    ("eos >= V in a list", dict(eos_token_id=[2, VOCAB]), ValueError, "eos_token_id"),
    ("negative eos", dict(eos_token_id=-3), ValueError, "eos_token_id -3"),
    ("pad >= V", dict(pad_token_id=VOCAB + 1), ValueError, "pad_token_id"),
    ("contrastive search", dict(penalty_alpha=0.6, top_k=4), ValueError, "contrastive search"),
    ("DoLa", dict(dola_layers="high"), ValueError, "DoLa"),
    ("beam search", dict(num_beams=2), ValueError, "drop num_beams"),
    ("group beam search", dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), ValueError, "beam search"),
    ("constrained beam search", dict(num_beams=2, force_words_ids=[[7]]), ValueError, "beam search"),
    ("watermarking", dict(watermarking_config={"bias": 2.0, "seeding_scheme": "lefthash"}), ValueError,
     "watermark"),
    ("several greedy sequences (HF's refusal)", dict(num_return_sequences=2), ValueError, "num_return_sequences"),
    ("attentions", dict(output_attentions=True, return_dict_in_generate=True), ValueError, "output_attentions"),
    ("HF prompt lookup, no tokens", dict(prompt_lookup_num_tokens=0), ValueError,
     "prompt_lookup_num_tokens must be an int >= 1"),
    ("HF's heuristic draft schedule", dict(num_assistant_tokens_schedule="heuristic"), ValueError,
     "num_assistant_tokens_schedule"),
    ("HF early exit", dict(assistant_early_exit=2), ValueError, "assistant_early_exit"),
    ("continuous batching", dict(cache_implementation="paged"), ValueError, "paged"),
    ("inputs_embeds", dict(inputs_embeds=torch.zeros(1, 3, 128), input_ids=None), ValueError, "inputs_embeds"),
    ("token healing", dict(token_healing=True), ValueError, "token healing"),
    ("another assistant", dict(assistant="other"), ValueError, "assistant must be 'self'"),
    ("classifier-free guidance", dict(guidance_scale=1.5), NotImplementedError, "ClassifierFreeGuidance"),
    ("own logits processor", dict(logits_processor=LogitsProcessorList([HalveScores()])), NotImplementedError,
     "HalveScores"),
    ("over the positions", dict(max_new_tokens=5000), ValueError, "max_position_embeddings"),
    ("right padding", dict(input_ids=torch.tensor([[5, 6, 0]]), attention_mask=torch.tensor([[1, 1, 0]])),
     ValueError, "left padding"),
    ("an all-padding row",
     dict(input_ids=torch.tensor([[5, 6], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]])),
     ValueError, "empty"),
    ("a streamer with a batch", dict(input_ids=torch.tensor([[5, 6], [7, 8]]), streamer=Nothing()), ValueError,
     "batch size 1"),
    ("stop strings without the tokenizer", dict(stop_strings=["end"]), ValueError, "tokenizer"),
    ("options as positional arguments", dict(args=(None, None)), ValueError, "keyword arguments"),
]


@pytest.fixture(scope="module")
def untouched():
    """An attached model that only ever sees bad requests: no engine may be built."""
    return attached(20)[1]


@pytest.mark.parametrize("name,kwargs,error,words", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_is_a_clear_error_before_any_work(untouched, name, kwargs, error, words):
    kwargs = dict(kwargs)
    args = kwargs.pop("args", ())
    kwargs.setdefault("input_ids", IDS)
    kwargs.setdefault("max_new_tokens", 5)
    kwargs.setdefault("assistant", "self")
    for key, value in GREEDY.items():
        kwargs.setdefault(key, value)
    with pytest.raises(error, match=re.escape(words)):
        untouched.generate(kwargs.pop("input_ids"), *args, **kwargs)
    assert untouched._selfspec.engine is None, "the engine was built for a request that was refused"


def test_a_model_never_attached_says_to_attach():
    with pytest.raises(ValueError, match=r"attach_heads\(model\) first"):
        tiny_model("llama", seed=21).generate(IDS, max_new_tokens=3, assistant="self", **GREEDY)


@pytest.mark.parametrize("kwargs,words", [
    (dict(heads=True), "heads must be a heads folder"),
    (dict(heads=3), "heads must be a heads folder"),
    (dict(heads=False, decode={"lookup": "only"}), "decode must be a DecodeConfig"),
    (dict(heads=False, engine="fast"), "engine must be an EngineConfig"),
])
def test_attach_arguments_of_another_type_are_refused_at_attach(kwargs, words):
    model = tiny_model("llama", seed=24, layers=1, hidden=64)
    with pytest.raises(TypeError, match=re.escape(words)):
        attach_heads(model, **kwargs)
    assert "_selfspec" not in model.__dict__, "the model was attached with the bad argument"


# --------------------------------------------------------------------------- re-entrancy


class ReenterStreamer(BaseStreamer):
    """Calls generate(assistant="self") on the same model from inside the first chunk."""

    def __init__(self, model):
        self.model, self.puts = model, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, assistant="self", **GREEDY)

    def end(self):
        pass


class ReenterCriterion(StoppingCriteria):
    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, scores, **kwargs):
        self.model.generate(input_ids[:, :4], max_new_tokens=2, assistant="self", **GREEDY)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_reentrant_calls_raise_instead_of_deadlocking():
    ref, model = attached(22)
    ids = prompt(2)
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, **GREEDY)
    with pytest.raises(RuntimeError, match="again on the same model"):
        model.generate(ids, max_new_tokens=16, assistant="self", streamer=ReenterStreamer(model), **GREEDY)
    with pytest.raises(RuntimeError, match="again on the same model"):
        model.generate(ids, max_new_tokens=16, assistant="self",
                       stopping_criteria=StoppingCriteriaList([ReenterCriterion(model)]), **GREEDY)
    # the model is free again and exact
    assert torch.equal(model.generate(ids, max_new_tokens=16, assistant="self", **GREEDY), expected)


def test_deepcopy_and_pickle_of_an_attached_model():
    ref, model = attached(23)
    ids = prompt(3)
    expected = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, **GREEDY)
    assert torch.equal(model.generate(ids, max_new_tokens=16, assistant="self", **GREEDY), expected)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone) is type(model) and clone._selfspec.engine is None  # rebuilt on first use
        assert clone._selfspec.lock is not model._selfspec.lock
        assert torch.equal(clone.generate(ids, max_new_tokens=16, assistant="self", **GREEDY), expected)
        with torch.no_grad():  # the copy's weights are its own: the original is unchanged
            clone.lm_head.weight.mul_(-1.0)
        assert not torch.equal(clone.generate(ids, max_new_tokens=16, assistant="self", **GREEDY), expected)
    assert torch.equal(model.generate(ids, max_new_tokens=16, assistant="self", **GREEDY), expected)


# --------------------------------------------------------------------------- property test

# generate() options drawn at random, valid and invalid values alike (GenerationConfig fields)
OPTIONS = {
    "max_new_tokens": [1, 6, 12],
    "min_new_tokens": [None, 4, 9],
    "eos_token_id": [None, 2, [2, 7], 9, VOCAB + 3, -1],
    "pad_token_id": [0, 5, VOCAB + 2],
    "repetition_penalty": [None, 1.3],
    "no_repeat_ngram_size": [None, 2],
    "suppress_tokens": [None, [5, 6]],
    "bad_words_ids": [None, [[7], [8, 9]]],
    "sequence_bias": [None, {(5,): -3.0}],
    "forced_eos_token_id": [None, 2],
    "renormalize_logits": [None, True],
    "num_beams": [None, 2],
    "num_return_sequences": [None, 2],
    "penalty_alpha": [None, 0.6],
    "top_k": [None, 1, 4],
    "dola_layers": [None, "low"],
    "do_sample": [False, True],
    "temperature": [None, 0.7],
    "top_p": [None, 0.9],
    "return_dict_in_generate": [None, True],
    "output_scores": [None, True],
    "max_length": [None, 28],
    "min_length": [None, 26],
    "guidance_scale": [None, 1.5],
    "exponential_decay_length_penalty": [None, (4, 1.5)],
    "use_cache": [None, False],
}
DRAWS = 30


def test_random_generate_kwargs_equal_hf_or_raise_clearly():
    rng = random.Random(1234)
    ref, model = attached(24)
    ids = prompt(4)  # 20 tokens of a 9-token alphabet: copies and heads both draft
    mask = torch.ones_like(ids)
    outcomes = {"equal": 0, "refused": 0}
    for draw in range(DRAWS):
        kwargs = {"max_new_tokens": 8, "pad_token_id": 0}
        for name in rng.sample(sorted(OPTIONS), rng.randint(1, 5)):
            value = rng.choice(OPTIONS[name])
            if value is not None:
                kwargs[name] = value
        if kwargs.get("do_sample"):
            kwargs["top_k"] = 1  # sampling from one token: deterministic, comparable with HF
        try:
            expected, hf_error = ref.generate(ids, attention_mask=mask, **kwargs), None
        except Exception as error:  # noqa: BLE001 -- HF refusing is a valid outcome
            expected, hf_error = None, error
        try:
            got = model.generate(ids, attention_mask=mask, assistant="self", **kwargs)
        except (ValueError, NotImplementedError) as error:
            assert str(error), f"draw {draw} {kwargs}: an error without a message"
            outcomes["refused"] += 1
            continue
        except Exception as error:  # noqa: BLE001
            pytest.fail(f"draw {draw} {kwargs}: a deep {type(error).__name__}: {error}")
        assert hf_error is None, f"draw {draw} {kwargs}: HF refuses ({hf_error!r}) but assistant='self' ran"
        sequences = getattr(got, "sequences", got)
        want = getattr(expected, "sequences", expected)
        assert torch.equal(sequences, want), f"draw {draw} {kwargs}: not HF's output"
        outcomes["equal"] += 1
    # the draws exercise both outcomes (a seed that only refused would test nothing)
    assert min(outcomes.values()) >= DRAWS // 5, outcomes


def test_a_fresh_process_never_attaching_gets_the_attach_first_error():
    """In a new process that imports hf_selfspec and never attaches: assistant='self' as a
    keyword or in a GenerationConfig raises the attach-first error (the check is installed
    when HF's generation module loads, before or after the package's import), and HF's
    module still reads as its own (source, loader)."""
    import subprocess
    import sys

    code = r'''
import sys
import hf_selfspec  # before transformers' generation module is loaded
assert "transformers.generation.utils" not in sys.modules
import inspect
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
import transformers.generation.utils as gu
assert "def generate" in inspect.getsource(gu.GenerationMixin)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).eval()
ids = torch.tensor([[3, 4, 5]])
for kw in (dict(assistant="self"), dict(generation_config=GenerationConfig(assistant="self", max_new_tokens=2))):
    try:
        model.generate(ids, max_new_tokens=2, **kw) if "assistant" in kw else model.generate(ids, **kw)
    except ValueError as e:
        assert "attach_heads(model) first" in str(e), e
    else:
        raise AssertionError(f"no error for {kw}")
print("ok")
'''
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
