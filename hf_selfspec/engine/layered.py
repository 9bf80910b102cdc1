"""A layered view of a Hugging Face causal LM's text decoder.

The view holds references to the HF model's own parameters (never copies) and the
maths of one decoder layer written as plain tensor ops on a `[W, hidden]` block of rows,
so the engine can run any row range through any layer range. The model types it runs, and
what sets each apart from Llama, are the registry's (families/: one module per family, its
model types as data; SUPPORTED_MODEL_TYPES lists them): GQA, MQA and MHA; tied or untied LM
head; linear biases; any head_dim; every RoPE type of these models' HF rotary module, whose
own tables the engine takes (rope.py). Each type is listed only after its modeling code was
read against Llama's: a model of another type is refused, never run on a guess.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .checks import GELU_TANH_NAMES, SILU_NAMES, _check_plain_linear, _dequantized_gguf
from .dispatch import ModelPlacement, model_placement
from .errors import UnsupportedModelError
from .families import (
    NORM_PLUS_ONE_TYPES,
    STATEFUL_MIXER_TYPES,
    SUPPORTED_MODEL_TYPES,
    TOKEN_TYPE_EMBEDDING_TYPES,
    spec_of,
)
from .families.moe_forms import build_moe, check_moe
from .limits import attention_window, query_scaling_positions, served_positions, windows_served
from .modules import (
    ATTENTION_PROJECTIONS,
    MLP_PROJECTIONS,
    _as_linear,
    _attention,
    _attention_name,
    _conv1d_class,
    _embedding,
    _first_held,
    _layer_window,
    _mlp_block,
    _mlp_path,
    _one_block,
    _projection_names,
    decoder_final_norm,
    decoder_layers,
)
from .norms import rms_norm, soft_cap
from .rope import (
    all_rope_tables,
    apply_rope,
    check_engine_prefill,
    longrope_short_positions,
    rope_layer_types,
    rope_type,
    rotate_half,
    rotate_pairs,
    rotates,
)
from .weights import (
    FLOAT_DTYPES,
    GatedDeltaNetWeights,
    LatentAttentionWeights,
    LayerWeights,
    Mamba1Weights,
    Mamba2Weights,
    MatrixView,
    MoEWeights,
    RowSlice,
    ShortConvWeights,
    TransposedLinear,
)

# names importable from here as before (core.py and its parts, attention.py, heads/base.py, tests)
__all__ = ["CPU_ONLY_REFUSAL", "FLOAT_DTYPES", "NORM_PLUS_ONE_TYPES", "STATEFUL_MIXER_TYPES", "SUPPORTED_MODEL_TYPES",
           "TOKEN_TYPE_EMBEDDING_TYPES", "GatedDeltaNetWeights", "LatentAttentionWeights", "LayerWeights",
           "LayeredModel", "Mamba1Weights", "Mamba2Weights", "MatrixView", "MoEWeights", "RowSlice", "ShortConvWeights",
           "TransposedLinear", "UnsupportedModelError", "apply_rope", "attention_window", "check_engine_prefill",
           "check_model_type", "cpu_only", "decoder_final_norm", "decoder_layers", "dispatch_placement",
           "longrope_short_positions", "query_scaling_positions", "rms_norm", "rope_type", "rotate_half",
           "rotate_pairs", "served_positions", "soft_cap", "text_config", "text_decoder", "windows_served"]

CPU_ONLY_REFUSAL = (
    "this model soft-caps its attention scores (Gemma 2), rotates its layer types by their own "
    "RoPE (Gemma 3, OLMo 3), turns adjacent pairs in its RoPE (GLM, ERNIE 4.5, Cohere), or has "
    "LayerNorms (StableLM, OLMo 1, Phi, StarCoder 2, GPT-NeoX, GPT-2, OPT, GPT-Neo, GPT-BigCode, "
    "GPT-J, CodeGen, Falcon, Nemotron, Bloom, MPT, Jais 2, Cohere 2, PhiMoE, NanoChat, Persimmon), MoE "
    "blocks, attention sinks (GPT-OSS, Granite-SWA), q/k norms after RoPE (HunYuan), short convolutions "
    "(LFM2), gated DeltaNets (Qwen 3.5, Qwen3-Next), Mamba mixers (Granite 4.0-H, Falcon-H1, Mamba) or latent "
    "attention (DeepSeek-V2 / V3, Youtu-LLM, GLM-4.7-Flash, MiniCPM3, Mistral 4), which the engine's "
    "CUDA programs do not serve yet: use it on the CPU, or plain "
    "model.generate()")
# the multipliers a model type's record may set (ModelType.multipliers), 1.0 for every other
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "head_input_divisor", "logits_scaling", "logit_scale",
               "attention_in_multiplier", "key_multiplier", "attention_out_multiplier", "mlp_gate_multiplier",
               "mlp_down_multiplier")


def _mixer_projections(layer, model_type: str) -> tuple[str, object, tuple[str, ...]]:
    """Where a decoder layer's token mixer sits (a module path prefix), the module, and the
    names of its projections: its attention's (LFM3's head gate, AFMoE's output gate too), or
    its hybrid's mixer's (ModelType.mixer)."""
    attn, spec = _attention(layer), spec_of(model_type)
    if attn is not None or spec.mixer is None:
        names = _projection_names(attn, ATTENTION_PROJECTIONS)
        if spec.head_gate and getattr(attn, "g_proj", None) is not None:
            names += ("g_proj",)
        if spec.out_gate:  # its attention's output gate
            names += ("gate_proj",)
        return _attention_name(layer) + ".", attn, names
    return spec.mixer.projections(layer)


def _activation(config) -> str:
    """The gated MLP's activation name (Gemma 2 and 3 read `hidden_activation`)."""
    act = getattr(config, "hidden_activation", None) if spec_of(config.model_type).gemma_later else None
    return act or getattr(config, "hidden_act", "silu")


