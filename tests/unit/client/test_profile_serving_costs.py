"""client/profile_serving_costs.py without a server: an unreachable one, bad arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.client_scripts import load_profile_serving_costs


def test_unreachable_server_is_a_clear_error(tmp_path: Path, capsys):
    rc = load_profile_serving_costs().main([
        "--http-url", "http://127.0.0.1:9", "--metrics-url", "http://127.0.0.1:9/metrics",
        "--concurrency", "1", "--draft-tokens", "2", "--out", str(tmp_path / "c.json"),
    ])  # fmt: skip
    assert rc == 2 and "error:" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--draft-tokens", "a,b"]])
def test_bad_arguments(tmp_path: Path, bad: list[str]):
    with pytest.raises(SystemExit):
        load_profile_serving_costs().main([*bad, "--out", str(tmp_path / "c")])


def _counters(steps, sequences, verified, draft_us, target_us, step_us, execs=None):
    execs = steps if execs is None else execs
    return {"steps": steps, "sequences": sequences, "verified": verified, "step_us": step_us,
            "step_requests": steps, "draft_us": draft_us, "draft_execs": execs,
            "target_us": target_us, "target_execs": execs}  # fmt: skip


def test_point_has_the_served_step_and_its_overhead():
    module = load_profile_serving_costs()
    zero = _counters(0, 0, 0, 0, 0, 0)
    # 10 steps of 4 sequences, 3 drafts verified each, 16 prompt tokens; 2 + 5 ms + 1.5 hops.
    after = _counters(10, 40, 120, 20_000, 50_000, 85_000)
    p = module.point(zero, after, 3, 16)
    assert p["sequences_per_step"] == 4 and p["target_tokens_per_step"] == (40 + 120 + 16) / 10
    assert (p["draft_ms"], p["target_ms"], p["step_ms"]) == (2.0, 5.0, 8.5)
    assert p["overhead_ms"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no decode step"):
        module.point(zero, zero, 3, 0)


def _served(c, k, rows, tokens, draft_ms, target_ms, overhead=1.0, steps=20):
    return {"concurrency": c, "k": k, "steps": steps, "prompt_tokens": 0,
            "sequences_per_step": rows, "target_tokens_per_step": tokens, "draft_ms": draft_ms,
            "target_ms": target_ms, "step_ms": draft_ms + target_ms + overhead,
            "overhead_ms": overhead}  # fmt: skip


def _synthetic_points():
    """A machine with draft pass 0.5 + 0.05 * rows (+0.2 per stage call), target 4 + 0.1 * t;
    K passes a step (none at K = 0: the draft defers its inputs)."""
    points = []
    for c in (1, 4, 16):
        for k in (0, 2, 8):
            passes = k
            draft = 0.2 + passes * (0.5 + 0.05 * c)
            tokens = c * (1 + k)
            points.append(_served(c, k, c, tokens, draft, 4.0 + 0.1 * tokens))
    return points


def test_tables_from_points():
    module = load_profile_serving_costs()
    points = _synthetic_points()
    draft = module.draft_pass_points(points)
    assert draft["sizes"] == [1, 4, 16]
    # (draft at K 8 - at K 0) / 8: the stage's per-call 0.2 ms cancels.
    assert draft["millis"] == pytest.approx([0.55, 0.7, 1.3])
    # plain hops 1.0 ms; the written overhead adds the draft's per-call 0.2 ms
    verify = module.verify_points(points)
    assert verify["sizes"][0] == 1 and 4 in verify["sizes"]
    assert verify["sizes"] == [1, 3, 4, 9, 12, 16, 36, 48, 144]
    assert verify["weights"] == [20] * 9
    # Points of the same size (to 1e-3) merge: weighted mean, summed steps.
    twice = [_served(1, 2, 2, 6.0, 1.0, 10.0, steps=30), _served(2, 0, 2, 6.0004, 1.0, 20.0)]
    assert module.verify_points(twice) == {"sizes": [6.0], "millis": [14.0], "weights": [50]}
    cost = module.step_cost_from_points(points)
    assert cost.overhead_ms == pytest.approx(1.2)
    report = module.check(cost, points)
    assert report["median_abs_relative_error"] < 1e-9  # linear machine: exact
    assert len(report["points"]) == len(points)


def test_single_k_and_no_drafting():
    module = load_profile_serving_costs()
    only_k4 = [_served(2, 4, 2.0, 10.0, 4.0, 5.0)]
    assert module.draft_pass_points(only_k4)["millis"] == [1.0]
    with pytest.raises(ValueError, match="no point drafted"):
        module.draft_pass_points([_served(2, 0, 2.0, 2.0, 1.0, 5.0)])
    negative = [_served(1, 0, 1, 1, 9.0, 5.0), _served(1, 2, 1, 3, 4.0, 5.0)]
    assert module.draft_pass_points(negative)["millis"] == [0.0]  # noise: never below free


def test_check_of_another_file_flags_its_error():
    """Tables without the served hops under-predict every served step by the overhead (11.2 ms
    of steps of 16-40 ms here)."""
    module = load_profile_serving_costs()
    points = [dict(p, step_ms=p["step_ms"] + 10.0, overhead_ms=11.0) for p in _synthetic_points()]
    cost = module.step_cost_from_points(points)
    in_process = module.StepCost(cost.draft_pass, cost.verify, 0.0)
    assert module.check(cost, points)["median_abs_relative_error"] < 0.05
    assert all(r["relative_error"] < -0.25 for r in module.check(in_process, points)["points"])


def test_bad_check_file_is_a_clear_error(tmp_path: Path, capsys):
    old = tmp_path / "old.json"
    old.write_text('{"draft_cost": {}, "verify_cost": {}}')
    rc = load_profile_serving_costs().main(["--check", str(old), "--out", str(tmp_path / "c")])
    assert rc == 2 and "old format" in capsys.readouterr().err
