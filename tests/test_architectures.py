"""The models a transformers user brings: the configuration variants of the supported
architectures give HF's greedy tokens (fp32; a left-padded batch row for row), and what the
engine cannot run is refused by attach_heads / generate() up front, leaving the model as it
was.

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
from hf_selfspec.engine.layered import UnsupportedModelError, cpu_only, text_config, text_decoder

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
            if random_norms and ("norm" in name or ".ln_" in name or "layer_norm" in name):  # a norm mistaken for another, a bias dropped
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
            if name.endswith(("conv.conv.weight", "conv1d.weight")):  # LFM2's, Qwen 3.5's taps [C, 1, K]: HF's 0.02 hides them
                param.normal_(0.0, param.shape[-1] ** -0.5)
            if name.endswith(("conv.conv.bias", "mamba.conv1d.bias")):
                param.normal_(0.0, 0.5)
            if name.endswith(("mamba.dt_bias", "mamba.D")):  # Mamba2's steps and skips: HF's ones hide a dropped one
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # DeepSeek-V3's, LFM2-MoE's: a bias that decides
                buffer.normal_(0.0, 0.2)
        for name, param in model.named_parameters():
            if name.endswith(("moe_statics.e_score_correction_bias", "mlp.expert_bias")):  # ERNIE 4.5's, AFMoE's: parameters
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


SUPPORTED = {
    "llama-tied": dict(tie_word_embeddings=True),
    "llama-biases": dict(attention_bias=True, mlp_bias=True),
    "llama-head_dim": dict(head_dim=24),  # != hidden / heads
    "llama-mqa-odd-dims": dict(hidden_size=100, num_attention_heads=5, num_key_value_heads=1,
                               intermediate_size=130),  # head_dim 20: kernel tails
    "llama-mha-swish": dict(num_key_value_heads=4, hidden_act="swish"),
    "llama-linear": rope("linear", factor=4.0),
    "llama-llama3": rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=64),
    "llama-yarn": rope("yarn", factor=4.0, original_max_position_embeddings=128),
    "llama-dynamic": dict(max_position_embeddings=64, **rope("dynamic", factor=4.0)),
    "qwen2": dict(arch="Qwen2"),  # q/k/v biases
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
    # embedding, attention, residual and logits multipliers (Granite 3's values)
    "granite-multipliers": dict(arch="Granite", embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                residual_multiplier=0.22, logits_scaling=8.0),
    # norms on the blocks' outputs, q/k norms over the whole projection
    "olmo2-output-norms": dict(arch="Olmo2"),
    "olmo2-mqa": dict(arch="Olmo2", num_key_value_heads=1),
    # norms scaling by 1 + w, GELU (tanh), the embedding scaled by sqrt(hidden); untied: a
    # random tied model repeats its last token
    "gemma": dict(arch="Gemma", head_dim=16, tie_word_embeddings=False),
    "gemma-mqa-tied": dict(arch="Gemma", head_dim=16, num_key_value_heads=1),
    # norms on both sides of each block, soft caps on the attention scores and the logits
    # (small here, so that they change the tokens), query_pre_attn_scalar, a window
    "gemma2": dict(arch="Gemma2", head_dim=16, tie_word_embeddings=False, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, query_pre_attn_scalar=24, sliding_window=256),
    # per-head q/k norms scaling by 1 + w, a RoPE per layer type (here far apart: base 10 in
    # the sliding layers, linear scaling in the full ones)
    "gemma3": dict(arch="Gemma3Text", model_class="Gemma3ForCausalLM", head_dim=16, tie_word_embeddings=False,
                   query_pre_attn_scalar=24, sliding_window=256, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
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
    "exaone4-global-nope": dict(arch="Exaone4", sliding_window=256, layer_types=["sliding_attention", "full_attention"]),
    "exaone4-all-full": dict(arch="Exaone4", sliding_window=None, layer_types=["full_attention", "full_attention"]),
    # RoPE turning adjacent pairs: GLM on half of each head (partial_rotary_factor 0.5), its
    # gate/up fused, q/k/v biases; ERNIE 4.5 on all of it, a bias on every projection
    "glm-rope-pairs": dict(arch="Glm", head_dim=16, attention_bias=True),
    "ernie4_5-rope-pairs": dict(arch="Ernie4_5", head_dim=16, use_bias=True),
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
    # sparse MoE blocks (PyTorch layers around the engine's products): Qwen3-MoE with a dense
    # layer among them and renormalised top-k, OLMoE (whole-projection q/k norms, clip_qkv),
    # Mixtral (float32 routing weights, a window)
    "qwen3_moe": dict(arch="Qwen3Moe", head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    "olmoe-clip-qkv": dict(arch="Olmoe", num_experts=8, num_experts_per_tok=3, clip_qkv=0.5),
    "mixtral-window": dict(arch="Mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=16),
    # Qwen2-MoE: a sigmoid-gated shared expert beside the routed ones
    "qwen2_moe-shared": dict(arch="Qwen2Moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48),
    # GLM-4: norms on both sides of each block under its own names, RoPE pairs on half of
    # each head, gate/up fused
    "glm4-sandwich": dict(arch="Glm4", head_dim=16, random_norms=True),
    # plain MLPs under Llama's names (up_proj, down_proj): Arcee's ReLU², Apertus's xIELU (an
    # activation with parameters of its own, called as HF's module) and its norms' own names
    "arcee-biases": dict(arch="Arcee", mlp_bias=True, attention_bias=True),
    "apertus": dict(arch="Apertus", head_dim=16, random_norms=True, max_position_embeddings=8192),
    # Helium: RoPE pairs, norms scaling in float32
    "helium-biases": dict(arch="Helium", head_dim=16, attention_bias=True, mlp_bias=True, random_norms=True),
    # HunYuan: per-head q/k norms after RoPE (query_ / key_layernorm)
    "hunyuan-qk-norm-after-rope": dict(arch="HunYuanDenseV1", head_dim=16, random_norms=True),
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
    # Bloom: ALiBi (each head's slope times the key's position, no RoPE), its embedding rows
    # normed before the first layer, q/k/v fused per head, BloomGelu
    "bloom": dict(arch="Bloom", random_norms=True, n_head=4),
    # MPT (transformer.blocks, norm_1 / norm_2 without biases, Wqkv rows, ffn): ALiBi slopes
    # over 6 heads (not a power of 2: HF interleaves them), softmax_scale, clip_qkv
    "mpt": dict(arch="Mpt", random_norms=True, num_attention_heads=8,
                attn_config={"softmax_scale": 0.3, "clip_qkv": 2.0}),
    "mpt-6-heads": dict(arch="Mpt", random_norms=True, num_attention_heads=6, hidden_size=96),
    # Granite MoE: the softmax of the top-k logits, Granite's four multipliers, block_sparse_moe
    "granitemoe": dict(arch="GraniteMoe", num_local_experts=8, num_experts_per_tok=3, embedding_multiplier=12.0,
                       attention_multiplier=0.0078125, residual_multiplier=0.22, logits_scaling=8.0),
    # VaultGemma: Gemma 2 without the blocks' output norms (soft caps, a window)
    "vaultgemma": dict(arch="VaultGemma", head_dim=16, tie_word_embeddings=False, attn_logit_softcapping=5.0,
                       final_logit_softcapping=3.0, query_pre_attn_scalar=24, sliding_window=256, random_norms=True),
    # IQuest-Coder loads as LlamaForCausalLM under its own model_type
    "iquestcoder": dict(arch="IQuestCoder", model_class="LlamaForCausalLM", head_dim=16),
    # CWM: Llama's layers with Qwen2's per-layer windows (every 4th layer full) and llama3 RoPE
    "cwm-window": dict(arch="Cwm", head_dim=16, num_hidden_layers=4, sliding_window=16,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}),
    # Jais 2: Llama's layers with LayerNorms and Nemotron's plain ReLU² MLP, biases everywhere
    "jais2": dict(arch="Jais2", random_norms=True),
    # HyperCLOVAX: Granite's multipliers, RMSNorms on both blocks' outputs (post_norm1 / 2),
    # logits multiplied by logits_scaling; and without the output norms (nn.Identity)
    "hyperclovax": dict(arch="HyperCLOVAX", random_norms=True, embedding_multiplier=3.0,
                        attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=0.25),
    "hyperclovax-no-post-norm": dict(arch="HyperCLOVAX", use_post_norm=False, logits_scaling=4.0),
    # Ministral 3: Mistral's layers, yarn RoPE, queries scaled from original_max_position_embeddings
    # on (the engine serves the positions below it, where the scale is 1)
    "ministral3": dict(arch="Ministral3", head_dim=16, max_position_embeddings=2048,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 512, "llama_4_scaling_beta": 0.1}),
    # Cohere 2 (Command R7B): Cohere's parallel blocks and LayerNorms, RoPE pairs in its sliding
    # layers only (the full-attention ones are NoPE), logit_scale
    "cohere2-window": dict(arch="Cohere2", random_norms=True, num_hidden_layers=4, sliding_window=16,
                           logit_scale=0.5, max_position_embeddings=1024),
    # GPT-OSS: attention sinks, a window in every other layer, biases on every projection, MoE
    # experts stored [in, out] with biases, gate/up interleaved, a clamped SwiGLU (a limit low
    # enough to clamp), the softmax of the top-k router logits, RoPE's halves from one table
    "gpt_oss": dict(arch="GptOss", head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
                    random_norms=True, max_position_embeddings=1024,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0}),
    # Granite-SWA: Granite's multipliers, attention sinks (HF's sigmoid(lse - sink) scaling), a
    # window in 3 of 4 layers, a RoPE base per layer (two bases, and a layer without RoPE)
    "granite_swa": dict(arch="GraniteSWA", num_hidden_layers=4, sliding_window=16, layer_rope_theta=[10000.0, 10.0, 0, 10.0],
                        embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
                        logits_scaling=2.0, max_position_embeddings=1024),
    # GraniteMoeShared: Granite MoE with the layer's ungated shared MLP (gate/up rows fused)
    "granitemoeshared": dict(arch="GraniteMoeShared", num_local_experts=8, num_experts_per_tok=3,
                             shared_intermediate_size=48, embedding_multiplier=12.0, attention_multiplier=0.0078125,
                             residual_multiplier=0.22, logits_scaling=8.0),
    # Granite-MoE-SWA: GraniteMoeShared's layers with Granite-SWA's attention (sinks, windows, a
    # RoPE base per layer)
    "granitemoe_swa": dict(arch="GraniteMoeSWA", num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
                           shared_intermediate_size=48, sliding_window=16, layer_rope_theta=[10000.0, 0, 10.0, 10.0],
                           max_position_embeddings=1024),
    # DeepSeek-V3's MoE routing (sigmoid scores, a correction bias, the best 2 of 4 expert
    # groups, renormalised and scaled weights, a shared MLP): GLM-4.5 (a dense first layer,
    # per-head q/k norms, RoPE on half of each head, q/k/v biases), dots.llm1 (Qwen3's
    # attention), Solar Open (Llama's attention, every layer MoE)
    "glm4_moe": dict(arch="Glm4Moe", head_dim=16, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                     norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                     random_norms=True),
    "dots1": dict(arch="Dots1", head_dim=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                  n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False,
                  routed_scaling_factor=1.5),
    # Mellum: Qwen3-MoE's layers (a dense one among them), a window and a RoPE per layer type
    "mellum": dict(arch="Mellum", head_dim=16, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, sliding_window=16, max_position_embeddings=1024,
                   layer_types=["sliding_attention", "full_attention"] * 2,
                   mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}),
    # Apertus 1.5's text model: Apertus's layers, its LM head pruned to the first output_vocab_size
    # ids (the embedding keeps the whole vocabulary); and unpruned
    "apertus1p5-pruned-head": dict(arch="Apertus1p5Text", head_dim=16, random_norms=True,
                                   max_position_embeddings=8192, output_vocab_size=200, tie_word_embeddings=False),
    "apertus1p5": dict(arch="Apertus1p5Text", head_dim=16, random_norms=True, max_position_embeddings=8192),
    # NanoChat: parameter-free RMS norms (the embedding rows normed too), RoPE turning by -angle,
    # q/k norms after it, a ReLU² plain MLP, soft-capped logits
    "nanochat": dict(arch="NanoChat", head_dim=16, final_logit_softcapping=3.0, tie_word_embeddings=False),
    # LFM2: gated short convolutions (3 positions) in place of attention in most layers, two
    # in a row, the last layer one; per-head q/k norms in the attention layers; the final norm
    # named embedding_norm; with conv_bias, biases in every convolution layer's products too
    "lfm2": dict(arch="Lfm2", layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4,
                 block_auto_adjust_ff_dim=False, random_norms=True),
    "lfm2-conv-bias": dict(arch="Lfm2", layer_types=["full_attention", "conv", "conv"], conv_bias=True,
                           num_hidden_layers=3, block_auto_adjust_ff_dim=False),
    # LFM2-MoE (LFM2-8B-A1B's form): LFM2's layers, a dense first layer, then sigmoid routers
    # choosing with the block's expert bias (float32), weights renormalised and scaled
    "lfm2_moe": dict(arch="Lfm2Moe", layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3,
                     num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     routed_scaling_factor=2.0, random_norms=True, router_scale=1.0),
    "lfm2_moe-unbiased": dict(arch="Lfm2Moe", layer_types=["full_attention", "conv"], num_dense_layers=0,
                              num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32, use_expert_bias=False,
                              norm_topk_prob=False),
    # LFM3: LFM2's convolutions, sliding and full attention layers each with its own RoPE
    # (float32 tables), sandwich norms around every block, a sigmoid gate per attention head;
    # and without the last two
    "lfm3": dict(arch="Lfm3", head_dim=16, num_hidden_layers=4, sliding_window=16, random_norms=True,
                 layer_types=["conv", "sliding_attention", "conv", "full_attention"]),
    "lfm3-plain": dict(arch="Lfm3", head_dim=16, num_hidden_layers=3, sliding_window=16, use_sandwich_norm=False,
                       use_attention_gate=False, layer_types=["sliding_attention", "conv", "full_attention"]),
    # Qwen 3.5 (text): gated DeltaNets (a SiLU convolution over 4 positions, a recurrent state
    # per head) in most layers, attention gated by more rows of q_proj, RoPE on a quarter of
    # each head, norms by 1 + w; value heads twice the key heads, or as many
    "qwen3_5": dict(arch="Qwen3_5Text", model_class="Qwen3_5ForCausalLM", head_dim=16, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    random_norms=True),
    "qwen3_5-one-value-head-per-key": dict(arch="Qwen3_5Text", model_class="Qwen3_5ForCausalLM", head_dim=16,
                                           linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=3,
                                           linear_num_value_heads=3, num_hidden_layers=2,
                                           layer_types=["full_attention", "linear_attention"]),
    # a DeltaNet convolving each row alone (kernel 1): its state's parent is still the row before
    "qwen3_5-one-tap": dict(arch="Qwen3_5Text", model_class="Qwen3_5ForCausalLM", head_dim=16, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                            linear_conv_kernel_dim=1, num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"]),
    # OLMo Hybrid: gated DeltaNets (q, k, v from three projections, beta up to 2) in pre-norm
    # layers, attention in OLMo 2's post-norm layers; its released form without RoPE, and with
    "olmo_hybrid": dict(arch="OlmoHybrid", linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_hidden_layers=3, random_norms=True,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        rope_parameters={"rope_type": "default", "rope_theta": None}),
    "olmo_hybrid-rope": dict(arch="OlmoHybrid", linear_key_head_dim=16, linear_value_head_dim=8,
                             linear_num_key_heads=2, linear_num_value_heads=2, num_hidden_layers=2,
                             linear_allow_neg_eigval=False, layer_types=["full_attention", "linear_attention"]),
    # Qwen 3.5 MoE (text): Qwen 3.5's layers with Qwen2-MoE's block (softmax top-k, a shared
    # expert gated by a sigmoid)
    "qwen3_5_moe": dict(arch="Qwen3_5MoeText", model_class="Qwen3_5MoeForCausalLM", head_dim=16,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48, random_norms=True,
                        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # Qwen3-Next: Qwen 3.5 MoE's layers with the DeltaNet's projections fused per key head
    # (q, k, v, z in one; b, a in another), a dense layer among the MoE ones
    "qwen3_next": dict(arch="Qwen3Next", head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=4, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       mlp_only_layers=[2], random_norms=True,
                       layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
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
                       layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
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
    # DeepSeek-V3's latent attention: a query LoRA, the latents RMS-normed, RoPE on each head's
    # last columns (its interleaved pairs), values narrower than q.k; a dense first layer, then
    # MoE blocks routed by sigmoid scores within groups
    "deepseek_v3": dict(arch="DeepseekV3", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, random_norms=True),
    # Hy3 (Tencent): Apertus's attention (per-head q/k norms), a dense layer, then MoE blocks
    # routed as MiniMax-M2 (the block's correction bias), renormalised and scaled; a gated shared MLP
    "hy_v3": dict(arch="HYV3", num_hidden_layers=3, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_shared_experts=1, router_scaling_factor=2.5,
                  mlp_layer_types=["dense", "sparse", "sparse"], random_norms=True),
    # AFMoE (Arcee's Trinity): per-head q/k norms, RoPE in the sliding layers only, the attention's
    # output gated per element, norms on both sides of each block, muP's sqrt(hidden) on the
    # embedding; a dense layer, then MoE blocks routed by sigmoid scores chosen with the
    # block's expert bias, renormalised and scaled; a gated shared MLP
    "afmoe": dict(arch="Afmoe", num_hidden_layers=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_shared_experts=1, num_dense_layers=1, route_scale=2.5,
                  sliding_window=16, global_attn_every_n_layers=2, mup_enabled=True, max_position_embeddings=1024,
                  random_norms=True),
    # Kolibri-1: EXAONE 4's attention (per-head q/k norms, windows in 4 of 5 layers, the full
    # ones NoPE), GLM-4's norms on both sides of each block, MoE blocks chosen by logit + a
    # correction bias, weighted by the chosen logits' sigmoid, renormalised; a gated shared MLP
    "kolibri1": dict(arch="Kolibri1", num_hidden_layers=5, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=48, sliding_window=16,
                     norm_topk_prob=True, max_position_embeddings=1024, random_norms=True),
    # Sarvam-105B's config (sarvam_mla), which AutoModelForCausalLM builds as DeepseekV3ForCausalLM:
    # no query LoRA, interleaved RoPE, one group
    "sarvam_mla": dict(arch="SarvamMLA", model_class="DeepseekV3ForCausalLM", num_hidden_layers=3,
                       num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                       num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.5, random_norms=True),
    # without a query LoRA, values wider than q.k, rotate_half, biases, YaRN (its mscale in
    # the attention's scale)
    "deepseek_v3-yarn-wide-v": dict(arch="DeepseekV3", num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None,
                                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=24,
                                    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                    moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                    rope_interleave=False, attention_bias=True, random_norms=True,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 128, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0}),
    # DeepSeek-V2: its RoPE as float32 complex products, a softmax router's group-limited top-k
    "deepseek_v2": dict(arch="DeepseekV2", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=1,
                        topk_method="group_limited_greedy", first_k_dense_replace=1, routed_scaling_factor=1.5,
                        random_norms=True, router_scale=1.0),
    # DeepSeek-V2-Lite's form: no query LoRA, the plain top-k of the softmax (no groups)
    "deepseek_v2-greedy": dict(arch="DeepseekV2", num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=None,
                               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                               n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, moe_intermediate_size=32,
                               first_k_dense_replace=1, router_scale=1.0),
    # Mistral 4: DeepSeek-V3's attention (served below its Llama-4 query scaling), a softmax
    # router in the rows' dtype choosing within groups, renormalised
    "mistral4": dict(arch="Mistral4", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, random_norms=True, router_scale=1.0,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 128, "llama_4_scaling_beta": 0.1,
                                      "mscale": 1.0, "mscale_all_dim": 1.0}),
    # A.X-K1: DeepSeek-V3's attention and MoE, its MoE blocks' output RMS-normed
    "axk1": dict(arch="AXK1", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                 routed_scaling_factor=2.5, random_norms=True),
    # Llama 4 (Scout's form): RoPE on adjacent pairs as complex products in float32 (llama3
    # scaling), each head's q and k L2-normed after it on the RoPE layers, NoPE layers between;
    # dense MLPs and MoE blocks interleaved, the top-1 expert's input scaled by its sigmoid
    # weight, a shared expert added
    "llama4": dict(arch="Llama4Text", model_class="Llama4ForCausalLM", num_hidden_layers=4, num_local_experts=4,
                   num_experts_per_tok=1, intermediate_size_mlp=96, interleave_moe_layer_step=2,
                   no_rope_layer_interval=2, random_norms=True,
                   **rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)),
    # Maverick's form without q/k norms, every layer MoE; here two experts per row and biases
    "llama4-top2-no-qk-norm": dict(arch="Llama4Text", model_class="Llama4ForCausalLM", num_hidden_layers=3,
                                   num_local_experts=4, num_experts_per_tok=2, use_qk_norm=False,
                                   attention_bias=True, no_rope_layer_interval=3),
    # Youtu-LLM: DeepSeek-V3's attention in dense layers, tied embeddings
    "youtu": dict(arch="Youtu", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, tie_word_embeddings=True, random_norms=True),
    # GLM-4.7-Flash: the same attention, MoE layers after a dense one (mlp_layer_types)
    "glm4_moe_lite": dict(arch="Glm4MoeLite", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                          n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                          mlp_layer_types=["dense", "sparse", "sparse"], random_norms=True),
    # MiniCPM3: the latent attention (rotate_half) in dense layers, its scaled embedding rows,
    # residual branches scaled by scale_depth / sqrt(layers), the final hidden state divided
    # before the (tied) LM head
    "minicpm3": dict(arch="MiniCPM3", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, scale_emb=3.0, scale_depth=1.4,
                     dim_model_base=16, random_norms=True),
    # Sarvam-M MoE: GLM-4.5's classes under its own model_type, RoPE over the whole head
    "sarvam_moe": dict(arch="SarvamMoE", model_class="Glm4MoeForCausalLM", head_dim=16, num_hidden_layers=3,
                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                       n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5),
    "solar_open": dict(arch="SolarOpen", head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True),
    # K-EXAONE: EXAONE 4's attention (per-head q/k norms; with a window, its full-attention
    # layers unrotated) in pre-norm layers, a dense first layer, DeepSeek-V3's routing
    "exaone_moe": dict(arch="ExaoneMoe", head_dim=16, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, num_shared_experts=1, n_group=2, topk_group=1,
                       mlp_layer_types=["dense", "sparse", "sparse", "sparse"], routed_scaling_factor=2.0,
                       sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                       max_position_embeddings=1024, random_norms=True),
    # FlexOlmo: OLMo 2's layers (norms on the blocks' outputs, whole-projection q/k norms)
    # with OLMoE's experts
    "flex_olmo": dict(arch="FlexOlmo", num_experts=8, num_experts_per_tok=2, random_norms=True),
    # HunYuan-MoE: HunYuan's q/k norms after RoPE, a float32 router (`wg`) on the rows widened,
    # renormalised top-k weights, the block's ungated shared MLP
    "hunyuan_v1_moe": dict(arch="HunYuanMoEV1", head_dim=16, num_experts=8, moe_topk=2, random_norms=True),
    # ERNIE 4.5 MoE: RoPE pairs, biases, a dense first layer, a float32 router whose choice adds
    # a correction bias, weights over their clamped sum, a shared MLP
    "ernie4_5_moe": dict(arch="Ernie4_5_Moe", head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, moe_num_shared_experts=1, use_bias=True, router_scale=0.5),
    # MiniMax-M2: whole-projection q/k norms, RoPE on part of each head, a sigmoid router whose
    # choice adds the block's correction bias, renormalised weights
    "minimax_m2": dict(arch="MiniMaxM2", head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # PhiMoE (Phi-3.5-MoE): LayerNorms, biases on q/k/v/o and the LM head, its sparsemixer's top-2
    # routing (HF's own function), a window
    "phimoe": dict(arch="Phimoe", num_local_experts=8, num_experts_per_tok=2, random_norms=True,
                   attention_bias=True, lm_head_bias=True, sliding_window=16, router_scale=1.0),
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


@pytest.mark.parametrize("case", list(SUPPORTED))
def test_supported_variant_gives_hf_greedy(case):
    """Row for row HF's batch-1 greedy output, alone and as a left-padded batch."""
    overrides = dict(SUPPORTED[case])
    model = build(overrides.pop("arch", "Llama"), **overrides)
    rows = prompts(11, 30)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False)
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows) == expected


