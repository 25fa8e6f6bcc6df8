"""The HTTP relay: the front's public HTTP port, forwarding to Triton's HTTP (front.http_upstream).

Why aiohttp: it is already a dependency (tritonclient[all] pulls it in; the metrics port is an
aiohttp server too), it is asyncio-native, so the HTTP side runs on the same event loop as the
gRPC relay (grpc.aio) and Front.abort_inference reaches both with one call, and it gives the two
halves a proxy needs: a server (llhttp parser, keep-alive, chunked bodies, pipelining) and a
client with a connection pool over a Unix socket. FastAPI on uvicorn, as Triton's own OpenAI
frontend uses, would add a framework (Starlette, pydantic), an ASGI server with its own loop and
lifecycle, and still need an HTTP client (httpx) for the upstream side; its routing and
validation would not replace the front's rules, which are neither REST routes nor pydantic
models. So aiohttp parses HTTP on both sides, and the project keeps only its rules:

* routes (front.http_routes): what is public, what needs the operator's admin key;
* who may call (policy): with API keys configured, every route but health and the page needs
  `Authorization: Bearer KEY` (401), the key's name the caller's identity; a `Host` that is not
  an IP, localhost or an allowed name is 421 (DNS rebinding); a POST with a foreign `Origin` is
  403 and the /v1 routes take JSON only (415): a page on another site cannot spend compute;
* a request head of at most `max_header_bytes` (431; Triton 2.51 breaks on heads past about
  8.1 KB), read within `header_timeout_s` (408; front.http_connection), connections per IP address
  and in total (429 / 503; front.limits);
* bodies over `max_body_bytes` get 413 before a byte is read, also in place of
  `100 Continue` (Triton 2.51's HTTP front end crashes on a ~10 MB body sent with
  `Expect: 100-continue`); generate bodies are type-checked against the model's inputs
  (front.schema), infer parameters named `avspec-*` refused (front.http_body);
* the caller's identity (its key's name, or its IP; see policy) goes upstream in header
  `avspec-client` and, for
  generate and generate_stream, as the body field `"avspec-client"`: Triton 2.51 does not
  forward HTTP headers to the model for /generate, but makes unknown generate fields request
  parameters. A client cannot send that field itself (an unknown field is a 400);
* Triton's 400 to a generate call is read whole and given the status the entry model meant
  (http_status.ENTRY_SERVER_ERRORS: 503 for a full queue, 500 for a failed stage); every 429
  and 503 says `Retry-After`.

Every inference call is registered for `Front.abort_inference`, which ends it: with a 503 if the
response has not started, with a last SSE event `data: {"error": ...}` and a proper end of the
body if an event stream is under way at an event boundary, and by closing the connection
otherwise (a body cut short cannot be ended cleanly). A client that goes away cancels its call
(aiohttp cancels the handler), which closes the upstream connection, and Triton cancels the
request. The front's own routes (OpenAI-compatible API, playground page) are handlers given to
the relay by kind (front.http_routes.FRONT_KINDS).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from avspec.serving.exposure import ADMIN_KEY_HEADER
from avspec.serving.front.config import FrontConfig
from avspec.serving.front.http_body import check_infer, checked_generate, read_body
from avspec.serving.front.http_connection import ConnectionServer, FrontConnection
from avspec.serving.front.http_routes import Route, route
from avspec.serving.front.http_status import (
    HttpError,
    entry_error_status,
    error_response,
    with_retry_after,
)
from avspec.serving.front.http_upstream import HOP_BY_HOP, Upstream, forwarded_headers
from avspec.serving.front.inflight import Abortable, InFlight, abortable
from avspec.serving.front.limits import Slots
from avspec.serving.front.policy import (
    RESTARTING,
    Unauthorized,
    host_allowed,
    key_identity,
    shown,
    stage_ready,
)

_log = logging.getLogger(__name__)

_LINGER_S = 1.0  # after an early answer: how long aiohttp swallows a body the client still sends
_WHOLE_BODY = 1 << 20  # an answer up to this size is read whole and sent in one write
_ERROR_BODY_LIMIT = 64 << 10  # an error answer read whole (Triton's are a line of JSON)
_MAX_HEADERS = 64  # header fields per request (the openai client sends about 17)
_CLOSE_WAIT_S = 0.2  # stop(): how long a connection's handler may finish before it is cancelled

# A route the front serves itself: (request, checked body, identity, the call's Abortable when
# it is an inference call) -> response; it answers an abort itself (front.inflight.Abortable).
FrontHandler = Callable[
    [web.BaseRequest, bytes, str, Abortable | None], Awaitable[web.StreamResponse]
]
ErrorFormat = Callable[[HttpError], web.StreamResponse]


@dataclass
class _Exchange:
    """What one forwarded call has sent so far (to end it cleanly when it is aborted)."""

    response: web.StreamResponse | None = None  # set once the response is about to start
    event_stream: bool = False
    at_event_end: bool = True  # what was written so far ends with a whole SSE event
    complete: bool = False  # the whole response has been written


def head_bytes(request: web.BaseRequest) -> int:
    """The size of the request head as the client sent it (request line, fields, CRLFs)."""
    line = len(request.method) + len(request.raw_path) + len(" HTTP/1.1\r\n") + 1
    return line + sum(len(name) + len(value) + 4 for name, value in request.raw_headers) + 2


def error_event(message: str) -> bytes:
    """A last SSE event `data: {"error": ...}`."""
    return b"data: " + json.dumps({"error": message}).encode() + b"\n\n"


class HttpRelay:
    """The public HTTP port: the front's rules, aiohttp's HTTP, Triton behind."""

    def __init__(self, config: FrontConfig, inflight: InFlight) -> None:
        self.config = config
        self.port = 0
        self.upstream = Upstream(config)
        self._inflight = inflight
        self._slots = Slots(
            config.max_per_address,
            config.max_connections,
            noun="open connections",
            total_noun="open connections",
        )
        self._front_handlers: dict[str, FrontHandler] = {}
        self._error_formats: list[tuple[str, ErrorFormat]] = []
        self._server: ConnectionServer | None = None
        self._listener: asyncio.Server | None = None
        self._closers: list[Callable[[], None]] = []

    def serve(self, kind: str, handler: FrontHandler) -> None:
        """Serve the front's own route `kind` (front.http_routes.FRONT_KINDS) with `handler`."""
        self._front_handlers[kind] = handler

    def on_close(self, closer: Callable[[], None]) -> None:
        """Call `closer` when the relay closes (a route's own resources)."""
        self._closers.append(closer)

    def format_errors(self, prefix: str, error_format: ErrorFormat) -> None:
        """Answer the front's refusals of paths under `prefix` with `error_format`."""
        self._error_formats.append((prefix, error_format))

    async def open(self) -> None:
        await self.upstream.open()
        limit = self.config.max_header_bytes
        self._server = ConnectionServer(
            self._handle,
            self._slots,
            handler_cancellation=True,  # a client that goes away cancels its call
            keepalive_timeout=self.config.header_timeout_s,
            lingering_time=_LINGER_S,
            max_line_size=limit,
            max_field_size=limit,
            max_headers=_MAX_HEADERS,
            access_log=None,
            logger=_log,
        )
        self._listener = await asyncio.get_running_loop().create_server(
            self._server,
            self.config.host,
            self.config.http_port,
            backlog=min(self.config.max_connections, 4096),
        )
        self.port = self._listener.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            for connection in self._server.connections:
                connection.force_close()  # cancels its handler: calls in flight end here
            await self._server.shutdown(_CLOSE_WAIT_S)
        if self._listener is not None:
            await self._listener.wait_closed()
        await self.upstream.close()
        for closer in self._closers:
            closer()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = request.protocol
        assert isinstance(connection, FrontConnection)
        connection.request_started()
        try:
            return await self._serve(request)
        except HttpError as err:
            response = self._error(request.raw_path, err)
            # a body left unread, or a connection refused at accept: end the connection after
            if connection.refusal is not None or not request.content.is_eof():
                response.force_close()
            return response
        finally:
            connection.request_ended()

    def _error(self, path: str, err: HttpError) -> web.StreamResponse:
        for prefix, error_format in self._error_formats:
            if path.startswith(prefix):
                return error_format(err)
        return error_response(err.status, err.message, err.headers)

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        connection = request.protocol
        assert isinstance(connection, FrontConnection)
        if connection.refusal is not None:  # over a cap at accept: answered once a head came
            raise HttpError(*connection.refusal)
        if head_bytes(request) > self.config.max_header_bytes:
            limit = self.config.max_header_bytes
            raise HttpError(431, f"request head exceeds {limit} bytes")
        host = request.headers.get("Host")  # none only on HTTP/1.0, never from a browser
        if host is not None and not host_allowed(self.config, host):
            raise HttpError(
                421,
                f"Host {shown(host)} is not a name of this server "
                "(IP addresses and localhost are; operators add names with --allowed-hosts)",
            )
        path = request.raw_path.partition("?")[0]
        found = route(
            self.config, request.method, path, request.headers.getall(ADMIN_KEY_HEADER, [])
        )
        identity = connection.identity  # the address, set once per connection
        if found.kind not in OPEN_KINDS:
            try:
                identity = (
                    key_identity(self.config, request.headers.getall("Authorization", []))
                    or identity
                )
            except Unauthorized as err:
                raise HttpError(401, str(err), (("WWW-Authenticate", "Bearer"),)) from None
        if request.method == "POST":
            check_cross_site(request, found)
        body = await read_body(request, self.config.max_body_bytes, self.config.read_timeout_s)
        if found.kind == "generate":
            body = checked_generate(body, self.config.generate_schema, identity)
        elif found.kind == "infer":
            check_infer(request, body)
        if found.inference and not await stage_ready(self.config.ready):
            raise HttpError(503, RESTARTING)  # fail fast instead of inside a stage
        if found.kind == "ready":
            return await self._serve_ready(identity)
        handler = self._front_handlers.get(found.kind)
        if handler is not None:
            if not found.inference:
                return await handler(request, body, identity, None)
            with abortable(self._inflight) as call:
                return await handler(request, body, identity, call)
        if found.kind not in ("plain", "live", "generate", "infer"):
            raise HttpError(404, f"{path} is not served by this front")
        return await self._forward(request, body, found, identity)

    async def _serve_ready(self, identity: str) -> web.StreamResponse:
        """200 only if the stages (config.ready) and Triton are ready; 503 otherwise."""
        if not await stage_ready(self.config.ready):
            return error_response(503, "not ready: the serving stages are not ready")
        try:
            async with asyncio.timeout(self.config.connect_timeout_s * 2):
                answer = await self.upstream.send("GET", "/v2/health/ready", [], identity)
                answer.release()
        except (HttpError, TimeoutError) as err:
            return error_response(503, f"not ready: Triton is unreachable ({err})")
        if answer.status != 200:
            return error_response(503, f"not ready: Triton answered {answer.status}")
        return web.Response(status=200)

    async def _forward(
        self, request: web.BaseRequest, body: bytes, found: Route, identity: str
    ) -> web.StreamResponse:
        """Send the request upstream and relay the answer; end it if it is aborted."""
        exchange = _Exchange()
        if not found.inference:
            return await self._relay(request, body, found, identity, exchange)
        with abortable(self._inflight) as call:
            try:
                return await self._relay(request, body, found, identity, exchange)
            except asyncio.CancelledError:
                if not call.resume():
                    raise
        assert call.message is not None
        return await self._end_aborted(request, exchange, call.message)

    async def _end_aborted(
        self, request: web.BaseRequest, exchange: _Exchange, message: str
    ) -> web.StreamResponse:
        """Answer an aborted call as well as what was already sent allows."""
        response = exchange.response
        if response is None or not response.prepared:
            return error_response(503, message)
        if exchange.complete:
            return response
        if exchange.event_stream and exchange.at_event_end:
            await self._write(response, error_event(message))
            await response.write_eof()
            return response
        # mid-event or mid-body: no clean end exists, so the connection ends here
        if request.transport is not None:
            request.transport.abort()
        return response

    async def _relay(
        self,
        request: web.BaseRequest,
        body: bytes,
        found: Route,
        identity: str,
        exchange: _Exchange,
    ) -> web.StreamResponse:
        connection = ",".join(request.headers.getall("Connection", ()))
        headers = forwarded_headers(
            request.headers.items(), connection.split(",") if connection else ()
        )
        # the body was read (and decoded) here: it goes on as plain bytes, no key with it
        headers = [(k, v) for k, v in headers if k.lower() not in _READ_HERE]
        data = body if body or request.method not in ("GET", "HEAD") else None
        answer = await self.upstream.send(request.method, request.raw_path, headers, identity, data)
        try:
            return await self._answer(request, found, answer, exchange)
        except aiohttp.ClientError as err:  # Triton went away mid-answer
            if exchange.response is not None and exchange.response.prepared:
                raise ConnectionResetError("Triton's answer broke off") from None
            raise HttpError(502, f"Triton's answer broke off ({err!r})") from None
        finally:
            answer.release()  # back to the pool if read to its end, else closed

    async def _answer(
        self,
        request: web.BaseRequest,
        found: Route,
        answer: aiohttp.ClientResponse,
        exchange: _Exchange,
    ) -> web.StreamResponse:
        headers = with_retry_after(
            answer.status,
            {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP},
        )
        length = answer.content_length
        if answer.status == 400 and found.kind == "generate":
            return await self._entry_error(answer, headers)
        exchange.event_stream = answer.content_type == "text/event-stream"
        if not exchange.event_stream and length is not None and length <= _WHOLE_BODY:
            data = await answer.read()
            return web.Response(status=answer.status, body=data, headers=headers)
        response = web.StreamResponse(status=answer.status, headers=headers)
        if length is not None:
            response.content_length = length
        exchange.response = response
        await response.prepare(request)
        ending = b""
        async for data in answer.content.iter_any():
            await self._write(response, data)
            ending = (ending + data)[-2:]
            exchange.at_event_end = ending == b"\n\n"
        await response.write_eof()
        exchange.complete = True
        return response

    async def _entry_error(
        self, answer: aiohttp.ClientResponse, headers: dict[str, str]
    ) -> web.Response:
        """Triton's 400 to a generate call, with the status the entry model meant.

        Triton 2.51 answers 400 whatever the code of a decoupled model's error
        (http_status.ENTRY_SERVER_ERRORS), so the body is read whole, its message decides the
        status, and it goes out as it came (same content type and bytes).
        """
        body = bytearray()
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                while chunk := await answer.content.readany():
                    body += chunk
                    if len(body) > _ERROR_BODY_LIMIT:
                        raise HttpError(502, "Triton's error answer is too long")
        except (aiohttp.ClientError, TimeoutError) as err:
            raise HttpError(502, f"Triton's error answer broke off ({err!r})") from None
        status = entry_error_status(bytes(body))
        return web.Response(
            status=status, body=bytes(body), headers=with_retry_after(status, headers)
        )

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        async with asyncio.timeout(self.config.read_timeout_s):  # a client that stopped reading
            await response.write(data)


