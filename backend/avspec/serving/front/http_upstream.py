"""The front's HTTP client to Triton: one aiohttp session over a pool of kept-alive connections.

tritonserver's HTTP is a Unix socket in production ("unix:/path") and a TCP port in the tests'
fakes ("host:port"). A call whose client goes away (or that Front.abort_inference ends) is
cancelled here, and aiohttp closes a connection whose answer was not read to its end, so
Triton sees the close and cancels the request; a finished answer gives its connection back to
the pool. Bodies pass through as bytes (no decompression); headers are those of the client
minus the hop-by-hop ones and anything naming `avspec` (the admin key among them), plus the
caller's identity.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from avspec.serving.exposure import CLIENT_HEADER
from avspec.serving.front.config import FrontConfig, upstream_address
from avspec.serving.front.http_status import HttpError
from avspec.serving.front.policy import RESERVED_MARK

# Hop-by-hop headers belong to one connection, never forwarded (RFC 9110 section 7.6.1); the
# framing and Host are aiohttp's to set on each side.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "host",
        "content-length",
    }
)
_BASE = "http://localhost"


def forwarded_headers(
    headers: Iterable[tuple[str, str]], connection_tokens: Iterable[str] = ()
) -> list[tuple[str, str]]:
    """`headers` without hop-by-hop ones, those the Connection header names, and `avspec` ones."""
    named = {token.strip().lower() for token in connection_tokens}
    dropped = HOP_BY_HOP | named if named else HOP_BY_HOP
    return [
        (name, value)
        for name, value in headers
        if name.lower() not in dropped and RESERVED_MARK not in name.lower()
    ]


class Upstream:
    """Requests to Triton's HTTP over one session; `open` and `close` on the front's loop."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self._address = upstream_address(config.upstream_http)
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        limit = self.config.max_connections
        if isinstance(self._address, str):
            connector: aiohttp.BaseConnector = aiohttp.UnixConnector(self._address, limit=limit)
        else:
            connector = aiohttp.TCPConnector(limit=limit)
        self._base = _BASE if isinstance(self._address, str) else self._tcp_base()
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=self.config.connect_timeout_s,
                sock_connect=self.config.connect_timeout_s,
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # one session serves every client: keep none
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        )

    def _tcp_base(self) -> str:
        address = self._address
        assert not isinstance(address, str)  # a Unix socket has no TCP base
        host, port = address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        identity: str,
        body: bytes | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a request for `target` (path and query, as the client wrote it) with the
        caller's identity; the response once its head arrived. 503 when Triton cannot be
        reached (down or restarting: a retry soon may succeed), 502 when it closed the
        connection without an answer."""
        assert self._session is not None, "Upstream.open() first"
        outgoing = CIMultiDict(headers)
        outgoing[CLIENT_HEADER] = identity
        try:
            return await self._session.request(
                method,
                URL(self._base + target, encoded=True),
                headers=outgoing,
                data=body,
                allow_redirects=False,
            )
        except (aiohttp.ClientConnectorError, TimeoutError) as err:
            address = self.config.upstream_http
            raise HttpError(503, f"Triton at {address} is unreachable: {err}") from None
        except aiohttp.ClientError as err:
            message = f"Triton closed the connection without an answer ({err!r})"
            raise HttpError(502, message) from None
