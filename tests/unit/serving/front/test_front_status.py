"""Status codes that tell a client what happened (issue 20, finding 6), against fake upstreams.

Before: a full queue and a stage failing mid-request both reached the client as 400 (Triton
2.51 answers 400 to every error a decoupled model sends, whatever its code), so clients took them
for their own mistake and never retried; no 503 said when to retry; a lone surrogate escape in
`text_input` got 500 from Triton's parser; a typo in a model name got 403 "internal ... admin
key". Now: overload 503 and a server-side failure 500, Retry-After on every 429 and 503, the
surrogate 400 naming the field, an unknown model 404, an internal one 403 with no hint.
"""

from __future__ import annotations

import json

import grpc
import pytest
from helpers.front_fakes import ADMIN_KEY, GOOD_BODY, infer_request, raw_exchange
from tritonclient.grpc import service_pb2

from avspec.engine.admission import AdmissionQueue, Overloaded
from avspec.serving.front import http_status

GENERATE = "/v2/models/speculative/generate"
OVERLOADED = "overloaded: 64 requests queued for this client (limit 64); retry later"
FAILED = "generation failed: speculative_step: Model 'speculative_step' is not ready."
TIMED_OUT = "request ran past the server's limit of 600 s per request (request_timeout_s)"
CLIENT_MISTAKE = "text_input must be a non-empty string"


def post(port: int, path: str, body: bytes, headers: str = "") -> tuple[bytes, bytes]:
    """(head, body) of the front's answer to one POST."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    reply = raw_exchange(port, head, body)
    answer_head, _, answer_body = reply.partition(b"\r\n\r\n")
    return answer_head, answer_body


@pytest.mark.parametrize("action", ["generate", "generate_stream"])
@pytest.mark.parametrize(
    ("message", "status"),
    [(OVERLOADED, 503), (TIMED_OUT, 503), (FAILED, 500), (CLIENT_MISTAKE, 400)],
)
def test_entry_errors_get_the_status_the_entry_meant(front, fake_http, action, message, status):
    body = json.dumps({**GOOD_BODY, "text_input": f"error:400:{message}"}).encode()
    head, answer = post(front.http_port, f"/v2/models/speculative/{action}", body)
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
    assert (b"\r\nRetry-After: 1" in head) is (status == 503)
    # the body goes out as Triton wrote it: the error object, or the one event of a stream
    error = json.dumps({"error": message}).encode()
    assert answer == (b"data: " + error + b"\n\n" if action == "generate_stream" else error)
    assert len(fake_http.requests) == 1


def test_the_admission_queue_overload_message_is_a_503():
    """The front keys on the entry's words: the queue's own message must still match."""
    queue: AdmissionQueue[int] = AdmissionQueue(max_queued=1)
    queue.add("a", 1, free_slots=0)
    with pytest.raises(Overloaded) as err:
        queue.add("b", 2, free_slots=0)
    assert http_status.entry_error_status(json.dumps({"error": str(err.value)}).encode()) == 503


@pytest.mark.parametrize(
    ("body", "status"),
    [(b"", None), (b"not json", None), (b'{"error": 3}', None), (b'{"error": "x"}', "x")],
)
def test_error_message_of_odd_bodies(body, status):
    assert http_status.error_message(body) == status


def test_every_503_the_front_sends_or_relays_says_when_to_retry(front, fake_http, state):
    body = json.dumps(GOOD_BODY).encode()
    relayed = json.dumps({**GOOD_BODY, "text_input": "error:503:busy"}).encode()
    state["ready"] = False
    answers = {
        "restarting": post(front.http_port, GENERATE, body)[0],
        "not ready": raw_exchange(
            front.http_port, "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
        ),
    }
    state["ready"] = True
    answers["relayed"] = post(front.http_port, GENERATE, relayed)[0]
    for what, head in answers.items():
        assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in head, what


def test_a_lone_surrogate_is_400_naming_the_field(front, fake_http):
    body = b'{"text_input": "a\\ud800", "max_tokens": 4}'
    head, answer = post(front.http_port, GENERATE, body)
    assert head.startswith(b"HTTP/1.1 400 ")
    assert "'text_input'" in json.loads(answer)["error"] and "surrogate" in answer.decode()
    assert not fake_http.requests
    pair = b'{"text_input": "\\ud83d\\ude00", "max_tokens": 4}'  # a valid pair passes
    assert post(front.http_port, GENERATE, pair)[0].startswith(b"HTTP/1.1 200 ")


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


@pytest.mark.parametrize(
    ("model", "code", "text"),
    [
        ("specultive", grpc.StatusCode.NOT_FOUND, "unknown model 'specultive'"),
        ("draft", grpc.StatusCode.PERMISSION_DENIED, "model 'draft' is internal"),
    ],
)
def test_grpc_unknown_model_is_not_found_and_internal_permission_denied(
    stub, fake_grpc, model, code, text
):
    calls = (
        lambda: stub.ModelInfer(infer_request(model)),
        lambda: stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=model)),
        lambda: list(stub.ModelStreamInfer(iter([infer_request(model)]))),
    )
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code and err.value.details().startswith(text)
        assert "admin" not in err.value.details()
    # (a stream's upstream call opens with the stream; the refused request never went on it)
    assert [name for name, _ in fake_grpc.calls if name != "ModelStreamInfer"] == []
    admin = (("avspec-admin-key", ADMIN_KEY),)
    assert stub.ModelInfer(infer_request(model), metadata=admin).model_name == model
