"""The glm family (hf_selfspec/engine/families/glm.py: Llama's layers, RoPE turning adjacent pairs): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
from arch_helpers import (
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    check_hf_greedy,
    hf_greedy,
    prompts,
    self_greedy,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.core import EngineConfig

CASES = {
    # RoPE turning adjacent pairs: GLM on half of each head (partial_rotary_factor 0.5), its
    # gate/up fused, q/k/v biases; ERNIE 4.5 on all of it, a bias on every projection
    "glm-rope-pairs": dict(arch="Glm", head_dim=16, attention_bias=True),
    "ernie4_5-rope-pairs": dict(arch="Ernie4_5", head_dim=16, use_bias=True),
    # GLM-4: norms on both sides of each block under its own names, RoPE pairs on half of
    # each head, gate/up fused
    "glm4-sandwich": dict(arch="Glm4", head_dim=16, random_norms=True),
    # Helium: RoPE pairs, norms scaling in float32
    "helium-biases": dict(arch="Helium", head_dim=16, attention_bias=True, mlp_bias=True, random_norms=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("layout", ["kernel", "fixed"])
@pytest.mark.parametrize("arch", ["Glm", "Ernie4_5", "Glm4", "Helium"])
def test_rope_pairs_in_both_layer_paths(arch, layout):
    """The C++ layers (kernel; no biases, which would send them to the PyTorch layers) and
    the PyTorch ones (fixed) turn the same pairs: HF's greedy tokens alone and batched."""
    model = build(arch, head_dim=16, attention_bias=False, use_bias=False)
    rows = prompts(11, 30)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False, engine=EngineConfig(row_layout=layout))
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows) == expected
    engine = model._selfspec.engine
    assert engine.view.rope_pairs and (engine._fused_weights is not None) == (layout == "kernel")
