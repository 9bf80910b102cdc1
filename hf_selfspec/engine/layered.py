"""A layered view of a Hugging Face causal LM's text decoder.

The view holds references to the HF model's own parameters (never copies) and the
maths of one decoder layer written as plain tensor ops on a `[W, hidden]` block of rows,
so the engine can run any row range through any layer range. Supported (SUPPORTED_MODEL_TYPES):
Llama and the models shaped like it (Mistral, Ministral, Qwen2, Qwen3 with q/k norms,
SmolLM2/3, EXAONE 3, InternLM 3, Seed-OSS), Phi-3 (fused q/k/v and gate/up projections,
read as row ranges; partial rotary), Granite (four multipliers), OLMo 2/3 and EXAONE 4
(norms on the blocks' outputs), Gemma 1-3 (norms scaling by 1 + w, GELU-gated MLPs, scaled
embeddings, soft caps; Gemma 3's image-text class for its text), GLM, GLM-4, ERNIE 4.5 and
Cohere (RoPE turning adjacent pairs), the LayerNorm families (StableLM, OLMo 1, Phi,
StarCoder 2, Cohere, GPT-NeoX, GPT-J, CodeGen, Falcon, Nemotron: norm modules called as HF
does, parallel blocks, plain MLPs), the models with learned positions (GPT-2: Conv1D weights
read transposed in place; OPT, GPT-Neo, GPT-BigCode), Bloom and MPT (ALiBi), the models with
attention sinks (GPT-OSS, Granite-SWA: a RoPE base per layer), and sparse MoE models
(Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo, Mixtral, the Granite MoEs, HunYuan-MoE, PhiMoE's
sparsemixer, Cohere 2 MoE, GPT-OSS; DeepSeek-V3's sigmoid routing: GLM-4.5, dots.llm1, Solar
Open, K-EXAONE, MiniMax-M2; ERNIE 4.5 MoE), and hybrids whose other layers mix tokens
without attention (LFM2, LFM2-MoE and LFM3: gated short convolutions; Qwen 3.5, its MoE,
Qwen3-Next and OLMo Hybrid: gated DeltaNets; Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1,
Jamba and the Mambas: Mamba mixers; their maths in mixers.py), and the models with latent
attention (DeepSeek-V2 / V3, Youtu-LLM, GLM-4.7-Flash, MiniCPM3, Mistral 4: latent.py; the
softmax routings of DeepSeek-V2 and Mistral 4); GQA, MQA and MHA; tied or untied LM head;
linear biases; any head_dim; every RoPE type of these models' HF rotary module (default,
linear, dynamic, yarn, llama3, longrope), whose own tables the engine takes. Each type is listed only after its modeling code was read against Llama's:
a model of another type is refused, never run on a guess.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import routing
from .dispatch import ModelPlacement, model_placement
from .errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "granite", "olmo2", "gemma",
                         "gemma2", "gemma3_text", "gemma3", "olmo3", "exaone", "exaone4", "internlm3",
                         "ministral", "seed_oss", "glm", "ernie4_5", "stablelm", "olmo", "phi", "starcoder2",
                         "cohere", "gpt_neox", "qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "glm4",
                         "granitemoe", "arcee", "apertus", "hunyuan_v1_dense", "helium", "gpt2",
                         "opt", "gpt_neo", "gpt_bigcode", "gptj", "falcon", "nemotron", "codegen",
                         "bloom", "mpt", "vaultgemma", "iquestcoder", "cwm", "jais2", "hyperclovax",
                         "ministral3", "cohere2", "gpt_oss", "granite_swa", "granitemoeshared",
                         "granitemoe_swa", "glm4_moe", "dots1", "solar_open", "exaone_moe", "flex_olmo",
                         "hunyuan_v1_moe", "ernie4_5_moe", "minimax_m2", "phimoe", "cohere2_moe", "sarvam_moe",
                         "mellum", "apertus1p5_text", "nanochat", "lfm2", "lfm2_moe", "qwen3_5_text", "qwen3_5",
                         "qwen3_5_moe_text", "qwen3_5_moe", "lfm3", "olmo_hybrid", "granitemoehybrid", "bamba", "nemotron_h",
                         "falcon_h1", "mamba2", "mamba", "falcon_mamba", "jamba", "deepseek_v3", "deepseek_v2",
                         "youtu", "glm4_moe_lite", "minicpm3", "qwen3_next", "mistral4", "axk1", "llama4_text",
                         "sarvam_mla", "kolibri1", "afmoe", "hy_v3")
# multi-head latent attention (LatentAttentionWeights): DeepSeek-V3's (Youtu-LLM, GLM-4.7-Flash,
# Sarvam-105B's sarvam_mla too, and Mistral 4 below its query scaling), DeepSeek-V2's (its RoPE in complex numbers),
# MiniCPM3's (rotate_half)
LATENT_ATTENTION_TYPES = ("deepseek_v3", "deepseek_v2", "youtu", "glm4_moe_lite", "minicpm3", "mistral4", "axk1",
                          "sarvam_mla")
# hybrids whose non-attention layers are gated short convolutions (LFM2: ShortConvWeights)
SHORT_CONV_TYPES = ("lfm2", "lfm2_moe", "lfm3")
# Qwen 3.5 (and its MoE) and Qwen3-Next: attention gating its output by a sigmoid of more rows
# of q_proj, norms by 1 + w; with OLMo Hybrid, the hybrids whose other layers are gated
# DeltaNets (GatedDeltaNetWeights)
QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
DELTA_NET_TYPES = QWEN3_5_TYPES + ("olmo_hybrid",)
# the DeltaNet's projections, as each family names them: q/k/v (one weight, or three), z
# (the output gate), b (beta), a (the decay), the output; Qwen3-Next's two fused ones hold
# per key head its q, k, v and z rows, and its b and a rows (GatedDeltaNetWeights.grouped)
DELTA_NET_PROJECTIONS = {"olmo_hybrid": (("q_proj", "k_proj", "v_proj"), "g_proj", "b_proj", "a_proj", "o_proj"),
                         "qwen3_next": (("in_proj_qkvz",), None, "in_proj_ba", None, "out_proj")}
QWEN3_5_DELTA_NET_PROJECTIONS = (("in_proj_qkv",), "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# hybrids whose other layers are Mamba2 mixers (Mamba2Weights), held by the layer as `mamba`
# (Nemotron-H: as its one block, `mixer`)
MAMBA2_TYPES = ("granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "mamba2")
# models whose every layer runs a Mamba2 mixer and attention side by side on its normed input,
# their outputs summed (Falcon-H1, with muP multipliers on both and on the MLP)
PARALLEL_MIXER_TYPES = ("falcon_h1",)
# the first Mamba (Mamba1Weights): a state [I, N] per layer, a decay per channel and state
# dimension; Falcon Mamba and Jamba norm its dt, B and C; Jamba's between attention layers,
# held by the layer as `mamba`, each layer with its MLP or MoE block
MAMBA1_TYPES = ("mamba", "falcon_mamba", "jamba")
# models whose decoder layers hold ONE block each (`mixer`, after the layer's `norm`): a Mamba2
# mixer, attention, an MLP or an MoE block (Nemotron-H); a Mamba2 or Mamba mixer (Mamba2,
# Mamba, Falcon Mamba); the engine's layer then has no token mixer or no MLP
ONE_BLOCK_LAYER_TYPES = ("nemotron_h", "mamba2", "mamba", "falcon_mamba")
# models without attention: no KV cache to speak of (one head of 8 dimensions, never written)
ATTENTION_FREE_TYPES = ("mamba2", "mamba", "falcon_mamba")
# models without position embeddings of any kind (their attention is unrotated: NoPE)
NOPE_TYPES = ("nemotron_h", "jamba") + ATTENTION_FREE_TYPES
# image-text classes served for their text decoder: the model type and the attribute of
# model.model holding it (AutoModelForCausalLM loads Gemma 3 4B and up, whose checkpoints
# carry a vision tower, as Gemma3ForConditionalGeneration)
IMAGE_TEXT_DECODERS = {"gemma3": "language_model", "qwen3_5": "language_model", "qwen3_5_moe": "language_model"}
# where a causal LM holds its decoder stack (a dotted path), if not at model.model
DECODER_ATTRIBUTES = {"gpt_neox": "gpt_neox", "gpt2": "transformer", "opt": "model.decoder",
                      "gpt_neo": "transformer", "gpt_bigcode": "transformer", "gptj": "transformer",
                      "falcon": "transformer", "codegen": "transformer", "bloom": "transformer",
                      "mpt": "transformer", "mamba2": "backbone", "mamba": "backbone", "falcon_mamba": "backbone"}
# LayerNorm models: their norm modules (mean subtracted; with weight and bias, weight only
# (Cohere) or neither (OLMo)) are called as HF calls them; their layers run as PyTorch ops
# around the engine's products
LAYER_NORM_TYPES = ("stablelm", "olmo", "phi", "starcoder2", "cohere", "gpt_neox", "gpt2", "opt", "gpt_neo",
                    "gpt_bigcode", "gptj", "falcon", "nemotron", "codegen", "bloom", "mpt", "jais2", "cohere2",
                    "phimoe", "cohere2_moe", "nanochat")
# sparse MoE models (MoEWeights): their layers run as PyTorch ops around the engine's products
MOE_TYPES = ("llama4_text", "qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "granitemoe", "gpt_oss", "granitemoeshared",
             "granitemoe_swa", "glm4_moe", "dots1", "solar_open", "exaone_moe", "flex_olmo", "hunyuan_v1_moe",
             "ernie4_5_moe", "minimax_m2", "phimoe", "cohere2_moe", "sarvam_moe", "mellum", "lfm2_moe", "qwen3_5_moe_text", "qwen3_5_moe",
             "jamba", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "qwen3_next", "mistral4", "axk1", "nemotron_h",
             "sarvam_mla", "kolibri1", "afmoe", "hy_v3")
# MoE models routing as DeepSeek-V3 (GLM-4.5, dots.llm1, Solar Open): sigmoid scores of
# float32 router logits, experts chosen by score + e_score_correction_bias within the best
# groups, and an ungated shared MLP (`shared_experts`)
SIGMOID_ROUTER_TYPES = ("glm4_moe", "dots1", "solar_open", "exaone_moe", "sarvam_moe", "deepseek_v3", "sarvam_mla",
                        "glm4_moe_lite", "axk1")
# Granite MoE and its kin: the softmax of the top-k router logits; GraniteMoeShared and
# Granite-MoE-SWA add the layer's ungated shared MLP (`shared_mlp`, gate and up rows fused)
GRANITE_MOE_TYPES = ("granitemoe", "granitemoeshared", "granitemoe_swa", "granitemoehybrid")
# models whose attention modules hold a learnable sink per head (`sinks`: one more logit in
# each softmax's denominator, of value 0)
ATTENTION_SINK_TYPES = ("gpt_oss", "granite_swa", "granitemoe_swa")
# models rotating each layer by a RoPE base of its own (layer_rope_theta; 0: no RoPE), one
# rotary module per distinct base (`rotary_embs`, in ascending base order)
PER_LAYER_THETA_TYPES = ("granite_swa", "granitemoe_swa")
# models whose rotary module gives tables of half a head's width (the angles once: GPT-OSS's
# rotation of the two halves), doubled here into the rotate_half form
HALF_WIDTH_ROPE_TYPES = ("gpt_oss",)
# models with a plain MLP (up -> act -> down, no gate): HF's own activation module runs it
PLAIN_MLP_TYPES = ("phi", "starcoder2", "gpt_neox", "arcee", "apertus", "apertus1p5_text", "gpt2", "opt", "gpt_neo", "gpt_bigcode",
                   "gptj", "falcon", "nemotron", "codegen", "bloom", "mpt", "jais2",
                   "nanochat")
# models with learned absolute position embeddings (GPT-2's wpe, OPT's embed_positions) and
# no RoPE: the position's row is added to the token's before the first layer
LEARNED_POSITION_TYPES = ("gpt2", "opt", "gpt_neo", "gpt_bigcode")
# models without GQA: a num_key_value_heads their config carries is not read
# (GPT-BigCode: MHA, or one KV head where multi_query)
MHA_ONLY_TYPES = ("gpt_neox", "gpt2", "opt", "gpt_neo", "gpt_bigcode", "gptj", "codegen", "bloom", "mpt")
# models whose attention scores get ALiBi's per-head slope times the key's position (no RoPE,
# no position embedding); their embedding rows are normed before the first layer (Bloom)
ALIBI_TYPES = ("bloom", "mpt")
# models whose forward adds the token embedding of each token_type_ids value (0 included)
# to the rows: the engine does not, so generate() refuses token_type_ids for them
TOKEN_TYPE_EMBEDDING_TYPES = ("gpt2", "gpt_bigcode", "gpt_neo", "gptj", "codegen")
# models whose projections are transformers' Conv1D (weight [in, out]: TransposedLinear)
CONV1D_TYPES = ("gpt2",)
# HF's ACT2FN names of the gated MLP's activation: SiLU, or GELU's tanh approximation (Gemma)
SILU_NAMES = ("silu", "swish")
GELU_TANH_NAMES = ("gelu_pytorch_tanh",)
CPU_ONLY_REFUSAL = (
    "this model soft-caps its attention scores (Gemma 2), rotates its layer types by their own "
    "RoPE (Gemma 3, OLMo 3), turns adjacent pairs in its RoPE (GLM, ERNIE 4.5, Cohere), or has "
    "LayerNorms (StableLM, OLMo 1, Phi, StarCoder 2, GPT-NeoX, GPT-2, OPT, GPT-Neo, GPT-BigCode, "
    "GPT-J, CodeGen, Falcon, Nemotron, Bloom, MPT, Jais 2, Cohere 2, PhiMoE, NanoChat), MoE blocks, "
    "attention sinks (GPT-OSS, Granite-SWA), q/k norms after RoPE (HunYuan), short convolutions "
    "(LFM2), gated DeltaNets (Qwen 3.5, Qwen3-Next), Mamba mixers (Granite 4.0-H, Falcon-H1, Mamba) or latent "
    "attention (DeepSeek-V2 / V3, Youtu-LLM, GLM-4.7-Flash, MiniCPM3, Mistral 4), which the engine's "
    "CUDA programs do not serve yet: use it on the CPU, or plain "
    "model.generate()")
# models whose RMSNorm scales by (1 + w), in float32, then rounds to the input's dtype
NORM_PLUS_ONE_TYPES = ("gemma", "gemma2", "gemma3_text", "vaultgemma") + QWEN3_5_TYPES
# models whose RoPE turns adjacent pairs of a head's dimensions, not its two halves
ROPE_PAIRS_TYPES = ("glm", "glm4", "ernie4_5", "cohere", "helium", "gptj", "codegen", "cohere2", "ernie4_5_moe",
                    "cohere2_moe", "llama4_text")
# of them, those whose rotary module gives the halves' tables, interleaved by their
# apply_rotary_pos_emb (Cohere's module interleaves its own)
HALF_TABLE_PAIRS_TYPES = ("glm", "glm4", "ernie4_5", "helium", "gptj", "codegen", "ernie4_5_moe")
# models whose per-head q/k norms come after RoPE
QK_NORM_AFTER_ROPE_TYPES = ("hunyuan_v1_dense", "hunyuan_v1_moe", "nanochat", "llama4_text")
# models whose full-attention layers go unrotated when the model has a sliding window
GLOBAL_NOPE_TYPES = ("exaone4", "exaone_moe", "kolibri1")
# models that rotate q and k in their sliding layers only (Cohere 2: its full-attention
# layers are NoPE whatever the window)
SLIDING_ROPE_TYPES = ("cohere2", "cohere2_moe")
# Gemma 2 and 3 (VaultGemma: Gemma 2 without the blocks' output norms): query_pre_attn_scalar,
# soft caps (Gemma 3's are None), hidden_activation
GEMMA_LATER_TYPES = ("gemma2", "gemma3_text", "vaultgemma")
# Granite's four multipliers (HyperCLOVAX: Granite's, its logits multiplied by logits_scaling)
GRANITE_MULTIPLIER_TYPES = ("granite", "hyperclovax", "granite_swa") + GRANITE_MOE_TYPES
# layers whose state or cached weight views the engine keeps across steps: not streamed
# from accelerate's offload (dispatch.py)
STATEFUL_MIXER_TYPES = LATENT_ATTENTION_TYPES + SHORT_CONV_TYPES + DELTA_NET_TYPES + MAMBA2_TYPES + MAMBA1_TYPES


class RowSlice:
    """Rows [lo, hi) of a fused projection (Phi-3's qkv_proj and gate_up_proj) as a linear
    layer of its own: its weight (and bias) are views of the module's own, never copies; a
    row range of a row-major weight is contiguous, so every layout reads it as a matrix."""

    def __init__(self, fused: torch.nn.Linear, lo: int, hi: int):
        self.weight = fused.weight[lo:hi]
        self.bias = None if fused.bias is None else fused.bias[lo:hi]
        self.in_features = fused.in_features
        self.out_features = hi - lo

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MatrixView:
    """A weight matrix held by a module that is not an nn.Linear (an MoE router's, one
    expert's slice of a 3D expert weight) as a linear layer: a view of the module's own
    tensor [out, in] (contiguous: its leading index picks whole matrices; or the transpose
    of one stored [in, out], GPT-OSS's experts, which the C++ product reads in place), and
    its bias where it has one (GPT-OSS's router and experts)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # a float32 x on a 16-bit router weight (DeepSeek-V3's routing): the weight widened
        # exactly, as HF's router does
        return F.linear(x, self.weight.to(x.dtype), self.bias)


class TransposedLinear:
    """GPT-2's Conv1D (its weight stored [in, out]: y = x @ weight + bias), or the column
    range [lo, hi) of one (c_attn's q, k and v), as a linear layer: `weight` is a view
    [out, in] of the module's own tensor (never a copy; the engine's C++ product reads its
    transpose in place, `rows_linear_t`)."""

    def __init__(self, conv: torch.nn.Module, lo: int = 0, hi: int | None = None):
        hi = conv.weight.shape[1] if hi is None else hi
        self.weight = conv.weight[:, lo:hi].t()
        self.bias = None if conv.bias is None else conv.bias[lo:hi]
        self.out_features, self.in_features = self.weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class MoEWeights:
    """A sparse MoE block, HF's maths: the router's logits (on the rows widened to float32
    where `router_input_float32`), `route` (routing.py: the form of this model's router, its
    constants bound) -> each row's experts and weights; each chosen expert act(gate) * up ->
    down on its rows (GPT-OSS: HF's own `gate_fn` on the whole gate_up product), times the
    row's weight, added to a zero row in ascending expert order; then the shared MLP's
    output, if any."""

    router: MatrixView  # [E, H]
    gate_up: list  # per expert, a MatrixView [2I, H]: the gate's rows, then up's
    down: list  # per expert, a MatrixView [H, I]
    act: torch.nn.Module | None  # HF's own activation module (None where gate_fn)
    # (logits [n, E], the rows' dtype) -> (weights [n, k], experts [n, k])
    route: Callable
    # the router's product on the rows widened to float32 (DeepSeek-V3's and ERNIE's routing;
    # HunYuan-MoE's where its router weight is float32), else on the rows as they are
    router_input_float32: bool = False
    # GPT-OSS: gate_up's product -> the experts' hidden rows, HF's own function
    gate_fn: Callable | None = None
    # a shared MLP (gate, up, down: Qwen2-MoE's shared expert, DeepSeek-V3's shared_experts,
    # GraniteMoeShared's shared_mlp) and, Qwen2-MoE's, its sigmoid gate [1, H]:
    # sigmoid(shared_gate(x)) * shared(x) added after the experts' (no gate: shared(x) added)
    shared: tuple | None = None
    shared_gate: torch.nn.Linear | None = None
    # Cohere 2 MoE's "average": (experts + shared) / 2 (else their sum)
    shared_average: bool = False
    # Llama 4: a row's weight scales its rows into the expert (act(gate(w x)) * up(w x) ->
    # down), not the expert's output
    weights_scale_inputs: bool = False
    # False: Nemotron-H's ungated experts, act(up x) -> down (gate_up then holds each expert's
    # up matrix), and its shared MLP likewise (shared = (None, up, down))
    gated: bool = True

    @property
    def linears(self) -> tuple:
        """The router's and every expert's matrices (and the shared expert's)."""
        shared = () if self.shared is None else (*self.shared, self.shared_gate)
        return (self.router, *self.gate_up, *self.down, *(lin for lin in shared if lin is not None))


@dataclass
class ShortConvWeights:
    """LFM2's gated short convolution, HF's maths: B, C, x = in_proj(h)'s three column
    blocks; Bx = B * x goes into the layer's conv cache at the row's slot; y = the depthwise
    causal convolution of Bx over the row's last `kernel.shape[1]` positions (its own and its
    predecessors', zeros before the first); out_proj(C * y) joins the residual stream."""

    in_proj: torch.nn.Linear  # [3H, H]
    kernel: torch.Tensor  # [H, K], a view of the Conv1d's weight [H, 1, K]
    bias: torch.Tensor | None  # [H] (conv_bias)
    out_proj: torch.nn.Linear  # [H, H]

    @property
    def linears(self) -> tuple:
        return (self.in_proj, self.out_proj)


@dataclass
class GatedDeltaNetWeights:
    """Qwen 3.5's gated DeltaNet, HF's decode maths: qkv = in_proj_qkv(h) goes into the
    layer's conv cache at the row's slot and is convolved over the row's last K positions
    (as ShortConvWeights), SiLU; q, k (l2-normed, q scaled by dk^-0.5) and v per head; a
    float32 state [Hv, dk, dv] per row, from its predecessor's: decayed by exp(g), g =
    -exp(A_log) * softplus(in_proj_a(h) + dt_bias), then the delta rule with beta =
    sigmoid(in_proj_b(h)); the row's output state^T q, RMS-normed per head (norm_weight,
    plain) and gated by silu(in_proj_z(h)); out_proj joins the residual stream."""

    in_qkv: tuple  # [2 Hk dk + Hv dv, H] in one linear (Qwen 3.5) or q, k, v in three (OLMo Hybrid)
    in_z: torch.nn.Linear | None  # [Hv dv, H] (None: `grouped`)
    in_b: torch.nn.Linear  # [Hv, H]
    in_a: torch.nn.Linear | None  # [Hv, H] (None: `grouped`)
    kernel: torch.Tensor  # [2 Hk dk + Hv dv, K], a view of the Conv1d's weight
    dt_bias: torch.Tensor  # [Hv]
    a_log: torch.Tensor  # [Hv]
    norm_weight: torch.Tensor  # [dv]
    norm_eps: float
    out_proj: torch.nn.Linear  # [H, Hv dv]
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    beta_scale: float = 1.0  # OLMo Hybrid's allow_neg_eigval: beta in (0, 2)
    # Qwen3-Next: in_qkv is one linear holding per key head its q, k, v and z rows (its
    # value heads' v, then their z), in_b one holding per key head its value heads' b, then a
    grouped: bool = False

    @property
    def linears(self) -> tuple:
        return tuple(lin for lin in (*self.in_qkv, self.in_z, self.in_b, self.in_a, self.out_proj) if lin is not None)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.k_dim, self.v_dim)


@dataclass
class Mamba2Weights:
    """A Mamba2 mixer (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1, Mamba2), HF's single-token decode maths
    (mamba2_selective_state_update): z, xBC, dt = in_proj(h)'s column blocks; xBC goes into
    the layer's conv cache at the row's slot and is convolved over the row's last K
    positions (with the conv's bias), SiLU, then split into x [Hm, dh] and B, C [G, N] (head
    h reads group h // (Hm / G)); dt = softplus(dt + dt_bias); a float32 state [Hm, dh, N]
    per row, from its predecessor's: state * exp(dt * A) + (dt * B) * x, A = -exp(A_log);
    the output state . C (in the model's dtype) + D * x, through the gated RMSNorm
    (silu(z), per group of `norm_group` channels), then out_proj."""

    in_proj: torch.nn.Linear  # [I + conv channels + Hm, H]: z, xBC, dt
    kernel: torch.Tensor  # [I + 2 G N, K], a view of the Conv1d's weight
    conv_bias: torch.Tensor | None  # [I + 2 G N]
    dt_bias: torch.Tensor  # [Hm]
    a_log: torch.Tensor  # [Hm]
    d: torch.Tensor  # [Hm]
    # the gated RMSNorm's weight [I]; None (Falcon-H1 without mamba_rms_norm): the output is
    # gated by silu(z) in the model's dtype, unnormed
    norm_weight: torch.Tensor | None
    norm_eps: float
    norm_group: int  # channels per group of the gated RMSNorm
    out_proj: torch.nn.Linear  # [H, I]
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    # HF's chunked prefill bounds the time steps by these (its decode steps do not)
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    # Falcon-H1's gated RMSNorm: its weight multiplies in float32, the gate after the norm
    # where norm_before_gate (Granite's: weight * the rounded norm, gated before it)
    norm_in_float32: bool = False
    norm_before_gate: bool = False
    # Falcon-H1's muP: the input scaled, in_proj's columns by its mup_vector [P], the output
    in_scale: float = 1.0
    projection_scale: torch.Tensor | None = None
    out_scale: float = 1.0

    @property
    def linears(self) -> tuple:
        return (self.in_proj, self.out_proj)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass
class Mamba1Weights:
    """The first Mamba's mixer (Mamba, Falcon Mamba, Jamba), HF's single-token decode maths
    (mamba_selective_state_update): x, z = in_proj(h)'s halves; x goes into the layer's conv
    cache and is convolved over the row's last K positions (with the conv's bias), SiLU;
    dt_rank, B, C = x_proj(x) (Falcon Mamba, Jamba: each RMS-normed by its module); dt =
    softplus(dt_proj.weight dt_rank + dt_proj.bias); a float32 state [I, N] per row, from
    its predecessor's: state * exp(dt A) + (dt B) x in float32, A = -exp(A_log) [I, N]; the
    output state . C (in the model's dtype) + D x, times silu(z), then out_proj."""

    in_proj: torch.nn.Linear  # [2I, H]: x, z
    kernel: torch.Tensor  # [I, K], a view of the Conv1d's weight
    conv_bias: torch.Tensor | None  # [I]
    x_proj: torch.nn.Linear  # [R + 2N, I]: dt's low-rank input, B, C
    dt_weight: MatrixView  # [I, R]: dt_proj's weight (its bias added after, as HF adds it)
    dt_bias: torch.Tensor  # [I]
    a_log: torch.Tensor  # [I, N]
    d: torch.Tensor  # [I]
    out_proj: torch.nn.Linear  # [H, I]
    rank: int
    state_size: int
    # Falcon Mamba's (weightless) or Jamba's RMS norms of dt's input, B and C (HF's own
    # modules), or None
    norms: tuple | None = None

    @property
    def linears(self) -> tuple:
        return (self.in_proj, self.x_proj, self.dt_weight, self.out_proj)

    @property
    def state_shape(self) -> tuple[int, int]:
        return tuple(self.a_log.shape)


@dataclass
class LatentAttentionWeights:
    """Multi-head latent attention (DeepSeek-V2 / V3, Youtu-LLM, GLM-4.7-Flash, MiniCPM3,
    Mistral 4), HF's maths: q = q_b(norm(q_a(h))) (or q_proj(h) without a query LoRA), each
    head's [nope | rope] columns; kv_a(h) = [latent | k_rope]; k_nope and v of each head =
    kv_b(norm(latent)); k_rope, one for all heads, and each head's q_rope are rotated;
    k = [k_nope | k_rope].

    The engine keeps what HF's cache keeps, one [normed latent | turned k_rope] per position
    (a single KV head, its values the same tensor as its keys), and moves kv_b to the
    queries and outputs instead of to every cached position: each head's q_nope times its
    key rows of kv_b (`k_up`) gives a query against the latents (q_nope . (W c) = (W^T
    q_nope) . c), and each head's attention-weighted latent times its value rows (`v_up`)
    its output. Both are products per head, so each is a row-invariant product of the
    engine's (views of kv_b's weight, no copies)."""

    q: torch.nn.Linear | None  # [Hq*(nope+rope), H]; None: q_a, q_a_norm, q_b
    q_a: torch.nn.Linear | None  # [q_rank, H]
    q_a_norm: torch.Tensor | None  # [q_rank]
    q_b: torch.nn.Linear | None  # [Hq*(nope+rope), q_rank]
    kv_a: torch.nn.Linear  # [kv_rank + rope, H]: kv_a_proj_with_mqa
    kv_a_norm: torch.Tensor  # [kv_rank]
    k_up: list  # per head, a MatrixView [kv_rank, nope]: its key rows of kv_b, transposed
    v_up: list  # per head, a MatrixView [v, kv_rank]: its value rows of kv_b
    nope_dim: int
    rope_dim: int
    kv_rank: int
    norm_eps: float  # the latent norms' own (HF builds them with its default, 1e-6)
    # how HF rotates the rope columns: "half" (rotate_half), "pairs_to_half" (DeepSeek-V3's
    # rope_interleave: the even and odd columns rotated as pairs, written as halves),
    # "complex" (DeepSeek-V2: pairs in float32 complex numbers, written as pairs)
    rope_form: str

    @property
    def linears(self) -> tuple:
        return tuple(lin for lin in (self.q, self.q_a, self.q_b, self.kv_a) if lin is not None) \
            + tuple(self.k_up) + tuple(self.v_up)


@dataclass
class LayerWeights:
    """Parameters of one decoder layer, shared with the HF module (no copies).

    The layer: h += residual(attn_out_norm(o(attention(input_norm(h))))), then
    h += residual(mlp_out_norm(mlp(post_norm(h)))), each norm left out where it is None:
    Llama-family layers norm the blocks' inputs (input_norm, post_norm), OLMo 2 their
    outputs (attn_out_norm, mlp_out_norm), Gemma 2 and 3 both. A parallel layer (Phi,
    Cohere, GPT-NeoX; LayeredModel.parallel) adds the attention's and the MLP's outputs of
    the same input to h at once. A norm is an RMSNorm's weight, or (LayerNorm models) the
    HF norm module itself, called as HF calls it. The MLP is act(gate) * up -> down, or
    where `gate` is None (a plain MLP: Phi's fc1/fc2) act(up) -> down with the model's own
    activation module `act`."""

    input_norm: torch.Tensor | torch.nn.Module | None  # [H]
    q: torch.nn.Linear | RowSlice | None  # None: q, k and v come from `qkv` (or `conv`)
    k: torch.nn.Linear | RowSlice | None
    v: torch.nn.Linear | RowSlice | None
    o: torch.nn.Linear | None  # None: a short-convolution layer
    # q/k norms: [d] on each head (Qwen3), [Hq*d] / [Hkv*d] on the whole projection (OLMo 2);
    # Cohere's LayerNorm modules, on [R, heads, d]
    q_norm: torch.Tensor | torch.nn.Module | None
    k_norm: torch.Tensor | torch.nn.Module | None
    post_norm: torch.Tensor | torch.nn.Module | None  # [H], the MLP's input norm
    gate: torch.nn.Linear | RowSlice | None
    up: torch.nn.Linear | RowSlice | None  # None: an MoE block (moe) instead of the MLP, or none (has_mlp)
    down: torch.nn.Linear | None
    attn_out_norm: torch.Tensor | None = None  # [H]
    mlp_out_norm: torch.Tensor | None = None  # [H]
    act: torch.nn.Module | None = None  # a plain MLP's activation (HF's own module)
    # q, k and v in one weight: one product, split by a view as `qkv_layout` says
    qkv: torch.nn.Linear | None = None
    # "per_head": rows [heads, 3, head_dim] (GPT-NeoX, GPT-BigCode's and Falcon's MHA forms);
    # "grouped": per KV head [kv_heads, group + 2, head_dim], its query heads, then its key
    # and value (Falcon's new architecture); "shards": [4, 3, E / 4], per model-parallel
    # shard its query, value and key rows (CodeGen), each shard a quarter of the heads
    qkv_layout: str = "per_head"
    moe: MoEWeights | None = None
    # LFM2's convolution layers: this block in place of the attention (q, k, v, o None)
    conv: ShortConvWeights | None = None
    # Qwen 3.5's DeltaNet layers: this block in place of the attention (q, k, v, o None)
    delta: GatedDeltaNetWeights | None = None
    # the Mamba2 layers (Granite 4.0-H, Bamba, Nemotron-H, Mamba2): this block in place of the
    # attention (q, k, v, o None); Falcon-H1's: beside its attention
    mamba: Mamba2Weights | None = None
    # the first Mamba's layers: this block alone (Mamba, Falcon Mamba), or before an MLP (Jamba)
    mamba1: Mamba1Weights | None = None
    # LFM3's attention gate [Hq, H]: each head's output times sigmoid(its row . x)
    head_gate: torch.nn.Linear | None = None
    # DeepSeek's latent attention in place of q, k and v (o its o_proj)
    latent: LatentAttentionWeights | None = None
    # AFMoE's attention gate [Hq*d, H]: the attention's output times sigmoid(its product), per element
    out_gate: torch.nn.Linear | None = None

    @property
    def linears(self) -> tuple:
        """The layer's projections (a plain MLP has no gate; an MoE block's router and every
        expert's matrices; a convolution, DeltaNet or Mamba layer's projections)."""
        return tuple(lin for lin in (self.q, self.k, self.v, self.qkv, self.o, self.gate, self.up, self.down)
                     if lin is not None) + (() if self.moe is None else self.moe.linears) \
            + tuple(lin for block in (self.conv, self.delta, self.mamba, self.mamba1, self.latent) if block is not None
                    for lin in block.linears) \
            + (() if self.head_gate is None else (self.head_gate,)) + (() if self.out_gate is None else (self.out_gate,))

    @property
    def has_mixer(self) -> bool:
        """Whether the layer mixes tokens (attention, a convolution, a DeltaNet or a Mamba): all
        but a Nemotron-H MLP layer do."""
        return self.o is not None or any(block is not None for block in (self.conv, self.delta, self.mamba, self.mamba1))

    @property
    def has_mlp(self) -> bool:
        """Whether the layer has an MLP or MoE block: all but Nemotron-H's token-mixer layers and
        the attention-free Mambas' do."""
        return self.up is not None or self.moe is not None

    @property
    def intermediate_size(self) -> int:
        """The MLP's (an expert's) intermediate width (0: no MLP)."""
        if self.moe is not None:
            return self.moe.down[0].in_features
        return 0 if self.up is None else self.up.weight.shape[0]

    @property
    def norms_inputs_only(self) -> bool:
        """The Llama form: both blocks' inputs normed, neither output."""
        return (self.input_norm is not None and self.post_norm is not None
                and self.attn_out_norm is None and self.mlp_out_norm is None)


# weight dtypes the engine's layouts may serve (each layout's self-test decides on this machine)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# the projections an attention block may hold: separate q/k/v, Phi-3's fused rows, Phi's
# `dense` output, GPT-NeoX's q/k/v fused per head
ATTENTION_PROJECTIONS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("qkv_proj", "o_proj"),
                         ("q_proj", "k_proj", "v_proj", "dense"), ("query_key_value", "dense"),
                         ("c_attn", "c_proj"), ("q_proj", "k_proj", "v_proj", "out_proj"), ("qkv_proj", "out_proj"),
                         ("Wqkv", "out_proj"), ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                         ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
# and an MLP: gated (separate or Phi-3's fused gate/up), or plain (Phi, StarCoder 2, GPT-NeoX,
# Arcee, Apertus)
MLP_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"), ("fc1", "fc2"),
                   ("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"), ("up_proj", "down_proj"),
                   ("fc_in", "fc_out"), ("w1", "w3", "w2"), ("input_linear", "output_linear"))


def _projection_names(module, options) -> tuple[str, ...]:
    """The first of `options` (names of projections) the block holds all of; the first
    option where none fits (its missing projection is then refused by name)."""
    for names in options:
        if all(getattr(module, name, None) is not None for name in names):
            return names
    return options[0]


def _one_block(layer) -> str | None:
    """A Nemotron-H layer's one block's type ("linear_attention", "full_attention", "mlp",
    "moe"; its `mixer`), or "linear_attention" for a Mamba2 / Mamba block (a `mixer` with
    A_log, no block_type); None for a layer of a token mixer and an MLP."""
    kind = getattr(layer, "block_type", None)
    if hasattr(layer, "mixer") and not isinstance(kind, str) and hasattr(layer.mixer, "A_log"):
        return "linear_attention"
    return kind if hasattr(layer, "mixer") and isinstance(kind, str) else None


def _mlp_path(layer) -> str:
    """Where a decoder layer holds its MLP or MoE block: "mlp." (Granite MoE:
    "block_sparse_moe."; a dense Granite 4.0 layer, whose block_sparse_moe is None: its
    "shared_mlp."; a Nemotron-H MLP layer: "mixer."), or "" where the layer holds the MLP's
    projections itself (OPT's fc1 / fc2)."""
    if _one_block(layer) is not None:
        return "mixer."
    for name in ("mlp", "block_sparse_moe", "ffn", "feed_forward", "shared_mlp"):  # MPT: ffn, LFM2: feed_forward
        if getattr(layer, name, None) is not None:
            return name + "."
    return ""


def _mlp_block(layer):
    """A decoder layer's MLP or MoE block (the layer itself for OPT: `_mlp_path`); None for a
    Nemotron-H layer whose one block is a token mixer."""
    if _one_block(layer) is not None:
        return layer.mixer if _one_block(layer) in ("mlp", "moe") else None
    path = _mlp_path(layer)
    return getattr(layer, path[:-1]) if path else layer


def _attention(layer):
    """A decoder layer's attention block (GPT-NeoX names it `attention`, GPT-2 `attn`; GPT-Neo's
    `attn` holds it as `attention`); None for LFM2's convolution and Qwen 3.5's DeltaNet layers."""
    if _one_block(layer) is not None:  # Nemotron-H: its attention layers' one block
        return layer.mixer if _one_block(layer) == "full_attention" else None
    for name in ("self_attn", "attention", "attn", "self_attention"):
        if hasattr(layer, name):
            block = getattr(layer, name)
            return block.attention if name == "attn" and hasattr(block, "attention") else block
    return None


def _attention_name(layer) -> str:
    """Where `_attention` finds the block, as a module path ("attn.attention": GPT-Neo)."""
    if _one_block(layer) is not None:
        return "mixer"
    name = next((name for name in ("self_attn", "attention", "attn", "self_attention") if hasattr(layer, name)),
                "self_attn")
    return "attn.attention" if name == "attn" and hasattr(layer.attn, "attention") else name


def decoder_layers(inner) -> torch.nn.ModuleList | None:
    """The decoder's layer stack (GPT-2 names it `h`, MPT `blocks`)."""
    for name in ("layers", "h", "blocks"):
        if getattr(inner, name, None) is not None:
            return getattr(inner, name)
    return None


def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def _dequantized_gguf(quantization) -> bool:
    """A quantization_config (dict or object) of method GGUF: transformers' `gguf_file=` loader
    dequantises every block to float weights and only leaves this marker (and its quantizer)
    on the model, so nothing quantized remains; each projection's float dtype is still checked
    (_check_plain_linear), and compact reads pick up the blocks (engine/compact.py)."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) \
        else getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "gguf"


def _check_plain_linear(name: str, module, model_type: str | None = None) -> None:
    """The engine runs a projection as `x @ weight^T (+ bias)` on the module's own float
    weight (GPT-2's transformers Conv1D: x @ weight + bias; Falcon's FalconLinear, an
    nn.Linear computing the same): a subclass (bitsandbytes, GPTQ, AWQ, LoRA wrappers) or an
    integer weight would be computed wrongly, so refuse it by name."""
    weight = getattr(module, "weight", None)
    expected = _conv1d_class() if model_type in CONV1D_TYPES else torch.nn.Linear
    if model_type == "falcon" and type(module) is not torch.nn.Linear:
        from transformers.models.falcon.modeling_falcon import FalconLinear

        expected = FalconLinear
    if type(module) is not expected or not isinstance(weight, torch.Tensor) \
            or weight.dtype not in FLOAT_DTYPES:
        kind = type(module).__module__ + "." + type(module).__qualname__
        dtype = getattr(weight, "dtype", None)
        raise UnsupportedModelError(
            f"{name} is a {kind} (weight dtype {dtype}); the engine runs plain "
            f"{expected.__module__}.{expected.__qualname__} projections with float weights "
            f"({', '.join(str(d) for d in FLOAT_DTYPES)}) only. "
            "Quantized or wrapped layers are not supported: use plain model.generate().")


def _check_short_conv(name: str, conv, channels: int) -> None:
    """LFM2's convolution: a plain depthwise, causal nn.Conv1d with a float weight [H, 1, K]
    (the engine convolves each channel over a row's last K positions)."""
    weight = getattr(conv, "weight", None)
    if type(conv) is not torch.nn.Conv1d or not isinstance(weight, torch.Tensor) \
            or weight.dtype not in FLOAT_DTYPES or conv.groups != channels or weight.dim() != 3 \
            or weight.shape[:2] != (channels, 1) or conv.stride != (1,) or conv.dilation != (1,):
        kind = type(conv).__module__ + "." + type(conv).__qualname__
        raise UnsupportedModelError(
            f"{name} is a {kind} (weight {getattr(weight, 'dtype', None)}, shape "
            f"{tuple(getattr(weight, 'shape', ()))}); the engine runs LFM2's plain depthwise "
            f"torch.nn.Conv1d over {channels} channels with float weights only: use plain model.generate()")


def _mixer_projections(layer, model_type: str) -> tuple[str, object, tuple[str, ...]]:
    """Where a decoder layer's token mixer sits (a module path prefix), the module, and the
    names of its projections: its attention's (LFM3's head gate, AFMoE's output gate too), LFM2's convolution's,
    or a DeltaNet's."""
    attn = _attention(layer)
    if attn is not None or model_type not in SHORT_CONV_TYPES + DELTA_NET_TYPES + MAMBA2_TYPES + MAMBA1_TYPES:
        names = _projection_names(attn, ATTENTION_PROJECTIONS)
        if model_type == "lfm3" and getattr(attn, "g_proj", None) is not None:
            names += ("g_proj",)
        if model_type == "afmoe":  # its attention's output gate
            names += ("gate_proj",)
        return _attention_name(layer) + ".", attn, names
    if model_type in SHORT_CONV_TYPES:
        return "conv.", getattr(layer, "conv", None), ("in_proj", "out_proj")
    if model_type in MAMBA2_TYPES + MAMBA1_TYPES:
        if _one_block(layer) in ("mlp", "moe"):  # a Nemotron-H layer without a token mixer
            return "", None, ()
        if model_type in MAMBA1_TYPES:
            return _mamba1_path(layer), _mamba1_block(layer), ("in_proj", "x_proj", "dt_proj", "out_proj")
        return ("mixer." if _one_block(layer) else "mamba."), _mamba2_block(layer), ("in_proj", "out_proj")
    return "linear_attn.", getattr(layer, "linear_attn", None), _delta_net_names(model_type)


def _delta_net_names(model_type: str) -> tuple[str, ...]:
    """The names of a DeltaNet's projections (DELTA_NET_PROJECTIONS), flat."""
    qkv, *rest = DELTA_NET_PROJECTIONS.get(model_type, QWEN3_5_DELTA_NET_PROJECTIONS)
    return (*qkv, *(name for name in rest if name is not None))


def _check_delta_net(name: str, block) -> None:
    """Qwen 3.5's (OLMo Hybrid's) gated DeltaNet as GatedDeltaNetWeights reads it: a plain
    depthwise Conv1d without bias over the q/k/v channels, SiLU, float dt_bias / A_log [Hv],
    a gated RMSNorm [dv] (`norm`, OLMo Hybrid's `o_norm`), value heads a multiple of the key
    heads."""
    norm = getattr(block, "norm", None) or getattr(block, "o_norm", None)
    if block is None or norm is None or not all(hasattr(block, a) for a in (
            "conv1d", "dt_bias", "A_log", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")):
        raise UnsupportedModelError(f"{name} is not a gated DeltaNet the engine knows; use plain model.generate()")
    conv = block.conv1d
    _check_short_conv(f"{name}.conv1d", conv, 2 * block.num_k_heads * block.head_k_dim
                      + block.num_v_heads * block.head_v_dim)
    params = (block.dt_bias, block.A_log, getattr(norm, "weight", None))
    if conv.bias is not None or getattr(block, "activation", None) not in SILU_NAMES \
            or block.num_v_heads % block.num_k_heads \
            or any(not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES for p in params) \
            or norm.weight.shape != (block.head_v_dim,):
        raise UnsupportedModelError(
            f"{name}: the engine runs Qwen 3.5's gated DeltaNet with a SiLU convolution without bias, float "
            "dt_bias / A_log and a gated RMSNorm per value head only; use plain model.generate()")


def _check_mamba1(name: str, block) -> None:
    """The first Mamba's mixer as Mamba1Weights reads it: a plain depthwise Conv1d over x,
    SiLU, float A_log [I, N] and D [I], dt_proj with its bias."""
    names = ("conv1d", "A_log", "D", "x_proj", "dt_proj", "in_proj", "out_proj", "time_step_rank", "ssm_state_size",
             "intermediate_size")
    if block is None or not all(hasattr(block, a) for a in names):
        raise UnsupportedModelError(f"{name} is not a Mamba mixer the engine knows; use plain model.generate()")
    inner, n = block.intermediate_size, block.ssm_state_size
    _check_short_conv(f"{name}.conv1d", block.conv1d, inner)
    _check_plain_linear(f"{name}.dt_proj", block.dt_proj)  # (a wrapped one named before its bias is read)
    params = (block.A_log, block.D, getattr(block.dt_proj, "bias", None))
    if getattr(block, "activation", None) not in SILU_NAMES \
            or any(not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES for p in params) \
            or block.A_log.shape != (inner, n) or block.D.shape != (inner,):
        raise UnsupportedModelError(
            f"{name}: the engine runs Mamba mixers with a SiLU convolution, float A_log [I, N] and D [I] and a "
            "dt_proj with its bias only; use plain model.generate()")


def _mamba1_path(layer) -> str:
    """Where a layer holds its first-Mamba mixer: "mamba." (Jamba) or "mixer." (Mamba)."""
    return "mamba." if hasattr(layer, "mamba") else "mixer."


def _mamba1_block(layer):
    """A layer's first-Mamba mixer (Jamba: `mamba`; Mamba, Falcon Mamba: `mixer`), or None."""
    return getattr(layer, _mamba1_path(layer)[:-1], None)


def _mamba2_block(layer):
    """A layer's Mamba2 mixer (Granite 4.0-H, Bamba: `mamba`; Nemotron-H: its one block), or None."""
    if _one_block(layer) is not None:
        return layer.mixer if _one_block(layer) == "linear_attention" else None
    return getattr(layer, "mamba", None)


def _check_mamba2(name: str, block) -> None:
    """A Mamba2 mixer as Mamba2Weights reads it: a plain depthwise Conv1d over x, B and C,
    SiLU, float dt_bias / A_log / D [heads], a gated RMSNorm over the heads' channels in
    whole groups, heads a multiple of the groups."""
    names = ("conv1d", "dt_bias", "A_log", "D", "norm", "num_heads", "head_dim", "ssm_state_size", "n_groups",
             "intermediate_size")
    if block is None or not all(hasattr(block, a) for a in names):
        raise UnsupportedModelError(f"{name} is not a Mamba2 mixer the engine knows; use plain model.generate()")
    inner = block.num_heads * block.head_dim
    _check_short_conv(f"{name}.conv1d", block.conv1d, inner + 2 * block.n_groups * block.ssm_state_size)
    norm_weight = getattr(block.norm, "weight", None)
    group = getattr(block.norm, "group_size", None)
    if isinstance(getattr(block.norm, "n_groups", None), int) and block.norm.n_groups > 0:  # Falcon-H1's
        group = inner // block.norm.n_groups if inner % block.norm.n_groups == 0 else None
    unnormed = type(block.norm) is torch.nn.Identity and getattr(block, "mamba_rms_norm", None) is False
    params = (block.dt_bias, block.A_log, block.D) + (() if unnormed else (norm_weight,))
    if getattr(block, "activation", None) not in SILU_NAMES or block.num_heads % block.n_groups \
            or inner != block.intermediate_size \
            or any(not isinstance(p, torch.Tensor) or p.dtype not in FLOAT_DTYPES for p in params) \
            or not unnormed and (norm_weight.shape != (inner,) or not isinstance(group, int) or group <= 0
                                 or inner % group):
        raise UnsupportedModelError(
            f"{name}: the engine runs Mamba2 mixers with a SiLU convolution, float dt_bias / A_log / D, heads in "
            "whole groups and a gated RMSNorm over whole groups only; use plain model.generate()")


def _check_latent(name: str, attn, num_heads: int) -> None:
    """A latent attention block as LatentAttentionWeights reads it: its dims, projections of
    the widths they imply, RMSNorms (float weights, one eps) of the query and KV latents, an
    even number of rotated columns."""
    dims = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "scaling")
    if attn is None or not all(isinstance(getattr(attn, a, None), (int, float)) for a in dims):
        raise UnsupportedModelError(f"{name} is not a latent attention block the engine knows; "
                                    "use plain model.generate()")
    nope, rope, v, rank = (int(getattr(attn, a)) for a in dims[:4])
    lora = getattr(attn, "q_a_proj", None) is not None
    norms = [getattr(attn, "kv_a_layernorm", None)] + ([getattr(attn, "q_a_layernorm", None)] if lora else [])
    q_out = getattr(getattr(attn, "q_b_proj" if lora else "q_proj", None), "out_features", None)
    kv_a, kv_b = getattr(attn, "kv_a_proj_with_mqa", None), getattr(attn, "kv_b_proj", None)
    eps = getattr(norms[0], "variance_epsilon", None)
    fits = (rope % 2 == 0 and q_out == num_heads * (nope + rope) and isinstance(eps, float)
            and getattr(attn, "num_key_value_groups", 1) == 1
            and getattr(kv_a, "out_features", None) == rank + rope
            and getattr(kv_b, "in_features", None) == rank and getattr(kv_b, "out_features", None) == num_heads * (nope + v)
            and all(isinstance(getattr(n, "weight", None), torch.Tensor) and n.weight.dtype in FLOAT_DTYPES
                    and n.weight.dim() == 1 and getattr(n, "variance_epsilon", None) == eps for n in norms)
            and norms[0].weight.shape[0] == rank)
    if not fits:
        raise UnsupportedModelError(
            f"{name}: the engine runs latent attention with q (or q_a / q_b) of heads x (nope + rope) rows, "
            "kv_a_proj_with_mqa of kv_lora_rank + rope rows, kv_b_proj of heads x (nope + v) rows, RMSNorms of one "
            "eps on the latents, an even rope width and num_key_value_heads == num_attention_heads (HF's own "
            "latent attention fails otherwise) only; use plain model.generate()")


def _first_held(module, names: tuple[str, ...]) -> str:
    """The first of `names` the module holds (the first where it holds none)."""
    return next((name for name in names if hasattr(module, name)), names[0])


def _as_linear(module):
    """A projection as the engine's linear layer: an nn.Linear itself, a Conv1D (GPT-2) as
    its TransposedLinear."""
    return TransposedLinear(module) if isinstance(module, _conv1d_class()) else module


def _router(block):
    """An MoE block's router (Granite MoE names it `router`)."""
    return getattr(block, "gate", None) if hasattr(block, "gate") else getattr(block, "router", None)


def _check_moe(name: str, block, model_type: str | None = None) -> None:
    """An MoE block the engine computes as MoEWeights says: a router with a float weight
    [E, H] and top_k, experts holding exactly gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    float weights (a quantized or biased expert, or another router, is refused by name)."""
    form_check = {"ernie4_5_moe": _check_ernie_moe, "minimax_m2": _check_minimax_moe,
                  "cohere2_moe": _check_cohere2_moe, "lfm2_moe": _check_lfm2_moe, "deepseek_v2": _check_deepseek_v2_moe,
                  "mistral4": _check_mistral4_moe, "kolibri1": _check_kolibri1_moe, "afmoe": _check_afmoe_moe,
                  "hy_v3": _check_hy_v3_moe, "nemotron_h": _check_nemotron_h_moe,
                  **dict.fromkeys(SIGMOID_ROUTER_TYPES, _check_sigmoid_router_moe)}.get(model_type)
    if form_check is not None:  # a router of its own form: checked by its own function
        form_check(name, block)
        return
    # the forms whose experts are stored [in, out]: (whether the block fits, what runs)
    stored_in_out = {
        "llama4_text": (_check_llama4_moe, "for Llama 4 it runs a float top-k router without a bias, experts of "
                                           "gate_up_proj / down_proj stored [in, out] and a gated shared expert only"),
        "gpt_oss": (_check_gpt_oss_moe, "for GPT-OSS it runs a float top-k router with a bias and experts of "
                                        "gate_up_proj / down_proj with their biases only")}.get(model_type)
    if stored_in_out is not None:
        fits, form = stored_in_out
        if fits(name, block):
            return
        raise _moe_refusal(name, block, form)
    router, experts = _router(block), block.experts
    weight = _router_linear(block, model_type).weight if router is not None else None
    fits = (isinstance(weight, torch.Tensor) and weight.dtype in FLOAT_DTYPES and weight.dim() == 2
            and hasattr(router, "top_k") and _standard_experts(experts, weight.shape[0]))
    if fits and model_type == "hunyuan_v1_moe":  # its router's `wg`, its ungated shared MLP in the block
        shared_mlp = getattr(block, "shared_mlp", None)
        fits = router.wg.bias is None and shared_mlp is not None \
            and all(hasattr(shared_mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        for part, module in ((f"{name}.gate.wg", router.wg),
                             *((f"{name}.shared_mlp.{n}", getattr(shared_mlp, n, None))
                               for n in ("gate_proj", "up_proj", "down_proj"))):
            _check_plain_linear(part, module)
    shared, shared_gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    if fits and (shared is not None or shared_gate is not None):  # Qwen2-MoE's: both, plain
        fits = shared is not None and shared_gate is not None and shared_gate.out_features == 1 \
            and all(hasattr(shared, n) for n in ("gate_proj", "up_proj", "down_proj"))
        for part, module in ((f"{name}.shared_expert_gate", shared_gate),
                             *((f"{name}.shared_expert.{n}", getattr(shared, n, None))
                               for n in ("gate_proj", "up_proj", "down_proj"))):
            _check_plain_linear(part, module)
    if not fits:
        raise _moe_refusal(
            name, block, "it runs a float top-k router and experts of gate_up_proj / down_proj only")


def _check_ernie_moe(name: str, block) -> None:
    """ERNIE 4.5's MoE form (MoEWeights.norm_min): a router with a float weight [E, H],
    moe_statics.e_score_correction_bias [1, E], top_k and norm_min; experts of gate_up_proj /
    down_proj; a gated shared MLP (`shared_experts`) or none."""
    router, shared = _router(block), getattr(block, "shared_experts", None)
    bias = getattr(getattr(router, "moe_statics", None), "e_score_correction_bias", None)
    fits = (_float_router_and_experts(block) and isinstance(bias, torch.Tensor)
            and bias.numel() == router.weight.shape[0] and bias.dtype in FLOAT_DTYPES
            and hasattr(router, "norm_min") and _gated_or_none(shared))
    if not fits:
        raise _moe_refusal(
            name, block, "for ERNIE 4.5 it runs a float32 router with a correction bias, experts of gate_up_proj / "
            "down_proj and a gated shared MLP only")
    _check_gated_mlp(f"{name}.shared_experts", shared)


def _check_minimax_moe(name: str, block) -> None:
    """MiniMax-M2's MoE form: a router with a float weight [E, H] and top_k, the block's
    e_score_correction_bias [E], experts of gate_up_proj / down_proj, no shared expert."""
    bias = getattr(block, "e_score_correction_bias", None)
    if not (_float_router_and_experts(block) and isinstance(bias, torch.Tensor)
            and bias.shape == (_router(block).weight.shape[0],) and bias.dtype in FLOAT_DTYPES
            and bias.shape[0] >= 2 and not hasattr(block, "shared_experts")):
        raise _moe_refusal(
            name, block, "for MiniMax-M2 it runs a sigmoid router with a correction bias and experts of gate_up_proj / "
            "down_proj only")


def _check_lfm2_moe(name: str, block) -> None:
    """LFM2-MoE's form: a router with a float weight [E, H], top_k, norm_topk_prob and
    routed_scaling_factor; with use_expert_bias, the block's float expert_bias [E]; experts
    of gate_up_proj / down_proj; no shared MLP."""
    router, bias = _router(block), getattr(block, "expert_bias", None)
    fits = (_float_router_and_experts(block)
            and all(hasattr(router, a) for a in ("norm_topk_prob", "routed_scaling_factor"))
            and getattr(block, "use_expert_bias", None) in (True, False)
            and (not block.use_expert_bias or (isinstance(bias, torch.Tensor) and bias.dtype in FLOAT_DTYPES
                                               and bias.shape == (router.weight.shape[0],)))
            and not hasattr(block, "shared_experts"))
    if not fits:
        raise _moe_refusal(
            name, block, "for LFM2-MoE it runs a sigmoid top-k router with an expert bias and experts of gate_up_proj / "
            "down_proj only")


def _check_cohere2_moe(name: str, block) -> None:
    """Cohere 2 MoE's form: a router with a float weight [E, H], top_k, a softmax or sigmoid
    selection; experts of gate_up_proj / down_proj; a gated shared MLP (or none) summed or
    averaged."""
    router, shared = _router(block), getattr(block, "shared_experts", None)
    fits = (_float_router_and_experts(block)
            and getattr(router, "expert_selection_fn", None) in ("softmax", "sigmoid")
            and getattr(block, "shared_expert_combination_strategy", None) in ("sum", "average")
            and _gated_or_none(shared))
    if not fits:
        raise _moe_refusal(
            name, block, "for Cohere 2 MoE it runs a softmax or sigmoid top-k router, experts of gate_up_proj / down_proj "
            "and a gated shared MLP only")
    _check_gated_mlp(f"{name}.shared_experts", shared)


def _float_router_and_experts(block) -> bool:
    """Whether an MoE block's router holds a float weight [E, H] and top_k, and its experts are
    `_standard_experts` of E."""
    weight = getattr(_router(block), "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in FLOAT_DTYPES
            and hasattr(_router(block), "top_k") and _standard_experts(block.experts, weight.shape[0]))


def _gated_or_none(mlp) -> bool:
    """Whether a shared MLP is absent or holds gate_proj, up_proj and down_proj."""
    return mlp is None or all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))


def _standard_experts(experts, num_experts: int) -> bool:
    """Whether an MoE block's experts hold exactly gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] float weights and their activation module (nothing else)."""
    weights = dict(experts.named_parameters(recurse=False))
    gate_up, down = weights.get("gate_up_proj"), weights.get("down_proj")
    return (set(weights) == {"gate_up_proj", "down_proj"} and hasattr(experts, "act_fn")
            and all(child is experts.act_fn for child in experts.children())
            and gate_up.dim() == 3 and down.dim() == 3 and gate_up.dtype in FLOAT_DTYPES
            and down.dtype in FLOAT_DTYPES and gate_up.shape[0] == down.shape[0] == num_experts
            and gate_up.shape[1] == 2 * down.shape[2])


def _router_linear(block, model_type: str | None):
    """The module holding an MoE block's router weight [E, H] (HunYuan-MoE's gate holds it in
    an nn.Linear `wg`; every other router holds it itself)."""
    router = _router(block)
    if model_type == "afmoe" and isinstance(getattr(router, "gate", None), torch.nn.Linear):  # its router's `gate`
        return router.gate
    return router.wg if model_type == "hunyuan_v1_moe" and isinstance(getattr(router, "wg", None),
                                                                      torch.nn.Linear) else router


def _moe_refusal(name: str, block, form: str) -> UnsupportedModelError:
    """The error for an MoE block of a form the engine does not run (`form`: what it runs)."""
    return UnsupportedModelError(
        f"{name} is an MoE block the engine does not implement ({type(block).__name__} with "
        f"{type(block.experts).__name__}: {form}); use plain model.generate() for this model")


def _check_gated_mlp(name: str, mlp) -> None:
    """A shared MLP's gate_proj / up_proj / down_proj are plain float linears (None: no MLP)."""
    for part in ("gate_proj", "up_proj", "down_proj") if mlp is not None else ():
        _check_plain_linear(f"{name}.{part}", getattr(mlp, part))


def _check_gpt_oss_moe(name: str, block) -> bool:
    """Whether an MoE block is GPT-OSS's form (MoEWeights' gate_fn): a router with weight
    [E, H], bias [E] and top_k, experts holding exactly gate_up_proj [E, H, 2I] and
    down_proj [E, I, H] (stored transposed) with biases [E, 2I] and [E, H], all float, and
    their own _apply_gate."""
    router, experts = _router(block), block.experts
    weights = dict(experts.named_parameters(recurse=False))
    shapes = {key: tuple(weights[key].shape) if key in weights else None
              for key in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    if set(weights) != set(shapes) or any(w.dtype not in FLOAT_DTYPES for w in weights.values()) \
            or router is None or not hasattr(router, "top_k") or list(router.children()) \
            or not callable(getattr(experts, "_apply_gate", None)) or list(experts.children()):
        return False
    params = dict(router.named_parameters(recurse=False))
    if set(params) != {"weight", "bias"} or any(p.dtype not in FLOAT_DTYPES for p in params.values()):
        return False
    E, H = params["weight"].shape
    if len(shapes["gate_up_proj"]) != 3 or shapes["gate_up_proj"][:2] != (E, H):
        return False
    two_i = shapes["gate_up_proj"][2]
    return two_i % 2 == 0 and shapes["gate_up_proj_bias"] == (E, two_i) and shapes["down_proj"] == (E, two_i // 2, H) \
        and shapes["down_proj_bias"] == (E, H) and tuple(params["bias"].shape) == (E,)


def _check_nemotron_h_moe(name: str, block) -> None:
    """Nemotron 3 Nano's MoE form: DeepSeek-V3's sigmoid router (a float weight [E, H],
    e_score_correction_bias [E], groups), experts holding exactly up_proj [E, I, H] and
    down_proj [E, H, I] and their activation (ungated: act(up x) -> down), an ungated shared
    MLP (up_proj, down_proj) and no latent projection; anything else is refused by name."""
    for part in ("fc1_latent_proj", "fc2_latent_proj"):
        if not isinstance(getattr(block, part, None), torch.nn.Identity):
            raise UnsupportedModelError(
                f"{name}.{part}: this Nemotron-H model's experts run in a latent space (moe_latent_size), "
                "which the engine does not implement; use plain model.generate() for this model")
    router, experts, shared = _router(block), block.experts, getattr(block, "shared_experts", None)
    weight, bias = getattr(router, "weight", None), getattr(router, "e_score_correction_bias", None)
    weights = dict(experts.named_parameters(recurse=False))
    up, down = weights.get("up_proj"), weights.get("down_proj")
    fits = (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in FLOAT_DTYPES
            and isinstance(bias, torch.Tensor) and tuple(bias.shape) == (weight.shape[0],) and bias.dtype in FLOAT_DTYPES
            and all(hasattr(router, a) for a in ("top_k", "norm_topk_prob", "routed_scaling_factor"))
            and _groups_fit(router, weight)
            and set(weights) == {"up_proj", "down_proj"} and hasattr(experts, "act_fn")
            and all(child is experts.act_fn for child in experts.children())
            and up.dim() == 3 and down.dim() == 3 and up.dtype in FLOAT_DTYPES and down.dtype in FLOAT_DTYPES
            and tuple(up.shape[:2]) == (weight.shape[0], down.shape[2])
            and tuple(down.shape[:2]) == (weight.shape[0], weight.shape[1]) and up.shape[2] == weight.shape[1]
            and shared is not None and all(hasattr(shared, n) for n in ("up_proj", "down_proj"))
            and not hasattr(shared, "gate_proj"))
    if not fits:
        raise _moe_refusal(name, block, "for Nemotron-H it runs DeepSeek-V3's sigmoid router, ungated experts "
                                        "of up_proj / down_proj and an ungated shared MLP only")
    for part in ("up_proj", "down_proj"):
        _check_plain_linear(f"{name}.shared_experts.{part}", getattr(shared, part))


def _check_llama4_moe(name: str, block) -> bool:
    """Whether an MoE block is Llama 4's form (routing.topk_then_sigmoid, the weights scaling the
    experts' inputs): a router holding exactly a float weight [E, H] (no bias) and top_k,
    experts holding exactly gate_up_proj [E, H, 2I] and down_proj [E, I, H] (stored [in, out])
    and their activation, and a shared expert of plain gate / up / down projections."""
    router, experts, shared = _router(block), block.experts, getattr(block, "shared_expert", None)
    params = dict(router.named_parameters(recurse=False)) if isinstance(router, torch.nn.Module) else {}
    weights = dict(experts.named_parameters(recurse=False))
    gate_up, down = weights.get("gate_up_proj"), weights.get("down_proj")
    if set(params) != {"weight"} or params["weight"].dim() != 2 or params["weight"].dtype not in FLOAT_DTYPES \
            or not isinstance(getattr(router, "top_k", None), int) or list(router.children()) \
            or set(weights) != {"gate_up_proj", "down_proj"} or not hasattr(experts, "act_fn") \
            or any(child is not experts.act_fn for child in experts.children()) \
            or not _gated_or_none(shared) or shared is None:
        return False
    E, H = params["weight"].shape
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.dtype not in FLOAT_DTYPES or down.dtype not in FLOAT_DTYPES:
        return False
    two_i = gate_up.shape[2]
    if tuple(gate_up.shape[:2]) != (E, H) or two_i % 2 or tuple(down.shape) != (E, two_i // 2, H):
        return False
    _check_gated_mlp(f"{name}.shared_expert", shared)
    return True


def _check_shared_expert_moe(name: str, block, router_fits: Callable, form: str) -> None:
    """The DeepSeek-style MoE forms: a router with a float weight [E, H] that
    `router_fits(router, weight)`, experts of gate_up_proj [E, 2I, H] / down_proj [E, H, I]
    and a plain gated shared MLP (`shared_experts`); anything else is refused by name, `form`
    saying what runs."""
    router, experts, shared = _router(block), block.experts, getattr(block, "shared_experts", None)
    weight = getattr(router, "weight", None)
    fits = (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in FLOAT_DTYPES
            and router_fits(router, weight) and _standard_experts(experts, weight.shape[0])
            and shared is not None and all(hasattr(shared, n) for n in ("gate_proj", "up_proj", "down_proj")))
    if not fits:
        raise _moe_refusal(name, block, f"{form}, experts of gate_up_proj / down_proj and a gated shared MLP only")
    _check_gated_mlp(f"{name}.shared_experts", shared)


def _groups_fit(router, weight: torch.Tensor) -> bool:
    """num_group int groups of at least 2 experts each, topk_group an int."""
    groups = getattr(router, "num_group", None)
    return (isinstance(groups, int) and isinstance(getattr(router, "topk_group", None), int) and groups > 0
            and weight.shape[0] % groups == 0 and weight.shape[0] // groups >= 2)


def _check_deepseek_v2_moe(name: str, block) -> None:
    """DeepSeek-V2's MoE form (routing.softmax_group_limited): top_k, routed_scaling_factor
    and its topk_method ("greedy", or "group_limited_greedy" with num_group / topk_group)."""
    _check_shared_expert_moe(name, block, lambda router, weight: (
        all(hasattr(router, a) for a in ("top_k", "routed_scaling_factor"))
        and getattr(router, "topk_method", None) in ("greedy", "group_limited_greedy")
        and (router.topk_method == "greedy" or _groups_fit(router, weight))),
        "for DeepSeek-V2 it runs a float softmax router (greedy or group-limited top-k)")


def _check_mistral4_moe(name: str, block) -> None:
    """Mistral 4's MoE form (routing.softmax_grouped): top_k, num_group / topk_group,
    norm_topk_prob and routed_scaling_factor."""
    _check_shared_expert_moe(name, block, lambda router, weight: (
        all(hasattr(router, a) for a in ("top_k", "norm_topk_prob", "routed_scaling_factor"))
        and _groups_fit(router, weight)), "for Mistral 4 it runs a float softmax router with groups")


def _check_afmoe_moe(name: str, block) -> None:
    """AFMoE's MoE form (routing.sigmoid_grouped in one group): a router holding a plain
    linear `gate` [E, H], top_k and route_scale, the block's float expert_bias [E], experts of
    gate_up_proj / down_proj and a gated shared MLP (`shared_experts`)."""
    router, bias, shared = _router(block), getattr(block, "expert_bias", None), getattr(block, "shared_experts", None)
    gate = getattr(router, "gate", None)
    weight = getattr(gate, "weight", None)
    fits = (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in FLOAT_DTYPES
            and all(hasattr(router, a) for a in ("top_k", "route_scale"))
            and isinstance(bias, torch.Tensor) and tuple(bias.shape) == (weight.shape[0],) and bias.dtype in FLOAT_DTYPES
            and _standard_experts(block.experts, weight.shape[0])
            and shared is not None and all(hasattr(shared, n) for n in ("gate_proj", "up_proj", "down_proj")))
    if not fits:
        raise _moe_refusal(name, block, "for AFMoE it runs a sigmoid router with an expert bias, experts of "
                                        "gate_up_proj / down_proj and a gated shared MLP only")
    _check_plain_linear(f"{name}.router.gate", gate)
    _check_gated_mlp(f"{name}.shared_experts", shared)


def _check_hy_v3_moe(name: str, block) -> None:
    """Hy3's MoE form (MiniMax-M2's routing, scaled): a router with a float weight [E, H],
    top_k and router_scaling_factor, the block's e_score_correction_bias [E], experts of
    gate_up_proj / down_proj and a gated shared MLP (`shared_experts`)."""
    bias = getattr(block, "e_score_correction_bias", None)
    _check_shared_expert_moe(name, block, lambda router, weight: (
        isinstance(bias, torch.Tensor) and tuple(bias.shape) == (weight.shape[0],) and bias.dtype in FLOAT_DTYPES
        and all(hasattr(router, a) for a in ("top_k", "router_scaling_factor"))),
        "for Hy3 it runs MiniMax-M2's sigmoid router with the block's correction bias, scaled")


def _check_kolibri1_moe(name: str, block) -> None:
    """Kolibri-1's MoE form (routing.biased_logits_sigmoid): top_k, norm_topk_prob and
    e_score_correction_bias [E]."""
    _check_shared_expert_moe(name, block, lambda router, weight: (
        isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor)
        and tuple(router.e_score_correction_bias.shape) == (weight.shape[0],)
        and router.e_score_correction_bias.dtype in FLOAT_DTYPES
        and all(hasattr(router, a) for a in ("top_k", "norm_topk_prob"))),
        "for Kolibri-1 it runs a float32 router choosing by logit + correction bias, weighting by sigmoid")


def _check_sigmoid_router_moe(name: str, block) -> None:
    """DeepSeek-V3's MoE form (routing.sigmoid_grouped): e_score_correction_bias [E],
    n_group / topk_group / norm_topk_prob / routed_scaling_factor / top_k."""
    def router_fits(router, weight):
        bias = getattr(router, "e_score_correction_bias", None)
        return (isinstance(bias, torch.Tensor) and bias.shape == (weight.shape[0],) and bias.dtype in FLOAT_DTYPES
                and all(hasattr(router, a) for a in ("top_k", "norm_topk_prob", "routed_scaling_factor"))
                and _groups_fit(router, weight))

    _check_shared_expert_moe(name, block, router_fits,
                             "for this model type it runs DeepSeek-V3's sigmoid router with a correction bias")


def attention_window(config) -> int | None:
    """The sliding window HF applies in at least one layer, or None (full attention in all).
    Where the config lists layer_types (Qwen2, Qwen3: only layers from max_window_layers on
    slide, and only with use_sliding_window) they decide; otherwise (Mistral) a set
    sliding_window slides every layer."""
    if config.model_type == "gpt_neo":  # its "local" layers
        return config.window_size if "local" in config.attention_layers else None
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


def windows_served(device) -> bool:
    """Whether the engine's attention on `device` applies sliding windows (the CPU's C++ and
    PyTorch attention do; the CUDA kernel does not, so there requests stay within them)."""
    return torch.device(device).type == "cpu"


def served_positions(config, windowed: bool = False) -> int | None:
    """The most positions a request may reach in the engine and get the model's own
    attention: max_position_embeddings, and where a layer slides and the engine does not
    apply windows (`windowed` False: its CUDA attention), at most the window (HF's sliding
    window lets query position q see keys q - window < j <= q: every key while q is below the
    window, so full attention is the model's there). None: no limit."""
    # MPT: its ALiBi tensor spans max_seq_len keys
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None) or None
    scaled_from = query_scaling_positions(config)
    if scaled_from is not None:
        limit = scaled_from if limit is None else min(limit, scaled_from)
    window = None if windowed else attention_window(config)
    if window is None:
        return limit
    return window if limit is None else min(limit, window)


def query_scaling_positions(config) -> int | None:
    """Where Ministral 3 and Mistral 4 start scaling their queries by position (Llama 4's
    attention temperature, 1 + beta * log(1 + floor(p / original_max_position_embeddings)),
    after RoPE): below original_max_position_embeddings the factor is exactly 1, which the
    engine serves; None where no query is scaled (every other model, or a beta of 0).
    Llama 4 itself: its NoPE layers' queries times 1 + attn_scale * log1p(floor((p + 1) /
    floor_scale)), exactly 1 while p + 1 < floor_scale; and its chunked layers attend within
    chunks of attention_chunk_size positions, all one chunk (causal attention) below it."""
    if config.model_type == "llama4_text":
        limits = []
        if config.attn_temperature_tuning and not all(config.no_rope_layers):
            limits.append(int(config.floor_scale) - 1)
        if config.attention_chunk_size and "chunked_attention" in (config.layer_types or ()):
            limits.append(int(config.attention_chunk_size))
        return min(limits, default=None)
    if config.model_type not in ("ministral3", "mistral4"):
        return None
    params = getattr(config, "rope_parameters", None) or {}
    if not params.get("llama_4_scaling_beta"):
        return None
    return int(params["original_max_position_embeddings"])


def rope_type(config) -> str:
    """The RoPE variant of the config ("default", "linear", "dynamic", "longrope", ...)."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def longrope_short_positions(config) -> int | None:
    """For "longrope" RoPE, the longest forward HF computes with the short factors
    (original_max_position_embeddings); None for any other RoPE."""
    if rope_type(config) != "longrope":
        return None
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("original_max_position_embeddings") \
        or getattr(config, "original_max_position_embeddings", None)


def check_engine_prefill(config, prompt_len: int) -> None:
    """Refuse a prompt the engine's own prefill (EngineConfig.prefill='engine') cannot rotate
    as HF does: "longrope" RoPE rotates a prompt longer than original_max_position_embeddings
    with its long factors at every position, which only HF's own prefill gives (the engine's
    RoPE table has one rotation per position)."""
    short = longrope_short_positions(config)
    if short and prompt_len > short:
        raise ValueError(
            f"this prompt ({prompt_len} tokens) is longer than the model's longrope "
            f"original_max_position_embeddings ({short}), which HF rotates with the long factors "
            "at every position; EngineConfig(prefill='engine') cannot reproduce that: use "
            "prefill='hf' or 'auto' (the default) or a shorter prompt")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False,
             scale_in_float32: bool = False) -> torch.Tensor:
    """RMSNorm exactly as HF's LlamaRMSNorm computes it (fp32 statistics); plus_one: as
    Gemma's, x * (1 + w) in float32, rounded to x's dtype after; scale_in_float32: as
    Helium's, x * w in float32, rounded after (the same as Llama's in float32)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (x32 * (1.0 + weight.float())).to(dtype)
    if scale_in_float32:
        return (weight.float() * x32).to(dtype)
    return weight * x32.to(dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft cap: cap * tanh(x / cap), as HF computes it (None: x)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's and ERNIE 4.5's rotate_half: (-x[2j + 1], x[2j]) interleaved."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over x's last dimension, or where the tables are
    narrower (partial rotary: Phi-4-mini's partial_rotary_factor) over its first
    cos.shape[-1] dimensions, the rest unchanged, as HF's apply_rotary_pos_emb. pairs: the
    rotation turns adjacent pairs (rotate_pairs; the tables hold each angle twice in a row).
    Tables of another dtype than x (Llama 4's float32 ones for a 16-bit model) turn x in
    their dtype, rounded to x's after, as HF's float32 complex product."""
    if cos.dtype != x.dtype:
        return apply_rope(x.to(cos.dtype), cos, sin, pairs).to(x.dtype)
    rotate = rotate_pairs if pairs else rotate_half
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate(x) * sin
    turned = x[..., :rot]
    return torch.cat((turned * cos + rotate(turned) * sin, x[..., rot:]), dim=-1)


def _activation(config) -> str:
    """The gated MLP's activation name (Gemma 2 and 3 read `hidden_activation`)."""
    act = getattr(config, "hidden_activation", None) if config.model_type in GEMMA_LATER_TYPES else None
    return act or getattr(config, "hidden_act", "silu")


def cpu_only(config, inner) -> bool:
    """Whether the model needs what only the engine's CPU programs do: Gemma 2's attention
    soft cap (the Triton attention has none), a RoPE per layer type (the CUDA-graph runner
    gathers one table), RoPE pairs (the Triton RoPE turns halves), attention sinks (the
    Triton attention has none); LayerNorm and MoE models and HunYuan's q/k norms after RoPE
    have not run on a GPU yet, nor have the hybrids' convolutions and recurrent states (LFM2,
    Qwen 3.5, the Mamba families) or latent attention: they stay on the CPU until they have."""
    softcap = config.model_type in GEMMA_LATER_TYPES and getattr(config, "attn_logit_softcapping", None) is not None
    return softcap or _rope_layer_types(inner, config) is not None or config.model_type in ROPE_PAIRS_TYPES \
        or config.model_type in LAYER_NORM_TYPES + MOE_TYPES + QK_NORM_AFTER_ROPE_TYPES + ATTENTION_SINK_TYPES \
        + SHORT_CONV_TYPES + DELTA_NET_TYPES + MAMBA2_TYPES + MAMBA1_TYPES + LATENT_ATTENTION_TYPES


def _rotates(attention, config) -> bool:
    """Whether HF rotates this attention module's q and k: SmolLM3's modules say so
    (`use_rope`); EXAONE 4 leaves its full-attention layers unrotated where the model has a
    sliding window (its "global NoPE"), Cohere 2 its full-attention layers always; a layer
    without attention (LFM2's convolutions, Qwen 3.5's DeltaNets) rotates nothing."""
    if attention is None or config.model_type in LEARNED_POSITION_TYPES + ALIBI_TYPES:
        return False
    if config.model_type == "afmoe":  # its sliding (local) layers only
        return bool(attention.is_local_attention)
    if hasattr(attention, "use_rope"):
        return bool(attention.use_rope)
    if config.model_type in GLOBAL_NOPE_TYPES:
        return getattr(attention, "sliding_window", None) is None or bool(attention.is_sliding)
    if config.model_type in SLIDING_ROPE_TYPES:  # Cohere 2 MoE: its dense prefix layers may force RoPE
        return attention.sliding_window is not None or bool(getattr(attention, "force_rope", False))
    if config.model_type in PER_LAYER_THETA_TYPES:  # Granite-SWA: a base of 0 is NoPE
        return bool(config.layer_rope_theta[attention.layer_idx])
    return True


def _layer_window(attention, config_window: int) -> int:
    """The sliding window of one attention module (0: none): its own `sliding_window` where
    it holds one (Qwen2, Gemma 2/3, OLMo 3, Ministral: set on sliding layers only; EXAONE 4:
    on every layer, applied where `is_sliding`), else the config's (Mistral, Phi-3)."""
    if attention is None:  # a convolution or DeltaNet layer
        return 0
    if getattr(attention, "attention_type", None) in ("global", "local"):  # GPT-Neo's layers
        return config_window if attention.attention_type == "local" else 0
    if not getattr(attention, "is_sliding", True):
        return 0
    return int(getattr(attention, "sliding_window", config_window) or 0)


def _rope_layer_types(inner, config) -> tuple | None:
    """The layer types whose RoPE differs, in first-seen layer order, where HF's rotary
    module takes a layer type (Gemma 3); Granite-SWA's distinct nonzero RoPE bases in its
    rotary_embs' (ascending) order; None where one RoPE serves every layer."""
    if config.model_type in PER_LAYER_THETA_TYPES:
        return tuple(sorted({theta for theta in config.layer_rope_theta if theta}))
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        return None
    # LFM3's rotary module holds the attention layers' types only (not its convolutions')
    rotated = getattr(rotary, "layer_types", None)
    return tuple(t for t in dict.fromkeys(config.layer_types) if rotated is None or t in rotated)


def text_config(model: torch.nn.Module):
    """The config of the model's text decoder: model.config, or an image-text model's
    text_config (its top-level config has no max_position_embeddings, windows, ...)."""
    config = model.config
    if getattr(config, "model_type", None) in IMAGE_TEXT_DECODERS:
        return config.get_text_config()
    return config


def text_decoder(model: torch.nn.Module):
    """The module holding the decoder stack (embedding, layers, final norm, rotary_emb):
    model.model (GPT-NeoX: model.gpt_neox), or an image-text model's language model (None
    where there is none)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in IMAGE_TEXT_DECODERS:
        return getattr(getattr(model, "model", None), IMAGE_TEXT_DECODERS[model_type], None)
    module = model
    for name in DECODER_ATTRIBUTES.get(model_type, "model").split("."):
        module = getattr(module, name, None)
    return module


def _embedding(inner):
    """The decoder's token embedding (GPT-NeoX: embed_in, GPT-2: wte)."""
    for name in ("embed_tokens", "embed_in", "wte", "word_embeddings", "embeddings"):
        if hasattr(inner, name):
            return getattr(inner, name)
    raise UnsupportedModelError(f"{type(inner).__name__} has no token embedding the engine knows")


def decoder_final_norm(inner):
    """The decoder's final norm module (Phi: final_layernorm, GPT-NeoX: final_layer_norm;
    LFM2's embedding_norm norms the last layer's output, not the embedding rows)."""
    for name in ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "embedding_norm"):
        if getattr(inner, name, None) is not None:
            return getattr(inner, name)
    raise UnsupportedModelError(f"{type(inner).__name__} has no final norm the engine knows")


def _parallel_form(config) -> str | None:
    """How a layer's blocks read h (LayeredModel.parallel): None one after the other,
    "shared" both from one input norm, "two" each from its own."""
    model_type = config.model_type
    if model_type in ("phi", "cohere", "gptj", "codegen", "cohere2", "cohere2_moe") \
            or (model_type == "stablelm" and config.use_parallel_residual):
        return "shared"
    if model_type == "gpt_neox" and config.use_parallel_residual:
        return "two"
    if model_type == "falcon" and config.parallel_attn:  # Falcon-40B / 180B: ln_attn and ln_mlp
        return "two" if config.new_decoder_architecture and config.num_ln_in_parallel_attn == 2 else "shared"
    return None


def _alibi_slopes(config) -> torch.Tensor:
    """ALiBi's slope per head [Hq], float32, from HF's own tensors: Bloom's build_alibi_tensor
    at key position 1; MPT's build_mpt_alibi_tensor (keys relative to the last one: the
    softmax is the same for any shift) as the step between two keys."""
    if config.model_type == "mpt":
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        alibi = build_mpt_alibi_tensor(config.num_attention_heads, 2).float()  # [H, 1, 2]
        return (alibi[:, 0, 1] - alibi[:, 0, 0]).contiguous()
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), config.num_attention_heads, torch.float32)
    return alibi[:, 0, 1].contiguous()


def check_model_type(model: torch.nn.Module) -> str:
    """The model's model_type, where it is one the engine implements; else
    UnsupportedModelError naming it."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "llama4":  # the image-text class: its text model is served as its own class
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type 'llama4') is Llama 4's image-text model; hf_selfspec "
            "serves its text model: load the checkpoint with AutoModelForCausalLM.from_pretrained(name) "
            "(Llama4ForCausalLM), or use plain model.generate() for this one")
    if model_type not in SUPPORTED_MODEL_TYPES:
        # the model's own type and what to do first; the long list of supported types last
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type={model_type!r}) is not a model type hf_selfspec "
            "runs: use plain model.generate() for this model. Supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return model_type


def dispatch_placement(model, map_files: bool = False) -> ModelPlacement | None:
    """dispatch.model_placement of `model`'s (embedding, decoder layers, final norm, LM
    head): None for a model accelerate did not dispatch."""
    inner = text_decoder(model)
    parts = _embedding(inner), decoder_layers(inner), decoder_final_norm(inner), model.lm_head
    return model_placement(model, parts, map_files)


def _check_placement(placement: ModelPlacement, model_type: str) -> None:
    """What the engine cannot run on a model accelerate dispatched, refused by name."""
    devices = placement.devices
    if len({d.type for d in devices}) > 1:
        raise UnsupportedModelError(
            f"this model executes on devices of several kinds ({', '.join(map(str, devices))}; device_map "
            f"{placement.describe()}): the engine follows a map over devices of one kind (several GPUs), "
            "with any share of the weights offloaded to the CPU or disk and streamed to them. Load it with "
            "device_map='auto' (accelerate then runs CPU- and disk-offloaded layers on the GPU), or use plain "
            "generate()")
    if len(devices) > 1 and model_type in STATEFUL_MIXER_TYPES:
        raise UnsupportedModelError(
            f"{model_type} over several devices ({', '.join(map(str, devices))}): the engine keeps the "
            "recurrent and latent layers' state on one device; load it on one device (with offload where it "
            "does not fit), or use plain generate()")
    if placement.any_offloaded and model_type in STATEFUL_MIXER_TYPES:
        raise UnsupportedModelError(
            f"{model_type} with offloaded weights: the engine streams weights of attention models "
            "only; load it without offload, or use plain generate()")


class LayeredModel:
    """Embedding, decoder layers, final norm, LM head and RoPE tables of an HF causal LM."""

    def __init__(self, model: torch.nn.Module, max_positions: int):
        self.check_supported(model, max_positions)
        config = text_config(model)
        inner = text_decoder(model)
        self.model = model
        self.decoder = inner  # model.model, or an image-text model's language model
        self.config = config  # the text decoder's
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        attention_free = config.model_type in ATTENTION_FREE_TYPES
        self.num_heads = 1 if attention_free else config.num_attention_heads
        self.num_kv_heads = (None if config.model_type in MHA_ONLY_TYPES + ATTENTION_FREE_TYPES
                             else getattr(config, "num_key_value_heads", None)) or self.num_heads
        if config.model_type == "gpt_bigcode" and config.multi_query:  # one KV head (StarCoder)
            self.num_kv_heads = 1
        if config.model_type == "falcon":  # one KV head (Falcon-7B), or num_kv_heads (new architecture)
            self.num_kv_heads = config.num_kv_heads if config.new_decoder_architecture or not config.multi_query \
                else 1
        self.head_dim = 8 if attention_free else getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        latent = config.model_type in LATENT_ATTENTION_TYPES
        # latent attention (LatentAttentionWeights): one KV head of [latent | k_rope], its
        # values the keys' own tensor
        self.values_are_keys = latent
        if latent:
            self.num_kv_heads = 1
            self.head_dim = config.kv_lora_rank + config.qk_rope_head_dim
        self.layer_norm = config.model_type in LAYER_NORM_TYPES
        self.eps = float(getattr(config, "rms_norm_eps", 0.0) or 0.0)  # RMSNorm models'
        if config.model_type in SHORT_CONV_TYPES:
            self.eps = float(config.norm_eps)
        if config.model_type in ONE_BLOCK_LAYER_TYPES:
            self.eps = float(config.layer_norm_epsilon)
        # the logits' width: the LM head's rows (Apertus 1.5 may prune its head below the
        # embedding's vocabulary)
        self.vocab_size = model.lm_head.weight.shape[0]
        embedding = _embedding(inner)
        self.embed = embedding.weight  # [V, H]
        final = decoder_final_norm(inner)
        self._final_norm_module = final
        self.final_norm = final if self.layer_norm else final.weight  # [H] (an RMSNorm's weight)
        self.lm_head = model.lm_head  # nn.Linear, weight [V, H] (tied or not; Phi's has a bias)
        self.dtype = self.embed.dtype
        # a model accelerate dispatched (device_map, offload): each part's execution device,
        # and the parts whose weights its hooks bring in at each use (dispatch.py); the
        # engine runs on the one execution device (_check_placement)
        self.placement = dispatch_placement(model, map_files=True)
        self.device = self.embed.device if self.placement is None else self.placement.main_device
        # whether the final norm or the LM head streams in (head_weights)
        self.head_streamed = self.placement is not None and (
            self.placement.final_norm.offloaded or self.placement.lm_head.offloaded)
        # Granite's four multipliers (1.0 and head_dim^-0.5 for every other model, whatever
        # keys its config carries): the embedding rows are scaled, attention scores scaled by
        # attention_multiplier, each block's output joins the residual stream scaled, the
        # logits divided
        granite = config.model_type in GRANITE_MULTIPLIER_TYPES
        falcon_h1 = config.model_type == "falcon_h1"
        self.embedding_multiplier = float(config.embedding_multiplier) if granite or falcon_h1 else 1.0
        if config.model_type == "afmoe" and config.mup_enabled:  # muP: the embedding rows times sqrt(hidden)
            self.embedding_multiplier = config.hidden_size**0.5
        # Gemma's embedding module scales its rows by sqrt(hidden), rounded to the weights'
        # dtype first (a buffer of the module: read when used, so a .to() is followed)
        self._embed_module = embedding
        self.scaled_embedding = isinstance(getattr(embedding, "embed_scale", None), torch.Tensor)
        self.norm_plus_one = config.model_type in NORM_PLUS_ONE_TYPES
        self.norm_scale_in_float32 = config.model_type in ("helium", "gpt_oss", "nemotron_h")
        self.gelu = _activation(config) in GELU_TANH_NAMES
        gemma2 = config.model_type in GEMMA_LATER_TYPES
        self.attention_softcap = getattr(config, "attn_logit_softcapping", None) if gemma2 else None
        self.logits_softcap = (getattr(config, "final_logit_softcapping", None)
                               if gemma2 or config.model_type == "nanochat" else None)
        self.residual_multiplier = float(config.residual_multiplier) if granite else 1.0
        minicpm3 = config.model_type == "minicpm3"
        if minicpm3:  # each block's output scaled before it joins h, as its layers compute it
            self.residual_multiplier = config.scale_depth / math.sqrt(config.num_hidden_layers)
        # MiniCPM3 divides the final hidden state before its LM head (1.0: every other model)
        self.head_input_divisor = float(config.logits_scaling) if minicpm3 else 1.0
        self.logits_scaling = float(config.logits_scaling) if granite and config.model_type != "hyperclovax" else 1.0
        # Cohere multiplies its logits by logit_scale, HyperCLOVAX by logits_scaling
        self.logit_scale = (float(config.logit_scale) if config.model_type in ("cohere", "cohere2", "cohere2_moe")
                            else float(config.lm_head_multiplier) if falcon_h1
                            else float(config.logits_scaling) if config.model_type == "hyperclovax" else 1.0)
        # Falcon-H1's muP multipliers (1.0 for every other model): the attention's input, its k
        # projection and its output; the MLP's gate product (before the activation) and output
        self.attention_in_multiplier = float(config.attention_in_multiplier) if falcon_h1 else 1.0
        self.key_multiplier = float(config.key_multiplier) if falcon_h1 else 1.0
        self.attention_out_multiplier = float(config.attention_out_multiplier) if falcon_h1 else 1.0
        self.mlp_gate_multiplier, self.mlp_down_multiplier = (
            (float(m) for m in config.mlp_multipliers) if falcon_h1 else (1.0, 1.0))
        # HunYuan norms q and k (per head) after RoPE, every other model before it
        self.qk_norm_after_rope = config.model_type in QK_NORM_AFTER_ROPE_TYPES
        # OLMo (1) clamps q, k and v to [-clip_qkv, clip_qkv] after their products
        self.clip_qkv = getattr(config, "clip_qkv", None) if config.model_type in ("olmo", "olmoe") else None
        if config.model_type == "mpt":  # a clip of 0 (falsy) clamps nothing in HF's MPT
            self.clip_qkv = config.attn_config.clip_qkv or None
        # parallel layers (LayerWeights): "shared" one input norm for both blocks (Phi,
        # Cohere, StableLM's option), "two" each block its own (GPT-NeoX); the outputs join h
        # in HF's order: (attention + MLP) + h (Phi, GPT-NeoX) or (h + attention) + MLP
        self.parallel = _parallel_form(config)
        self.parallel_sum_first = config.model_type in ("phi", "gpt_neox", "gptj", "falcon", "codegen")
        self.scaling = float(config.attention_multiplier) if granite else self.head_dim**-0.5
        if gemma2:  # Gemma 2 and 3
            self.scaling = float(config.query_pre_attn_scalar) ** -0.5
        if (config.model_type in ("gpt2", "gpt_bigcode") and not config.scale_attn_weights) \
                or config.model_type == "gpt_neo":
            self.scaling = 1.0  # GPT-Neo never scales its attention scores
        # the learned position embedding [P, H] (GPT-2's wpe; OPT's embed_positions from its
        # row `offset`, 2: a view), added before the first layer
        self.position_embedding = None
        if config.model_type in ("gpt2", "gpt_neo", "gpt_bigcode"):
            self.position_embedding = inner.wpe.weight
        elif config.model_type == "opt":
            self.position_embedding = inner.embed_positions.weight[inner.embed_positions.offset:]
        # Bloom, MPT: ALiBi's slopes [Hq] (float32, from HF's own tensors); Bloom: the LayerNorm
        # of the embedding rows before the first layer
        self.alibi_slopes = _alibi_slopes(config) if config.model_type in ALIBI_TYPES else None
        if config.model_type == "mpt":  # its attention config's scale
            self.scaling = config.attn_config.softmax_scale or self.scaling
        if latent:  # (q.k dims)^-0.5, times YaRN's mscale squared where it applies: the module's own
            self.scaling = float(_attention(decoder_layers(inner)[0]).scaling)
        self.embedding_norm = getattr(inner, "word_embeddings_layernorm", None)
        if config.model_type == "nanochat":  # its (parameter-free) final norm also norms the embedding rows
            self.embedding_norm = inner.norm
        layers = decoder_layers(inner)
        self._decoder_layers = layers
        # an offloaded layer's entry holds its modules with weights on the meta device: a
        # step reads the layer through `layer_weights`, which brings them in
        self.layers = [self._layer(layer) for layer in layers]
        self.streamed_layers = frozenset(
            () if self.placement is None else (i for i, p in enumerate(self.placement.layers) if p.offloaded))
        # LFM2's convolution, Qwen 3.5's DeltaNet and Granite 4.0-H's Mamba2 layers: per layer,
        # its index among them (-1: an attention layer; the engine's conv cache), the
        # convolutions' width in positions (0 without any) and channels; per layer its index
        # among the DeltaNet / Mamba2 layers (their recurrent states), and their state's shape
        mixers = [lw.conv or lw.delta or lw.mamba or lw.mamba1 for lw in self.layers]
        conv_layers = [i for i, block in enumerate(mixers) if block is not None]
        self.conv_index = tuple(conv_layers.index(i) if i in conv_layers else -1 for i in range(self.num_layers))
        self.num_conv_layers = len(conv_layers)
        self.conv_taps = mixers[conv_layers[0]].kernel.shape[1] if conv_layers else 0
        self.conv_channels = mixers[conv_layers[0]].kernel.shape[0] if conv_layers else 0
        state_layers = [i for i in conv_layers if hasattr(mixers[i], "state_shape")]
        self.state_index = tuple(state_layers.index(i) if i in state_layers else -1 for i in range(self.num_layers))
        self.num_state_layers = len(state_layers)
        self.state_shape = mixers[state_layers[0]].state_shape if state_layers else None
        # Qwen 3.5's attention: q_proj gives each head its q rows, then as many gate rows
        self.gated_attention = config.model_type in QWEN3_5_TYPES
        # GPT-OSS: per layer, its attention's sink per head [Hq] (the module's own parameter);
        # None for a model without sinks
        self.layer_sinks = tuple(_attention(layer).sinks for layer in layers) \
            if config.model_type in ATTENTION_SINK_TYPES else None
        # per layer, whether HF rotates its q and k (SmolLM3 leaves every 4th layer without
        # RoPE: `no_rope_layers`, read by each attention module as `use_rope`)
        # (OLMo Hybrid's released checkpoints have no rotary module: NoPE everywhere)
        self.rope_layers = tuple(_rotates(_attention(layer), config) and getattr(inner, "rotary_emb", True) is not None
                                 and config.model_type not in NOPE_TYPES for layer in layers)
        # Gemma 3 rotates each layer type (sliding / full attention) by its own RoPE: HF's
        # rotary module takes the layer type. rope_types: the types in table order (None:
        # one RoPE for every layer); layer_rope: each layer's table, -1 for none
        self.rope_types = _rope_layer_types(inner, config)
        kinds = (config.layer_rope_theta if config.model_type in PER_LAYER_THETA_TYPES
                 else getattr(config, "layer_types", None) or [None] * self.num_layers)
        self.layer_rope = tuple(
            -1 if not rotated else (0 if self.rope_types is None else self.rope_types.index(kind))
            for rotated, kind in zip(self.rope_layers, kinds))
        # per layer, the sliding window of its attention (0: none; _layer_window)
        window = attention_window(config) or 0
        self.layer_window = tuple(_layer_window(_attention(layer), window) for layer in layers)
        self.max_positions = self._table_positions(config, max_positions, self.device)
        # GLM, ERNIE 4.5: RoPE turns adjacent pairs (apply_rope's pairs)
        self.rope_pairs = config.model_type in ROPE_PAIRS_TYPES
        self.rope_tables = self._all_rope_tables(inner, self.max_positions)
        self.cos, self.sin = self.rope_tables[0]  # [P, d] each

    @classmethod
    def check_supported(cls, model: torch.nn.Module, max_positions: int = 1) -> None:
        """Raise (UnsupportedModelError, a ValueError) naming what the engine cannot run:
        the architecture, a feature (sliding window, activation), quantization, or a
        projection that is not a plain float nn.Linear. Cheap: attach_heads may call it."""
        model_type = check_model_type(model)
        config, inner = text_config(model), text_decoder(model)
        if not isinstance(getattr(model, "lm_head", None), torch.nn.Module) \
                or not isinstance(decoder_layers(inner), torch.nn.ModuleList):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a causal LM with an LM head (model.model.layers and "
                "model.lm_head); load the ...ForCausalLM class, e.g. with "
                "AutoModelForCausalLM.from_pretrained(name)")
        cls._check_features(config, cls._table_positions(config, max_positions, model.lm_head.weight.device))
        cls._check_quantization(model.config)  # an image-text model's is its top config's
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None and not _dequantized_gguf(getattr(quantizer, "quantization_config", None)):
            raise UnsupportedModelError(
                f"this model is quantized ({type(quantizer).__name__}); the engine runs float "
                "weights only (fp32/bf16/fp16): load the model unquantized, or use plain "
                "model.generate()")
        layers = decoder_layers(inner)
        projections = [(f"model.layers.{i}.{part}{name}", getattr(block, name, None))
                       for i, layer in enumerate(layers)
                       for part, block, names in (
                           _mixer_projections(layer, model_type),
                           (_mlp_path(layer), _mlp_block(layer),
                            () if _mlp_block(layer) is None or hasattr(_mlp_block(layer), "experts")
                            else _projection_names(_mlp_block(layer), MLP_PROJECTIONS)))
                       for name in names]
        for i, layer in enumerate(layers):
            if hasattr(_mlp_block(layer), "experts"):
                _check_moe(f"model.layers.{i}.{_mlp_path(layer)[:-1] or 'mlp'}", _mlp_block(layer), model_type)
            shared_mlp = getattr(layer, "shared_mlp", None)
            if shared_mlp is not None:  # GraniteMoeShared's: a gated MLP, gate and up rows fused
                projections += [(f"model.layers.{i}.shared_mlp.{name}", getattr(shared_mlp, name, None))
                                for name in ("input_linear", "output_linear")]
        for i, layer in enumerate(layers):
            if model_type in SHORT_CONV_TYPES and _attention(layer) is None:
                _check_short_conv(f"model.layers.{i}.conv.conv", getattr(getattr(layer, "conv", None), "conv", None),
                                  config.hidden_size)
            if model_type in DELTA_NET_TYPES and _attention(layer) is None:
                _check_delta_net(f"model.layers.{i}.linear_attn", getattr(layer, "linear_attn", None))
            if model_type in MAMBA1_TYPES and _attention(layer) is None:
                _check_mamba1(f"model.layers.{i}.{_mamba1_path(layer)[:-1]}", _mamba1_block(layer))
            elif model_type in MAMBA2_TYPES and _mamba2_block(layer) is not None:
                name = f"model.layers.{i}.{'mixer' if _one_block(layer) else 'mamba'}"
                _check_mamba2(name, _mamba2_block(layer))
                if model_type in PARALLEL_MIXER_TYPES:  # beside the attention: its projections too
                    projections += [(f"{name}.{n}", getattr(_mamba2_block(layer), n, None))
                                    for n in ("in_proj", "out_proj")]
        for name, module in projections:
            _check_plain_linear(name, module, model_type)
        if model_type in LATENT_ATTENTION_TYPES:  # (its projections plain, checked above)
            for i, layer in enumerate(layers):
                _check_latent(f"model.layers.{i}.{_attention_name(layer)}", _attention(layer), config.num_attention_heads)
        _check_plain_linear("lm_head", model.lm_head)
        placement = dispatch_placement(model)  # accelerate's dispatch: refusals by name
        if placement is not None:
            _check_placement(placement, model_type)
        devices = [model.lm_head.weight.device] if placement is None else placement.devices
        if any(d.type == "cuda" for d in devices) and cpu_only(config, inner):
            raise UnsupportedModelError(CPU_ONLY_REFUSAL)

    def set_max_positions(self, max_positions: int) -> None:
        """RoPE tables for positions [0, max_positions) (the engine's KV cache grew or shrank),
        at most max_position_embeddings."""
        max_positions = self._table_positions(self.config, max_positions, self.device)
        self._check_features(self.config, max_positions)
        self.max_positions = max_positions
        self.rope_tables = self._all_rope_tables(self.decoder, max_positions)
        self.cos, self.sin = self.rope_tables[0]

    @staticmethod
    def _table_positions(config, max_positions: int, device) -> int:
        """At most `served_positions`: no request reaches past them (generate() refuses such
        a request), past max_position_embeddings "dynamic" RoPE would rescale HF's rotary
        module, and past a sliding window the CUDA attention is no longer the model's."""
        limit = served_positions(config, windows_served(device))
        return min(max_positions, limit) if limit else max_positions

    @classmethod
    def _check_features(cls, config, max_positions: int) -> None:
        cls._check_quantization(config)
        for flag in ("qk_layernorm",):  # StableLM's per-head LayerNorms, Phi's shared one
            if getattr(config, flag, False) and config.model_type in ("stablelm", "phi"):
                raise UnsupportedModelError(
                    f"{flag}=True ({config.model_type}): the engine does not implement these q/k "
                    "LayerNorms; use plain model.generate() for this model")
        act = _activation(config)
        if act not in SILU_NAMES + GELU_TANH_NAMES and config.model_type not in PLAIN_MLP_TYPES:
            raise UnsupportedModelError(
                f"hidden_act={act!r}: the engine implements gated MLPs with "
                f"{', '.join(repr(a) for a in SILU_NAMES + GELU_TANH_NAMES)} only; use plain "
                "model.generate() for this model")
        if config.model_type == "opt" and (not config.do_layer_norm_before or config._remove_final_layer_norm
                                           or config.word_embed_proj_dim != config.hidden_size):
            raise UnsupportedModelError(
                "this OPT model norms after its blocks (do_layer_norm_before=False) or projects its "
                "embeddings (word_embed_proj_dim != hidden_size), as OPT-350m does; the engine runs "
                "the other OPT models only: use plain model.generate() for this one")
        if config.model_type == "bloom" and (config.apply_residual_connection_post_layernorm
                                             or (config.pretraining_tp > 1 and config.slow_but_exact)):
            raise UnsupportedModelError(
                "this Bloom model adds its blocks to the normed stream "
                "(apply_residual_connection_post_layernorm=True) or sums its products in "
                "pretraining_tp slices (slow_but_exact=True); use plain model.generate() for it")
        if config.model_type == "falcon" and (config.alibi or (config.new_decoder_architecture
                                                               and not config.parallel_attn)):
            raise UnsupportedModelError(
                "this Falcon model biases its attention by distance (alibi=True, as Falcon-RW) or is a "
                "new-architecture model without parallel blocks; the engine runs Falcon's RoPE models: "
                "use plain model.generate() for this one")
        if config.model_type == "gpt2" and config.scale_attn_by_inverse_layer_idx:
            raise UnsupportedModelError(
                "scale_attn_by_inverse_layer_idx=True (gpt2): the engine scales every layer's "
                "attention alike; use plain model.generate() for this model")
        if config.model_type == "mellum" and any(
                (params or {}).get("partial_rotary_factor", 1.0) != 1.0
                for params in (getattr(config, "rope_parameters", None) or {}).values()):
            raise UnsupportedModelError(
                "partial_rotary_factor below 1 (mellum): HF's Mellum attention rotates whole heads and "
                "cannot run these tables; the engine does not guess: use a full rotary configuration")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(
                "use_bidirectional_attention=True: the engine decodes causally only; use plain "
                "model.generate() for this model")

    @staticmethod
    def _check_quantization(config) -> None:
        quantization = getattr(config, "quantization_config", None)
        if quantization and not _dequantized_gguf(quantization):  # before any module is looked at
            method = quantization.get("quant_method") if isinstance(quantization, dict) \
                else getattr(quantization, "quant_method", type(quantization).__name__)
            raise UnsupportedModelError(
                f"this model is quantized (quantization_config: {method}); the engine runs "
                "float weights only (fp32/bf16/fp16): load the model unquantized, or use plain "
                "model.generate()")

    def _layer(self, layer) -> LayerWeights:
        attn, mlp = _attention(layer), _mlp_block(layer)
        # HunYuan names its per-head q/k norms query_ / key_layernorm, LFM2 q_ / k_layernorm
        q_norm = k_norm = None
        for q_name, k_name in (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"),
                               ("q_layernorm", "k_layernorm")):
            if hasattr(attn, q_name):
                q_norm, k_norm = getattr(attn, q_name), getattr(attn, k_name)
                break
        if getattr(attn, "qk_norm", None) is not None:  # Llama 4: one weightless L2 norm for q and k (HF's module)
            q_norm = k_norm = attn.qk_norm
        qkv, qkv_layout, conv, delta, mamba, o = None, "per_head", None, None, None, None
        mamba1 = latent = None
        if attn is None and _one_block(layer) in ("mlp", "moe"):  # a Nemotron-H layer without a token mixer
            q = k = v = None
        elif attn is None and self.config.model_type in MAMBA1_TYPES:  # Mamba, Falcon Mamba, Jamba
            q = k = v = None
            block = _mamba1_block(layer)
            norms = ((block.dt_layernorm, block.b_layernorm, block.c_layernorm)
                     if self.config.model_type in ("falcon_mamba", "jamba") else None)
            mamba1 = Mamba1Weights(
                block.in_proj, block.conv1d.weight[:, 0], block.conv1d.bias, block.x_proj,
                MatrixView(block.dt_proj.weight), block.dt_proj.bias, block.A_log, block.D, block.out_proj,
                int(block.time_step_rank), int(block.ssm_state_size), norms)
        elif attn is None and _mamba2_block(layer) is not None:  # Granite 4.0-H's, Bamba's, Nemotron-H's Mamba2
            q = k = v = None
            block = _mamba2_block(layer)
            mamba = self._mamba2(block)
        elif attn is None and hasattr(layer, "linear_attn"):  # Qwen 3.5's / OLMo Hybrid's gated DeltaNet
            q = k = v = None
            block = layer.linear_attn
            qkv_names, z, b, a, out = DELTA_NET_PROJECTIONS.get(self.config.model_type, QWEN3_5_DELTA_NET_PROJECTIONS)
            gated_norm = block.norm if hasattr(block, "norm") else block.o_norm
            delta = GatedDeltaNetWeights(
                tuple(getattr(block, n) for n in qkv_names), z and getattr(block, z), getattr(block, b), a and getattr(block, a),
                block.conv1d.weight[:, 0], block.dt_bias, block.A_log, gated_norm.weight,
                float(gated_norm.variance_epsilon), getattr(block, out), int(block.num_k_heads), int(block.num_v_heads),
                int(block.head_k_dim), int(block.head_v_dim), 2.0 if getattr(block, "allow_neg_eigval", False) else 1.0,
                grouped=z is None)
        elif attn is None:  # LFM2's convolution layer
            q = k = v = None
            block = layer.conv
            conv = ShortConvWeights(block.in_proj, block.conv.weight[:, 0], block.conv.bias, block.out_proj)
        elif self.config.model_type == "codegen":  # q, v, k rows per shard of 4 (`qkv_layout`)
            q = k = v = None
            qkv, qkv_layout = attn.qkv_proj, "shards"
        elif hasattr(attn, "Wqkv"):  # MPT: q, k, v rows of one weight, in that order
            width = self.num_heads * self.head_dim
            q, k, v = (RowSlice(attn.Wqkv, lo, lo + width) for lo in (0, width, 2 * width))
        elif hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v rows of one weight, in that order
            qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = (RowSlice(attn.qkv_proj, lo, hi) for lo, hi in ((0, qd), (qd, qd + kvd),
                                                                        (qd + kvd, qd + 2 * kvd)))
        elif hasattr(attn, "query_key_value") and self.config.model_type == "falcon" \
                and not self.config.new_decoder_architecture and self.config.multi_query:
            # Falcon-7B: all query heads' rows, then one key head's, one value head's
            qd, kvd = self.num_heads * self.head_dim, self.head_dim
            q, k, v = (RowSlice(attn.query_key_value, lo, hi) for lo, hi in ((0, qd), (qd, qd + kvd),
                                                                              (qd + kvd, qd + 2 * kvd)))
        elif hasattr(attn, "query_key_value"):  # GPT-NeoX (Falcon's MHA): per head, its q, k and v rows
            q = k = v = None
            qkv = attn.query_key_value
            # Falcon's new architecture: per KV head, its group's query rows, then its k and v rows
            if self.config.model_type == "falcon" and self.config.new_decoder_architecture:
                qkv_layout = "grouped"
        elif isinstance(getattr(attn, "c_attn", None), _conv1d_class()):  # GPT-2: q, k, v columns of [H, 3H]
            width = self.num_heads * self.head_dim
            q, k, v = (TransposedLinear(attn.c_attn, lo, lo + width) for lo in (0, width, 2 * width))
        elif hasattr(attn, "c_attn") and self.num_kv_heads == 1:  # GPT-BigCode multi-query: q, k, v rows
            qd, kvd = self.num_heads * self.head_dim, self.head_dim
            q, k, v = (RowSlice(attn.c_attn, lo, hi) for lo, hi in ((0, qd), (qd, qd + kvd),
                                                                     (qd + kvd, qd + 2 * kvd)))
        elif hasattr(attn, "c_attn"):  # GPT-BigCode's MHA form: per head, its q, k and v rows (GPT-NeoX's)
            q = k = v = None
            qkv = attn.c_attn
        elif self.config.model_type in LATENT_ATTENTION_TYPES:  # DeepSeek's latent attention
            q = k = v = None
            latent = self._latent(attn)
        else:
            q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        if self.config.model_type in PARALLEL_MIXER_TYPES:  # Falcon-H1: its Mamba2 mixer beside the attention
            mamba = self._mamba2(layer.mamba)
        if attn is not None:
            o = attn.o_proj if hasattr(attn, "o_proj") else attn.dense if hasattr(attn, "dense") \
                else attn.out_proj if hasattr(attn, "out_proj") else _as_linear(attn.c_proj)
        gate = act = moe = None
        if mlp is None:  # a Nemotron-H layer whose one block is a token mixer
            up = down = None
        elif hasattr(mlp, "experts"):  # a sparse MoE block (its dense layers: an MLP below)
            up = down = None
            moe = self._moe(mlp, getattr(layer, "shared_mlp", None))
        elif hasattr(mlp, "gate_up_proj"):  # Phi-3: the gate's rows, then the up projection's
            inter = mlp.gate_up_proj.out_features // 2
            gate, up = RowSlice(mlp.gate_up_proj, 0, inter), RowSlice(mlp.gate_up_proj, inter, 2 * inter)
            down = mlp.down_proj
        elif hasattr(mlp, "gate_proj"):
            gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        elif hasattr(mlp, "w1"):  # LFM2: silu(w1(x)) * w3(x) -> w2
            gate, up, down = mlp.w1, mlp.w3, mlp.w2
        elif hasattr(mlp, "input_linear"):  # a dense Granite 4.0 layer's shared_mlp: gate rows, then up's
            inter = mlp.input_linear.out_features // 2
            gate, up = RowSlice(mlp.input_linear, 0, inter), RowSlice(mlp.input_linear, inter, 2 * inter)
            down = mlp.output_linear
        else:  # a plain MLP: Phi's fc1/fc2, StarCoder 2's c_fc/c_proj, GPT-NeoX's dense_h_to_4h/...,
            # Arcee's and Apertus's up_proj/down_proj
            up_name, down_name = _projection_names(mlp, MLP_PROJECTIONS[2:])
            up, down = getattr(mlp, up_name), getattr(mlp, down_name)
            up, down = _as_linear(up), _as_linear(down)  # GPT-2's c_fc / c_proj: Conv1D
            act = next(getattr(mlp, name) for name in ("act", "act_fn", "activation_fn", "gelu_impl")
                       if hasattr(mlp, name))
        # a layer with a feed-forward norm of its own (OLMo 2: post_feedforward_layernorm)
        # norms the attention's output with post_attention_layernorm; otherwise (Llama)
        # that name is the MLP's input norm
        out_norms = any(hasattr(layer, name) for name in ("post_feedforward_layernorm", "pre_feedforward_layernorm",
                                                            "pre_mlp_layernorm"))  # (AFMoE: pre_ / post_mlp_layernorm)

        def held(module):  # an RMSNorm's weight, a LayerNorm model's module (Cohere's q/k too)
            if module is None or isinstance(module, torch.nn.Identity):  # HyperCLOVAX without post norms
                return None
            # a norm without a weight (Llama 4's q/k L2 norm): HF's module itself, called as HF calls it
            return module if self.layer_norm or getattr(module, "weight", None) is None else module.weight

        def norm(name):
            return held(getattr(layer, name, None))

        input_norm = norm(_first_held(layer, ("input_layernorm", "attention_layernorm", "ln_1",
                                              "self_attn_layer_norm", "ln_attn", "norm_1", "operator_norm")))
        post_norm = norm(_first_held(layer, ("pre_feedforward_layernorm", "pre_mlp_layernorm"))) if out_norms else norm(
            _first_held(layer, ("post_attention_layernorm", "feedforward_layernorm", "ln_2", "final_layer_norm",
                                "ln_mlp", "norm_2", "ffn_norm", "pre_ff_layernorm")))
        if _one_block(layer) is not None:  # Nemotron-H: its one norm is its one block's input norm
            input_norm, post_norm = (None, held(layer.norm)) if mlp is not None else (held(layer.norm), None)

        return LayerWeights(
            # Apertus names its input norms attention_ / feedforward_layernorm, GPT-2 ln_1 / ln_2,
            # OPT self_attn_layer_norm / final_layer_norm (the layer's own)
            # LFM2 operator_norm / ffn_norm
            input_norm=input_norm,
            q=q,
            k=k,
            v=v,
            o=o,
            q_norm=held(q_norm),
            k_norm=held(k_norm),
            post_norm=post_norm,
            gate=gate,
            up=up,
            down=down,
            # GLM-4 names its blocks' output norms post_self_attn_ / post_mlp_layernorm,
            # HyperCLOVAX post_norm1 / post_norm2 (its Peri-LN)
            attn_out_norm=norm("post_attention_layernorm") if out_norms
            else norm(_first_held(layer, ("post_self_attn_layernorm", "post_norm1", "post_operator_norm"))),
            # (A.X-K1's MoE blocks norm their own output: post_mlp_layernorm in the block)
            mlp_out_norm=norm(_first_held(layer, ("post_feedforward_layernorm", "post_mlp_layernorm", "post_norm2",
                                                  "post_ffn_norm")))
            if getattr(mlp, "post_mlp_layernorm", None) is None else held(mlp.post_mlp_layernorm),
            act=act,
            qkv=qkv,
            qkv_layout=qkv_layout,
            moe=moe,
            conv=conv,
            delta=delta,
            mamba=mamba,
            mamba1=mamba1,
            head_gate=getattr(attn, "g_proj", None) if self.config.model_type == "lfm3" else None,
            latent=latent,
            out_gate=attn.gate_proj if self.config.model_type == "afmoe" else None,
        )

    def _latent(self, attn) -> LatentAttentionWeights:
        """A latent attention module's LatentAttentionWeights (_check_latent has passed)."""
        config = self.config
        lora = getattr(attn, "q_a_proj", None) is not None
        nope, v_dim, rows = int(attn.qk_nope_head_dim), int(attn.v_head_dim), attn.kv_b_proj.weight
        per_head = nope + v_dim  # kv_b's rows: per head, its k_nope rows then its v rows
        k_up = [MatrixView(rows[h * per_head:h * per_head + nope].t()) for h in range(self.num_heads)]
        v_up = [MatrixView(rows[h * per_head + nope:(h + 1) * per_head]) for h in range(self.num_heads)]
        if config.model_type == "deepseek_v2":
            form = "complex"
        else:
            form = "pairs_to_half" if getattr(config, "rope_interleave", False) else "half"
        return LatentAttentionWeights(
            q=None if lora else attn.q_proj, q_a=attn.q_a_proj if lora else None,
            q_a_norm=attn.q_a_layernorm.weight if lora else None, q_b=attn.q_b_proj if lora else None,
            kv_a=attn.kv_a_proj_with_mqa, kv_a_norm=attn.kv_a_layernorm.weight, k_up=k_up, v_up=v_up,
            nope_dim=nope, rope_dim=int(attn.qk_rope_head_dim),
            kv_rank=int(attn.kv_lora_rank), norm_eps=float(attn.kv_a_layernorm.variance_epsilon), rope_form=form)

    def _mamba2(self, block) -> Mamba2Weights:
        """A Mamba2 mixer's Mamba2Weights (Falcon-H1's: its norm optional, its muP scales)."""
        norm = block.norm if isinstance(getattr(block.norm, "weight", None), torch.Tensor) else None
        falcon = self.config.model_type == "falcon_h1"
        inner = int(block.num_heads) * int(block.head_dim)
        group = inner // int(block.norm.n_groups) if falcon and norm is not None else int(getattr(norm, "group_size", inner))
        mup = getattr(block, "mup_vector", None) if falcon else None
        return Mamba2Weights(
            block.in_proj, block.conv1d.weight[:, 0], block.conv1d.bias, block.dt_bias, block.A_log, block.D,
            None if norm is None else norm.weight, float(getattr(norm, "variance_epsilon", 0.0)), group,
            block.out_proj, int(block.num_heads), int(block.head_dim), int(block.ssm_state_size), int(block.n_groups),
            tuple(float(b) for b in (block.time_step_limit or (0.0, float("inf")))),
            norm_in_float32=falcon, norm_before_gate=falcon and norm is not None and bool(norm.norm_before_gate),
            in_scale=float(block.ssm_in_multiplier) if falcon else 1.0,
            projection_scale=None if mup is None else mup.view(-1),
            out_scale=float(self.config.ssm_out_multiplier) if falcon else 1.0)

    def _moe(self, block, shared_mlp=None) -> MoEWeights:
        """The MoE block's MoEWeights (shared_mlp: GraniteMoeShared's, held by the layer)."""
        experts, router, model_type = block.experts, _router(block), self.config.model_type
        top_k = int(router.top_k)
        if model_type == "nemotron_h":  # DeepSeek-V3's routing; ungated experts and shared MLP
            shared = block.shared_experts
            return MoEWeights(
                router=MatrixView(router.weight), gate_up=[MatrixView(w) for w in experts.up_proj],
                down=[MatrixView(w) for w in experts.down_proj], act=experts.act_fn,
                route=functools.partial(
                    routing.sigmoid_grouped, top_k=top_k, correction_bias=router.e_score_correction_bias,
                    n_group=int(router.num_group), topk_group=int(router.topk_group),
                    normalize=bool(router.norm_topk_prob), norm_eps=1e-20,
                    scaling=float(router.routed_scaling_factor)),
                router_input_float32=True, shared=(None, shared.up_proj, shared.down_proj), gated=False)
        if model_type == "llama4_text":  # experts stored [in, out] (transposed views); the weights scale inputs
            shared = block.shared_expert
            return MoEWeights(
                router=MatrixView(router.weight), gate_up=[MatrixView(w.t()) for w in experts.gate_up_proj],
                down=[MatrixView(w.t()) for w in experts.down_proj], act=experts.act_fn,
                route=functools.partial(routing.topk_then_sigmoid, top_k=top_k),
                shared=(shared.gate_proj, shared.up_proj, shared.down_proj), weights_scale_inputs=True)
        if model_type == "gpt_oss":  # experts stored [in, out]: transposed views, with biases
            return MoEWeights(
                router=MatrixView(router.weight, router.bias),
                gate_up=[MatrixView(w.t(), b) for w, b in zip(experts.gate_up_proj, experts.gate_up_proj_bias)],
                down=[MatrixView(w.t(), b) for w, b in zip(experts.down_proj, experts.down_proj_bias)],
                act=None, route=functools.partial(routing.topk_softmax, top_k=top_k, in_float32=False),
                gate_fn=experts._apply_gate)
        router_weight = _router_linear(block, model_type).weight
        # views of the router's weight and of each expert's gate_up / down matrices
        parts = dict(router=MatrixView(router_weight), gate_up=[MatrixView(w) for w in experts.gate_up_proj],
                     down=[MatrixView(w) for w in experts.down_proj], act=experts.act_fn)
        shared = getattr(block, "shared_experts", None)  # DeepSeek-V3's, ERNIE's, Cohere 2 MoE's
        shared = None if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj)
        if model_type == "hy_v3":  # MiniMax-M2's routing (float32 logits), renormalised over sum + 1e-20, scaled
            return MoEWeights(**parts, route=functools.partial(
                routing.sigmoid_grouped, top_k=top_k, correction_bias=block.e_score_correction_bias, n_group=1,
                topk_group=1, normalize=True, norm_eps=1e-20, scaling=float(router.router_scaling_factor)),
                router_input_float32=True, shared=shared)
        if model_type in SIGMOID_ROUTER_TYPES or model_type == "minimax_m2":  # DeepSeek-V3's routing
            minimax = model_type == "minimax_m2"  # no groups or scaling, its bias on the block
            route = functools.partial(
                routing.sigmoid_grouped, top_k=top_k,
                correction_bias=block.e_score_correction_bias if minimax else router.e_score_correction_bias,
                n_group=1 if minimax else int(router.num_group), topk_group=1 if minimax else int(router.topk_group),
                normalize=True if minimax else bool(router.norm_topk_prob), norm_eps=0.0 if minimax else 1e-20,
                scaling=1.0 if minimax else float(router.routed_scaling_factor))
            # MiniMax-M2 computes its logits in its router weight's dtype
            widen = router_weight.dtype == torch.float32 if minimax else True
            return MoEWeights(**parts, route=route, router_input_float32=widen, shared=shared)
        if model_type == "deepseek_v2":  # the float32 softmax's top-k (group-limited), scaled, not renormalised
            return MoEWeights(**parts, route=functools.partial(
                routing.softmax_group_limited, top_k=top_k, n_group=int(router.num_group or 1),
                topk_group=int(router.topk_group or 1), limited=router.topk_method == "group_limited_greedy",
                scaling=float(router.routed_scaling_factor)), router_input_float32=True, shared=shared)
        if model_type == "afmoe":  # sigmoid scores (logits in the rows' dtype) chosen with the block's bias, one group
            return MoEWeights(**parts, route=functools.partial(
                routing.sigmoid_grouped, top_k=top_k, correction_bias=block.expert_bias, n_group=1, topk_group=1,
                normalize=True, norm_eps=1e-20, scaling=float(router.route_scale)), shared=shared)
        if model_type == "kolibri1":  # chosen by logit + bias, weighted by the chosen logits' sigmoid
            return MoEWeights(**parts, route=functools.partial(
                routing.biased_logits_sigmoid, top_k=top_k, correction_bias=router.e_score_correction_bias,
                normalize=bool(router.norm_topk_prob)), router_input_float32=True, shared=shared)
        if model_type == "mistral4":  # the softmax (the rows' dtype) within the best groups, renormalised
            return MoEWeights(**parts, route=functools.partial(
                routing.softmax_grouped, top_k=top_k, n_group=int(router.num_group),
                topk_group=int(router.topk_group), normalize=bool(router.norm_topk_prob),
                scaling=float(router.routed_scaling_factor)), shared=shared)
        if model_type == "lfm2_moe":  # sigmoid scores in the model's dtype, chosen with the block's bias
            return MoEWeights(**parts, route=functools.partial(
                routing.sigmoid_topk, top_k=top_k, expert_bias=block.expert_bias if block.use_expert_bias else None,
                normalize=bool(router.norm_topk_prob), scaling=float(router.routed_scaling_factor)))
        if model_type == "ernie4_5_moe":  # a float32 router with a correction bias on its choice
            return MoEWeights(**parts, route=functools.partial(
                routing.biased_softmax, top_k=top_k, correction_bias=router.moe_statics.e_score_correction_bias.view(-1),
                norm_min=float(router.norm_min)), router_input_float32=True, shared=shared)
        if model_type == "phimoe":  # HF's own sparsemixer on the router's logits
            from transformers.models.phimoe.modeling_phimoe import sparsemixer

            return MoEWeights(**parts, route=functools.partial(
                routing.sparsemixer, hf_sparsemixer=sparsemixer, top_k=top_k, jitter_eps=router.router_jitter_noise))
        if model_type == "cohere2_moe":  # the top-k logits' softmax or sigmoid; a shared MLP summed or averaged
            return MoEWeights(**parts, route=functools.partial(
                routing.topk_softmax_or_sigmoid, top_k=top_k, selection=router.expert_selection_fn,
                normalize=bool(router.norm_topk_prob)), shared=shared,
                shared_average=block.shared_expert_combination_strategy == "average")
        if model_type in GRANITE_MOE_TYPES:  # the softmax of the float32 top-k logits
            route = functools.partial(routing.topk_softmax, top_k=top_k, in_float32=True)
        else:  # Mixtral always renormalises and multiplies by the float32 weights
            route = functools.partial(routing.softmax_topk, top_k=top_k,  # Jamba: never renormalised
                                      normalize=model_type != "jamba" and bool(getattr(router, "norm_topk_prob", True)),
                                      round_weights=model_type != "mixtral")
        # Qwen2-MoE's gated shared expert; HunYuan-MoE's ungated shared MLP in the block
        shared = block.shared_mlp if model_type == "hunyuan_v1_moe" else getattr(block, "shared_expert", None)
        shared_rows = None if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj)
        if shared_mlp is not None:  # GraniteMoeShared: gate rows, then up's, in input_linear
            inter = shared_mlp.input_linear.out_features // 2
            shared_rows = (RowSlice(shared_mlp.input_linear, 0, inter),
                           RowSlice(shared_mlp.input_linear, inter, 2 * inter), shared_mlp.output_linear)
        return MoEWeights(
            **parts, route=route, shared=shared_rows, shared_gate=getattr(block, "shared_expert_gate", None),
            # HunYuan-MoE: HF widens the rows where its router's weight is float32
            router_input_float32=model_type == "hunyuan_v1_moe" and router_weight.dtype == torch.float32)

    def _all_rope_tables(self, inner, max_positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (cos, sin) per RoPE the layers use (rope_types' order; one for most models)."""
        if self.rope_types is None:
            return [self._rope_tables(inner, max_positions)]
        if not self.rope_types:  # Granite-SWA without RoPE in any layer: tables that rotate nothing
            return [self._identity_tables(max_positions)]
        return [self._rope_tables(inner, max_positions, kind) for kind in self.rope_types]

    def _rope_tables(self, inner, max_positions: int, layer_type: str | None = None):
        """cos/sin for positions [0, max_positions) from the HF rotary module itself, so
        every RoPE variant the HF model supports gives the same tables.

        Two variants make HF's tables depend on the length of the forward pass, not only on
        the position; the tables below are the ones HF's greedy generate() uses for a
        request of up to max_position_embeddings positions:
        - "dynamic" rescales past max_position_embeddings (never served here) and keeps the
          rescaled frequencies until a shorter forward resets them: one 1-position call
          resets a module that an earlier long HF call left rescaled.
        - "longrope" uses its short factors while a forward's length is at most
          original_max_position_embeddings and its long factors for all positions of a longer
          one. Its decode steps rotate position p with the long factors exactly when
          p >= original_max_position_embeddings: so short factors below, long from there.
          A prompt past that length has long factors at every position, which HF's own
          prefill (EngineConfig.prefill="hf", and "auto" always for longrope) gives the
          prompt's keys; generate() refuses such a prompt with prefill="engine"."""
        if self.config.model_type in LEARNED_POSITION_TYPES + ALIBI_TYPES + NOPE_TYPES:  # no RoPE: tables that rotate nothing
            return self._identity_tables(max_positions)
        positions = torch.arange(max_positions, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        # LFM2-MoE names its rotary module pos_emb; OLMo Hybrid may have none (NoPE)
        rotary = inner.rotary_emb if hasattr(inner, "rotary_emb") else inner.pos_emb
        if rotary is None:
            return self._identity_tables(max_positions)
        kind = {} if layer_type is None else {"layer_type": layer_type}
        if self.config.model_type in PER_LAYER_THETA_TYPES:  # layer_type: a RoPE base, its own module
            rotary, kind = inner.rotary_embs[self.rope_types.index(layer_type)], {}
        with torch.no_grad():
            if rope_type(self.config) == "dynamic":
                rotary(probe, positions[:, :1], **kind)
            tables = rotary(probe, positions, **kind)
            if isinstance(tables, torch.Tensor) and tables.is_complex():  # DeepSeek-V2, Llama 4: each angle once, complex
                tables = (tables.real, tables.imag)
                if self.config.model_type == "llama4_text":  # its complex product turns adjacent pairs
                    tables = tuple(t.repeat_interleave(2, dim=-1) for t in tables)
            cos, sin = tables
            if self.config.model_type == "nanochat":  # its rotate_half is (x2, -x1): the turn by -angle
                sin = -sin
            if self.config.model_type in HALF_WIDTH_ROPE_TYPES:  # the angles once: both halves turn by them
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            if self.config.model_type in ("gptj", "codegen"):
                # its rotary module returns (sin, cos), one column per angle: laid out here as
                # the other pair models' modules give them (the angles twice, in halves), which
                # the interleaving below turns into GPT-J's repeat_interleave
                cos, sin = sin.repeat(1, 1, 2), cos.repeat(1, 1, 2)
            short = longrope_short_positions(self.config)
            if short is not None and short < max_positions:
                cos[:, :short], sin[:, :short] = rotary(probe, positions[:, :short])
        cos, sin = cos[0], sin[0]
        if self.config.model_type in HALF_TABLE_PAIRS_TYPES:  # as their apply_rotary_pos_emb
            cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        # in the model's dtype (OLMo 2's rotary module returns float32 tables for any model);
        # DeepSeek-V2 and Llama 4 rotate in float32 whatever the model's dtype
        dtype = torch.float32 if self.config.model_type in ("deepseek_v2", "llama4_text") else self.dtype
        return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()

    def _identity_tables(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos = 1, sin = 0 at every position: a model without RoPE."""
        return (torch.ones(max_positions, self.head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(max_positions, self.head_dim, dtype=self.dtype, device=self.device))

    # ---- maths on a block of rows -------------------------------------------------------

    @contextlib.contextmanager
    def layer_weights(self, index: int) -> Iterator[LayerWeights]:
        """Layer `index`'s weights for one step: its entry in `layers`, or for a layer
        accelerate offloads, the same view of its weights brought in by accelerate's hooks
        for the duration of the block (then dropped again: never a second copy)."""
        if index not in self.streamed_layers:
            yield self.layers[index]
            return
        with self.placement.layers[index].onloaded():
            yield self._layer(self._decoder_layers[index])

    @contextlib.contextmanager
    def head_weights(self) -> Iterator[None]:
        """The final norm's and the LM head's weights inside the block (`final_norm` the
        weight brought in where accelerate offloads it)."""
        if not self.head_streamed:
            yield
            return
        with self.placement.final_norm.onloaded(), self.placement.lm_head.onloaded():
            final = self._final_norm_module
            self.final_norm = final if self.layer_norm else final.weight
            try:
                yield
            finally:
                self.final_norm = final if self.layer_norm else final.weight

    @contextlib.contextmanager
    def embedding_weights(self) -> Iterator[None]:
        """The token embedding's weight (`embed`) inside the block, brought in where
        accelerate offloads it."""
        if self.placement is None or not self.placement.embedding.offloaded:
            yield
            return
        with self.placement.embedding.onloaded():
            self.embed = self._embed_module.weight
            try:
                yield
            finally:
                self.embed = self._embed_module.weight

    @functools.cached_property
    def rms_sequential_gated(self) -> bool:
        """Whether the layers are the form the C++ layer kernel computes: RMSNorms, the blocks
        one after the other, gated MLPs, q/k/v products of their own, nothing clamped, q/k
        norms (if any) before RoPE."""
        return (not self.layer_norm and self.parallel is None and self.clip_qkv is None
                and not self.qk_norm_after_rope and self.layer_sinks is None
                and all(lw.gate is not None and lw.qkv is None and lw.conv is None and lw.delta is None
                        and lw.mamba is None and lw.mamba1 is None and lw.latent is None
                        and lw.head_gate is None and lw.out_gate is None for lw in self.layers))

    def first_layer_input(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input from the token rows h [n, H] (positions: the step's, its
        first n the rows'): plus their positions' learned embedding rows (GPT-2:
        inputs_embeds + wpe(position_ids), as HF adds them), or normed (Bloom's
        word_embeddings_layernorm); h itself for every other model."""
        if self.embedding_norm is not None:
            return self.embedding_norm(h)
        if self.position_embedding is None:
            return h
        return h + F.embedding(positions[:h.shape[0]], self.position_embedding)

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [W] -> hidden [W, H] (times embedding_multiplier or Gemma's scale, as
        HF's model)."""
        if self.placement is None:
            return self._scale_embedding(F.embedding(token_ids, self.embed))
        with self.embedding_weights():
            return self._scale_embedding(F.embedding(token_ids, self.embed))

    def embed_row(self, token: int) -> torch.Tensor:
        """One token's hidden row [H], as embed_rows gives it (no index tensor made)."""
        if self.placement is None:
            return self._scale_embedding(self.embed[token])
        with self.embedding_weights():  # (a copy: the brought-in weight goes after the block)
            return self._scale_embedding(self.embed[token].clone())

    def _scale_embedding(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scaled_embedding:
            return rows * self._embed_module.embed_scale.to(rows.dtype)
        return rows if self.embedding_multiplier == 1.0 else rows * self.embedding_multiplier

    def norm(self, x: torch.Tensor, weight: torch.Tensor | torch.nn.Module) -> torch.Tensor:
        """The model's RMSNorm of x's rows by `weight` (Gemma's scales by 1 + w), or a
        LayerNorm model's norm module applied to them (its own maths: nn.LayerNorm, OLMo's
        parameter-free one, Cohere's float32 one; a row's result is its own)."""
        if isinstance(weight, torch.nn.Module):
            return weight(x)
        return rms_norm(x, weight, self.eps, self.norm_plus_one, self.norm_scale_in_float32)

    def act_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated MLP's act(gate) * up (SiLU, or Gemma's tanh-approximated GELU)."""
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up

    def residual(self, block_output: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream (times residual_multiplier)."""
        return block_output if self.residual_multiplier == 1.0 else block_output * self.residual_multiplier

    def head_input(self, final: torch.Tensor) -> torch.Tensor:
        """The final hidden state as the LM head reads it (MiniCPM3: divided by its
        logits_scaling; every other model: itself)."""
        return final if self.head_input_divisor == 1.0 else final / self.head_input_divisor

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as HF's model returns it (divided by logits_scaling; Gemma 2's
        soft cap)."""
        logits = soft_cap(logits, self.logits_softcap)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    @property
    def logits_transformed(self) -> bool:
        """Whether HF's logits are a rounding function of the LM head's (scaled, capped):
        two logits may then round to one value where HF's argmax takes the lower id."""
        return self.logits_scaling != 1.0 or self.logits_softcap is not None or self.logit_scale != 1.0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [W, H] after the last layer -> logits [W, V]."""
        with self.head_weights():
            return self.scale_logits(self.lm_head(self.head_input(self.norm(hidden, self.final_norm))))
