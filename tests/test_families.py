"""What the families share: sliding windows, the refusal of unsupported types, what only the
CPU programs serve, attention sinks, the hybrids' convolutions and recurrent states along a
draft tree, and the registry itself (hf_selfspec/engine/families): every model type in one
family, each family with its test file."""

from __future__ import annotations

import pytest
import torch
from arch_helpers import (
    NEW,
    _greedy_and_logits_in_one_attention,
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    gemma3_image_text,
    hf_greedy,
    prompts,
    self_greedy,
    supported,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.core import EngineConfig
from hf_selfspec.engine.layered import UnsupportedModelError, cpu_only, text_config, text_decoder


@pytest.mark.parametrize("layout", ["auto", "fixed"])
@pytest.mark.parametrize("arch,overrides", [
    ("Qwen2", dict(max_window_layers=1)),  # slides from layer max_window_layers on (layer 1)
    ("SmolLM3", dict(num_hidden_layers=4)),  # slides in its layers without RoPE (layer 3)
    ("Phi3", {}),  # slides in every layer (Phi-3-mini-4k: a window of 2047 in 4096 positions)
    ("Mistral", {}),  # every layer, from the config alone (no per-module window)
    ("Gemma3Text", dict(model_class="Gemma3ForCausalLM", head_dim=16, tie_word_embeddings=False,
                        layer_types=["sliding_attention", "full_attention"])),
    ("Ministral", dict(head_dim=16, layer_types=["sliding_attention", "full_attention"])),
    # every module holds the window; only its sliding layers apply it (is_sliding)
    ("Exaone4", dict(layer_types=["full_attention", "sliding_attention"])),
    # its "local" layers slide (window_size; a sliding_window set on its config would make
    # HF's cache drop keys of every layer)
    ("GPTNeo", dict(attention_types=[[["global", "local"], 1]], window_size=16, sliding_window=None)),
], ids=["qwen2", "smollm3", "phi3", "mistral", "gemma3", "ministral", "exaone4", "gpt_neo"])
def test_a_sliding_window_applies_past_it(arch, overrides, layout):
    """A window shorter than the context, in some layers or all: every request is HF's greedy
    output, alone and as a left-padded batch, within the window and past it (the rows then
    see only their last `window` keys: the C++ attention skips the key chunks before them,
    here past 512 keys; HF's prefill keeps window - 1 keys of a sliding layer)."""
    model = build(arch, **{"use_sliding_window": True, "sliding_window": 16, "max_position_embeddings": 1024,
                           **overrides})
    rows = prompts(5, 11, 40, 600)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False, engine=EngineConfig(row_layout=layout))
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows[:3]) == expected[:3]
    assert any(model._selfspec.engine.view.layer_window)


@pytest.mark.parametrize("arch,overrides,name", [pytest.param(*case, id=case[2]) for case in [
    # differential attention: two softmaxes per head, their difference normed
    ("DiffLlama", dict(), "diffllama"),
]])
def test_unsupported_architecture_refused_and_untouched(arch, overrides, name):
    model = build(arch, **overrides)
    prompt = prompts(9)[0]
    expected = hf_greedy(model, prompt)
    cls = type(model)
    with pytest.raises(UnsupportedModelError, match=f"model_type='{name}'.*plain model.generate"):
        attach_heads(model, heads=False)
    assert type(model) is cls and "_selfspec" not in model.__dict__
    assert hf_greedy(model, prompt) == expected
    with pytest.raises(ValueError, match="attach_heads"):
        hf_greedy(model, prompt, assistant="self")


@pytest.mark.parametrize("case,cuda", [("llama-tied", False), ("olmo2-output-norms", False), ("gemma2", True),
                                       ("gemma3", True), ("olmo3", True), ("glm-rope-pairs", True),
                                       ("ernie4_5-rope-pairs", True), ("phi", True), ("olmoe-clip-qkv", True),
                                       ("hunyuan-qk-norm-after-rope", True), ("gpt2", True), ("lfm2", True),
                                       ("qwen3_5", True), ("granitemoehybrid", True),
                                       ("mamba", True), ("mamba2", True), ("deepseek_v3", True), ("youtu", True),
                                       ("llama4", True)])
def test_what_only_the_cpu_programs_serve(case, cuda):
    """The models attach_heads refuses on CUDA (layered.cpu_only: soft caps, a RoPE per layer
    type, RoPE pairs), decided from the model alone."""
    overrides = dict(supported(case))
    model = build(overrides.pop("arch", "Llama"), **overrides)
    assert cpu_only(text_config(model), text_decoder(model)) is cuda
    image_text = gemma3_image_text()
    assert cpu_only(text_config(image_text), text_decoder(image_text))


