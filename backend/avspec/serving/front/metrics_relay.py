"""The metrics relay: the front's public metrics port, serving Triton's `/metrics` and nothing else.

Triton's own metrics server answers 200 with an empty body on any GET path (`/v2/health/ready`
included, which misleads a probe pointed at the wrong port) and takes none of the front's caps.
So tritonserver binds its metrics on loopback, and the public port is this small aiohttp server:
`GET /metrics` is fetched from Triton and relayed (Prometheus text, as Triton sends it); any other
path is 404, any other method 405 (aiohttp parses the HTTP; the project keeps only the route).
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from avspec.serving.front.config import FrontConfig

_UPSTREAM_TIMEOUT_S = 10.0


class MetricsRelay:
    """`GET /metrics` on the public metrics port, from Triton's loopback metrics."""

    def __init__(self, config: FrontConfig) -> None:
        if config.upstream_metrics is None:
            raise ValueError("MetricsRelay needs config.upstream_metrics")
        self.config = config
        self.port = 0
        self._url = f"http://{config.upstream_metrics}/metrics"
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        app = web.Application(client_max_size=1024)  # a GET has no business sending a body
        app.router.add_get("/metrics", self._metrics, allow_head=True)
        app.on_response_prepare.append(_nosniff)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=_UPSTREAM_TIMEOUT_S)
        )
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.host, self.config.metrics_port, reuse_address=False
        )
        await site.start()
        server = site._server  # aiohttp keeps the asyncio server; its socket has the port
        self.port = server.sockets[0].getsockname()[1] if isinstance(server, asyncio.Server) else 0

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self._session is not None
        try:
            async with self._session.get(self._url) as upstream:
                body = await upstream.read()
                if upstream.status != 200:
                    return _unavailable(f"Triton's metrics answered {upstream.status}")
                content_type = upstream.headers.get("Content-Type", "text/plain; version=0.0.4")
        except (aiohttp.ClientError, TimeoutError) as err:
            return _unavailable(f"Triton's metrics are unreachable ({err!r})")
        return web.Response(body=body, headers={"Content-Type": content_type})


def _unavailable(message: str) -> web.Response:
    return web.json_response({"error": message}, status=503, headers={"Retry-After": "5"})


async def _nosniff(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer of the port, its 404s included, is read as the type it says."""
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
