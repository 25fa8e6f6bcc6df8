"""Benchmark statistics, frontier and goal checks on constructed inputs with known answers."""

from __future__ import annotations

import math

import pytest

from avspec.tools.bench.frontier import (
    X_KEY,
    Y_KEY,
    RequestRecord,
    frontier_by_concurrency,
    goal_checks,
    inter_token_latencies,
    mark_frontier,
    pareto_mask,
    percentile,
    set_and_forget_goals,
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


def test_goal_checks():
    def point(c, arm, x, y):
        return {"workload": "w", "concurrency": c, "arm": arm, X_KEY: x, Y_KEY: y}

    points = [
        point(1, "k1", 10, 10), point(1, "k2", 11, 11), point(1, "av2", 10.5, 10.45),
        point(8, "k1", 3, 30), point(8, "k2", 2, 40), point(8, "av2", 2.5, 50),
    ]  # fmt: skip
    mark_frontier(points)
    points += [point(16, "k1", 1, 60), point(16, "k2", 0.9, 70), point(16, "av2", 1.0, 77.7)]
    mark_frontier(points)
    g = goal_checks(points, "w", "av2", ["k1", "k2"])
    assert g["av_over_best_fixed"] == pytest.approx({"1": 10.45 / 11, "8": 50 / 40, "16": 1.11})
    assert g["high_goal_met"]  # 1.11 >= 1.10 at c = 16
    assert not g["low_goal_met"]  # 0.95 < 0.98 at c = 1
    assert g["av_on_frontier"] == [8, 16] and g["av_on_frontier_count"] == 2
    assert g["concurrencies"] == 3
    missing = goal_checks(points, "w", "av4", ["k1", "k4"])
    assert math.isnan(missing["av_over_best_fixed"]["1"]) and missing["av_on_frontier"] == []
    assert not missing["high_goal_met"] and not missing["low_goal_met"]


def test_set_and_forget_goals_known_answers() -> None:
    def point(c: int, arm: str, tps: float) -> dict:
        return {"workload": "w", "concurrency": c, "arm": arm, "output_tokens_per_s": tps}

    points = [
        point(1, "none", 10), point(1, "k8", 12), point(1, "av8", 12), point(1, "ad8", 13),
        point(16, "none", 50), point(16, "k8", 40), point(16, "av8", 49), point(16, "ad8", 49.5),
    ]  # fmt: skip
    goals = set_and_forget_goals(points, "w")
    assert goals["av_over_k"] == {"1": 1.0, "16": pytest.approx(49 / 40)}
    assert goals["ad_over_best_arm"] == {"1": 13 / 12, "16": pytest.approx(49.5 / 50)}
    assert goals["same_length_goal_met"] and goals["best_arm_goal_met"]
    points[-1]["output_tokens_per_s"] = 48.0  # 0.96 of no speculation: the goal fails
    points[-2]["output_tokens_per_s"] = 47.0  # 1.175 of k8: below 1.20
    goals = set_and_forget_goals(points, "w")
    assert not goals["best_arm_goal_met"] and not goals["same_length_goal_met"]
