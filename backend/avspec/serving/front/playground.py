"""The playground page at `/`: one static HTML file (playground.html, no build step).

It talks only to the same front (/v1/chat/completions, or /v1/completions for a pair without a
chat template); the Content-Security-Policy says so, so the page loads nothing from elsewhere,
and no other site may frame it (`frame-ancestors 'none'`, with `X-Frame-Options: DENY` for
older browsers).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from avspec.serving.front.http_relay import HttpRelay

PAGE = Path(__file__).with_name("playground.html")
_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def install(relay: HttpRelay) -> None:
    """Serve the page on `relay` (route kind "page")."""
    body = PAGE.read_bytes()

    async def page(*_: object) -> web.StreamResponse:
        return web.Response(
            body=body,
            content_type="text/html",
            charset="utf-8",
            headers={
                "Content-Security-Policy": _POLICY,
                "X-Frame-Options": "DENY",
                "Cache-Control": "no-cache",
            },
        )

    relay.serve("page", page)
