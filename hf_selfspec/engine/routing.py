"""Sparse MoE routers as HF's modules compute them, from the router's logits.

Every function maps the router logits of a step's real rows [n, E] (the engine's own
row-invariant product) and the rows' dtype to (weights [n, k], experts [n, k]); each row's
result depends on its own logits only. LayeredModel._moe binds one of them, with the
model's constants, as MoEWeights.route.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_topk(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, normalize: bool,
                 round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, HunYuan-MoE: the softmax in float32, its top_k,
    renormalised where `normalize`, rounded to the logits' dtype where `round_weights`
    (Mixtral multiplies by the float32 weights)."""
    top, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top.to(logits.dtype) if round_weights else top), chosen


def topk_softmax(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int,
                 in_float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Granite MoE (in float32) and GPT-OSS (in the logits' dtype): the softmax of the top_k
    logits, rounded to the logits' dtype."""
    top, chosen = torch.topk(logits.float() if in_float32 else logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1).to(logits.dtype), chosen


def within_best_groups(values: torch.Tensor, group_scores: torch.Tensor, topk_group: int,
                       fill: float) -> torch.Tensor:
    """values [n, E] with every expert outside the topk_group best of the groups (by
    group_scores [n, n_group], each group E / n_group consecutive experts) set to `fill`:
    the group-limited choice of DeepSeek-V2 / V3 and Mistral 4, HF's ops in HF's order."""
    n, experts = values.shape
    n_group = group_scores.shape[1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, n_group, experts // n_group).reshape(n, experts)
    return values.masked_fill(~score_mask.bool(), fill)


def sigmoid_grouped(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, correction_bias: torch.Tensor,
                    n_group: int, topk_group: int, normalize: bool, norm_eps: float,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (GLM-4.5, dots.llm1, Solar Open, Sarvam, K-EXAONE, MiniMax-M2),
    HF's ops in HF's order: sigmoid scores of the float32 logits; the choice by score +
    correction_bias [E] among the experts of the topk_group best of n_group groups (a group's
    worth: its two best choice values); the weights the chosen scores, renormalised where
    `normalize` (their sum + norm_eps: DeepSeek's 1e-20, MiniMax-M2's 0), times `scaling`,
    in float32."""
    scores = torch.sigmoid(logits.float())
    choice = scores + correction_bias
    n, experts = choice.shape
    group_scores = choice.view(n, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    choice = within_best_groups(choice, group_scores, topk_group, float("-inf"))
    chosen = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    top = scores.gather(1, chosen)
    if normalize:
        top = top / (top.sum(dim=-1, keepdim=True) + norm_eps)
    return top * scaling, chosen


def softmax_group_limited(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, n_group: int, topk_group: int,
                          limited: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing, HF's ops in HF's order: the softmax of the float32 logits; its
    top_k, where `limited` ("group_limited_greedy") among the experts of the topk_group groups
    of n_group with the highest best score (the others' scores zeroed); never renormalised,
    times `scaling`, in float32."""
    scores = logits.float().softmax(dim=-1, dtype=torch.float32)
    if limited:
        n, experts = scores.shape
        group_scores = scores.view(n, n_group, experts // n_group).max(dim=-1).values
        scores = within_best_groups(scores, group_scores, topk_group, 0.0)
    top, chosen = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return top * scaling, chosen


def softmax_grouped(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, n_group: int, topk_group: int,
                    normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mistral 4's routing, HF's ops in HF's order, in the logits' dtype: the softmax; the
    choice among the experts of the topk_group best of n_group groups (a group's worth: its
    two best scores; the others' scores zeroed); the chosen scores, renormalised where
    `normalize` (their sum + 1e-20), times `scaling`."""
    scores = logits.softmax(-1)
    n, experts = scores.shape
    group_scores = scores.view(n, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(within_best_groups(scores, group_scores, topk_group, 0.0), k=top_k, dim=-1, sorted=False)[1]
    top = scores.gather(1, chosen)
    if normalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * scaling, chosen


def sigmoid_topk(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, expert_bias: torch.Tensor | None,
                 normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LFM2-MoE: sigmoid scores in the logits' dtype; the choice by score + expert_bias [E]
    (float32) where there is one, else by score; the chosen scores, renormalised where
    `normalize` (over their sum + 1e-6), times `scaling`, in the logits' dtype."""
    scores = logits.sigmoid()
    if expert_bias is not None:
        chosen = torch.topk(scores + expert_bias, k=top_k, dim=-1)[1]
        top = torch.gather(scores, dim=1, index=chosen).type_as(logits)
    else:
        top, chosen = torch.topk(scores, k=top_k, dim=-1)
    if normalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-6)
    return top * scaling, chosen


def biased_softmax(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, correction_bias: torch.Tensor,
                   norm_min: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ERNIE 4.5 MoE, from float32 logits: the softmax; the choice by probability +
    correction_bias; the chosen probabilities over their sum (at least norm_min), rounded to
    the rows' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    chosen = torch.topk(probs + correction_bias, top_k, dim=-1)[1]
    top = torch.gather(probs, dim=-1, index=chosen)
    top = top / torch.clamp(top.sum(dim=-1, keepdim=True), min=norm_min)
    return top.to(dtype), chosen


def topk_softmax_or_sigmoid(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, selection: str,
                            normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Cohere 2 MoE: the top_k logits, their softmax in float32 or their sigmoid (renormalised
    where `normalize`), rounded to the logits' dtype."""
    scores, chosen = torch.topk(logits, top_k, dim=-1)
    if selection == "softmax":
        scores = F.softmax(scores, dim=1, dtype=torch.float)
    else:
        scores = F.sigmoid(scores)
        if normalize:
            scores = scores / torch.sum(scores, dim=-1, keepdim=True)
    return scores.to(logits.dtype), chosen


def sparsemixer(logits: torch.Tensor, dtype: torch.dtype, *, hf_sparsemixer, top_k: int,
                jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE: HF's own sparsemixer (the function of its modeling module), in evaluation mode."""
    return hf_sparsemixer(logits, jitter_eps=jitter_eps, training=False, top_k=top_k)


def topk_then_sigmoid(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4: the top_k logits' sigmoid in float32, rounded to the logits' dtype (HF's
    sigmoid over the scattered scores gives the others 0: they add nothing). These weights
    scale the expert's input rows, not its output (MoEWeights.weights_scale_inputs)."""
    top, chosen = torch.topk(logits, top_k, dim=1)
    return torch.sigmoid(top.float()).to(logits.dtype), chosen


def biased_logits_sigmoid(logits: torch.Tensor, dtype: torch.dtype, *, top_k: int, correction_bias: torch.Tensor,
                          normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Kolibri-1, from float32 logits: the choice by logit + correction_bias [E]; the weights
    the chosen logits' sigmoid, over their sum where `normalize`, in float32."""
    chosen = torch.topk(logits + correction_bias, top_k, dim=-1)[1]
    top = logits.gather(1, chosen).sigmoid()
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, chosen
