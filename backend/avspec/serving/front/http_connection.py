"""The front's HTTP connections: aiohttp's server protocol plus the front's connection rules.

aiohttp parses HTTP/1.1 (llhttp, strict: a Content-Length with a Transfer-Encoding, two
Content-Lengths, a bare LF, an obsolete line fold are 400), keeps connections alive, reads
chunked bodies and serves pipelined requests in order. What the front adds per connection:

* caps per IP address and in total (front.limits): a connection past its address's cap gets
  429, past the total 503, both with Retry-After, as the answer to its first request (answered
  before the request arrived, the client's write met a closed socket: a broken pipe); it holds
  no slot meanwhile, and past `total` (at least MIN_REFUSED) such connections waiting, one is
  closed at once;
* a request head must arrive within `header_timeout_s` (a few seconds) of the connection or of
  the previous response: a connection that sent part of a head by then gets 408, an idle one is
  closed, so idle sockets hold slots for seconds, not for the body timeout;
* the errors aiohttp answers itself (a malformed or oversized head) as `{"error": ...}` JSON on
  HTTP/1.1, 431 for a head line or header count past the limits, never logged as a traceback.

The answer given without a request (408) goes through aiohttp's own
path for requests it could not parse (an error message queued for the connection, answered by
`handle_error`), so aiohttp writes every byte. That path and the keep-alive timer are aiohttp
internals (`_ErrInfo`, `_messages`, `_waiter`, `_process_keepalive`, `ERROR`); aiohttp is
pinned (constraints.txt) and tests/unit/serving/front/ covers each of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import ERROR, _ErrInfo

from avspec.serving.front.http_status import error_response
from avspec.serving.front.limits import Full, Slots
from avspec.serving.front.policy import http_identity

_log = logging.getLogger(__name__)

# connections over a cap waiting for their refusal, at least (the total cap, if larger)
MIN_REFUSED = 256
# aiohttp answers a request it could not parse as if it were HTTP/1.0; the front speaks 1.1.
_UNPARSED = ERROR._replace(version=HttpVersion11)


class FrontConnection(web.RequestHandler):
    """One client connection (aiohttp's protocol) with the front's head timeout and answers."""

    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.identity = ""  # the caller's identity (policy.http_identity of its IP)
        self.busy = False  # a request of this connection is being handled
        self._head_started = False  # bytes of a request head arrived, the head did not
        # (status, message) of a connection over a cap at accept: its first request gets it
        self.refusal: tuple[int, str] | None = None

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` {"error": message} next and close, without waiting for a request."""
        self._messages.append((_ErrInfo(status, RuntimeError(message), message), EMPTY_PAYLOAD))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def request_started(self) -> None:
        self.busy, self._head_started = True, False

    def request_ended(self) -> None:
        self.busy, self._head_started = False, False

    def data_received(self, data: bytes) -> None:
        if data and not self.busy:
            self._head_started = True
        super().data_received(data)
        if self._messages:  # a whole head was parsed
            self._head_started = False

    def _process_keepalive(self) -> None:
        waiting = self._waiter is not None and not self._waiter.done()
        due = self._loop.time() >= self._next_keepalive_close_time
        if self._head_started and waiting and due:
            self._keepalive_handle = None
            self.refuse(408, "timed out reading the request head")
            return
        super()._process_keepalive()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what it could not parse or serve, as the front's JSON error."""
        if request.writer.output_size > 0:  # the answer is under way: only closing is left
            raise ConnectionError("response already started; cannot send an error")
        if isinstance(exc, LineTooLong) or (
            isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower()
        ):
            status = 431
            message = f"request head too large: {exc}"
        elif status >= 500 and status not in (503,):
            _log.error("front: error serving %s", request.path, exc_info=exc)
            message = "internal error in the front"
        elif isinstance(exc, BadHttpMessage):
            message = f"malformed request: {exc.message.splitlines()[0] if exc.message else exc}"
        response = error_response(status, message or "error")
        response.force_close()
        return response


class ConnectionServer(web.Server):
    """aiohttp's low-level server, counting connections per address (front.limits)."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        slots: Slots,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self._slots = slots
        self._held: dict[web.RequestHandler, contextlib.ExitStack] = {}
        self._refused = 0  # open connections waiting for their refusal

    def __call__(self) -> FrontConnection:
        return FrontConnection(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        assert isinstance(handler, FrontConnection)
        peer = transport.get_extra_info("peername")
        address = handler.identity = http_identity(peer[0]) if peer else "unknown"
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self._slots.hold(address))
        except Full as err:
            # answered when its request head arrives (answered at once, the client's request
            # met a closed socket: a broken pipe, not the 429), or closed at the head timeout;
            # past the limit of such connections, closed at once
            if self._refused >= max(self._slots.total, MIN_REFUSED):
                transport.abort()
                return
            handler.refusal = (429 if err.per_address else 503, str(err))
            self._refused += 1
            return
        self._held[handler] = stack

    def connection_lost(
        self, handler: web.RequestHandler, exc: BaseException | None = None
    ) -> None:
        super().connection_lost(handler, exc)
        stack = self._held.pop(handler, None)
        if stack is not None:
            stack.close()
        elif isinstance(handler, FrontConnection) and handler.refusal is not None:
            self._refused -= 1

    def _make_request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        if message is ERROR:
            message = _UNPARSED
        elif message.version < HttpVersion10:  # answered (505) on HTTP/1.1, then closed
            message = message._replace(version=HttpVersion11, should_close=True)
            assert isinstance(protocol, FrontConnection)  # the only handler ConnectionServer makes
            protocol.refusal = (505, "HTTP/0.9 is not supported: send HTTP/1.1")
        return FrontRequest(message, payload, protocol, writer, task, self._loop)


class FrontRequest(web.BaseRequest):
    """aiohttp's request, with the headers every answer of the front carries."""

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        # no answer is ever sniffed into another type (an error's JSON as HTML, say)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        await super()._prepare_hook(response)
