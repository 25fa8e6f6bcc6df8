"""The fleet prior (avspec.av.prior) on constructed statistics with answers computed by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from avspec.av.estimator import AcceptanceEstimator
from avspec.av.prior import Replica, combine, combine_files, read_replica
from avspec.av.snapshot import load_snapshot, save_snapshot
from avspec.config import EstimatorConfig
from avspec.tools.setup.combine_snapshots import main as combine_main

NAMES = ("A", "B", "C", "G0", "G1", "n")


def replica(slope, intercepts, stats, num_steps=0, num_refits=1, pair=None) -> Replica:
    k = len(intercepts)
    full = {name: torch.tensor(stats.get(name, [0.0] * k), dtype=torch.float64) for name in NAMES}
    return Replica(
        slope, torch.tensor(intercepts, dtype=torch.float64), full, num_steps, num_refits, pair
    )


def save(path, r: Replica, pair: str = "") -> None:
    config = EstimatorConfig(num_positions=r.num_positions)
    estimator = AcceptanceEstimator(config)
    state = estimator.state_dict()
    state.update(
        slope=torch.tensor(r.slope),
        intercepts=r.intercepts.float(),
        stats=r.stats,
        num_steps=r.num_steps,
        num_refits=r.num_refits,
    )
    estimator.load_state_dict(state)
    save_snapshot(estimator, path, pair)


def naive_mean(replicas):
    return np.mean([r.slope for r in replicas]), np.mean(
        [r.intercepts.numpy() for r in replicas], 0
    )


def lifetime_weighted(replicas):
    """The wrong combination: weights by num_steps, i.e. by labels the refits already cleared."""
    w = np.array([r.num_steps for r in replicas], dtype=float)
    return (
        float(np.dot(w, [r.slope for r in replicas]) / w.sum()),
        np.average([r.intercepts.numpy() for r in replicas], axis=0, weights=w),
    )


def test_decoupled_statistics_give_the_information_weighted_mean():
    # B = 0 decouples slope from intercept: w* = (3 * 0.8 + 1 * 0.4) / 4 = 0.7 and
    # b* = (1 * 0.0 + 3 * -0.4) / 4 = -0.3, by hand. Replica 1 ran 10 steps, replica 2 a
    # million (cleared windows): the lifetime counters must weigh nothing.
    one = replica(0.8, [0.0], {"A": [3.0], "C": [1.0], "G0": [0.5], "n": [7.0]}, num_steps=10)
    two = replica(0.4, [-0.4], {"A": [1.0], "C": [3.0], "G1": [0.2], "n": [5.0]}, 1_000_000, 999)
    prior = combine([one, two], anchor=1e-12)
    assert prior.slope == pytest.approx(0.7, abs=1e-9)
    assert prior.intercepts.tolist() == pytest.approx([-0.3], abs=1e-9)
    # the wrong combinations land elsewhere
    mean_w, mean_b = naive_mean([one, two])
    assert abs(mean_w - prior.slope) > 0.05 and abs(mean_b[0] - prior.intercepts[0]) > 0.05
    life_w, life_b = lifetime_weighted([one, two])
    assert abs(life_w - prior.slope) > 0.2 and abs(life_b[0] - prior.intercepts[0]) > 0.05
    # pooled window at theta*: sums add, residual sums re-centred by hand:
    # G0 = 0.5 - 3 (0.7 - 0.8) + 0 - 1 (0.7 - 0.4) = 0.5; G1 = 0 - 1 (-0.3 - 0) + 0.2 - 3 (0.1)
    assert prior.stats["A"].tolist() == [4.0] and prior.stats["C"].tolist() == [4.0]
    assert prior.stats["G0"].tolist() == pytest.approx([0.5], abs=1e-9)
    assert prior.stats["G1"].tolist() == pytest.approx([0.2], abs=1e-9)
    # n holds the open windows' labels only (7 + 5), never cleared ones; counters restart
    assert prior.stats["n"].tolist() == [12.0]
    assert (prior.num_steps, prior.num_refits) == (0, 0)


def test_coupled_statistics_match_the_normal_equations():
    # K = 2 with the slope coupled to the intercepts (B != 0): the answer is the solution of
    # (H1 + H2 + a I) theta = H1 theta1 + H2 theta2 + a theta_bar, with the arrowhead
    # matrices written out by hand. Replica 3 has just refitted (empty window): it only enters
    # theta_bar, the anchor's target.
    one = replica(0.6, [0.2, -0.1], {"A": [4, 2], "B": [1, 0.5], "C": [2, 1], "n": [10, 6]}, 100)
    two = replica(
        0.3, [-0.4, -0.6], {"A": [1, 0.5], "B": [0.2, 0.1], "C": [0.5, 0.25], "n": [3, 2]}
    )
    three = replica(1.0, [1.0, 1.0], {}, num_steps=10**7, num_refits=10**5)
    a = 1e-3
    h1 = np.array([[6.0, 1.0, 0.5], [1.0, 2.0, 0.0], [0.5, 0.0, 1.0]])
    h2 = np.array([[1.5, 0.2, 0.1], [0.2, 0.5, 0.0], [0.1, 0.0, 0.25]])
    t1, t2, t3 = np.array([0.6, 0.2, -0.1]), np.array([0.3, -0.4, -0.6]), np.array([1.0, 1, 1])
    bar = (t1 + t2 + t3) / 3
    expected = np.linalg.solve(h1 + h2 + a * np.eye(3), h1 @ t1 + h2 @ t2 + a * bar)
    prior = combine([one, two, three], anchor=a)
    got = np.array([prior.slope, *prior.intercepts.tolist()])
    np.testing.assert_allclose(got, expected, atol=1e-12)
    # the coupling matters: solving slope and intercepts separately (dropping B) differs
    diag = np.diag(np.diag(h1 + h2) + a)
    decoupled = np.linalg.solve(
        diag, np.diag(np.diag(h1)) @ t1 + np.diag(np.diag(h2)) @ t2 + a * bar
    )
    assert np.abs(decoupled - got).max() > 1e-3
    # the pooled gradient at theta* is a (theta* - theta_bar) (nothing pending was added twice)
    pooled = np.array([prior.stats["G0"].sum(), *prior.stats["G1"].tolist()])
    np.testing.assert_allclose(pooled, a * (got - bar), atol=1e-12)


def test_all_windows_empty_gives_the_mean_of_replicas_that_learned():
    fresh = replica(0.5, [-0.2], {}, num_refits=0)  # never refitted: the configured start
    learned = [replica(0.9, [0.4], {}, 500, 5), replica(0.7, [0.0], {}, 50_000, 500)]
    prior = combine([fresh, *learned])
    assert prior.slope == pytest.approx(0.8) and prior.intercepts.tolist() == pytest.approx([0.2])


def test_mismatched_snapshots_are_refused():
    with pytest.raises(ValueError, match="differ in K"):
        combine([replica(0.5, [0.0], {}), replica(0.5, [0.0, 0.0], {})])
    with pytest.raises(ValueError, match="different draft/target pairs"):
        combine([replica(0.5, [0.0], {}, pair="aa"), replica(0.5, [0.0], {}, pair="bb")])
    with pytest.raises(ValueError, match="no snapshots"):
        combine([])


def test_files_round_trip_and_the_prior_warm_starts_an_estimator(tmp_path, capsys):
    one = replica(0.8, [0.0, 0.1], {"A": [3.0, 0], "C": [1.0, 0.5], "n": [7.0, 2.0]}, 10)
    two = replica(0.4, [-0.4, 0.3], {"A": [1.0, 0], "C": [3.0, 0.5], "n": [5.0, 1.0]}, 10**6)
    save(tmp_path / "pod-0.json", one, "pair-x")
    save(tmp_path / "pod-1.json", two, "pair-x")
    assert read_replica(tmp_path / "pod-1.json").num_steps == 10**6
    out = tmp_path / "prior.json"
    assert (
        combine_main(
            ["--out", str(out), str(tmp_path / "pod-0.json"), str(tmp_path / "pod-1.json")]
        )
        == 0
    )
    assert "open-window labels 15" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["pair"] == "pair-x" and document["num_steps"] == 0
    estimator = load_snapshot(out, EstimatorConfig(num_positions=2, refit_interval=3))
    assert float(estimator.slope) == pytest.approx(0.7, abs=1e-3)  # the anchor, float32
    assert estimator.intercepts.tolist() == pytest.approx([-0.3, 0.2], abs=1e-3)
    assert float(estimator.stats.total()) == 15.0
    prior = combine_files([tmp_path / "pod-0.json", tmp_path / "pod-1.json"], tmp_path / "p2.json")
    assert prior.pair == "pair-x"
    save(tmp_path / "other.json", one, "pair-y")
    assert (
        combine_main(
            ["--out", str(out), str(tmp_path / "pod-0.json"), str(tmp_path / "other.json")]
        )
        == 1
    )
    assert "different draft/target pairs" in capsys.readouterr().err
