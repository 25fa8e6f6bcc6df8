"""The bodies of `/v1/completions` and `/v1/chat/completions`: parsed, checked, made sampling.

What is accepted is what the entry model can honour: `max_tokens` (chat also
`max_completion_tokens`), `temperature` (0..2, as OpenAI), `top_p` (0..1], `seed`, `stop` (a
string or up to 4), `n` 1, `stream` with `stream_options.include_usage`. Parameters the entry
cannot honour are refused unless they carry their neutral value (penalties 0, no logprobs, no
logit bias, `best_of` 1, ...), and an unknown field is refused as the OpenAI API refuses it: a
client never gets a silently different answer. The speculative settings of the entry
(`num_draft_tokens`, `adaptive_verification`, `adaptive_drafting`) are accepted as extra fields
(the official client's `extra_body`). Every refusal is a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from avspec.serving.front.openai.errors import OpenAIError, field_error
from avspec.serving.front.policy import shown
from avspec.serving.front.schema import parse_json

MAX_STOPS = 4
MAX_MESSAGES = 1024  # a conversation's messages (each one costs the template a loop turn)
_INT32_MAX = (1 << 31) - 1
_SEED_SPAN = 1 << 64
EXTRAS = ("num_draft_tokens", "adaptive_verification", "adaptive_drafting")
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
    *EXTRAS,
}  # fmt: skip
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "echo", "suffix", "best_of"})
CHAT_FIELDS = frozenset(
    _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format"}
)
# Accepted only with these values: what the entry does anyway.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "response_format": (None, {"type": "text"}),
}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Sampling:
    """How to generate: the entry's inputs, plus what the front applies itself (stop strings,
    streaming and usage)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # already in 0..2^64-1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # the entry's speculative settings


@dataclass(frozen=True)
class Completion:
    model: str
    prompt: str
    sampling: Sampling


@dataclass(frozen=True)
class Chat:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling


def parse_completion(body: bytes, default_max_tokens: int) -> Completion:
    """A `/v1/completions` body; OpenAIError 400 naming the field that is wrong."""
    document = _object(body, COMPLETION_FIELDS)
    prompt = document.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise field_error("prompt", "prompt must be a non-empty string (one prompt per request)")
    max_tokens = _max_tokens(document, ("max_tokens",), default_max_tokens)
    return Completion(_model(document), prompt, _sampling(document, max_tokens))


def parse_chat(body: bytes, default_max_tokens: int) -> Chat:
    """A `/v1/chat/completions` body; OpenAIError 400 naming the field that is wrong."""
    document = _object(body, CHAT_FIELDS)
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise field_error("messages", "messages must be a non-empty array of messages")
    if len(messages) > MAX_MESSAGES:
        raise field_error(
            "messages", f"messages holds {len(messages)} messages; at most {MAX_MESSAGES}"
        )
    checked = [_message(message, i) for i, message in enumerate(messages)]
    names = ("max_completion_tokens", "max_tokens")
    max_tokens = _max_tokens(document, names, default_max_tokens)
    return Chat(_model(document), checked, _sampling(document, max_tokens))


def _object(body: bytes, fields: frozenset[str]) -> dict[str, Any]:
    try:
        document = parse_json(body)
    except (ValueError, RecursionError) as err:
        raise OpenAIError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    for name in document:
        if name not in fields:
            raise field_error(
                shown(name)[1:-1], f"unrecognized request argument supplied: {shown(name)}"
            )
    for name, allowed in _NEUTRAL.items():
        if name in document and not any(_same(document[name], a) for a in allowed):
            raise field_error(
                name,
                f"{name} is not supported by this server (only {allowed[-1]!r}), "
                f"got {shown(document[name])}",
            )
    return document


def _same(value: Any, allowed: Any) -> bool:
    """Equal and of the same JSON type: `0.0`, `false` and `0` are three different answers."""
    return type(value) is type(allowed) and value == allowed


def _model(document: dict[str, Any]) -> str:
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise field_error("model", "model must be a non-empty string (see GET /v1/models)")
    return model


def _number(document: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = document.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise field_error(
            name, f"{name} must be a number in [{low:g}, {high:g}], got {shown(value)}"
        )
    return float(value)


def _max_tokens(document: dict[str, Any], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = document.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT32_MAX:
            raise field_error(
                name, f"{name} must be an integer in [1, {_INT32_MAX}], got {shown(value)}"
            )
        return value
    return default


def _sampling(document: dict[str, Any], max_tokens: int) -> Sampling:
    n = document.get("n")
    if n is not None and not _same(n, 1):
        raise field_error(
            "n", f"n must be the integer 1: this server returns one choice, got {shown(n)}"
        )
    top_p = _number(document, "top_p", 1.0, 0.0, 1.0)
    if not np.float32(top_p) > 0:  # the entry samples in float32: 1e-300 would be 0 there
        raise field_error(
            "top_p", f"top_p must be in (0, 1] (at least about 1.4e-45), got {shown(top_p)}"
        )
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise field_error("stream", f"stream must be a boolean, got {shown(stream)}")
    seed = document.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < _SEED_SPAN
    ):
        raise field_error("seed", f"seed must be a 64-bit integer, got {shown(seed)}")
    extras = {name: document[name] for name in EXTRAS if document.get(name) is not None}
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(document, "temperature", 1.0, 0.0, 2.0),
        top_p=top_p,
        seed=None if seed is None else seed % _SEED_SPAN,
        stop=_stops(document.get("stop")),
        stream=bool(stream),
        include_usage=_include_usage(document.get("stream_options"), bool(stream)),
        extras=extras,
    )


def _stops(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise field_error(
            "stop",
            f"stop must be a non-empty string or up to {MAX_STOPS} of them, got {shown(value)}",
        )
    return tuple(dict.fromkeys(stops))


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise field_error("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise field_error("stream_options", "stream_options takes only include_usage")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise field_error("stream_options", "stream_options.include_usage must be a boolean")
    return include


def _message(message: Any, index: int) -> dict[str, Any]:
    """A chat message with its content as one string (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise field_error(where, f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise field_error(f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise field_error(f"{where}.content", "only text content parts are supported")
        if not all(isinstance(p.get("text"), str) for p in content):
            raise field_error(f"{where}.content", "a text content part needs a string text")
        content = "".join(p["text"] for p in content)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise field_error(f"{where}.content", f"{where}.content must be a string")
    return {**message, "content": content}
