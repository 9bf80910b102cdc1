"""The sparse MoE forms the engine runs: per form (a model type's ModelType.moe), how its
block is checked (refused by name where it does not fit) and read as MoEWeights (its
router's form bound from routing.py). FORMS names them; a model type without a form of its
own gets the standard one (HF's top-k softmax, Mixtral's)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import routing
from ..checks import _check_plain_linear
from ..errors import UnsupportedModelError
from ..modules import _router
from ..weights import FLOAT_DTYPES, MatrixView, MoEWeights, RowSlice

# the MoE forms (ModelType.moe) and what sets each apart; "softmax" (the standard form): a
# float top-k router, experts of gate_up_proj / down_proj, Qwen2-MoE's gated shared expert if any
FORMS = {
    "softmax": "HF's top-k softmax of the router's logits, renormalised where norm_topk_prob",
    "mixtral": "the standard softmax, its weights never rounded to the rows' dtype",
    "jamba": "the standard softmax, never renormalised",
    "granite": "the softmax of the float32 top-k logits; GraniteMoeShared's shared_mlp",
    "hunyuan": "the standard softmax on its router's `wg`, an ungated shared MLP in the block",
    "phimoe": "HF's own sparsemixer on the router's logits",
    "sigmoid_grouped": "DeepSeek-V3's sigmoid scores + e_score_correction_bias within the best groups",
    "minimax": "DeepSeek-V3's routing without groups or scaling, its bias on the block",
    "hy_v3": "MiniMax-M2's routing, scaled",
    "deepseek_v2": "the float32 softmax's top-k (group-limited), scaled",
    "mistral4": "the softmax within the best groups, renormalised",
    "kolibri1": "chosen by logit + bias, weighted by the chosen logits' sigmoid",
    "afmoe": "sigmoid scores chosen with the block's expert bias, one group",
    "lfm2": "sigmoid scores chosen with the block's expert bias",
    "ernie": "a float32 router with a correction bias on its choice",
    "cohere2": "the top-k logits' softmax or sigmoid; a shared MLP summed or averaged",
    "llama4": "experts stored [in, out], the weights scaling the experts' inputs",
    "gpt_oss": "experts stored [in, out] with biases, HF's own gate function",
    "nemotron_h": "DeepSeek-V3's routing, ungated experts and shared MLP",
}


def check_moe(name: str, block, form: str | None = None) -> None:
    """An MoE block the engine computes as MoEWeights says: a router with a float weight
    [E, H] and top_k, experts holding exactly gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    float weights (a quantized or biased expert, or another router, is refused by name).
    `form`: the model type's MoE form (ModelType.moe; FORMS)."""
    form_check = {"ernie": _check_ernie_moe, "minimax": _check_minimax_moe,
                  "cohere2": _check_cohere2_moe, "lfm2": _check_lfm2_moe, "deepseek_v2": _check_deepseek_v2_moe,
                  "mistral4": _check_mistral4_moe, "kolibri1": _check_kolibri1_moe, "afmoe": _check_afmoe_moe,
                  "hy_v3": _check_hy_v3_moe, "nemotron_h": _check_nemotron_h_moe,
                  "sigmoid_grouped": _check_sigmoid_router_moe}.get(form)
    if form_check is not None:  # a router of its own form: checked by its own function
        form_check(name, block)
        return
    # the forms whose experts are stored [in, out]: (whether the block fits, what runs)
    stored_in_out = {
        "llama4": (_check_llama4_moe, "for Llama 4 it runs a float top-k router without a bias, experts of "
                                           "gate_up_proj / down_proj stored [in, out] and a gated shared expert only"),
        "gpt_oss": (_check_gpt_oss_moe, "for GPT-OSS it runs a float top-k router with a bias and experts of "
                                        "gate_up_proj / down_proj with their biases only")}.get(form)
    if stored_in_out is not None:
        fits, runs = stored_in_out
        if fits(name, block):
            return
        raise _moe_refusal(name, block, runs)
    router, experts = _router(block), block.experts
    weight = _router_linear(block, form).weight if router is not None else None
    fits = (isinstance(weight, torch.Tensor) and weight.dtype in FLOAT_DTYPES and weight.dim() == 2
            and hasattr(router, "top_k") and _standard_experts(experts, weight.shape[0]))
    if fits and form == "hunyuan":  # its router's `wg`, its ungated shared MLP in the block
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
            name, block, "for LFM2-MoE it runs a sigmoid top-k router with an expert bias and experts of "
            "gate_up_proj / down_proj only")


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
            name, block, "for Cohere 2 MoE it runs a softmax or sigmoid top-k router, experts of "
            "gate_up_proj / down_proj and a gated shared MLP only")
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


