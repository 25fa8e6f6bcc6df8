"""What the budget chose, per decode row, from constructed step-log lines."""

from __future__ import annotations

from typing import Any

import pytest

from avspec.tools.bench.budget_view import budget_choices


def line(ids: list[int], caps: list[int], drafted: list[int], verify: list[int],
         prev: list[int]) -> dict[str, Any]:  # fmt: skip
    return {"ids": ids, "caps": caps, "drafted": drafted, "verify": verify, "prev_accepted": prev}


def test_per_row_means_leave_out_prompts_and_rows_without_drafts() -> None:
    lines = [
        line([1], [8], [0], [0], []),  # request 1's prompt
        line([1, 2], [8, 8], [4, 0], [2, 0], [0]),  # request 2's prompt
        line([1, 2, 3], [8, 8, 0], [6, 2, 0], [3, 2, 0], [1, 0]),  # request 3: no speculation
        line([1, 2], [8, 8], [0, 8], [0, 8], [-1 - 2, 1, 0]),  # an unlabelled outcome counts
    ]
    choices = budget_choices(lines)
    assert choices["rows"] == 5  # 1 at step 2, 1 and 2 at steps 3 and 4
    assert choices["batch"] == pytest.approx(5 / 3)
    assert choices["drafted_per_row"] == pytest.approx((4 + 6 + 2 + 0 + 8) / 5)
    assert choices["verified_per_row"] == pytest.approx((2 + 3 + 2 + 0 + 8) / 5)
    assert choices["accepted_per_row"] == pytest.approx((1 + 2 + 1) / 5)  # last step: no outcome
    assert choices["trimmed_share"] == pytest.approx((20 - 15) / 20)
    assert choices["stopped_early_share"] == pytest.approx((40 - 20) / 40)


def test_no_decode_rows() -> None:
    assert budget_choices([line([1], [0], [0], [0], [])]) == {"rows": 0}
    assert budget_choices([]) == {"rows": 0}
