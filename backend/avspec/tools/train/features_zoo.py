"""Alternative acceptance features and the offline fit used to compare them (spec section 5).

The served feature is logit(q_max) (`avspec.av.features`). The spec's feature table compares it with
log q_max, the top-2 margin q_(1) - q_(2), the entropy H(q), -log(-log q_max), q_max used
directly with no fit, and logit q(x) of the sampled draft (lossy: a trimming rule that reads
q(x) breaks exact rejection sampling, spec section 2). Every feature is computed from the same
temperature-scaled draft distribution (temperature 0 is treated as 1, as the served feature).

Offline fit: the served model p = sigmoid(w f + b_k) (one slope, one intercept per position),
fitted to convergence by undamped Newton steps of `avspec.av.refit` (the same arrowhead solve), and
evaluated by 2-fold cross-fitting over requests so no prediction sees its own label.
"""

from __future__ import annotations

import numpy as np
import torch

from avspec.av.estimator import verification_labels
from avspec.av.features import scaled_logits
from avspec.av.refit import SufficientStats, newton_step
from avspec.checks import check_shape

CLAMP = 40.0
ZOO_FEATURES = ("log_qmax", "top2_margin", "entropy", "neg_log_neg_log_qmax", "logit_qsampled")


def feature_zoo(
    logits: torch.Tensor, temperature: torch.Tensor | float, sampled: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Alternative features, each [batch, position] float32, keyed by ZOO_FEATURES.

    logits: [batch, position, vocab] (-inf entries allowed); temperature: [batch] or a scalar;
    sampled: [batch, position] integer, the drawn draft token (for logit_qsampled only).
    Unbounded values (-log(-log 1), logit of 1) are clamped to [-CLAMP, CLAMP].
    """
    check_shape("logits", logits, (None, None, None))
    batch, positions, _ = logits.shape
    check_shape("sampled", sampled, (batch, positions))
    logq = torch.log_softmax(scaled_logits(logits, temperature), dim=-1)  # [batch, position, vocab]
    top2 = logq.topk(min(2, logq.shape[-1]), dim=-1).values  # [batch, position, 2]
    log_qmax = top2[..., 0]
    q = logq.exp()
    second = top2[..., 1].exp() if top2.shape[-1] > 1 else torch.zeros_like(log_qmax)
    entropy = -(q * torch.where(q > 0, logq, torch.zeros_like(logq))).sum(-1)
    log_qs = logq.gather(-1, sampled.long().unsqueeze(-1))[..., 0]
    return {
        "log_qmax": log_qmax,
        "top2_margin": log_qmax.exp() - second,
        "entropy": entropy,
        "neg_log_neg_log_qmax": _clamp(-torch.log(-log_qmax)),
        "logit_qsampled": _clamp(log_qs - _log1m_exp(log_qs)),
    }


def _clamp(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=CLAMP, posinf=CLAMP, neginf=-CLAMP).clamp(-CLAMP, CLAMP)


def _log1m_exp(log_p: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(log_p)) for log_p <= 0, stable near 0 and near -inf."""
    return torch.where(
        log_p > -0.6931, torch.log(-torch.expm1(log_p)), torch.log1p(-torch.exp(log_p))
    )


def label_matrix(
    num_verified: np.ndarray, num_accepted: np.ndarray, positions: int
) -> tuple[np.ndarray, np.ndarray]:
    """(labels float64, mask bool), each [rows, position], from per-row verification outcomes."""
    labels, mask = verification_labels(
        torch.as_tensor(num_verified), torch.as_tensor(num_accepted), positions
    )
    return labels.double().numpy(), mask.numpy()


def fit_logistic(
    features: np.ndarray,
    labels: np.ndarray,
    mask: np.ndarray,
    iterations: int = 100,
    ridge: float = 1e-3,
    max_step: float = 2.0,
) -> tuple[float, np.ndarray]:
    """Fit p = sigmoid(w f + b_k) to the masked labels; return (w, b [position]).

    features, labels, mask: [rows, position]. Starts at the reference values (0.5, -0.2) and
    takes undamped Newton steps (the slope may turn negative, e.g. for entropy), each component
    capped at `max_step` (a full step from the start can saturate every prediction, after which
    Newton diverges: seen for the entropy feature of a BPE pair). Raises ValueError with no
    labels.
    """
    features, labels, mask = np.asarray(features), np.asarray(labels), np.asarray(mask)
    if features.ndim != 2:
        raise ValueError(f"features must have shape (rows, position), got {features.shape}")
    _check_same_shape(features.shape, labels=labels, mask=mask)
    if not mask.any():
        raise ValueError("no labelled drafts to fit")
    positions = features.shape[1]
    y = torch.as_tensor(labels, dtype=torch.float64)
    m = torch.as_tensor(mask, dtype=torch.bool)
    # Fit on the standardised feature (the same model family: w f + b = w' f' + b'), then map
    # back: Newton from a fixed start behaves alike for features of any scale (entropy in nats).
    raw = torch.as_tensor(features, dtype=torch.float64)
    centre = float(raw[m].mean())
    scale = float(raw[m].std()) if int(m.sum()) > 1 and float(raw[m].std()) > 0 else 1.0
    f = (raw - centre) / scale
    w = torch.tensor(0.5, dtype=torch.float64)
    b = torch.full((positions,), -0.2, dtype=torch.float64)
    stats = SufficientStats(positions)
    for _ in range(iterations):
        stats.clear()
        stats.add(f, torch.sigmoid(w * f + b), y, m)
        dw, db = newton_step(stats, ridge, damping=0.0)
        if not (torch.isfinite(dw) and torch.isfinite(db).all()):
            break
        dw, db = dw.clamp(-max_step, max_step), db.clamp(-max_step, max_step)
        w, b = w + dw, b + db
        if float(dw.abs()) < 1e-9 and float(db.abs().max()) < 1e-9:
            break
    return float(w) / scale, (b - w * centre / scale).numpy()


def _check_same_shape(shape: tuple[int, ...], **arrays: np.ndarray) -> None:
    for name, array in arrays.items():
        if array.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {array.shape}")


def predict_logistic(features: np.ndarray, slope: float, intercepts: np.ndarray) -> np.ndarray:
    """sigmoid(w f + b_k), [rows, position] float64."""
    z = slope * np.asarray(features, dtype=np.float64) + intercepts[: features.shape[1]]
    return 1.0 / (1.0 + np.exp(-z))


def cross_fit_predictions(
    features: np.ndarray, labels: np.ndarray, mask: np.ndarray, folds: np.ndarray
) -> np.ndarray:
    """Out-of-fold predictions [rows, position]: each row predicted by the fit on the others.

    folds: [rows] integer fold id (e.g. the request's seq id parity). A fold with no labels
    outside it raises ValueError.
    """
    folds = np.asarray(folds)
    if folds.shape != features.shape[:1]:
        raise ValueError(f"folds must have shape ({features.shape[0]},), got {folds.shape}")
    out = np.zeros(features.shape, dtype=np.float64)
    for fold in np.unique(folds):
        held = folds == fold
        train = ~held[:, None] & mask
        slope, intercepts = fit_logistic(features, labels, train)
        out[held] = predict_logistic(features[held], slope, intercepts)
    return out


def rate_by_bins(
    values: np.ndarray,
    labels: np.ndarray,
    mask: np.ndarray,
    edges: np.ndarray,
    min_labels: int = 50,
) -> tuple[list[dict[str, float]], bool]:
    """Observed acceptance per bin of `values` (e.g. q_max) over the masked labels.

    values, labels, mask: same shape; edges: increasing bin edges (a value equal to the last
    edge falls in the last bin). Returns one row per bin (low, high, labels, observed rate, NaN
    when empty) and whether the rate never falls from one bin to the next among the bins with
    at least `min_labels` labels (the calibration table's monotonicity).
    """
    values, labels, mask = (np.asarray(a) for a in (values, labels, mask))
    _check_same_shape(values.shape, labels=labels, mask=mask)
    v, y = values[mask], labels[mask].astype(np.float64)
    index = np.clip(np.searchsorted(edges, v, side="right") - 1, 0, len(edges) - 2)
    rows = []
    for i in range(len(edges) - 1):
        chosen = index == i
        count = int(chosen.sum())
        rate = float(y[chosen].mean()) if count else float("nan")
        rows.append({"low": float(edges[i]), "high": float(edges[i + 1]), "labels": count,
                     "observed_rate": rate})  # fmt: skip
    rates = [r["observed_rate"] for r in rows if r["labels"] >= min_labels]
    monotone = all(a <= b for a, b in zip(rates, rates[1:], strict=False))
    return rows, monotone