@pytest.mark.parametrize("case", ["gemma", "gemma2", "gemma3", "granite-multipliers", "olmo2-output-norms", "phi",
                                  "cohere-qk-norm", "gpt_neox", "qwen3_moe", "mixtral-window", "gpt2", "opt",
                                  "gpt_neo-local", "gpt_bigcode-mqa", "gpt_bigcode-mha-unscaled",
                                  "gptj-partial-rotary", "falcon-40b-form", "nemotron", "codegen", "bloom",
                                  "mpt-6-heads", "vaultgemma", "hyperclovax", "cohere2-window", "jais2", "glm4_moe",
                                  "granitemoeshared", "nanochat", "lfm2", "lfm2-conv-bias", "lfm2_moe", "qwen3_5",
                                  "qwen3_5_moe", "lfm3", "olmo_hybrid", "granitemoehybrid", "granitemoehybrid-moe-rope",
                                  "bamba", "nemotron_h", "falcon_h1", "falcon_h1-norm-before-gate", "mamba2",
                                  "mamba", "falcon_mamba", "jamba", "deepseek_v3", "deepseek_v3-yarn-wide-v",
                                  "deepseek_v2", "youtu", "glm4_moe_lite", "minicpm3", "qwen3_next", "mistral4", "axk1",
                                  "llama4", "nemotron_h-moe", "kolibri1", "afmoe", "hy_v3"])
