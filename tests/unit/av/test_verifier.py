"""Tests for avspec.av.verifier: stale budget, admission, labelling, release, drafting plan,
adaptive drafting inputs (num_drafted, stale extrapolation), bad input."""

import copy
from dataclasses import replace

import pytest
import torch

from avspec.av.budget import StepPlan, plan_step
from avspec.av.cost_refresh import CostRefresh
from avspec.av.cost_table import CostTable
from avspec.av.drafting import DraftPlan
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.step_cost import StepCost
from avspec.av.verifier import STALE_WEIGHT, AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.contract import VerifierInputs

K = 3
# A zero draft-pass table: with no row drafting adaptively the budget is the verify-only one.
DRAFT = CostTable([1], [0.0], name="draft_pass")
STEEP = CostTable.linear(fixed_ms=1.0, per_unit_ms=0.5, max_size=32, name="verify")
COST = StepCost(DRAFT, STEEP)


def _verifier(verify_cost=STEEP, refit_interval=100, num_positions=K, cost=None, **kwargs):
    config = EstimatorConfig(num_positions=num_positions, refit_interval=refit_interval)
    cost = StepCost(DRAFT, verify_cost) if cost is None else cost
    return AdaptiveVerifier(AcceptanceEstimator(config), cost, **kwargs)


def _args(
    ids, features, ndt=None, adaptive=None, prev=(), release=(), base=None, drafted=None,
    drafting=None, k=K,
):  # fmt: skip
    batch = len(ids)
    args = dict(
        seq_ids=torch.tensor(ids, dtype=torch.int64),
        features=torch.as_tensor(features, dtype=torch.float32).reshape(batch, k),
        num_draft_tokens=torch.tensor(ndt if ndt is not None else [k] * batch, dtype=torch.int64),
        adaptive=torch.tensor(
            adaptive if adaptive is not None else [True] * batch, dtype=torch.bool
        ),
        prev_num_accepted=torch.tensor(list(prev), dtype=torch.int32),
        release_seq_ids=torch.tensor(list(release), dtype=torch.int64),
        base_tokens=batch if base is None else base,
    )
    if drafted is not None:
        args["num_drafted"] = torch.tensor(drafted, dtype=torch.int64)
    if drafting is not None:
        args["adaptive_drafting"] = torch.tensor(drafting, dtype=torch.bool)
    return VerifierInputs(**args)


def _plan(stale, ndt, base, adaptive=None, drafting=None, cost=COST, **kw) -> StepPlan:
    """plan_step on stale rows [batch, position] (host lists or a tensor)."""
    stale = torch.as_tensor(stale, dtype=torch.float32)
    batch = stale.shape[0]
    return plan_step(
        stale,
        torch.tensor(ndt, dtype=torch.int64),
        torch.tensor(adaptive if adaptive is not None else [True] * batch, dtype=torch.bool),
        torch.tensor(drafting if drafting is not None else [False] * batch, dtype=torch.bool),
        base,
        cost,
        **kw,
    )


def _budget(stale, ndt, base, **kwargs) -> int:
    return int(_plan(stale, ndt, base, **kwargs).budget)


def _sigmoid(x):
    return torch.sigmoid(torch.tensor(x, dtype=torch.float32))


def test_first_step_scores_new_sequences_as_confident():
    verifier = _verifier(verify_cost=CostTable([0], [1.0]))  # free verification
    features = [[4.0, 0.0, -4.0], [2.0, 2.0, 2.0]]
    decision = verifier.step(_args([7, 8], features, ndt=[3, 2]))
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
    first = verifier.step(_args([1, 2], [[3.0, 1.0, -2.0], [0.0, -1.0, -3.0]]))
    # Step 2: very confident features now; the budget must still use step 1's values.
    second = verifier.step(_args([2, 1], [[9.0] * 3, [9.0] * 3], prev=[1, 0]))
    stale = torch.stack([first.survival[1], first.survival[0]])  # rows follow the new order
    want = _budget(stale, [3, 3], 2)
    assert int(second.budget) == want
    current = _budget(second.survival, [3, 3], 2)
    assert current != want  # the case distinguishes stale from current
    assert int(second.verified) == min(want, 6)


