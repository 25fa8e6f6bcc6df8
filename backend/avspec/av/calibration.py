"""Estimator quality metrics (spec section 5): AUC, log-loss, ECE and a per-position report.

numpy on the host, O(n log n) at worst, so millions of labels take well under a second.
Inputs are 1-D array-likes (numpy arrays, lists, CPU torch tensors) of equal length:
predictions / scores in [0, 1] (scores for AUC only need to be finite), labels 0 or 1.
Empty input raises ValueError; so does AUC when the labels hold a single class.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def auc(scores: Any, labels: Any) -> float:
    """Probability that a random accepted draft scores above a random rejected one.

    Mann-Whitney U with average ranks for tied scores (a tie counts one half).
    """
    s, y = _inputs(scores, labels, probabilities=False)
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs both accepted and rejected labels")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # Tie groups: [starts[i], ends[i]) share one score and get the mean of their 1-based ranks.
    boundaries = np.flatnonzero(np.diff(sorted_s)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [s.size]))
    group_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(group_rank, ends - starts)
    u = ranks[y == 1].sum() - positives * (positives + 1) / 2.0
    return float(u / (positives * negatives))


def log_loss(predictions: Any, labels: Any, eps: float = 1e-7) -> float:
    """Mean negative log-likelihood, predictions clipped to [eps, 1 - eps]."""
    p, y = _inputs(predictions, labels)
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))


def ece(predictions: Any, labels: Any, bins: int = 10) -> float:
    """Expected calibration error: equal-width bins, mean |mean prediction - observed rate|
    weighted by the bin's share of labels."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    p, y = _inputs(predictions, labels)
    index = np.minimum((p * bins).astype(np.int64), bins - 1)
    sum_p = np.bincount(index, weights=p, minlength=bins)
    sum_y = np.bincount(index, weights=y, minlength=bins)
    # count_b * |sum_p_b / count_b - sum_y_b / count_b| = |sum_p_b - sum_y_b|
    return float(np.abs(sum_p - sum_y).sum() / p.size)


def calibration_report(
    predictions: Any, labels: Any, positions: Any | None = None
) -> dict[str, Any]:
    """Overall metrics, mean predicted vs observed rate, and a per-position breakdown.

    positions: optional 1-D integer draft positions aligned with the labels. The report's
    "auc" is NaN (not an error) for a group whose labels hold a single class.
    Returns {"labels", "auc", "log_loss", "ece", "mean_predicted", "observed_rate",
    "per_position": [{"position", ...same keys...}, ...]} (per_position empty without positions).
    """
    p, y = _inputs(predictions, labels)
    report = _group(p, y)
    report["per_position"] = []
    if positions is not None:
        k = np.asarray(positions)
        if k.shape != p.shape or not np.issubdtype(k.dtype, np.integer):
            raise ValueError(
                f"positions must be integers of shape {p.shape}, got {k.shape} {k.dtype}"
            )
        for position in np.unique(k):
            rows = k == position
            report["per_position"].append({"position": int(position), **_group(p[rows], y[rows])})
    return report


def _group(p: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    both_classes = 0 < y.sum() < y.size
    return {
        "labels": int(p.size),
        "auc": auc(p, y) if both_classes else float("nan"),
        "log_loss": log_loss(p, y),
        "ece": ece(p, y),
        "mean_predicted": float(p.mean()),
        "observed_rate": float(y.mean()),
    }


def _inputs(values: Any, labels: Any, probabilities: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Validate and convert to float64 arrays (values, labels)."""
    v = np.asarray(values, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if v.ndim != 1 or y.shape != v.shape:
        raise ValueError(f"need 1-D inputs of equal length, got {v.shape} and {y.shape}")
    if v.size == 0:
        raise ValueError("no labels: empty input")
    if not np.isfinite(v).all():
        raise ValueError("predictions / scores contain NaN or inf")
    if probabilities and ((v < 0).any() or (v > 1).any()):
        raise ValueError("predictions must lie in [0, 1]")
    if not ((y == 0) | (y == 1)).all():
        raise ValueError("labels must be 0 or 1")
    return v, y