def test_logits_are_hfs_to_float32_rounding(case):
    """output_logits equal HF's to float32 rounding: what the tokens alone may not show (a
    GELU without the tanh approximation, a soft cap left off the logits: the argmax
    survives both)."""
    overrides = dict(SUPPORTED[case])
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


@pytest.mark.parametrize("cls", ["LlamaForSequenceClassification", "LlamaModel"])
def test_a_model_without_an_lm_head_is_refused(cls):
    torch.manual_seed(0)
    model = getattr(transformers, cls)(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="not a causal LM.*AutoModelForCausalLM"):
        attach_heads(model, heads=False)


def test_other_activation_refused():
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'.*'silu'.*'gelu_pytorch_tanh'.*plain model.generate"):
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


def test_gemma3_image_text_class_decodes_its_text():
    """Text prompts, alone and as a batch, within its window and past it: HF's greedy output;
    the engine reads the language model's layers and the text config's window."""
    model = gemma3_image_text()
    rows = prompts(11, 30, 120)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False)
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows) == expected
    assert model._selfspec.engine.view.layer_window == (32, 0)
    # the processor's token_type_ids of a text prompt (all 0) are the text's own
    ids = torch.tensor(rows[:1])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                         do_sample=False, max_new_tokens=NEW, pad_token_id=0, assistant="self")
    assert out[0, ids.shape[1]:].tolist()[:len(expected[0])] == expected[0]


