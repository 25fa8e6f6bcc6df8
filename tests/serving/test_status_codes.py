"""Status codes through the real server (issue 20, finding 6).

Before: a request refused because its client's queue was full came back 400 (Triton 2.51
answers 400 to every error a decoupled model sends over /generate, whatever its code: measured
for the entry's UNAVAILABLE "overloaded" and INTERNAL "generation failed"), so clients took it
for their own mistake; a lone surrogate escape got 500 from Triton's JSON parser; a typo in a
model name got 403 "internal ... admin key". The front's own mapping, one case at a time against
a fake upstream: tests/unit/serving/front/test_http_status.py, test_http_routes.py and
test_schema.py.
"""

from __future__ import annotations

import json
import select
import socket
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from helpers.clients import post_json
from helpers.server import all_freed, wait_for

from avspec.serving.host.server_process import ServerProcess
from avspec.serving.repository import EntryParams

BATCH = 32  # the session server's speculative max_batch_size (conftest.py)


def send_generate(server: ServerProcess, text: str) -> socket.socket:
    """A long /generate request on a connection of its own; its answer is left unread."""
    body = json.dumps({"text_input": text, "max_tokens": 200, "temperature": 0.0}).encode()
    head = (
        "POST /v2/models/speculative/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    sock.sendall(head.encode() + body)
    return sock


def answers_within(sockets: list[socket.socket], seconds: float) -> list[bytes]:
    """The replies that arrived within `seconds` (the rest are running or queued)."""
    replies: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([s for s in sockets if s not in replies], [], [], left)
        for sock in readable:
            replies[sock] = sock.recv(65536)
    return list(replies.values())


def test_a_full_queue_is_503_with_retry_after(server: ServerProcess) -> None:
    """One HTTP client (one IP) asks for more than the batch and its queue hold."""
    extra = 12
    count = BATCH + EntryParams().max_queued_per_client + extra
    sockets = [send_generate(server, f"q{i} ") for i in range(count)]
    try:
        replies = answers_within(sockets, 3.0)  # refusals come at once; 200 tokens take longer
    finally:
        for sock in sockets:
            sock.close()  # cancels every running and queued request
    refused = [reply for reply in replies if not reply.startswith(b"HTTP/1.1 200 ")]
    assert refused, "no request was refused"  # (a 200: a request that met EOS early)
    heads = [reply.partition(b"\r\n\r\n")[0] for reply in refused]
    assert all(head.startswith(b"HTTP/1.1 503 ") for head in heads), heads
    assert all(b"\r\nRetry-After: 1\r\n" in head for head in heads)
    assert all(b"overloaded" in reply for reply in refused)
    assert len(refused) <= extra + 4  # only what neither the batch nor the queue could hold
    assert wait_for(lambda: all_freed(server), timeout_s=60)


def test_a_lone_surrogate_is_400_naming_the_field(server: ServerProcess) -> None:
    body = b'{"text_input": "\\ud800", "max_tokens": 4}'
    request = urllib.request.Request(f"{server.http_url}/v2/models/speculative/generate", body)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400
    assert "'text_input'" in json.loads(err.value.read())["error"]


@pytest.mark.parametrize(
    ("model", "status", "grpc_status", "text"),
    [
        ("specultive", 404, "StatusCode.NOT_FOUND", "unknown model 'specultive'"),
        ("draft", 403, "StatusCode.PERMISSION_DENIED", "model 'draft' is internal"),
    ],
)
def test_unknown_model_is_404_and_internal_403_without_a_hint(
    server: ServerProcess, model: str, status: int, grpc_status: str, text: str
) -> None:
    code, body = post_json(f"{server.http_url}/v2/models/{model}/generate", {"text_input": "a"})
    assert code == status and json.loads(body)["error"].startswith(text)
    assert "admin" not in body
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(grpcclient.InferenceServerException) as err:
        client.get_model_metadata(model)
    assert err.value.status() == grpc_status and text in err.value.message()
    assert "admin" not in err.value.message()
