"""Tests for avspec.av.cost_file: the step-cost file round trip, its errors, the fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from avspec.av.cost_file import FORMAT, default_step_cost, load_step_cost, save_step_cost
from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost

ROOT = Path(__file__).resolve().parents[3]


def _cost() -> StepCost:
    return StepCost(
        CostTable([1, 2, 4], [1.0, 1.5, 1.4], name="draft_pass"),  # fitted to 1.0, 1.45, 1.45
        CostTable([1, 8, 64], [5.0, 6.0, 20.0], name="verify"),
        overhead_ms=2.5,
    )


def _good(tmp_path: Path) -> dict:
    path = tmp_path / "good.json"
    save_step_cost(path, _cost(), None)
    return json.loads(path.read_text())


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "costs.json"
    measured = {"command": "x", "threads": 1, "verify": {"samples": {"1": [5.0, 5.1]}}}
    save_step_cost(path, _cost(), measured)
    document = json.loads(path.read_text())
    assert document["format"] == FORMAT and document["measured"] == measured
    assert document["draft_pass"] == {"sizes": [1, 2, 4], "millis": [1.0, 1.45, 1.45]}
    cost = load_step_cost(path)
    assert cost.overhead_ms == 2.5
    assert cost.draft_pass.millis == [1.0, 1.45, 1.45] and cost.draft_pass.name == "draft_pass"
    assert cost.verify.sizes == [1.0, 8.0, 64.0] and cost.verify.name == "verify"
    assert float(cost.verify(36.0)) == pytest.approx(13.0)
    assert [p.name for p in path.parent.iterdir()] == ["costs.json"]  # no temp file left


def test_file_mode_is_readable_or_kept(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    save_step_cost(path, _cost(), None)
    assert path.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    path.chmod(0o640)
    save_step_cost(path, _cost(), None)
    assert path.stat().st_mode & 0o777 == 0o640


def test_fractional_sizes_round_trip(tmp_path: Path) -> None:
    """Served tables have sizes like 2.071 sequences per step; integral ones are written as ints."""
    path = tmp_path / "served.json"
    cost = StepCost(CostTable([1.0, 2.071], [1.0, 2.0]), CostTable([1.25, 64], [3.0, 9.0]), 0.0)
    save_step_cost(path, cost, None)
    assert json.loads(path.read_text())["verify"]["sizes"] == [1.25, 64]
    assert load_step_cost(path).draft_pass.sizes == [1.0, 2.071]


def test_measured_defaults_to_empty(tmp_path: Path) -> None:
    assert _good(tmp_path)["measured"] == {}


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_step_cost(tmp_path / "absent.json")


def test_old_format_names_the_command(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    old = {"draft_cost": {"sizes": [1], "millis": [1.0]}, "verify_cost": {"sizes": [1],
           "millis": [2.0]}, "device": "cpu"}  # fmt: skip
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="old format") as info:
        load_step_cost(path)
    assert str(path) in str(info.value) and "client/profile_costs.py" in str(info.value)


def _mutate(document: dict, field: str, value) -> dict:
    document = json.loads(json.dumps(document))
    target, *rest = field.split(".")
    if rest:
        document[target][rest[0]] = value
    elif value is _DELETE:
        del document[target]
    else:
        document[target] = value
    return document


_DELETE = object()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("format", "avspec-step-cost/0", "field 'format'"),
        ("format", _DELETE, "field 'format'"),
        ("overhead_ms", _DELETE, "field 'overhead_ms'"),
        ("overhead_ms", -1.0, "field 'overhead_ms'"),
        ("overhead_ms", "1", "field 'overhead_ms'"),
        ("overhead_ms", True, "field 'overhead_ms'"),
        ("draft_pass", _DELETE, "field 'draft_pass' missing"),
        ("verify", [1, 2], "field 'verify' missing or not an object"),
        ("verify.sizes", "1,2", r"field 'verify.sizes' must be a list"),
        ("verify.millis", [1.0, None, 2.0], r"field 'verify.millis' must be a list of numbers"),
        ("verify.millis", [1.0, 2.0], "field 'verify': .*3 sizes but 2"),
        ("draft_pass.millis", [1.0, -2.0, 3.0], "field 'draft_pass': .*finite and >= 0"),
        ("draft_pass.sizes", [1, 1, 2], "field 'draft_pass': .*duplicate sizes"),
        ("draft_pass.sizes", [], "field 'draft_pass': .*empty"),
        ("measured", [], "field 'measured'"),
    ],
)
def test_malformed_fields_are_named(tmp_path: Path, field: str, value, match: str) -> None:
    path = tmp_path / "bad.json"
    document = _mutate(_good(tmp_path), field, value)
    if field == "draft_pass.sizes" and value == []:
        document["draft_pass"]["millis"] = []
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=match) as info:
        load_step_cost(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"x"'])
def test_not_an_object(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"cost file {path}"):
        load_step_cost(path)


def test_nan_in_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(_good(tmp_path)).replace("20.0", "NaN"))
    with pytest.raises(ValueError, match="field 'verify'"):
        load_step_cost(path)


def test_save_refuses_non_json_measured(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        save_step_cost(tmp_path / "x.json", _cost(), {"bad": float("nan")})
    assert not list(tmp_path.iterdir())


def test_default_step_cost() -> None:
    cost = default_step_cost(64, 576)
    assert cost.overhead_ms == 0.0
    assert float(cost.draft_pass(0.0)) == pytest.approx(1.0)
    assert float(cost.draft_pass(64.0)) == pytest.approx(1.64)
    assert float(cost.verify(100.0)) == pytest.approx(20.0)
    assert float(cost.verify(1000.0)) == pytest.approx(110.0)  # extrapolated on the line
    torch.testing.assert_close(
        cost.pass_ms(torch.tensor([0, 10])), torch.tensor([0.0, 1.1], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="max_rows"):
        default_step_cost(0, 10)


def test_shipped_file_loads() -> None:
    """models/cost_tables.json is in the current format (regenerated by profile_costs.py)."""
    cost = load_step_cost(ROOT / "models" / "cost_tables.json")
    assert cost.draft_pass.millis == sorted(cost.draft_pass.millis)
    assert cost.verify.millis == sorted(cost.verify.millis)
    assert max(cost.verify.sizes) >= 64 * 9 and max(cost.draft_pass.sizes) >= 64


def test_verify_to_draft_ratio_on_straight_tables():
    """64 rows x (1 + 8) tokens: verify 2 + 0.5 * 576 ms + 0.25 ms/row, draft pass 1 + 0.1 * 64."""
    from avspec.av.step_cost import StepCost

    cost = StepCost.linear(1.0, 0.1, 2.0, 0.5, 64, 576, verify_row_ms=0.25)
    per_token = (2.0 + 0.5 * 576 + 0.25 * 64) / 576
    per_row = (1.0 + 0.1 * 64) / 64
    assert abs(cost.verify_to_draft_ratio(64, 8) - per_token / per_row) < 1e-9
    with pytest.raises(ValueError, match="rows >= 1"):
        cost.verify_to_draft_ratio(0, 8)


def test_verify_to_draft_ratio_of_a_free_draft_pass_is_infinite():
    """A noisy profile can measure a draft pass as free once its fixed cost is subtracted: the
    ratio is infinite, not a division by zero (the profiler's CLI failed on it once in CI)."""
    cost = StepCost.linear(0.0, 0.0, 10.0, 0.1, max_rows=64, max_tokens=1024)
    assert cost.verify_to_draft_ratio(16, 8) == float("inf")