@pytest.mark.parametrize("media", ["pixel_values", "token_type_ids"])
def test_gemma3_image_inputs_refused(media):
    """An image (its pixels, or token_type_ids marking image tokens) would be dropped by the
    engine: refused by name, before HF encodes it."""
    model = gemma3_image_text()
    attach_heads(model, heads=False)
    ids = torch.tensor(prompts(12))
    kw = {"pixel_values": torch.zeros(1, 3, 28, 28),
          "token_type_ids": torch.zeros_like(ids).index_fill_(1, torch.tensor([3, 4]), 1)}
    encoded = []
    model.model.vision_tower.register_forward_hook(lambda *args: encoded.append(1))
    with pytest.raises(ValueError, match=f"{media} is not supported with assistant='self'.*text only"):
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                       assistant="self", **{media: kw[media]})
    assert not encoded


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
    overrides = dict(SUPPORTED[case])
    model = build(overrides.pop("arch", "Llama"), **overrides)
    assert cpu_only(text_config(model), text_decoder(model)) is cuda
    image_text = gemma3_image_text()
    assert cpu_only(text_config(image_text), text_decoder(image_text))



@pytest.mark.parametrize("case", ["gpt2", "opt", "gpt_neo-local", "gpt_bigcode-mqa", "bloom"])
def test_learned_positions_with_either_prefill(case):
    """GPT-2, OPT, GPT-Neo, GPT-BigCode and Bloom (ALiBi) with the engine's own prefill (every
    position's learned row added by the engine; Bloom's slopes over every key) and HF's, a prompt of 200 tokens and a short one batched: HF's greedy output;
    the position rows the engine reads are a view of the model's own (OPT's from row 2)."""
    overrides = dict(SUPPORTED[case])
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
    overrides = dict(SUPPORTED[case], **extra)
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
    overrides = dict(SUPPORTED[case])
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


