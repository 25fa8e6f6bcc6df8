"""Oracle bound on recorded steps with hand-computed answers; RecordedSteps validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from avspec.av.cost_table import CostTable
from avspec.av.estimator import AcceptanceEstimator
from avspec.config import EstimatorConfig
from avspec.tools.oracle import RecordedSteps, oracle_bound


def steps(num_accepted, num_draft, step, seq_id, features=None, base=None):
    rows = len(step)
    return RecordedSteps(
        step=np.asarray(step),
        seq_id=np.asarray(seq_id),
        num_draft=np.asarray(num_draft),
        num_accepted=np.asarray(num_accepted),
        features=np.zeros((rows, 4)) if features is None else np.asarray(features),
        base_tokens=np.asarray(base if base is not None else np.bincount(step)),  # one per request
    )


def test_oracle_bound_hand_computed():
    """Two steps of 2 requests, K = 4; draft 1 ms flat, verify 10 ms + 1 ms per token.

    T = 2 per step. fixed: tokens (1+1)+(3+1) + (0+1)+(4+1) = 12, ms 2 * (1 + 10 + 2 + 8) = 42.
    oracle: same tokens, ms (1 + 10 + 2 + 4) + (1 + 10 + 2 + 4) = 34.
    """
    rec = steps([1, 3, 0, 4], [4, 4, 4, 4], [0, 0, 1, 1], [1, 2, 1, 2])
    draft = CostTable([0, 100], [1, 1])
    verify = CostTable([0, 100], [10, 110])
    out = oracle_bound(rec, draft, verify)
    assert out["fixed"]["tokens"] == 12 and out["fixed"]["ms"] == pytest.approx(42)
    assert out["oracle"]["tokens"] == 12 and out["oracle"]["ms"] == pytest.approx(34)
    assert out["oracle_gain"] == pytest.approx(42 / 34 - 1)
    assert out["av"]["tokens"] <= 12 and out["av"]["ms"] <= 42
    # static trim to 1: tokens (1+1)+(1+1)+(0+1)+(1+1) = 7, ms 2 * (1 + 10 + 2 + 2) = 30
    assert out["trim_to_k"][1] == pytest.approx(7 / 30)
    assert out["trim_to_k"][4] == pytest.approx(out["fixed"]["tokens_per_ms"])


def test_oracle_bound_av_verifies_everything_when_verification_is_free():
    """Verify cost flat: the budget admits every draft, so AV equals fixed; fraction is 0."""
    rec = steps([1, 3, 0, 4], [4, 4, 4, 4], [0, 0, 1, 1], [1, 2, 1, 2])
    flat = CostTable([0, 100], [5, 5])
    out = oracle_bound(rec, flat, flat)
    assert out["av"]["tokens"] == out["fixed"]["tokens"]
    assert out["av"]["ms"] == pytest.approx(out["fixed"]["ms"])
    assert out["oracle_gain"] == 0 and math.isnan(out["fraction"])


def test_oracle_bound_av_trims_when_verification_is_dear():
    """Steep verify cost and confident-low features: AV trims and gains on fixed K = 4.

    400 steps of one request accepting nothing: fixed pays 1 + (1 + 5) ms a step for one token,
    the oracle 1 + (1 + 1); with features -40 the estimator's confidences vanish and AV
    verifies nothing after its first step (no stale scores yet), so it nearly reaches the oracle.
    """
    n = 400
    rec = steps([0] * n, [4] * n, list(range(n)), [1] * n, features=np.full((n, 4), -40.0))
    out = oracle_bound(rec, CostTable([0, 10], [1, 1]), CostTable([0, 10], [1, 11]))
    assert out["oracle_gain"] == pytest.approx(7 / 3 - 1)
    assert out["fraction"] > 0.95


def test_oracle_bound_custom_config_and_validation():
    rec = steps([1], [2], [0], [7], features=np.zeros((1, 4)))
    cost = CostTable([0, 10], [1, 2])
    out = oracle_bound(rec, cost, cost, EstimatorConfig(num_positions=4, initial_intercept=3.0))
    assert out["fixed"]["tokens"] == 2
    # 3 steps of one request rejecting its 4 drafts; verify 1 + size ms. A fresh estimator
    # (p = sigmoid(-0.2) at feature 0) still verifies a draft; one warm-started at intercept -30
    # verifies none after the first step (no stale scores there).
    dear = steps([0] * 3, [4] * 3, [0, 1, 2], [1] * 3)
    flat, steep = CostTable([0, 10], [1, 1]), CostTable([0, 10], [1, 11])
    warm = AcceptanceEstimator(EstimatorConfig(num_positions=4))
    warm.intercepts.fill_(-30.0)
    fresh_ms = oracle_bound(dear, flat, steep)["av"]["ms"]
    warm_ms = oracle_bound(dear, flat, steep, estimator=warm)["av"]["ms"]
    assert warm_ms == pytest.approx(3 + (1 + 5) + 2 * (1 + 1)) and fresh_ms > warm_ms
    with pytest.raises(ValueError, match="num_accepted"):
        steps([3], [2], [0], [1])
    with pytest.raises(ValueError, match="non-decreasing"):
        steps([0, 0], [1, 1], [1, 0], [1, 2])
    with pytest.raises(ValueError, match="seq_id"):
        RecordedSteps(
            np.zeros(2, int),
            np.zeros(3, int),
            np.zeros(2, int),
            np.zeros(2, int),
            np.zeros((2, 4)),
            np.ones(1, int),
        )  # noqa: E501
    with pytest.raises(ValueError, match="features"):
        RecordedSteps(
            np.zeros(2, int),
            np.zeros(2, int),
            np.zeros(2, int),
            np.zeros(2, int),
            np.zeros(2),
            np.ones(1, int),
        )  # noqa: E501
    with pytest.raises(ValueError, match="num_draft exceeds"):
        steps([0], [5], [0], [1])
    with pytest.raises(ValueError, match="base_tokens"):
        steps([0], [1], [3], [1], base=[1])
