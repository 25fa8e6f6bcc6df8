"""Tests for avspec.av.cost_table: validation, monotone forcing, interpolation, extrapolation."""

import json

import pytest
import torch

from avspec.av.cost_table import CostTable


@pytest.mark.parametrize(
    ("sizes", "millis", "match"),
    [
        ([], [], "'verify' is empty"),
        ([1, 2], [1.0], "2 sizes but 1"),
        ([1, 2], [1.0, float("nan")], "millis must be finite"),
        ([1, 2], [1.0, float("inf")], "millis must be finite"),
        ([1, 2], [-1.0, 2.0], "millis must be finite and >= 0"),
        ([-1, 2], [1.0, 2.0], "sizes must be finite and >= 0"),
        ([1, float("nan")], [1.0, 2.0], "sizes must be finite"),
        ([4, 2, 4], [1.0, 2.0, 3.0], "duplicate sizes"),
    ],
)
def test_rejects_bad_tables(sizes, millis, match):
    with pytest.raises(ValueError, match=match):
        CostTable(sizes, millis, name="verify")


def test_interpolates_and_extrapolates_with_last_slope():
    table = CostTable([1, 3, 5], [10.0, 14.0, 15.0])
    got = table(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0]))
    torch.testing.assert_close(got, torch.tensor([10.0, 10.0, 12.0, 14.0, 14.5, 15.0, 17.0]))
    assert got.dtype == torch.float32


def test_unsorted_points_are_sorted():
    table = CostTable([5, 1, 3], [15.0, 10.0, 14.0])
    assert table.sizes == [1.0, 3.0, 5.0] and table.millis == [10.0, 14.0, 15.0]


def test_curve_forced_non_decreasing():
    table = CostTable([1, 2, 3, 4], [5.0, 4.0, 7.0, 6.0])
    assert table.millis == [5.0, 5.0, 7.0, 7.0]
    torch.testing.assert_close(table(torch.tensor([1.5, 6.0])), torch.tensor([5.0, 7.0]))


def test_single_point_is_constant():
    table = CostTable([8], [3.0])
    torch.testing.assert_close(table(torch.tensor([0.0, 8.0, 100.0])), torch.full((3,), 3.0))


def test_scalar_and_integer_inputs():
    table = CostTable.linear(fixed_ms=2.0, per_unit_ms=0.5, max_size=10)
    assert table(4).shape == ()
    assert float(table(4)) == 4.0
    assert float(table(torch.tensor(20))) == 12.0  # extrapolated past max_size


def test_round_trip_dict():
    table = CostTable([1, 2], [3.0, 2.0], name="draft")
    again = CostTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert again.to_dict() == {"name": "draft", "sizes": [1.0, 2.0], "millis": [3.0, 3.0]}


def test_from_dict_missing_keys():
    with pytest.raises(ValueError, match="lacks"):
        CostTable.from_dict({"sizes": [1]})


def test_follows_input_device():
    table = CostTable([1, 2], [1.0, 2.0])
    assert table(torch.tensor([1.5], device="meta")).device.type == "meta"
