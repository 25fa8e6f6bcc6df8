"""OpenAI's error object, and the status each of the front's failures gets on the /v1 routes.

`{"error": {"message", "type", "param", "code"}}` as the OpenAI API sends it (the official client
reads `message` and `code` from it): 400 `invalid_request_error` naming the field in `param`,
404 `model_not_found`, 429 / 503 with `Retry-After` when the server or this client is over a
limit, 500 `server_error` when a stage failed. The front's own refusals (HttpError) and the
entry model's errors (front.openai.triton_engine.entry_error) map onto the same statuses as on
/v2.
"""

from __future__ import annotations

import json

from aiohttp import web

from avspec.serving.front.http_status import with_retry_after

_TYPES = {  # status -> OpenAI error type
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "overloaded_error",
}


class OpenAIError(Exception):
    """An answer in OpenAI's error format: status, message, and the field it is about."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The error object, `{"error": {...}}`."""
        kind = _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type="application/json",
            headers=with_retry_after(self.status, {}),
        )


def field_error(param: str, message: str) -> OpenAIError:
    """400 naming the request field `param`."""
    return OpenAIError(400, message, param=param)
