"""Fixtures of the front's tests: fake upstreams, and fronts in front of them (the shared one per
module; one with the pair's tokenizer, for the OpenAI routes and the playground; one with small
caps, for the limit tests)."""

from __future__ import annotations

import json
import threading
from concurrent import futures
from http.server import ThreadingHTTPServer

import grpc
import pytest
from helpers.front_fakes import (
    ADMIN_KEY,
    CAP,
    IDLE_S,
    INTERNAL_MODELS,
    USED_IDLE_S,
    FakeHttp,
    FakeTriton,
    front_config,
    make_handler,
)
from helpers.hf_dirs import EOS, byte_tokenizer
from tritonclient.grpc import service_pb2_grpc

from avspec.serving.front import Front

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def fake_http():
    fake = FakeHttp()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))
    server.daemon_threads = True
    fake.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def fake_grpc():
    fake = FakeTriton()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))  # streams hold a worker
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    fake.port = port
    yield fake
    server.stop(grace=None)


@pytest.fixture(scope="module")
def state():
    return {"ready": True}


@pytest.fixture(scope="module")
def front(fake_http, fake_grpc, state):
    config = front_config(
        fake_http,
        fake_grpc,
        admin_key=ADMIN_KEY,
        ready=lambda: state["ready"],
        internal_models=INTERNAL_MODELS,
    )
    with Front(config) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pair")
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"eos_token": EOS, "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def openai_front(fake_http, fake_grpc, tokenizer_dir, state):
    config = front_config(
        fake_http,
        fake_grpc,
        tokenizer_dir=tokenizer_dir,
        internal_models=("draft",),
        ready=lambda: state["ready"],
    )
    with Front(config) as running:
        yield running


@pytest.fixture
def capped(fake_http, fake_grpc):
    config = front_config(
        fake_http,
        fake_grpc,
        max_per_address=CAP,
        max_connections=3 * CAP,
        stream_first_request_timeout_s=IDLE_S,
        stream_idle_timeout_s=USED_IDLE_S,
    )
    with Front(config) as running:
        yield running


@pytest.fixture
def stub(front):
    with grpc.insecure_channel(f"127.0.0.1:{front.grpc_port}") as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(autouse=True)
def clean(request, state):
    """Each test starts with ready stages and fakes that have seen nothing."""
    state["ready"] = True
    if "fake_http" in request.fixturenames:
        request.getfixturevalue("fake_http").clear()
    if "fake_grpc" in request.fixturenames:
        fake = request.getfixturevalue("fake_grpc")
        fake.calls.clear()
        fake.cancelled.clear()
