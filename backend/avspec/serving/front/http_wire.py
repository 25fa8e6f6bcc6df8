"""HTTP/1.1 on the wire for the front: parsing request heads, routing, building the upstream
request and the responses. No I/O here; the relay (http_relay) does the reading and writing.

Routing: health (live, ready) and server metadata, and for each public model metadata, ready,
generate, generate_stream and infer. Anything else is refused with 403 unless the request carries
the operator's admin key, in which case it is forwarded as is (only the front reaches Triton,
so this check is the only one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import NamedTuple

from avspec.serving.exposure import ADMIN_KEY_HEADER, CLIENT_HEADER
from avspec.serving.front.config import FrontConfig
from avspec.serving.front.policy import (
    RESERVED_MARK,
    admin_authorized,
    model_refusal,
    refusal,
    reserved_parameter,
)
from avspec.serving.front.schema import parse_json

_REQUEST_LINE = re.compile(r"([A-Z]{1,20}) (/[\x21-\x7e]*) HTTP/(1\.[01])")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [^\r\n]*)?")
_MODEL_PATH = re.compile(
    r"/v2/models/(?P<model>[^/]+)(?:/versions/[0-9]+)?"
    r"(?P<action>|/ready|/generate|/generate_stream|/infer)"
)
_MODEL_ACTIONS = {  # action -> (method, kind)
    "": ("GET", "plain"),
    "/ready": ("GET", "plain"),
    "/generate": ("POST", "generate"),
    "/generate_stream": ("POST", "generate"),
    "/infer": ("POST", "infer"),
}
_INFERENCE_ACTIONS = frozenset({"/generate", "/generate_stream", "/infer"})
_STATISTICS_PATH = "/v2/models/stats"  # Triton's statistics API, not a model named "stats"
_SERVER_PATHS = {  # path -> kind; all GET
    "/v2": "plain",
    "/v2/health/live": "plain",
    "/v2/health/ready": "ready",
}
# Hop-by-hop headers belong to one connection, never forwarded (RFC 9110 section 7.6.1).
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "host",
        "content-length",
    }
)


# A 429 or 503 tells the client when to retry: a decode step or two frees a queue slot, and a
# stage restart takes 1-2 s.
RETRY_STATUSES = frozenset({429, 503})
RETRY_AFTER_S = 1

# Triton 2.51 answers 400 to every error a decoupled model sends over /generate, whatever its
# TritonError code (measured on the bundled server: the entry's UNAVAILABLE "overloaded" and
# INTERNAL "generation failed" both came back 400, which clients take for their own mistake).
# The entry's errors that are not the client's fault start with these words; the front gives
# them the status Triton gives those codes elsewhere (UNAVAILABLE 503, INTERNAL 500).
ENTRY_SERVER_ERRORS: tuple[tuple[str, int], ...] = (
    ("overloaded", 503),  # avspec.engine.admission.Overloaded: the wait queue is full
    ("request ran past the server's limit", 503),  # avspec.engine.scheduler.RequestTimedOut
    ("generation failed", 500),  # a stage failed mid-request (the entry's _Client.on_error)
)


class HttpError(Exception):
    """An answer the front gives itself: status, message (sent as `{"error": ...}`), headers."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


class ClientGone(Exception):
    """The client closed its connection; nothing left to answer."""


@dataclass
class Request:
    """A parsed request head: request line, and header fields in order."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    def values(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name]


class Route(NamedTuple):
    """How the front handles a request it forwards.

    kind: "plain" (forward as is), "ready", "generate" (check the body) or "infer".
    admin: the request carries the operator key (checked here; never forwarded).
    inference: a model's generate, generate_stream or infer (Front.abort_inference ends it).
    """

    kind: str
    admin: bool
    inference: bool


def response(
    status: int,
    body: bytes = b"",
    content_type: str = "application/json",
    headers: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A whole response, `Connection: close`; a 429 or 503 says when to retry (Retry-After)."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
    if body:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{name}: {value}" for name, value in headers]
    if status in RETRY_STATUSES and not any(name.lower() == "retry-after" for name, _ in headers):
        lines.append(f"Retry-After: {RETRY_AFTER_S}")
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def error_response(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    return response(status, json.dumps({"error": message}).encode(), headers=headers)


def error_event_chunk(message: str) -> bytes:
    """A last SSE event `data: {"error": ...}` as one chunk, then the chunked body's end."""
    event = b"data: " + json.dumps({"error": message}).encode() + b"\n\n"
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event)


def parse_head(head: bytes) -> Request:
    """Parse a request head (request line and header fields, CRLF-terminated)."""
    text = head.decode("latin-1")
    lines = text.lstrip("\r\n").split("\r\n")[:-2]  # the head ends with an empty line
    match = _REQUEST_LINE.fullmatch(lines[0]) if lines else None
    if match is None:
        raise HttpError(400, "malformed request line (expected: METHOD /path HTTP/1.1)")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        # A bare CR or LF (or a folded line) could split into two headers upstream: refuse.
        if not colon or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise HttpError(400, f"malformed header line {line[:60]!r}")
        headers.append((name, value.strip(" \t")))
    return Request(match.group(1), match.group(2), match.group(3), headers)


def content_length(request: Request) -> int:
    if request.values("transfer-encoding"):
        raise HttpError(411, "chunked request bodies are not accepted: send a Content-Length")
    values = {v for value in request.values("content-length") for v in value.split(",")}
    values = {v.strip() for v in values}
    if not values:
        if request.method == "POST":
            raise HttpError(411, "a POST needs a Content-Length header")
        return 0
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise HttpError(400, "invalid Content-Length")
    return int(next(iter(values)))