def cpu_only(config, inner) -> bool:
    """Whether the model needs what only the engine's CPU programs do: Gemma 2's attention
    soft cap (the Triton attention has none), a RoPE per layer type (the CUDA-graph runner
    gathers one table), RoPE pairs (the Triton RoPE turns halves), attention sinks (the
    Triton attention has none); LayerNorm and MoE models and HunYuan's q/k norms after RoPE
    have not run on a GPU yet, nor have the hybrids' convolutions and recurrent states (LFM2,
    Qwen 3.5, the Mamba families) or latent attention: they stay on the CPU until they have
    (ModelType.cpu_only)."""
    spec = spec_of(config.model_type)
    softcap = spec.gemma_later and getattr(config, "attn_logit_softcapping", None) is not None
    return softcap or rope_layer_types(inner, config) is not None or spec.cpu_only


def text_config(model: torch.nn.Module):
    """The config of the model's text decoder: model.config, or an image-text model's
    text_config (its top-level config has no max_position_embeddings, windows, ...)."""
    config = model.config
    if spec_of(getattr(config, "model_type", None)).image_text_decoder is not None:
        return config.get_text_config()
    return config


def text_decoder(model: torch.nn.Module):
    """The module holding the decoder stack (embedding, layers, final norm, rotary_emb):
    model.model (GPT-NeoX: model.gpt_neox; ModelType.decoder_attribute), or an image-text
    model's language model (None where there is none)."""
    spec = spec_of(getattr(model.config, "model_type", None))
    if spec.image_text_decoder is not None:
        return getattr(getattr(model, "model", None), spec.image_text_decoder, None)
    module = model
    for name in spec.decoder_attribute.split("."):
        module = getattr(module, name, None)
    return module


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
        self.spec = spec = spec_of(config.model_type)  # its registry record (families/)
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.num_heads = 1 if spec.attention_free else config.num_attention_heads
        self.num_kv_heads = (None if spec.mha_only or spec.attention_free
                             else getattr(config, "num_key_value_heads", None)) or self.num_heads
        if spec.kv_heads is not None:  # GPT-BigCode's multi_query, Falcon's forms
            self.num_kv_heads = spec.kv_heads(config, self.num_kv_heads)
        self.head_dim = (8 if spec.attention_free
                         else getattr(config, "head_dim", None) or self.hidden_size // self.num_heads)
        # latent attention (LatentAttentionWeights): one KV head of [latent | k_rope], its
        # values the keys' own tensor
        self.values_are_keys = spec.latent_attention
        if spec.latent_attention:
            self.num_kv_heads = 1
            self.head_dim = config.kv_lora_rank + config.qk_rope_head_dim
        self.layer_norm = spec.layer_norm
        self.eps = float(getattr(config, "rms_norm_eps", 0.0) or 0.0)  # RMSNorm models'
        if spec.eps_attribute is not None:  # LFM2's norm_eps, the Mambas' layer_norm_epsilon
            self.eps = float(getattr(config, spec.eps_attribute))
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
        # the multipliers (MULTIPLIERS; 1.0 where the record sets none): Granite's four (the
        # embedding rows scaled, each block's output joining the residual stream scaled, the
        # logits divided; its attention_multiplier is its `scaling`), Cohere's logit_scale,
        # MiniCPM3's residual scale and head input divisor, Falcon-H1's muP multipliers (the
        # attention's input, its k projection and its output; the MLP's gate product, before
        # the activation, and its output)
        multipliers = dict.fromkeys(MULTIPLIERS, 1.0)
        if spec.multipliers is not None:
            multipliers.update(spec.multipliers(config))
        for name, value in multipliers.items():
            setattr(self, name, value)
        # Gemma's embedding module scales its rows by sqrt(hidden), rounded to the weights'
        # dtype first (a buffer of the module: read when used, so a .to() is followed)
        self._embed_module = embedding
        self.scaled_embedding = isinstance(getattr(embedding, "embed_scale", None), torch.Tensor)
        self.norm_plus_one = spec.norm_plus_one
        self.norm_scale_in_float32 = spec.norm_scale_in_float32
        self.gelu = _activation(config) in GELU_TANH_NAMES
        self.attention_softcap = getattr(config, "attn_logit_softcapping", None) if spec.gemma_later else None
        self.logits_softcap = getattr(config, "final_logit_softcapping", None) if spec.logits_softcap else None
        # HunYuan norms q and k (per head) after RoPE, every other model before it
        self.qk_norm_after_rope = spec.qk_norm_after_rope
        # OLMo (1) clamps q, k and v to [-clip_qkv, clip_qkv] after their products
        self.clip_qkv = None if spec.clip_qkv is None else spec.clip_qkv(config)
        # parallel layers (LayerWeights): "shared" one input norm for both blocks (Phi,
        # Cohere, StableLM's option), "two" each block its own (GPT-NeoX); the outputs join h
        # in HF's order: (attention + MLP) + h (Phi, GPT-NeoX) or (h + attention) + MLP
        self.parallel = None if spec.parallel_form is None else spec.parallel_form(config)
        self.parallel_sum_first = spec.parallel_sum_first
        self.scaling = self.head_dim**-0.5
        if spec.scaling is not None:  # Granite's attention_multiplier, Gemma 2's query_pre_attn_scalar, ...
            self.scaling = spec.scaling(config, self.scaling)
        # the learned position embedding [P, H] (GPT-2's wpe; OPT's embed_positions from its
        # row `offset`, 2: a view), added before the first layer
        self.position_embedding = None if spec.position_embedding is None else spec.position_embedding(inner)
        # Bloom, MPT: ALiBi's slopes [Hq] (float32, from HF's own tensors); Bloom: the LayerNorm
        # of the embedding rows before the first layer
        self.alibi_slopes = None if spec.alibi_slopes is None else spec.alibi_slopes(config)
        if spec.latent_attention:  # (q.k dims)^-0.5, times YaRN's mscale squared where it applies: the module's own
            self.scaling = float(_attention(decoder_layers(inner)[0]).scaling)
        self.embedding_norm = getattr(inner, "word_embeddings_layernorm", None)
        if spec.embedding_norm is not None:  # NanoChat's final norm
            self.embedding_norm = spec.embedding_norm(inner)
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
        self.gated_attention = spec.gated_attention
        # GPT-OSS: per layer, its attention's sink per head [Hq] (the module's own parameter);
        # None for a model without sinks
        self.layer_sinks = tuple(_attention(layer).sinks for layer in layers) if spec.attention_sinks else None
        # per layer, whether HF rotates its q and k (SmolLM3 leaves every 4th layer without
        # RoPE: `no_rope_layers`, read by each attention module as `use_rope`)
        # (OLMo Hybrid's released checkpoints have no rotary module: NoPE everywhere)
        self.rope_layers = tuple(rotates(_attention(layer), config) and getattr(inner, "rotary_emb", True) is not None
                                 and spec.positions != "none" for layer in layers)
        # Gemma 3 rotates each layer type (sliding / full attention) by its own RoPE: HF's
        # rotary module takes the layer type. rope_types: the types in table order (None:
        # one RoPE for every layer); layer_rope: each layer's table, -1 for none
        self.rope_types = rope_layer_types(inner, config)
        kinds = (config.layer_rope_theta if spec.rope_per_layer_theta
                 else getattr(config, "layer_types", None) or [None] * self.num_layers)
        self.layer_rope = tuple(
            -1 if not rotated else (0 if self.rope_types is None else self.rope_types.index(kind))
            for rotated, kind in zip(self.rope_layers, kinds))
        # per layer, the sliding window of its attention (0: none; _layer_window)
        window = attention_window(config) or 0
        self.layer_window = tuple(_layer_window(_attention(layer), window) for layer in layers)
        self.max_positions = self._table_positions(config, max_positions, self.device)
        # GLM, ERNIE 4.5: RoPE turns adjacent pairs (apply_rope's pairs)
        self.rope_pairs = spec.rope_pairs
        self.rope_tables = all_rope_tables(self, inner, self.max_positions)
        self.cos, self.sin = self.rope_tables[0]  # [P, d] each


    @classmethod
    def check_supported(cls, model: torch.nn.Module, max_positions: int = 1) -> None:
        """Raise (UnsupportedModelError, a ValueError) naming what the engine cannot run:
        the architecture, a feature (sliding window, activation), quantization, or a
        projection that is not a plain float nn.Linear. Cheap: attach_heads may call it."""
        model_type = check_model_type(model)
        spec = spec_of(model_type)
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
                check_moe(f"model.layers.{i}.{_mlp_path(layer)[:-1] or 'mlp'}", _mlp_block(layer), spec.moe)
            shared_mlp = getattr(layer, "shared_mlp", None)
            if shared_mlp is not None:  # GraniteMoeShared's: a gated MLP, gate and up rows fused
                projections += [(f"model.layers.{i}.shared_mlp.{name}", getattr(shared_mlp, name, None))
                                for name in ("input_linear", "output_linear")]
        for i, layer in enumerate(layers):
            if spec.mixer is not None:  # a hybrid's mixer (refused by name), and any projections beside
                projections += spec.mixer.check(i, layer, config)
        for name, module in projections:
            _check_plain_linear(name, module, spec)
        if spec.check_attention is not None:  # (its projections plain, checked above)
            for i, layer in enumerate(layers):
                spec.check_attention(f"model.layers.{i}.{_attention_name(layer)}", _attention(layer), config)
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
        self.rope_tables = all_rope_tables(self, self.decoder, max_positions)
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
        spec = spec_of(config.model_type)
        act = _activation(config)
        if act not in SILU_NAMES + GELU_TANH_NAMES and not spec.plain_mlp:
            raise UnsupportedModelError(
                f"hidden_act={act!r}: the engine implements gated MLPs with "
                f"{', '.join(repr(a) for a in SILU_NAMES + GELU_TANH_NAMES)} only; use plain "
                "model.generate() for this model")
        if spec.check_config is not None:  # the family's refusals of configurations it cannot run
            spec.check_config(config)
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
        attn, mlp, spec = _attention(layer), _mlp_block(layer), self.spec
        # HunYuan names its per-head q/k norms query_ / key_layernorm, LFM2 q_ / k_layernorm
        q_norm = k_norm = None
        for q_name, k_name in (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"),
                               ("q_layernorm", "k_layernorm")):
            if hasattr(attn, q_name):
                q_norm, k_norm = getattr(attn, q_name), getattr(attn, k_name)
                break
        if getattr(attn, "qk_norm", None) is not None:  # Llama 4: one weightless L2 norm for q and k (HF's module)
            q_norm = k_norm = attn.qk_norm
        # the token mixer's LayerWeights fields: q, k, v (or qkv, a hybrid's mixer, latent attention) and o
        fields = {"q": None, "k": None, "v": None, "o": None}
        if attn is None:
            if _one_block(layer) not in ("mlp", "moe"):  # (a Nemotron-H layer without a token mixer: none)
                fields.update(spec.mixer.build(layer, self))  # a hybrid's convolution, DeltaNet or Mamba
        else:
            fields.update(self._attention_fields(attn))
            o = attn.o_proj if hasattr(attn, "o_proj") else attn.dense if hasattr(attn, "dense") \
                else attn.out_proj if hasattr(attn, "out_proj") else _as_linear(attn.c_proj)
            fields["o"] = o
        if spec.mixer is not None and spec.mixer.build_beside is not None:  # Falcon-H1: its Mamba2 beside the attention
            fields.update(spec.mixer.build_beside(layer, self))
        gate = act = moe = None
        if mlp is None:  # a Nemotron-H layer whose one block is a token mixer
            up = down = None
        elif hasattr(mlp, "experts"):  # a sparse MoE block (its dense layers: an MLP below)
            up = down = None
            moe = build_moe(mlp, spec.moe or "softmax", getattr(layer, "shared_mlp", None))
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
            moe=moe,
            head_gate=getattr(attn, "g_proj", None) if spec.head_gate else None,
            out_gate=attn.gate_proj if spec.out_gate else None,
            **fields,
        )

    def _attention_fields(self, attn) -> dict:
        """An attention module's q, k and v as LayerWeights fields: views of its own weights
        (fused ones read as row or column ranges), or the family's own reading
        (ModelType.read_attention: CodeGen's shards, Falcon's forms, latent attention)."""
        if self.spec.read_attention is not None:
            return self.spec.read_attention(attn, self)
        if hasattr(attn, "Wqkv"):  # MPT: q, k, v rows of one weight, in that order
            width = self.num_heads * self.head_dim
            q, k, v = (RowSlice(attn.Wqkv, lo, lo + width) for lo in (0, width, 2 * width))
        elif hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v rows of one weight, in that order
            qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = (RowSlice(attn.qkv_proj, lo, hi) for lo, hi in ((0, qd), (qd, qd + kvd),
                                                                        (qd + kvd, qd + 2 * kvd)))
        elif hasattr(attn, "query_key_value"):  # GPT-NeoX: per head, its q, k and v rows
            return {"qkv": attn.query_key_value}
        elif isinstance(getattr(attn, "c_attn", None), _conv1d_class()):  # GPT-2: q, k, v columns of [H, 3H]
            width = self.num_heads * self.head_dim
            q, k, v = (TransposedLinear(attn.c_attn, lo, lo + width) for lo in (0, width, 2 * width))
        elif hasattr(attn, "c_attn") and self.num_kv_heads == 1:  # GPT-BigCode multi-query: q, k, v rows
            qd, kvd = self.num_heads * self.head_dim, self.head_dim
            q, k, v = (RowSlice(attn.c_attn, lo, hi) for lo, hi in ((0, qd), (qd, qd + kvd),
                                                                     (qd + kvd, qd + 2 * kvd)))
        elif hasattr(attn, "c_attn"):  # GPT-BigCode's MHA form: per head, its q, k and v rows (GPT-NeoX's)
            return {"qkv": attn.c_attn}
        else:
            q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        return {"q": q, "k": k, "v": v}

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