def test_new_sequence_among_old_ones_scores_the_previous_batchs_mean_row():
    """Sequence 5 joins: it scores the mean of the previous batch's rows (1 and 2), not 1.0 (a
    sure draft) nor sequence 1's row; the case tells the three apart."""
    verifier = _verifier()
    first = verifier.step(_args([1, 2], [[-3.0, -3.0, -3.0], [6.0, 6.0, 6.0]]))
    second = verifier.step(_args([1, 5], [[0.0] * 3, [0.0] * 3], prev=[0, 0]))
    mean = first.survival.mean(0)
    stale = torch.stack([first.survival[0], mean])
    assert int(second.budget) == _budget(stale, [3, 3], 2)
    assert int(second.budget) != _budget(torch.stack([first.survival[0], torch.ones(3)]), [3, 3], 2)
    assert int(second.budget) != _budget(torch.stack([first.survival[0]] * 2), [3, 3], 2)


def test_non_adaptive_requests_verify_everything_and_raise_base_tokens():
    verifier = _verifier()
    decision = verifier.step(
        _args([1, 2, 3], [[-5.0] * 3] * 3, ndt=[3, 2, 3], adaptive=[False, True, False], base=3)
    )
    assert decision.num_verify[0] == 3 and decision.num_verify[2] == 3
    # New sequences: stale 1.0 everywhere; only row 1's two drafts compete, T = 3 + 6.
    want = _budget(torch.ones(3, 3), [3, 2, 3], 3, adaptive=[False, True, False])
    assert int(decision.budget) == want
    assert want == _budget(torch.ones(3, 3), [0, 2, 0], 3 + 6)  # their drafts count in T
    assert int(decision.num_verify[1]) == min(want, 2)


def test_trimming_keeps_best_prefixes_when_budget_binds():
    verifier = _verifier(verify_cost=CostTable([2, 10], [1.0, 1.8]))
    verifier.step(_args([1, 2], [[0.0] * 3] * 2))
    # stale survival 0.45, 0.2, 0.09 per row; ratios 2, 2.23, 2.42, 2.39, ...: budget 2.
    # Current row 0 is the confident one, so it takes the whole budget.
    decision = verifier.step(_args([1, 2], [[8.0, 8.0, 8.0], [-8.0, -8.0, -8.0]], prev=[0, 0]))
    budget = int(decision.budget)
    assert budget == 2
    assert decision.num_verify.tolist() == [min(budget, 3), max(budget - 3, 0)]


def test_counts_decode_steps_and_refits_on_schedule():
    verifier = _verifier(refit_interval=2)
    estimator = verifier.estimator
    verifier.step(_args([1, 2], [[1.0, 0.5, 0.0], [2.0, 1.0, 0.0]]))
    assert estimator.num_steps == 1 and estimator.num_refits == 0
    verifier.step(_args([1, 2], [[1.0] * 3] * 2, prev=[1, 3]))
    assert estimator.num_steps == 2 and estimator.num_refits == 1
    assert verifier.num_observed == 1 and verifier.num_steps == 2
    # the labels were observed before the refit, which then cleared the window
    assert int(estimator.stats.n.sum()) == 0 and estimator.slope != 0.5


def test_stored_rows_follow_a_change_of_draft_length():
    verifier = _verifier()
    two = replace(
        _args([1], [[0.0] * 3]), features=torch.zeros(1, 2), num_draft_tokens=torch.tensor([2])
    )
    first = verifier.step(two)
    second = verifier.step(_args([1], [[0.0] * 3], prev=[0]))
    last = first.survival[0, 1]
    stale = torch.stack([first.survival[0, 0], last, last])  # last value carried forward
    assert int(second.budget) == _budget(stale[None], [3], 1)
    back = verifier.step(replace(two, prev_num_accepted=torch.tensor([0])))
    assert int(back.budget) == _budget(second.survival[:, :2], [2], 1)


def test_observe_accumulates_labels():
    verifier = _verifier()
    first = verifier.step(_args([1], [[1.0, 0.5, 0.0]]))
    assert first.num_verify.tolist() == [3]
    verifier.step(_args([1], [[1.0] * 3], prev=[1]))
    # accepted 1 of 3: positions 0 (accept) and 1 (first rejection) are labelled
    assert verifier.estimator.stats.n.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("check_values", [True, False])