def test_mellum_partial_rotary_refused():
    """HF's Mellum rotates whole heads (its tables of a partial_rotary_factor < 1 would not
    fit them): such a config is refused by name, not run on a guess."""
    overrides = dict(SUPPORTED["mellum"])
    overrides["rope_parameters"] = {**overrides["rope_parameters"],
                                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5}}
    model = build(overrides.pop("arch"), **overrides)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor below 1 \\(mellum\\)"):
        attach_heads(model, heads=False)


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
    overrides = dict(SUPPORTED[case])
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


def test_falcon_alibi_refused():
    """Falcon-RW's ALiBi (attention biased by distance): refused by name."""
    with pytest.raises(UnsupportedModelError, match="alibi=True.*plain model.generate"):
        attach_heads(build("Falcon", alibi=True), heads=False)


@pytest.mark.parametrize("layout", ["kernel", "fixed"])
@pytest.mark.parametrize("case", ["gpt_oss", "granite_swa", "granitemoe_swa"])
def test_attention_sinks_in_both_attentions(case, layout):
    """GPT-OSS's and Granite-SWA's attention sinks in the C++ row attention (kernel) and the
    PyTorch block attention (fixed), within and past their windows and a 256-key block: HF's
    greedy tokens alone and (the C++ rows) batched, and its logits to float32 rounding."""
    _greedy_and_logits_in_one_attention(case, layout)


