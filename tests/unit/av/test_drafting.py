"""Tests for avspec.av.drafting: the DraftPlan tensor, the stop rule and the per-row limits."""

from dataclasses import replace

import pytest
import torch

from avspec.av.drafting import (
    DraftPlan,
    draft_limits,
    drafted_by_plan,
    keeps_drafting,
    probe_stride,
    probed,
    stop_confidence,
)

K = 4
# Values exact in float32, so a round trip through the tensor gives them back as they are.
PLAN = DraftPlan(threshold=0.375, depth=3, slope=0.75, intercepts=(0.5, -0.25, -1.0, 2.0))


def _tensor(threshold=0.375, depth=3.0, slope=0.75, intercepts=(0.5, -0.25, -1.0, 2.0), stride=0.0):
    return torch.tensor([threshold, depth, slope, stride, *intercepts], dtype=torch.float32)


def test_to_tensor_layout():
    t = PLAN.to_tensor()
    assert t.dtype == torch.float32 and t.shape == (4 + K,) and t.device == torch.device("cpu")
    assert t.tolist() == [0.375, 3.0, 0.75, 0.0, 0.5, -0.25, -1.0, 2.0]
    assert replace(PLAN, probe_stride=3).to_tensor()[3].item() == 3.0


def test_round_trip():
    assert DraftPlan.from_tensor(PLAN.to_tensor(), K) == PLAN
    probing = replace(PLAN, probe_stride=5)
    assert DraftPlan.from_tensor(probing.to_tensor(), K) == probing
    back = DraftPlan.from_tensor(PLAN.to_tensor(), K)
    assert isinstance(back.depth, int) and isinstance(back.intercepts, tuple)


def test_from_tensor_reads_float64_and_keeps_the_first_num_positions_intercepts():
    plan = DraftPlan.from_tensor(_tensor(depth=2.0).double(), 2)
    assert plan == DraftPlan(0.375, 2, 0.75, (0.5, -0.25))


def test_empty_tensor_is_no_plan():
    assert DraftPlan.from_tensor(torch.zeros(0), K) is None
    assert DraftPlan.from_tensor(torch.zeros(0, dtype=torch.float64), K) is None


@pytest.mark.parametrize("threshold", [0.0, 1.0])
@pytest.mark.parametrize("depth", [0, 1, K])
def test_bounds_are_accepted(threshold, depth):
    plan = DraftPlan.from_tensor(_tensor(threshold=threshold, depth=float(depth)), K)
    assert plan is not None and plan.threshold == threshold and plan.depth == depth


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (torch.zeros(1, 4 + K), "draft_plan must have shape"),
        (torch.zeros(()), "draft_plan must have shape"),
        (torch.zeros(4 + K - 1), r"draft_plan has 7 entries, want 4 \+ 4"),
        (torch.zeros(3), r"draft_plan has 3 entries"),
        (_tensor(stride=-1.0), "probe stride -1.0 is not an integer >= 0"),
        (_tensor(stride=2.5), "probe stride 2.5 is not an integer"),
        (_tensor(stride=float("nan")), "finite"),
        (_tensor(threshold=float("nan")), "finite"),
        (_tensor(slope=float("nan")), "finite"),
        (_tensor(intercepts=(0.0, 0.0, float("nan"), 0.0)), "finite"),
        (_tensor(intercepts=(0.0, float("inf"), 0.0, 0.0)), "finite"),
        (_tensor(depth=float("-inf")), "finite"),
        (_tensor(threshold=-0.25), "threshold -0.25 outside"),
        (_tensor(threshold=1.5), "threshold 1.5 outside"),
        (_tensor(depth=1.5), "depth 1.5 is not an integer in 0..4"),
        (_tensor(depth=-1.0), "depth -1.0 is not an integer"),
        (_tensor(depth=K + 1.0), "depth 5.0 is not an integer in 0..4"),
    ],
)
def test_from_tensor_rejects(plan, match):
    with pytest.raises(ValueError, match=match):
        DraftPlan.from_tensor(plan, K)


def test_a_nan_past_the_read_intercepts_is_still_rejected():
    """Every entry must be finite, even intercepts beyond num_positions."""
    with pytest.raises(ValueError, match="finite"):
        DraftPlan.from_tensor(torch.cat([PLAN.to_tensor(), torch.tensor([float("nan")])]), K)


def test_stop_confidence_is_the_plans_sigmoid_at_that_position():
    features = torch.tensor([-2.0, 0.0, 3.5])
    for position in range(K):
        got = stop_confidence(features, position, PLAN)
        want = torch.sigmoid(0.75 * features + PLAN.intercepts[position])
        assert got.dtype == torch.float32 and got.shape == (3,)
        torch.testing.assert_close(got, want)
    # float64 features are computed in float32, like the estimator's predict
    assert stop_confidence(features.double(), 1, PLAN).dtype == torch.float32


