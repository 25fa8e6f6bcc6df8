"""front.http_upstream against a fake Triton: what goes upstream (the client's headers without any
naming `avspec`, the caller's identity, the body unchanged) on a kept-alive connection, the
upstream call closed when its client goes away, and Triton unreachable.
"""

from __future__ import annotations

import json
import socket

from helpers.front_fakes import GOOD_BODY, IDENTITY, front_config, request

from avspec.serving.front import Front
from avspec.serving.host.server_process import free_port


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


def test_infer_body_is_forwarded_unchanged_with_the_identity_header(front, fake_http):
    body = json.dumps({"inputs": [], "parameters": {"x": 1}}).encode()
    status, _, _ = request(front.http_port, "POST", "/v2/models/speculative/infer", body)
    assert status == 200
    (seen,) = fake_http.requests
    assert seen.body == body and seen.header("avspec-client") == ["127.0.0.1"]


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
    """Triton down (restarting, avspec.serving.host.restart): 503, retry; not 502, a broken
    gateway."""
    config = front_config(fake_http, fake_grpc, upstream_http=f"127.0.0.1:{free_port()}")
    with Front(config) as broken:
        status, payload, _ = request(broken.http_port, "GET", "/v2")
        assert status == 503 and "unreachable" in payload["error"]
        assert request(broken.http_port, "GET", "/v2/health/ready")[0] == 503
