"""Tests for avspec.av.verifier: stale budget, admission, labelling, release, bad input."""

import copy

import pytest
import torch

from avspec.av.budget import choose_budget
from avspec.av.cost_table import CostTable
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig

K = 3
DRAFT = CostTable([1], [0.0], name="draft")
STEEP = CostTable.linear(fixed_ms=1.0, per_unit_ms=0.5, max_size=32, name="verify")


def _verifier(verify_cost=STEEP, refit_interval=100):
    config = EstimatorConfig(num_positions=K, refit_interval=refit_interval)
    return AdaptiveVerifier(AcceptanceEstimator(config), DRAFT, verify_cost)


def _args(ids, features, ndt=None, adaptive=None, prev=(), release=(), base=None):
    batch = len(ids)
    return dict(
        seq_ids=torch.tensor(ids, dtype=torch.int64),
        features=torch.as_tensor(features, dtype=torch.float32).reshape(batch, K),
        num_draft_tokens=torch.tensor(ndt if ndt is not None else [K] * batch, dtype=torch.int64),
        adaptive=torch.tensor(
            adaptive if adaptive is not None else [True] * batch, dtype=torch.bool
        ),
        prev_num_accepted=torch.tensor(list(prev), dtype=torch.int32),
        release_seq_ids=torch.tensor(list(release), dtype=torch.int64),
        base_tokens=batch if base is None else base,
    )


def _sigmoid(x):
    return torch.sigmoid(torch.tensor(x, dtype=torch.float32))


def test_first_step_scores_new_sequences_as_confident():
    verifier = _verifier(verify_cost=CostTable([0], [1.0]))  # free verification
    features = [[4.0, 0.0, -4.0], [2.0, 2.0, 2.0]]
    decision = verifier.step(**_args([7, 8], features, ndt=[3, 2]))
    conf = torch.sigmoid(0.5 * torch.tensor(features) - 0.2)
    torch.testing.assert_close(decision.confidences[0], conf[0])
    torch.testing.assert_close(decision.confidences[1, :2], conf[1, :2])
    torch.testing.assert_close(decision.survival[0], conf[0].cumprod(0))
    assert decision.survival[1, 2] == 0
    assert decision.num_verify.tolist() == [3, 2] and decision.num_verify.dtype == torch.int32
    assert int(decision.budget) == 5
    assert (int(decision.drafted), int(decision.verified), int(decision.trimmed)) == (5, 5, 0)


def test_budget_comes_from_previous_step_survival():
    verifier = _verifier()
    first = verifier.step(**_args([1, 2], [[3.0, 1.0, -2.0], [0.0, -1.0, -3.0]]))
    # Step 2: very confident features now; the budget must still use step 1's values.
    second = verifier.step(**_args([2, 1], [[9.0] * 3, [9.0] * 3], prev=[1, 0]))
    stale = torch.cat([first.survival[1], first.survival[0]])
    want = choose_budget(stale, 2, 2, DRAFT, STEEP)
    assert int(second.budget) == int(want)
    current = choose_budget(second.survival.flatten(), 2, 2, DRAFT, STEEP)
    assert int(current) != int(want)  # the case distinguishes stale from current
    assert int(second.verified) == min(int(want), 6)


def test_new_sequence_among_old_ones_scores_one():
    verifier = _verifier()
    first = verifier.step(**_args([1], [[-3.0, -3.0, -3.0]]))
    second = verifier.step(**_args([1, 5], [[0.0] * 3, [0.0] * 3], prev=[0]))
    stale = torch.cat([first.survival[0], torch.ones(3)])
    assert int(second.budget) == int(choose_budget(stale, 2, 2, DRAFT, STEEP))


def test_non_adaptive_requests_verify_everything_and_raise_base_tokens():
    verifier = _verifier()
    decision = verifier.step(
        **_args([1, 2, 3], [[-5.0] * 3] * 3, ndt=[3, 2, 3], adaptive=[False, True, False], base=3)
    )
    assert decision.num_verify[0] == 3 and decision.num_verify[2] == 3
    want = choose_budget(torch.ones(2), 3, 3 + 6, DRAFT, STEEP)
    assert int(decision.budget) == int(want)
    assert int(decision.num_verify[1]) == min(int(want), 2)


