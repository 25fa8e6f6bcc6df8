"""Fake upstreams (a Triton HTTP and gRPC stand-in) and client helpers for the front's tests."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

import grpc
import openai
from tritonclient.grpc import service_pb2, service_pb2_grpc

from avspec.serving.front import Front, FrontConfig
from avspec.serving.front.config import Access

ADMIN_KEY = "operator-key-456"
INTERNAL_MODELS = ("draft", "verifier", "target", "speculative_step")
MAX_BODY = 64 << 10
GOOD_BODY = {"text_input": "hello", "max_tokens": 8}
IDENTITY = {"avspec-client": "127.0.0.1"}  # the identity field the front adds for a local client
STALL_LIMIT_S = 10.0  # a stalled fake answer gives up after this long
SLOW_S = 4.0  # how long a "slow" stream request takes to be answered
# The `capped` front (tests/unit/serving/front/conftest.py): small caps keep the limit tests fast.
CAP = 4  # streams / connections per address
IDLE_S = 1.5  # the limit for a stream that has sent nothing
USED_IDLE_S = 2 * IDLE_S  # the idle limit after an answer


@dataclass
class Recorded:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    peer_port: int = 0  # the port of the front's upstream connection it came on

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name]


@dataclass
class FakeHttp:
    """Records every request; answers SSE slowly, and notices when its client goes away.

    The body's `text_input` picks the behaviour: "endless" streams 400 events, "stall" sends no
    answer until its client goes away (or STALL_LIMIT_S), "error:STATUS:MESSAGE" answers STATUS
    with MESSAGE as Triton answers an error of the entry model (chunked, one JSON object or one
    event), a prompt holding "blocks:SPEC|" streams the decode steps of SPEC (`blocks`), anything
    else streams 3 events.
    """

    requests: list[Recorded] = field(default_factory=list)
    ready: bool = True
    stream_gap_s: float = 0.3
    disconnected: threading.Event = field(default_factory=threading.Event)
    port: int = 0

    def clear(self) -> None:
        self.requests.clear()
        self.ready = True
        self.stream_gap_s = 0.3
        self.disconnected.clear()


def make_handler(fake: FakeHttp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _record(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            fake.requests.append(
                Recorded(
                    self.command, self.path, self.headers.items(), body, self.client_address[1]
                )
            )
            return body

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
            self._record()
            if self.path == "/v2/health/ready" and not fake.ready:
                self._reply(400, {"error": "not ready"})
            else:
                self._reply(200, {"path": self.path})

        def do_POST(self) -> None:  # noqa: N802
            body = self._record()
            try:
                mode = json.loads(body).get("text_input")
            except (ValueError, AttributeError):
                mode = None
            if isinstance(mode, str) and "blocks:" in mode and path_streams(self.path):
                spec = mode[mode.index("blocks:") + len("blocks:") :].partition("|")[0]
                self._blocks(spec, json.loads(body)["max_tokens"], prompt_count(mode))
            elif mode == "stall":
                self._stall()
            elif isinstance(mode, str) and mode.startswith("error:"):
                status, _, message = mode.removeprefix("error:").partition(":")
                self._error(int(status), message)
            elif self.path.endswith("/generate_stream"):
                self._stream(mode)
            else:
                self._reply(200, {"path": self.path, "echo": body.decode()})

        def _error(self, status: int, message: str) -> None:
            """An error as Triton 2.51 sends the entry's: chunked, JSON or one SSE event."""
            payload = json.dumps({"error": message}).encode()
            streaming = self.path.endswith("/generate_stream")
            self.send_response(status)
            if streaming:
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                payload = b"data: " + payload + b"\n\n"
            else:
                self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))

        def _blocks(self, spec: str, max_tokens: int, prompt_tokens: int) -> None:
            """The steps of `spec` as the entry streams them (`blocks`), each with the
            prompt's token count as the entry reports it."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for event in blocks(spec, max_tokens):
                    if event is None:  # "~": no more steps until the client goes away
                        self._stall()
                        return
                    if "error" not in event:
                        event = {**event, "prompt_tokens": prompt_tokens}
                    data = b"data: " + json.dumps(event).encode() + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                fake.disconnected.set()

        def _stall(self) -> None:
            """No answer; note when the client closes the connection."""
            deadline = time.monotonic() + STALL_LIMIT_S
            while time.monotonic() < deadline:
                readable, _, _ = select.select([self.connection], [], [], 0.05)
                if readable and not self.connection.recv(1, socket.MSG_PEEK):
                    fake.disconnected.set()
                    return
            self.close_connection = True

        def _stream(self, mode: str | None) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            count, gap = (3, fake.stream_gap_s) if mode != "endless" else (400, 0.025)
            try:
                for i in range(count):
                    event = f'data: {{"text_output": "t{i}"}}\n\n'.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    time.sleep(gap)
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                fake.disconnected.set()

    return Handler


def path_streams(path: str) -> bool:
    return path.endswith("/generate_stream")


def prompt_count(text: str) -> int:
    """The prompt's tokens as the entry counts them, on the byte tokenizer."""
    from helpers.hf_dirs import byte_tokenizer

    return len(byte_tokenizer().encode(text).ids)


