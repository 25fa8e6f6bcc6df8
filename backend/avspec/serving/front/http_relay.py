"""The HTTP relay: the front's public HTTP/1.1 port, forwarding to Triton's loopback HTTP port.

One request per client connection (every response says `Connection: close`) and one upstream
connection per request, so a client that goes away closes its upstream connection at once and
Triton cancels the request. Bodies are bounded before they are read (413 at once, also in place
of `100 Continue`: Triton's HTTP front end crashes on a ~10 MB body sent with
`Expect: 100-continue`), header blocks are bounded, slow clients time out, and generate bodies are
type-checked against the model's inputs.

The caller's identity (its IP, see policy) goes upstream in header `avspec-client` and, for
generate and generate_stream, as the body field `"avspec-client"`: Triton 2.51 does not forward
HTTP headers to the model for /generate, but makes unknown generate fields request parameters.
A client cannot send that field itself (an unknown field is a 400).

Each IP address holds at most `max_per_address` connections (429 past it), all clients
together `max_connections` (503); every 429 and 503 says `Retry-After`. Triton's 400 to a
generate call is read whole and given the status the entry model meant (http_wire
.ENTRY_SERVER_ERRORS: 503 for a full queue, 500 for a failed stage).

Every generate, generate_stream and infer call is registered for `Front.abort_inference`, which
ends it: with a 503 if the response head has not started, with a last SSE event
`data: {"error": ...}` and a proper end of the chunked body if an event stream is under way, and
by closing the connection otherwise (a body cut short cannot be ended cleanly).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from functools import partial

from avspec.serving.exposure import CLIENT_HEADER
from avspec.serving.front import http_wire as wire
from avspec.serving.front.config import FrontConfig, upstream_address
from avspec.serving.front.inflight import InFlight, settle
from avspec.serving.front.limits import Full, Slots
from avspec.serving.front.policy import RESTARTING, http_identity, stage_ready
from avspec.serving.front.schema import check_generate_body

_LINGER_S = 1.0  # after an early error: how long to swallow a body the client still sends
_CHUNK = 64 << 10
_ERROR_BODY_LIMIT = 64 << 10  # an error answer read whole (Triton's are a line of JSON)


@dataclass
class _Exchange:
    """What one forwarded call has sent so far (to end it cleanly when it is aborted)."""

    upstream: asyncio.StreamWriter | None = None
    head: wire.ResponseHead | None = None  # set once the response head goes out
    owed: int = 0  # bytes still due to close the chunk (or Content-Length body) under way
    complete: bool = False  # the whole response has been written
    generate: bool = False  # a generate call: Triton's 400 may hide a server-side error


class HttpRelay:
    def __init__(self, config: FrontConfig, inflight: InFlight) -> None:
        self.config = config
        self.port = 0
        self._inflight = inflight
        self._upstream = upstream_address(config.upstream_http)
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task] = set()
        self._slots = Slots(
            config.max_per_address,
            config.max_connections,
            noun="open connections",
            total_noun="open connections",
        )
        self._closing = False

    async def open(self) -> None:
        self._server = await asyncio.start_server(
            self._on_client,
            self.config.host,
            self.config.http_port,
            limit=self.config.max_header_bytes,
            backlog=min(self.config.max_connections, 4096),
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._closing = True  # from now on connections are reset, not closed gracefully
        if self._server is not None:
            self._server.close()
        for task in list(self._clients):
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve a connection within a slot of its IP address (and of the total): past its
        address's cap 429, past the total 503, both with Retry-After."""
        address = http_identity(writer.get_extra_info("peername")[0])
        try:
            with self._slots.hold(address):
                await self._serve_client(reader, writer)
        except Full as err:
            writer.write(wire.error_response(429 if err.per_address else 503, str(err)))
            await self._linger_close(reader, writer)
            await self._close_client(writer)

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            await self._serve(reader, writer)
        except (wire.ClientGone, ConnectionError):
            pass
        finally:
            self._clients.discard(task)
            await self._close_client(writer)

    async def _close_client(self, writer: asyncio.StreamWriter) -> None:
        """Close after the queued bytes are sent (abort would drop them), within a timeout."""
        if self._closing:
            writer.transport.abort()
            return
        try:
            writer.close()
            async with asyncio.timeout(self.config.read_timeout_s):
                await writer.wait_closed()
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except Exception:  # reset by the client, or it does not read: drop the rest
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        identity = http_identity(writer.get_extra_info("peername")[0])
        try:
            request = await self._read_head(reader)
            route = wire.route(self.config, request)
            body = await self._read_body(request, reader, writer)
            if route.kind == "generate":
                body = self._checked_generate(body, identity)
            elif route.kind == "infer":
                wire.check_infer(request, body)
            if route.kind in ("generate", "infer") and not await stage_ready(self.config.ready):
                raise wire.HttpError(503, RESTARTING)  # fail fast instead of inside a stage
        except wire.HttpError as err:
            writer.write(wire.error_response(err.status, err.message, err.headers))
            await self._linger_close(reader, writer)
            return
        if route.kind == "ready":
            await self._serve_ready(request, identity, writer)
        else:
            await self._forward(request, body, route, identity, reader, writer)

    async def _read_head(self, reader: asyncio.StreamReader) -> wire.Request:
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            raise wire.HttpError(408, "timed out reading the request head") from None
        except asyncio.LimitOverrunError:
            limit = self.config.max_header_bytes
            raise wire.HttpError(431, f"request head exceeds {limit} bytes") from None
        except asyncio.IncompleteReadError as err:
            if not err.partial.strip():
                raise wire.ClientGone from None
            raise wire.HttpError(400, "incomplete request head") from None
        return wire.parse_head(head)

    async def _read_body(
        self, request: wire.Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes:
        """Read the body only once its declared size is within the limit (413 otherwise)."""
        length = wire.content_length(request)
        limit = self.config.max_body_bytes
        if length > limit:
            message = f"request body of {length} bytes exceeds the limit of {limit} bytes"
            raise wire.HttpError(413, message)
        expect = request.values("expect")
        if expect:
            if [value.lower() for value in expect] != ["100-continue"]:
                raise wire.HttpError(417, "only 'Expect: 100-continue' is supported")
            if length and request.version == "1.1":
                # Answered here, never by Triton (it crashes on large bodies after 100-continue).
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not length:
            return b""
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                return await reader.readexactly(length)
        except TimeoutError:
            raise wire.HttpError(408, "timed out reading the request body") from None
        except asyncio.IncompleteReadError:
            raise wire.ClientGone from None

    def _checked_generate(self, body: bytes, identity: str) -> bytes:
        """The checked body, re-serialised, with the caller's identity as `avspec-client`."""
        try:
            request = check_generate_body(body, self.config.generate_schema)
        except ValueError as err:
            raise wire.HttpError(400, str(err)) from None
        request[CLIENT_HEADER] = identity
        return json.dumps(request, allow_nan=False, separators=(",", ":")).encode()

    async def _linger_close(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Send what is queued, then swallow input for a moment before closing.

        Closing with unread input makes the kernel send a reset, which can destroy the error
        response before the client reads it (typical when a 413 interrupts an upload).
        """
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_LINGER_S):
                await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()
                while await reader.read(_CHUNK):
                    pass

    async def _serve_ready(
        self, request: wire.Request, identity: str, writer: asyncio.StreamWriter
    ) -> None:
        """200 only if the stages (config.ready) and Triton are ready; 503 otherwise."""
        if not await stage_ready(self.config.ready):
            writer.write(wire.error_response(503, "not ready: the serving stages are not ready"))
        else:
            try:
                status = await self._upstream_status(request, identity)
            except (OSError, TimeoutError, wire.HttpError) as err:
                message = f"not ready: Triton is unreachable ({err})"
                writer.write(wire.error_response(503, message))
            else:
                if status == 200:
                    writer.write(wire.response(200))
                else:
                    message = f"not ready: Triton answered {status}"
                    writer.write(wire.error_response(503, message))
        with contextlib.suppress(Exception):
            await writer.drain()

    async def _upstream_status(self, request: wire.Request, identity: str) -> int:
        async with asyncio.timeout(self.config.connect_timeout_s * 2):
            up_reader, up_writer = await self._connect()
            try:
                up_writer.write(wire.upstream_head(self.config, request, b"", False, identity))
                head = await up_reader.readuntil(b"\r\n\r\n")
            finally:
                up_writer.transport.abort()
        return wire.parse_status(head)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new connection to Triton's HTTP (its Unix socket, or host:port)."""
        limit = self.config.max_header_bytes * 4
        if isinstance(self._upstream, str):
            return await asyncio.open_unix_connection(self._upstream, limit=limit)
        return await asyncio.open_connection(*self._upstream, limit=limit)

    async def _forward(
        self,
        request: wire.Request,
        body: bytes,
        route: wire.Route,
        identity: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Send the request upstream and relay the response as it arrives.

        The client's side is watched meanwhile: once it closes, the upstream connection is
        reset at once, which makes Triton cancel the request. An inference call also ends when
        Front.abort_inference resolves its `aborted` future.
        """
        exchange = _Exchange(generate=route.kind == "generate")
        aborted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        relay = asyncio.create_task(
            self._relay(request, body, route.admin, identity, exchange, writer)
        )
        watch = asyncio.create_task(_wait_closed(reader))
        tracked = self._inflight.track(partial(settle, aborted)) if route.inference else None
        try:
            with tracked or contextlib.nullcontext():
                await asyncio.wait({relay, watch, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if exchange.upstream is not None:
                exchange.upstream.transport.abort()
            relay.cancel()
            watch.cancel()
            await asyncio.gather(relay, watch, return_exceptions=True)
        failure = None if relay.cancelled() else relay.exception()
        if aborted.done() and (relay.cancelled() or failure is not None):
            await self._end_aborted(exchange, aborted.result(), writer)
        elif isinstance(failure, wire.HttpError):
            writer.write(wire.error_response(failure.status, failure.message))
            await self._linger_close(reader, writer)

    async def _end_aborted(
        self, exchange: _Exchange, message: str, writer: asyncio.StreamWriter
    ) -> None:
        """Answer an aborted call as well as what was already sent allows."""
        head = exchange.head
        sized = head is not None and not head.chunked and head.length is not None
        if head is None:
            writer.write(wire.error_response(503, message))
        elif exchange.complete or (sized and not exchange.owed):
            pass  # the whole answer is written already: let it go out
        elif head.chunked and head.event_stream and not exchange.owed:
            writer.write(wire.error_event_chunk(message))
        else:  # mid-chunk, mid-body, or a body framed by the close: no clean end is possible
            writer.transport.abort()
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.config.read_timeout_s):
                await writer.drain()

    async def _relay(
        self,
        request: wire.Request,
        body: bytes,
        admin: bool,
        identity: str,
        exchange: _Exchange,
        writer: asyncio.StreamWriter,
    ) -> None:
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                up_reader, exchange.upstream = await self._connect()
        except (OSError, TimeoutError) as err:
            # down or restarting (the launcher starts it again): a retry soon may succeed
            address = self.config.upstream_http
            raise wire.HttpError(503, f"Triton at {address} is unreachable: {err}") from None
        try:
            exchange.upstream.write(wire.upstream_head(self.config, request, body, admin, identity))
            await exchange.upstream.drain()
            head = await up_reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
            message = f"Triton closed the connection without an answer ({err!r})"
            raise wire.HttpError(502, message) from None
        status = wire.parse_status(head)
        framing = wire.rewrite_head(head)
        if status == 400 and exchange.generate:
            answer = await self._entry_error(framing, up_reader)
            exchange.head, exchange.complete = framing, True  # written whole, without a pause
            await self._send(writer, answer)
            return
        bodyless = status in (204, 304) or 100 <= status < 200
        exchange.head = framing
        if not framing.chunked and framing.length is not None and not bodyless:
            exchange.owed = framing.length
        exchange.complete = bodyless
        await self._send(writer, framing.head)
        if not bodyless:
            await self._relay_body(framing, up_reader, writer, exchange)

    async def _entry_error(
        self, framing: wire.ResponseHead, up_reader: asyncio.StreamReader
    ) -> bytes:
        """Triton's 400 to a generate call, with the status the entry model meant.

        Triton 2.51 answers 400 whatever the code of a decoupled model's error
        (wire.ENTRY_SERVER_ERRORS), so the body is read whole, its message decides the status,
        and it goes out as it came (same content type and bytes), framed by Content-Length.
        """
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                body = await _read_whole(framing, up_reader)
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as err:
            raise wire.HttpError(502, f"Triton's error answer broke off ({err!r})") from None
        except asyncio.LimitOverrunError:
            raise wire.HttpError(502, "Triton's error answer has an overlong line") from None
        content_type = (
            "text/event-stream; charset=utf-8" if framing.event_stream else "application/json"
        )
        return wire.response(wire.entry_error_status(body), body, content_type)

    async def _relay_body(
        self,
        framing: wire.ResponseHead,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        exchange: _Exchange,
    ) -> None:
        """Copy the response body as it arrives, and stop at its end even if Triton keeps the
        connection open (framing: chunked, Content-Length, or until Triton closes)."""
        if framing.chunked:
            while True:
                size_line = await up_reader.readuntil(b"\r\n")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:  # last chunk: trailers up to an empty line
                    tail = size_line
                    while (line := await up_reader.readuntil(b"\r\n")) != b"\r\n":
                        tail += line
                    exchange.complete = True
                    await self._send(writer, tail + line)
                    return
                # The size line goes out with the chunk: one write per event, not two.
                await self._copy(up_reader, writer, size + 2, size_line, exchange)
        elif framing.length is not None:
            await self._copy(up_reader, writer, framing.length, b"", exchange)
            exchange.complete = True
        else:
            while data := await up_reader.read(_CHUNK):
                await self._send(writer, data)

    async def _copy(
        self,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        count: int,
        prefix: bytes,
        exchange: _Exchange,
    ) -> None:
        """Copy `count` bytes; `exchange.owed` says how many are still due once each is sent."""
        while count > 0:
            data = await up_reader.read(min(count, _CHUNK))
            if not data:
                raise wire.ClientGone  # Triton went away mid-body: nothing sane left to send
            count -= len(data)
            exchange.owed = count
            await self._send(writer, prefix + data)
            prefix = b""

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(self.config.read_timeout_s):  # a client that stopped reading
            await writer.drain()


async def _wait_closed(reader: asyncio.StreamReader) -> None:
    """Return once the client closes its side (any further input is discarded)."""
    with contextlib.suppress(OSError):
        while await reader.read(_CHUNK):
            pass


async def _read_whole(framing: wire.ResponseHead, up_reader: asyncio.StreamReader) -> bytes:
    """A small body (an error answer), its framing removed; ValueError past 64 KiB."""
    limit = _ERROR_BODY_LIMIT
    if framing.length is not None and not framing.chunked:
        if framing.length > limit:
            raise ValueError(f"error body of {framing.length} bytes")
        return await up_reader.readexactly(framing.length)
    body = b""
    while framing.chunked:
        size = int((await up_reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if not size:  # last chunk: trailers up to an empty line
            while await up_reader.readuntil(b"\r\n") != b"\r\n":
                pass
            return body
        body += (await up_reader.readexactly(size + 2))[:-2]
        if len(body) > limit:
            raise ValueError(f"error body over {limit} bytes")
    while data := await up_reader.read(_CHUNK):  # framed by the close
        body += data
        if len(body) > limit:
            raise ValueError(f"error body over {limit} bytes")
    return body
