"""Tests for avspec.av.cost_refresh: following the served step times with windowed medians."""

from __future__ import annotations

import math
import random

import pytest

from avspec.av.cost_refresh import CostRefresh, _nearest
from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost, draft_width

ROWS = [1, 2, 4, 8, 16, 32, 64]
TOKENS = [1, 8, 64, 256, 576]


def _profiled() -> StepCost:
    draft = CostTable(ROWS, [1.0 + 0.1 * r for r in ROWS], name="draft_pass")
    verify = CostTable(TOKENS, [5.0 + 0.25 * t for t in TOKENS], name="verify")
    return StepCost(draft, verify, overhead_ms=0.5)


def _step(
    refresh: CostRefresh,
    rows: list[int],
    tokens: int,
    speed: float = 1.0,
    overhead: float = 0.5,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> None:
    """Observe one step of a machine `speed` times as slow as profiled, with `overhead` ms."""
    jitter = (lambda: 1.0 + rng.uniform(-noise, noise)) if rng else (lambda: 1.0)
    profiled = refresh.profiled
    draft_ms = [speed * profiled.draft_pass.at(r) * jitter() if r else 0.0 for r in rows]
    verify_ms = speed * profiled.verify.at(tokens) * jitter()
    refresh.observe(rows, draft_ms, tokens, verify_ms, sum(draft_ms) + verify_ms + overhead)


def _batch(rng: random.Random) -> tuple[list[int], int]:
    batch = rng.choice(ROWS)
    depth = rng.randint(0, 7)
    rows = [batch] + [batch] * depth + [0] * (7 - depth)
    return rows, batch * (1 + depth)


def test_follows_a_machine_that_becomes_twice_as_slow():
    """Worst case for one ladder point: its whole window is old. It flips once window // 2 + 1
    of its ratios are new, then at most every - 1 steps wait for the refresh."""
    cost = _profiled()
    window, every = 16, 4
    refresh = CostRefresh(cost, window=window, every=every)
    rng = random.Random(0)
    for _ in range(3 * window):
        _step(refresh, [16], 64, noise=0.05, rng=rng)
    assert cost.draft_pass.at(16) == pytest.approx(refresh.profiled.draft_pass.at(16), rel=0.05)
    ratios = []
    for _ in range(window // 2 + every):  # N = 12 steps, one ratio per table per step
        _step(refresh, [16], 64, speed=2.0, noise=0.05, rng=rng)
        ratios.append(cost.verify.at(64) / refresh.profiled.verify.at(64))
    assert ratios[-1] == pytest.approx(2.0, rel=0.05)
    assert ratios[window // 2 - 2] == pytest.approx(1.0, rel=0.05)  # not after 7 steps yet
    # The steps ran pass 0 only (the pending pass): its own table follows.
    assert cost.first_pass.at(16) == pytest.approx(2 * refresh.profiled.draft_pass.at(16), rel=0.05)
    # Ladder points never seen follow the table-wide median (only 16 and 64 were seen).
    assert cost.first_pass.at(1) == pytest.approx(2 * refresh.profiled.draft_pass.at(1), rel=0.05)
    assert cost.verify.at(576) == pytest.approx(2 * refresh.profiled.verify.at(576), rel=0.05)
    assert cost.first_pass.millis == sorted(cost.first_pass.millis)
    report = refresh.report()
    assert report["profiled_relative_error"] < -0.2  # the profiled tables are stale now
    assert refresh.updates == refresh.steps // every


def test_follows_everywhere_with_mixed_traffic():
    cost = _profiled()
    refresh = CostRefresh(cost, window=16, every=4)
    rng = random.Random(1)
    for _ in range(100):
        _step(refresh, *_batch(rng), noise=0.02, rng=rng)
    for _ in range(200):  # slower, and a longer fixed path: every point and the overhead follow
        _step(refresh, *_batch(rng), speed=2.0, overhead=1.5, noise=0.02, rng=rng)
    for r in ROWS:
        assert cost.draft_pass.at(r) == pytest.approx(
            2 * refresh.profiled.draft_pass.at(r), rel=0.03
        )
    for t in TOKENS:
        assert cost.verify.at(t) == pytest.approx(2 * refresh.profiled.verify.at(t), rel=0.03)
    assert cost.overhead_ms == pytest.approx(1.5, abs=0.2)
    report = refresh.report()
    assert abs(report["relative_error"]) < 0.05 and report["median_abs_relative_error"] < 0.05
    assert report["profiled_relative_error"] == pytest.approx(-0.5, abs=0.05)


def test_disabled_does_nothing():
    cost = _profiled()
    tables = (cost.draft_pass, cost.verify, cost.overhead_ms)
    refresh = CostRefresh(cost, enabled=False, window=4, every=1)
    for _ in range(10):
        _step(refresh, [4, 4], 8, speed=3.0, overhead=9.0)
    refresh.observe([1], [float("nan")], -1, -1.0, None)  # not even validated
    assert (cost.draft_pass, cost.verify, cost.overhead_ms) == tables
    assert refresh.steps == 0 and refresh.updates == 0
    assert refresh.report()["enabled"] is False and refresh.report()["observed_step_ms"] is None


def test_a_pass_timed_at_zero_is_not_a_sample():
    """A draft pass reported at 0 ms (not run, or not timed) with rows > 0 would pull the table
    towards a free draft: the refresh leaves it out, and the table stays the profile's."""
    cost = _profiled()
    refresh = CostRefresh(cost, window=4, every=4)
    for _ in range(8):
        refresh.observe([64, 0], [0.0, 0.0], 64, float(cost.verify(64)), None)
    assert cost.draft_pass.millis == pytest.approx(refresh.profiled.draft_pass.millis, rel=1e-12)


def test_one_outlier_does_not_move_the_table():
    cost = _profiled()
    refresh = CostRefresh(cost, window=16, every=8)
    for i in range(16):
        speed, overhead = (50.0, 400.0) if i == 5 else (1.0, 0.5)
        _step(refresh, [8] * 4, 32, speed=speed, overhead=overhead)
    assert refresh.updates == 2
    assert cost.draft_pass.millis == pytest.approx(refresh.profiled.draft_pass.millis, rel=1e-12)
    assert cost.verify.millis == pytest.approx(refresh.profiled.verify.millis, rel=1e-12)
    assert cost.overhead_ms == pytest.approx(0.5)


def test_steps_past_the_ladder_do_not_rescale_its_last_point():
    """A prefill far past the largest size (here 4x dearer than the profiled extrapolation)
    says nothing about the last ladder point; it is left out, not bucketed there."""
    cost = _profiled()
    refresh = CostRefresh(cost, window=16, every=4)
    for _ in range(8):
        _step(refresh, [8], 576)  # as profiled at the last point
        refresh.observe([8], [1.8], 2304, 4 * refresh.profiled.verify.at(2304), None)
    assert refresh.updates == 4
    assert cost.verify.at(576) == pytest.approx(refresh.profiled.verify.at(576), rel=1e-12)


def test_overhead_recovered_on_synthetic_steps():
    cost = _profiled()
    refresh = CostRefresh(cost, window=32, every=8)
    rng = random.Random(2)
    for _ in range(32):
        rows, tokens = _batch(rng)
        _step(refresh, rows, tokens, overhead=3.0 + rng.gauss(0.0, 0.2))
    assert cost.overhead_ms == pytest.approx(3.0, abs=0.15)
    # The tables were right: they stay (ratios 1).
    assert cost.verify.millis == pytest.approx(refresh.profiled.verify.millis)


def test_probabilities_hop_fitted_from_steps_of_different_widths():
    """Outside the stages a served step costs 3 ms + 0.25 ms per row and draft position (the
    draft probabilities' hop, as on the CPU host): the refresh recovers both, through noise and
    a stalled step, and then predicts the steps; a fit without the hop (the median alone, as
    before) puts the overhead at the median rest, 10.5 ms here."""
    cost = _profiled()
    refresh = CostRefresh(cost, window=64, every=16)
    rng = random.Random(3)
    draft, verify = refresh.profiled.draft_pass, refresh.profiled.verify
    for step in range(64):
        rows, tokens = _batch(rng)
        batch, width = rows[0], draft_width(rows)
        millis = [draft.at(r) if r else 0.0 for r in rows]
        rest = 3.0 + 0.25 * batch * width + rng.gauss(0.0, 0.1) + (500.0 if step == 40 else 0.0)
        wall = sum(millis) + verify.at(tokens) + rest
        refresh.observe(rows, millis, tokens, verify.at(tokens), wall, verify_rows=batch)
    assert cost.overhead_ms == pytest.approx(3.0, abs=0.3)
    assert cost.probs_row_ms == pytest.approx(0.25, abs=0.01)
    assert refresh.report()["median_abs_relative_error"] < 0.02


def test_probabilities_hop_kept_while_every_step_has_one_width():
    cost = _profiled()
    cost.probs_row_ms = 0.5  # learned before
    refresh = CostRefresh(cost, window=8, every=4)
    for _ in range(4):  # 4 rows at width 2 each: 4 ms of hop, 6 ms in all outside the stages
        refresh.observe([4, 4], [1.4, 1.4], 8, 7.0, 1.4 + 1.4 + 7.0 + 6.0, verify_rows=4)
    assert cost.probs_row_ms == 0.5 and cost.overhead_ms == pytest.approx(2.0)


def test_overhead_clamped_at_zero_and_steps_without_wall_time():
    cost = _profiled()
    refresh = CostRefresh(cost, window=8, every=2)
    refresh.observe([4], [1.4], 4, 6.0, 5.0)  # the step took less than its parts: clock skew
    refresh.observe([4], [1.4], 4, 6.0, None)
    assert cost.overhead_ms == 0.0 and refresh.updates == 1
    assert refresh.report()["window_steps"] == 1


def test_no_refresh_before_every_and_no_data_leaves_cost():
    cost = _profiled()
    draft, verify = cost.draft_pass, cost.verify
    refresh = CostRefresh(cost, window=8, every=3)
    refresh.observe([0, 0], [0.0, 0.0], 0, 0.0, None)  # nothing ran, nothing timed
    refresh.observe([], [], 0, 0.0, None)
    refresh.observe([2], [9.0], 0, 0.0, None)
    assert refresh.steps == 3 and refresh.updates == 1  # pending_pass refreshed, nothing else
    assert cost.verify is verify and cost.draft_pass is draft and cost.overhead_ms == 0.5
    assert cost.pending_pass is not None and cost.first_pass.at(2) == pytest.approx(9.0)
    refresh2 = CostRefresh(_profiled(), window=8, every=3)
    for _ in range(2):
        _step(refresh2, [4], 4, speed=2.0)
    assert refresh2.updates == 0 and refresh2.cost.verify is refresh2.profiled.verify


def test_points_without_data_take_the_table_wide_median():
    cost = _profiled()
    refresh = CostRefresh(cost, window=8, every=3)
    for speed, rows in ((2.0, 1), (3.0, 2), (3.0, 64)):
        ms = speed * refresh.profiled.draft_pass.at(rows)
        refresh.observe([0, rows], [0.0, ms], 0, 0.0, None)  # a decode pass only
    got = [a / b for a, b in zip(cost.draft_pass.millis, refresh.profiled.draft_pass.millis,
                                 strict=True)]  # fmt: skip
    # ladder 1 -> 2x, 2 -> 3x, 64 -> 3x, the rest -> median 3x; isotonic keeps it monotone
    assert got == pytest.approx([2.0] + [3.0] * 6)


def test_ratios_are_against_the_profiled_table_not_the_refreshed_one():
    cost = _profiled()
    refresh = CostRefresh(cost, window=4, every=1)
    for _ in range(10):
        _step(refresh, [8, 8], 16, speed=2.0)
    assert cost.draft_pass.at(8) == pytest.approx(2 * refresh.profiled.draft_pass.at(8))
    assert cost.first_pass.at(8) == pytest.approx(2 * refresh.profiled.draft_pass.at(8))


def test_same_step_cost_object_mutated():
    cost = _profiled()
    refresh = CostRefresh(cost, window=4, every=1)
    _step(refresh, [4], 4, speed=2.0)
    assert refresh.cost is cost and isinstance(cost.verify, CostTable)
    assert cost.verify.name == "verify" and cost.draft_pass.name == "draft_pass"
    assert cost.first_pass.name == "pending_pass"


def test_pending_pass_and_decode_passes_learned_apart():
    """Served, the pass over pending inputs costs more than a decode pass of as many rows (2.3x
    against 1.5x the profiled draft pass on the CPU host): each keeps its own ratios, and the
    step's prediction prices pass 0 by the pending table. A shared table (the refresh before)
    would price both at the median of the mixed ratios, 1.5x here: 35% low on pass 0."""
    cost = _profiled()
    refresh = CostRefresh(cost, window=64, every=8)
    rng = random.Random(1)
    for _ in range(64):
        rows, tokens = _batch(rng)
        draft = refresh.profiled.draft_pass
        millis = [(2.3 if p == 0 else 1.5) * draft.at(r) if r else 0.0 for p, r in enumerate(rows)]
        verify_ms = refresh.profiled.verify.at(tokens)
        refresh.observe(rows, millis, tokens, verify_ms, sum(millis) + verify_ms + 0.5)
    for r in ROWS:
        assert cost.first_pass.at(r) == pytest.approx(2.3 * draft.at(r), rel=1e-6)
        assert cost.draft_pass.at(r) == pytest.approx(1.5 * draft.at(r), rel=1e-6)
    assert refresh.report()["median_abs_relative_error"] < 1e-6


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1], [-1.0], 1, 1.0, 1.0), "draft_ms must be finite and >= 0"),
        (([1], [math.nan], 1, 1.0, 1.0), "draft_ms must be finite"),
        (([-1], [1.0], 1, 1.0, 1.0), "draft_rows must be finite and >= 0"),
        (([1.5], [1.0], 1, 1.0, 1.0), "draft_rows must be a whole number"),
        (([1, 2], [1.0], 1, 1.0, 1.0), "draft_rows has 2 passes but draft_ms has 1"),
        (([1], [1.0], math.inf, 1.0, 1.0), "verify_tokens must be finite"),
        (([1], [1.0], 1, math.inf, 1.0), "verify_ms must be finite"),
        (([1], [1.0], 1, 1.0, -3.0), "step_ms must be finite and >= 0"),
        (([1], [1.0], 1, 1.0, "x"), "step_ms must be a number"),
    ],
)
def test_rejects_bad_observations(args, match):
    cost = _profiled()
    refresh = CostRefresh(cost, window=4, every=1)
    with pytest.raises(ValueError, match=match):
        refresh.observe(*args)
    assert refresh.steps == 0 and refresh.updates == 0 and refresh.report()["window_steps"] == 0


@pytest.mark.parametrize(("kwargs", "match"), [({"window": 0}, "window"), ({"every": 0}, "every"),
                                               ({"every": 2.5}, "every")])  # fmt: skip
def test_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostRefresh(_profiled(), **kwargs)


def test_nearest_ladder_size():
    sizes = [1.0, 2.0, 4.0, 8.0]
    assert [_nearest(sizes, s) for s in (0.0, 1.0, 1.5, 1.6, 3.0, 5.9, 6.0, 7.0, 100.0)] == [
        0, 0, 0, 1, 1, 2, 2, 3, 3
    ]  # fmt: skip


def test_report_fields():
    refresh = CostRefresh(_profiled(), window=8, every=100)
    empty = refresh.report()
    assert empty["observed_step_ms"] is None and empty["updates"] == 0
    _step(refresh, [4, 4], 8, speed=1.0, overhead=0.5)
    report = refresh.report()
    assert report["observed_step_ms"] == pytest.approx(report["predicted_step_ms"])
    assert report["relative_error"] == pytest.approx(0.0, abs=1e-12)
    assert report["steps"] == 1 and report["window_steps"] == 1
