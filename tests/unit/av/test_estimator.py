"""Tests for avspec.av.estimator.AcceptanceEstimator: labelling, refits, recovery, bad input."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from avspec.av.estimator import AcceptanceEstimator, verification_labels
from avspec.config import EstimatorConfig

TRUE_SLOPE = 0.6
TRUE_INTERCEPTS = [1.4, 0.9, 0.4, -0.1]


def _simulate(
    est: AcceptanceEstimator,
    steps: int,
    intercepts: list[float],
    gen: torch.Generator,
    batch: int = 256,
) -> None:
    """Draft features ~ N(0, 2^2), accept sequentially with the true model, stop at the first
    rejection (num_verified = K), and feed the estimator step by step."""
    k = len(intercepts)
    b = torch.tensor(intercepts)
    for _ in range(steps):
        f = torch.randn(batch, k, generator=gen) * 2
        p_true = torch.sigmoid(TRUE_SLOPE * f + b)
        accept = torch.rand(batch, k, generator=gen) < p_true
        num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
        num_verified = torch.full((batch,), k, dtype=torch.int32)
        est.observe(f, est.predict(f), num_verified, num_accepted)
        est.step()


def _assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_state_equal(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_labels_from_verification() -> None:
    verified = torch.tensor([4, 4, 2, 0, 3])
    accepted = torch.tensor([4, 1, 2, 0, 0])
    labels, mask = verification_labels(verified, accepted, 4)
    assert mask.int().tolist() == [
        [1, 1, 1, 1],
        [1, 1, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 0, 0],
        [1, 0, 0, 0],
    ]
    assert (labels * mask).int().tolist() == [
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 0, 0],
    ]


def test_minus_one_leaves_the_row_unlabelled() -> None:
    labels, mask = verification_labels(torch.tensor([3, 3, 0]), torch.tensor([-1, 1, -1]), 3)
    assert mask.int().tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert labels.int().tolist() == [[0, 0, 0], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("check_values", [True, False])
def test_rows_marked_minus_one_change_nothing(check_values: bool) -> None:
    """Statistics and calibration bins equal those of the batch without the -1 rows."""
    cfg = EstimatorConfig(num_positions=3)
    marked, subset = AcceptanceEstimator(cfg), AcceptanceEstimator(cfg)
    gen = torch.Generator().manual_seed(7)
    f = torch.randn(32, 3, generator=gen)
    verified = torch.randint(0, 4, (32,), generator=gen)
    accepted = torch.minimum(torch.randint(0, 4, (32,), generator=gen), verified)
    skip = torch.rand(32, generator=gen) < 0.4
    marked.observe(
        f, marked.predict(f), verified, torch.where(skip, -1, accepted), check_values=check_values
    )
    keep = ~skip
    subset.observe(f[keep], subset.predict(f[keep]), verified[keep], accepted[keep])
    for key, value in subset.state_dict()["stats"].items():
        torch.testing.assert_close(marked.state_dict()["stats"][key], value)
    torch.testing.assert_close(marked.state_dict()["bins"], subset.state_dict()["bins"])
    assert int(marked.stats.n.sum()) > 0


def test_predict_uses_slope_and_per_position_intercepts() -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=3))
    est.intercepts.copy_(torch.tensor([1.0, 0.0, -1.0]))
    f = torch.tensor([[2.0, 2.0], [0.0, -4.0]])
    want = torch.sigmoid(torch.tensor([[0.5 * 2 + 1.0, 0.5 * 2], [1.0, -2.0]]))
    torch.testing.assert_close(est.predict(f), want)


def test_parameter_recovery() -> None:
    """K=4, w=0.6, b=[1.4, 0.9, 0.4, -0.1]; 300 steps x 256 requests, refit every 20 steps
    (15 refits, ~5k requests per window). Slope within 0.05, intercepts within 0.15. Seeded."""
    cfg = EstimatorConfig(num_positions=4, refit_interval=20)
    est = AcceptanceEstimator(cfg)
    _simulate(est, 300, TRUE_INTERCEPTS, torch.Generator().manual_seed(0))
    assert est.num_refits == 15
    assert abs(est.slope.item() - TRUE_SLOPE) < 0.05
    assert (est.intercepts - torch.tensor(TRUE_INTERCEPTS)).abs().max().item() < 0.15
    calib = est.window_calibration()
    assert calib["labels"] > 10_000
    assert abs(calib["mean_predicted"] - calib["observed_rate"]) < 0.02
    assert calib["ece"] < 0.03


def test_fit_follows_a_change_of_intercepts() -> None:
    """After fitting b = TRUE_INTERCEPTS, the workload shifts every intercept by -0.8; 200 more
    steps (10 refits, 256 requests a step) bring every intercept within 0.15 of the new value."""
    cfg = EstimatorConfig(num_positions=4, refit_interval=20)
    est = AcceptanceEstimator(cfg)
    gen = torch.Generator().manual_seed(1)
    _simulate(est, 200, TRUE_INTERCEPTS, gen)
    shifted = [b - 0.8 for b in TRUE_INTERCEPTS]
    _simulate(est, 200, shifted, gen)
    assert (est.intercepts - torch.tensor(shifted)).abs().max().item() < 0.15
    assert abs(est.slope.item() - TRUE_SLOPE) < 0.05


def test_unobserved_positions_keep_their_intercepts() -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=4, refit_interval=1))
    initial = est.intercepts.clone()
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        f = torch.randn(32, 4, generator=gen)
        verified = torch.full((32,), 2)
        accepted = torch.randint(0, 3, (32,), generator=gen)
        est.observe(f, est.predict(f), verified, accepted)
        assert est.step()
    assert torch.equal(est.intercepts[2:], initial[2:])
    assert est.intercepts[0] != initial[0] and est.slope.item() != 0.5


def test_nan_features_never_reach_the_coefficients() -> None:
    """Rows whose features are NaN (check_values=False) fit exactly like rows never verified."""
    cfg = EstimatorConfig(num_positions=3, refit_interval=1)
    clean, dirty = AcceptanceEstimator(cfg), AcceptanceEstimator(cfg)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        f = torch.randn(16, 3, generator=gen)
        accepted = torch.randint(0, 4, (16,), generator=gen)
        verified = torch.full((16,), 3)
        bad = torch.rand(16, generator=gen) < 0.3
        f_dirty = torch.where(bad.unsqueeze(1), float("nan"), f)
        dirty.observe(f_dirty, dirty.predict(f_dirty), verified, accepted, check_values=False)
        clean.observe(
            f, clean.predict(f), torch.where(bad, 0, verified), accepted.clamp(max=3) * ~bad
        )
        clean.step(), dirty.step()
    torch.testing.assert_close(dirty.slope, clean.slope)
    torch.testing.assert_close(dirty.intercepts, clean.intercepts)
    # a single NaN entry, inf and out-of-range predictions: skipped, coefficients stay finite
    f = torch.randn(8, 3, generator=gen)
    p = dirty.predict(f)
    f[0, 1], f[1, 0], p[2, 2] = float("nan"), float("inf"), 1.5
    dirty.observe(f, p, torch.full((8,), 3), torch.full((8,), 9), check_values=False)
    dirty.step()
    assert torch.isfinite(dirty.slope) and torch.isfinite(dirty.intercepts).all()


def test_step_schedule_and_nan_step_dropped() -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=2, refit_interval=3, ridge=0.0))
    assert [est.step() for _ in range(7)] == [False, False, True, False, False, True, False]
    # empty windows with ridge 0 give a 0/0 step: dropped, coefficients unchanged
    assert est.num_refits == 2 and est.slope.item() == 0.5
    assert est.intercepts.tolist() == pytest.approx([-0.2, -0.2])


def test_slope_kept_positive() -> None:
    """Acceptance falling with the feature pushes w below zero: clamped to min_slope."""
    est = AcceptanceEstimator(EstimatorConfig(num_positions=1, damping=0.0, min_slope=0.01))
    f = torch.tensor([[3.0]] * 50 + [[-3.0]] * 50)
    accepted = torch.tensor([0] * 50 + [1] * 50)
    for _ in range(3):
        est.observe(f, est.predict(f), torch.ones(100, dtype=torch.long), accepted)
        est.refit()
    assert est.slope.item() == pytest.approx(0.01)


def _saturated_refits(config: EstimatorConfig, refits: int) -> AcceptanceEstimator:
    """Drafts predicted near certain (f = 30) but rejected half the time: C_k = sum p(1 - p) is
    tiny and the reference Newton step for b_0 is enormous."""
    est = AcceptanceEstimator(config)
    f = torch.full((64, 1), 30.0)
    accepted = torch.tensor([0, 1] * 32)
    for _ in range(refits):
        est.observe(f, est.predict(f), torch.ones(64, dtype=torch.long), accepted)
        est.refit()
    return est


def test_a_refit_moves_coefficients_at_most_max_step_and_stays_in_bounds() -> None:
    from avspec.av.estimator import MAX_ABS_INTERCEPT, MAX_SLOPE

    config = EstimatorConfig(num_positions=1, initial_slope=1.0, initial_intercept=0.0)
    one = _saturated_refits(config, 1)
    assert abs(one.intercepts.item()) <= config.max_step + 1e-6
    assert abs(one.slope.item() - 1.0) <= config.max_step + 1e-6
    many = _saturated_refits(config, 200)
    assert config.min_slope <= many.slope.item() <= MAX_SLOPE
    assert abs(many.intercepts.item()) <= MAX_ABS_INTERCEPT
    # It keeps learning: predictions come back to the observed 50 % instead of sticking at 0/1.
    assert 0.2 < many.predict(torch.full((1, 1), 30.0)).item() < 0.8


def test_the_uncapped_reference_step_is_what_the_cap_prevents() -> None:
    """With max_step = inf (the reference step) the same statistics throw b_0 to the bound and
    the fit swings between p = 0 and p = 1 for ever instead of finding 50 %."""
    from avspec.av.estimator import MAX_ABS_INTERCEPT

    config = EstimatorConfig(
        num_positions=1, initial_slope=1.0, initial_intercept=0.0, max_step=float("inf")
    )
    assert abs(_saturated_refits(config, 1).intercepts.item()) == MAX_ABS_INTERCEPT
    stuck = _saturated_refits(config, 200).predict(torch.full((1, 1), 30.0)).item()
    assert not 0.2 < stuck < 0.8


def test_window_calibration() -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=2))
    assert est.window_calibration()["labels"] == 0.0  # before any refit: NaN rates
    f = torch.zeros(4, 2)
    p = torch.tensor([[0.15, 0.15], [0.15, 0.15], [0.95, 0.95], [0.95, 0.95]])
    est.observe(f, p, torch.tensor([2, 2, 2, 2]), torch.tensor([0, 2, 2, 1]))
    est.refit()
    # labels: row0 [0, -], row1 [1, 1], row2 [1, 1], row3 [1, 0]: 7 labels
    # bin 1: p 0.15 x3, y 0,1,1; bin 9: p 0.95 x4, y 1,1,1,0
    got = est.window_calibration()
    assert got["labels"] == 7
    assert got["mean_predicted"] == pytest.approx((0.45 + 3.8) / 7)
    assert got["observed_rate"] == pytest.approx(5 / 7)
    assert got["ece"] == pytest.approx((abs(0.45 - 2) + abs(3.8 - 3)) / 7)
    est.refit()  # an empty window
    assert got["labels"] == 7 and est.window_calibration()["labels"] == 0


def test_state_dict_roundtrip_and_errors() -> None:
    cfg = EstimatorConfig(num_positions=4, refit_interval=20)
    est = AcceptanceEstimator(cfg)
    _simulate(est, 30, TRUE_INTERCEPTS, torch.Generator().manual_seed(4), batch=16)
    state = est.state_dict()
    copy = AcceptanceEstimator(cfg)
    copy.load_state_dict(state)
    _assert_state_equal(copy.state_dict(), state)
    other = AcceptanceEstimator(dataclasses.replace(cfg, num_positions=3))
    before = other.state_dict()
    with pytest.raises(ValueError, match="num_positions=4"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="malformed"):
        copy.load_state_dict({k: v for k, v in state.items() if k != "bins"})
    with pytest.raises(ValueError, match="intercepts must have shape"):
        copy.load_state_dict({**state, "intercepts": torch.zeros(5)})
    with pytest.raises(ValueError, match="slope must be >= min_slope"):
        copy.load_state_dict({**state, "slope": torch.tensor(float("nan"))})
    with pytest.raises(ValueError, match="intercepts finite"):
        copy.load_state_dict({**state, "intercepts": torch.tensor([0.0, 1.0, float("inf"), 0.0])})
    with pytest.raises(ValueError, match=">= 0"):
        copy.load_state_dict({**state, "num_steps": -1})
    with pytest.raises(ValueError, match="stats A"):
        copy.load_state_dict({**state, "stats": {**state["stats"], "A": torch.zeros(2)}})
    _assert_state_equal(other.state_dict(), before)
    _assert_state_equal(copy.state_dict(), state)


def test_empty_batch_is_accepted_and_changes_nothing() -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=3))
    before = est.state_dict()
    empty = torch.zeros(0, 3)
    assert est.predict(empty).shape == (0, 3)
    est.observe(empty, empty, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    _assert_state_equal(est.state_dict(), before)


def test_zero_positions_config_rejected() -> None:
    with pytest.raises(ValueError, match="num_positions"):
        AcceptanceEstimator(EstimatorConfig(num_positions=0))


def _good() -> dict[str, torch.Tensor]:
    return {
        "features": torch.zeros(2, 3),
        "predictions": torch.full((2, 3), 0.5),
        "num_verified": torch.tensor([3, 1]),
        "num_accepted": torch.tensor([1, 1]),
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"features": torch.zeros(2, 5)}, "5 positions"),
        ({"features": torch.zeros(6)}, "features must have shape"),
        ({"features": torch.zeros(2, 3, dtype=torch.long)}, "floating point"),
        ({"features": torch.zeros(2, 3, device="meta")}, "features on meta"),
        ({"predictions": torch.zeros(2, 2)}, "predictions must have shape"),
        ({"num_verified": torch.tensor([3])}, "num_verified must have shape"),
        ({"num_accepted": torch.tensor([[1, 1]])}, "num_accepted must have shape"),
        ({"num_accepted": torch.tensor([1, 1], device="meta")}, "share one device"),
        ({"num_verified": torch.tensor([3.0, 1.0])}, "integer tensor"),
        ({"num_accepted": torch.tensor([2, 2])}, "num_accepted must be in"),
        ({"num_accepted": torch.tensor([-100, 0])}, "num_accepted must be in"),
        ({"num_verified": torch.tensor([4, 1])}, "num_verified must be in"),
        ({"features": torch.tensor([[0.0, float("nan"), 0.0], [0.0] * 3])}, "features contains"),
        ({"predictions": torch.tensor([[0.5, 1.5, 0.5], [0.5] * 3])}, "predictions must be"),
    ],
)
def test_bad_observe_input_leaves_state_unchanged(change: dict, match: str) -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=4))
    est.observe(**_good())
    before = est.state_dict()
    with pytest.raises(ValueError, match=match):
        est.observe(**{**_good(), **change})
    _assert_state_equal(est.state_dict(), before)


@pytest.mark.parametrize(
    ("features", "match"),
    [
        (torch.zeros(2, 5), "5 positions"),
        (torch.zeros(2), "features must have shape"),
        (torch.zeros(2, 2, device="meta"), "features on meta"),
        (torch.zeros(2, 2, dtype=torch.int32), "floating point"),
    ],
)
def test_bad_predict_input(features: torch.Tensor, match: str) -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=4))
    with pytest.raises(ValueError, match=match):
        est.predict(features)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_cuda() -> None:
    est = AcceptanceEstimator(EstimatorConfig(num_positions=4, refit_interval=20), "cuda")
    f = torch.randn(64, 4, device="cuda")
    est.observe(
        f,
        est.predict(f),
        torch.full((64,), 4, device="cuda"),
        torch.full((64,), 2, device="cuda"),
        check_values=False,
    )
    est.refit()
    assert est.slope.device.type == "cuda" and torch.isfinite(est.intercepts).all()
