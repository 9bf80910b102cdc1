"""Calibration: a head's confidence -> P(its draft is accepted), and drafting thresholds.

Per head, a monotone (isotonic) map is fit on held-out positions by pool-adjacent-
violators (PAV) over confidence-sorted bins, stored as knots (x, y) and evaluated by
linear interpolation (flat outside the knots), so it is non-decreasing by construction.

A head's threshold is the smallest confidence whose calibrated acceptance reaches its
`min_accept`: 0.5 by default, one value per head if given, or the cost rule
`cost_of_draft / value_of_accept` (draft when the expected gain of an accepted token
exceeds the cost of drafting it). A head drafts when `confidence >= threshold`; NEVER
(2.0, above any confidence) means the head never reaches the bar.

`Calibration` serves exit heads (one map per head); `ChainCalibration` top-layer heads (one
threshold per chain step, P(accept) = the confidence). Both read calibration.json as
untrusted input: every field checked, a ValueError naming the field otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import checks

NEVER = 2.0  # threshold of a head that never reaches min_accept (confidence is <= 1)


def isotonic_fit(x, y, weight=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: the non-decreasing least-squares fit of y on sorted x.

    Args:
        x, y, weight: 1-D arrays of one length (weight defaults to 1).
    Returns:
        (block_x, block_y, block_weight): weighted mean x and fitted y of each pooled
        block, x strictly increasing and y non-decreasing.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(x) if weight is None else np.asarray(weight, dtype=np.float64)
    if not (x.ndim == y.ndim == w.ndim == 1 and len(x) == len(y) == len(w)):
        raise ValueError("isotonic_fit needs 1-D x, y, weight of one length")
    if len(x) == 0:
        raise ValueError("isotonic_fit needs at least one point")
    # Pool tied x first (e.g. the many confidences of exactly 0 where ⊥ wins), so the
    # blocks below have strictly increasing mean x.
    x, inverse = np.unique(x, return_inverse=True)
    wy = np.bincount(inverse, weights=y * w)
    w = np.bincount(inverse, weights=w)
    # Stack of blocks: sums of w*x, w*y, w.
    sx, sy, sw = [], [], []
    for xi, yi, wi in zip(x * w, wy, w):
        sx.append(xi)
        sy.append(yi)
        sw.append(wi)
        # Pool while the last block's mean is below the previous one (a violation).
        while len(sw) > 1 and sy[-1] * sw[-2] <= sy[-2] * sw[-1]:
            wx, wy, ww = sx.pop(), sy.pop(), sw.pop()
            sx[-1] += wx
            sy[-1] += wy
            sw[-1] += ww
    bw = np.array(sw)
    return np.array(sx) / bw, np.array(sy) / bw, bw


@dataclass
class HeadCalibration:
    """One head's map: knots (x non-decreasing confidence, y P(accept)) and threshold."""

    knots_x: list[float]
    knots_y: list[float]
    threshold: float
    min_accept: float = 0.5  # the calibrated acceptance at `threshold`
    positions: int = 0  # held-out positions it was fit on
    accept_rate: float = 0.0  # their overall top-1 agreement

    def accept_prob(self, confidence: np.ndarray) -> np.ndarray:
        return np.interp(confidence, self.knots_x, self.knots_y)


def _threshold(knots_x, knots_y, min_accept: float) -> float:
    """Smallest x with interp(x) >= min_accept on a non-decreasing piecewise-linear map."""
    xs, ys = np.asarray(knots_x), np.asarray(knots_y)
    if ys[0] >= min_accept:
        return 0.0
    above = np.nonzero(ys >= min_accept)[0]
    if len(above) == 0:
        return NEVER
    i = above[0]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(x0 + (min_accept - y0) * (x1 - x0) / (y1 - y0))


