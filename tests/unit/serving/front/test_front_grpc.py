"""The front's gRPC relay against a fake Triton: routing, metadata, identity, streaming."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from helpers.front_fakes import ADMIN_KEY, MAX_BODY, infer_request
from tritonclient.grpc import service_pb2

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
