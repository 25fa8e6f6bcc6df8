"""Oracle bound on recorded steps with hand-computed answers; RecordedSteps validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from avspec.av.cost_table import CostTable
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.step_cost import StepCost
from avspec.config import EstimatorConfig
from avspec.tools.bench.oracle import RecordedSteps, oracle_bound


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


def costs(draft_pass: CostTable, verify: CostTable) -> StepCost:
    return StepCost(draft_pass, verify)


def test_oracle_bound_hand_computed():
    """Two steps of 2 requests, K = 4; a draft pass 1 ms whatever its rows, verify 10 + 1/token.

    T = 2 per step, so the pass over pending tokens costs 1 ms and each further pass 1 ms.
    fixed: tokens (1+1)+(3+1) + (0+1)+(4+1) = 12; ms per step 1 + 3 passes + (10 + 2 + 8) = 24.
    oracle (drafts the accepted only): step 0 drafts (1, 3): 1 + 2 passes + (10 + 2 + 4) = 19;
    step 1 drafts (0, 4): 1 + 3 passes + 16 = 20; 39 in all.
    """
    rec = steps([1, 3, 0, 4], [4, 4, 4, 4], [0, 0, 1, 1], [1, 2, 1, 2])
    out = oracle_bound(rec, costs(CostTable([0, 100], [1, 1]), CostTable([0, 100], [10, 110])))
    assert out["fixed"]["tokens"] == 12 and out["fixed"]["ms"] == pytest.approx(48)
    assert out["oracle"]["tokens"] == 12 and out["oracle"]["ms"] == pytest.approx(39)
    assert out["oracle_gain"] == pytest.approx(48 / 39 - 1)
    assert out["av"]["tokens"] <= 12 and out["av"]["ms"] <= 48
    # static K = 1: tokens (1+1)+(1+1)+(0+1)+(1+1) = 7, ms 2 * (1 + 0 passes + 10 + 2 + 2) = 30
    assert out["trim_to_k"][1] == pytest.approx(7 / 30)
    assert out["trim_to_k"][4] == pytest.approx(out["fixed"]["tokens_per_ms"])


def test_oracle_bound_av_verifies_everything_when_verification_is_free():
    """Verify cost flat, draft passes free: the budget admits every draft, so AV equals fixed
    and the oracle gains nothing (fraction NaN)."""
    rec = steps([1, 3, 0, 4], [4, 4, 4, 4], [0, 0, 1, 1], [1, 2, 1, 2])
    out = oracle_bound(rec, costs(CostTable([0, 100], [0, 0]), CostTable([0, 100], [5, 5])))
    assert out["av"]["tokens"] == out["fixed"]["tokens"]
    assert out["av"]["ms"] == pytest.approx(out["fixed"]["ms"])
    assert out["oracle_gain"] == 0 and math.isnan(out["fraction"])


def test_oracle_bound_av_trims_when_verification_is_dear():
    """Steep verify cost and confident-low features: AV trims; adaptive drafting drafts less.

    400 steps of one request accepting nothing; a draft pass 1 ms, verify 1 + 1 ms/token. Fixed
    pays 1 + 3 passes + (1 + 5) = 10 ms a step for one token, the oracle (drafts nothing past
    x_0) 1 + (1 + 1) = 3. With features -40 the confidences vanish: AV verifies nothing after
    its first step but still drafts 4 (6 ms: fraction (1/6 - 1/10) / (1/3 - 1/10) = 2/7);
    adaptive drafting stops each row after x_0 too, so it nearly reaches the oracle.
    """
    n = 400
    rec = steps([0] * n, [4] * n, list(range(n)), [1] * n, features=np.full((n, 4), -40.0))
    out = oracle_bound(rec, costs(CostTable([0, 10], [1, 1]), CostTable([0, 10], [1, 11])))
    assert out["oracle_gain"] == pytest.approx(10 / 3 - 1)
    assert out["fraction"] == pytest.approx(2 / 7, abs=0.01)
    assert out["drafting_fraction"] > 0.95


def test_oracle_bound_custom_config_and_validation():
    rec = steps([1], [2], [0], [7], features=np.zeros((1, 4)))
    cost = CostTable([0, 10], [1, 2])
    out = oracle_bound(
        rec, costs(cost, cost), EstimatorConfig(num_positions=4, initial_intercept=3.0)
    )
    assert out["fixed"]["tokens"] == 2
    # 3 steps of one request rejecting its 4 drafts; a pass 1 ms, verify 1 + size ms. A fresh
    # estimator (p = sigmoid(-0.2) at feature 0) still verifies a draft; one warm-started at
    # intercept -30 verifies none after the first step (no stale scores there).
    dear = steps([0] * 3, [4] * 3, [0, 1, 2], [1] * 3)
    model = costs(CostTable([0, 10], [1, 1]), CostTable([0, 10], [1, 11]))
    warm = AcceptanceEstimator(EstimatorConfig(num_positions=4))
    warm.intercepts.fill_(-30.0)
    fresh_ms = oracle_bound(dear, model)["av"]["ms"]
    warm_ms = oracle_bound(dear, model, estimator=warm)["av"]["ms"]
    assert warm_ms == pytest.approx((4 + 6) + 2 * (4 + 2)) and fresh_ms > warm_ms
    assert float(warm.intercepts[0]) == -30.0  # the replays work on copies
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