class Calibration:
    """Per-head calibrated acceptance and thresholds (calibration.json).

    Attributes:
        heads: list[HeadCalibration], one per head, in head order.
        min_accept: the default acceptance bar (each head stores its own).
    """

    def __init__(self, heads: list[HeadCalibration], min_accept: float = 0.5) -> None:
        self.heads = list(heads)
        self.min_accept = float(min_accept)
        self._knot_tensors: dict = {}

    @property
    def thresholds(self) -> list[float]:
        """Per head: draft when confidence >= threshold (NEVER = 2.0: never drafts)."""
        return [h.threshold for h in self.heads]

    def threshold_for(self, head_index: int, min_accept: float) -> float:
        """The confidence threshold of head `head_index` for another acceptance bar."""
        h = self.heads[head_index]
        return _threshold(h.knots_x, h.knots_y, min_accept)

    @classmethod
    def fit(
        cls,
        confidences,
        accepted,
        min_accept: float | list[float] = 0.5,
        bins: int = 200,
        cost_of_draft: float | list[float] | None = None,
        value_of_accept: float = 1.0,
    ) -> Calibration:
        """Fit one isotonic map per head on held-out (confidence, accepted) pairs.

        Args:
            confidences: per head a 1-D array of confidences in [0, 1].
            accepted: per head a 1-D bool array: the head's token == the model's token.
            min_accept: acceptance bar for the thresholds, one for all heads or one per head
                (ignored when cost_of_draft is set).
            bins: equal-count confidence bins pooled before PAV (keeps the map small).
            cost_of_draft: if given (one or per head), min_accept = cost_of_draft / value_of_accept.
        """
        n = len(confidences)
        if len(accepted) != n:
            raise ValueError("confidences and accepted need one entry per head")
        if cost_of_draft is not None:
            if value_of_accept <= 0:
                raise ValueError("value_of_accept must be > 0")
            costs = (
                cost_of_draft if isinstance(cost_of_draft, (list, tuple)) else [cost_of_draft] * n
            )
            min_accept = [c / value_of_accept for c in costs]
        bars = list(min_accept) if isinstance(min_accept, (list, tuple)) else [min_accept] * n
        if len(bars) != n or not all(0.0 <= b <= 1.0 for b in bars):
            raise ValueError(
                f"min_accept must be in [0, 1], one value or one per head: {min_accept}"
            )
        heads = []
        for conf, acc, bar in zip(confidences, accepted, bars):
            conf = np.asarray(torch.as_tensor(conf).float().cpu(), dtype=np.float64)
            acc = np.asarray(torch.as_tensor(acc).float().cpu(), dtype=np.float64)
            if conf.shape != acc.shape or conf.ndim != 1 or len(conf) == 0:
                raise ValueError(
                    "each head needs non-empty 1-D confidences and accepted of one length"
                )
            order = np.argsort(conf, kind="stable")
            groups = np.array_split(order, min(bins, len(order)))
            gx = np.array([conf[g].mean() for g in groups])
            gy = np.array([acc[g].mean() for g in groups])
            gw = np.array([len(g) for g in groups], dtype=np.float64)
            kx, ky, _ = isotonic_fit(gx, gy, gw)
            heads.append(
                HeadCalibration(
                    knots_x=[round(float(v), 6) for v in kx],
                    knots_y=[round(float(v), 6) for v in ky],
                    threshold=round(_threshold(kx, ky, bar), 6),
                    min_accept=float(bar),
                    positions=len(conf),
                    accept_rate=float(acc.mean()),
                )
            )
        return cls(heads, bars[0] if len(set(bars)) == 1 else 0.5)

    @classmethod
    def uncalibrated(cls, num_heads: int, threshold: float = 0.6) -> Calibration:
        """Identity maps (P(accept) = confidence) with one fixed threshold."""
        return cls(
            [
                HeadCalibration([0.0, 1.0], [0.0, 1.0], threshold, threshold)
                for _ in range(num_heads)
            ],
            min_accept=threshold,
        )

    def accept_prob(self, head_index: int, confidence: torch.Tensor) -> torch.Tensor:
        """Calibrated P(accept) of head `head_index` at `confidence` (any shape, float)."""
        key = (head_index, confidence.device)
        if key not in self._knot_tensors:
            h = self.heads[head_index]
            self._knot_tensors[key] = (
                torch.tensor(h.knots_x, dtype=torch.float32, device=confidence.device),
                torch.tensor(h.knots_y, dtype=torch.float32, device=confidence.device),
            )
        xs, ys = self._knot_tensors[key]
        c = confidence.float().clamp(xs[0], xs[-1])
        if xs.numel() == 1:
            return ys.expand_as(c).clone()
        i = torch.searchsorted(xs, c, right=True).clamp(1, xs.numel() - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        t = ((c - x0) / (x1 - x0).clamp_min(1e-12)).clamp(0, 1)
        return y0 + t * (y1 - y0)

    def to_dict(self) -> dict:
        return {
            "min_accept": self.min_accept,
            "rule": "draft when confidence >= threshold; threshold 2.0 means never",
            "heads": [vars(h).copy() for h in self.heads],
        }

    @classmethod
    def from_dict(cls, data: dict, num_heads: int | None = None) -> Calibration:
        """ValueError naming the field on malformed data: not an object, a head count other
        than `num_heads`, knots that are not finite, in [0, 1] and non-decreasing, a
        threshold outside [0, NEVER] (NaN included)."""
        checks.need_object(data, "calibration")
        if not isinstance(data.get("heads"), list):
            raise ValueError("calibration must be a JSON object with a 'heads' list")  # noqa: TRY004
        heads_data = checks.need_list("heads", data["heads"], checks.MAX_LAYERS, num_heads)
        default_bar = checks.need_number("min_accept", data.get("min_accept", 0.5), 0.0, 1.0)
        heads = []
        for i, h in enumerate(heads_data):
            try:
                heads.append(_head_from_dict(h, default_bar))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"calibration head {i} is malformed: {e}") from None
        return cls(heads, default_bar)


