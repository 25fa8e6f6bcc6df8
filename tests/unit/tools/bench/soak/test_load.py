"""avspec.tools.bench.soak.load: requests over HTTP and gRPC (fakes), the tally, the client
loops.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from avspec.serving.host.server_process import free_port
from avspec.tools.bench.soak import load
from avspec.tools.bench.soak.load import (
    Endpoints,
    GrpcStream,
    RequestFailed,
    Tally,
    client_loop,
    http_generate,
    http_generate_stream,
    join_loops,
    payload,
    send,
    start_loops,
)
from avspec.tools.bench.soak.mix import Mix, RequestSpec

GENERATE = "/v2/models/speculative/generate"
STREAM = "/v2/models/speculative/generate_stream"


def _spec(protocol: str = "http", cancel_after: int | None = None, k: int | None = 4):
    return RequestSpec(protocol, "hi", 8, 0.7, k, 3, cancel_after)


def _events(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def test_payload_leaves_out_the_default_draft_length():
    assert payload(_spec(k=4), stream=True) == {
        "text_input": "hi",
        "max_tokens": 8,
        "temperature": 0.7,
        "random_seed": 3,
        "stream": True,
        "num_draft_tokens": 4,
    }
    assert "num_draft_tokens" not in payload(_spec(k=None), stream=False)


def test_http_generate(canned):
    canned.routes[GENERATE] = (200, b'{"text_output": "ok"}')
    assert http_generate(canned.url, _spec(), timeout=5) == "ok"


@pytest.mark.parametrize(
    "status, body, message",
    [
        (503, b"busy", "HTTP 503: busy"),
        (200, b"<html>", "non-JSON"),
        (200, b'{"error": "x"}', "without text_output"),
    ],
)
def test_http_generate_failures(canned, status, body, message):
    canned.routes[GENERATE] = (status, body)
    with pytest.raises(RequestFailed, match=message):
        http_generate(canned.url, _spec(), timeout=5)


def test_http_generate_stream(canned):
    canned.routes[STREAM] = (200, b": comment\n\n" + _events({"text_output": "a"}, {"x": 1}))
    assert http_generate_stream(canned.url, _spec(), timeout=5) == "ok"
    assert http_generate_stream(canned.url, _spec(cancel_after=1), timeout=5) == "cancelled"


@pytest.mark.parametrize(
    "body, message",
    [
        (_events({"text_output": "a"}, {"error": "boom"}), "event: boom"),
        (b"", "without an event"),
    ],
)
def test_http_generate_stream_failures(canned, body, message):
    canned.routes[STREAM] = (200, body)
    with pytest.raises(RequestFailed, match=message):
        http_generate_stream(canned.url, _spec(), timeout=5)


def _response(outputs: int, final: bool) -> SimpleNamespace:
    response = SimpleNamespace(
        outputs=[object()] * outputs,
        parameters={"triton_final_response": SimpleNamespace(bool_param=final)},
    )
    return SimpleNamespace(get_response=lambda: response)


class FakeGrpcClient:
    """Answers each request with `answers` ((result, error) pairs) on the stream's queue."""

    def __init__(self, stream: GrpcStream, answers: list) -> None:
        self.stream, self.answers = stream, answers
        self.sent: list[str] = []
        self.stopped = self.closed = False

    def async_stream_infer(self, model, inputs, request_id, enable_empty_final_response):
        assert model == "speculative" and enable_empty_final_response
        self.sent.append(request_id)
        for answer in self.answers:
            self.stream.results.put(answer)

    def stop_stream(self, cancel_requests: bool) -> None:
        self.stopped = cancel_requests

    def close(self) -> None:
        self.closed = True


def _stream(answers: list) -> tuple[GrpcStream, FakeGrpcClient]:
    stream = GrpcStream("127.0.0.1:1")
    stream.client = fake = FakeGrpcClient(stream, answers)
    return stream, fake


