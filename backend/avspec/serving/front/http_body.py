"""The HTTP relay's request bodies: read within the limits, and checked before forwarding.

* `read_body`: a body over `max_body_bytes` gets 413 before a byte is read, also in place of
  `100 Continue` (Triton 2.51's HTTP front end crashes on a ~10 MB body sent with
  `Expect: 100-continue`, so the front answers it itself); a POST without a body is 411, a body
  not sent within `read_timeout_s` 408, one that does not decode (gzip, deflate, br) 400;
* `checked_generate`: a generate body type-checked against the model's inputs (front.schema),
  re-serialised with the caller's identity as the field `"avspec-client"`;
* `check_infer`: infer parameters named `avspec-*` refused (Triton's own checks do the rest).
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import _default_expect_handler

from avspec.serving.exposure import CLIENT_HEADER
from avspec.serving.front.http_status import HttpError
from avspec.serving.front.policy import reserved_parameter, shown
from avspec.serving.front.schema import GenerateSchema, check_generate_body, parse_json


async def read_body(request: web.BaseRequest, limit: int, timeout_s: float) -> bytes:
    """The body, read only once its declared size is within `limit` bytes (413 otherwise), and
    within `timeout_s` (408)."""
    length = request.content_length
    if length is not None and length > limit:
        message = f"request body of {length} bytes exceeds the limit of {limit} bytes"
        raise HttpError(413, message)
    if not request.body_exists:
        if request.method == "POST" and length is None:
            raise HttpError(411, "a POST needs a body: a Content-Length or a chunked body")
        return b""
    expect = request.headers.getall("Expect", [])
    if expect:
        if [value.lower() for value in expect] != ["100-continue"]:
            raise HttpError(417, "only 'Expect: 100-continue' is supported")
        if request.version == HttpVersion11:
            # answered here, never by Triton (it crashes on large bodies after 100-continue)
            # aiohttp's interim 100 Continue (typed for web.Request, works on any request)
            await _default_expect_handler(request)  # type: ignore[arg-type]
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:  # a chunked body has no size to check beforehand
                    message = f"request body exceeds the limit of {limit} bytes"
                    raise HttpError(413, message)
    except TimeoutError:
        raise HttpError(408, "timed out reading the request body") from None
    except RequestPayloadError as err:  # aiohttp decodes gzip, deflate and br bodies
        request.content.feed_eof()  # nothing more to read (or to linger over) on it
        encoding = request.headers.get("Content-Encoding")
        what = f"valid {shown(encoding)} data" if encoding else "a well-formed body"
        cause = err.__cause__ if isinstance(err.__cause__, Exception) else err
        reason = str(cause).replace("\n", " ").strip()
        raise HttpError(400, f"request body is not {what} ({reason})") from None
    return bytes(body)


def checked_generate(body: bytes, schema: GenerateSchema, identity: str) -> bytes:
    """The checked body, re-serialised, with the caller's identity as `avspec-client`."""
    try:
        request = check_generate_body(body, schema)
    except ValueError as err:
        raise HttpError(400, str(err)) from None
    request[CLIENT_HEADER] = identity
    return json.dumps(request, allow_nan=False, separators=(",", ":")).encode()


def check_infer(request: web.BaseRequest, body: bytes) -> None:
    """Refuse request parameters named `avspec-*`; Triton's own checks do the rest."""
    header_length = request.headers.getall("Inference-Header-Content-Length", [])
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
