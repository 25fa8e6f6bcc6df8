"""Tests for avspec.av.refit: sufficient statistics and the arrowhead Newton step."""

from __future__ import annotations

import pytest
import torch

from avspec.av.refit import SufficientStats, newton_step


def _random_stats(k: int = 4, batch: int = 300, seed: int = 0) -> SufficientStats:
    gen = torch.Generator().manual_seed(seed)
    f = torch.randn(batch, k, generator=gen, dtype=torch.float64) * 2
    p = torch.sigmoid(0.5 * f - 0.2)
    y = (torch.rand(batch, k, generator=gen, dtype=torch.float64) < 0.6).double()
    mask = torch.rand(batch, k, generator=gen) < 0.8
    stats = SufficientStats(k)
    stats.add(f, p, y, mask)
    return stats


def _dense_step(stats: SufficientStats, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve the full (K+1)x(K+1) Newton system, ridge on every diagonal entry (spec 3)."""
    k = stats.num_positions
    h = torch.zeros(k + 1, k + 1, dtype=torch.float64)
    h[0, 0] = stats.A.sum() + ridge
    h[0, 1:] = stats.B
    h[1:, 0] = stats.B
    h[1:, 1:] = torch.diag(stats.C + ridge)
    g = torch.cat([stats.G0.sum().view(1), stats.G1])
    theta = torch.linalg.solve(h, g)
    return theta[0], theta[1:]


def test_stats_match_explicit_sums() -> None:
    f = torch.tensor([[1.0, 2.0], [3.0, float("nan")], [-1.0, 0.5]])
    p = torch.tensor([[0.5, 0.2], [0.9, 0.5], [0.3, 0.6]])
    y = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    mask = torch.tensor([[True, True], [True, True], [False, True]])
    stats = SufficientStats(3)
    stats.add(f, p, y, mask)
    s0 = torch.tensor([0.25, 0.09], dtype=torch.float64)  # position 0 rows 0, 1
    f0 = torch.tensor([1.0, 3.0], dtype=torch.float64)
    r0 = torch.tensor([0.5, 0.1], dtype=torch.float64)
    assert stats.A[0].item() == pytest.approx(float((s0 * f0 * f0).sum()))
    assert stats.B[0].item() == pytest.approx(float((s0 * f0).sum()))
    assert stats.C[0].item() == pytest.approx(float(s0.sum()))
    assert stats.G0[0].item() == pytest.approx(float((r0 * f0).sum()))
    assert stats.G1[0].item() == pytest.approx(float(r0.sum()))
    # position 1: the NaN feature row is skipped, rows 0 and 2 count
    assert stats.n.tolist() == [2.0, 2.0, 0.0]
    assert stats.C[1].item() == pytest.approx(0.16 + 0.24)
    assert stats.G1[1].item() == pytest.approx(-0.2 + 0.4)
    assert stats.total().item() == 4.0
    stats.clear()
    assert stats.total().item() == 0.0 and stats.A.abs().sum() == 0


def test_arrowhead_equals_dense_solve() -> None:
    stats = _random_stats()
    dw, db = newton_step(stats, ridge=1e-3, damping=0.0)
    want_w, want_b = _dense_step(stats, 1e-3)
    torch.testing.assert_close(dw, want_w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(db, want_b, rtol=1e-9, atol=1e-12)


def test_damping_scales_the_undamped_step() -> None:
    stats = _random_stats(k=3, batch=40, seed=3)
    dw0, db0 = newton_step(stats, ridge=1e-3, damping=0.0)
    dw, db = newton_step(stats, ridge=1e-3, damping=50.0)
    n_k = stats.n
    n = n_k.sum()
    torch.testing.assert_close(dw, dw0 * n / (n + 50))
    torch.testing.assert_close(db, db0 * n_k / (n_k + 50))


def test_unlabelled_position_gets_zero_step() -> None:
    gen = torch.Generator().manual_seed(4)
    f = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    mask = torch.ones(50, 3, dtype=torch.bool)
    mask[:, 2] = False
    stats = SufficientStats(3)
    stats.add(f, torch.full_like(f, 0.4), (f > 0).double(), mask)
    dw, db = newton_step(stats, ridge=1e-3, damping=50.0)
    assert db[2].item() == 0.0 and torch.isfinite(dw)
    # the Schur sums ignore position 2: same step as a 2-position system
    small = SufficientStats(2)
    small.add(f[:, :2], torch.full_like(f[:, :2], 0.4), (f[:, :2] > 0).double(), mask[:, :2])
    dw2, db2 = newton_step(small, ridge=1e-3, damping=50.0)
    torch.testing.assert_close(dw, dw2)
    torch.testing.assert_close(db[:2], db2)


def test_empty_stats_give_zero_or_nan_step() -> None:
    stats = SufficientStats(2)
    dw, db = newton_step(stats, ridge=1e-3, damping=50.0)
    assert dw.item() == 0.0 and db.abs().sum() == 0
    dw, _ = newton_step(stats, ridge=0.0, damping=0.0)
    assert torch.isnan(dw)  # 0 / 0: the caller drops it


def test_fewer_positions_than_stats() -> None:
    stats = SufficientStats(4)
    stats.add(torch.ones(2, 2), torch.full((2, 2), 0.5), torch.ones(2, 2), torch.ones(2, 2).bool())
    assert stats.n.tolist() == [2.0, 2.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2, 5), (2, 5), (2, 5), (2, 5)), "5 positions"),
        (((2, 3), (2, 2), (2, 3), (2, 3)), "predictions must have shape"),
        (((2, 3), (2, 3), (3, 3), (2, 3)), "labels must have shape"),
        (((2, 3), (2, 3), (2, 3), (2,)), "mask must have shape"),
        (((6,), (2, 3), (2, 3), (2, 3)), "features must have shape"),
    ],
)
def test_add_rejects_bad_shapes_without_change(shapes: tuple, match: str) -> None:
    stats = _random_stats()
    before = stats.state_dict()
    f, p, y, m = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        stats.add(f, p, y, m.bool())
    for name, value in stats.state_dict().items():
        assert torch.equal(value, before[name])


def test_add_rejects_other_device() -> None:
    stats = SufficientStats(2)
    meta = torch.zeros(1, 2, device="meta")
    with pytest.raises(ValueError, match="share one device"):
        stats.add(meta, meta, meta, meta.bool())


def test_constructor_and_state_dict_errors() -> None:
    with pytest.raises(ValueError, match="num_positions"):
        SufficientStats(0)
    stats = _random_stats()
    state = stats.state_dict()
    fresh = SufficientStats(4)
    fresh.load_state_dict(state)
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(ValueError, match="lacks 'G1'"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "G1"})
    with pytest.raises(ValueError, match="stats A must have shape"):
        fresh.load_state_dict({**state, "A": torch.zeros(5)})