@pytest.mark.parametrize("layout", ["kernel", "fixed"])
def test_bloom_alibi_in_both_attentions(layout):
    """ALiBi in the C++ row attention (kernel) and the PyTorch block attention (fixed), past
    a 256-key block: HF's greedy tokens and its logits to float32 rounding, alone and (the
    C++ rows) batched; Bloom's own options refused."""
    _greedy_and_logits_in_one_attention("bloom", layout)
    for bad in (dict(apply_residual_connection_post_layernorm=True), dict(pretraining_tp=2, slow_but_exact=True)):
        with pytest.raises(UnsupportedModelError, match="Bloom.*plain model.generate"):
            attach_heads(build("Bloom", n_head=4, **bad), heads=False)


def _greedy_and_logits_in_one_attention(case: str, layout: str) -> None:
    """SUPPORTED[case] with the attention of `layout` (kernel: the C++ rows; fixed: the
    PyTorch blocks), prompts of 300 and 11 tokens: HF's greedy tokens alone and (the C++ rows)
    batched, and the 300-token prompt's logits to float32 rounding."""
    overrides = dict(SUPPORTED[case])
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

    overrides = dict(SUPPORTED[case])
    model = build(overrides.pop("arch"), **overrides)
    engine = Engine(model, EngineConfig(width=8, capacity=400, row_layout="kernel"))
    for p in prompts(5, 40):
        expected = engine.generate_ar(p, 30)
        result = OracleTrees(engine, expected, shape).generate(p, 30)
        assert result.tokens == expected
        assert result.stats.off_chain_cycles > 0


