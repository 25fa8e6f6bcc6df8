"""The launcher's calls to Triton over its Unix socket (avspec.serving.host.triton_api)."""

from __future__ import annotations

import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from avspec.serving.host.triton_api import TritonAPI, TritonAPIError


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
        self._answer(200 if self.path == "/v2/health/ready" else 400, b"{}")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        ok = self.path == "/v2/repository/models/good/load"
        self._answer(200 if ok else 400, b"{}" if ok else b'{"error": "no such model"}')


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture
def api(tmp_path: Path):
    path = tmp_path / "http.sock"
    server = _Server(str(path), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield TritonAPI(str(path))
    server.shutdown()
    server.server_close()


def test_readiness_over_the_socket(api: TritonAPI, tmp_path: Path) -> None:
    assert api.ok("/v2/health/ready")
    assert not api.ok("/v2/models/x/ready")
    assert not TritonAPI(str(tmp_path / "absent.sock")).ok("/v2/health/ready")  # no server


def test_repository_actions_name_triton_s_answer(api: TritonAPI, tmp_path: Path) -> None:
    api.repository_action("good", "load", timeout=5)
    with pytest.raises(TritonAPIError, match="load bad: 400 .*no such model"):
        api.repository_action("bad", "load", timeout=5)
    with pytest.raises(TritonAPIError, match="unload good"):
        TritonAPI(str(tmp_path / "absent.sock")).repository_action("good", "unload", timeout=5)
