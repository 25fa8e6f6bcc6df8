"""front.http_routes against a fake Triton: the public paths and models are forwarded, anything
else needs the operator's admin key, and a refused model says whether it is unknown or internal.

Before (issue 20, finding 6): a typo in a model name got 403 "internal ... admin key". Now an
unknown model is 404 naming the models served, an internal one 403 with no hint on opening it;
the operator's admin key still reaches any model.
"""

from __future__ import annotations

import json

import pytest
from helpers.front_fakes import ADMIN_KEY, GOOD_BODY, post, raw_exchange, request


@pytest.mark.parametrize(
    "path",
    ["/v2", "/v2/health/live", "/v2/models/speculative", "/v2/models/speculative/versions/1/ready"],
)
def test_public_get_is_forwarded(front, fake_http, path):
    status, payload, _ = request(front.http_port, "GET", path)
    assert (status, payload) == (200, {"path": path})
    assert [r.path for r in fake_http.requests] == [path]


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


def test_internal_model_is_refused(front, fake_http):
    status, payload, _ = request(
        front.http_port, "POST", "/v2/models/speculative_step/infer", {"inputs": []}
    )
    assert status == 403 and "speculative_step" in payload["error"]
    status, _, _ = request(front.http_port, "GET", "/v2/models/speculative/config")
    assert status == 403
    assert not fake_http.requests


@pytest.mark.parametrize(
    ("model", "status", "text"),
    [
        ("specultive", 404, "unknown model 'specultive'; this server serves 'speculative'"),
        ("draft", 403, "model 'draft' is internal"),
    ],
)
def test_unknown_model_is_404_and_internal_403_without_a_hint(
    front, fake_http, model, status, text
):
    for path in (f"/v2/models/{model}/generate", f"/v2/models/{model}/infer"):
        head, answer = post(front.http_port, path, json.dumps(GOOD_BODY).encode())
        assert head.startswith(f"HTTP/1.1 {status} ".encode())
        assert json.loads(answer) == {"error": text}  # nothing on how to open it
    head = raw_exchange(front.http_port, f"GET /v2/models/{model} HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode())
    assert not fake_http.requests
    admin = f"avspec-admin-key: {ADMIN_KEY}\r\n"  # the operator still reaches any model
    head, _ = post(front.http_port, f"/v2/models/{model}/infer", b'{"inputs": []}', admin)
    assert head.startswith(b"HTTP/1.1 200 ") and len(fake_http.requests) == 1