def _head_from_dict(h, default_bar: float) -> HeadCalibration:
    checks.need_object(h, "a calibration head")
    for name in ("knots_x", "knots_y", "threshold"):
        if name not in h:
            raise ValueError(f"field {name!r} is missing")
    xs = checks.need_list("knots_x", h["knots_x"], checks.MAX_KNOTS)
    ys = checks.need_list("knots_y", h["knots_y"], checks.MAX_KNOTS, len(xs))
    if not xs or not all(checks.is_number(v) and 0.0 <= v <= 1.0 for v in xs + ys):
        raise ValueError("knots must be non-empty lists of finite numbers in [0, 1]")
    if np.any(np.diff(xs) < 0) or np.any(np.diff(ys) < 0):
        raise ValueError("knots must be non-empty, of one length and non-decreasing")
    return HeadCalibration(
        knots_x=[float(v) for v in xs],
        knots_y=[float(v) for v in ys],
        threshold=checks.need_number("threshold", h["threshold"], 0.0, NEVER),
        min_accept=checks.need_number("min_accept", h.get("min_accept", default_bar), 0.0, 1.0),
        positions=checks.need_int("positions", h.get("positions", 0), 0, 1 << 62),
        accept_rate=checks.need_number("accept_rate", h.get("accept_rate", 0.0), 0.0, 1.0),
    )


class ChainCalibration:
    """Top-layer heads' calibration: draft chain step i only when its confidence >=
    thresholds[i]. P(accept) is the confidence itself (uncalibrated)."""

    def __init__(self, thresholds: list[float]):
        self.thresholds = [float(t) for t in thresholds]

    def accept_prob(self, index, confidence):
        return confidence

    def to_dict(self) -> dict:
        return {"kind": "top_draft", "thresholds": self.thresholds,
                "rule": "draft step i when its confidence >= thresholds[i]"}

    @classmethod
    def from_dict(cls, data, depth: int) -> ChainCalibration:
        """ValueError naming the field: not an object, another kind, not `depth` finite
        thresholds in [0, NEVER]. A missing 'thresholds' means 0 (always draft)."""
        checks.need_object(data, "calibration")
        if data.get("kind", "top_draft") != "top_draft":
            raise ValueError(f"field 'kind' must be 'top_draft', got {data.get('kind')!r}")
        thresholds = checks.need_list(
            "thresholds", data.get("thresholds", [0.0] * depth), checks.MAX_DEPTH, depth)
        return cls([checks.need_number(f"thresholds[{i}]", t, 0.0, NEVER)
                    for i, t in enumerate(thresholds)])