def _router_linear(block, form: str | None):
    """The module holding an MoE block's router weight [E, H] (HunYuan-MoE's gate holds it in
    an nn.Linear `wg`; every other router holds it itself)."""
    router = _router(block)
    if form == "afmoe" and isinstance(getattr(router, "gate", None), torch.nn.Linear):  # its router's `gate`
        return router.gate
    return router.wg if form == "hunyuan" and isinstance(getattr(router, "wg", None),
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
            and isinstance(bias, torch.Tensor) and tuple(bias.shape) == (weight.shape[0],)
            and bias.dtype in FLOAT_DTYPES
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
            and isinstance(bias, torch.Tensor) and tuple(bias.shape) == (weight.shape[0],)
            and bias.dtype in FLOAT_DTYPES
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


def build_moe(block, form: str | None, shared_mlp=None) -> MoEWeights:
    """The MoE block's MoEWeights (check_moe has passed; `form`: the model type's MoE form;
    shared_mlp: GraniteMoeShared's, held by the layer)."""
    experts, router = block.experts, _router(block)
    top_k = int(router.top_k)
    if form == "nemotron_h":  # DeepSeek-V3's routing; ungated experts and shared MLP
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
    if form == "llama4":  # experts stored [in, out] (transposed views); the weights scale inputs
        shared = block.shared_expert
        return MoEWeights(
            router=MatrixView(router.weight), gate_up=[MatrixView(w.t()) for w in experts.gate_up_proj],
            down=[MatrixView(w.t()) for w in experts.down_proj], act=experts.act_fn,
            route=functools.partial(routing.topk_then_sigmoid, top_k=top_k),
            shared=(shared.gate_proj, shared.up_proj, shared.down_proj), weights_scale_inputs=True)
    if form == "gpt_oss":  # experts stored [in, out]: transposed views, with biases
        return MoEWeights(
            router=MatrixView(router.weight, router.bias),
            gate_up=[MatrixView(w.t(), b) for w, b in zip(experts.gate_up_proj, experts.gate_up_proj_bias)],
            down=[MatrixView(w.t(), b) for w, b in zip(experts.down_proj, experts.down_proj_bias)],
            act=None, route=functools.partial(routing.topk_softmax, top_k=top_k, in_float32=False),
            gate_fn=experts._apply_gate)
    router_weight = _router_linear(block, form).weight
    # views of the router's weight and of each expert's gate_up / down matrices
    parts = {"router": MatrixView(router_weight), "gate_up": [MatrixView(w) for w in experts.gate_up_proj],
                 "down": [MatrixView(w) for w in experts.down_proj], "act": experts.act_fn}
    shared = getattr(block, "shared_experts", None)  # DeepSeek-V3's, ERNIE's, Cohere 2 MoE's
    shared = None if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj)
    if form == "hy_v3":  # MiniMax-M2's routing (float32 logits), renormalised over sum + 1e-20, scaled
        return MoEWeights(**parts, route=functools.partial(
            routing.sigmoid_grouped, top_k=top_k, correction_bias=block.e_score_correction_bias, n_group=1,
            topk_group=1, normalize=True, norm_eps=1e-20, scaling=float(router.router_scaling_factor)),
            router_input_float32=True, shared=shared)
    if form in ("sigmoid_grouped", "minimax"):  # DeepSeek-V3's routing
        minimax = form == "minimax"  # no groups or scaling, its bias on the block
        route = functools.partial(
            routing.sigmoid_grouped, top_k=top_k,
            correction_bias=block.e_score_correction_bias if minimax else router.e_score_correction_bias,
            n_group=1 if minimax else int(router.num_group), topk_group=1 if minimax else int(router.topk_group),
            normalize=True if minimax else bool(router.norm_topk_prob), norm_eps=0.0 if minimax else 1e-20,
            scaling=1.0 if minimax else float(router.routed_scaling_factor))
        # MiniMax-M2 computes its logits in its router weight's dtype
        widen = router_weight.dtype == torch.float32 if minimax else True
        return MoEWeights(**parts, route=route, router_input_float32=widen, shared=shared)
    if form == "deepseek_v2":  # the float32 softmax's top-k (group-limited), scaled, not renormalised
        return MoEWeights(**parts, route=functools.partial(
            routing.softmax_group_limited, top_k=top_k, n_group=int(router.num_group or 1),
            topk_group=int(router.topk_group or 1), limited=router.topk_method == "group_limited_greedy",
            scaling=float(router.routed_scaling_factor)), router_input_float32=True, shared=shared)
    if form == "afmoe":  # sigmoid scores (logits in the rows' dtype) chosen with the block's bias, one group
        return MoEWeights(**parts, route=functools.partial(
            routing.sigmoid_grouped, top_k=top_k, correction_bias=block.expert_bias, n_group=1, topk_group=1,
            normalize=True, norm_eps=1e-20, scaling=float(router.route_scale)), shared=shared)
    if form == "kolibri1":  # chosen by logit + bias, weighted by the chosen logits' sigmoid
        return MoEWeights(**parts, route=functools.partial(
            routing.biased_logits_sigmoid, top_k=top_k, correction_bias=router.e_score_correction_bias,
            normalize=bool(router.norm_topk_prob)), router_input_float32=True, shared=shared)
    if form == "mistral4":  # the softmax (the rows' dtype) within the best groups, renormalised
        return MoEWeights(**parts, route=functools.partial(
            routing.softmax_grouped, top_k=top_k, n_group=int(router.num_group),
            topk_group=int(router.topk_group), normalize=bool(router.norm_topk_prob),
            scaling=float(router.routed_scaling_factor)), shared=shared)
    if form == "lfm2":  # sigmoid scores in the model's dtype, chosen with the block's bias
        return MoEWeights(**parts, route=functools.partial(
            routing.sigmoid_topk, top_k=top_k, expert_bias=block.expert_bias if block.use_expert_bias else None,
            normalize=bool(router.norm_topk_prob), scaling=float(router.routed_scaling_factor)))
    if form == "ernie":  # a float32 router with a correction bias on its choice
        return MoEWeights(**parts, route=functools.partial(
            routing.biased_softmax, top_k=top_k, correction_bias=router.moe_statics.e_score_correction_bias.view(-1),
            norm_min=float(router.norm_min)), router_input_float32=True, shared=shared)
    if form == "phimoe":  # HF's own sparsemixer on the router's logits
        from transformers.models.phimoe.modeling_phimoe import sparsemixer

        return MoEWeights(**parts, route=functools.partial(
            routing.sparsemixer, hf_sparsemixer=sparsemixer, top_k=top_k, jitter_eps=router.router_jitter_noise))
    if form == "cohere2":  # the top-k logits' softmax or sigmoid; a shared MLP summed or averaged
        return MoEWeights(**parts, route=functools.partial(
            routing.topk_softmax_or_sigmoid, top_k=top_k, selection=router.expert_selection_fn,
            normalize=bool(router.norm_topk_prob)), shared=shared,
            shared_average=block.shared_expert_combination_strategy == "average")
    if form == "granite":  # the softmax of the float32 top-k logits
        route = functools.partial(routing.topk_softmax, top_k=top_k, in_float32=True)
    else:  # Mixtral always renormalises and multiplies by the float32 weights
        route = functools.partial(routing.softmax_topk, top_k=top_k,  # Jamba: never renormalised
                                  normalize=form != "jamba" and bool(getattr(router, "norm_topk_prob", True)),
                                  round_weights=form != "mixtral")
    # Qwen2-MoE's gated shared expert; HunYuan-MoE's ungated shared MLP in the block
    shared = block.shared_mlp if form == "hunyuan" else getattr(block, "shared_expert", None)
    shared_rows = None if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj)
    if shared_mlp is not None:  # GraniteMoeShared: gate rows, then up's, in input_linear
        inter = shared_mlp.input_linear.out_features // 2
        shared_rows = (RowSlice(shared_mlp.input_linear, 0, inter),
                       RowSlice(shared_mlp.input_linear, inter, 2 * inter), shared_mlp.output_linear)
    return MoEWeights(
        **parts, route=route, shared=shared_rows, shared_gate=getattr(block, "shared_expert_gate", None),
        # HunYuan-MoE: HF widens the rows where its router's weight is float32
        router_input_float32=form == "hunyuan" and router_weight.dtype == torch.float32)
