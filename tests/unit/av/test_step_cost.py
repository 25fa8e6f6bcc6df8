"""Tests for avspec.av.step_cost: a step's modelled milliseconds from its tables."""

import pytest

from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost, draft_width, rows_per_pass

COST = StepCost.linear(1.0, 0.5, 10.0, 1.0, 64, 576, overhead_ms=2.0, verify_row_ms=0.25)


def test_step_ms_by_hand():
    # passes of 6 pending tokens, then 2 and 1 rows; the target over 9 tokens in 3 rows
    passes = rows_per_pass(6, [3, 2, 0], 3)
    assert passes == [6, 2, 1]
    want = 2.0 + (1 + 3.0) + (1 + 1.0) + (1 + 0.5) + (10 + 9.0) + 0.75
    assert COST.step_ms(passes, 9, 3) == pytest.approx(want)


def test_pass_zero_is_priced_by_the_pending_table_when_there_is_one():
    cost = StepCost.linear(1.0, 0.5, 10.0, 1.0, 64, 576)
    assert cost.first_pass is cost.draft_pass
    assert cost.pending_ms(6) == pytest.approx(4.0) and cost.pending_ms(0) == 0.0
    cost.pending_pass = CostTable.linear(3.0, 1.0, 64, name="pending_pass")
    assert cost.pending_ms(6) == pytest.approx(9.0)
    # only pass 0 changes: 9 + (1 + 1) + (1 + 0.5), target 10 + 9
    assert cost.step_ms([6, 2, 1], 9, 0) == pytest.approx(9.0 + 2.0 + 1.5 + 19.0)
    assert cost.step_ms([0, 2], 0, 0) == pytest.approx(2.0)  # pass 0 not run: free


def test_draft_width_is_the_deepest_pass_run_plus_one():
    assert draft_width([6, 2, 1]) == 3
    assert draft_width([6, 0, 0, 0]) == 1  # x_0 only
    assert draft_width([0, 0]) == 1 and draft_width([]) == 1  # nothing drawn: one position sent
    assert draft_width([4, 3, 0, 1, 0]) == 4


def test_probabilities_hop_priced_per_row_and_position():
    cost = StepCost.linear(1.0, 0.5, 10.0, 1.0, 64, 576, probs_row_ms=0.25)
    plain = StepCost.linear(1.0, 0.5, 10.0, 1.0, 64, 576)
    # 3 rows, width 3: 0.25 * 3 * 3
    assert cost.step_ms([6, 2, 1], 9, 3) - plain.step_ms([6, 2, 1], 9, 3) == pytest.approx(2.25)
    with pytest.raises(ValueError, match="probs_row_ms must be finite and >= 0"):
        StepCost.linear(1.0, 0.5, 10.0, 1.0, 64, 576, probs_row_ms=-1.0)