def test_trimming_keeps_best_prefixes_when_budget_binds():
    verifier = _verifier(verify_cost=CostTable([2, 10], [1.0, 1.8]))
    verifier.step(**_args([1, 2], [[0.0] * 3] * 2))
    # stale survival 0.45, 0.2, 0.09 per row; ratios 2, 2.23, 2.42, 2.39, ...: budget 2.
    # Current row 0 is the confident one, so it takes the whole budget.
    decision = verifier.step(**_args([1, 2], [[8.0, 8.0, 8.0], [-8.0, -8.0, -8.0]], prev=[0, 0]))
    budget = int(decision.budget)
    assert budget == 2
    assert decision.num_verify.tolist() == [min(budget, 3), max(budget - 3, 0)]


def test_counts_decode_steps_and_refits_on_schedule():
    verifier = _verifier(refit_interval=2)
    estimator = verifier.estimator
    verifier.step(**_args([1, 2], [[1.0, 0.5, 0.0], [2.0, 1.0, 0.0]]))
    assert estimator.num_steps == 1 and estimator.num_refits == 0
    verifier.step(**_args([1, 2], [[1.0] * 3] * 2, prev=[1, 3]))
    assert estimator.num_steps == 2 and estimator.num_refits == 1
    assert verifier.num_observed == 1 and verifier.num_steps == 2
    # the labels were observed before the refit, which then cleared the window
    assert int(estimator.stats.n.sum()) == 0 and estimator.slope != 0.5


def test_stored_rows_follow_a_change_of_draft_length():
    verifier = _verifier()
    two = dict(_args([1], [[0.0] * 3]))
    two["features"] = torch.zeros(1, 2)
    two["num_draft_tokens"] = torch.tensor([2])
    first = verifier.step(**two)
    second = verifier.step(**_args([1], [[0.0] * 3], prev=[0]))
    last = first.survival[0, 1]
    stale = torch.stack([first.survival[0, 0], last, last])  # last value carried forward
    assert int(second.budget) == int(choose_budget(stale, 1, 1, DRAFT, STEEP))
    back = verifier.step(**(two | {"prev_num_accepted": torch.tensor([0])}))
    assert int(back.budget) == int(choose_budget(second.survival[0, :2], 1, 1, DRAFT, STEEP))


def test_observe_accumulates_labels():
    verifier = _verifier()
    first = verifier.step(**_args([1], [[1.0, 0.5, 0.0]]))
    assert first.num_verify.tolist() == [3]
    verifier.step(**_args([1], [[1.0] * 3], prev=[1]))
    # accepted 1 of 3: positions 0 (accept) and 1 (first rejection) are labelled
    assert verifier.estimator.stats.n.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("check_values", [True, False])
def test_rows_marked_minus_one_are_not_labelled(check_values):
    """prev_num_accepted -1: the row feeds nothing; stats equal a batch without that row."""
    free = CostTable([0], [1.0])  # every draft verified, whatever the batch
    features = [[1.0, 0.5, 0.0], [2.0, -1.0, 0.3], [-0.5, 0.2, 1.5]]
    with_row, without = _verifier(verify_cost=free), _verifier(verify_cost=free)
    with_row.check_values = without.check_values = check_values
    with_row.step(**_args([1, 2, 3], features))
    without.step(**_args([1, 3], [features[0], features[2]]))
    with_row.step(**_args([1, 2, 3], [[0.0] * 3] * 3, prev=[1, -1, 3]))
    without.step(**_args([1, 3], [[0.0] * 3] * 2, prev=[1, 3]))
    assert with_row.num_observed == without.num_observed == 1
    for key, value in without.estimator.stats.state_dict().items():
        torch.testing.assert_close(with_row.estimator.stats.state_dict()[key], value)
    torch.testing.assert_close(with_row.estimator._bins, without.estimator._bins)


def test_length_mismatch_drops_the_record():
    verifier = _verifier()
    verifier.step(**_args([1, 2], [[1.0] * 3] * 2))
    verifier.step(**_args([1], [[1.0] * 3], prev=[1]))
    assert verifier.num_dropped_records == 1 and verifier.num_observed == 0
    assert verifier.estimator.stats.n.sum() == 0


