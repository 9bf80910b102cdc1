"""The persimmon family (hf_selfspec/engine/families/persimmon.py: GPT-NeoX's fused attention with
q/k LayerNorms, sequential blocks, a ReLU² MLP): its configurations give HF's greedy tokens
(fp32; a left-padded batch row for row) and its logits, its prompt's rows through the
engine's own prefill too, and in bf16 the engine's own greedy tokens (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import torch
from arch_helpers import (
    NEW,
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    check_hf_greedy,
    check_logits,
    hf_greedy,
    prompts,
    self_greedy,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.core import EngineConfig
from hf_selfspec.engine.layered import cpu_only, text_config, text_decoder

CASES = {
    # Persimmon-8B's form: q/k LayerNorms on each head before RoPE, RoPE on half of each head
    # (partial_rotary_factor 0.5, its config's default), biases everywhere; random norms, so a
    # norm mistaken for another or a bias dropped changes the tokens
    "persimmon": dict(arch="Persimmon", random_norms=True),
    # RoPE on the whole head: the q/k norms' output turned in full
    "persimmon-full-rotary": dict(arch="Persimmon", random_norms=True, partial_rotary_factor=1.0),
    # without q/k LayerNorms, RoPE on a quarter of each head (the factor in rope_parameters)
    "persimmon-no-qk-norm": dict(arch="Persimmon", random_norms=True, qk_layernorm=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


def test_logits_are_hfs_to_float32_rounding():
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (ReLU²
    taken for another activation, a LayerNorm's eps)."""
    check_logits(CASES["persimmon"])


def test_engine_prefill_gives_hf_greedy():
    """The prompt's rows through the engine's own programs (fp32 prefills through HF's forward
    by default): its q/k norms and partial RoPE on every prompt row, HF's greedy tokens."""
    overrides = dict(CASES["persimmon"])
    model = build(overrides.pop("arch"), **overrides)
    rows = prompts(11, 30)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False, engine=EngineConfig(prefill="engine"))
    assert [self_greedy(model, [p])[0] for p in rows] == expected


def test_bf16_gives_the_engines_ar_tokens():
    """In bf16 HF's kernels round otherwise: the self-speculative tokens are the engine's own
    greedy (AR) ones, alone and batched."""
    overrides = dict(CASES["persimmon"])
    model = build(overrides.pop("arch"), dtype=torch.bfloat16, **overrides)
    attach_heads(model, heads=False)
    rows = prompts(11, 30)
    got = self_greedy(model, rows)
    engine = model._selfspec.engine
    assert got == [engine.generate_ar(p, NEW, eos_token_ids=[2]) for p in rows]


def test_only_the_cpu_programs_serve_it():
    """Its LayerNorms keep it on the CPU programs (refused on CUDA at attach, layered.cpu_only)."""
    overrides = dict(CASES["persimmon"])
    model = build(overrides.pop("arch"), **overrides)
    assert cpu_only(text_config(model), text_decoder(model))
