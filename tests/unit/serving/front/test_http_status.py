"""front.http_status: status codes that tell a client what happened (issue 20, finding 6), against
fake upstreams.

Before: a full queue and a stage failing mid-request both reached the client as 400 (Triton
2.51 answers 400 to every error a decoupled model sends, whatever its code), so clients took them
for their own mistake and never retried; no 503 said when to retry. Now: overload 503 and a
server-side failure 500, Retry-After on every 429 and 503. The finding's other cases: a lone
surrogate (400 naming the field) in test_schema.py, an unknown model (404) in
test_http_routes.py and test_grpc_relay.py.
"""

from __future__ import annotations

import json

import pytest
from helpers.front_fakes import GOOD_BODY, post, raw_exchange

from avspec.engine.admission import AdmissionQueue, Overloaded
from avspec.serving.front import http_status

GENERATE = "/v2/models/speculative/generate"
OVERLOADED = "overloaded: 64 requests queued for this client (limit 64); retry later"
FAILED = "generation failed: speculative_step: Model 'speculative_step' is not ready."
TIMED_OUT = "request ran past the server's limit of 600 s per request (request_timeout_s)"
CLIENT_MISTAKE = "text_input must be a non-empty string"


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