def route(config: FrontConfig, request: Request) -> Route:
    """The route of a request the front forwards; raise HttpError otherwise."""
    keys = request.values(ADMIN_KEY_HEADER)
    admin = admin_authorized(config, keys)
    path = request.path
    model_match = _MODEL_PATH.fullmatch(path) if path != _STATISTICS_PATH else None
    inference = model_match is not None and model_match.group("action") in _INFERENCE_ACTIONS
    if path in _SERVER_PATHS:
        method, kind = "GET", _SERVER_PATHS[path]
    elif model_match is not None:
        method, kind = _MODEL_ACTIONS[model_match.group("action")]
        model = model_match.group("model")
        if model not in config.public_models:
            if admin:
                return Route("plain", True, inference)
            internal, message = model_refusal(config, model)
            raise HttpError(403 if internal else 404, message)
    elif admin:
        return Route("plain", True, False)
    else:
        raise HttpError(403, refusal(config, f"path {path!r}", keys))
    if request.method != method:
        if admin:
            return Route("plain", True, inference)
        raise HttpError(405, f"{path} takes {method} only", (("Allow", method),))
    return Route(kind, admin, inference)


def check_infer(request: Request, body: bytes) -> None:
    """Refuse request parameters named `avspec-*`; Triton's own checks do the rest."""
    header_length = request.values("inference-header-content-length")
    json_part = body
    if header_length:
        if len(header_length) != 1 or not header_length[0].isdigit():
            raise HttpError(400, "invalid Inference-Header-Content-Length")
        json_part = body[: int(header_length[0])]
    try:
        document = parse_json(json_part)
    except (ValueError, RecursionError) as err:
        raise HttpError(400, f"inference request header is not valid JSON: {err}") from None
    parameters = document.get("parameters") if isinstance(document, dict) else None
    name = reserved_parameter(parameters) if isinstance(parameters, dict) else None
    if name is not None:
        raise HttpError(400, f"request parameter {name!r} is reserved for the front")


def upstream_head(
    config: FrontConfig, request: Request, body: bytes, admin: bool, identity: str
) -> bytes:
    """The request as sent to Triton: hop-by-hop and `avspec` headers dropped (the admin key
    among them), the caller's identity added, `Connection: close`. `admin` is unused upstream:
    only the front can reach Triton, so the front alone checks the key."""
    connection_tokens = {
        token.strip().lower()
        for value in request.values("connection")
        for token in value.split(",")
    }
    lines = [f"{request.method} {request.target} HTTP/1.1", "Host: localhost"]
    for name, value in request.headers:
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in connection_tokens or RESERVED_MARK in lower:
            continue
        lines.append(f"{name}: {value}")
    lines.append(f"{CLIENT_HEADER}: {identity}")
    if body or request.method not in ("GET", "HEAD"):
        lines.append(f"Content-Length: {len(body)}")
    lines += ["Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def error_message(body: bytes) -> str | None:
    """The message of the first `{"error": "..."}` object in an error body: Triton's JSON
    answer, or the `data: {...}` event of an event stream."""
    text = body.decode("utf-8", "replace")
    start = text.find("{")
    try:
        document, _ = json.JSONDecoder().raw_decode(text, max(start, 0))
    except ValueError:
        return None
    message = document.get("error") if isinstance(document, dict) else None
    return message if isinstance(message, str) else None


def entry_error_status(body: bytes) -> int:
    """The status of a generate call that Triton answered 400 with this body: the entry's
    server-side errors (ENTRY_SERVER_ERRORS) get theirs, anything else stays 400."""
    message = error_message(body) or ""
    for prefix, status in ENTRY_SERVER_ERRORS:
        if message.startswith(prefix):
            return status
    return 400


def parse_status(head: bytes) -> int:
    match = _STATUS_LINE.fullmatch(head.split(b"\r\n", 1)[0])
    if match is None:
        raise HttpError(502, "malformed response from Triton")
    return int(match.group(1))


class ResponseHead(NamedTuple):
    """Triton's response head as relayed: `Connection: close`, and how its body is framed."""

    head: bytes
    chunked: bool
    length: int | None
    event_stream: bool  # Content-Type text/event-stream (generate_stream's SSE)


def rewrite_head(head: bytes) -> ResponseHead:
    """Triton's head as relayed: `Connection: close`, and Retry-After on a 429 or 503."""
    lines = head.decode("latin-1").split("\r\n")[:-2]
    kept = [lines[0]]
    chunked, length, event_stream = False, None, False
    retry_after = parse_status(head) not in RETRY_STATUSES
    for line in lines[1:]:
        name, _, value = line.partition(":")
        lower = name.strip().lower()
        if lower in ("connection", "keep-alive", "proxy-connection"):
            continue
        retry_after = retry_after or lower == "retry-after"
        if lower == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
        elif lower == "content-length" and value.strip().isdigit():
            length = int(value.strip())
        elif lower == "content-type" and value.strip().lower().startswith("text/event-stream"):
            event_stream = True
        kept.append(line)
    if not retry_after:
        kept.append(f"Retry-After: {RETRY_AFTER_S}")
    kept += ["Connection: close", "", ""]
    return ResponseHead("\r\n".join(kept).encode("latin-1"), chunked, length, event_stream)
