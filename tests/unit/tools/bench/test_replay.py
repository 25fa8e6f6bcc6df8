"""Replays of served steps on constructed step-log lines, with known answers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import avspec.tools.bench.oracle as oracle
import avspec.tools.bench.replay as replay
from avspec.av.step_cost import StepCost
from avspec.config import EstimatorConfig
from avspec.tools.bench.replay import (
    recorded_sequences,
    recorded_steps,
    replay_point,
    served_cost,
    served_lengths,
)

K = 4


def line(t: float, ids: list[int], drafted: list[int], prev: list[int], base: int = 0,
         timing: list[float] | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "t": t, "ids": ids, "caps": [K] * len(ids), "drafted": drafted,
        "adaptive": [0] * len(ids), "features": [[1.0] * d for d in drafted],
        "verify": drafted, "budget": 0, "base": base or len(ids), "prev_accepted": prev,
        "timing": timing or [],
    }  # fmt: skip


def one_request(accepted: list[int], prompt: int = 10) -> list[dict[str, Any]]:
    """One request at K drafts per step: a prefill step, then a step per outcome in `accepted`."""
    lines = [line(0.0, [7], [0], [], base=prompt)]
    for i in range(len(accepted)):  # line i + 1 carries the outcome of line i
        lines.append(line(i + 1.0, [7], [K], [accepted[i - 1]] if i else [0]))
    lines.append(line(len(accepted) + 1.0, [7], [K], [accepted[-1]]))
    return lines


def flat_cost() -> StepCost:
    """1 ms per step whatever it drafts or verifies, so tokens/s = 1000 x tokens per step."""
    return StepCost.linear(0.0, 0.0, 0.0, 0.0, 64, 1024, overhead_ms=1.0)


def test_recorded_steps_are_labelled_by_the_next_line() -> None:
    lines = one_request([2, 4, 1])
    recorded = recorded_steps(lines, K)
    assert recorded.num_draft.tolist() == [0, K, K, K]
    assert recorded.num_accepted.tolist() == [0, 2, 4, 1]
    assert recorded.base_tokens.tolist() == [10, 1, 1, 1]
    assert recorded.features.shape == (4, K) and recorded.features[0].sum() == 0
    lines[2]["verify"] = [1]
    with pytest.raises(ValueError, match="every draft verified"):
        recorded_steps(lines, K)


def test_unlabelled_outcomes_still_count_and_mismatched_lines_are_dropped() -> None:
    lines = one_request([2, 3])
    lines[2]["prev_accepted"] = [-1 - 2]  # kept out of the refit: still 2 accepted
    recorded = recorded_steps(lines, K)
    assert recorded.num_accepted.tolist() == [0, 2, 3]
    lines[2]["prev_accepted"] = [1, 1]  # a failed step: its predecessor has no outcome
    assert recorded_steps(lines, K).num_accepted.tolist() == [0, 3]


def test_sequences_and_lengths() -> None:
    lines = [
        line(0.0, [1, 2], [0, 0], [], base=30),
        line(1.0, [1, 2], [K, K], [0, 0]),
        line(2.0, [1, 2, 3], [K, K, 0], [1, 3], base=2 + 12),
        line(3.0, [2, 3], [K, K], [0, 2, 0]),
        line(4.0, [2, 3], [K, K], [K, 1]),
    ]
    sequences = recorded_sequences(recorded_steps(lines, K))
    assert [s.seq_id for s in sequences] == [1, 2, 3]
    assert [s.prompt_tokens for s in sequences] == [15, 15, 12]
    assert [s.length for s in sequences] == [1 + 2 + 1, 1 + 4 + 3 + 5, 1 + 2]
    assert served_lengths(lines) == [1 + 2 + 1, 1 + 4 + 3 + 5 + 1, 1 + 2 + 1]


def test_fixed_k_and_oracle_known_answers() -> None:
    # outcomes 2, 2, 2 at K drafts: k4 gains 3 a step, k1 2, none 1; 1 ms a step.
    recorded = recorded_steps(one_request([2, 2, 2, 2]), K)
    length = 1 + 3 * 4  # prefill token + four steps of 3
    result = replay_point(recorded, flat_cost(), ["none", "k1", "k4", "oracle"], 1)
    steps = {"none": 1 + 12, "k1": 1 + 6, "k4": 1 + 4, "oracle": 1 + 4}
    for arm, n in steps.items():
        assert result[arm]["tokens"] == length
        assert result[arm]["ms"] == pytest.approx(n)
        assert result[arm]["output_tokens_per_s"] == pytest.approx(1000 * length / n)
        assert result[arm]["tokens_per_s_per_user"] == pytest.approx(1000 * (length - 1) / (n - 1))


def test_a_slower_arm_has_a_longer_tail() -> None:
    """Two users, requests of 5 and 41 tokens: the short one leaves and the batch shrinks."""
    lines = [line(0.0, [1, 2], [0, 0], [], base=2)]
    lines += [line(1.0 + i, [1, 2], [K, K], [K, K] if i else [0, 0]) for i in range(8)]
    lines.append(line(9.0, [1, 2], [K, K], [K, K]))
    recorded = recorded_steps(lines, K)
    cost = StepCost.linear(0.0, 0.0, 0.0, 1.0, 64, 1024)  # 1 ms per verified token
    result = replay_point(recorded, cost, ["k1", "k4"], 2, lengths={"k1": [5, 41], "k4": [5, 41]})
    # k4: prefill (2 tokens, 2 ms), then 2 x 5 tokens a step until the first ends, then 5 alone
    assert result["k4"]["tokens"] == 46 and result["k4"]["ms"] == pytest.approx(2 + 10 + 7 * 5)
    # k1: 2 tokens per row a step at 2 ms per row: 2 ms (prefill) + 2 x 2 (4 tokens) + 18 x 2
    assert result["k1"]["tokens"] == 46 and result["k1"]["ms"] == pytest.approx(
        2 + 4 + 2 * 2 + 18 * 2
    )


def test_av_arms_call_the_verifier_and_the_drafting_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"step": 0, "plan": 0}
    step, plan = replay.AdaptiveVerifier.step, oracle.drafted_by_plan

    def counted_step(self, inputs):  # type: ignore[no-untyped-def]
        calls["step"] += 1
        return step(self, inputs)

    def counted_plan(*args):  # type: ignore[no-untyped-def]
        calls["plan"] += 1
        return plan(*args)

    monkeypatch.setattr(replay.AdaptiveVerifier, "step", counted_step)
    monkeypatch.setattr(oracle, "drafted_by_plan", counted_plan)
    recorded = recorded_steps(one_request([3, 0, 4, 1, 2, 0]), K)
    cost = StepCost.linear(1.0, 0.5, 5.0, 0.2, 64, 1024, overhead_ms=1.0)
    result = replay_point(recorded, cost, ["av4", "ad4", "k4", "oracle"], 1, EstimatorConfig(K))
    # a step each for av4 and ad4 until their requests end; ad4 drafts by a plan from step 2
    assert calls["step"] >= 2 * 5 and calls["plan"] >= 4
    for arm in ("av4", "ad4", "k4"):
        assert result[arm]["output_tokens_per_s"] <= result["oracle"]["output_tokens_per_s"]


def test_bad_arm_names() -> None:
    recorded = recorded_steps(one_request([1, 1]), K)
    for bad in ("k5", "av2", "ad", "x4"):
        with pytest.raises(ValueError, match="bad replay arm"):
            replay_point(recorded, flat_cost(), [bad], 1)


def test_served_cost_prices_each_step_shape_as_recorded() -> None:
    """Stages twice as slow as profiled and 3 ms between steps: the fit follows both."""
    profiled = StepCost.linear(1.0, 0.1, 10.0, 0.5, 64, 1024)
    lines = []
    for _ in range(40):
        timing = [2 * profiled.draft_pass.at(1)] * K + [2 * profiled.verify.at(1 + K), 0.0]
        previous = lines[-1] if lines else None
        gap = 0.0 if previous is None else sum(timing[: K + 1]) + 3.0
        t = (previous["t"] + gap / 1000.0) if previous else 0.0
        lines.append(
            line(t, [1], [K], [K] if previous else [], timing=timing if previous else None)
        )
    cost = served_cost(profiled, [lines])
    assert cost.overhead_ms == pytest.approx(3.0, abs=1e-6)
    assert cost.draft_pass.at(1) == pytest.approx(2 * profiled.draft_pass.at(1), rel=1e-4)
    assert cost.verify.at(1 + K) == pytest.approx(2 * profiled.verify.at(1 + K), rel=1e-4)
    assert profiled.overhead_ms == 0.0  # the profiled cost is left as it was
    assert np.isfinite(cost.step_ms([1] * K, 1 + K, 1))


def test_a_step_without_draws_defers_the_draft_pass_to_the_next_one() -> None:
    """none and k1 over one request of prompt 10, outcomes 0: with `defers_draft` none never
    runs the draft, and a step where no row draws adds its tokens to the next pass 0; without
    it (servers before the draft deferred) every step runs the draft over its pending tokens."""
    recorded = recorded_steps(one_request([0, 0, 0, 0], prompt=10), K)
    cost = StepCost.linear(1.0, 1.0, 0.0, 0.0, 64, 1024)  # a draft pass: 1 + 1 per token
    lazy = replay_point(recorded, cost, ["none", "k1"], 1, lengths={"none": [5], "k1": [5]})
    eager = replay_point(recorded, cost, ["none", "k1"], 1, defers_draft=False,
                         lengths={"none": [5], "k1": [5]})  # fmt: skip
    assert lazy["none"]["ms"] == 0.0  # no draft pass at all; the target is free here
    assert eager["none"]["ms"] == pytest.approx((1 + 10) + 4 * (1 + 1))
    # k1 draws every step after the prompt's (which records no drafts): deferring the
    # prompt's pass to the next saves that pass's fixed 1 ms, its tokens cost the same
    assert lazy["k1"]["ms"] == pytest.approx(eager["k1"]["ms"] - 1.0)
    assert replay.draft_deferred([[line(0.0, [1], [0], [], timing=[0.0, 0, 0, 0, 1.0, 2.0])]])
    assert not replay.draft_deferred([[line(0.0, [1], [0], [], timing=[3.0, 0, 0, 0, 1.0, 2.0])]])


def test_deferred_tokens_are_priced_in_the_pass_that_runs_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An arm that draws nothing for two steps, then draws: its pass 0 runs the prompt and the
    correction token of the second with its own token."""
    passes: list[list[int]] = []
    step_ms = StepCost.step_ms

    def spy(self, rows, tokens, verify_rows):  # type: ignore[no-untyped-def]
        passes.append(list(rows))
        return step_ms(self, rows, tokens, verify_rows)

    monkeypatch.setattr(StepCost, "step_ms", spy)
    draws = iter([0, 0, 1, 1, 1, 1])

    def plan(verifier, recorded, rows, *rest):  # type: ignore[no-untyped-def]
        n = next(draws)
        return np.array([n]), np.array([n]), None

    monkeypatch.setattr(replay, "av_step", plan)
    recorded = recorded_steps(one_request([0, 0, 0, 0, 0], prompt=10), K)
    replay_point(recorded, flat_cost(), ["ad4"], 1, EstimatorConfig(K), lengths={"ad4": [5]})
    assert [p[0] for p in passes[:4]] == [0, 0, 10 + 1 + 1, 1]  # prompt, a token, its own


