"""Tests for avspec.tools.bench.full_batch: tokens/s over the steps where every user is busy."""

import pytest

from avspec.tools.bench.full_batch import full_batch_rate


def _line(t: float, ids: list[int], prev_accepted: list[int]) -> dict:
    return {"t": t, "ids": ids, "prev_accepted": prev_accepted}


def test_counts_full_batch_steps_only():
    """Two users: two full steps of 100 ms (3 + 2 tokens, then 1 + 4; -1 - n encodes n
    accepted, not for the refit), then a tail step of one row taking 300 ms (1 token)."""
    lines = [
        _line(0.0, [1, 2], []),
        _line(0.1, [1, 2], [2, 1]),
        _line(0.2, [2], [0, -4]),  # 1 + (3 + 1): the second row's outcome encoded as -1 - 3
        _line(0.5, [], [0]),
    ]
    rate = full_batch_rate(lines, 2)
    assert rate["steps"] == 2
    assert rate["tokens_per_s"] == pytest.approx((5 + 5) / 0.2)
    assert rate["share"] == pytest.approx(0.2 / 0.5)


def test_no_full_step_and_phase_boundaries():
    lines = [_line(0.0, [1], []), _line(0.1, [7, 8], [])]  # the outcome is not this step's
    assert full_batch_rate(lines, 2) == {"tokens_per_s": 0.0, "share": 0.0, "steps": 0.0}
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        full_batch_rate(lines, 0)
