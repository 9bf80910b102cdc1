"""The layernorm family (hf_selfspec/engine/families/layernorm.py: LayerNorm modules called as HF calls
them; parallel blocks): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
from arch_helpers import (
    _measurement_cache,  # noqa: F401 (an autouse fixture)
    build,
    check_hf_greedy,
    check_logits,
)

from hf_selfspec import attach_heads
from hf_selfspec.engine.layered import UnsupportedModelError

CASES = {
    # LayerNorm models (their layers as PyTorch ops around the engine's products):
    # StableLM's LayerNorms with biases, RoPE on a quarter of each head, one after the other
    # or in parallel from one norm
    "stablelm": dict(arch="StableLm", random_norms=True),
    "stablelm-parallel-biases": dict(arch="StableLm", random_norms=True, use_parallel_residual=True, use_qkv_bias=True),
    # OLMo's parameter-free LayerNorms; q, k and v clamped
    "olmo-clip-qkv": dict(arch="Olmo", random_norms=True, clip_qkv=0.5),
    # Phi: parallel blocks from one norm, a plain gelu_new MLP, half the head rotated, biases
    # everywhere (its LM head's too), `dense` and `final_layernorm`
    "phi": dict(arch="Phi", random_norms=True),
    # StarCoder 2: plain GELU MLP (c_fc / c_proj), biases, a window
    "starcoder2-window": dict(arch="Starcoder2", random_norms=True, sliding_window=16),
    # Cohere: float32 LayerNorms without bias, parallel blocks, RoPE pairs, logits times
    # logit_scale, per-head q/k LayerNorms
    "cohere-qk-norm": dict(arch="Cohere", random_norms=True, use_qk_norm=True, logit_scale=0.5),
    # GPT-NeoX (model.gpt_neox, embed_in): q/k/v fused per head, parallel blocks from two
    # norms, exact GELU, RoPE on a quarter of each head; and its sequential form
    "gpt_neox": dict(arch="GPTNeoX", random_norms=True, attention_bias=True),
    "gpt_neox-sequential": dict(arch="GPTNeoX", random_norms=True, use_parallel_residual=False),
    # GPT-J: parallel blocks from one norm, RoPE pairs on the first rotary_dim dimensions of
    # each head (its rotary module returns sin, cos), fc_in / fc_out, an LM-head bias
    "gptj-partial-rotary": dict(arch="GPTJ", random_norms=True, rotary_dim=8),
    "gptj-full-rotary": dict(arch="GPTJ", random_norms=True, rotary_dim=16),
    # Falcon (FalconLinear projections, RoPE): Falcon-7B's one KV head and parallel blocks from
    # one norm; the new architecture's grouped q/k/v rows (GQA) and two norms (Falcon-40B);
    # an MHA form with sequential blocks and biases
    "falcon-7b-form": dict(arch="Falcon", random_norms=True, multi_query=True, parallel_attn=True),
    "falcon-40b-form": dict(arch="Falcon", random_norms=True, new_decoder_architecture=True, num_kv_heads=2,
                            ffn_hidden_size=96),
    "falcon-mha-sequential": dict(arch="Falcon", random_norms=True, multi_query=False, parallel_attn=False,
                                  bias=True),
    # Nemotron: LayerNorm1P (weight + 1), a plain ReLU² MLP, RoPE on half of each head
    "nemotron": dict(arch="Nemotron", random_norms=True, head_dim=16, attention_bias=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # CodeGen: GPT-J's layers with q/k/v fused in 4 model-parallel shards (query, value, key
    # rows in each)
    "codegen": dict(arch="CodeGen", random_norms=True, rotary_dim=8, num_attention_heads=8, hidden_size=128),
    # Jais 2: Llama's layers with LayerNorms and Nemotron's plain ReLU² MLP, biases everywhere
    "jais2": dict(arch="Jais2", random_norms=True),
    # Cohere 2 (Command R7B): Cohere's parallel blocks and LayerNorms, RoPE pairs in its sliding
    # layers only (the full-attention ones are NoPE), logit_scale
    "cohere2-window": dict(arch="Cohere2", random_norms=True, num_hidden_layers=4, sliding_window=16,
                           logit_scale=0.5, max_position_embeddings=1024),
    # NanoChat: parameter-free RMS norms (the embedding rows normed too), RoPE turning by -angle,
    # q/k norms after it, a ReLU² plain MLP, soft-capped logits
    "nanochat": dict(arch="NanoChat", head_dim=16, final_logit_softcapping=3.0, tie_word_embeddings=False),
    # Cohere 2 MoE: Cohere 2's parallel layers with a dense prefix layer (RoPE forced there) and
    # MoE blocks: the top-k logits' softmax, a shared MLP averaged in; its RMSNorm form, and
    # its LayerNorm form with a sigmoid selection and the shared MLP summed
    "cohere2_moe": dict(arch="Cohere2Moe", num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                        num_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                        prefix_dense_intermediate_size=96, sliding_window=16, rms_norm_eps=1e-5, logit_scale=0.5,
                        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                        max_position_embeddings=1024, random_norms=True, router_scale=1.0),
    "cohere2_moe-layernorm-sigmoid": dict(arch="Cohere2Moe", num_hidden_layers=4, num_experts=8,
                                          num_experts_per_tok=2, num_shared_experts=1,
                                          mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                          prefix_dense_intermediate_size=96, sliding_window=16,
                                          expert_selection_fn="sigmoid", norm_topk_prob=True,
                                          shared_expert_combination_strategy="sum", max_position_embeddings=1024,
                                          random_norms=True, router_scale=1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["phi", "cohere-qk-norm", "gpt_neox", "gptj-partial-rotary", "falcon-40b-form",
                                  "nemotron", "codegen", "cohere2-window", "jais2", "nanochat"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


def test_falcon_alibi_refused():
    """Falcon-RW's ALiBi (attention biased by distance): refused by name."""
    with pytest.raises(UnsupportedModelError, match="alibi=True.*plain model.generate"):
        attach_heads(build("Falcon", alibi=True), heads=False)