def test_the_oracle_picks_each_steps_batch_depth() -> None:
    """Two rows, one accepting 4 drafts and one 0, a draft pass of 10 ms whatever its rows
    and a free target: drafting 4 for the first row opens 4 passes (40 ms for 4 more tokens),
    so the oracle drafts nothing; a per-row oracle would draft 4 and lose to none."""
    lines = [line(0.0, [1, 2], [0, 0], [], base=2)]
    lines += [line(1.0 + i, [1, 2], [K, K], [K, 0] if i else [0, 0]) for i in range(6)]
    lines.append(line(7.0, [1, 2], [K, K], [K, 0]))
    recorded = recorded_steps(lines, K)
    cost = StepCost.linear(10.0, 0.0, 0.0, 0.0, 64, 1024, overhead_ms=1.0)
    result = replay_point(recorded, cost, ["none", "k4", "oracle"], 2)
    assert result["oracle"]["output_tokens_per_s"] >= result["none"]["output_tokens_per_s"]
    assert result["oracle"]["ms"] == pytest.approx(result["none"]["ms"])
    cheap = StepCost.linear(0.1, 0.0, 0.0, 0.0, 64, 1024, overhead_ms=1.0)
    result = replay_point(recorded, cheap, ["none", "k4", "oracle"], 2)
    assert result["oracle"]["output_tokens_per_s"] >= result["k4"]["output_tokens_per_s"]
    assert result["oracle"]["output_tokens_per_s"] > 1.5 * result["none"]["output_tokens_per_s"]
