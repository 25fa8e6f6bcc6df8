"""A request body checked once, at the boundary: strict JSON, then its schema (pydantic).

The JSON is parsed as on /v2 (front.schema.parse_json: no duplicate keys, NaN and Infinity kept
as what they are, never numbers), then validated against the route's model. A ValidationError
becomes OpenAI's 400 naming the field in `param` as the OpenAI API names it
(`messages[0].content`), with the rule the field's `description` states and the value sent
(cut, front.policy.shown): `temperature must be a number in [0, 2], got 2.5`. An unknown field
is `unrecognized request argument supplied: 'name'`, reported before any other mistake.
"""

from __future__ import annotations

import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from avspec.serving.front.openai.errors import OpenAIError, field_error
from avspec.serving.front.policy import shown
from avspec.serving.front.schema import parse_json

M = TypeVar("M", bound=BaseModel)
_ABSENT = object()


def validated(schema: type[M], body: bytes) -> M:
    """`body` as a `schema`; OpenAIError 400 naming what is wrong."""
    try:
        document = parse_json(body)
    except (ValueError, RecursionError) as err:
        raise OpenAIError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    try:
        return schema.model_validate(document)
    except ValidationError as err:
        raise refusal(schema, document, err) from None


def refusal(schema: type[BaseModel], document: dict[str, Any], err: ValidationError) -> OpenAIError:
    """The 400 of the first mistake `err` found in `document` (an unknown field first)."""
    error = min(err.errors(include_url=False), key=_rank)  # the first of the lowest rank
    if _rank(error) == 0:
        name = shown(error["loc"][0])
        return field_error(name[1:-1], f"unrecognized request argument supplied: {name}")
    param, rule, value = _located(schema, document, error)
    got = "" if value is _ABSENT else f", got {shown(value)}"
    return field_error(param, f"{param} {rule}{got}")


def _rank(error: ErrorDetails) -> int:
    if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:
        return 0
    return 1 if error["type"] == "value_error" else 2


def _located(
    schema: type[BaseModel], document: dict[str, Any], error: ErrorDetails
) -> tuple[str, str, Any]:
    """The field `error` is about (`messages[0].role`), the rule it broke, the value sent there
    (_ABSENT: none). The walk stops where the location leaves the schema's fields (a union's
    member, a key of no field)."""
    param, rule, value = "", "", document
    model: type[BaseModel] | None = schema
    for part in error["loc"]:
        if isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value):
            param, value = f"{param}[{part}]", value[part]
            rule = getattr(model, "RULE", rule)  # the list's items are `model`s
        elif model is not None and part in model.model_fields and isinstance(value, dict):
            info = model.model_fields[str(part)]
            param = f"{param}.{part}" if param else str(part)
            rule, value = info.description or rule, value.get(part, _ABSENT)
            model = _model_in(info.annotation)
        else:
            if error["type"] == "extra_forbidden":
                rule = f"takes no field {shown(part)}"
            break
    if error["type"] == "value_error":
        rule = str(error["ctx"]["error"])
    return param, rule, value


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The schema inside a field's type (`list[Message]`, `StreamOptions | None`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None