def test_keeps_drafting_at_equality():
    """>= tau keeps drafting: a survival exactly at tau keeps, the float just below stops."""
    plan = DraftPlan(0.5, K, 1.0, (0.0,) * K)
    below = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0))
    survival = torch.stack([torch.tensor(0.5), below, torch.tensor(0.75), torch.tensor(1.0)])
    assert keeps_drafting(survival, plan).tolist() == [True, False, True, True]
    zero = DraftPlan(0.0, K, 1.0, (0.0,) * K)  # tau 0: nothing stops, not even survival 0
    assert keeps_drafting(torch.tensor([0.0, 1e-30]), zero).tolist() == [True, True]
    one = DraftPlan(1.0, K, 1.0, (0.0,) * K)  # tau 1: only a certain draft goes on
    assert keeps_drafting(torch.tensor([1.0, 0.9999999]), one).tolist() == [True, False]


def test_keeps_drafting_with_a_plan_read_from_its_tensor():
    """tau read back from the float32 tensor compares equal to the float32 survival."""
    plan = DraftPlan.from_tensor(_tensor(threshold=0.3), K)
    survival = torch.tensor([0.3], dtype=torch.float32)
    assert keeps_drafting(survival, plan).tolist() == [True]


def test_draft_limits_without_a_plan_are_the_caps():
    caps = [4, 0, 2, 3]
    limits, stops = draft_limits(
        caps, [True, True, False, True], [True, True, True, False], None, [1, 2, 3, 4]
    )
    assert limits == caps and stops == [False] * 4


def test_draft_limits_with_a_plan():
    """Only rows both adaptive and drafting adaptively stop by the plan, capped at min(cap, D);
    the others draft their caps."""
    plan = DraftPlan(0.5, 2, 1.0, (0.0,) * K)
    caps = [4, 1, 0, 4, 4, 3]
    adaptive = [True, True, True, True, False, False]
    drafting = [True, True, True, False, True, False]
    limits, stops = draft_limits(caps, adaptive, drafting, plan, [1, 2, 3, 4, 5, 6])
    assert limits == [2, 1, 0, 4, 4, 3]
    assert stops == [True, True, True, False, False, False]


def test_draft_limits_rejects_ragged_lists():
    with pytest.raises(ValueError):
        draft_limits([4, 4], [True], [True, True], PLAN, [1, 2])
    with pytest.raises(ValueError):
        draft_limits([4, 4], [True, True], [True, True], PLAN, [1])


def test_probe_stride_takes_about_that_many_requests():
    """Stride 1 (every request) up to `rows`, then ceil(batch / rows)."""
    assert [probe_stride(b, 8) for b in (0, 1, 8, 9, 16, 17, 64, 65)] == [1, 1, 1, 2, 2, 3, 8, 9]
    for batch in (9, 40, 64, 100):  # consecutive ids: every stride-th request
        stride = probe_stride(batch, 8)
        taken = sum(probed(1001 + i, stride) for i in range(batch))
        assert batch // stride <= taken <= -(-batch // stride) <= 8


def test_probed_by_seq_id():
    assert [probed(i, 3) for i in range(7)] == [True, False, False, True, False, False, True]
    assert not any(probed(i, 0) for i in range(5))  # stride 0: no probe
    assert all(probed(i, 1) for i in (1, 2, 7, 2**60 + 1))


def test_draft_limits_under_a_probe():
    """A plan of depth 0 with a probe: the requests it takes (id a multiple of the stride) draft
    one position, up to their caps; the others nothing; rows not drafting adaptively their caps.
    At depth 2 the probe changes nothing."""
    plan = DraftPlan(0.5, 0, 1.0, (0.0,) * K, probe_stride=4)
    ids = [8, 9, 12, 13, 16, 20]
    caps = [4, 4, 0, 4, 4, 3]
    drafting = [True, True, True, True, False, True]
    limits, _ = draft_limits(caps, [True] * 6, drafting, plan, ids)
    assert limits == [1, 0, 0, 0, 4, 1]
    deeper = replace(plan, depth=2)
    assert draft_limits(caps, [True] * 6, drafting, deeper, ids)[0] == [2, 2, 0, 2, 4, 2]
    assert plan.row_depth(8) == 1 and plan.row_depth(9) == 0 and deeper.row_depth(8) == 2


def test_drafted_by_plan_follows_the_probe():
    """The replay's rule gives the draft stage's limits under a probe."""
    plan = DraftPlan(0.0, 0, 1.0, (5.0,) * K, probe_stride=2)  # tau 0: nobody stops early
    features = torch.zeros(4, K)
    caps = torch.tensor([4, 4, 4, 0], dtype=torch.int32)
    assert drafted_by_plan(features, caps, plan, [2, 3, 4, 6]).tolist() == [1, 0, 1, 0]
    assert drafted_by_plan(features, caps, replace(plan, depth=3), [2, 3, 4, 6]).tolist() == [
        3,
        3,
        3,
        0,
    ]
    with pytest.raises(ValueError, match="seq_ids has 3 ids for 4 rows"):
        drafted_by_plan(features, caps, plan, [1, 2, 3])
