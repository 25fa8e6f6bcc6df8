"""The statuses the HTTP front answers with, and the error answers it builds itself.

Every error the front answers is `{"error": message}` with a status that tells the client what
to do (docs/serving.md, status codes); every 429 and 503, its own or relayed from Triton, says
when to retry (`Retry-After`). Triton 2.51 answers 400 to every error of a decoupled model, so
the entry's server-side errors are recognised by their first words (ENTRY_SERVER_ERRORS).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from aiohttp import web

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

    def __init__(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, tuple(headers)


def with_retry_after(status: int, headers: dict[str, str]) -> dict[str, str]:
    """`headers` with Retry-After added when `status` is worth retrying and none is set."""
    if status in RETRY_STATUSES and not any(k.lower() == "retry-after" for k in headers):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return headers


def error_response(
    status: int, message: str, headers: Iterable[tuple[str, str]] = ()
) -> web.Response:
    """`{"error": message}` with `status`, Retry-After on a 429 or 503."""
    return web.Response(
        status=status,
        body=json.dumps({"error": message}).encode(),
        content_type="application/json",
        headers=with_retry_after(status, dict(headers)),
    )


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