SCALED_QUERIES = "original_max_position_embeddings.*llama_4_scaling_beta"


LLAMA4_LIMITS = "attn_temperature_tuning, floor_scale.*attention_chunk_size"


@pytest.mark.parametrize("case,extra,start,why", [
    ("ministral3", {}, 512, SCALED_QUERIES), ("mistral4", {}, 128, SCALED_QUERIES),
    ("llama4", {"floor_scale": 64}, 63, LLAMA4_LIMITS), ("llama4", {"attention_chunk_size": 48}, 48, LLAMA4_LIMITS)])
def test_served_below_the_query_scaling(case, extra, start, why):
    """Ministral 3 and Mistral 4 scale their queries from original_max_position_embeddings
    on; Llama 4 its NoPE layers' queries from floor_scale - 1, and its chunked layers attend
    within chunks: a request ending there is HF's greedy output; one reaching past it is
    refused before any work, naming why."""
    overrides = dict(supported(case), **extra)
    model = build(overrides.pop("arch"), **overrides)
    attach_heads(model, heads=False)
    below = prompts(start - NEW)[0]
    assert self_greedy(model, [below])[0] == hf_greedy(model, below)
    with pytest.raises(ValueError, match=why):
        self_greedy(model, [below + [5]])


@pytest.mark.parametrize("case", ["glm4_moe", "minimax_m2", "lfm2_moe"])
def test_new_routing_biases_rebuild_the_engine(case):
    """A router's e_score_correction_bias (LFM2-MoE's expert_bias) is a buffer: new tensors
    assigned to it (not edited in place) make the engine stale, and the next request is HF's
    greedy output again."""
    overrides = dict(supported(case))
    model = build(overrides.pop("arch"), **overrides)
    attach_heads(model, heads=False)
    prompt = prompts(30)[0]
    assert self_greedy(model, [prompt])[0] == hf_greedy(model, prompt)
    first = model._selfspec.engine
    for module in model.modules():
        for name in ("e_score_correction_bias", "expert_bias"):
            bias = getattr(module, name, None)
            if isinstance(bias, torch.Tensor) and not isinstance(bias, torch.nn.Parameter):
                setattr(module, name, torch.randn(bias.shape, generator=torch.Generator().manual_seed(4)))
    assert self_greedy(model, [prompt])[0] == hf_greedy(model, prompt)
    assert model._selfspec.engine is not first


@pytest.mark.parametrize("layout", ["kernel", "fixed"])
@pytest.mark.parametrize("case", ["gpt_oss", "granite_swa", "granitemoe_swa"])
def test_attention_sinks_in_both_attentions(case, layout):
    """GPT-OSS's and Granite-SWA's attention sinks in the C++ row attention (kernel) and the
    PyTorch block attention (fixed), within and past their windows and a 256-key block: HF's
    greedy tokens alone and (the C++ rows) batched, and its logits to float32 rounding."""
    _greedy_and_logits_in_one_attention(case, layout)


@pytest.mark.parametrize("shape", ["sibling", "deep_gap", "full"])
@pytest.mark.parametrize("case", ["lfm2", "qwen3_5", "qwen3_5-one-tap", "olmo_hybrid", "granitemoehybrid", "nemotron_h",
                                  "falcon_h1", "mamba2", "mamba", "jamba", "deepseek_v3", "deepseek_v2", "qwen3_next"])
def test_convolutions_and_recurrent_states_follow_a_draft_trees_paths(case, shape):
    """A tree row's convolution (LFM2, Qwen 3.5, Granite 4.0-H) and recurrent state (the
    DeltaNet's, Mamba2's) come from its own path's rows (a sibling branch accepted, rows after gaps, a full tree),
    and the accepted rows' convolution inputs and states move with their KV (DeepSeek's
    latent attention: each head's keys and values): the engine's AR output, with the
    accepted path off the first branch."""
    from test_trees import OracleTrees

    from hf_selfspec.engine.core import Engine

    overrides = dict(supported(case))
    model = build(overrides.pop("arch"), **overrides)
    engine = Engine(model, EngineConfig(width=8, capacity=400, row_layout="kernel"))
    for p in prompts(5, 40):
        expected = engine.generate_ar(p, 30)
        result = OracleTrees(engine, expected, shape).generate(p, 30)
        assert result.tokens == expected
        assert result.stats.off_chain_cycles > 0


