"""The restart budget of a dead tritonserver (avspec.serving.host.restart)."""

from __future__ import annotations

import pytest

from avspec.serving.host.restart import RestartBudget


def test_delays_double_and_the_budget_of_a_window_runs_out() -> None:
    budget = RestartBudget(max_restarts=3, window_s=100.0, first_delay_s=1.0, max_delay_s=3.0)
    assert [budget.next_delay(t) for t in (0.0, 5.0, 10.0)] == [1.0, 2.0, 3.0]  # capped at 3
    assert budget.next_delay(20.0) is None  # a fourth death within 100 s: give up
    assert budget.used == 3
    # once the first restart leaves the window, one more is allowed
    assert budget.next_delay(100.0) == 3.0


def test_a_single_crash_long_after_the_last_restarts_quickly() -> None:
    budget = RestartBudget(max_restarts=5, window_s=60.0)
    budget.next_delay(0.0)
    budget.next_delay(1.0)
    assert budget.next_delay(1000.0) == budget.first_delay_s


def test_no_restarts_allowed() -> None:
    assert RestartBudget(max_restarts=0).next_delay(0.0) is None


@pytest.mark.parametrize(
    "kwargs", [{"max_restarts": -1}, {"window_s": 0}, {"first_delay_s": 5, "max_delay_s": 1}]
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RestartBudget(**kwargs)
