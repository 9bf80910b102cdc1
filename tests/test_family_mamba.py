"""The mamba family (hf_selfspec/engine/families/mamba.py: Mamba mixers, alone or between attention layers
(Granite 4.0-H, Nemotron-H, Jamba)): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import torch
from arch_helpers import (
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    check_hf_greedy,
    check_logits,
    hf_greedy,
    prompts,
    self_greedy,
    supported,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.core import EngineConfig
from hf_selfspec.engine.layered import UnsupportedModelError

CASES = {
    # Granite 4.0-H: Mamba2 mixers (a SiLU convolution over 4 positions, a recurrent state per
    # head, B and C per group of heads, a gated RMSNorm per group) in most layers, attention
    # without RoPE, Granite's multipliers, the dense shared MLP; its MoE form with RoPE and
    # biased projections; Granite 4.0's attention-only form (the C++ layers)
    "granitemoehybrid": dict(arch="GraniteMoeHybrid", num_hidden_layers=4, num_local_experts=0,
                             layer_types=["mamba", "attention", "mamba", "mamba"], shared_intermediate_size=96,
                             mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, embedding_multiplier=4.0,
                             residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0, random_norms=True),
    "granitemoehybrid-moe-rope": dict(arch="GraniteMoeHybrid", num_hidden_layers=3, num_local_experts=8,
                                      num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=64,
                                      layer_types=["attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_state=8,
                                      mamba_proj_bias=True, position_embedding_type="rope"),
    "granitemoehybrid-attention-only": dict(arch="GraniteMoeHybrid", num_local_experts=0, shared_intermediate_size=96,
                                            layer_types=["attention", "attention"], position_embedding_type="rope",
                                            embedding_multiplier=4.0, attention_multiplier=0.1, logits_scaling=2.0),
    # Bamba: Granite 4.0-H's Mamba2 mixers between attention layers rotating half of each head,
    # a gated MLP after its own norm (pre_ff_layernorm); with biases everywhere and full RoPE
    "bamba": dict(arch="Bamba", num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_n_groups=2,
                  mamba_d_state=16, random_norms=True),
    "bamba-biases": dict(arch="Bamba", num_hidden_layers=3, attn_layer_indices=[0], mamba_n_heads=8, mamba_d_state=8,
                         mamba_proj_bias=True, mlp_bias=True, attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
    # Nemotron-H: layers of ONE block each after their own norm (weight applied in float32): a
    # Mamba2 mixer, attention without RoPE, or a ReLU² MLP; the embedding named `embeddings`
    "nemotron_h": dict(arch="NemotronH", num_hidden_layers=6, head_dim=16, random_norms=True,
                       layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                                          "mlp"],
                       mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16),
    # Nemotron 3 Nano's form: MoE blocks of ungated ReLU² experts routed as DeepSeek-V3 (sigmoid
    # scores, a correction bias on the choice, groups, renormalised and scaled weights), an
    # ungated shared MLP added; an MLP block too
    "nemotron_h-moe": dict(arch="NemotronH", num_hidden_layers=6, head_dim=16, random_norms=True,
                           layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                                              "moe"],
                           mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, n_routed_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                           n_group=2, topk_group=1, routed_scaling_factor=2.5),
    # Falcon-H1: a Mamba2 mixer and attention side by side in every layer, their outputs summed,
    # muP multipliers on the embedding, both mixers' inputs and outputs, in_proj's columns, k,
    # the MLP's gate and output and the logits; without the mixer's norm (the gate in the
    # model's dtype), and with it, gating after or before it
    "falcon_h1": dict(arch="FalconH1", num_hidden_layers=3, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                      mamba_n_groups=2, mamba_d_state=16, embedding_multiplier=3.0, lm_head_multiplier=0.5,
                      mlp_multipliers=[0.7, 1.3], key_multiplier=0.8, attention_in_multiplier=0.9,
                      attention_out_multiplier=1.1, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6], ssm_in_multiplier=1.2,
                      ssm_out_multiplier=0.9, random_norms=True),
    "falcon_h1-norm-after-gate": dict(arch="FalconH1", num_hidden_layers=2, head_dim=16, mamba_d_ssm=64,
                                      mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_rms_norm=True,
                                      mamba_norm_before_gate=False, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6],
                                      random_norms=True),
    "falcon_h1-norm-before-gate": dict(arch="FalconH1", num_hidden_layers=2, head_dim=16, mamba_d_ssm=64,
                                       mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_rms_norm=True,
                                       mamba_norm_before_gate=True, random_norms=True),
    # Mamba2: no attention at all, a Mamba2 mixer after each layer's norm (the decoder named
    # `backbone`)
    "mamba2": dict(arch="Mamba2", num_hidden_layers=3, num_heads=4, head_dim=32, n_groups=2, state_size=16,
                   random_norms=True),
    # the first Mamba: a state [I, N] per layer decaying per channel and state dimension, dt from
    # a low-rank projection; Falcon Mamba also RMS-norms dt's input, B and C
    "mamba": dict(arch="Mamba", num_hidden_layers=3, state_size=8, random_norms=True),
    "falcon_mamba": dict(arch="FalconMamba", num_hidden_layers=2, state_size=8, random_norms=True),
    # Jamba: the first Mamba's mixers (dt, B and C RMS-normed) between NoPE attention layers,
    # every other layer an MoE block (a softmax over all experts, top-k, not renormalised);
    # and its dense form without conv biases
    "jamba": dict(arch="Jamba", num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8,
                  random_norms=True, router_scale=1.0),
    "jamba-dense": dict(arch="Jamba", num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=2,
                        expert_layer_period=4, expert_layer_offset=3, num_experts=1, mamba_d_state=8, mamba_dt_rank=4,
                        mamba_conv_bias=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["granitemoehybrid", "granitemoehybrid-moe-rope", "bamba", "nemotron_h", "falcon_h1",
                                  "falcon_h1-norm-before-gate", "mamba2", "mamba",
                                  "falcon_mamba", "jamba", "nemotron_h-moe"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


def test_nemotron_h_latent_moe_refused_by_name():
    """Nemotron-H MoE blocks whose experts run in a latent space (moe_latent_size, Nemotron 3
    Super's form): refused at attach_heads with what it is, the model left as it was."""
    overrides = dict(supported("nemotron_h-moe"), moe_latent_size=32)
    model = build(overrides.pop("arch"), **overrides)
    with pytest.raises(UnsupportedModelError, match="layers.1.mixer.fc1_latent_proj.*latent.*plain model.generate"):
        attach_heads(model, heads=False)
    assert "_selfspec" not in model.__dict__


def test_nemotron_h_prompt_time_steps_bounded_as_in_hfs_prefill():
    """Nemotron-H's chunked prefill bounds the Mamba2 time steps below by time_step_min (its
    decode steps do not; HF's dt_bias init puts many below it): the engine's own prefill
    bounds the prompt's rows alike, and gives HF's greedy tokens."""
    overrides = dict(supported("nemotron_h"))
    model = build(overrides.pop("arch"), **overrides)
    with torch.no_grad():  # time steps about e^-8 before the bound: 1e-3 instead of 3e-4 in the prompt
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.dt_bias.fill_(-8.0)
    rows = prompts(5, 40, 120)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False, engine=EngineConfig(prefill="engine"))
    assert [self_greedy(model, [p])[0] for p in rows] == expected