def test_qwen3_5_image_text_class_decodes_its_text():
    """Qwen3_5ForConditionalGeneration (what a Qwen 3.5 checkpoint's own class is): its
    language model decodes HF's greedy tokens, and its media inputs are refused by name."""
    torch.manual_seed(0)
    overrides = dict(SUPPORTED["qwen3_5"])
    for key in ("arch", "model_class", "random_norms"):
        overrides.pop(key)
    text = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("conv1d.weight"):
                param.normal_(0.0, 0.5)
    rows = prompts(11, 30)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False)
    assert [self_greedy(model, [p])[0] for p in rows] == expected
    assert self_greedy(model, rows) == expected
    cache = model._selfspec.engine.mixer_cache
    assert len(cache._regions) == 2  # a ring of convolution inputs and states per sequence of the batch
    assert self_greedy(model, rows[:1]) == expected[:1]
    assert len(cache._regions) == 1  # a new request reuses the rings
    ids = torch.tensor(rows[:1])
    with pytest.raises(ValueError, match="pixel_values"):
        model.generate(ids, pixel_values=torch.zeros(4, 3), assistant="self", max_new_tokens=4)


@pytest.mark.parametrize("case", ["lfm2", "qwen3_5", "granitemoehybrid"])
def test_a_measurement_mid_request_leaves_the_sequences_rings(case):
    """A decoder used directly measures the engine's step costs after its prefill: those
    timing steps write their rows to rings of their own (MixerCache.scratch), so the
    convolution inputs and states of the sequence stay as they were (the engine's AR output)
    and the sequences' rings do not grow by a region for them."""
    from hf_selfspec.decoding.cycle import DecodeConfig, SelfSpecDecoder
    from hf_selfspec.engine.core import Engine

    overrides = dict(SUPPORTED[case])
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
                                       ("nemotron_h", "layers.4.mixer.in_proj"), ("nemotron_h", "layers.3.mixer.up_proj"),
                                       ("falcon_h1", "layers.1.mamba.out_proj"), ("mamba", "layers.1.mixer.x_proj"),
                                       ("jamba", "layers.2.mamba.dt_proj"), ("deepseek_v3", "layers.1.self_attn.q_a_proj"),
                                       ("deepseek_v3", "layers.0.self_attn.kv_b_proj"),
                                       ("deepseek_v3-yarn-wide-v", "layers.1.self_attn.q_proj"),
                                       ("minicpm3", "layers.2.self_attn.kv_a_proj_with_mqa"),
                                       ("qwen3_next", "layers.0.linear_attn.in_proj_qkvz"),
                                       ("qwen3_next", "layers.2.linear_attn.in_proj_ba"),
                                       ("llama4", "layers.1.feed_forward.shared_expert.up_proj"),
                                       ("afmoe", "layers.0.self_attn.gate_proj"), ("afmoe", "layers.2.mlp.router.gate")])
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

    overrides = dict(SUPPORTED[case])
    model = build(overrides.pop("arch"), **overrides)
    parent_path, name = path.rsplit(".", 1)
    parent = text_decoder(model).get_submodule(parent_path)
    setattr(parent, name, Wrapped(getattr(parent, name)))
    with pytest.raises(UnsupportedModelError, match=f"{path}.*plain model.generate"):
        attach_heads(model, heads=False)
    assert "_selfspec" not in model.__dict__


