"""Shared fixtures: tiny random-weight HF models built in the test, and the real default."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter when there is no GPU; this
# must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("HF_SELFSPEC_TEST_THREADS", min(2, os.cpu_count() or 1))))


def tiny_model(kind: str = "llama", seed: int = 0, layers: int = 4, kv_heads: int = 2,
               vocab: int = 256, hidden: int = 128, tie: bool = False):
    """A random-weight causal LM small enough for exhaustive tests: kind "llama", "qwen3"
    (q/k norms), "qwen2" (q/k/v biases), "llama_bias" (attention_bias and mlp_bias) or
    "smollm3" (layers 1 and 3 without RoPE), "phi3" (fused q/k/v and gate/up projections),
    "phi3_partial" (the same, RoPE on half of each head's dimensions) or
    "granite" (embedding, attention, residual and logits multipliers, Granite 3's values) or
    "olmo2" (norms on the blocks' outputs, q/k norms over the whole projection; its norm
    weights random: HF initialises them to one), "gemma" (norms scaling by 1 + w, GELU, a
    scaled embedding) or "gemma2" (also norms on both sides of each block, soft caps on the
    attention scores and the logits); Gemma's LM head untied (a tied one repeats the last
    token on a random model) and its norm weights random around 0; "gemma3" (Gemma 3 text:
    per-head q/k norms, a RoPE per layer type) or "olmo3" (OLMo 2's layers, a RoPE per layer
    type); both alternate sliding and full attention layers, with RoPE bases 10 and 10000;
    "lfm2" (LFM2: gated short convolutions in alternate layers, from the first), "qwen3_5"
    (Qwen 3.5: gated DeltaNets in alternate layers, from the first), "granite4h" (Granite
    4.0-H: Mamba2 mixers in alternate layers, from the first; NoPE attention, Granite's
    multipliers, the dense shared MLP), "deepseek_v3" (DeepSeek-V3: latent attention with a
    query LoRA, values narrower than q.k, a dense first layer, then MoE blocks).
    Biases get random values (HF initialises them to zero, which would hide a layout that
    drops them)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GemmaConfig,
        GemmaForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Olmo3Config,
        Olmo3ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                  max_position_embeddings=2048, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))
    elif kind == "smollm3":
        model = SmolLM3ForCausalLM(SmolLM3Config(no_rope_layer_interval=2, **common))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**common))
    elif kind == "phi3_partial":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        model = Phi3ForCausalLM(Phi3Config(rope_parameters=rope, **common))
    elif kind == "granite":
        model = GraniteForCausalLM(GraniteConfig(embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                                 residual_multiplier=0.22, logits_scaling=8.0, **common))
    elif kind == "olmo2":
        model = Olmo2ForCausalLM(Olmo2Config(**common))
        with torch.no_grad():  # a norm the engine put in the wrong place must show
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    elif kind in ("gemma3", "olmo3"):
        types = dict(layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                     + ["full_attention"] * (layers % 2),
                     sliding_window=1024,
                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                      "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
        if kind == "gemma3":
            common.update(head_dim=hidden // 4, tie_word_embeddings=False)
            model = Gemma3ForCausalLM(Gemma3TextConfig(query_pre_attn_scalar=hidden // 4, **types, **common))
        else:
            model = Olmo3ForCausalLM(Olmo3Config(**types, **common))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5) if kind == "gemma3" else p.uniform_(0.5, 1.5)
    elif kind in ("gemma", "gemma2"):
        common.update(head_dim=hidden // 4, tie_word_embeddings=False)
        if kind == "gemma":
            model = GemmaForCausalLM(GemmaConfig(**common))
        else:
            model = Gemma2ForCausalLM(Gemma2Config(query_pre_attn_scalar=hidden // 4 + 8, attn_logit_softcapping=2.0,
                                                   final_logit_softcapping=10.0, **common))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
    elif kind == "llama_bias":
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **common))
    elif kind == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        types = ["conv", "full_attention"] * (layers // 2) + ["conv"] * (layers % 2)
        model = Lfm2ForCausalLM(Lfm2Config(layer_types=types, block_auto_adjust_ff_dim=False, **common))
        with torch.no_grad():  # HF's std 0.02 would hide the convolution taps
            for name, p in model.named_parameters():
                if name.endswith("conv.conv.weight"):
                    p.normal_(0.0, p.shape[-1] ** -0.5)
    elif kind == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        types = ["linear_attention", "full_attention"] * (layers // 2) + ["linear_attention"] * (layers % 2)
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            layer_types=types, head_dim=hidden // 4, linear_key_head_dim=hidden // 8, linear_value_head_dim=hidden // 4,
            linear_num_key_heads=2, linear_num_value_heads=4, **common))
        with torch.no_grad():  # the convolution taps and the norms (zero-centred) HF leaves small
            for name, p in model.named_parameters():
                if name.endswith("conv1d.weight"):
                    p.normal_(0.0, p.shape[-1] ** -0.5)
                elif "norm" in name:
                    p.uniform_(-0.5, 0.5)
    elif kind == "granite4h":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        types = ["mamba", "attention"] * (layers // 2) + ["mamba"] * (layers % 2)
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            layer_types=types, num_local_experts=0, shared_intermediate_size=2 * hidden, mamba_n_heads=4,
            mamba_n_groups=2, mamba_d_state=16, embedding_multiplier=4.0, residual_multiplier=0.5,
            attention_multiplier=1.0 / (hidden // 4), logits_scaling=2.0, **common))
        with torch.no_grad():  # the convolution taps, the SSM's steps and skips (HF: ones), the norms
            for name, p in model.named_parameters():
                if name.endswith("conv1d.weight"):
                    p.normal_(0.0, p.shape[-1] ** -0.5)
                elif name.endswith(("mamba.dt_bias", "mamba.D")):
                    p.normal_(0.0, 1.0)
                elif "norm" in name:
                    p.uniform_(0.5, 1.5)
    elif kind == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        common["num_key_value_heads"] = common["num_attention_heads"]  # every head its own keys
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_nope_head_dim=hidden // 8,
            qk_rope_head_dim=hidden // 16, v_head_dim=hidden // 8 - 4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden // 2, n_group=2, topk_group=1, first_k_dense_replace=1, **common))
        with torch.no_grad():  # decisive routers and correction biases; the latents' norms random
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 4.0 * p.shape[-1] ** -0.5)
                elif "norm" in name:
                    p.uniform_(0.5, 1.5)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.2)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
    return model.eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """HF's own greedy generate(): the reference everything is compared against."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def default_model():
    from hf_selfspec.defaults import load_default_model_and_tokenizer

    return load_default_model_and_tokenizer()


def perturbed_copy(model, scale: float, seed: int = 0):
    """A copy of `model` with Gaussian noise (std `scale` x each weight's std) on every
    weight: a draft model of the same vocabulary that agrees with `model` part of the time."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * float(p.std()) * scale)
    return draft.eval()


def engine_or_skip(model, config):
    """Engine(model, config), or a skip where this machine cannot run the requested row
    layout row-invariantly: the engine refuses such a layout with a ValueError that says so
    (its start-up self-test failed on this BLAS / CPU; `auto` never picks it). Layouts
    are machine-dependent by design: e.g. MKL's 1-3 row GEMMs (`gemv`) are row-invariant on
    the AMD EPYC CI machine and not on an AVX-512 Xeon. Any other error fails the test."""
    from hf_selfspec.engine.core import Engine

    try:
        return Engine(model, config)
    except ValueError as error:
        refusal = str(error)
        if f"row_layout={config.row_layout!r}" in refusal and (
                "row-invariantly" in refusal or "AVX2 CPU and the compiled kernel" in refusal):
            pytest.skip(f"layout {config.row_layout!r} refused on this machine: {refusal}")
        raise
