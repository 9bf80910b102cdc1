"""The engine's views of a decoder layer's weights: linear layers over row or column ranges
of a module's own tensors (RowSlice, MatrixView, TransposedLinear) and the dataclasses
holding one layer's parameters (LayerWeights) and its blocks' (MoE, short convolution,
DeltaNet, Mamba, latent attention). Each holds references to the HF model's own parameters,
never copies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# weight dtypes the engine's layouts may serve (each layout's self-test decides on this machine)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
            + (() if self.head_gate is None else (self.head_gate,)) \
            + (() if self.out_gate is None else (self.out_gate,))

    @property
    def has_mixer(self) -> bool:
        """Whether the layer mixes tokens (attention, a convolution, a DeltaNet or a Mamba): all
        but a Nemotron-H MLP layer do."""
        return self.o is not None or any(
            block is not None for block in (self.conv, self.delta, self.mamba, self.mamba1))

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

