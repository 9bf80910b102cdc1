"""What the engine knows of one model type: `ModelType`, a frozen record of the facts and
functions that set its layers apart from Llama's (each field's default is Llama's). A family
module (llama.py, gemma.py, ...) lists its model types as ModelType records; the registry
(families/__init__.py) maps each model_type to its record, and LayeredModel reads the record
instead of testing model_type against lists."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# how a model type places its positions: "rope" (its HF rotary module's tables), "learned"
# (an absolute position embedding added before the first layer: GPT-2's wpe), "alibi" (a
# per-head slope times the key's position on the scores: Bloom, MPT), "none" (NoPE)
POSITIONS = ("rope", "learned", "alibi", "none")
# which of a model's attention layers HF rotates, where not all (`ModelType.rotated_layers`):
# "local" (AFMoE: its local layers), "sliding_or_no_window" (EXAONE 4: its full-attention
# layers unrotated where the model slides), "sliding" (Cohere 2: its sliding layers, or where
# a module forces RoPE), "layer_theta" (Granite-SWA: a base of 0 is NoPE)
ROTATED_LAYERS = (None, "local", "sliding_or_no_window", "sliding", "layer_theta")


@dataclass(frozen=True)
class Mixer:
    """The token mixer a hybrid's layers hold in place of (Falcon-H1: beside) attention: LFM2's
    short convolution, a gated DeltaNet, a Mamba2 or a first Mamba mixer."""

    kind: str  # "short_conv", "delta_net", "mamba2", "mamba1"
    # layer -> (its module path prefix, the mixer module or None, its projections' names)
    projections: Callable
    # (i, layer, config) -> [(name, module)]: checks layer i's mixer (refused by name),
    # returning further projections to check as plain linears
    check: Callable
    # (layer, view) -> LayerWeights fields: the mixer of a layer without attention
    build: Callable
    # (layer, view) -> LayerWeights fields: the mixer beside a layer's attention (Falcon-H1)
    build_beside: Callable | None = None


@dataclass(frozen=True)
class ModelType:
    """One model_type the engine runs, and what sets it apart from Llama (the defaults)."""

    name: str  # the config's model_type
    family: str = ""  # the family module's name (filled in by its Family)

    # ---- where its parts are --------------------------------------------------------------
    # the causal LM's attribute holding the decoder stack (a dotted path: OPT "model.decoder")
    decoder_attribute: str = "model"
    # an image-text class served for its text decoder: model.model's attribute holding it
    image_text_decoder: str | None = None
    # the config attribute of its RMSNorms' eps (None: rms_norm_eps, 0.0 where absent)
    eps_attribute: str | None = None

    # ---- norms and MLPs -------------------------------------------------------------------
    # LayerNorm models: their norm modules (mean subtracted) called as HF calls them
    layer_norm: bool = False
    # RMSNorm scaling by (1 + w) in float32, rounded to the input's dtype (Gemma, Qwen 3.5)
    norm_plus_one: bool = False
    # RMSNorm's x * w in float32, rounded after (Helium, GPT-OSS, Nemotron-H)
    norm_scale_in_float32: bool = False
    # a plain MLP (up -> act -> down, no gate): HF's own activation module runs it
    plain_mlp: bool = False
    # Gemma 2 and 3: query_pre_attn_scalar, soft caps, hidden_activation
    gemma_later: bool = False
    # its logits soft-capped by final_logit_softcapping (Gemma 2 and 3 too: gemma_later)
    logits_softcap: bool = False
    # the sparse MoE form of its MoE blocks (families/moe_forms.py FORMS; "softmax" the
    # standard one, which a block holding experts of a type without a form gets too); None: dense
    moe: str | None = None

    # ---- attention --------------------------------------------------------------------------
    # the token mixer of its other layers (hybrids; Falcon-H1: beside its attention)
    mixer: Mixer | None = None
    # layers holding ONE block each (`mixer`): Nemotron-H, the Mambas
    one_block_layers: bool = False
    # no attention at all: no KV cache to speak of (one head of 8 dimensions, never written)
    attention_free: bool = False
    # multi-head latent attention (LatentAttentionWeights)
    latent_attention: bool = False
    # Qwen 3.5: q_proj gives each head its q rows, then as many gate rows
    gated_attention: bool = False
    # (attention module, view) -> its q, k, v (qkv, qkv_layout, latent) LayerWeights fields,
    # where the family reads them its own way (CodeGen's shards, Falcon's forms, latent attention)
    read_attention: Callable | None = None
    # (name, attention module, config) -> None, or UnsupportedModelError: an attention block
    # the family reads its own way, checked (latent attention)
    check_attention: Callable | None = None
    # LFM3's head gate (`g_proj`: each head's output times sigmoid(its row . x))
    head_gate: bool = False
    # AFMoE's output gate (`gate_proj`: the attention's output times sigmoid(its product))
    out_gate: bool = False
    # without GQA: a num_key_value_heads its config carries is not read
    mha_only: bool = False
    # the number of KV heads where the config says it otherwise (GPT-BigCode, Falcon): config -> int
    kv_heads: Callable | None = None
    # learnable sinks per head (`sinks`) in each softmax's denominator
    attention_sinks: bool = False
    # per-head q/k norms after RoPE (HunYuan), not before
    qk_norm_after_rope: bool = False
    # OLMo's clip_qkv: config -> the clamp of q, k and v (None: none)
    clip_qkv: Callable | None = None
    # (config, scaling) -> the attention's score scale, where not head_dim^-0.5 (Granite, Gemma 2, GPT-2, MPT)
    scaling: Callable | None = None
    # projections stored as transformers' Conv1D (weight [in, out]: TransposedLinear): GPT-2
    conv1d: bool = False
    # module -> the class its projection must be (Falcon's FalconLinear), else nn.Linear
    linear_class: Callable | None = None

    # ---- positions --------------------------------------------------------------------------
    positions: str = "rope"  # POSITIONS
    rope_pairs: bool = False  # RoPE turning adjacent pairs, not halves
    rope_half_tables: bool = False  # of them, those whose rotary module gives the halves' tables
    rope_half_width: bool = False  # tables of half a head's width, doubled (GPT-OSS)
    rope_complex_pairs: bool = False  # complex tables of adjacent pairs (Llama 4)
    rope_sin_negated: bool = False  # rotate_half as (x2, -x1): the turn by -angle (NanoChat)
    rope_sin_cos_swapped: bool = False  # a rotary module returning (sin, cos), one column per angle (GPT-J)
    rope_float32: bool = False  # rotating in float32 whatever the model's dtype (DeepSeek-V2, Llama 4)
    rope_per_layer_theta: bool = False  # a RoPE base per layer (layer_rope_theta; 0: no RoPE)
    rotated_layers: str | None = None  # ROTATED_LAYERS
    # inner -> the learned position embedding [P, H] (positions "learned")
    position_embedding: Callable | None = None
    # config -> ALiBi's slope per head [Hq], float32 (positions "alibi")
    alibi_slopes: Callable | None = None
    # token_type_ids' embedding added by its forward (the engine does not: refused)
    token_type_embeddings: bool = False

    # config -> the sliding window HF applies in at least one layer, where the family says it
    # its own way (GPT-Neo's local layers; else the config's sliding_window)
    window: Callable | None = None
    # config -> the position from which HF scales the queries by position, or attends within
    # chunks (Llama 4's attention temperature and chunks); None: never
    query_scaling: Callable | None = None

    # ---- layers and multipliers -------------------------------------------------------------
    # config -> how a layer's blocks read h: None one after the other, "shared" both from one
    # input norm, "two" each from its own
    parallel_form: Callable | None = None
    # parallel outputs summed before they join h: (attention + MLP) + h
    parallel_sum_first: bool = False
    # inner -> the norm module of the embedding rows before the first layer (Bloom's
    # word_embeddings_layernorm is found by name)
    embedding_norm: Callable | None = None
    # config -> the multipliers that are not 1.0 (LayeredModel's names: embedding_multiplier,
    # residual_multiplier, logits_scaling, logit_scale, head_input_divisor, Falcon-H1's muP ones)
    multipliers: Callable | None = None
    # config -> None, or UnsupportedModelError for a configuration of this type it cannot run
    check_config: Callable | None = None

    @property
    def rope(self) -> bool:
        return self.positions == "rope"

    @property
    def stateful(self) -> bool:
        """Layers whose state or cached weight views the engine keeps across steps: not
        streamed from accelerate's offload (dispatch.py)."""
        return self.latent_attention or self.mixer is not None

    @property
    def cpu_only(self) -> bool:
        """What only the engine's CPU programs serve, whatever the configuration (layered.cpu_only)."""
        return (self.rope_pairs or self.layer_norm or self.moe is not None or self.qk_norm_after_rope
                or self.attention_sinks or self.stateful)


@dataclass(frozen=True)
class Family:
    """A family module's spec: its name and its model types."""

    name: str
    doc: str  # one line: what the family's layers are
    types: tuple[ModelType, ...]

    def __post_init__(self):
        object.__setattr__(self, "types", tuple(
            t if t.family == self.name else _replace(t, family=self.name) for t in self.types))

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.types)


def _replace(spec: ModelType, **changes) -> ModelType:
    from dataclasses import replace

    return replace(spec, **changes)
