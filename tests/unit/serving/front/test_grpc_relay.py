"""front.grpc_relay against a fake Triton: routing, metadata, identity, streaming, unknown and
internal models, and idle streams ended.

Before (issue 20, finding 6): a typo in a model name was refused as "internal ... admin key";
now an unknown model is NOT_FOUND, an internal one PERMISSION_DENIED with no hint on opening it.
Before (issue 20, finding 4): a `ModelStreamInfer` call that never sent a message held its slot
for as long as its client liked; now a stream that sends nothing within
`stream_first_request_timeout_s` is ended, one that was used gets the longer
`stream_idle_timeout_s` after each answer, and one waiting on a generation is not idle (on the
`capped` front of conftest.py, whose short limits keep these tests fast).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers.front_fakes import (
    ADMIN_KEY,
    IDLE_S,
    MAX_BODY,
    SLOW_S,
    USED_IDLE_S,
    FakeTriton,
    front_config,
    infer_request,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc

from avspec.serving.front import Front

PREFIX = "triton-grpc-protocol-"


def test_grpc_infer_forwarded_with_identity(stub, fake_grpc):
    spoofs = (
        ("avspec-client", "1.2.3.4:1"),
        ("avspec-front-key", "guess"),
        ("triton-grpc-protocol-avspec-client", "1.2.3.4:2"),  # Triton's pattern would match it
        ("triton-grpc-protocol-avspec-front-key", "guess"),
        ("x-trace", "t"),
    )
    response = stub.ModelInfer(infer_request(), metadata=spoofs)
    echoed = {k: v.string_param for k, v in response.parameters.items()}
    assert echoed["avspec-client"].startswith("ipv4:127.0.0.1:")  # one channel = one client
    assert echoed["x-trace"] == "t"
    # Only the front reaches Triton: no key of any kind goes upstream, the identity alone.
    assert [key for key in echoed if "avspec" in key] == ["avspec-client"]
    assert stub.ServerLive(service_pb2.ServerLiveRequest()).live


def test_grpc_identity_is_stable_on_one_channel(stub, fake_grpc):
    first = stub.ModelInfer(infer_request(request_id="a")).parameters["avspec-client"]
    second = stub.ModelInfer(infer_request(request_id="b")).parameters["avspec-client"]
    assert first.string_param == second.string_param


def test_grpc_internal_model_denied(stub, fake_grpc):
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(infer_request("speculative_step"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "speculative_step" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="speculative_step"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not fake_grpc.calls


def test_grpc_reserved_parameter_refused(stub, fake_grpc):
    request_ = infer_request()
    request_.parameters["avspec-client"].string_param = "someone-else"
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not fake_grpc.calls


@pytest.mark.parametrize("name", ["avspec-admin-key", "triton-grpc-protocol-avspec-admin-key"])
@pytest.mark.parametrize(("key", "allowed"), [(None, False), ("wrong", False), (ADMIN_KEY, True)])
def test_grpc_admin_method_needs_the_admin_key(stub, fake_grpc, name, key, allowed):
    metadata = ((name, key),) if key else ()
    if allowed:
        stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), metadata=metadata)
        ((_, seen),) = fake_grpc.calls
        assert [key for key in seen if "avspec" in key] == ["avspec-client"]  # key checked here
    else:
        with pytest.raises(grpc.RpcError) as err:
            stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "avspec-admin-key" in err.value.details() and not fake_grpc.calls


def test_grpc_server_ready_follows_stages(stub, state):
    assert stub.ServerReady(service_pb2.ServerReadyRequest()).ready
    state["ready"] = False
    assert not stub.ServerReady(service_pb2.ServerReadyRequest()).ready


def test_grpc_inference_fails_fast_while_a_stage_restarts(stub, fake_grpc, state):
    state["ready"] = False
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(infer_request())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "restarting" in err.value.details()
    assert not fake_grpc.calls
    with pytest.raises(grpc.RpcError) as err:
        list(stub.ModelStreamInfer(iter([infer_request()])))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_restarted_upstream_is_reached_at_once_after_reconnect(fake_http, tmp_path):
    """A CI run (December 2026): after tritonserver was started again, calls through the front
    failed for seconds with the connect error ("No such file or directory") its channel kept
    from the restart, in gRPC's reconnect backoff. The launcher now renews the channel."""
    socket_path = tmp_path / "grpc"
    fake = FakeTriton()
    config = front_config(fake_http, fake, upstream_grpc=f"unix:{socket_path}")
    with Front(config) as front, grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as c:
        client = service_pb2_grpc.GRPCInferenceServiceStub(c)
        for _ in range(6):  # failures while Triton is down push the channel's backoff up
            with pytest.raises(grpc.RpcError) as err:
                client.ModelInfer(infer_request(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.25)
        upstream = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, upstream)
        upstream.add_insecure_port(f"unix:{socket_path}")
        upstream.start()
        try:
            front.reconnect_upstream()
            client.ModelInfer(infer_request(), timeout=5)  # at once: no error kept
            assert len(fake.calls) == 1
        finally:
            upstream.stop(grace=None)