def blocks(spec: str, max_tokens: int) -> list[dict | None]:
    """The events of an entry streaming `spec`: comma-separated steps, each a block of
    accepted drafts then one token of the target, one byte-tokenizer token per character
    (helpers.hf_dirs.byte_tokenizer); "!MESSAGE" an error event of a failing stage, "~" a stall.
    Like the entry, at most `max_tokens` tokens in all (the last block cut)."""
    from helpers.hf_dirs import byte_tokenizer

    tokenizer, events, left = byte_tokenizer(), [], max_tokens
    for step in spec.split(","):
        if step.startswith("!"):
            events.append({"error": f"generation failed: {step[1:]}"})
            break
        if step == "~":
            events.append(None)
            break
        ids = tokenizer.encode(step).ids[:left]
        left -= len(ids)
        drafted = len(step) - 1
        events.append(
            {
                "text_output": tokenizer.decode(ids),
                "output_ids": ids[0] if len(ids) == 1 else ids,  # Triton writes [x] as x
                "drafted_tokens": drafted + 2,
                "verified_tokens": drafted + 1,
                "accepted_tokens": drafted,
            }
        )
        if not left:
            break
    return events


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Echoes the metadata it receives into response parameters; records the calls.

    Request id "endless" (ModelStreamInfer) streams until cancelled; "slow" (ModelStreamInfer)
    answers once after SLOW_S; "stall" (ModelInfer) never answers; "endless" and "stall" set
    `cancelled` once their caller goes away. Stream responses carry `triton_final_response`
    as Triton's do for a decoupled model.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.cancelled = threading.Event()
        self.port = 0

    def _note(self, name: str, context: grpc.ServicerContext) -> dict[str, str]:
        metadata = {key: value for key, value in context.invocation_metadata()}
        self.calls.append((name, metadata))
        return metadata

    @staticmethod
    def _response(request: service_pb2.ModelInferRequest, metadata: dict[str, str]):
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        for key, value in metadata.items():
            response.parameters[key].string_param = value
        return response

    def _streamed(self, request, metadata: dict[str, str], final: bool):
        response = self._response(request, metadata)
        response.parameters["triton_final_response"].bool_param = final
        return service_pb2.ModelStreamInferResponse(infer_response=response)

    def _wait_cancelled(self, context: grpc.ServicerContext) -> None:
        deadline = time.monotonic() + STALL_LIMIT_S
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not context.is_active():
            self.cancelled.set()

    def ServerLive(self, request, context):  # noqa: N802 - the service's spelling
        self._note("ServerLive", context)
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):  # noqa: N802
        self._note("ServerReady", context)
        return service_pb2.ServerReadyResponse(ready=True)

    def ServerMetadata(self, request, context):  # noqa: N802
        self._note("ServerMetadata", context)
        return service_pb2.ServerMetadataResponse(name="fake-triton")

    def RepositoryIndex(self, request, context):  # noqa: N802
        self._note("RepositoryIndex", context)
        return service_pb2.RepositoryIndexResponse()

    def ModelInfer(self, request, context):  # noqa: N802
        metadata = self._note("ModelInfer", context)
        if request.id == "stall":
            self._wait_cancelled(context)
        return self._response(request, metadata)

    def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        metadata = self._note("ModelStreamInfer", context)
        for request in request_iterator:
            if request.id == "endless":
                try:
                    while context.is_active():
                        yield self._streamed(request, metadata, final=False)
                        time.sleep(0.02)
                finally:
                    # gRPC may close this generator at a blocked yield (flow control) rather
                    # than let the loop see the cancellation: note it either way
                    if not context.is_active():
                        self.cancelled.set()
                return
            if request.id == "slow":
                deadline = time.monotonic() + SLOW_S
                while context.is_active() and time.monotonic() < deadline:
                    time.sleep(0.02)
            yield self._streamed(request, metadata, final=True)


