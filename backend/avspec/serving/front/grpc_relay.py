"""The gRPC relay: the front's public gRPC port, forwarding to Triton's loopback gRPC port.

Requests and responses cross the front as raw bytes; only the requests that name a model
(ModelReady, ModelMetadata, ModelInfer, every message of ModelStreamInfer) are parsed, to refuse
internal models and reserved request parameters. Public: ServerLive, ServerReady,
ServerMetadata, and ModelReady, ModelMetadata, ModelInfer, ModelStreamInfer on public models;
anything else needs the operator's admin key, sent as `avspec-admin-key` or
`triton-grpc-protocol-avspec-admin-key`.

Only the front reaches Triton (its gRPC listens on a Unix socket only the server's user may
open), so the admin key is checked here and never sent upstream. Upstream the front adds
`avspec-client: <peer ip:port>`, which `--grpc-header-forward-pattern` hands to the model.
Client metadata whose key contains `avspec` is dropped: the forward pattern is a regex search,
so even `triton-grpc-protocol-avspec-client` would reach the model.

ModelInfer and ModelStreamInfer calls are registered for `Front.abort_inference`, which ends
them with UNAVAILABLE and its message, and cancels their upstream calls.

Caps (front.limits), counted here rather than by gRPC's `maximum_concurrent_rpcs`, which also
refused health calls once idle streams filled it: a stream takes a slot of its peer's IP address
and of the total, any other call but health (ServerLive, ServerReady, ServerMetadata) one of the
total; past a cap RESOURCE_EXHAUSTED. A stream that sends no request within
`stream_first_request_timeout_s` of opening, or has had none in progress for
`stream_idle_timeout_s` since its last answer, is ended with UNAVAILABLE (front.grpc_idle).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from avspec.serving.exposure import ADMIN_KEY_HEADER, CLIENT_HEADER, GRPC_RESTRICTED_PREFIX
from avspec.serving.front.config import FrontConfig
from avspec.serving.front.grpc_idle import StreamActivity, end_when_idle
from avspec.serving.front.inflight import InFlight, settle
from avspec.serving.front.limits import Full, Slots
from avspec.serving.front.policy import (
    RESERVED_MARK,
    RESTARTING,
    Unauthorized,
    admin_authorized,
    grpc_peer_ip,
    key_identity,
    model_refusal,
    refusal,
    reserved_parameter,
    stage_ready,
)

_SERVICE = "inference.GRPCInferenceService"
_PUBLIC_RPCS = frozenset(
    {
        "ServerLive",
        "ServerReady",
        "ServerMetadata",
        "ModelReady",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
    }
)
_RPCS = frozenset(
    m.name for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
)
ADMIN_KEY_METADATA = GRPC_RESTRICTED_PREFIX + ADMIN_KEY_HEADER
_ADMIN_KEY_NAMES = frozenset({ADMIN_KEY_HEADER, ADMIN_KEY_METADATA})
# Metadata gRPC manages itself; passing it on to a new call is refused or meaningless.
_GRPC_OWN_METADATA = frozenset({"user-agent", "content-type", "te", "grpc-accept-encoding"})
_STREAM_EOF = object()
# Never refused by the caps of front.limits: a probe must see the server whatever clients hold.
_HEALTH_RPCS = frozenset({"ServerLive", "ServerReady", "ServerMetadata"})


@dataclass(frozen=True)
class _Refused:
    code: grpc.StatusCode
    details: str


def _model_of(rpc: str, request: bytes) -> tuple[str, Any]:
    """The model a request names (and its parameter names), parsed from its bytes."""
    if rpc in ("ModelInfer", "ModelStreamInfer"):
        message = service_pb2.ModelInferRequest.FromString(request)
        return message.model_name, list(message.parameters)
    if rpc == "ModelReady":
        return service_pb2.ModelReadyRequest.FromString(request).name, ()
    return service_pb2.ModelMetadataRequest.FromString(request).name, ()


class GrpcRelay(grpc.GenericRpcHandler):
    def __init__(self, config: FrontConfig, inflight: InFlight) -> None:
        self.config = config
        self.port = 0
        self._inflight = inflight
        self._slots = Slots(
            config.max_per_address,
            config.max_connections,
            noun="open streams",
            total_noun="calls in progress",
        )
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None

    def _open_channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(
            self.config.upstream_grpc,
            options=[
                ("grpc.max_receive_message_length", -1),  # responses are Triton's business
                ("grpc.max_send_message_length", -1),
                # Triton is a local socket: while it restarts, gRPC's default backoff (1 s
                # growing to 120 s) would fail calls with the old connect error long after
                # it is back
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                # a channel of its own: else a new channel shares the old one's connection
                # (gRPC's global subchannel pool) and so its backoff and error
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )

    async def reconnect(self) -> None:
        """A fresh upstream channel, for after tritonserver was started again: calls then
        connect at once instead of failing with the connect error the old channel kept."""
        old, self._channel = self._channel, self._open_channel()
        if old is not None:
            await old.close()

    async def open(self) -> None:
        self._channel = self._open_channel()
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.config.max_body_bytes),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),  # else a taken port is silently shared
            ],
        )
        self._server.add_generic_rpc_handlers((self,))
        host = self.config.host
        address = f"[{host}]" if ":" in host and not host.startswith("[") else host
        try:
            self.port = self._server.add_insecure_port(f"{address}:{self.config.grpc_port}")
        except RuntimeError as err:  # how grpcio reports a port in use
            raise OSError(f"cannot bind gRPC on {address}:{self.config.grpc_port}: {err}") from None
        if self.port == 0:  # how older grpcio reported it
            raise OSError(f"cannot bind gRPC on {address}:{self.config.grpc_port}")
        await self._server.start()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
        if self._channel is not None:
            await self._channel.close()

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        """Pick the forwarding handler; unknown methods are left UNIMPLEMENTED by gRPC."""
        method = handler_call_details.method
        service, _, rpc = method.rpartition("/")
        if service != f"/{_SERVICE}" or rpc not in _RPCS:
            return None
        # No (de)serializers: requests and responses cross the front as raw bytes.
        if rpc == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(partial(self._stream, method))
        return grpc.unary_unary_rpc_method_handler(partial(self._unary, rpc, method))

    def _metadata(self, context: grpc.aio.ServicerContext) -> list[tuple[str, str]]:
        """Client metadata without keys containing `avspec`, plus the caller's identity.

        The caller's identity is its peer `ip:port` (as gRPC writes it, e.g.
        `ipv4:10.0.0.7:51234`): one channel is one client program.
        """
        metadata = [
            (key, value)
            for key, value in context.invocation_metadata() or ()
            if RESERVED_MARK not in key
            and key not in _GRPC_OWN_METADATA
            and key != "authorization"
            and not key.startswith(":")
        ]
        try:
            identity = self._identity(context)
        except Unauthorized:  # a health call, which needs no key: its peer
            identity = context.peer()
        metadata.append((CLIENT_HEADER, identity))
        return metadata

    def _identity(self, context: grpc.aio.ServicerContext) -> str:
        """`key:NAME` of the call's API key (metadata `authorization: Bearer KEY`) when the
        front has keys, else the peer; Unauthorized for a missing or unknown key."""
        values = [
            value if isinstance(value, str) else value.decode("latin-1")
            for key, value in context.invocation_metadata() or ()
            if key == "authorization"
        ]
        return key_identity(self.config, values) or context.peer()

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """End the call UNAUTHENTICATED unless its API key is good (or none is needed)."""
        try:
            self._identity(context)
        except Unauthorized as err:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))

    def _admin(self, context: grpc.aio.ServicerContext) -> tuple[bool, list[str]]:
        """(authorised?, the admin-key values sent); the same key under both names counts once."""
        values = [
            value if isinstance(value, str) else value.decode("latin-1")
            for key, value in context.invocation_metadata() or ()
            if key in _ADMIN_KEY_NAMES
        ]
        keys = list(dict.fromkeys(values))
        return admin_authorized(self.config, keys), keys

    def _refusal(self, rpc: str, request: bytes, admin: bool) -> tuple[grpc.StatusCode, str] | None:
        """Why a request is refused (status, details): a model that is not public, a reserved
        request parameter, or bytes that do not parse; None if it may go upstream."""
        try:
            model, parameters = _model_of(rpc, request)
        except Exception:  # protobuf's DecodeError, whatever its implementation
            return grpc.StatusCode.INVALID_ARGUMENT, f"malformed {rpc} request"
        name = reserved_parameter(parameters)
        if name is not None:
            details = f"request parameter {name!r} is reserved for the front"
            return grpc.StatusCode.INVALID_ARGUMENT, details
        if model not in self.config.public_models and not admin:
            internal, message = model_refusal(self.config, model)
            code = grpc.StatusCode.PERMISSION_DENIED if internal else grpc.StatusCode.NOT_FOUND
            return code, message
        return None

    async def _unary(
        self, rpc: str, method: str, request: bytes, context: grpc.aio.ServicerContext
    ) -> bytes:
        """Forward a unary call within a slot of the total; health calls need none."""
        if rpc in _HEALTH_RPCS:
            return await self._forward_unary(rpc, method, request, context)
        try:
            with self._slots.hold(None):
                return await self._forward_unary(rpc, method, request, context)
        except Full as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            raise AssertionError("context.abort raises") from err

    async def _forward_unary(  # type: ignore[return]
        self, rpc: str, method: str, request: bytes, context: grpc.aio.ServicerContext
    ) -> bytes:
        if rpc not in _HEALTH_RPCS:
            await self._authenticate(context)
        admin, keys = self._admin(context)
        if rpc not in _PUBLIC_RPCS and not admin:
            what = f"method {rpc!r}"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(self.config, what, keys))
        if rpc in ("ModelReady", "ModelMetadata", "ModelInfer"):
            refused = self._refusal(rpc, request, admin)
            if refused is not None:
                await context.abort(*refused)
        if rpc == "ServerReady" and not await stage_ready(self.config.ready):
            return service_pb2.ServerReadyResponse(ready=False).SerializeToString()
        if rpc == "ModelInfer" and not await stage_ready(self.config.ready):
            await context.abort(grpc.StatusCode.UNAVAILABLE, RESTARTING)
        assert self._channel is not None
        call = self._channel.unary_unary(method)(
            request, metadata=self._metadata(context), timeout=context.time_remaining()
        )
        if rpc != "ModelInfer":
            try:
                return await call
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
            finally:
                call.cancel()  # no-op once done; on our cancellation it cancels Triton's call
        aborted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        upstream = asyncio.ensure_future(call)
        try:
            with self._inflight.track(partial(settle, aborted)):
                await asyncio.wait({upstream, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not upstream.done():
                upstream.cancel()
            call.cancel()
        if upstream.done() and not upstream.cancelled():
            try:
                return upstream.result()
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
        await context.abort(grpc.StatusCode.UNAVAILABLE, aborted.result())

    async def _stream(
        self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Relay a stream within a slot of its peer's IP address (and of the total)."""
        try:
            with self._slots.hold(grpc_peer_ip(context.peer())):
                # aclosing: the relay's cleanup (cancelling Triton's call) runs before the slot
                # is given back, not whenever the generator is collected
                relay = self._relay_stream(method, requests, context)
                async with contextlib.aclosing(relay) as responses:  # type: ignore[type-var]
                    async for response in responses:
                        yield response
        except Full as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))

    async def _relay_stream(
        self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Relay a bidirectional stream; every request is checked before it goes upstream.

        One task copies requests up, one copies responses into a small queue (backpressure), and
        this generator yields from the queue; a refused request ends the stream with its status,
        and so does Front.abort_inference (UNAVAILABLE). A third task ends the stream once it is
        idle (StreamActivity): open streams cost Triton and a slot of their address.
        """
        await self._authenticate(context)
        admin, _ = self._admin(context)
        loop = asyncio.get_running_loop()
        activity = StreamActivity(quiet_since=loop.time())
        assert self._channel is not None
        call = self._channel.stream_stream(method)(
            metadata=self._metadata(context), timeout=context.time_remaining()
        )
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=8)

        async def pump_requests() -> None:
            try:
                async for request in requests:
                    refused = self._refusal("ModelStreamInfer", request, admin)
                    if refused is not None:  # ends the stream with this status
                        await queue.put(_Refused(*refused))
                        return
                    if not await stage_ready(self.config.ready):
                        await queue.put(_Refused(grpc.StatusCode.UNAVAILABLE, RESTARTING))
                        return
                    activity.sent()
                    await call.write(request)
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the upstream call ended first; the response side reports how

        async def pump_responses() -> None:
            try:
                while (response := await call.read()) is not grpc.aio.EOF:
                    await queue.put(response)
                await queue.put(_STREAM_EOF)
            except grpc.aio.AioRpcError as err:
                await queue.put(err)

        tasks = [asyncio.create_task(pump_requests()), asyncio.create_task(pump_responses())]

        def end(code: grpc.StatusCode, message: str) -> None:
            """Stop both pumps (they put nothing more), then leave the status alone queued."""
            call.cancel()
            for task in tasks:
                task.cancel()
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(_Refused(code, message))

        watch = asyncio.create_task(
            end_when_idle(
                activity,
                self.config.stream_first_request_timeout_s,
                self.config.stream_idle_timeout_s,
                end,
            )
        )
        try:
            with self._inflight.track(partial(end, grpc.StatusCode.UNAVAILABLE)):
                while (item := await queue.get()) is not _STREAM_EOF:
                    if isinstance(item, _Refused):
                        await context.abort(item.code, item.details)
                    if isinstance(item, grpc.aio.AioRpcError):
                        await context.abort(item.code(), item.details() or "")
                    yield item
                    activity.answered(item, loop.time())  # once handed to the client
        finally:
            call.cancel()  # the client cancelled, dropped, was refused, or the stream ended
            watch.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, watch, return_exceptions=True)
