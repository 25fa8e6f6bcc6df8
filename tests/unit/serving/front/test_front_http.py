"""The front's HTTP relay against a fake Triton: routing, limits, identity, streaming."""

from __future__ import annotations

import http.client
import json
import socket
import time

import grpc
import pytest
from helpers.front_fakes import (
    ADMIN_KEY,
    GOOD_BODY,
    MAX_BODY,
    front_config,
    raw_exchange,
    read_reply,
    request,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc

from avspec.serving.front import Front
from avspec.serving.server_process import free_port

IDENTITY = {"avspec-client": "127.0.0.1"}


@pytest.mark.parametrize(
    "path",
    ["/v2", "/v2/health/live", "/v2/models/speculative", "/v2/models/speculative/versions/1/ready"],
)
def test_public_get_is_forwarded(front, fake_http, path):
    status, payload, _ = request(front.http_port, "GET", path)
    assert (status, payload) == (200, {"path": path})
    assert [r.path for r in fake_http.requests] == [path]


def test_generate_forwarded_with_identity_and_spoofs_removed(front, fake_http):
    spoofs = {"avspec-client": "1.2.3.4:1", "avspec-front-key": "guess", "X-Avspec-Client": "z"}
    status, payload, _ = request(
        front.http_port, "POST", "/v2/models/speculative/generate", GOOD_BODY, spoofs
    )
    # Triton 2.51 hands generate fields, not headers, to the model: the identity is in both.
    assert status == 200 and json.loads(payload["echo"]) == {**GOOD_BODY, **IDENTITY}
    (seen,) = fake_http.requests
    assert seen.header("avspec-client") == ["127.0.0.1"]
    # Only the front reaches Triton: no key of any kind goes upstream, the identity alone.
    assert [name for name, _ in seen.headers if "avspec" in name.lower()] == ["avspec-client"]
    assert seen.header("x-avspec-client") == []
    assert seen.header("connection") == []  # HTTP/1.1: the upstream connection is kept alive


@pytest.mark.parametrize(
    ("headers", "forwarded"),
    [({}, False), ({"avspec-admin-key": "wrong"}, False), ({"avspec-admin-key": ADMIN_KEY}, True)],
)
def test_admin_path_needs_the_admin_key(front, fake_http, headers, forwarded):
    status, payload, _ = request(front.http_port, "POST", "/v2/repository/index", b"{}", headers)
    if forwarded:
        assert status == 200
        assert fake_http.requests[0].header("avspec-admin-key") == []  # checked here only
    else:
        assert status == 403 and "avspec-admin-key" in payload["error"]
        assert "not public" in payload["error"] and not fake_http.requests


def test_admin_closed_without_admin_key(fake_http, fake_grpc):
    with Front(front_config(fake_http, fake_grpc)) as closed:
        headers = {"avspec-admin-key": ADMIN_KEY}
        status, payload, _ = request(closed.http_port, "GET", "/v2/models/stats", None, headers)
        with grpc.insecure_channel(f"127.0.0.1:{closed.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.RepositoryIndex(
                    service_pb2.RepositoryIndexRequest(),
                    metadata=(("avspec-admin-key", ADMIN_KEY),),
                )
    assert status == 403 and "closed" in payload["error"]
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "closed" in err.value.details()
    assert not fake_http.requests and not fake_grpc.calls


def test_internal_model_is_refused(front, fake_http):
    status, payload, _ = request(
        front.http_port, "POST", "/v2/models/speculative_step/infer", {"inputs": []}
    )
    assert status == 403 and "speculative_step" in payload["error"]
    status, _, _ = request(front.http_port, "GET", "/v2/models/speculative/config")
    assert status == 403
    assert not fake_http.requests


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


@pytest.mark.parametrize(
    ("fragment", "field"),
    [
        ('"max_tokens": "8"', "max_tokens"),
        ('"max_tokens": 8, "temperature": "NaN"', "temperature"),
        ('"max_tokens": 8, "temperature": NaN', "temperature"),
        ('"max_tokens": 8, "temperature": -Infinity', "temperature"),
        ('"max_tokens": 8, "temperature": 1e39', "temperature"),
        ('"max_tokens": 8, "random_seed": -1', "random_seed"),
        ('"max_tokens": 8, "stream": "yes"', "stream"),
        ('"max_tokens": 8, "stream": 1', "stream"),
        ('"max_tokens": 4294967300', "max_tokens"),
        ('"max_tokens": true', "max_tokens"),
        ('"max_tokens": 8, "avspec-client": "x"', "avspec-client"),
        ('"temperature": 1.0', "max_tokens"),
    ],
)
def test_bad_generate_body_gets_400_naming_the_field(front, fake_http, fragment, field):
    body = ('{"text_input": "hi", ' + fragment + "}").encode()
    for path in ("/v2/models/speculative/generate", "/v2/models/speculative/generate_stream"):
        status, payload, _ = request(front.http_port, "POST", path, body)
        assert status == 400 and repr(field) in payload["error"], payload
    assert not fake_http.requests


@pytest.mark.parametrize("body", [b"[1]", b"not json", b'{"text_input": "a", "text_input": "b"}'])
def test_generate_body_must_be_one_json_object(front, body):
    status, payload, _ = request(front.http_port, "POST", "/v2/models/speculative/generate", body)
    assert status == 400 and payload["error"]


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


def test_client_disconnect_closes_upstream(front, fake_http):
    body = json.dumps({"text_input": "endless", "max_tokens": 3})
    head = (
        "POST /v2/models/speculative/generate_stream HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", front.http_port), timeout=10) as sock:
        sock.sendall(head.encode() + body.encode())
        received = b""
        while b"t0" not in received:
            data = sock.recv(65536)
            assert data, received
            received += data
        assert not fake_http.disconnected.is_set()
    assert fake_http.disconnected.wait(2.0)


