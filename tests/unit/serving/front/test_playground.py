"""front.playground: the page at `/`, served with a Content-Security-Policy that lets it talk only
to this front."""

from __future__ import annotations

import http.client


def test_the_playground_page_is_served_at_the_root(openai_front):
    connection = http.client.HTTPConnection("127.0.0.1", openai_front.http_port, timeout=10)
    connection.request("GET", "/")
    response = connection.getresponse()
    page = response.read()
    connection.close()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/html")
    assert "connect-src 'self'" in response.getheader("Content-Security-Policy")
    assert b"/v1/chat/completions" in page
