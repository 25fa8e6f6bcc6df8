"""The generate body schema: which JSON fields a /generate body may carry, and their types.

Triton 2.51 answers 500, not 400, when a generate field has the wrong JSON type, and it may keep
another duplicate key than Python does; the front checks every /generate and /generate_stream
body against the public model's inputs (read from its config.pbtxt) before forwarding it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from avspec.serving import pbtxt
from avspec.serving.entry_interface import ENTRY_INPUTS

_INT_RANGES: dict[str, tuple[int, int]] = {
    "TYPE_INT8": (-(2**7), 2**7 - 1),
    "TYPE_INT16": (-(2**15), 2**15 - 1),
    "TYPE_INT32": (-(2**31), 2**31 - 1),
    "TYPE_INT64": (-(2**63), 2**63 - 1),
    "TYPE_UINT8": (0, 2**8 - 1),
    "TYPE_UINT16": (0, 2**16 - 1),
    "TYPE_UINT32": (0, 2**32 - 1),
    "TYPE_UINT64": (0, 2**64 - 1),
}
_FLOAT_MAX: dict[str, float] = {
    "TYPE_FP16": 65504.0,
    "TYPE_BF16": 3.3895313892515355e38,
    "TYPE_FP32": 3.4028234663852886e38,
    "TYPE_FP64": 1.7976931348623157e308,
}
SUPPORTED_DTYPES = frozenset({"TYPE_STRING", "TYPE_BOOL", *_INT_RANGES, *_FLOAT_MAX})


@dataclass(frozen=True)
class InputSpec:
    """One model input as a /generate JSON field: its Triton dtype, and whether it must be sent."""

    dtype: str
    required: bool = True
    array: bool = False  # dims [ -1 ]: a JSON array of values, not one value

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r} for a generate field")


GenerateSchema = Mapping[str, InputSpec]


def input_spec(data_type: int, dims: Sequence[int], optional: bool) -> InputSpec:
    """The generate field of a model input: its Triton data type (`mc.TYPE_*`), required unless
    optional, an array when its dims are [ -1 ]."""
    return InputSpec(pbtxt.type_name(data_type), not optional, list(dims) == [-1])


# The entry model's inputs, declared once (avspec.serving.entry_interface; its config.pbtxt is
# rendered from the same declaration).
DEFAULT_GENERATE_SCHEMA: GenerateSchema = MappingProxyType(
    {t.name: input_spec(t.data_type, t.dims, t.optional) for t in ENTRY_INPUTS}
)


def generate_schema_from_config(config_pbtxt_text: str) -> dict[str, InputSpec]:
    """The generate schema of a Triton config.pbtxt (parsed as Triton's ModelConfig): one field
    per input, required unless `optional: true`, an array when its dims are [ -1 ]."""
    config = pbtxt.parse(config_pbtxt_text)
    if not config.input:
        raise ValueError("config.pbtxt has no `input [ ... ]` block")
    return {
        spec.name: input_spec(spec.data_type, spec.dims, spec.optional) for spec in config.input
    }


class _NonFinite:
    """A NaN/Infinity literal, kept by the JSON parser so the error can name its field."""

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def __repr__(self) -> str:
        return self.literal


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Duplicate keys are refused: Triton's parser may keep another duplicate than Python's.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate JSON key {key!r}")
        result[key] = value
    return result


def parse_json(body: bytes) -> Any:
    """Parse strictly: no duplicate keys; NaN/Infinity become `_NonFinite` (never valid)."""
    return json.loads(body, object_pairs_hook=_unique_object, parse_constant=_NonFinite)


def _describe(value: Any) -> str:
    if isinstance(value, _NonFinite):
        return value.literal
    kind = {bool: "boolean", str: "string", int: "number", float: "number", list: "array"}
    text = json.dumps(value) if not isinstance(value, dict) else "{...}"
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{kind.get(type(value), 'object')} {text}"


def _expected(dtype: str) -> str:
    if dtype == "TYPE_STRING":
        return "a string"
    if dtype == "TYPE_BOOL":
        return "a boolean (true or false)"
    if dtype in _INT_RANGES:
        low, high = _INT_RANGES[dtype]
        return f"an integer in [{low}, {high}]"
    return f"a finite number with magnitude at most {_FLOAT_MAX[dtype]:.7g}"


def _type_ok(dtype: str, value: Any) -> bool:
    if dtype == "TYPE_STRING":
        return isinstance(value, str)
    if dtype == "TYPE_BOOL":
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False  # bool is an int in Python, never a number in JSON
    if dtype in _INT_RANGES:
        low, high = _INT_RANGES[dtype]
        return isinstance(value, int) and low <= value <= high
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return abs(value) <= _FLOAT_MAX[dtype]  # exact for ints of any size, no float overflow


def check_generate_body(body: bytes, schema: GenerateSchema) -> dict[str, Any]:
    """Return the parsed /generate body, or raise ValueError saying which field is wrong."""
    try:
        request = parse_json(body)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"request body is not valid JSON: {err}") from None
    if not isinstance(request, dict):
        raise ValueError("request body must be a JSON object of input name -> value")
    unknown = sorted(set(request) - set(schema))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; accepted fields: {', '.join(schema)}")
    missing = [name for name, spec in schema.items() if spec.required and name not in request]
    if missing:
        raise ValueError(f"missing required field {missing[0]!r} ({schema[missing[0]].dtype})")
    for name, value in request.items():
        dtype = schema[name].dtype
        if schema[name].array:
            if not isinstance(value, list) or not all(_type_ok(dtype, v) for v in value):
                raise ValueError(
                    f"field {name!r} must be an array of {_expected(dtype)} ({dtype}), "
                    f"got {_describe(value)}"
                )
            continue
        if not _type_ok(dtype, value):
            raise ValueError(
                f"field {name!r} must be {_expected(dtype)} ({dtype}), got {_describe(value)}"
            )
        problem = unicode_problem(value) if isinstance(value, str) else None
        if problem is not None:
            raise ValueError(f"field {name!r} {problem}")
    return request


def unicode_problem(text: str) -> str | None:
    """What makes `text` no valid Unicode text, if anything: a lone UTF-16 surrogate.

    JSON lets a string escape one (`"\\ud800"`) and Python keeps it, but it is no character:
    Triton's parser answers 500 and UTF-8 cannot encode it. A valid pair arrives as one code
    point.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (
            f"is not valid Unicode text: lone UTF-16 surrogate escape "
            f"\\u{ord(text[err.start]):04x} at character {err.start} (a surrogate must come in "
            "a high-low pair)"
        )
    return None
