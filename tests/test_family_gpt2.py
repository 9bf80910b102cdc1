"""The gpt2 family (hf_selfspec/engine/families/gpt2.py: learned absolute positions or ALiBi; LayerNorms,
plain MLPs): its
configurations give HF's greedy tokens (fp32; a left-padded batch row for row) and its
logits, and what the engine cannot run of it is refused up front (tests/arch_helpers.py:
the models and the checks)."""

from __future__ import annotations

import pytest
import torch
from arch_helpers import (
    _greedy_and_logits_in_one_attention,
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
from hf_selfspec.engine.layered import UnsupportedModelError, text_decoder

CASES = {
    # GPT-2 (model.transformer, its layers `h`): Conv1D projections (weights stored [in, out],
    # read transposed in place), learned positions (wpe) and no RoPE, MHA, LayerNorms ln_1 /
    # ln_2 / ln_f, gelu_new; and unscaled attention with a ReLU MLP and an untied LM head
    "gpt2": dict(arch="GPT2", model_class="GPT2LMHeadModel", random_norms=True),
    "gpt2-unscaled-relu-untied": dict(arch="GPT2", model_class="GPT2LMHeadModel", random_norms=True,
                                      scale_attn_weights=False, activation_function="relu", n_inner=96,
                                      tie_word_embeddings=False, reorder_and_upcast_attn=True),
    # OPT (model.model.decoder): learned positions from row 2 of embed_positions, the layer
    # holding fc1 / fc2 itself, out_proj, ReLU; and without biases or LayerNorm affines, GELU
    "opt": dict(arch="OPT", random_norms=True, ffn_dim=96, enable_bias=True),
    "opt-no-bias-gelu": dict(arch="OPT", random_norms=True, ffn_dim=96, enable_bias=False,
                             layer_norm_elementwise_affine=False, activation_function="gelu",
                             tie_word_embeddings=False),
    # GPT-Neo (transformer.h, attn.attention): learned positions, unscaled attention scores,
    # a window of 16 in its "local" layers (every other)
    "gpt_neo-local": dict(arch="GPTNeo", random_norms=True, attention_types=[[["global", "local"], 1]],
                          window_size=16),
    # GPT-BigCode (StarCoder 1, SantaCoder): one KV head read as row ranges of c_attn, learned
    # positions; and its MHA form (q, k, v rows per head, as GPT-NeoX), unscaled attention
    "gpt_bigcode-mqa": dict(arch="GPTBigCode", random_norms=True, n_inner=96),
    "gpt_bigcode-mha-unscaled": dict(arch="GPTBigCode", random_norms=True, multi_query=False,
                                     scale_attn_weights=False, activation_function="gelu_new"),
    # Bloom: ALiBi (each head's slope times the key's position, no RoPE), its embedding rows
    # normed before the first layer, q/k/v fused per head, BloomGelu
    "bloom": dict(arch="Bloom", random_norms=True, n_head=4),
    # MPT (transformer.blocks, norm_1 / norm_2 without biases, Wqkv rows, ffn): ALiBi slopes
    # over 6 heads (not a power of 2: HF interleaves them), softmax_scale, clip_qkv
    "mpt": dict(arch="Mpt", random_norms=True, num_attention_heads=8,
                attn_config={"softmax_scale": 0.3, "clip_qkv": 2.0}),
    "mpt-6-heads": dict(arch="Mpt", random_norms=True, num_attention_heads=6, hidden_size=96),
}


@pytest.mark.parametrize("case", list(CASES))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    check_hf_greedy(CASES[case])


@pytest.mark.parametrize("case", ["gpt2", "opt", "gpt_neo-local", "gpt_bigcode-mqa", "gpt_bigcode-mha-unscaled",
                                  "bloom", "mpt-6-heads"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    check_logits(CASES[case])


@pytest.mark.parametrize("case", ["gpt2", "opt", "gpt_neo-local", "gpt_bigcode-mqa", "bloom"])
def test_learned_positions_with_either_prefill(case):
    """GPT-2, OPT, GPT-Neo, GPT-BigCode and Bloom (ALiBi) with the engine's own prefill (every
    position's learned row added by the engine; Bloom's slopes over every key) and HF's, a prompt of 200
    tokens and a short one batched: HF's greedy output;
    the position rows the engine reads are a view of the model's own (OPT's from row 2)."""
    overrides = dict(supported(case))
    model = build(overrides.pop("arch"), **overrides)
    rows = prompts(200, 7)
    expected = [hf_greedy(model, p) for p in rows]
    for prefill in ("engine", "hf"):
        attach_heads(model, heads=False, engine=EngineConfig(prefill=prefill))
        assert self_greedy(model, rows) == expected
    view = model._selfspec.engine.view
    if case == "bloom":  # ALiBi, no position rows: HF's own slopes, 2^(-8 h / heads)
        assert view.position_embedding is None
        torch.testing.assert_close(view.alibi_slopes, torch.tensor([0.25, 0.0625, 0.015625, 0.00390625]))
        return
    table = text_decoder(model).embed_positions.weight[2] if case == "opt" else text_decoder(model).wpe.weight[0]
    assert view.position_embedding.data_ptr() == table.data_ptr()


def test_gpt2_weights_are_read_in_place():
    """Every projection the engine reads of GPT-2 is a transposed view of the model's own
    Conv1D storage (none copied into the [out, in] layout)."""
    model = build("GPT2", model_class="GPT2LMHeadModel")
    prompt = prompts(9)[0]
    expected = hf_greedy(model, prompt)
    attach_heads(model, heads=False)
    assert self_greedy(model, [prompt])[0] == expected
    view = model._selfspec.engine.view
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for lw in view.layers:
        for lin in lw.linears:
            assert lin.weight.untyped_storage().data_ptr() in storages and not lin.weight.is_contiguous()


def test_opt_350m_form_refused():
    """OPT-350m norms after its blocks and projects its embeddings: refused by name."""
    for overrides in (dict(do_layer_norm_before=False), dict(word_embed_proj_dim=32)):
        with pytest.raises(UnsupportedModelError, match="OPT-350m.*plain model.generate"):
            attach_heads(build("OPT", ffn_dim=96, **overrides), heads=False)


@pytest.mark.parametrize("case", ["gpt2", "gptj-partial-rotary", "gpt_neo-local", "gpt_bigcode-mqa", "codegen"])
def test_token_type_ids_of_zeros_refused_for_the_gpt2_kin(case):
    """A tokenizer's token_type_ids of plain text (all 0): the GPT-2 kin add each type's
    embedding row (wte[0] here) to every row, which the engine does not: refused by name
    (HF's own generate() refuses them for a Llama-shaped model that does not read them)."""
    overrides = dict(supported(case))
    model = build(overrides.pop("arch"), **overrides)
    ids = torch.tensor(prompts(12))
    attach_heads(model, heads=False)
    with pytest.raises(ValueError, match="token_type_ids is not supported with assistant='self'"):
        model.generate(ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                       do_sample=False, max_new_tokens=4, pad_token_id=0, assistant="self")


def test_gpt2_refusals():
    """What the engine would compute otherwise than HF: token_type_ids (GPT-2 adds each
    type's embedding row, 0 included), attention scaled per layer, a projection that is not
    HF's Conv1D (a LoRA-like wrapper)."""
    model = build("GPT2", model_class="GPT2LMHeadModel")
    attach_heads(model, heads=False)
    ids = torch.tensor(prompts(12))
    with pytest.raises(ValueError, match="token_type_ids is not supported with assistant='self'"):
        model.generate(ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                       do_sample=False, max_new_tokens=4, pad_token_id=0, assistant="self")
    with pytest.raises(UnsupportedModelError, match="scale_attn_by_inverse_layer_idx=True.*plain model.generate"):
        attach_heads(build("GPT2", model_class="GPT2LMHeadModel", scale_attn_by_inverse_layer_idx=True),
                     heads=False)
    model = build("GPT2", model_class="GPT2LMHeadModel")
    conv = model.transformer.h[1].mlp.c_fc
    model.transformer.h[1].mlp.c_fc = torch.nn.Sequential(conv)
    with pytest.raises(UnsupportedModelError, match=r"model.layers.1.mlp.c_fc is a torch.nn.*Sequential.*Conv1D"):
        attach_heads(model, heads=False)


@pytest.mark.parametrize("layout", ["kernel", "fixed"])
def test_bloom_alibi_in_both_attentions(layout):
    """ALiBi in the C++ row attention (kernel) and the PyTorch block attention (fixed), past
    a 256-key block: HF's greedy tokens and its logits to float32 rounding, alone and (the
    C++ rows) batched; Bloom's own options refused."""
    _greedy_and_logits_in_one_attention("bloom", layout)
    for bad in (dict(apply_residual_connection_post_layernorm=True), dict(pretraining_tp=2, slow_but_exact=True)):
        with pytest.raises(UnsupportedModelError, match="Bloom.*plain model.generate"):
            attach_heads(build("Bloom", n_head=4, **bad), heads=False)
