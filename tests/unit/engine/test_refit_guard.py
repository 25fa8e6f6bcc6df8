"""RefitGuard: the temperature cap and the per-client share, with rotation, on plain rows."""

from __future__ import annotations

import pytest
import torch

from avspec.av.estimator import accepted_counts, refit_excluded
from avspec.engine.refit_guard import RefitGuard, RefitRow


def row(seq_id: int, client: str = "", temperature: float = 1.0, verified: int = 4, accepted=2):
    return RefitRow(seq_id, client, temperature, verified, accepted)


def labelled_ids(rows: list[RefitRow], sent: torch.Tensor) -> set[int]:
    return {r.seq_id for r, value in zip(rows, sent.tolist(), strict=True) if value >= 0}


def test_defaults_label_every_row() -> None:
    rows = [row(i, client="A", temperature=100.0, accepted=i % 3) for i in range(1, 9)]
    sent = RefitGuard().prev_num_accepted(rows)
    assert sent.dtype == torch.int32 and sent.tolist() == [r.accepted for r in rows]


def test_empty_step() -> None:
    sent = RefitGuard(refit_client_share=0.25).prev_num_accepted([])
    assert sent.shape == (0,) and sent.dtype == torch.int32


def test_hot_rows_do_not_feed_the_refit() -> None:
    guard = RefitGuard(refit_max_temperature=2.0)
    rows = [row(1, temperature=0.7), row(2, temperature=2.5, accepted=3), row(3, temperature=2.0)]
    sent = guard.prev_num_accepted(rows)
    assert sent.tolist() == [2, int(refit_excluded(torch.tensor(3))), 2]  # 2.0 is not above
    accepted, labelled = accepted_counts(sent)
    assert accepted.tolist() == [2, 3, 2] and labelled.tolist() == [True, False, True]


def test_client_share_caps_labels_per_step_and_rotates() -> None:
    """One client owns 60 of 64 rows; share 0.25: it labels 16 per step, in turn."""
    guard = RefitGuard(refit_client_share=0.25)
    a_rows = [row(i, client="A") for i in range(1, 61)]
    others = [row(60 + i, client=f"c{i}") for i in range(1, 5)]
    labelled = []
    for _ in range(5):
        sent = guard.prev_num_accepted(a_rows + others)
        assert set(sent.tolist()) <= {2, -3}
        assert sent[60:].tolist() == [2] * 4  # the other clients stay under their cap
        labelled.append(labelled_ids(a_rows, sent[:60]))
    assert labelled[0] == set(range(1, 17))
    assert labelled[3] == set(range(49, 61)) | set(range(1, 5))  # wraps round
    assert [len(s) for s in labelled] == [16] * 5
    assert set.union(*labelled[:4]) == {r.seq_id for r in a_rows}  # each within 4 steps


def test_cap_counts_only_rows_that_would_be_labelled() -> None:
    guard = RefitGuard(refit_client_share=0.25, refit_max_temperature=2.0)
    rows = [row(i, verified=0, accepted=0) for i in range(1, 6)]  # nothing verified: no label
    rows += [row(6, temperature=3.0), row(7), row(8)]  # one hot row, excluded anyway
    sent = guard.prev_num_accepted(rows)
    assert sent.tolist() == [0] * 5 + [-3, 2, 2]  # cap 2 of 8 rows: both verified rows labelled


def test_cap_is_at_least_one_row() -> None:
    guard = RefitGuard(refit_client_share=0.1)
    sent = guard.prev_num_accepted([row(i, client="A") for i in range(1, 5)])
    assert sent.tolist() == [2, -3, -3, -3]  # floor(0.4) = 0, yet one row labels


def test_cap_survives_float_rounding() -> None:
    """0.29 * 100 = 28.999999999999996 in floats: the cap is still 29."""
    guard = RefitGuard(refit_client_share=0.29)
    sent = guard.prev_num_accepted([row(i, client="A") for i in range(1, 101)])
    assert int((sent >= 0).sum()) == 29


def test_rotation_follows_seq_ids_not_row_order() -> None:
    guard = RefitGuard(refit_client_share=0.5)
    rows = [row(i, client="A") for i in (40, 10, 30, 20)]
    assert labelled_ids(rows, guard.prev_num_accepted(rows)) == {10, 20}
    rows = [row(i, client="A") for i in (25, 40, 10, 30)]  # 20 finished, 25 joined
    assert labelled_ids(rows, guard.prev_num_accepted(rows)) == {25, 30}


def test_a_client_that_labels_nothing_starts_over() -> None:
    guard = RefitGuard(refit_client_share=0.5)
    rows = [row(i, client="A") for i in (1, 2, 3, 4)]
    assert labelled_ids(rows, guard.prev_num_accepted(rows)) == {1, 2}
    idle = [row(i, client="A", verified=0, accepted=0) for i in (1, 2, 3, 4)]
    guard.prev_num_accepted(idle)  # A has no row to label: its cursor is dropped
    assert labelled_ids(rows, guard.prev_num_accepted(rows)) == {1, 2}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"refit_max_temperature": -0.5}, "refit_max_temperature must be >= 0"),
        ({"refit_max_temperature": float("nan")}, "refit_max_temperature must be >= 0"),
        ({"refit_client_share": 0.0}, r"refit_client_share must lie in \(0, 1\]"),
        ({"refit_client_share": 1.5}, r"refit_client_share must lie in \(0, 1\]"),
    ],
)
def test_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RefitGuard(**kwargs)