def test_released_sequence_counts_as_new():
    verifier = _verifier()
    verifier.step(**_args([1], [[-6.0] * 3]))
    again = verifier.step(**_args([1], [[0.0] * 3], prev=[0], release=[1]))
    assert int(again.budget) == int(choose_budget(torch.ones(3), 1, 1, DRAFT, STEEP))


def test_empty_batch_releases_and_labels():
    verifier = _verifier()
    verifier.step(**_args([1], [[1.0] * 3]))
    empty = dict(_args([], torch.zeros(0, K), prev=[2], release=[1]))
    decision = verifier.step(**empty)
    assert decision.num_verify.shape == (0,) and decision.confidences.shape == (0, K)
    assert verifier.num_observed == 1 and verifier.estimator.num_steps == 1
    assert 1 not in verifier._stale


def test_padding_features_may_be_nan():
    verifier = _verifier()
    decision = verifier.step(**_args([1], [[1.0, float("nan"), float("inf")]], ndt=[1]))
    assert decision.num_verify.tolist() == [1]
    assert torch.isfinite(decision.survival).all()


def _state(verifier):
    return (
        copy.deepcopy(verifier.estimator.state_dict()),
        verifier._pending,
        dict(verifier._stale),
        verifier.num_steps,
        verifier.num_dropped_records,
    )


BAD_CASES = [
    ({"features": torch.zeros(2, 0)}, "K = 0"),
    ({"features": torch.zeros(2, 4)}, "4 positions, estimator has 3"),
    ({"features": torch.zeros(3, K)}, "seq_ids must have shape"),
    ({"features": torch.zeros(2, K, dtype=torch.int64)}, "floating point"),
    ({"seq_ids": torch.tensor([1, 1])}, "distinct"),
    ({"seq_ids": torch.tensor([1.0, 2.0])}, "seq_ids must be an integer"),
    ({"num_draft_tokens": torch.tensor([4, 1])}, "num_draft_tokens must lie"),
    ({"num_draft_tokens": torch.tensor([-1, 1])}, "num_draft_tokens must lie"),
    ({"num_draft_tokens": torch.tensor([1])}, "num_draft_tokens must have shape"),
    ({"adaptive": torch.tensor([1, 0])}, "bool"),
    ({"features": torch.tensor([[float("nan"), 0, 0], [0, 0, 0]])}, "features at draft"),
    ({"features": torch.tensor([[float("-inf"), 0, 0], [0, 0, 0]])}, "-inf"),
    ({"prev_num_accepted": torch.tensor([4, 0])}, "prev_num_accepted must lie"),
    ({"prev_num_accepted": torch.tensor([-100, 0])}, "prev_num_accepted must lie"),
    ({"prev_num_accepted": torch.tensor([[1, 0]])}, "prev_num_accepted must have shape"),
    ({"release_seq_ids": torch.tensor([0.5])}, "release_seq_ids must be an integer"),
    ({"base_tokens": -1}, "base_tokens"),
    ({"base_tokens": 1.5}, "base_tokens"),
    ({"adaptive": torch.tensor([True, True], device="meta")}, "share one device"),
    ({"prev_num_accepted": torch.tensor([1, 1], device="meta")}, "share one device"),
    (
        {
            "features": torch.zeros(2, K, device="meta"),
            "num_draft_tokens": torch.tensor([3, 3], device="meta"),
            "adaptive": torch.tensor([True, True], device="meta"),
            "prev_num_accepted": torch.tensor([], dtype=torch.int32),
        },
        "estimator on cpu",
    ),
]


@pytest.mark.parametrize(("change", "match"), BAD_CASES)
def test_bad_input_raises_and_changes_nothing(change, match):
    verifier = _verifier()
    verifier.step(**_args([1, 2], [[1.0] * 3] * 2))
    before = _state(verifier)
    args = _args([1, 2], [[0.5] * 3] * 2, prev=[1, 1]) | change
    with pytest.raises(ValueError, match=match):
        verifier.step(**args)
    after = _state(verifier)
    assert after[1] is before[1] and after[2].keys() == before[2].keys()
    assert after[3:] == before[3:]
    for key in ("slope", "intercepts", "num_steps"):
        assert torch.equal(torch.as_tensor(after[0][key]), torch.as_tensor(before[0][key]))
    for key, value in before[0]["stats"].items():
        assert torch.equal(after[0]["stats"][key], value)