# Kinds no API key is needed for: health (probes), the playground page.
OPEN_KINDS = frozenset({"ready", "live", "page"})
_READ_HERE = frozenset({"content-encoding", "authorization"})


def check_cross_site(request: web.BaseRequest, found: Route) -> None:
    """Refuse what a page on another site can make a browser send to this server.

    A cross-site page cannot read the answer, but a POST that needs no CORS preflight (a form,
    or `fetch` with a text/plain body) still spends the server's compute. Browsers name the
    page's origin in `Origin` on every cross-origin POST: one that is not this server's is 403.
    The front's own JSON routes (/v1) also take `application/json` only (415), which no page
    can send elsewhere without a preflight; /v2 keeps Triton's `curl -d` habit (a form type).
    """
    origin = request.headers.get("Origin")
    if origin is not None and urllib.parse.urlsplit(origin).netloc.lower() != (
        request.headers.get("Host", "").lower()
    ):
        raise HttpError(403, f"cross-origin request from {shown(origin)} refused")
    kind = request.content_type.lower() if "Content-Type" in request.headers else "none"
    if found.kind in JSON_KINDS and kind != "application/json":
        raise HttpError(415, f"Content-Type must be application/json, got {shown(kind)}")


JSON_KINDS = frozenset({"openai_completions", "openai_chat"})
