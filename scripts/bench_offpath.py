"""Off the happy path, side by side with HF greedy in one process: a bf16 and an fp16
model, a bigger random-weight model (memory and first call), and the first call of a fresh
process.

    python scripts/bench_offpath.py                    # all four parts
    python scripts/bench_offpath.py --parts bf16 --prompts 4 --max-new-tokens 64

bf16:    the default model cast to bfloat16: HF bf16 greedy vs generate(assistant="self")
         on short prompts and one long one (--long-prompt-tokens), with the prefill `auto`
         chose (seconds; outputs equal to HF bf16 greedy; outputs equal to the engine's own
         AR output in bf16, which is the exactness promise in that dtype).
fp16:    the same in float16.
big:     a random-weight Llama of 0.85B parameters (hidden 2048, 16 layers, GQA 32/8), fp32:
         resident memory added by the engine beyond HF greedy's, first-call time, speed vs
         HF greedy, identical outputs (acceptance of random weights means nothing: prompt
         lookup only).
process: a fresh Python process loads the default model and times its first and second
         assistant="self" calls (the engine's measurements come from the on-disk cache).
smollm3, phi3, granite, olmo2, gemma, gemma2, gemma3, exaone4, ernie, pythia, stablelm, olmo,
phi, olmoe, qwen3_moe, gemma3_4b, gpt2, gpt2_large,
opt_1_3b, gpt_neo_125m, santacoder, gptj, falcon_7b, bloom_560m, codegen_350m,
nemotron_mini, mpt_7b, qwen2_5_0_5b, gpt_oss_20b, glm4_5_air, granite_swa: (not in the default parts)
         a random-weight model of a real checkpoint's shape (RANDOM_SHAPES; --layers fewer for a quicker
         run; --dtype), as `big`.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec import attach_heads, selfspec_state  # noqa: E402
from hf_selfspec.data import prompt_sets, render_prompt  # noqa: E402
from hf_selfspec.defaults import load_default_model_and_tokenizer  # noqa: E402


def rss_gb() -> float:
    """Resident memory of this process now (Linux /proc), GB."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def part_half(args, dtype: torch.dtype) -> None:
    """The default model cast to `dtype` (bf16 / fp16): HF greedy in that dtype against
    assistant="self" on short prompts and one long one (the prefill `auto` chose is printed:
    HF's forward, or the engine's own steps where PyTorch's 16-bit products are the dearer)."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    model, tokenizer = load_default_model_and_tokenizer()
    model = model.to(dtype)
    attach_heads(model)
    sets = prompt_sets(tokenizer, per_category=max(1, args.prompts // 2))
    prompts = [render_prompt(tokenizer, m) for cat in ("chat", "code") for m in sets[cat][: max(1, args.prompts // 2)]]
    # a long prompt: every set's prompts one after another, cut to --long-prompt-tokens
    texts = [m if isinstance(m, str) else " ".join(x["content"] for x in m) for cat in sets for m in sets[cat]]
    body = tokenizer.decode(tokenizer(" ".join(texts))["input_ids"][: args.long_prompt_tokens])
    prompts.append(render_prompt(tokenizer, "Summarize: " + body))
    greedy = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    warm = torch.tensor([prompts[0]])
    model.generate(warm, **greedy)
    model.generate(warm, assistant="self", **greedy)
    engine = selfspec_state(model).engine
    hf_t = self_t = 0.0
    tokens = same_hf = same_ar = 0
    for p in prompts:
        ids = torch.tensor([p])
        hf, t_hf = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **greedy))
        spec, t_self = timed(
            lambda: model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **greedy))
        ar = engine.generate_ar(p, args.max_new_tokens, [tokenizer.eos_token_id])
        new = spec[0, len(p):].tolist()
        hf_t, self_t, tokens = hf_t + t_hf, self_t + t_self, tokens + len(new)
        same_hf += torch.equal(hf, spec)
        same_ar += new == ar
        print(f"  {name} prompt {len(p)} tok: HF {t_hf:.2f} s, self {t_self:.2f} s ({t_hf / t_self:.2f}x; "
              f"tau {model.selfspec_stats.tau:.2f}), == HF {name} greedy: {torch.equal(hf, spec)}, "
              f"== engine AR: {new == ar}", flush=True)
    print(f"{name} default model, {len(prompts)} prompts (the last {len(prompts[-1])} tokens), layout "
          f"{engine.layout.name}, prefill {engine.prefill_mode!r}: self {hf_t / self_t:.2f}x HF {name} greedy; "
          f"identical to HF {name} greedy {same_hf}/{len(prompts)}, to the engine's {name} AR "
          f"{same_ar}/{len(prompts)}")


def part_big(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    random_model_run("big: random Llama", LlamaForCausalLM(config).eval(), args)


# random-weight models of real checkpoints' shapes (parts not in the default run): the
# config class, the model class, the config (num_hidden_layers: the checkpoint's, --layers
# fewer for a quicker run), what the shape is and what of the architecture it exercises
# LFM2's checkpoints (350M to 2.6B alike): convolution layers, attention at 2, 5, 8, 10, 12, 14
LFM2_LAYERS = ["conv", "conv", "full_attention"] * 3 + ["conv", "full_attention"] * 3 + ["conv"]
RANDOM_SHAPES = {
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=65536, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}),
        "SmolLM3-3B (12 GB; every 4th layer without RoPE)"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, tie_word_embeddings=False),
        "Phi-3-mini (15 GB; q/k/v and gate/up fused)"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        vocab_size=49159, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True, embedding_multiplier=12.0,
        attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0),
        "Granite-3.3-2B (10 GB; its four multipliers)"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "OLMo-2-0425-1B (6 GB; norms on the blocks' outputs, q/k norms over the whole projection)"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=8192),
        "Gemma-2B (10 GB; norms by 1 + w, tanh-GELU MLP, scaled embedding)"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, query_pre_attn_scalar=256),
        "Gemma-2-2B (10.5 GB; sandwich norms, soft caps 50 / 30, windows of 4096 in every other layer)"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, query_pre_attn_scalar=256,
        sliding_window=512),
        "Gemma-3-1B (4 GB; per-head q/k norms, five sliding layers (window 512) to a full one, a RoPE each)"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=4096, num_hidden_layers=30, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=65536, tie_word_embeddings=True,
        sliding_window=None, layer_types=["full_attention"] * 30,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "EXAONE-4.0-1.2B (5 GB; output norms, per-head q/k norms)"),
    "ernie": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(
        vocab_size=103424, hidden_size=1024, intermediate_size=3072, num_hidden_layers=18, num_attention_heads=16,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=True,
        use_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "ERNIE-4.5-0.3B (1.5 GB; RoPE turning adjacent pairs)"),
    "pythia": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=50304, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
        "Pythia-410M (1.6 GB; GPT-NeoX: LayerNorms, parallel blocks, per-head fused q/k/v, GELU MLP)"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(
        vocab_size=100352, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, partial_rotary_factor=0.25, use_qkv_bias=True,
        tie_word_embeddings=False),
        "StableLM-2-1.6B (6.6 GB; LayerNorms with biases, RoPE on a quarter of each head)"),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=2048, tie_word_embeddings=True),
        "OLMo-1B-hf (4.7 GB; parameter-free LayerNorms)"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(
        vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        max_position_embeddings=2048, partial_rotary_factor=0.5, tie_word_embeddings=False),
        "Phi-1.5 (5.7 GB; LayerNorm, parallel blocks, gelu_new MLP, biases, LM-head bias)"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
        tie_word_embeddings=False),
        "OLMoE-1B-7B (28 GB in fp32: --layers 4 or --dtype bfloat16; 64 experts, 8 per token)"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False),
        "Qwen3-30B-A3B (122 GB in fp32: --layers 2; 128 experts, 8 per token)"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=1024),
        "GPT-2 (0.5 GB; Conv1D projections read transposed, learned positions)"),
    "gpt2_large": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=50257, hidden_size=1280, num_hidden_layers=36, num_attention_heads=20, max_position_embeddings=1024),
        "GPT-2 Large (3.1 GB; Conv1D projections read transposed, learned positions)"),
    "opt_1_3b": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=50272, hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
        max_position_embeddings=2048, word_embed_proj_dim=2048),
        "OPT-1.3b (5.3 GB; learned positions from row 2, ReLU)"),
    "gpt_neo_125m": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(
        vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, max_position_embeddings=2048,
        attention_types=[[["global", "local"], 6]], window_size=256),
        "GPT-Neo-125M (0.5 GB; unscaled attention, windows of 256 in every other layer)"),
    "santacoder": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        vocab_size=49280, n_embd=2048, n_layer=24, n_head=16, n_positions=2048, multi_query=True,
        bos_token_id=49152, eos_token_id=49152),
        "SantaCoder-1.1B (4.5 GB; one KV head, learned positions)"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=50400, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_positions=2048,
        tie_word_embeddings=False),
        "GPT-J-6B (24 GB in fp32: --layers 4 or --dtype bfloat16; parallel blocks, RoPE pairs on 64 of 256)"),
    "falcon_7b": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        parallel_attn=True, bias=False, max_position_embeddings=2048, bos_token_id=11, eos_token_id=11),
        "Falcon-7B (28 GB in fp32: --layers 4 or --dtype bfloat16; one KV head, parallel blocks)"),
    "bloom_560m": ("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=250880, hidden_size=1024, n_layer=24, n_head=16),
        "bloom-560m (2.2 GB; ALiBi, embedding rows normed, a 250,880-token vocabulary)"),
    "codegen_350m": ("CodeGenConfig", "CodeGenForCausalLM", dict(
        vocab_size=51200, n_embd=1024, n_layer=20, n_head=16, rotary_dim=32, n_positions=2048,
        tie_word_embeddings=False),
        "codegen-350M-mono (1.5 GB; q/k/v in 4 shards, GPT-J's layers)"),
    "nemotron_mini": ("NemotronConfig", "NemotronForCausalLM", dict(
        vocab_size=256000, hidden_size=3072, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "Nemotron-Mini-4B (17 GB in fp32: --layers 4; LayerNorm1P, ReLU² MLP, RoPE on half of each head)"),
    "mpt_7b": ("MptConfig", "MptForCausalLM", dict(
        vocab_size=50432, d_model=4096, n_layers=32, n_heads=32, max_seq_len=2048, bos_token_id=0, eos_token_id=0),
        "mpt-7b (27 GB in fp32: --layers 4; ALiBi, norms without biases)"),
    "qwen2_5_0_5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True),
        "Qwen2.5-0.5B (q/k/v biases)"),
    "gpt_oss_20b": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
        "gpt-oss-20b (84 GB in fp32: --layers 2; attention sinks, windows in alternate layers, 32 experts, 4 "
        "per token)"),
    "glm4_5_air": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
        num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False,
        max_position_embeddings=131072, tie_word_embeddings=False),
        "GLM-4.5-Air (440 GB in fp32: --layers 2; DeepSeek-V3's sigmoid routing, 128 experts, 8 per token, "
        "a shared MLP; RoPE on half of each head)"),
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(
        vocab_size=100352, hidden_size=2560, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=20,
        num_key_value_heads=4, sliding_window=128, max_position_embeddings=8192, tie_word_embeddings=True),
        "Granite-SWA 2B (attention sinks, a window in 3 of 4 layers)"),
    "lfm2_350m": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=65536, hidden_size=1024, intermediate_size=6656, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=128000, tie_word_embeddings=True, layer_types=LFM2_LAYERS),
        "LFM2-350M (gated short convolutions in 10 of 16 layers)"),
    "lfm2_1_2b": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=65536, hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=128000, tie_word_embeddings=True, layer_types=LFM2_LAYERS),
        "LFM2-1.2B (gated short convolutions in 10 of 16 layers)"),
    "lfm2_8b_a1b": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=8, num_dense_layers=2, num_experts=32, num_experts_per_tok=4,
        max_position_embeddings=128000, tie_word_embeddings=True,
        layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]),
        "LFM2-8B-A1B (33 GB in fp32: --layers 4; attention in 6 of 24 layers, 32 experts, 4 per token, "
        "sigmoid routing with an expert bias)"),
    "lfm3_1_7b": ("Lfm3Config", "Lfm3ForCausalLM", dict(
        vocab_size=128000, hidden_size=2048, intermediate_size=7680, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, sliding_window=256, max_position_embeddings=128000,
        tie_word_embeddings=True),
        "LFM3-1.7B (convolutions in 12 of 24 layers, sliding and full attention with their own RoPE, sandwich "
        "norms, gated heads)"),
    "qwen3_5_0_8b": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=262144, tie_word_embeddings=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
        "Qwen3.5-0.8B's text model (gated DeltaNets in 18 of 24 layers, gated attention; an LM head of 248k rows)"),
    "granite_4_0_h_1b": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=100352, hidden_size=1536, shared_intermediate_size=4096, num_hidden_layers=40,
        num_attention_heads=12, num_key_value_heads=4, num_local_experts=0, mamba_n_heads=48, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, embedding_multiplier=12.0, logits_scaling=6.0,
        attention_multiplier=0.0078125, residual_multiplier=0.22, max_position_embeddings=131072,
        tie_word_embeddings=True, layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)]),
        "Granite-4.0-H-1B's shape (Mamba2 mixers in 36 of 40 layers, attention without RoPE in 4)"),
    "nemotron_nano_9b_v2": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=131072, hidden_size=4480, intermediate_size=15680, num_hidden_layers=56, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=80, n_groups=8, ssm_state_size=128,
        max_position_embeddings=131072, tie_word_embeddings=False,
        hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"),
        "NVIDIA-Nemotron-Nano-9B-v2's shape (36 GB in fp32: --layers 15, its first attention layer the 15th; "
        "Mamba2, NoPE attention and ReLU² MLP layers of one block each)"),
    "nemotron_3_nano_30b_a3b": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=131072, hidden_size=2688, num_hidden_layers=52, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128, mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, n_routed_experts=128,
        num_experts_per_tok=6, moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=262144, tie_word_embeddings=False,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
        "NVIDIA-Nemotron-3-Nano-30B-A3B's shape (126 GB in fp32: --layers 6, its first attention layer the 6th; "
        "Mamba2, NoPE attention and MoE layers of one block each: 128 ungated ReLU² experts, 6 per token, "
        "a shared one)"),
    "falcon_h1_0_5b": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=32784, hidden_size=1024, intermediate_size=2048, num_hidden_layers=36, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128,
        mamba_n_groups=1, mamba_rms_norm=False, mamba_norm_before_gate=False, embedding_multiplier=5.656854249492381,
        attention_out_multiplier=0.9375, key_multiplier=0.39062499999999994, lm_head_multiplier=0.0390625,
        mlp_multipliers=[0.8838834764831844, 0.5859375], max_position_embeddings=16384, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 100000000000.0}),
        "Falcon-H1-0.5B's shape (a Mamba2 mixer beside the attention in each of 36 layers, muP multipliers)"),
    "mamba_1_4b": ("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=50280, hidden_size=2048, intermediate_size=4096, num_hidden_layers=48, state_size=16,
        time_step_rank=128, conv_kernel=4, tie_word_embeddings=True),
        "mamba-1.4b-hf's shape (no attention: a Mamba mixer with a float32 state [4096, 16] in each of 48 layers)"),
    "mamba2_2_7b": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=50288, hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, n_groups=1,
        state_size=128, conv_kernel=4, tie_word_embeddings=True),
        "mamba2-2.7b's shape (no attention: a Mamba2 mixer in each of 64 layers)"),
    "jamba_v0_1": ("JambaConfig", "JambaForCausalLM", dict(
        vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, attn_layer_offset=4, attn_layer_period=8, expert_layer_offset=1, expert_layer_period=2,
        num_experts=16, num_experts_per_tok=2, mamba_d_state=16, mamba_dt_rank=256, mamba_expand=2,
        max_position_embeddings=262144, tie_word_embeddings=False),
        "Jamba-v0.1's shape (208 GB in fp32: --layers 5 --dtype bfloat16; Mamba mixers with normed dt / B / C, "
        "NoPE attention in 1 of 8 layers, 16 experts in every other layer, 2 per token)"),
    "qwen3_next_80b_a3b": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
        layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
        "Qwen3-Next-80B-A3B's shape (318 GB in fp32: --layers 4 --dtype bfloat16; gated DeltaNets with fused "
        "projections in 3 of 4 layers, gated attention, 512 experts, 10 per token, a gated shared one)"),
    "mistral_small_4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        vocab_size=131072, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=32, q_lora_rank=1024, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=2048,
        first_k_dense_replace=0, max_position_embeddings=1048576, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                         "original_max_position_embeddings": 8192, "llama_4_scaling_beta": 0.1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
        "Mistral-Small-4-119B's shape (476 GB in fp32: --layers 1 --dtype bfloat16; latent attention, 128 "
        "experts, 4 per token, a shared one; served below its query scaling, 8,192 positions)"),
    "hy3_preview": ("HYV3Config", "HYV3ForCausalLM", dict(
        vocab_size=120832, hidden_size=4096, intermediate_size=13312, moe_intermediate_size=1536, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, num_local_experts=192, num_experts_per_tok=8,
        num_shared_experts=1, router_scaling_factor=2.826, enable_moe_fp32_combine=True,
        mlp_layer_types=["dense"] + ["sparse"] * 79, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 11158840.0}),
        "HYV3Config's defaults, the shape of its documented checkpoint tencent/Hy3-preview (1.2 TB in fp32: "
        "--layers 2 --dtype bfloat16, a dense layer and an MoE block of 192 experts, 8 per token, a shared one)"),
    "trinity_mini": ("AfmoeConfig", "AfmoeForCausalLM", dict(
        vocab_size=200192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=1408, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128, num_experts=64, num_experts_per_tok=6,
        num_shared_experts=2, num_dense_layers=1, route_scale=1.0, sliding_window=1024, global_attn_every_n_layers=4,
        max_position_embeddings=16384, tie_word_embeddings=False),
        "AfmoeConfig's defaults, the shape of its documented checkpoint arcee-ai/Trinity-Mini (78 GB in fp32: "
        "--layers 4, a dense layer then MoE blocks of 64 experts, 6 per token, 2 shared; RoPE in 3 of 4 layers, "
        "windows of 1,024)"),
    "kolibri_1": ("Kolibri1Config", "Kolibri1ForCausalLM", dict(
        vocab_size=128000, hidden_size=2560, num_hidden_layers=50, num_attention_heads=48, num_key_value_heads=4,
        head_dim=128, num_experts=384, num_experts_per_tok=6, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, sliding_window=513, max_position_embeddings=262144,
        tie_word_embeddings=False),
        "Kolibri-1's shape (Aleph Alpha; 312 GB in fp32: --layers 2; 384 experts, 6 per token, a shared MLP; "
        "windows of 513 in 4 of 5 layers)"),
    "llama4_scout": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1,
        interleave_moe_layer_step=1, max_position_embeddings=10485760, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
        "Llama-4-Scout-17B-16E's text shape (436 GB in fp32: --layers 1 --dtype bfloat16; 16 experts, 1 per "
        "token, a shared one; NoPE every 4th layer; served below its chunks and query temperature, 8,191 positions)"),
    "youtu_llm_2b": ("YoutuConfig", "YoutuForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=6144, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1600000.0}),
        "Youtu-LLM-2B's shape (latent attention, DeepSeek-V3's: a query LoRA, interleaved RoPE; dense layers)"),
    "minicpm3_4b": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(
        vocab_size=73448, hidden_size=2560, intermediate_size=6400, num_hidden_layers=62, num_attention_heads=40,
        num_key_value_heads=40, q_lora_rank=768, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, scale_emb=12, scale_depth=1.4, dim_model_base=256, max_position_embeddings=32768,
        tie_word_embeddings=True),
        "MiniCPM3-4B's shape (16 GB in fp32: --dtype bfloat16; latent attention with rotate_half, scaled "
        "residual branches, the final hidden state divided before the LM head)"),
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
        first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=163840, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1}),
        "DeepSeek-V2-Lite's shape (63 GB in fp32: --layers 4; latent attention without a query LoRA, complex "
        "RoPE, YaRN; 64 experts, 6 per token, 2 shared)"),
    "glm_4_7_flash": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        vocab_size=154880, hidden_size=2048, intermediate_size=10240, num_hidden_layers=47, num_attention_heads=20,
        num_key_value_heads=20, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4, moe_intermediate_size=1536,
        routed_scaling_factor=1.8, max_position_embeddings=202752, tie_word_embeddings=False),
        "GLM-4.7-Flash's shape (120 GB in fp32: --layers 4; latent attention, 64 experts, 4 per token, a shared one)"),
    "gemma3_4b": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config=dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                         query_pre_attn_scalar=256, sliding_window=1024,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                             "factor": 8.0}}),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14)),
        "gemma-3-4b-it (17 GB in fp32, 8.6 in bf16 (--dtype bfloat16); the image-text class: a "
        "vision tower beside the language model, which decodes)"),
}


def part_random_shape(name: str, args) -> None:
    import transformers

    config_class, model_class, config, about = RANDOM_SHAPES[name]
    config = dict(config)
    text = config  # the decoder's config: the whole one, or an image-text model's text_config
    if "text_config" in config:
        text = config["text_config"] = dict(config["text_config"])
    # GPT-Neo, GPT-BigCode, MPT
    key = next(k for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if k in text)
    layers = args.layers or text[key]
    for kinds in ("layer_types", "mlp_layer_types"):  # the checkpoint's pattern, cut or repeated to `layers`
        if kinds in text:
            text[kinds] = (text[kinds] * layers)[:layers]
    if "hybrid_override_pattern" in text:  # Nemotron-H's pattern, likewise
        text["hybrid_override_pattern"] = (text["hybrid_override_pattern"] * layers)[:layers]
    if args.layers and "attention_types" in text:  # GPT-Neo: its layers' kinds, alternating
        text["attention_types"] = [[["global", "local"], (layers + 1) // 2]]
        layers = 2 * ((layers + 1) // 2)
    text[key] = layers
    torch.manual_seed(0)
    dtype, default = getattr(torch, args.dtype), torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a 16-bit model never held in fp32
    try:
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    finally:
        torch.set_default_dtype(default)
    random_model_run(f"{name}: random {about}, {layers} layers,", model.to(dtype).eval(), args)


def random_model_run(label, model, args):
    """HF greedy vs assistant="self" (heads=False: prompt lookup) on a random-weight model:
    resident memory the engine adds, first / second / third call, identical outputs."""
    params = sum(p.numel() for p in model.parameters()) / 1e9
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, args.prompt_tokens), generator=gen)  # a small alphabet: prompt lookup copies
    greedy = dict(do_sample=False, max_new_tokens=args.max_new_tokens, attention_mask=torch.ones_like(ids))
    model.generate(ids[:, :8], do_sample=False, max_new_tokens=2)  # HF warm-up
    gc.collect()
    base = rss_gb()
    hf, t_hf = timed(lambda: model.generate(ids, **greedy))
    after_hf = rss_gb()
    attach_heads(model, heads=False)
    first, t_first = timed(lambda: model.generate(ids, assistant="self", **greedy))
    build = model.selfspec_stats.build_time
    after_self = rss_gb()
    # the second call also makes what the first deferred (a big LM head's int8 screen)
    second, t_second_call = timed(lambda: model.generate(ids, assistant="self", **greedy))
    third, t_second = timed(lambda: model.generate(ids, assistant="self", **greedy))
    tau = model.selfspec_stats.tau
    _, t_hf2 = timed(lambda: model.generate(ids, **greedy))
    n = hf.shape[1] - ids.shape[1]
    own_ar = ""
    if model.dtype != torch.float32:  # a 16-bit model's promise: the engine's own AR output
        eos = model.generation_config.eos_token_id
        ar = selfspec_state(model).engine.generate_ar(ids[0].tolist(), n, eos if isinstance(eos, list) else [eos])
        own_ar = f" (to HF's {model.dtype} greedy), to the engine's own AR {third[0, ids.shape[1]:].tolist() == ar}"
    t_hf_med = statistics.median([t_hf, t_hf2])
    print(f"{label} {params:.2f}B {str(model.dtype).removeprefix('torch.')}, prompt {args.prompt_tokens}, "
          f"{n} new: HF greedy {n / t_hf_med:.2f} tok/s; self "
          f"first call {t_first:.1f} s (engine build {build:.1f} s), second call {t_second_call:.1f} s, "
          f"warm (third call) {n / t_second:.2f} tok/s = "
          f"{t_hf_med / t_second:.2f}x HF (tau {tau:.2f}); resident memory: "
          f"HF greedy +{after_hf - base:.2f} GB, the engine "
          f"+{after_self - after_hf:.2f} GB more after the first call; identical "
          f"{torch.equal(hf, first) and torch.equal(hf, second) and torch.equal(hf, third)}{own_ar}", flush=True)


def part_process(args):
    code = (
        "import sys, time, torch; sys.path.insert(0, '.');"
        "from hf_selfspec import load_default;"
        "model, tok = load_default();"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Name three colours.'}], "
        "add_generation_prompt=True, return_tensors='pt', return_dict=True)['input_ids'];"
        "t = [];"
        "[t.append((time.perf_counter(), model.generate(ids, max_new_tokens=32, do_sample=False, assistant='self'), "
        "time.perf_counter())) for _ in range(2)];"
        "print('TIMES', t[0][2] - t[0][0], t[1][2] - t[1][0], model.selfspec_stats.build_time)"
    )
    for run in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent.parent)
        line = [x for x in out.stdout.splitlines() if x.startswith("TIMES")]
        if not line:
            print("process: failed:", out.stderr[-500:])
            return
        first, second, _ = map(float, line[0].split()[1:])
        print(f"process run {run + 1}: first assistant='self' call {first:.2f} s, second {second:.2f} s "
              f"(first - second = {first - second:.2f} s)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="bf16,fp16,big,process",
                    help="any of bf16,fp16,big,process," + ",".join(RANDOM_SHAPES))
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of the random-shape parts (default: each checkpoint's own)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the random-shape parts (16-bit: == the engine's own AR output is the promise)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--long-prompt-tokens", type=int, default=1000,
                    help="the bf16 / fp16 parts' long prompt (cut to this many tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=200,
                    help="prompt length of the random-model parts (past a model's sliding window: its window applies)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for part in args.parts.split(","):
        if part in RANDOM_SHAPES:
            part_random_shape(part, args)
        else:
            {"bf16": lambda a: part_half(a, torch.bfloat16), "fp16": lambda a: part_half(a, torch.float16),
             "big": part_big, "process": part_process}[part](args)


if __name__ == "__main__":
    main()