@pytest.mark.parametrize("case", ["lfm2", "qwen3_5", "granitemoehybrid"])
def test_a_measurement_mid_request_leaves_the_sequences_rings(case):
    """A decoder used directly measures the engine's step costs after its prefill: those
    timing steps write their rows to rings of their own (MixerCache.scratch), so the
    convolution inputs and states of the sequence stay as they were (the engine's AR output)
    and the sequences' rings do not grow by a region for them."""
    from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
    from hf_selfspec.engine.core import Engine

    overrides = dict(supported(case))
    model = build(overrides.pop("arch"), **overrides)
    engine = Engine(model, EngineConfig(width=8, capacity=400, row_layout="kernel"))
    prompt = prompts(40)[0]
    expected = engine.generate_ar(prompt, 24)
    rings = engine.mixer_cache.conv.shape
    assert not engine.costs.has_step_costs
    result = SelfSpecDecoder(engine, None, DecodeConfig(lookup="only")).generate(prompt, 24)
    assert engine.costs.has_step_costs  # measured mid-request
    assert result.tokens == expected
    assert engine.mixer_cache.conv.shape == rings  # the measurement's rings were its own, dropped after


@pytest.mark.parametrize("case,path", [("lfm2", "layers.0.conv.in_proj"), ("lfm3", "layers.1.self_attn.g_proj"),
                                       ("qwen3_5", "layers.0.linear_attn.in_proj_qkv"),
                                       ("olmo_hybrid", "layers.0.linear_attn.g_proj"), ("lfm2", "layers.0.conv.conv"),
                                       ("granitemoehybrid", "layers.0.mamba.in_proj"),
                                       ("granitemoehybrid", "layers.2.mamba.conv1d"),
                                       ("nemotron_h", "layers.4.mixer.in_proj"),
                                       ("nemotron_h", "layers.3.mixer.up_proj"),
                                       ("falcon_h1", "layers.1.mamba.out_proj"),
                                       ("mamba", "layers.1.mixer.x_proj"),
                                       ("jamba", "layers.2.mamba.dt_proj"),
                                       ("deepseek_v3", "layers.1.self_attn.q_a_proj"),
                                       ("deepseek_v3", "layers.0.self_attn.kv_b_proj"),
                                       ("deepseek_v3-yarn-wide-v", "layers.1.self_attn.q_proj"),
                                       ("minicpm3", "layers.2.self_attn.kv_a_proj_with_mqa"),
                                       ("qwen3_next", "layers.0.linear_attn.in_proj_qkvz"),
                                       ("qwen3_next", "layers.2.linear_attn.in_proj_ba"),
                                       ("llama4", "layers.1.feed_forward.shared_expert.up_proj"),
                                       ("afmoe", "layers.0.self_attn.gate_proj"),
                                       ("afmoe", "layers.2.mlp.router.gate")])
def test_a_hybrids_wrapped_projection_is_refused_by_name(case, path):
    """A projection of a convolution / DeltaNet layer, or LFM3's head gate, that is not the
    plain torch module (a quantized or LoRA wrapper stands in for it here) is refused at
    attach_heads, naming it, and the model is left as it was."""
    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.weight = inner, inner.weight

        def forward(self, x):
            return self.inner(x)

    overrides = dict(supported(case))
    model = build(overrides.pop("arch"), **overrides)
    parent_path, name = path.rsplit(".", 1)
    parent = text_decoder(model).get_submodule(parent_path)
    setattr(parent, name, Wrapped(getattr(parent, name)))
    with pytest.raises(UnsupportedModelError, match=f"{path}.*plain model.generate"):
        attach_heads(model, heads=False)
    assert "_selfspec" not in model.__dict__


def test_every_model_type_in_one_family_and_each_family_tested():
    """The registry lists each supported type once, in the family module that covers it, and
    each family module has its test file (tests/test_family_<name>.py)."""
    from pathlib import Path

    from hf_selfspec.engine import families

    listed = [t for family in families.FAMILIES.values() for t in family.model_types]
    assert len(listed) == len(set(listed)) and tuple(listed) == families.SUPPORTED_MODEL_TYPES
    assert all(families.spec_of(t).family == name for name, family in families.FAMILIES.items()
               for t in family.model_types)
    here = Path(__file__).parent
    assert all((here / f"test_family_{name}.py").exists() for name in families.FAMILIES)
    assert families.spec_of("not_a_model_type").moe is None  # an unknown type: Llama's defaults
