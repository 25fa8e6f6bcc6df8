"""Benchmark statistics, frontier and oracle bound on constructed inputs with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from avspec.av.cost_table import CostTable
from avspec.av.estimator import AcceptanceEstimator
from avspec.config import EstimatorConfig
from avspec.tools.frontier import (
    X_KEY,
    Y_KEY,
    RecordedSteps,
    RequestRecord,
    frontier_by_concurrency,
    goal_checks,
    inter_token_latencies,
    mark_frontier,
    oracle_bound,
    pareto_mask,
    percentile,
    summarize_arm,
    time_to_first_token,
    user_rate,
)


def record(sent=0.0, times=(0.1, 0.13, 0.15), tokens=(1, 3, 2), counts=(4, 3, 2)):
    return RequestRecord(sent, list(times), list(tokens), *counts)


def test_request_timings():
    r = record()
    assert time_to_first_token(r) == pytest.approx(0.1)
    # 3 tokens after 30 ms: 3 x 10 ms; 2 tokens after 20 ms: 2 x 10 ms
    assert inter_token_latencies(r) == pytest.approx([0.01] * 5)
    assert user_rate(r) == pytest.approx(5 / 0.05)


def test_zero_token_responses_are_merged_into_the_next_gap():
    r = record(times=(0.1, 0.12, 0.14), tokens=(1, 0, 2))
    assert inter_token_latencies(r) == pytest.approx([0.02, 0.02])
    assert time_to_first_token(record(times=(0.05, 0.1), tokens=(0, 1))) == pytest.approx(0.1)


def test_degenerate_requests_give_nan():
    empty = RequestRecord(0.0)
    assert math.isnan(time_to_first_token(empty))
    assert math.isnan(user_rate(record(times=(0.1,), tokens=(4,))))
    assert math.isnan(percentile([], 50))
    assert percentile([1.0, 3.0], 50) == 2.0


def test_summarize_arm_known_values():
    failed = RequestRecord(0.0, error="boom")
    s = summarize_arm([record(), record(sent=0.05, times=(0.1, 0.2), tokens=(2, 2)), failed], 0.5)
    assert s["requests"] == 2 and s["errors"] == 1
    assert s["output_tokens"] == 10
    assert s["output_tokens_per_s"] == pytest.approx(20.0)
    assert s["tokens_per_s_per_user"] == pytest.approx((100.0 + 20.0) / 2)
    assert s["ttft_ms_median"] == pytest.approx(75.0)
    assert s["itl_ms_median"] == pytest.approx(10.0)
    assert s["steps"] == 5
    assert (s["drafted"], s["verified"], s["accepted"]) == (8, 6, 4)
    assert s["accepted_per_pass"] == pytest.approx(4 / 5)
    assert s["tokens_per_pass"] == pytest.approx(10 / 5)
    assert s["acceptance_rate"] == pytest.approx(4 / 6)


def test_summarize_arm_rejects_bad_wall_time():
    with pytest.raises(ValueError, match="wall_s"):
        summarize_arm([record()], 0.0)


def test_pareto_mask():
    xs = [1.0, 2.0, 3.0, 1.5, 3.0, float("nan")]
    ys = [5.0, 4.0, 1.0, 3.0, 1.0, 100.0]
    # (1.5, 3) is dominated by (2, 4); the two (3, 1) points tie and both stay; NaN never counts
    assert pareto_mask(xs, ys) == [True, True, True, False, True, False]


def test_frontier_by_concurrency():
    points = [
        {
            "workload": "w",
            "concurrency": 1,
            "arm": "av",
            "tokens_per_s_per_user": 10,
            "output_tokens_per_s": 10,
        },  # noqa: E501
        {
            "workload": "w",
            "concurrency": 1,
            "arm": "k2",
            "tokens_per_s_per_user": 9,
            "output_tokens_per_s": 9,
        },  # noqa: E501
        {
            "workload": "w",
            "concurrency": 4,
            "arm": "av",
            "tokens_per_s_per_user": 5,
            "output_tokens_per_s": 30,
        },  # noqa: E501
        {
            "workload": "w",
            "concurrency": 4,
            "arm": "k2",
            "tokens_per_s_per_user": 4,
            "output_tokens_per_s": 31,
        },  # noqa: E501
        {
            "workload": "v",
            "concurrency": 1,
            "arm": "k2",
            "tokens_per_s_per_user": 1,
            "output_tokens_per_s": 1,
        },  # noqa: E501
    ]
    mark_frontier(points)
    assert frontier_by_concurrency(points, "w") == {1: ["av"], 4: ["av", "k2"]}
    assert frontier_by_concurrency(points, "v") == {1: ["k2"]}


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


def test_goal_checks():
    def point(c, arm, x, y):
        return {"workload": "w", "concurrency": c, "arm": arm, X_KEY: x, Y_KEY: y}

    points = [
        point(1, "k1", 10, 10), point(1, "k2", 11, 11), point(1, "av2", 10.5, 10.45),
        point(8, "k1", 3, 30), point(8, "k2", 2, 40), point(8, "av2", 2.5, 50),
    ]  # fmt: skip
    mark_frontier(points)
    g = goal_checks(points, "w", "av2", ["k1", "k2"])
    assert g["av_over_fixed_kmax_at_high"] == pytest.approx(50 / 40)
    assert g["av_over_best_fixed_at_low"] == pytest.approx(10.45 / 11)
    assert g["av_on_frontier"] == [8] and g["av_on_frontier_count"] == 1
    assert g["concurrencies"] == 2 and (g["low_concurrency"], g["high_concurrency"]) == (1, 8)
    missing = goal_checks(points, "w", "av4", ["k1", "k4"])
    assert math.isnan(missing["av_over_fixed_kmax_at_high"]) and missing["av_on_frontier"] == []