def test_rows_marked_minus_one_are_not_labelled(check_values):
    """prev_num_accepted -1: the row feeds nothing; stats equal a batch without that row."""
    free = CostTable([0], [1.0])  # every draft verified, whatever the batch
    features = [[1.0, 0.5, 0.0], [2.0, -1.0, 0.3], [-0.5, 0.2, 1.5]]
    with_row, without = _verifier(verify_cost=free), _verifier(verify_cost=free)
    with_row.check_values = without.check_values = check_values
    with_row.step(_args([1, 2, 3], features))
    without.step(_args([1, 3], [features[0], features[2]]))
    with_row.step(_args([1, 2, 3], [[0.0] * 3] * 3, prev=[1, -1, 3]))
    without.step(_args([1, 3], [[0.0] * 3] * 2, prev=[1, 3]))
    assert with_row.num_observed == without.num_observed == 1
    for key, value in without.estimator.stats.state_dict().items():
        torch.testing.assert_close(with_row.estimator.stats.state_dict()[key], value)
    torch.testing.assert_close(with_row.estimator._bins, without.estimator._bins)


def test_length_mismatch_drops_the_record():
    verifier = _verifier()
    verifier.step(_args([1, 2], [[1.0] * 3] * 2))
    verifier.step(_args([1], [[1.0] * 3], prev=[1]))
    assert verifier.num_dropped_records == 1 and verifier.num_observed == 0
    assert verifier.estimator.stats.n.sum() == 0


def test_released_sequence_counts_as_new():
    """A released id that comes back is new: it scores the previous batch's mean row."""
    verifier = _verifier()
    verifier.step(_args([1, 2], [[-6.0] * 3, [6.0] * 3]))
    again = verifier.step(_args([1], [[0.0] * 3], prev=[0, 0], release=[1]))
    c = torch.sigmoid(0.5 * torch.tensor([-6.0, 6.0]) - 0.2)
    rows = torch.stack([c[0] ** torch.arange(1, 4), c[1] ** torch.arange(1, 4)])
    assert int(again.budget) == _budget(rows.mean(0)[None], [3], 1)


def test_empty_batch_releases_and_labels():
    verifier = _verifier()
    verifier.step(_args([1], [[1.0] * 3]))
    decision = verifier.step(_args([], torch.zeros(0, K), prev=[2], release=[1]))
    assert decision.num_verify.shape == (0,) and decision.confidences.shape == (0, K)
    assert verifier.num_observed == 1 and verifier.estimator.num_steps == 1
    assert 1 not in verifier._stale


def test_padding_features_may_be_nan():
    verifier = _verifier()
    decision = verifier.step(_args([1], [[1.0, float("nan"), float("inf")]], ndt=[1]))
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
    ({"num_drafted": torch.tensor([4, 1])}, "num_drafted must lie"),
    (
        {"num_draft_tokens": torch.tensor([2, 3]), "num_drafted": torch.tensor([3, 3])},
        "num_drafted must lie",
    ),
    ({"num_drafted": torch.tensor([-1, 1])}, "num_drafted must lie"),
    ({"num_drafted": torch.tensor([1])}, "num_drafted must have shape"),
    ({"num_drafted": torch.tensor([1.0, 1.0])}, "num_drafted must be an integer"),
    ({"num_drafted": torch.tensor([1, 1], device="meta")}, "share one device"),
    ({"adaptive_drafting": torch.tensor([1, 0])}, "adaptive_drafting must be a bool"),
    ({"adaptive_drafting": torch.tensor([True])}, "adaptive_drafting must have shape"),
    (
        {
            "features": torch.tensor([[0.0, float("nan"), 0], [0, 0, 0]]),
            "num_drafted": torch.tensor([2, 3]),
        },
        "features at draft",
    ),  # fmt: skip
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
    verifier = _verifier(check_values=True)  # the stages leave it off: checked at their door
    verifier.step(_args([1, 2], [[1.0] * 3] * 2))
    before = _state(verifier)
    args = replace(_args([1, 2], [[0.5] * 3] * 2, prev=[1, 1]), **change)
    with pytest.raises(ValueError, match=match):
        verifier.step(args)
    after = _state(verifier)
    assert after[1] is before[1] and after[2].keys() == before[2].keys()
    assert after[3:] == before[3:]
    for key in ("slope", "intercepts", "num_steps"):
        assert torch.equal(torch.as_tensor(after[0][key]), torch.as_tensor(before[0][key]))
    for key, value in before[0]["stats"].items():
        assert torch.equal(after[0]["stats"][key], value)


