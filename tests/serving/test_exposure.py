"""What a client can reach through the public ports (issue: closed admin surface, intake).

Each test is one defect found by a hostile client on the previous deployment, which bound
Triton's own ports on every interface: it loaded arbitrary Python through the repository API,
drove the internal stage models directly, and crashed the server with a 10 MB body.
"""

from __future__ import annotations

import json
import socket
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers.clients import GrpcStream, http_generate, post_json
from helpers.server import ADMIN_KEY

from avspec.serving.host.server_process import ServerProcess

EVIL_LOAD = {
    "parameters": {
        "config": json.dumps({"name": "evil", "backend": "python"}),
        "file:1/model.py": "aW1wb3J0IG9zCg==",  # base64 of `import os`
    }
}


def status_of(url: str, data: bytes | None = None, headers: dict | None = None) -> int:
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.parametrize(
    "path",
    [
        "/v2/repository/models/evil/load",
        "/v2/repository/models/verifier/unload",
        "/v2/repository/index",
        "/v2/logging",
        "/v2/trace/setting",
        "/v2/models/verifier/config",
        "/v2/models/stats",
    ],
)
def test_admin_api_is_closed_to_clients(server: ServerProcess, path: str) -> None:
    body = json.dumps(EVIL_LOAD).encode()
    assert status_of(server.http_url + path, body) == 403
    assert status_of(server.http_url + path, body, {"avspec-admin-key": "guess" * 8}) == 403
    assert server.supervisor.ready()  # nothing was unloaded


def test_admin_api_opens_with_the_operator_key(server: ServerProcess) -> None:
    url = server.http_url + "/v2/repository/index"
    assert status_of(url, b"{}", {"avspec-admin-key": ADMIN_KEY}) == 200
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception, match="(?i)permission|not public|admin"):
        client.get_model_repository_index()
    index = client.get_model_repository_index(headers={"avspec-admin-key": ADMIN_KEY})
    assert {m.name for m in index.models} >= {"speculative", "verifier"}


def test_admin_load_over_grpc_is_refused(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception, match="(?i)permission|not public|admin"):
        client.load_model("evil", config=EVIL_LOAD["parameters"]["config"])
    with pytest.raises(Exception, match="(?i)permission|not public|admin"):
        client.unload_model("verifier")


def _draft_inputs(module) -> list:
    """A draft-stage request with 128 made-up sequences: would fill the KV cache if it ran."""
    ids = np.arange(1, 129, dtype=np.int64)
    values = {"seq_ids": ids, "release_seq_ids": ids}
    inputs = []
    for name, value in values.items():
        tensor = module.InferInput(name, list(value.shape), "INT64")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


@pytest.mark.parametrize("model", ["draft", "verifier", "target", "speculative_step"])
def test_internal_models_cannot_be_driven(server: ServerProcess, model: str) -> None:
    url = f"{server.http_url}/v2/models/{model}/infer"
    assert status_of(url, json.dumps({"inputs": []}).encode()) == 403
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(Exception, match="(?i)permission|internal|not public"):
        client.infer(model, _draft_inputs(grpcclient))
    # Another local user cannot go around the front: tests/serving/test_host_boundary.py


def test_internal_model_in_a_grpc_stream_ends_the_stream(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors: list = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("draft", _draft_inputs(grpcclient))
    client.stop_stream()
    assert errors, "the refused stream message got no answer"
    assert any(word in str(errors[0]).lower() for word in ("internal", "permission"))


def raw_post(server: ServerProcess, headers: str, body: bytes = b"") -> bytes:
    """Send a hand-made POST (curl's Expect: 100-continue included) and return the reply."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as conn:
        conn.sendall(headers.encode() + b"\r\n" + body)
        return conn.recv(4096)


def test_ten_megabyte_body_is_refused_before_triton_sees_it(server: ServerProcess) -> None:
    head = (
        "POST /v2/models/speculative/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10 << 20}\r\n"
        "Expect: 100-continue\r\n"
    )
    reply = raw_post(server, head)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    # the same without Expect, body actually sent
    head = head.replace("Expect: 100-continue\r\n", "")
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as conn:
        conn.sendall(head.encode() + b"\r\n")
        reply = conn.recv(4096)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert server.process.poll() is None
    assert len(http_generate(server.http_url, text_input="alive", max_tokens=4).text) == 4


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "8"),
        ("temperature", "NaN"),
        ("random_seed", -1),
        ("stream", "yes"),
        ("max_tokens", 4294967300),
    ],
)
def test_wrong_json_types_get_400_naming_the_field(
    server: ServerProcess, field: str, value: object
) -> None:
    payload = {"text_input": "x", "max_tokens": 8, field: value}
    status, body = post_json(f"{server.http_url}/v2/models/speculative/generate", payload)
    assert status == 400, body
    assert field in body


def test_huge_temperature_is_refused_at_the_entry_over_grpc(server: ServerProcess) -> None:
    stream = GrpcStream(server.grpc_url)
    try:
        stream.send(text_input="x", max_tokens=8, temperature=np.float32(1e38), stream=True)
        result, error = stream.next(30)
        assert result is None and "temperature" in str(error)
    finally:
        stream.close()


def test_metrics_stay_public(server: ServerProcess) -> None:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        assert b"av_estimator_slope" in response.read()


def test_grpc_message_over_the_limit_is_refused(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    big = grpcclient.InferInput("text_input", [1], "BYTES")
    big.set_data_from_numpy(np.array([b"x" * (server.max_body_bytes + 1)], dtype=object))
    with pytest.raises(Exception, match="(?i)resource|exhausted|larger|limit"):
        client.infer("speculative", [big])
