"""front.http_relay against a fake Triton: request bodies (the size limit, 413 before upstream
and in place of `100 Continue`, reserved infer parameters), readiness, failing fast while a stage
restarts, event streams relayed as they come, and the caller's identity on every generate call.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from helpers.front_fakes import GOOD_BODY, IDENTITY, MAX_BODY, raw_exchange, read_reply, request

GENERATE = "/v2/models/speculative/generate"


def test_large_body_within_the_limit_is_forwarded_intact(front, fake_http):
    body = json.dumps({"inputs": [{"name": "x", "data": list(range(9000))}]}).encode()
    assert 48 << 10 < len(body) <= MAX_BODY  # beyond the reader's 2 x 16 KB pause threshold
    status, _, _ = request(front.http_port, "POST", "/v2/models/speculative/infer", body)
    assert status == 200 and fake_http.requests[0].body == body


def test_reserved_infer_parameter_is_refused(front, fake_http):
    body = {"inputs": [], "parameters": {"avspec-client": "someone-else"}}
    status, payload, _ = request(front.http_port, "POST", "/v2/models/speculative/infer", body)
    assert status == 400 and "avspec-client" in payload["error"]
    assert not fake_http.requests


@pytest.mark.parametrize("expect", [True, False])
def test_oversized_body_gets_413_before_upstream(front, fake_http, expect):
    size = 10 << 20
    head = (
        "POST /v2/models/speculative/generate HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {size}\r\n" + ("Expect: 100-continue\r\n" if expect else "") + "\r\n"
    )
    reply = raw_exchange(front.http_port, head, b"" if expect else b"x" * 4096)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in reply
    assert str(MAX_BODY).encode() in reply
    time.sleep(0.05)
    assert not fake_http.requests


def test_expect_continue_within_limit_is_answered_by_the_front(front, fake_http):
    body = json.dumps(GOOD_BODY).encode()
    head = (
        "POST /v2/models/speculative/generate HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", front.http_port), timeout=10) as sock:
        sock.sendall(head.encode())
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 200 ")
    (seen,) = fake_http.requests
    assert seen.header("expect") == [] and json.loads(seen.body) == {**GOOD_BODY, **IDENTITY}


def test_chunked_body_past_the_limit_is_413(front, fake_http):
    head = f"POST {GENERATE} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"x" * (16 << 10)
    count = MAX_BODY // len(chunk) + 2
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(count))
    reply = raw_exchange(front.http_port, head, body + b"0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413 ") and str(MAX_BODY).encode() in reply
    assert not fake_http.requests


def test_readiness(front, fake_http, state):
    assert request(front.http_port, "GET", "/v2/health/ready")[0] == 200
    state["ready"] = False
    status, payload, _ = request(front.http_port, "GET", "/v2/health/ready")
    assert status == 503 and "stages" in payload["error"]
    state["ready"] = True
    fake_http.ready = False
    assert request(front.http_port, "GET", "/v2/health/ready")[0] == 503


def test_inference_fails_fast_while_a_stage_restarts(front, fake_http, state):
    state["ready"] = False
    body = {"text_input": "a", "max_tokens": 4}
    status, payload, _ = request(front.http_port, "POST", "/v2/models/speculative/generate", body)
    assert status == 503 and "restarting" in payload["error"]
    assert not fake_http.requests
    state["ready"] = True
    assert request(front.http_port, "POST", "/v2/models/speculative/generate", body)[0] == 200


def test_sse_chunks_arrive_before_upstream_finishes(front, fake_http):
    connection = http.client.HTTPConnection("127.0.0.1", front.http_port, timeout=10)
    body = json.dumps({"text_input": "slow", "max_tokens": 3})
    started = time.monotonic()
    connection.request("POST", "/v2/models/speculative/generate_stream", body=body)
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Connection") is None  # kept alive
    first = response.read1(65536)
    first_at = time.monotonic() - started
    rest = response.read()
    done_at = time.monotonic() - started
    connection.close()
    assert b"t0" in first and b"t2" in rest
    # The fake sleeps 0.3 s after each of its 3 events: buffering would deliver all at the end.
    assert done_at >= 0.85 and done_at - first_at >= 0.5


def test_http_identity_is_the_client_ip_on_every_connection(front, fake_http):
    """Each HTTP request has a connection (and a port) of its own: the IP alone is stable."""
    fake_http.stream_gap_s = 0.01
    ports = set()
    for path in ("/v2/models/speculative/generate", "/v2/models/speculative/generate_stream"):
        for _ in range(2):
            status, _, port = request(front.http_port, "POST", path, GOOD_BODY)
            assert status == 200
            ports.add(port)
    assert len(ports) == 4
    for seen in fake_http.requests:
        assert seen.header("avspec-client") == ["127.0.0.1"]
        assert json.loads(seen.body)["avspec-client"] == "127.0.0.1"