@pytest.mark.parametrize("change", ["kv_heads", "latent_norm"])
def test_latent_attention_it_cannot_run_is_refused(change):
    """A latent attention block outside what LatentAttentionWeights reads is refused at
    attach_heads with the reason, the model untouched: fewer KV heads than heads (HF's own
    attention fails on it), a latent norm that is not an RMSNorm."""
    overrides = dict(SUPPORTED["deepseek_v3"])
    if change == "kv_heads":
        overrides["num_key_value_heads"] = 2
    model = build(overrides.pop("arch"), **overrides)
    if change == "latent_norm":
        model.model.layers[1].self_attn.kv_a_layernorm = torch.nn.LayerNorm(16)
    with pytest.raises(UnsupportedModelError, match="model.layers.0.self_attn|model.layers.1.self_attn") as error:
        attach_heads(model, heads=False)
    assert "num_key_value_heads" in str(error.value) and "plain model.generate" in str(error.value)
    assert "_selfspec" not in model.__dict__


def test_llama4_image_text_class_points_to_its_text_model():
    """Llama4ForConditionalGeneration is refused at attach_heads, naming the class that runs
    (what AutoModelForCausalLM loads from the same checkpoint), the model left as it was."""
    text = dict(hidden_size=64, intermediate_size=128, intermediate_size_mlp=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300, num_local_experts=4)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  vision_output_dim=32, projector_input_dim=32, projector_output_dim=64, image_size=28, patch_size=14)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text, vision_config=vision))
    with pytest.raises(UnsupportedModelError, match="Llama 4's image-text model.*AutoModelForCausalLM.*Llama4ForCausalLM"):
        attach_heads(model, heads=False)
    assert "_selfspec" not in model.__dict__


def test_nemotron_h_latent_moe_refused_by_name():
    """Nemotron-H MoE blocks whose experts run in a latent space (moe_latent_size, Nemotron 3
    Super's form): refused at attach_heads with what it is, the model left as it was."""
    overrides = dict(SUPPORTED["nemotron_h-moe"], moe_latent_size=32)
    model = build(overrides.pop("arch"), **overrides)
    with pytest.raises(UnsupportedModelError, match="layers.1.mixer.fc1_latent_proj.*latent.*plain model.generate"):
        attach_heads(model, heads=False)
    assert "_selfspec" not in model.__dict__


def test_nemotron_h_prompt_time_steps_bounded_as_in_hfs_prefill():
    """Nemotron-H's chunked prefill bounds the Mamba2 time steps below by time_step_min (its
    decode steps do not; HF's dt_bias init puts many below it): the engine's own prefill
    bounds the prompt's rows alike, and gives HF's greedy tokens."""
    overrides = dict(SUPPORTED["nemotron_h"])
    model = build(overrides.pop("arch"), **overrides)
    with torch.no_grad():  # time steps about e^-8 before the bound: 1e-3 instead of 3e-4 in the prompt
        for layer in model.model.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.dt_bias.fill_(-8.0)
    rows = prompts(5, 40, 120)
    expected = [hf_greedy(model, p) for p in rows]
    attach_heads(model, heads=False, engine=EngineConfig(prefill="engine"))
    assert [self_greedy(model, [p])[0] for p in rows] == expected
