"""The launcher's own calls to tritonserver's HTTP API, over its Unix socket.

Readiness polling and the supervisor's model reloads go to the socket directly, not through the
front: they are the server's business, and the front refuses model control without the
operator's key. Only the server's user (and root) can open the socket.
"""

from __future__ import annotations

import http.client
import json
import socket


class TritonAPIError(RuntimeError):
    """Triton answered a repository call with an error, or could not be reached."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (the host name only fills the Host header)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class TritonAPI:
    """tritonserver's HTTP API on the Unix socket `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def request(
        self, method: str, target: str, body: bytes | None = None, timeout: float = 2.0
    ) -> tuple[int, bytes]:
        """(status, body) of one request; OSError or http.client.HTTPException on failure."""
        connection = _UnixHTTPConnection(self.path, timeout)
        try:
            connection.request(method, target, body=body)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def ok(self, target: str) -> bool:
        """Whether GET `target` answers 200 (False when the server cannot be reached)."""
        try:
            return self.request("GET", target)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def repository_action(self, model: str, action: str, timeout: float) -> None:
        """POST `load` or `unload` for `model`; TritonAPIError naming Triton's answer."""
        target = f"/v2/repository/models/{model}/{action}"
        try:
            status, body = self.request("POST", target, json.dumps({}).encode(), timeout)
        except (OSError, http.client.HTTPException) as err:
            raise TritonAPIError(f"{action} {model}: {err!r}") from None
        if status != 200:
            raise TritonAPIError(f"{action} {model}: {status} {body.decode(errors='replace')}")
