"""The llama family (hf_selfspec/engine/families/llama.py: Llama's layers (RMSNorm, q/k/v/o, gated MLP,
RoPE of halves)): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import torch
import transformers
from arch_helpers import (
    NEW,
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    check_hf_greedy,
    check_logits,
    hf_greedy,
    longrope,
    prompts,
    rope,
    self_greedy,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.core import EngineConfig
from hf_selfspec.engine.layered import UnsupportedModelError

CASES = {
    "llama-tied": dict(tie_word_embeddings=True),
    "llama-biases": dict(attention_bias=True, mlp_bias=True),
    "llama-head_dim": dict(head_dim=24),  # != hidden / heads,
    "llama-mqa-odd-dims": dict(hidden_size=100, num_attention_heads=5, num_key_value_heads=1,
                               intermediate_size=130),  # head_dim 20: kernel tails,
    "llama-mha-swish": dict(num_key_value_heads=4, hidden_act="swish"),
    "llama-linear": rope("linear", factor=4.0),
    "llama-llama3": rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=64),
    "llama-yarn": rope("yarn", factor=4.0, original_max_position_embeddings=128),
    "llama-dynamic": dict(max_position_embeddings=64, **rope("dynamic", factor=4.0)),
    "qwen2": dict(arch="Qwen2"),  # q/k/v biases,
    # use_sliding_window, but max_window_layers leaves every layer full attention
    "qwen3-window-unused": dict(arch="Qwen3", head_dim=20, use_sliding_window=True, sliding_window=8),
    "mistral-no-window": dict(arch="Mistral", sliding_window=None),
    # layers 1 and 3 without RoPE (no_rope_layers): the engine must not rotate their q and k
    "smollm3-nope-layers": dict(arch="SmolLM3", num_hidden_layers=4, no_rope_layer_interval=2),
    # q/k/v and gate/up fused in one weight each: the engine reads their row ranges
    "phi3-fused-projections": dict(arch="Phi3"),
    "phi3-mha-longrope": dict(arch="Phi3", num_key_value_heads=4, **longrope()),
    # RoPE on half of each head's dimensions (Phi-4-mini: 0.75)
    "phi3-partial-rotary": dict(arch="Phi3", **rope("default", partial_rotary_factor=0.5)),
    # norms on the blocks' outputs, q/k norms over the whole projection
    "olmo2-output-norms": dict(arch="Olmo2"),
    "olmo2-mqa": dict(arch="Olmo2", num_key_value_heads=1),
    # OLMo 2's layers with a RoPE per layer type and windows
    "olmo3": dict(arch="Olmo3", sliding_window=256, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # EXAONE 3 and InternLM 3 load as LlamaForCausalLM under their own model_type
    "exaone": dict(arch="Exaone", model_class="LlamaForCausalLM"),
    "internlm3-biases": dict(arch="InternLM3", model_class="LlamaForCausalLM", head_dim=16, attention_bias=True,
                             mlp_bias=True),
    # q/k/v biases and the o projection's under a flag of its own
    "seed_oss-biases": dict(arch="SeedOss", head_dim=16, attention_bias=True, attention_out_bias=True,
                            mlp_bias=True),
    # a window on its sliding layers only (the module's sliding_window is None on the others)
    "ministral": dict(arch="Ministral", head_dim=16, sliding_window=256,
                      layer_types=["sliding_attention", "full_attention"]),
    # OLMo 2's output norms with per-head q/k norms; with a window, its full-attention layers
    # go unrotated ("global NoPE")
    "exaone4-global-nope": dict(arch="Exaone4", sliding_window=256,
                                layer_types=["sliding_attention", "full_attention"]),
    "exaone4-all-full": dict(arch="Exaone4", sliding_window=None, layer_types=["full_attention", "full_attention"]),
    # plain MLPs under Llama's names (up_proj, down_proj): Arcee's ReLU², Apertus's xIELU (an
    # activation with parameters of its own, called as HF's module) and its norms' own names
    "arcee-biases": dict(arch="Arcee", mlp_bias=True, attention_bias=True),
    "apertus": dict(arch="Apertus", head_dim=16, random_norms=True, max_position_embeddings=8192),
    # HunYuan: per-head q/k norms after RoPE (query_ / key_layernorm)
    "hunyuan-qk-norm-after-rope": dict(arch="HunYuanDenseV1", head_dim=16, random_norms=True),
    # IQuest-Coder loads as LlamaForCausalLM under its own model_type
    "iquestcoder": dict(arch="IQuestCoder", model_class="LlamaForCausalLM", head_dim=16),
    # CWM: Llama's layers with Qwen2's per-layer windows (every 4th layer full) and llama3 RoPE
    "cwm-window": dict(arch="Cwm", head_dim=16, num_hidden_layers=4, sliding_window=16,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    # Ministral 3: Mistral's layers, yarn RoPE, queries scaled from original_max_position_embeddings
    # on (the engine serves the positions below it, where the scale is 1)
    "ministral3": dict(arch="Ministral3", head_dim=16, max_position_embeddings=2048,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 512, "llama_4_scaling_beta": 0.1}),
    # Apertus 1.5's text model: Apertus's layers, its LM head pruned to the first output_vocab_size
    # ids (the embedding keeps the whole vocabulary); and unpruned
    "apertus1p5-pruned-head": dict(arch="Apertus1p5Text", head_dim=16, random_norms=True,
                                   max_position_embeddings=8192, output_vocab_size=200, tie_word_embeddings=False),
    "apertus1p5": dict(arch="Apertus1p5Text", head_dim=16, random_norms=True, max_position_embeddings=8192),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["olmo2-output-norms"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_odd_dims_give_the_engines_ar_tokens(dtype):
    model = build(hidden_size=100, num_attention_heads=5, num_key_value_heads=1,
                  intermediate_size=130, dtype=dtype)
    attach_heads(model, heads=False)
    rows = prompts(11, 30)
    got = self_greedy(model, rows)
    engine = model._selfspec.engine
    assert got == [engine.generate_ar(p, NEW, eos_token_ids=[2]) for p in rows]


LONGROPE = longrope()


@pytest.mark.parametrize("length", [20, 115, 140])  # short, crossing 128 while decoding, long
def test_longrope_short_and_long_factors_as_hf(length):
    """HF's longrope takes its long factors for a whole forward longer than
    original_max_position_embeddings (128): short factors below position 128, long from there
    (the engine once took the long ones everywhere: its table had 512 positions)."""
    model = build(**LONGROPE)
    prompt = prompts(length)[0]
    expected = hf_greedy(model, prompt)
    attach_heads(model, heads=False)
    assert self_greedy(model, [prompt]) == [expected]


def test_longrope_long_prompt_refused_with_engine_prefill():
    model = build(**LONGROPE)
    attach_heads(model, heads=False, engine=EngineConfig(prefill="engine"))
    assert self_greedy(model, prompts(40)) == [hf_greedy(model, prompts(40)[0])]
    with pytest.raises(ValueError, match="original_max_position_embeddings .128.*prefill='hf'"):
        self_greedy(model, prompts(140))


def test_dynamic_rope_after_a_long_hf_call():
    """An HF call past max_position_embeddings leaves "dynamic" RoPE's frequencies rescaled
    until a shorter call; the engine's tables are those of a request that fits."""
    model = build(max_position_embeddings=64, **rope("dynamic", factor=4.0))
    rows = prompts(11, 20)
    expected = [hf_greedy(model, p) for p in rows]
    hf_greedy(model, prompts(60)[0])  # 80 positions: rescales HF's rotary module
    attach_heads(model, heads=False)
    assert self_greedy(model, rows) == expected  # an engine of 64 positions, built now


