"""A canned HTTP server for the soak tests: each path answers a fixed status and body."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class Canned:
    """Routes of the canned server: path -> (status, body); `hits` counts the requests."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, bytes]] = {}
        self.hits: dict[str, int] = {}
        self.url = ""


def _handler(canned: Canned) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            canned.hits[self.path] = canned.hits.get(self.path, 0) + 1
            status, body = canned.routes.get(self.path, (404, b"no such path"))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def canned() -> Iterator[Canned]:
    result = Canned()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(result))
    result.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield result
    server.shutdown()
    server.server_close()
