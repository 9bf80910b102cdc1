"""Held-out evaluation and calibration of top-layer heads, on the model's own replies.

At every held-out position where the committed token is the model's own (x_{t+1} == a_t),
the chain runs as the decoder runs it: step i is fed step i-1's draft. Step i is *reached*
when every earlier draft was right and the text keeps following the model there; its
top-1 agreement given reached, and the expected tokens per verification of a full chain

    tau = 1 + sum_i P(drafts 0..i all right)

(the figures of docs/head_study.md; thresholds thr: a step also stops the chain when its
confidence is below thr).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..heads.calibrate import Calibration, ChainCalibration
from .train import Examples

TAU_THRESHOLDS = (0.0, 0.2, 0.4, 0.6)


@dataclass(frozen=True)
class ChainOutcomes:
    """Per step i (lists of D tensors over N positions): the draft's confidence, whether it
    is the model's token, whether the step is reached, its top-4 hit."""

    confidence: list[torch.Tensor]
    right: list[torch.Tensor]
    reached: list[torch.Tensor]
    top4: list[torch.Tensor]


@torch.no_grad()
def chain_outcomes(heads, data: Examples, chunk: int = 4096) -> ChainOutcomes:
    """Run the chain (fed its own drafts) over the positions of `data` whose committed token
    is the model's own, `chunk` positions at a time."""
    D = heads.config.depth
    if data.x.shape[1] < D:
        raise ValueError(f"examples of depth {data.x.shape[1]} for heads of depth {D}")
    sel = data.agree[:, 0]
    f, x, y, agree = data.f[sel], data.x[sel], data.y[sel], data.agree[sel]
    device, dtype = heads.out_norm.device, heads.out_norm.dtype
    parts = {name: [[] for _ in range(D)] for name in ("confidence", "right", "reached", "top4")}
    for lo in range(0, len(f), chunk):
        h = f[lo:lo + chunk].to(device, dtype)
        yy, aa = y[lo:lo + chunk].to(device), agree[lo:lo + chunk].to(device)
        prev = x[lo:lo + chunk, 0].to(device)
        alive = torch.ones(len(h), dtype=torch.bool, device=device)
        for i in range(D):
            h, logits = heads.step_logits(i, h, prev)
            probs = torch.softmax(logits.float(), -1)
            conf, idx = probs.max(-1)
            draft = heads.vocab_ids[idx]
            right = draft == yy[:, i]
            top4 = (heads.vocab_ids[probs.topk(min(4, probs.shape[-1]), -1).indices] == yy[:, i:i + 1]).any(-1)
            for name, value in (("confidence", conf), ("right", right), ("reached", alive), ("top4", top4)):
                parts[name][i].append(value.cpu())
            # the next step is reached when this draft was right and the text goes on as
            # the model's own (then its tokens are the decoder's)
            alive = alive & right
            if i + 1 < D:
                alive = alive & aa[:, i + 1]
            prev = draft
    return ChainOutcomes(**{name: [torch.cat(p) if p else torch.zeros(0, dtype=torch.bool) for p in per_step]
                            for name, per_step in parts.items()})


def evaluate(heads, data: Examples, prefix: str = "own_eval_") -> dict:
    """Held-out figures under the keys heads/card.py reads: {prefix}positions,
    {prefix}step{i}_top1_given_reached, {prefix}step{i}_top4_given_reached,
    {prefix}tau_thr{thr}."""
    o = chain_outcomes(heads, data)
    n = len(o.right[0])
    report = {f"{prefix}positions": n}
    if n == 0:
        return report
    chain = {thr: torch.ones(n, dtype=torch.bool) for thr in TAU_THRESHOLDS}
    taus = dict.fromkeys(TAU_THRESHOLDS, 1.0)
    for i in range(heads.config.depth):
        reached = o.reached[i]
        if bool(reached.any()):
            report[f"{prefix}step{i}_top1_given_reached"] = round(float(o.right[i][reached].float().mean()), 4)
            report[f"{prefix}step{i}_top4_given_reached"] = round(float(o.top4[i][reached].float().mean()), 4)
        for thr in TAU_THRESHOLDS:
            # a draft is accepted when it and every earlier one are right (on the model's
            # own replies the text always follows the model, so `reached` adds nothing)
            chain[thr] = chain[thr] & o.right[i] & (o.confidence[i] >= thr)
            taus[thr] += float(chain[thr].float().mean())
    for thr, tau in taus.items():
        report[f"{prefix}tau_thr{thr}"] = round(tau, 4)
    return report


def calibrate(heads, data: Examples, min_accept: float = 0.0) -> tuple[ChainCalibration, dict]:
    """Chain thresholds from held-out (confidence, right) pairs of reached steps, through
    the isotonic calibration of heads/calibrate.py: step i drafts when its calibrated
    acceptance reaches `min_accept` (0: always draft, as the shipped heads, whose drafts
    the decoder's dynamic tree ranks by path probability). Returns the calibration and
    figures for the model card (each step's accept rate and the confidence at which its
    acceptance reaches 0.5)."""
    o = chain_outcomes(heads, data)
    confs = [o.confidence[i][o.reached[i]] for i in range(heads.config.depth)]
    rights = [o.right[i][o.reached[i]] for i in range(heads.config.depth)]
    if len(confs[0]) == 0:
        raise ValueError("no held-out positions to calibrate on: collect more replies")
    # a step never reached on the held-out replies keeps threshold 0 (no evidence to stop it)
    measured = [i for i in range(heads.config.depth) if len(confs[i])]
    fitted = Calibration.fit([confs[i] for i in measured], [rights[i] for i in measured], min_accept=min_accept)
    thresholds, rates, at_half = [0.0] * heads.config.depth, [None] * heads.config.depth, [None] * heads.config.depth
    for k, i in enumerate(measured):
        thresholds[i] = fitted.thresholds[k]
        rates[i] = round(fitted.heads[k].accept_rate, 4)
        at_half[i] = round(fitted.threshold_for(k, 0.5), 4)
    figures = {"min_accept": min_accept, "step_accept_rate": rates, "confidence_for_accept_0.5": at_half}
    return ChainCalibration(thresholds), figures
