"""Shared by the family test files (tests/test_family_*.py, tests/test_families.py): the models
a transformers user brings, built random, and the checks against HF's greedy tokens.

The models are random 2-layer ones with weights at 1/sqrt(fan_in) and q/k projections
doubled, so attention is sharp and a wrong RoPE rotation changes the tokens (HF's default
std 0.02 gives near-uniform attention, where it would not).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.pytorch_utils import Conv1D

from hf_selfspec import attach_heads
from hf_selfspec.engine.core import EngineConfig

NEW = 20  # new tokens per request


@pytest.fixture(autouse=True)
def _measurement_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "selfspec_cache"))


def build(arch: str = "Llama", dtype=torch.float32, **overrides):
    """A random `{arch}ForCausalLM` (Llama, Mistral, Qwen2, Qwen3, ...) from its config class
    (`model_class` names another class, Gemma3ForCausalLM for Gemma3TextConfig)."""
    torch.manual_seed(0)
    model_class = overrides.pop("model_class", f"{arch}ForCausalLM")
    random_norms = overrides.pop("random_norms", False)  # else HF's ones and zeros
    router_scale = overrides.pop("router_scale", 4.0)  # MoE routers' logits: decisive by default
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.update(overrides)
    model = getattr(transformers, model_class)(getattr(transformers, f"{arch}Config")(**config))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, Conv1D)):  # GPT-2's Conv1D: weight [in, out]
                sharp = 2.0 if name.endswith(("q_proj", "k_proj", "c_attn")) else 1.0
                fan_in = module.weight.shape[0 if isinstance(module, Conv1D) else 1]
                module.weight.normal_(0.0, sharp * fan_in**-0.5)
                if module.bias is not None:  # HF initialises biases to zero: that would hide them
                    module.bias.normal_(0.0, 0.5)
        for name, param in model.named_parameters():
            # a norm mistaken for another, a bias dropped
            if random_norms and ("norm" in name or ".ln_" in name or "layer_norm" in name):
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            if name.endswith(("wpe.weight", "embed_positions.weight")):  # positions, as strong as the tokens' rows
                param.normal_(0.0, 1.0)
            if param.dim() == 3 or name.endswith(("mlp.gate.weight", "mlp.router.weight", "gate.wg.weight",
                                                  "feed_forward.gate.weight", "feed_forward.router.weight",
                                              "mixer.gate.weight", "router.gate.weight")):  # routers: decisive
                param.normal_(0.0, (1.0 if param.dim() == 3 else router_scale) * param.shape[-1] ** -0.5)
            if name.endswith(("_proj_bias", "router.bias")):  # GPT-OSS's experts' and router's biases
                param.normal_(0.0, 0.5)
            if name.endswith("sinks"):  # GPT-OSS's attention sinks: as large as the scores
                param.normal_(0.0, 2.0)
            # LFM2's, Qwen 3.5's taps [C, 1, K]: HF's 0.02 hides them
            if name.endswith(("conv.conv.weight", "conv1d.weight")):
                param.normal_(0.0, param.shape[-1] ** -0.5)
            if name.endswith(("conv.conv.bias", "mamba.conv1d.bias")):
                param.normal_(0.0, 0.5)
            if name.endswith(("mamba.dt_bias", "mamba.D")):  # Mamba2's steps and skips: HF's ones hide a dropped one
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            # DeepSeek-V3's, LFM2-MoE's: a bias that decides
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.normal_(0.0, 0.2)
        for name, param in model.named_parameters():
            # ERNIE 4.5's, AFMoE's: parameters
            if name.endswith(("moe_statics.e_score_correction_bias", "mlp.expert_bias")):
                param.normal_(0.0, 0.2)
    return model.to(dtype).eval()


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], **kw) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=NEW, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def self_greedy(model, rows: list[list[int]]) -> list[list[int]]:
    """assistant='self' on the rows as one left-padded batch; each row's new tokens up to
    its first EOS (included)."""
    width = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(rows):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                         pad_token_id=0, assistant="self")
    new = [row[width:].tolist() for row in out]
    return [r[:r.index(2) + 1] if 2 in r else r for r in new]


def rope(kind: str, **params) -> dict:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **params}}


def longrope() -> dict:
    """A longrope configuration, a new dict each time (a config class may edit the one it gets)."""
    return dict(max_position_embeddings=512, **rope(
        "longrope", original_max_position_embeddings=128,
        short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.3 * i for i in range(8)]))


def gemma3_image_text():
    """A random Gemma3ForConditionalGeneration (what AutoModelForCausalLM loads for Gemma 3 4B
    and up): a vision tower beside Gemma 3 text layers with a window of 32 in one layer."""
    torch.manual_seed(0)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512,
                sliding_window=32, layer_types=["sliding_attention", "full_attention"], bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, (2.0 if name.endswith(("q_proj", "k_proj")) else 1.0)
                                      * module.in_features**-0.5)
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + w: zeros would hide a dropped 1
                param.normal_(0.0, 0.3)
    return model.eval()


def _greedy_and_logits_in_one_attention(case: str, layout: str) -> None:
    """supported(case) with the attention of `layout` (kernel: the C++ rows; fixed: the
    PyTorch blocks), prompts of 300 and 11 tokens: HF's greedy tokens alone and (the C++ rows)
    batched, and the 300-token prompt's logits to float32 rounding."""
    overrides = dict(supported(case))
    model = build(overrides.pop("arch"), **overrides)
    rows = prompts(300, 11)
    expected = [hf_greedy(model, p) for p in rows]
    ids = torch.tensor(rows[:1])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    reference = model.generate(ids, **kw)
    attach_heads(model, heads=False, engine=EngineConfig(row_layout=layout))
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    if layout == "kernel":
        assert self_greedy(model, rows) == expected
    got = model.generate(ids, assistant="self", **kw)
    assert torch.equal(got.sequences, reference.sequences)
    # after a 300-token prompt float32 rounding alone moves HF's own logits up to ~1.2e-4 from
    # a float64 forward, the engine's up to ~2e-4 (granitemoe_swa on an AMD EPYC): 3e-4 still
    # fails a sink or slope left out, or a window misplaced, by orders of magnitude
    for a, b in zip(reference.logits, got.logits):
        torch.testing.assert_close(b, a, rtol=3e-4, atol=3e-4)


def supported(case: str) -> dict:
    """The configuration named `case` in a family's test file (its CASES), whichever family."""
    import importlib

    from hf_selfspec.engine.families import FAMILIES

    for name in FAMILIES:
        cases = importlib.import_module(f"test_family_{name}").CASES
        if case in cases:
            return cases[case]
    raise KeyError(case)


def check_hf_greedy(case: dict) -> None:
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    overrides = dict(case)
    model = build(overrides.pop("arch", "Llama"), **overrides)
    rows = prompts(11, 30)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False)
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows) == expected


def check_logits(case: dict) -> None:
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    overrides = dict(case)
    model = build(overrides.pop("arch", "Llama"), **overrides)
    ids = torch.tensor(prompts(30))
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    expected = model.generate(ids, **kw)
    attach_heads(model, heads=False)
    got = model.generate(ids, assistant="self", **kw)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(expected.logits, got.logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