@pytest.mark.parametrize("cls", ["LlamaForSequenceClassification", "LlamaModel"])
def test_a_model_without_an_lm_head_is_refused(cls):
    torch.manual_seed(0)
    model = getattr(transformers, cls)(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="not a causal LM.*AutoModelForCausalLM"):
        attach_heads(model, heads=False)


def test_other_activation_refused():
    with pytest.raises(UnsupportedModelError,
                       match="hidden_act='gelu'.*'silu'.*'gelu_pytorch_tanh'.*plain model.generate"):
        attach_heads(build(hidden_act="gelu"), heads=False)


def test_direct_engine_guards_positions_and_longrope_prefill():
    """An Engine used directly: a request past the positions its RoPE table can rotate is
    refused before any work (it was an IndexError), and its own prefill refuses a longrope
    prompt past original_max_position_embeddings (only HF's prefill rotates it as HF does)."""
    from hf_selfspec.engine.core import Engine

    model = build(max_position_embeddings=64)
    engine = Engine(model, EngineConfig(width=4, capacity=128))
    with pytest.raises(ValueError, match="positions this engine can rotate .64"):
        engine.generate_ar(prompts(50)[0], 30)
    model = build(**LONGROPE)
    engine = Engine(model, EngineConfig(width=4, capacity=256, prefill="engine"))
    with pytest.raises(ValueError, match="original_max_position_embeddings .128.*prefill='hf'"):
        engine.generate_ar(prompts(140)[0], 4)
    assert engine.generate_ar(prompts(40)[0], 4)