def test_grpc_stream_reads_to_the_final_response():
    answers = [(_response(1, False), None), (_response(1, False), None), (_response(0, True), None)]
    stream, fake = _stream(answers)
    assert stream.generate(_spec("grpc"), "r1", timeout=5) == "ok"
    assert fake.sent == ["r1"] and stream.client is fake  # the stream stays open


def test_grpc_stream_cancels_by_stopping_the_stream():
    stream, fake = _stream([(_response(1, False), None)] * 3)
    assert stream.generate(_spec("grpc", cancel_after=2), "r1", timeout=5) == "cancelled"
    assert fake.stopped and fake.closed and stream.client is None


@pytest.mark.parametrize(
    "answers, message",
    [([(None, "UNAVAILABLE: gone")], "gRPC: UNAVAILABLE: gone"), ([], "no response for 0 s")],
)
def test_grpc_stream_failures_close_the_stream(answers, message):
    stream, fake = _stream(answers)
    with pytest.raises(RequestFailed, match=message):
        stream.generate(_spec("grpc"), "r1", timeout=0.05)
    assert fake.closed and stream.client is None
    stream.close()  # closing a closed stream is a no-op


def test_send_picks_the_protocol(canned):
    canned.routes[GENERATE] = (200, b'{"text_output": "ok"}')
    canned.routes[STREAM] = (200, _events({"text_output": "a"}))
    stream, _ = _stream([(_response(0, True), None)])
    endpoints = Endpoints("unused", canned.url)
    for protocol in ("grpc", "http", "http_stream"):
        assert send(_spec(protocol), endpoints, stream, "r", timeout=5) == "ok"
    assert canned.hits == {GENERATE: 1, STREAM: 1}


def test_tally_counts_and_keeps_errors(monkeypatch):
    monkeypatch.setattr(load, "MAX_KEPT_ERRORS", 2)
    tally = Tally()
    tally.add("grpc", "ok")
    tally.add("http", "cancelled")
    for _ in range(3):
        tally.add("http_stream", "failed", "HTTP 503: busy")
    assert (tally.total("ok"), tally.total("failed"), tally.total("cancelled")) == (1, 3, 1)
    assert tally.done() == 5 and tally.errors == ["http_stream: HTTP 503: busy"] * 2
    assert tally.by_protocol()["http"] == {"ok": 0, "failed": 0, "cancelled": 1}


def test_client_loop_counts_failures_and_goes_on(monkeypatch):
    """Nothing listens: gRPC answers an error, HTTP raises URLError; each is counted."""
    monkeypatch.setattr(load, "FAILURE_PAUSE_S", 0.0)
    port = free_port()
    endpoints = Endpoints(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}")
    tally = Tally()
    client_loop(0, endpoints, Mix(["a"]), tally, time.monotonic() + 0.5, 0, request_timeout=5)
    counts = tally.by_protocol()
    assert tally.failed == tally.done() > 0
    assert counts["grpc"]["failed"] and counts["http"]["failed"]
    # the stream's failure reaches the loop either through its callback (RequestFailed) or, when
    # the client library notices first, as its own exception on the next send: both are counted
    grpc_errors = [e for e in tally.errors if e.startswith("grpc: ")]
    assert grpc_errors and all(
        e.startswith(("grpc: gRPC:", "grpc: InferenceServerException:")) for e in grpc_errors
    ), grpc_errors
    assert any(e.startswith("http: URLError:") for e in tally.errors)


def test_loops_end_at_the_deadline():
    tally = Tally()
    threads = start_loops(3, Endpoints("x:1", "http://x"), Mix(["a"]), tally, 0.0, 0, 5.0)
    assert len(threads) == 3 and join_loops(threads, within_s=10) == 0
    assert tally.done() == 0


def test_join_loops_counts_the_stuck_ones():
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    done = threading.Thread(target=lambda: None)
    for thread in (stuck, done):
        thread.start()
    assert join_loops([stuck, done], within_s=0.1) == 1
    release.set()
    stuck.join()
