"""Tests for avspec.config: the parameters parser and EstimatorConfig validation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from avspec.config import EstimatorConfig, from_parameters, parse_bool


@dataclass(frozen=True)
class _Example:
    name: str
    enabled: bool = False
    count: int = 3
    scale: float = 1.0
    where: Path = Path("/tmp")
    ladder: tuple[float, ...] = ()
    maybe: int | None = None


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("Yes", True),
        (" no ", False),
        ("0", False),
        ("False", False),
        ("NO", False),
    ],
)
def test_booleans_follow_one_rule(text: str, want: bool) -> None:
    assert from_parameters(_Example, {"name": "x", "enabled": text}).enabled is want
    assert parse_bool("k", text) is want


@pytest.mark.parametrize("text", ["on", "off", "", "2", "truthy", "t"])
def test_other_boolean_words_rejected_naming_key(text: str) -> None:
    with pytest.raises(ValueError, match="'enabled'"):
        from_parameters(_Example, {"name": "x", "enabled": text})


def test_types_and_string_value_wrapping() -> None:
    params = {
        "name": {"string_value": "draft"},
        "count": {"string_value": "7"},
        "scale": "0.25",
        "where": "/models/a",
        "ladder": "1, 2.5,4",
        "maybe": "5",
    }
    cfg = from_parameters(_Example, params)
    assert cfg == _Example("draft", False, 7, 0.25, Path("/models/a"), (1.0, 2.5, 4.0), 5)
    assert from_parameters(_Example, {"name": "x", "maybe": "none"}).maybe is None


def test_defaults_for_missing_fields() -> None:
    assert from_parameters(EstimatorConfig, {}) == EstimatorConfig()


def test_missing_required_field() -> None:
    with pytest.raises(ValueError, match="missing required parameter 'name'"):
        from_parameters(_Example, {})


@pytest.mark.parametrize("value", ["${num_positions}", {"string_value": "a${x}b"}])
def test_unfilled_placeholder_rejected(value: str | dict) -> None:
    with pytest.raises(ValueError, match="placeholder"):
        from_parameters(EstimatorConfig, {"num_positions": value})


def test_unknown_key_rejected_unless_ignored() -> None:
    with pytest.raises(ValueError, match="unknown parameter.*FORCE_CPU"):
        from_parameters(EstimatorConfig, {"FORCE_CPU": "1"})
    cfg = from_parameters(EstimatorConfig, {"FORCE_CPU": "1"}, ignore={"FORCE_CPU"})
    assert cfg == EstimatorConfig()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"count": "3.5"}, "'count'.*not a valid int"),
        ({"scale": "fast"}, "'scale'.*not a valid float"),
        ({"count": {"int_value": "3"}}, "string_value"),
        ({"count": 3}, "expected a string"),
    ],
)
def test_bad_values_name_the_key(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_parameters(_Example, {"name": "x", **params})


def test_not_a_dataclass_and_unsupported_type() -> None:
    with pytest.raises(ValueError, match="not a dataclass"):
        from_parameters(dict, {})

    @dataclass
    class Odd:
        items: list = None  # type: ignore[assignment]

    with pytest.raises(ValueError, match="unsupported field type"):
        from_parameters(Odd, {"items": "1"})

    @dataclass
    class Either:
        value: int | str = 0

    with pytest.raises(ValueError, match="unsupported field type"):
        from_parameters(Either, {"value": "1"})


def test_estimator_config_post_init_runs_through_parser() -> None:
    with pytest.raises(ValueError, match="num_positions"):
        from_parameters(EstimatorConfig, {"num_positions": "0"})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_positions", 0),
        ("refit_interval", 0),
        ("ridge", -1.0),
        ("ridge", float("nan")),
        ("damping", -0.5),
        ("feature_clamp", 0.0),
        ("min_slope", 0.0),
        ("initial_slope", 0.0),
        ("initial_intercept", float("inf")),
    ],
)
def test_estimator_config_validation(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EstimatorConfig(**{field: value})