# --- adaptive drafting: the plan, num_drafted, stale extrapolation -------------------------------


def test_draft_plan_is_threshold_depth_slope_intercepts_of_this_steps_rows():
    """[threshold, depth, slope, probe stride, intercepts[:K]] (float32): plan_step on this
    step's survival rows (extrapolated past the cap of row 1), with the estimator's coefficients
    as they stand."""
    cost = StepCost.linear(0.4, 0.1, 1.0, 0.05, 8, 64)
    verifier = _verifier(cost=cost, num_positions=4)
    verifier.estimator.slope.fill_(0.8)
    verifier.estimator.intercepts.copy_(torch.tensor([0.5, 0.1, -0.3, -0.6]))
    features = [[3.0, 2.0, 1.5], [0.5, -1.0, 9.0]]  # row 1's position 2 is past its cap
    decision = verifier.step(_args([1, 2], features, ndt=[3, 2], drafting=[True, False]))
    plan = decision.draft_plan
    assert plan.shape == (4 + K,) and plan.dtype == torch.float32
    conf = torch.sigmoid(0.8 * torch.tensor(features) + torch.tensor([0.5, 0.1, -0.3]))
    # row 1 drafted 2: its last confidence c_1 is repeated past the cap
    rows = torch.stack([conf[0], torch.stack([conf[1, 0], conf[1, 1], conf[1, 1]])]).cumprod(1)
    want = _plan(rows, [3, 2], 2, drafting=[True, False], cost=cost, for_next_step=True)
    torch.testing.assert_close(plan[0], want.threshold.float())
    assert plan[1] == float(want.depth) and 1 <= int(want.depth) <= K
    assert plan[2] == torch.tensor(0.8)
    assert plan[3] == 0.0  # the first step is no probe (every 8th is)
    assert plan[4:].tolist() == torch.tensor([0.5, 0.1, -0.3]).tolist()
    parsed = DraftPlan.from_tensor(plan, K)
    assert parsed is not None and parsed.depth == int(want.depth)
    assert parsed.intercepts == tuple(torch.tensor([0.5, 0.1, -0.3]).tolist())
    assert 0.0 < parsed.threshold < 1.0


def test_draft_plan_follows_a_refit():
    """The plan carries the coefficients after this step's refit, the ones the next step's
    draft must use (they are the estimator's at the end of the step)."""
    verifier = _verifier(refit_interval=2)
    verifier.step(_args([1, 2], [[1.0, 0.5, 0.0], [2.0, 1.0, 0.0]]))
    decision = verifier.step(_args([1, 2], [[1.0] * 3] * 2, prev=[1, 3]))
    assert verifier.estimator.num_refits == 1
    assert decision.draft_plan[2] == verifier.estimator.slope
    assert torch.equal(decision.draft_plan[4:], verifier.estimator.intercepts[:K])


@pytest.mark.parametrize("interval", [0, 4])
def test_a_stopped_plan_probes_one_position_every_interval(interval):
    """Draft passes that never pay plan depth 0; every `probe_interval` steps the plan carries a
    probe (stride 1 for a batch this small: every request drafts one position), so the stop is
    re-examined on fresh scores (0: never)."""
    dear = StepCost(CostTable([1], [1000.0], name="draft_pass"), STEEP)
    verifier = _verifier(cost=dear, probe_interval=interval)
    plans = []
    for step in range(12):
        prev = [1, 1] if step else []
        decision = verifier.step(_args([1, 2], [[-2.0] * K] * 2, prev=prev, drafting=[True] * 2))
        plans.append(DraftPlan.from_tensor(decision.draft_plan, K))
    probes = [n for n in range(1, 13) if interval and n % interval == 0]
    assert [p.depth for p in plans] == [0] * 12
    assert [p.probe_stride for p in plans] == [1 if n in probes else 0 for n in range(1, 13)]
    assert [[p.row_depth(i) for i in (1, 2)] for p in plans] == [
        [1, 1] if n in probes else [0, 0] for n in range(1, 13)
    ]


