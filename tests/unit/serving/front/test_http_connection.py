"""front.http_connection: HTTP/1.1 as the front speaks it (aiohttp parses it): keep-alive on both
sides, pipelining, chunked request bodies, HTTP/1.0 clients, request smuggling refused, malformed
or oversized heads answered as JSON errors, a head not sent in time 408, and a connection past
the total cap refused at once.

Before (issue 22): the hand-written proxy closed the connection after every response, refused
chunked bodies with 411, dropped pipelined requests, answered an HTTP/1.0 client with chunked
encoding, and dropped the connection with a traceback on `Content-Length: ²`.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from helpers.front_fakes import GOOD_BODY, front_config, raw_exchange, read_reply

from avspec.serving.front import Front

GENERATE = "/v2/models/speculative/generate"
STREAM = "/v2/models/speculative/generate_stream"


def test_keep_alive_serves_many_requests_on_one_connection_each_side(front, fake_http):
    connection = http.client.HTTPConnection("127.0.0.1", front.http_port, timeout=10)
    ports = set()
    for path, body in [("/v2", None), (GENERATE, GOOD_BODY), ("/v2/health/live", None)] * 3:
        data = json.dumps(body).encode() if body is not None else None
        connection.request("POST" if body else "GET", path, body=data)
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Connection") is None
        response.read()
        ports.add(connection.sock.getsockname()[1])
    connection.close()
    assert len(ports) == 1  # one client connection for all nine
    assert len(fake_http.requests) == 9
    assert len({seen.peer_port for seen in fake_http.requests}) == 1  # and one upstream


def test_pipelined_requests_are_answered_in_order(front, fake_http):
    body = json.dumps(GOOD_BODY).encode()
    heads = [
        "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n",
        f"POST {GENERATE} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n",
        "GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    with socket.create_connection(("127.0.0.1", front.http_port), timeout=10) as sock:
        sock.sendall(heads[0].encode() + heads[1].encode() + body + heads[2].encode())
        replies = [read_reply(sock) for _ in heads]
    assert all(reply.startswith(b"HTTP/1.1 200 ") for reply in replies), replies
    assert b'"path": "/v2/health/live"' in replies[0]
    assert b'"echo"' in replies[1] and b'"path": "/v2"}' in replies[2]
    assert [seen.path for seen in fake_http.requests] == ["/v2/health/live", GENERATE, "/v2"]


def test_chunked_request_body_is_forwarded_with_the_identity(front, fake_http):
    body = json.dumps(GOOD_BODY).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:5], body[5:]))
    head = f"POST {GENERATE} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    reply = raw_exchange(front.http_port, head, chunks + b"0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    (seen,) = fake_http.requests
    assert json.loads(seen.body) == {**GOOD_BODY, "avspec-client": "127.0.0.1"}
    assert seen.header("transfer-encoding") == []  # sent on with a Content-Length


@pytest.mark.parametrize(
    "framing",
    [
        "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",  # CL.TE / TE.CL smuggling
        "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
        "Content-Length: 4\r\nContent-Length: 40\r\n",  # two different lengths
        "Content-Length: 4, 40\r\n",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
        "Transfer-Encoding: identity\r\n",
        "Transfer-Encoding : chunked\r\n",  # whitespace before the colon
    ],
)
def test_smuggling_attempts_are_refused(front, fake_http, framing):
    smuggled = "GET /v2/repository/index HTTP/1.1\r\nHost: x\r\n\r\n"
    head = f"POST {GENERATE} HTTP/1.1\r\nHost: x\r\n{framing}\r\n"
    with socket.create_connection(("127.0.0.1", front.http_port), timeout=10) as sock:
        sock.sendall(head.encode() + b"0\r\n\r\n" + smuggled.encode())
        reply = read_reply(sock)
        rest = sock.recv(65536)  # the connection is closed: nothing else is answered
    assert reply.startswith(b"HTTP/1.1 400 ") and b"\r\nConnection: close\r\n" in reply, reply
    assert rest == b""
    assert not fake_http.requests


def test_http10_client_gets_a_stream_without_chunked_encoding(front, fake_http):
    fake_http.stream_gap_s = 0.01
    body = json.dumps(GOOD_BODY).encode()
    head = f"POST {STREAM} HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", front.http_port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        reply = b""
        while data := sock.recv(65536):  # HTTP/1.0 without a length: the close ends the body
            reply += data
    answer_head, _, answer = reply.partition(b"\r\n\r\n")
    assert answer_head.startswith(b"HTTP/1.0 200 ")
    assert b"chunked" not in answer_head.lower()
    assert answer == b"".join(b'data: {"text_output": "t%d"}\n\n' % i for i in range(3))


def test_head_at_the_cap_passes_one_byte_more_is_431(front, fake_http):
    cap = front.config.max_header_bytes
    start = "GET /v2 HTTP/1.1\r\nHost: x\r\nX-Pad: "
    pad = cap - len(start) - len("\r\n\r\n")
    at_cap = start + "a" * pad + "\r\n\r\n"
    assert len(at_cap) == cap
    assert raw_exchange(front.http_port, at_cap).startswith(b"HTTP/1.1 200 ")
    over = start + "a" * (pad + 1) + "\r\n\r\n"
    assert raw_exchange(front.http_port, over).startswith(b"HTTP/1.1 431 ")
    assert len(fake_http.requests) == 1


@pytest.mark.parametrize(
    ("head", "status"),
    [
        ("GARBAGE\r\n\r\n", 400),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n", 400),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nX: a\nAvspec-Client: spoof\r\n\r\n", 400),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", 400),  # obsolete line fold
        ("POST /v2/models/speculative/generate HTTP/1.1\r\nHost: x\r\n\r\n", 411),
        (
            "POST /v2/models/speculative/generate HTTP/1.1\r\nHost: x\r\n"
            "Content-Length: \u00b2\r\n\r\n",
            400,
        ),
        ("DELETE /v2/models/speculative HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\nX: " + "a" * (20 << 10) + "\r\n\r\n", 431),
        ("GET /v2 HTTP/1.1\r\nHost: x\r\n" + "X: y\r\n" * 100 + "\r\n", 431),
        # each line within the limit, the head past it: Triton breaks on heads past ~8.1 KB
        (
            "GET /v2 HTTP/1.1\r\nHost: x\r\nX: " + "a" * 5000 + "\r\nY: " + "a" * 5000 + "\r\n\r\n",
            431,
        ),
        ("GET /v2 HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host (RFC 9112 section 3.2)
    ],
)
def test_malformed_requests(front, fake_http, head, status):
    reply = raw_exchange(front.http_port, head)
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply[:200]
    assert b"\r\nContent-Type: application/json" in reply and b'{"error": ' in reply
    assert not fake_http.requests


def test_slow_client_times_out(fake_http, fake_grpc):
    with Front(front_config(fake_http, fake_grpc, header_timeout_s=0.3)) as quick:
        started = time.monotonic()
        reply = raw_exchange(quick.http_port, "GET /v2 HTTP/1.1\r\n")
    assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 2


def test_connection_limit(fake_http, fake_grpc):
    with (
        Front(front_config(fake_http, fake_grpc, max_connections=1)) as small,
        socket.create_connection(("127.0.0.1", small.http_port), timeout=10) as idle,
    ):
        idle.sendall(b"GET /v2 HTTP/1.1\r\n")  # holds the only slot, head unfinished
        time.sleep(0.1)
        reply = raw_exchange(small.http_port, "GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in reply