def test_grpc_oversized_message_is_resource_exhausted(stub, fake_grpc):
    big = infer_request(raw_input_contents=[b"x" * (MAX_BODY + 1)])
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(big)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not fake_grpc.calls


def test_grpc_stream_refuses_an_internal_model_midway(stub, fake_grpc):
    def requests():
        yield infer_request(request_id="a")
        time.sleep(0.2)  # let the first answer come back before the refused one
        yield infer_request("speculative_step", request_id="b")

    responses = stub.ModelStreamInfer(requests())
    first = next(responses)
    assert first.infer_response.id == "a"
    with pytest.raises(grpc.RpcError) as err:
        list(responses)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "speculative_step" in err.value.details()


def test_grpc_client_cancel_cancels_upstream(stub, fake_grpc):
    fake_grpc.cancelled.clear()
    responses = stub.ModelStreamInfer(iter([infer_request(request_id="endless")]))
    assert next(responses).infer_response.id == "endless"
    responses.cancel()
    assert fake_grpc.cancelled.wait(10.0)


def test_tritonclient_grpc_stream_through_the_front(front, fake_grpc):
    results: list = []
    done = threading.Event()

    def callback(result, error):
        results.append(error or result)
        if len(results) == 2:
            done.set()

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{front.grpc_port}")
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=object))
    client.start_stream(callback, headers={"avspec-client": "spoof"})
    try:
        for request_id in ("r1", "r2"):
            client.async_stream_infer("speculative", [text], request_id=request_id)
        assert done.wait(5.0)
    finally:
        client.stop_stream()
        client.close()
    ids = sorted(r.get_response().id for r in results)
    assert ids == ["r1", "r2"]
    echoed = results[0].get_response().parameters
    assert echoed["avspec-client"].string_param.startswith("ipv4:127.0.0.1:")
    assert [key for key in echoed if "avspec" in key] == ["avspec-client"]


def test_grpc_admin_key_sent_under_both_names_counts_once(stub, fake_grpc):
    metadata = (("avspec-admin-key", ADMIN_KEY), (PREFIX + "avspec-admin-key", ADMIN_KEY))
    stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), metadata=metadata)
    ((_, seen),) = fake_grpc.calls  # authorised once, and neither name goes upstream
    assert [key for key in seen if "avspec" in key] == ["avspec-client"]


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


def test_a_stream_waiting_on_a_long_generation_is_not_idle(capped, fake_grpc):
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{capped.grpc_port}") as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
            started = time.monotonic()
            await call.write(infer_request(request_id="slow"))  # answered after SLOW_S
            response = await call.read()
            answered = time.monotonic() - started
            assert response.infer_response.id == "slow" and answered >= SLOW_S > 2 * IDLE_S
            code = await asyncio.wait_for(call.code(), 3 * USED_IDLE_S)  # idle, then ended
            assert code == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started >= answered + USED_IDLE_S

    asyncio.run(scenario())


def test_a_used_stream_may_rest_longer_than_a_fresh_one(capped, fake_grpc):
    """A client that keeps one stream between bursts is not cut off at the fresh-stream limit
    (the soak's loops alternate gRPC with HTTP requests and were, at 30 s for every stream)."""

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{capped.grpc_port}") as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
            await call.write(infer_request(request_id="first"))
            assert (await call.read()).infer_response.id == "first"
            await asyncio.sleep(1.3 * IDLE_S)  # past the fresh limit, within the used one
            await call.write(infer_request(request_id="second"))
            assert (await call.read()).infer_response.id == "second"
            call.cancel()

    asyncio.run(scenario())


def test_a_streaming_generation_is_not_idle(capped, fake_grpc):
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{capped.grpc_port}") as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
            await call.write(infer_request(request_id="endless"))  # never a final response
            deadline = time.monotonic() + 3 * IDLE_S
            while time.monotonic() < deadline:
                assert (await call.read()).infer_response.id == "endless"
            call.cancel()

    asyncio.run(scenario())
