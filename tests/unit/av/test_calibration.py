"""Tests for avspec.av.calibration against independent, explicit computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from avspec.av.calibration import auc, calibration_report, ece, log_loss


def _random(n: int, seed: int, ties: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.random(n)
    if ties:
        p = np.round(p, 1)  # many tied scores
    y = (rng.random(n) < p).astype(np.float64)
    return p, y


def _pairwise_auc(s: np.ndarray, y: np.ndarray) -> float:
    wins = 0.0
    for a in s[y == 1]:
        for b in s[y == 0]:
            wins += 1.0 if a > b else 0.5 if a == b else 0.0
    return wins / ((y == 1).sum() * (y == 0).sum())


def _loop_ece(p: np.ndarray, y: np.ndarray, bins: int) -> float:
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        rows = [i for i in range(len(p)) if lo <= p[i] < hi or (b == bins - 1 and p[i] == 1.0)]
        if rows:
            total += len(rows) * abs(np.mean(p[rows]) - np.mean(y[rows]))
    return total / len(p)


@pytest.mark.parametrize(("seed", "ties"), [(0, False), (1, True), (2, True)])
def test_auc_matches_pairwise_count(seed: int, ties: bool) -> None:
    p, y = _random(300, seed, ties)
    assert auc(p, y) == pytest.approx(_pairwise_auc(p, y), abs=1e-12)


def test_auc_extremes_and_array_likes() -> None:
    assert auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5
    assert auc([-3.0, 7.0], [0, 1]) == 1.0  # scores need not be probabilities


def test_log_loss_matches_formula() -> None:
    p, y = _random(1000, 3)
    want = -np.mean([np.log(q) if t else np.log(1 - q) for q, t in zip(p, y, strict=True)])
    assert log_loss(p, y) == pytest.approx(want, rel=1e-12)
    assert log_loss([0.0, 1.0], [1, 0]) == pytest.approx(-np.log(1e-7), rel=1e-6)


@pytest.mark.parametrize("bins", [1, 10, 15])
def test_ece_matches_loop(bins: int) -> None:
    p, y = _random(2000, 4)
    p[:3] = [0.0, 1.0, 0.5]
    assert ece(p, y, bins) == pytest.approx(_loop_ece(p, y, bins), abs=1e-12)


def test_report_overall_and_per_position() -> None:
    p, y = _random(4000, 5)
    positions = np.arange(4000) % 4
    y[positions == 3] = 1.0  # one single-class position: its AUC is NaN, not an error
    report = calibration_report(p, y, positions)
    assert report["labels"] == 4000
    assert report["auc"] == pytest.approx(auc(p, y))
    assert report["mean_predicted"] == pytest.approx(p.mean())
    assert report["observed_rate"] == pytest.approx(y.mean())
    rows = report["per_position"]
    assert [r["position"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["ece"] == pytest.approx(ece(p[positions == 1], y[positions == 1]))
    assert rows[1]["labels"] == 1000 and np.isnan(rows[3]["auc"])
    assert calibration_report(p, y)["per_position"] == []


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: auc([], []), "empty"),
        (lambda: auc([0.1, 0.2], [1, 1]), "both accepted and rejected"),
        (lambda: auc([0.1, np.nan], [0, 1]), "NaN"),
        (lambda: auc([0.1, 0.2], [0, 1, 1]), "equal length"),
        (lambda: auc([[0.1, 0.2]], [[0, 1]]), "1-D"),
        (lambda: log_loss([0.5], [2]), "0 or 1"),
        (lambda: log_loss([1.5], [1]), r"\[0, 1\]"),
        (lambda: ece([0.5], [1], bins=0), "bins"),
        (lambda: ece([], []), "empty"),
        (lambda: calibration_report([0.5, 0.5], [0, 1], [0.0, 1.0]), "positions"),
        (lambda: calibration_report([0.5, 0.5], [0, 1], [0]), "positions"),
    ],
)
def test_bad_input(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_known_answers_on_two_million_labels() -> None:
    """At scale, against closed forms: p ~ U(0, 1), y ~ Bernoulli(p).

    AUC = P(p of an accepted > p of a rejected) = 5/6; log-loss = E[binary entropy] = 1/2 nat;
    ECE of p itself is sampling noise only, of p**2 it is E[p - p**2] = 1/6. The sampling error
    at 2M labels is below 1e-3. How fast these calls are is a benchmark, not a test:
    client/bench_calibration.py.
    """
    p, y = _random(2_000_000, 6)
    assert auc(p, y) == pytest.approx(5 / 6, abs=3e-3)
    assert log_loss(p, y) == pytest.approx(0.5, abs=3e-3)
    assert ece(p, y) < 3e-3
    assert ece(p**2, y) == pytest.approx(1 / 6, abs=3e-3)
