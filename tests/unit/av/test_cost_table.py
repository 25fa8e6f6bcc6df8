"""Tests for avspec.av.cost_table and avspec.av.isotonic: validation, the isotonic fit (pool
adjacent violators, not a running max), interpolation, extrapolation."""

import json
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from avspec.av.cost_table import CostTable
from avspec.av.isotonic import isotonic

# models/cost_tables.json before isotonic fitting: one sample per size, verify by tokens.
OLD_VERIFY_SIZES = [32, 36, 48, 64, 80, 96, 112, 128, 144]
OLD_VERIFY_MILLIS = [20.392, 18.532, 24.712, 53.542, 39.455, 44.199, 45.469, 62.463, 50.782]


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
    ids=["empty", "lengths", "nan", "inf", "negative ms", "negative size", "nan size", "dup"],
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
    assert table.millis == [4.5, 4.5, 6.5, 6.5]
    torch.testing.assert_close(table(torch.tensor([1.5, 6.0])), torch.tensor([4.5, 6.5]))


def test_isotonic_not_running_max():
    """A running max would give [1, 3, 3]: the one high point lifts everything after it."""
    assert CostTable([1, 2, 3], [1.0, 3.0, 2.0]).millis == [1.0, 2.5, 2.5]
    assert isotonic([1.0, 3.0, 2.0]) == [1.0, 2.5, 2.5]


def test_cliff_of_the_old_table_is_pooled():
    """48 -> 24.7, 64 -> 53.5, 80 -> 39.5: 64 and 80 pool at their mean 46.5; a running max
    kept 53.5 at 64 and 80 and a steeper 48..64 segment."""
    table = CostTable([48, 64, 80], [24.7, 53.5, 39.5], name="verify")
    assert table.millis == pytest.approx([24.7, 46.5, 46.5])
    got = table(torch.tensor([49.0, 56.0, 64.0, 72.0, 80.0], dtype=torch.float64)).tolist()
    assert got == pytest.approx([24.7 + 21.8 / 16, 24.7 + 21.8 / 2, 46.5, 46.5, 46.5], abs=1e-5)
    assert max(got) <= 46.5 + 1e-5 < 53.5


def test_old_table_segment_stays_below_the_outlier():
    table = CostTable(OLD_VERIFY_SIZES, OLD_VERIFY_MILLIS, name="verify")
    assert table.millis == sorted(table.millis)
    at = dict(zip(table.sizes, table.millis, strict=True))
    # 64, 80, 96 and 112 pool (the 44.2 and 45.5 at 96 and 112 are below 46.5 too).
    pooled = sum(OLD_VERIFY_MILLIS[3:7]) / 4
    assert [at[s] for s in (64.0, 80.0, 96.0, 112.0)] == pytest.approx([pooled] * 4)
    assert at[64.0] < 53.542 - 7.0
    # 128 -> 62.5 and 144 -> 50.8 pool too; the curve ends where the data do, not at the max.
    assert at[128.0] == at[144.0] == pytest.approx((62.463 + 50.782) / 2)


def test_weights_pull_the_pooled_value():
    """A point backed by more repeats moves the pooled mean towards itself."""
    table = CostTable([1, 2], [4.0, 2.0], weights=[3, 1])
    assert table.millis == [3.5, 3.5] and table.weights == [3.0, 1.0]
    assert isotonic([4.0, 2.0], [1.0, 3.0]) == [2.5, 2.5]


def test_weights_follow_the_sorted_points():
    table = CostTable([2, 1], [2.0, 4.0], weights=[1, 3])  # same points as above, unsorted
    assert table.sizes == [1.0, 2.0] and table.millis == [3.5, 3.5]


@pytest.mark.parametrize(
    ("weights", "match"),
    [([1.0], "2 sizes but 1 weights"), ([1.0, 0.0], "weights must be finite and > 0"),
     ([1.0, float("nan")], "weights must be finite"), ([-1.0, 1.0], "> 0")],
)  # fmt: skip
def test_rejects_bad_weights(weights, match):
    with pytest.raises(ValueError, match=match):
        CostTable([1, 2], [1.0, 2.0], name="verify", weights=weights)


