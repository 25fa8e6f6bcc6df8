"""The front's metrics port: Triton's /metrics and nothing else (front.metrics_relay).

Triton's own metrics server answered 200 with an empty body on any GET path, `/v2/health/ready`
included, so a probe pointed at the metrics port saw a healthy server whatever its state.
"""

from __future__ import annotations

import http.client
import json

import pytest
from helpers.front_fakes import front_config, raw_exchange, request

from avspec.serving.front import Front
from avspec.serving.host.server_process import free_port


@pytest.fixture(scope="module")
def metrics_front(fake_http, fake_grpc):
    config = front_config(fake_http, fake_grpc, upstream_metrics=f"127.0.0.1:{fake_http.port}")
    with Front(config) as front:
        yield front


def test_metrics_are_relayed_from_upstream(metrics_front: Front, fake_http) -> None:
    status, body, _ = request(metrics_front.metrics_port, "GET", "/metrics")
    assert status == 200 and body == {"path": "/metrics"}  # the fake's answer, as it sent it
    assert fake_http.requests[-1].path == "/metrics"


def test_every_answer_says_nosniff(metrics_front: Front) -> None:
    for path in ("/metrics", "/elsewhere"):
        reply = raw_exchange(metrics_front.metrics_port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"\r\nX-Content-Type-Options: nosniff\r\n" in reply, reply[:200]


@pytest.mark.parametrize("path", ["/v2/health/ready", "/", "/metrics/extra", "/v2/models/x"])
def test_every_other_path_is_not_found(metrics_front: Front, fake_http, path: str) -> None:
    fake_http.clear()
    status, _, _ = request(metrics_front.metrics_port, "GET", path)
    assert status == 404 and not fake_http.requests  # never reaches Triton


def test_only_get_is_allowed(metrics_front: Front) -> None:
    status, _, _ = request(metrics_front.metrics_port, "POST", "/metrics", body=b"x")
    assert status == 405


def test_unreachable_upstream_is_503_with_retry_after(fake_http, fake_grpc) -> None:
    config = front_config(fake_http, fake_grpc, upstream_metrics=f"127.0.0.1:{free_port()}")
    with Front(config) as front:
        connection = http.client.HTTPConnection("127.0.0.1", front.metrics_port, timeout=10)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 503 and response.getheader("Retry-After")
        assert "unreachable" in json.loads(response.read())["error"]
        connection.close()