def test_upstream_unreachable_is_503(fake_http, fake_grpc):
    """Triton down (restarting, avspec.serving.restart): 503, retry; not 502, a broken gateway."""
    config = front_config(fake_http, fake_grpc, upstream_http=f"127.0.0.1:{free_port()}")
    with Front(config) as broken:
        status, payload, _ = request(broken.http_port, "GET", "/v2")
        assert status == 503 and "unreachable" in payload["error"]
        assert request(broken.http_port, "GET", "/v2/health/ready")[0] == 503


@pytest.mark.parametrize(
    ("head", "status"),
    [
        ("GARBAGE\r\n\r\n", 400),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n", 400),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nX: a\nAvspec-Client: spoof\r\n\r\n", 400),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", 400),  # obsolete line fold
        ("POST /v2/models/speculative/generate HTTP/1.1\r\nHost: x\r\n\r\n", 411),
        (
            "POST /v2/models/speculative/generate HTTP/1.1\r\nHost: x\r\n"
            "Content-Length: \u00b2\r\n\r\n",
            400,
        ),
        ("DELETE /v2/models/speculative HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nX: " + "a" * (20 << 10) + "\r\n\r\n", 431),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\n" + "X: y\r\n" * 100 + "\r\n", 431),
        # each line within the limit, the head past it: Triton breaks on heads past ~8.1 KB
        (
            "GET /v2 HTTP/1.1\r\nHost: x\r\nX: " + "a" * 5000 + "\r\nY: " + "a" * 5000 + "\r\n\r\n",
            431,
        ),
        ("GET /v2 HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host (RFC 9112 section 3.2)
    ],
)
def test_malformed_requests(front, fake_http, head, status):
    reply = raw_exchange(front.http_port, head)
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply[:200]
    assert b"\r\nContent-Type: application/json" in reply and b'{"error": ' in reply
    assert not fake_http.requests


def test_slow_client_times_out(fake_http, fake_grpc):
    with Front(front_config(fake_http, fake_grpc, read_timeout_s=0.3)) as quick:
        started = time.monotonic()
        reply = raw_exchange(quick.http_port, "GET /v2 HTTP/1.1\r\n")
    assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 2


def test_connection_limit(fake_http, fake_grpc):
    with (
        Front(front_config(fake_http, fake_grpc, max_connections=1)) as small,
        socket.create_connection(("127.0.0.1", small.http_port), timeout=10) as idle,
    ):
        idle.sendall(b"GET /v2 HTTP/1.1\r\n")  # holds the only slot, head unfinished
        time.sleep(0.1)
        reply = raw_exchange(small.http_port, "GET /v2 HTTP/1.1\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in reply


def test_stop_is_idempotent_and_closes_the_ports(fake_http, fake_grpc):
    running = Front(front_config(fake_http, fake_grpc)).start()
    port = running.http_port
    running.stop()
    running.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


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


def test_infer_body_is_forwarded_unchanged_with_the_identity_header(front, fake_http):
    body = json.dumps({"inputs": [], "parameters": {"x": 1}}).encode()
    status, _, _ = request(front.http_port, "POST", "/v2/models/speculative/infer", body)
    assert status == 200
    (seen,) = fake_http.requests
    assert seen.body == body and seen.header("avspec-client") == ["127.0.0.1"]