def front_config(fake_http: FakeHttp, fake_grpc: FakeTriton, **overrides) -> FrontConfig:
    options = dict(
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        upstream_http=f"127.0.0.1:{fake_http.port}",
        upstream_grpc=f"127.0.0.1:{fake_grpc.port}",
        max_body_bytes=MAX_BODY,
        # the raw requests of the tests name Host "x"
        access=Access(allowed_hosts=(RAW_HOST,)),
    )
    options.update(overrides)
    return FrontConfig(**options)


RAW_HOST = "x"


def request(port: int, method: str, path: str, body: object = None, headers: dict | None = None):
    """(status, JSON or raw body, client port) of one HTTP request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.connect()
    client_port = connection.sock.getsockname()[1]
    connection.request(method, path, body=data, headers=headers or {})
    response = connection.getresponse()
    raw = response.read()
    connection.close()
    try:
        payload = json.loads(raw) if raw else None
    except ValueError:
        payload = raw
    return response.status, payload, client_port


class _Recording(io.RawIOBase):
    """A socket's input as a raw stream that keeps every byte read (the reply on the wire)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.received = sock, bytearray()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._sock.recv(len(buffer))
        buffer[: len(data)] = data
        self.received += data
        return len(data)


def read_reply(sock: socket.socket) -> bytes:
    """The bytes of one HTTP response read from `sock` (http.client finds where it ends), or of
    whatever came before the connection closed."""
    recording = _Recording(sock)
    reader = io.BufferedReader(recording)
    response = http.client.HTTPResponse(sock)
    response.fp = reader  # http.client reads the response from the recorded stream
    with contextlib.suppress(http.client.HTTPException, ConnectionError):
        response.begin()
        response.read()
    return bytes(recording.received)


def raw_exchange(port: int, head: str, body: bytes = b"") -> bytes:
    """Send bytes on a raw socket; return the one reply that comes back (its bytes as sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode("latin-1") + body)
        return read_reply(sock)


def post(port: int, path: str, body: bytes, headers: str = "") -> tuple[bytes, bytes]:
    """(head, body) of the front's answer to one POST."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    reply = raw_exchange(port, head, body)
    answer_head, _, answer_body = reply.partition(b"\r\n\r\n")
    return answer_head, answer_body


def official_client(front: Front) -> openai.OpenAI:
    """The official client on `front`'s /v1 (no retries: each call is one request)."""
    url = f"http://127.0.0.1:{front.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def infer_request(model: str = "speculative", request_id: str = "1", **kwargs):
    return service_pb2.ModelInferRequest(model_name=model, id=request_id, **kwargs)


class SourceProxy:
    """A TCP forwarder to 127.0.0.1:`port` whose upstream connections come from `source` (e.g.
    127.0.0.2), so a client connecting to `self.port` reaches the front from another address."""

    def __init__(self, port: int, source: str) -> None:
        self._target, self._source = port, source
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(
                    ("127.0.0.1", self._target), source_address=(self._source, 0)
                )
            except OSError:  # closed
                return
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
