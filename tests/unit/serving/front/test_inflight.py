"""front.inflight, through Front.abort_inference: every forwarded inference call in flight ends at
once, with an error, on both relays.

Triton 2.51 never answers the in-flight decoupled requests of a model whose stub died; the
launcher then calls abort_inference so that clients get an error instead of a hung stream.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent import futures

import grpc
import pytest
from helpers.front_fakes import GOOD_BODY, front_config, infer_request, request
from tritonclient.grpc import service_pb2, service_pb2_grpc

from avspec.serving.front import Front

MESSAGE = "the speculative stage restarted; the request was lost, retry"
PROMPT_S = 2.0  # how soon an aborted client must hear of it
DEADLINE_S = 10.0  # endless calls carry one: without abort_inference they would end only then


@pytest.fixture
def own_front(fake_http, fake_grpc):
    """A front of its own: no call of another test is in flight there."""
    with Front(front_config(fake_http, fake_grpc)) as running:
        yield running


@pytest.fixture
def own_stub(own_front):
    with grpc.insecure_channel(f"127.0.0.1:{own_front.grpc_port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_new_calls_work(front: Front, stub) -> None:
    """Calls started after abort_inference are not affected."""
    stream = json.dumps({"text_input": "fast", "max_tokens": 3}).encode()
    path = "/v2/models/speculative/generate_stream"
    status, payload, _ = request(front.http_port, "POST", path, stream)
    assert status == 200 and b"t2" in payload and b"error" not in payload
    (response,) = stub.ModelStreamInfer(iter([infer_request(request_id="after")]))
    assert response.infer_response.id == "after"


def test_abort_without_calls_or_front(fake_http, fake_grpc):
    front = Front(front_config(fake_http, fake_grpc))
    assert front.abort_inference(MESSAGE) == 0  # not started
    with front:
        assert front.abort_inference(MESSAGE) == 0
        assert request(front.http_port, "GET", "/v2")[0] == 200
        assert front.abort_inference(MESSAGE) == 0  # done calls and non-inference are not kept
    assert front.abort_inference(MESSAGE) == 0  # stopped


def test_abort_http_event_stream_mid_stream(own_front, own_stub, fake_http):
    fake_http.stream_gap_s = 0.02  # the fast stream of assert_new_calls_work
    connection = http.client.HTTPConnection("127.0.0.1", own_front.http_port, timeout=DEADLINE_S)
    body = json.dumps({"text_input": "endless", "max_tokens": 3})
    connection.request("POST", "/v2/models/speculative/generate_stream", body=body)
    response = connection.getresponse()
    assert response.status == 200
    assert b"t0" in response.read1(65536)
    started = time.monotonic()
    assert own_front.abort_inference(MESSAGE) == 1
    rest = response.read()  # chunked: IncompleteRead unless the body ends properly
    assert time.monotonic() - started < PROMPT_S
    connection.close()
    event = b"data: " + json.dumps({"error": MESSAGE}).encode() + b"\n\n"
    assert rest.endswith(event) and rest.count(b"error") == 1
    assert fake_http.disconnected.wait(PROMPT_S)  # the upstream connection was closed
    assert_new_calls_work(own_front, own_stub)


@pytest.mark.parametrize("action", ["generate", "generate_stream"])
def test_abort_http_before_the_response_head(own_front, own_stub, fake_http, action):
    fake_http.stream_gap_s = 0.02
    body = {**GOOD_BODY, "text_input": "stall"}
    path = f"/v2/models/speculative/{action}"
    with futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(request, own_front.http_port, "POST", path, body)
        wait_for(lambda: fake_http.requests)  # upstream has it, and answers nothing
        started = time.monotonic()
        assert own_front.abort_inference(MESSAGE) == 1
        status, payload, _ = answer.result(timeout=PROMPT_S)
    assert time.monotonic() - started < PROMPT_S
    assert (status, payload) == (503, {"error": MESSAGE})
    assert fake_http.disconnected.wait(PROMPT_S)
    assert_new_calls_work(own_front, own_stub)


def test_abort_grpc_stream(own_front, own_stub, fake_grpc, fake_http):
    fake_http.stream_gap_s = 0.02
    responses = own_stub.ModelStreamInfer(
        iter([infer_request(request_id="endless")]), timeout=DEADLINE_S
    )
    assert next(responses).infer_response.id == "endless"
    started = time.monotonic()
    assert own_front.abort_inference(MESSAGE) == 1
    with pytest.raises(grpc.RpcError) as err:
        for _ in responses:
            pass
    assert time.monotonic() - started < PROMPT_S
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == MESSAGE
    assert fake_grpc.cancelled.wait(PROMPT_S)  # the upstream call was cancelled
    assert_new_calls_work(own_front, own_stub)


def test_abort_grpc_unary(own_front, own_stub, fake_grpc, fake_http):
    fake_http.stream_gap_s = 0.02
    answer = own_stub.ModelInfer.future(infer_request(request_id="stall"))
    wait_for(lambda: fake_grpc.calls)
    started = time.monotonic()
    assert own_front.abort_inference(MESSAGE) == 1
    with pytest.raises(grpc.RpcError) as err:
        answer.result(timeout=PROMPT_S)
    assert time.monotonic() - started < PROMPT_S
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == MESSAGE
    assert fake_grpc.cancelled.wait(PROMPT_S)
    assert own_stub.ModelInfer(infer_request(request_id="after")).id == "after"


def test_abort_counts_every_call_of_both_protocols(own_front, own_stub, fake_http, fake_grpc):
    fake_http.stream_gap_s = 0.02
    stalled = {**GOOD_BODY, "text_input": "stall"}
    path = "/v2/models/speculative/generate"
    with futures.ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(request, own_front.http_port, "POST", path, stalled) for _ in "ab"]
        stream = own_stub.ModelStreamInfer(
            iter([infer_request(request_id="endless")]), timeout=DEADLINE_S
        )
        assert next(stream).infer_response.id == "endless"
        wait_for(lambda: len(fake_http.requests) == 2)
        # From another thread than the test's, as the launcher's supervisor would call it.
        counted: list[int] = []
        caller = threading.Thread(target=lambda: counted.append(own_front.abort_inference("x")))
        caller.start()
        caller.join(PROMPT_S)
        assert counted == [3]
        assert [answer.result(timeout=PROMPT_S)[0] for answer in answers] == [503, 503]
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert own_front.abort_inference(MESSAGE) == 0
    assert own_stub.ServerLive(service_pb2.ServerLiveRequest()).live