@pytest.mark.parametrize(("batch", "stride"), [(8, 1), (9, 2), (20, 3), (64, 8)])
def test_a_probe_of_a_large_batch_takes_about_probe_rows_requests(batch, stride):
    """The probe's stride is ceil(batch / probe_rows) (8): a probe takes the requests whose seq
    id is a multiple of it, at most 8 of a batch."""
    dear = StepCost(CostTable([1], [1000.0], name="draft_pass"), STEEP)
    verifier = _verifier(cost=dear, probe_interval=1)
    ids = list(range(100, 100 + batch))
    decision = verifier.step(_args(ids, [[-2.0] * K] * batch, drafting=[True] * batch))
    plan = DraftPlan.from_tensor(decision.draft_plan, K)
    assert plan is not None and plan.depth == 0 and plan.probe_stride == stride
    assert 1 <= sum(plan.row_depth(i) for i in ids) <= 8
    with pytest.raises(ValueError, match="probe_rows must be >= 1"):
        _verifier(probe_rows=0)


def test_no_plan_when_drafting_is_off():
    on, off = _verifier(), _verifier(drafting=False)
    for verifier in (on, off):
        verifier.step(_args([1, 2], [[1.0, 0.0, -1.0]] * 2, drafting=[True, True]))
    args = _args([1, 2], [[0.5] * 3] * 2, prev=[1, 1], drafting=[True, True])
    with_plan, without = on.step(args), off.step(args)
    assert with_plan.draft_plan.shape == (4 + K,)
    assert without.draft_plan.shape == (0,)
    assert torch.equal(with_plan.num_verify, without.num_verify)
    assert torch.equal(with_plan.budget, without.budget)


def test_candidates_are_the_drafted_positions():
    """Features past num_drafted are ignored, NaN and inf included: the decision equals that of
    zero features there, nothing past num_drafted is verified, and the next step's labels only
    cover verified positions."""
    free = CostTable([0], [1.0])  # every candidate verified
    nan, inf = float("nan"), float("inf")
    drafted = dict(ndt=[3, 3], drafted=[1, 2], drafting=[True, True])
    verifier = _verifier(verify_cost=free)
    decision = verifier.step(_args([1, 2], [[1.0, nan, inf], [0.5, -0.5, nan]], **drafted))
    clean = _verifier(verify_cost=free).step(
        _args([1, 2], [[1.0, 0.0, 0.0], [0.5, -0.5, 0.0]], **drafted)
    )
    assert decision.num_verify.tolist() == [1, 2]
    assert (int(decision.drafted), int(decision.verified), int(decision.trimmed)) == (3, 3, 0)
    torch.testing.assert_close(decision.survival, clean.survival)
    assert decision.survival[0, 1:].tolist() == [0.0, 0.0] and decision.survival[1, 2] == 0
    assert torch.equal(decision.draft_plan, clean.draft_plan)
    verifier.step(_args([1, 2], [[0.0] * 3] * 2, prev=[0, 1]))
    # row 1: position 0 rejected; row 2: position 0 accepted, position 1 rejected
    assert verifier.estimator.stats.n.tolist() == [2.0, 1.0, 0.0]
    assert torch.isfinite(verifier.estimator.stats.sums).all()


