"""Component configuration: one frozen dataclass per component, one parser of Triton parameters.

`from_parameters` is the single place where a `config.pbtxt` `parameters` block becomes typed
values. It has one boolean rule, rejects unfilled `${...}` template placeholders and unknown
keys, and names the offending key in every error.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}
_PLACEHOLDER = re.compile(r"\$\{[^}]*\}")


def parse_bool(key: str, text: str) -> bool:
    """The one boolean rule: true/false/1/0/yes/no, case-insensitive, else ValueError."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"parameter {key!r}: {text!r} is not a boolean (true/false/1/0/yes/no)")


def _raw_value(key: str, value: str | dict) -> str:
    """Unwrap a Triton `{"string_value": ...}` entry or pass a plain string through."""
    if isinstance(value, Mapping):
        if "string_value" not in value:
            raise ValueError(f"parameter {key!r}: expected a 'string_value' entry, got {value!r}")
        value = value["string_value"]
    if not isinstance(value, str):
        raise ValueError(f"parameter {key!r}: expected a string, got {type(value).__name__}")
    if _PLACEHOLDER.search(value):
        raise ValueError(f"parameter {key!r}: unfilled template placeholder in {value!r}")
    return value


def _convert(key: str, text: str, kind: Any) -> Any:
    """Convert `text` to the dataclass field type `kind`."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if text.strip().lower() in ("", "none") and len(options) < len(typing.get_args(kind)):
            return None
        if len(options) != 1:
            raise ValueError(f"parameter {key!r}: unsupported field type {kind!r}")
        return _convert(key, text, options[0])
    if origin is tuple:
        element = typing.get_args(kind)[0]
        items = [s for s in (part.strip() for part in text.split(",")) if s]
        return tuple(_convert(key, item, element) for item in items)
    if kind is bool:
        return parse_bool(key, text)
    if kind in (int, float):
        try:
            return kind(text.strip())
        except ValueError:
            message = f"parameter {key!r}: {text!r} is not a valid {kind.__name__}"
            raise ValueError(message) from None
    if kind is str:
        return text
    if kind is Path:
        return Path(text)
    raise ValueError(f"parameter {key!r}: unsupported field type {kind!r}")


def from_parameters(
    cls: type[T], params: Mapping[str, str | dict], ignore: Collection[str] = ()
) -> T:
    """Build the config dataclass `cls` from a Triton `parameters` block.

    Values are plain strings or `{"string_value": "..."}`. Keys not naming a field must be listed
    in `ignore`; missing fields take their dataclass default; a field without default is required.
    The dataclass's own `__post_init__` validation runs last.
    """
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(k for k in params if k not in fields and k not in ignore)
    if unknown:
        raise ValueError(f"unknown parameter(s) for {cls.__name__}: {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name in params:
            values[name] = _convert(name, _raw_value(name, params[name]), hints[name])
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"missing required parameter {name!r} for {cls.__name__}")
    return cls(**values)


@dataclass(frozen=True)
class EstimatorConfig:
    """The online acceptance estimator (spec section 2 and 3), reference values as defaults."""

    num_positions: int = 8  # K, draft positions with their own intercept
    initial_slope: float = 0.5
    initial_intercept: float = -0.2
    refit_interval: int = 100  # decode steps between Newton refits
    ridge: float = 1e-3
    damping: float = 50.0  # evidence damping: step scaled by n / (n + damping)
    feature_clamp: float = 40.0
    min_slope: float = 1e-3  # the slope is kept positive
    # Trust region: one refit moves the slope and each intercept by at most this much. Not in the
    # reference; without it saturated predictions (C_k = sum p(1 - p) -> 0) let one Newton step
    # throw an intercept to -1e6, where p = 0, no draft at that position is verified again and
    # the fit never returns (seen on the fleet test's tiny pair). inf: the reference's step.
    max_step: float = 2.0

    def __post_init__(self) -> None:
        if self.num_positions < 1:
            raise ValueError(f"num_positions must be >= 1, got {self.num_positions}")
        if self.refit_interval < 1:
            raise ValueError(f"refit_interval must be >= 1, got {self.refit_interval}")
        if not self.ridge >= 0:
            raise ValueError(f"ridge must be >= 0, got {self.ridge}")
        if not self.damping >= 0:
            raise ValueError(f"damping must be >= 0, got {self.damping}")
        if not self.feature_clamp > 0:
            raise ValueError(f"feature_clamp must be > 0, got {self.feature_clamp}")
        if not self.min_slope > 0:
            raise ValueError(f"min_slope must be > 0, got {self.min_slope}")
        if not self.max_step > 0:
            raise ValueError(f"max_step must be > 0 (inf: uncapped), got {self.max_step}")
        if not self.initial_slope >= self.min_slope:
            raise ValueError(
                f"initial_slope must be >= min_slope ({self.min_slope}), got {self.initial_slope}"
            )
        if not abs(self.initial_intercept) < float("inf"):
            raise ValueError(f"initial_intercept must be finite, got {self.initial_intercept}")