def _minmax_isotonic(values, weights):
    """Independent reference: f_i = max_{j <= i} min_{k >= i} weighted mean of values[j..k]."""
    n = len(values)

    def mean(j, k):
        w = weights[j : k + 1]
        return sum(v * x for v, x in zip(values[j : k + 1], w, strict=True)) / sum(w)

    return [max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_isotonic_properties(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    values = [rng.uniform(0.0, 100.0) for _ in range(n)]
    weights = [float(rng.randint(1, 10)) for _ in range(n)]
    fitted = isotonic(values, weights)
    assert len(fitted) == n
    assert all(b >= a for a, b in zip(fitted, fitted[1:], strict=False))  # monotone
    assert fitted == pytest.approx(_minmax_isotonic(values, weights))  # the least-squares fit
    # Each pooled block (a run of equal fitted values) keeps its points' weighted mean.
    start = 0
    for end in range(1, n + 1):
        if end == n or fitted[end] != fitted[start]:
            w = weights[start:end]
            block_mean = sum(v * x for v, x in zip(values[start:end], w, strict=True)) / sum(w)
            assert fitted[start] == pytest.approx(block_mean)
            start = end
    total = sum(w * f for w, f in zip(weights, fitted, strict=True))
    assert total == pytest.approx(sum(w * v for w, v in zip(weights, values, strict=True)))


def test_isotonic_keeps_monotone_input_and_edge_cases():
    assert isotonic([1.0, 1.0, 2.0, 5.0]) == [1.0, 1.0, 2.0, 5.0]
    assert isotonic([]) == []
    assert isotonic([3.0]) == [3.0]
    assert isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="2 values but 1 weights"):
        isotonic([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="values must be finite"):
        isotonic([1.0, float("inf")])
    with pytest.raises(ValueError, match="weights must be finite and > 0"):
        isotonic([1.0], [0.0])


def test_slope_is_the_segment_slope():
    table = CostTable([1, 3, 5], [10.0, 14.0, 15.0])
    got = table.slope(torch.tensor([0.0, 1.0, 2.9, 3.0, 9.0]))
    torch.testing.assert_close(got, torch.tensor([2.0, 2.0, 2.0, 0.5, 0.5], dtype=torch.float64))
    assert float(CostTable([8], [3.0]).slope(4.0)) == 0.0


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
    assert again.to_dict() == {"name": "draft", "sizes": [1.0, 2.0], "millis": [2.5, 2.5]}
    weighted = CostTable.from_dict({"sizes": [1, 2], "millis": [3.0, 2.0], "weights": [3, 1]})
    assert weighted.millis == [2.75, 2.75]


def test_from_dict_missing_keys():
    with pytest.raises(ValueError, match="lacks"):
        CostTable.from_dict({"sizes": [1]})


def test_follows_input_device():
    table = CostTable([1, 2], [1.0, 2.0])
    assert table(torch.tensor([1.5], device="meta")).device.type == "meta"


@pytest.mark.parametrize("seed", range(5))
def test_at_matches_call(seed):
    rng = random.Random(seed)
    sizes = sorted(rng.sample(range(0, 600), rng.randint(1, 8)))
    table = CostTable(sizes, [rng.uniform(0.0, 50.0) for _ in sizes])
    probes = [rng.uniform(-5.0, 800.0) for _ in range(50)] + [float(s) for s in sizes]
    want = table(torch.tensor(probes, dtype=torch.float64)).double().tolist()
    assert [table.at(p) for p in probes] == pytest.approx(want, rel=1e-6, abs=1e-5)


class _HostReads(TorchDispatchMode):
    """Records reads of a tensor's value on the host (`.item()`, or indexing by a 0-dim tensor):
    a blocking sync when the tensor lives on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_a_0_dim_size_is_priced_without_reading_it_on_the_host():
    """The budget prices 0-dim device tensors (a batch's row count): cost and slope must stay on
    the device (on an H200 `ys[segment]` with a 0-dim segment was a sync every step). Broken
    variant: the same lookup by Python indexing reads the segment on the host."""
    table = CostTable([0.0, 10.0, 20.0], [1.0, 2.0, 5.0])
    size = torch.tensor(15.0)
    with _HostReads() as mode:
        cost, slope = table(size), table.slope(size)
    assert mode.reads == 0
    assert cost.shape == () and float(cost) == pytest.approx(3.5) and float(slope) == 0.3
    xs, ys, _ = table._tables(size.device)
    with _HostReads() as broken:
        _ = ys[table._segment(xs, size.double())]
    assert broken.reads == 1