def test_num_drafted_defaults_to_the_caps():
    verifier, explicit = _verifier(), _verifier()
    features = [[1.0, 0.0, -1.0], [0.5, 0.5, 0.5]]
    a = verifier.step(_args([1, 2], features, ndt=[3, 2]))
    b = explicit.step(_args([1, 2], features, ndt=[3, 2], drafted=[3, 2], drafting=[False] * 2))
    for name in ("num_verify", "survival", "budget", "draft_plan", "stopped_early"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert int(a.stopped_early) == 0 and float(a.draft_ms_saved) == 0.0


def test_num_drafted_above_the_cap_is_rejected():
    verifier = _verifier(check_values=True)
    with pytest.raises(ValueError, match="num_drafted must lie in 0..num_draft_tokens"):
        verifier.step(_args([1], [[0.0] * 3], ndt=[2], drafted=[3]))
    assert verifier.num_steps == 0 and verifier._pending is None


def test_stopped_early_draft_passes_and_draft_ms_saved():
    """caps [3, 3, 2], drafted [1, 3, 2]: 2 drafts not drafted, 3 passes; passes 1 and 2 would
    have run 3 and 2 rows and ran 2 and 1 (draft pass 0.5 + 0.25 per row)."""
    cost = StepCost.linear(0.5, 0.25, 1.0, 0.1, 8, 64)
    verifier = _verifier(cost=cost)
    common = dict(ndt=[3, 3, 2], drafting=[True] * 3)
    d = verifier.step(_args([1, 2, 3], [[0.0] * 3] * 3, drafted=[1, 3, 2], **common))
    assert d.stopped_early.dtype == torch.int64 and d.draft_passes.dtype == torch.int64
    assert d.draft_ms_saved.dtype == torch.float64 and d.draft_ms_saved.shape == ()
    assert (int(d.stopped_early), int(d.draft_passes)) == (2, 3)
    assert int(d.drafted) == 6
    assert float(d.draft_ms_saved) == pytest.approx((1.25 - 1.0) + (1.0 - 0.75))
    # Every row stopped after its first draft: passes 1 and 2 did not run at all.
    d = verifier.step(_args([1, 2, 3], [[0.0] * 3] * 3, drafted=[1, 1, 1], prev=[0] * 3,
                              **common))  # fmt: skip
    assert (int(d.stopped_early), int(d.draft_passes)) == (5, 1)
    assert float(d.draft_ms_saved) == pytest.approx(1.25 + 1.0)
    # Nothing stopped early.
    d = verifier.step(_args([1, 2, 3], [[0.0] * 3] * 3, prev=[0] * 3, **common))
    assert (int(d.stopped_early), int(d.draft_passes), float(d.draft_ms_saved)) == (0, 3, 0.0)


def test_stale_rows_are_extrapolated_past_the_last_drafted_position():
    """A row that drafted 2 of 4 scores s1, s2, s2 c2, s2 c2^2 in the next step's budget (c2 the
    confidence of its last draft), not the carried s2 nor 0; its plan uses the same rows."""
    k = 4
    verify = CostTable.linear(1.0, 0.05, 64, name="verify")
    verifier = _verifier(verify_cost=verify, num_positions=k)
    nan = float("nan")
    first = verifier.step(
        _args([1], [[2.0, 0.0, nan, nan]], ndt=[k], drafted=[2], drafting=[True], k=k)
    )
    c = torch.sigmoid(0.5 * torch.tensor([2.0, 0.0]) - 0.2)
    s1, s2 = c[0], c[0] * c[1]
    extrapolated = torch.stack([s1, s2, s2 * c[1], s2 * c[1] ** 2])[None]
    torch.testing.assert_close(first.survival[0, :2], torch.stack([s1, s2]))
    cost = StepCost(DRAFT, verify)
    plan = _plan(extrapolated, [k], 1, drafting=[True], cost=cost)
    torch.testing.assert_close(first.draft_plan[0], plan.threshold.float())
    assert first.draft_plan[1] == float(plan.depth)

    second = verifier.step(_args([1], [[0.0] * k], ndt=[k], prev=[0], k=k))
    want = _budget(extrapolated, [k], 1, cost=cost)
    assert int(second.budget) == want == 3
    carried = torch.stack([s1, s2, s2, s2])[None]
    zeros = torch.stack([s1, s2, torch.tensor(0.0), torch.tensor(0.0)])[None]
    assert _budget(carried, [k], 1, cost=cost) == 4  # the case tells the three apart
    assert _budget(zeros, [k], 1, cost=cost) == 2


def test_a_row_that_drafted_nothing_scores_one_next_step():
    verifier = _verifier()
    verifier.step(_args([1, 2], [[-3.0] * 3] * 2, ndt=[0, 3], drafting=[True, True]))
    second = verifier.step(_args([1, 2], [[0.0] * 3] * 2, prev=[0, 0]))
    c = torch.sigmoid(torch.tensor(0.5 * -3.0 - 0.2))
    row2 = torch.stack([c, c * c, c * c * c])
    assert int(second.budget) == _budget(torch.stack([torch.ones(3), row2]), [3, 3], 2)
    assert int(second.budget) != _budget(torch.stack([row2, row2]), [3, 3], 2)


def test_a_row_that_drafts_nothing_keeps_its_last_survival_row():
    """Step 1: row 1 drafts 3 at low confidence; step 2 (D = 0: it drafts nothing) must not
    reset it to 1.0, or the next plan would see a sure draft and draw x_0 again; step 3's
    budget still ranks it by step 1's values. Without the carry it would score 1.0."""
    verifier = _verifier()
    verifier.step(_args([1], [[-3.0] * 3], ndt=[3], drafting=[True]))
    c = torch.sigmoid(torch.tensor(0.5 * -3.0 - 0.2))
    row = torch.stack([c, c * c, c * c * c])[None]
    verifier.step(_args([1], [[0.0] * 3], ndt=[3], drafted=[0], drafting=[True], prev=[0]))
    third = verifier.step(_args([1], [[0.0] * 3], ndt=[3], drafting=[True], prev=[-1]))
    assert int(third.budget) == _budget(row, [3], 1)
    assert _budget(row, [3], 1) != _budget(torch.ones(1, 3), [3], 1)  # the case tells them apart


def test_a_requests_stale_row_averages_its_fresh_rows():
    """Step 1: request 1 drafts 3 at high confidence; step 2 at low confidence, and request 2
    joins. Step 3's budget ranks request 1 by the average (STALE_WEIGHT on step 1's row, the rest
    on step 2's) and request 2 by its own first row. Taken as it came (the rule before), one low
    draft would rank request 1 as low as request 2."""
    verifier = _verifier()
    verifier.step(_args([1], [[3.0] * 3], ndt=[3], drafting=[True]))
    verifier.step(_args([1, 2], [[-3.0] * 3] * 2, ndt=[3, 3], drafting=[True] * 2, prev=[3]))
    third = verifier.step(_args([1, 2], [[0.0] * 3] * 2, ndt=[3, 3], drafting=[True] * 2,
                                prev=[0, 0]))  # fmt: skip

    def row(feature: float) -> torch.Tensor:
        c = torch.sigmoid(torch.tensor(0.5 * feature - 0.2))
        return torch.stack([c, c * c, c * c * c])

    averaged = STALE_WEIGHT * row(3.0) + (1 - STALE_WEIGHT) * row(-3.0)
    want = _budget(torch.stack([averaged, row(-3.0)]), [3, 3], 2)
    assert int(third.budget) == want
    assert want != _budget(torch.stack([row(-3.0), row(-3.0)]), [3, 3], 2)  # tells them apart


def test_the_step_after_a_deferred_pending_pass_is_not_observed():
    """A step whose pass 0 took 0 ms ran no draft (its inputs wait for the next pass), so the
    next pass 0 runs more tokens than its step's base: the cost refresh skips that step and
    takes the ones around it (the rule is the cost refresh's). A refresh that observes every step
    (the variant) is caught."""

    class ObservesAll(CostRefresh):
        _deferred = property(lambda self: False, lambda self, value: None)

    def observed(refresh_class) -> int:
        cost = StepCost(CostTable([1, 8], [1.0, 2.0], name="draft_pass"), STEEP)
        config = EstimatorConfig(num_positions=K, refit_interval=100)
        verifier = AdaptiveVerifier(AcceptanceEstimator(config), cost, refresh=refresh_class(cost))
        verifier.step(_args([1, 2], [[0.0] * K] * 2, drafted=[1, 1]))
        # pass ms per position, target ms, wall ms; the second step deferred, the third caught up
        for timing in ([1.0, 0, 0, 2, 4], [0, 0, 0, 2, 3], [9.0, 0, 0, 2, 12], [1.0, 0, 0, 2, 4]):
            inputs = _args([1, 2], [[0.0] * K] * 2, prev=[0, 0], drafted=[1, 1])
            verifier.step(replace(inputs, prev_timing_ms=torch.tensor(timing, dtype=torch.float32)))
        return verifier.refresh.steps

    assert observed(CostRefresh) == 3
    assert observed(ObservesAll) == 4
