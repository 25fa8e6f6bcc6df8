"""Alternative features and the offline logistic fit, on inputs with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from avspec.av.features import logit_qmax
from avspec.tools.train.features_zoo import (
    ZOO_FEATURES,
    cross_fit_predictions,
    feature_zoo,
    fit_logistic,
    label_matrix,
    predict_logistic,
)


def test_feature_zoo_known_distribution():
    q = torch.tensor([0.5, 0.3, 0.2])
    logits = q.log().reshape(1, 1, 3)
    out = feature_zoo(logits, 1.0, torch.tensor([[1]]))
    assert set(out) == set(ZOO_FEATURES)
    assert out["log_qmax"].item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert out["top2_margin"].item() == pytest.approx(0.2, abs=1e-6)
    entropy = -sum(p * math.log(p) for p in (0.5, 0.3, 0.2))
    assert out["entropy"].item() == pytest.approx(entropy, abs=1e-6)
    assert out["neg_log_neg_log_qmax"].item() == pytest.approx(-math.log(math.log(2)), abs=1e-5)
    assert out["logit_qsampled"].item() == pytest.approx(math.log(0.3 / 0.7), abs=1e-5)


def test_feature_zoo_temperature_masking_and_extremes():
    logits = torch.tensor([[[2.0, 0.0, float("-inf")], [100.0, -100.0, -100.0]]])
    temps = torch.tensor([2.0])
    out = feature_zoo(logits, temps, torch.tensor([[0, 0]]))
    # row 0 at temperature 2: q = softmax([1, 0]) over two live entries
    q0 = 1 / (1 + math.exp(-1))
    assert out["log_qmax"][0, 0].item() == pytest.approx(math.log(q0), abs=1e-6)
    # q_max rounds to 1: -log(-log 1) and logit(1) clamp instead of inf; greedy 0 acts as 1
    assert out["neg_log_neg_log_qmax"][0, 1].item() == 40.0
    assert out["logit_qsampled"][0, 1].item() == 40.0
    greedy = feature_zoo(logits, torch.tensor([0.0]), torch.tensor([[0, 0]]))
    plain = feature_zoo(logits, 1.0, torch.tensor([[0, 0]]))
    assert torch.equal(greedy["entropy"], plain["entropy"])
    # monotone in q_max: the served logit(q_max) ranks like log q_max
    served = logit_qmax(logits, temps)
    assert (served[0, 1] > served[0, 0]) == (out["log_qmax"][0, 1] > out["log_qmax"][0, 0])


def test_feature_zoo_shape_errors():
    with pytest.raises(ValueError, match="logits"):
        feature_zoo(torch.zeros(2, 3), 1.0, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sampled"):
        feature_zoo(torch.zeros(1, 2, 3), 1.0, torch.zeros(1, 3))


def test_label_matrix():
    labels, mask = label_matrix(np.array([3, 3, 0]), np.array([1, 3, 0]), 4)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    assert labels[0].tolist() == [1, 0, 0, 0] and labels[1, :3].tolist() == [1, 1, 1]


def synthetic(n=4000, w=1.3, b=(0.8, -0.4), seed=0):
    rng = np.random.default_rng(seed)
    f = rng.normal(0, 2, size=(n, 2))
    p = predict_logistic(f, w, np.asarray(b))
    y = (rng.random((n, 2)) < p).astype(np.float64)
    return f, y, np.ones((n, 2), dtype=bool)


def test_fit_logistic_recovers_known_coefficients():
    """8000 labels drawn from w = 1.3, b = (0.8, -0.4), seed 0: fit within 0.15 of each."""
    f, y, m = synthetic()
    w, b = fit_logistic(f, y, m)
    assert w == pytest.approx(1.3, abs=0.15)
    assert b == pytest.approx([0.8, -0.4], abs=0.15)


def test_fit_logistic_negative_slope_and_mask():
    """A decreasing feature (like entropy) gets a negative slope; masked labels are ignored."""
    f, y, m = synthetic(w=-0.9)
    m[:, 1] = False
    w0, b0 = fit_logistic(f, y, m)
    y[:, 1] = 1.0 - y[:, 1]  # would pull b_1 the wrong way if it were used
    w, b = fit_logistic(f, y, m)
    assert w == pytest.approx(-0.9, abs=0.15)
    assert w == w0 and b.tolist() == b0.tolist()  # the masked labels change nothing


def test_fit_logistic_errors():
    with pytest.raises(ValueError, match="no labelled"):
        fit_logistic(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2), dtype=bool))
    with pytest.raises(ValueError, match="features must"):
        fit_logistic(np.zeros(2), np.zeros(2), np.ones(2, dtype=bool))
    with pytest.raises(ValueError, match="labels must"):
        fit_logistic(np.zeros((2, 2)), np.zeros((2, 3)), np.ones((2, 2), dtype=bool))


def test_cross_fit_predictions():
    """Out-of-fold predictions match the true probabilities to 0.05 on average (8000 labels)."""
    f, y, m = synthetic()
    folds = np.arange(f.shape[0]) % 2
    pred = cross_fit_predictions(f, y, m, folds)
    truth = predict_logistic(f, 1.3, np.array([0.8, -0.4]))
    assert np.abs(pred - truth).mean() < 0.05
    with pytest.raises(ValueError, match="folds"):
        cross_fit_predictions(f, y, m, folds[:-1])


def test_rate_by_bins_known_answer_and_a_dip():
    from avspec.tools.train.features_zoo import rate_by_bins

    edges = np.array([0.0, 0.5, 1.0])
    values = np.array([[0.1, 0.2, 0.6, 0.9, 1.0, 0.3]])
    labels = np.array([[0, 1, 1, 1, 1, 0]])
    mask = np.ones_like(labels, dtype=bool)
    rows, monotone = rate_by_bins(values, labels, mask, edges, min_labels=1)
    assert [r["labels"] for r in rows] == [3, 3] and monotone
    assert rows[0]["observed_rate"] == pytest.approx(1 / 3) and rows[1]["observed_rate"] == 1.0
    # the same values with the labels flipped: acceptance falls with q_max, flagged
    _, falls = rate_by_bins(values, 1 - labels, mask, edges, min_labels=1)
    assert not falls
