"""The playground page (`/`) in headless Chromium against the real server.

Chromium loads `/?prompt=...` (the page fills the box, never sends by itself), the test presses
send, the page streams the answer from /v1/chat/completions and marks
each token as an accepted draft or the target's; the DOM it dumps is compared with the same
request through the official client. The page sets data-state="done" only after `data: [DONE]`,
so a stream that breaks fails the test. Needs Debian's `chromium` (.ci/run installs it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import threading
import time
import urllib.parse
from html.parser import HTMLParser

import aiohttp
import openai
from aiohttp import web
from helpers.ci import missing_tool

from avspec.serving.front.playground import PAGE
from avspec.serving.host.server_process import ServerProcess

PROMPT = "Write a loop."
DEADLINE_S = 60.0


class _Page(HTMLParser):
    """The body's data-state, the last assistant turn's token spans, and the error box."""

    def __init__(self) -> None:
        super().__init__()
        self.state, self.tokens, self.error = "", [], ""
        self._in: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "body":
            self.state = attributes.get("data-state", "")
        classes = (attributes.get("class") or "").split()
        if "assistant" in classes:
            self.tokens = []
        self._in.append(
            "token"
            if tag == "span" and classes[:1] in (["draft"], ["target"])
            else "error"
            if attributes.get("id") == "error"
            else tag
        )
        if self._in[-1] == "token":
            self.tokens.append([classes[0], ""])

    def handle_endtag(self, tag):
        if self._in:
            self._in.pop()

    def handle_data(self, data):
        if self._in and self._in[-1] == "token":
            self.tokens[-1][1] += data
        elif self._in and self._in[-1] == "error":
            self.error += data


def render(url: str, tmp_path, screenshot=None) -> str:
    """The page's DOM once it is done streaming (or failed), through Chromium's DevTools
    protocol; a PNG of it to `screenshot` when given."""
    browser = shutil.which("chromium")
    if browser is None:
        missing_tool("chromium not found", "apt-get install chromium")
    command = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
        f"--user-data-dir={tmp_path}", "--window-size=1000,640", "about:blank",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if line.startswith("DevTools listening on "):
                endpoint = line.split()[-1]
                break
        else:
            raise AssertionError("chromium did not start its DevTools endpoint")
        return asyncio.run(_drive(endpoint, url, screenshot))
    finally:
        process.kill()
        process.wait()


async def _drive(endpoint: str, url: str, screenshot) -> str:
    port = urllib.parse.urlsplit(endpoint).port
    async with aiohttp.ClientSession() as session:
        new = f"http://127.0.0.1:{port}/json/new?{urllib.parse.quote(url, safe='')}"
        async with session.put(new) as response:
            target = await response.json()
        async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1 << 30))

            async def call(method: str, **params) -> dict:
                message_id = next(ids)
                await ws.send_json({"id": message_id, "method": method, "params": params})
                while (message := await ws.receive_json()).get("id") != message_id:
                    pass
                return message["result"]

            async def evaluate(expression: str) -> str:
                result = await call("Runtime.evaluate", expression=expression)
                return result["result"].get("value", "")

            deadline = time.monotonic() + DEADLINE_S
            loaded = "document.readyState === 'complete' && !!document.getElementById('ask')"
            while await evaluate(loaded) is not True:  # about:blank is complete at first
                assert time.monotonic() < deadline, "the page did not load"
                await asyncio.sleep(0.1)
            # the page never sends on its own (a link must not spend compute): press send
            await evaluate("document.getElementById('ask').requestSubmit()")
            while await evaluate("document.body && document.body.dataset.state") not in (
                "done",
                "error",
            ):
                assert time.monotonic() < deadline, "the page did not finish"
                await asyncio.sleep(0.2)
            if screenshot is not None:
                shot = await call("Page.captureScreenshot", format="png")
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            return await evaluate("document.documentElement.outerHTML")


def test_the_page_streams_an_answer_marked_by_origin(server: ServerProcess, tmp_path) -> None:
    query = urllib.parse.urlencode({"prompt": PROMPT, "temperature": 0, "max-tokens": 24})
    page = _Page()
    page.feed(render(f"{server.http_url}/?{query}", tmp_path, tmp_path / "playground.png"))
    assert page.state == "done", page.error
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0) as client:
        reference = client.chat.completions.create(
            model="speculative",
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0,
            max_tokens=24,
        )
    assert "".join(text for _, text in page.tokens) == reference.choices[0].message.content
    assert {origin for origin, _ in page.tokens} <= {"draft", "target"}
    assert "target" in {origin for origin, _ in page.tokens}  # every step ends with one


def _broken_stream_server(port_holder: list[int], ready, stop) -> None:
    """The playground page and a /v1/chat/completions that sends its role and one token, then
    closes the connection without `data: [DONE]` (a server that died mid-answer)."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE.read_text(), content_type="text/html")

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        token = {
            "choices": [{"index": 0, "delta": {"content": "Hi"}}],
            "speculative": {"tokens": [{"text": "Hi", "draft": False}], "accepted_tokens": 0,
                            "verified_tokens": 0, "steps": 1},
        }  # fmt: skip
        for chunk in (role, token):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        request.transport.close()  # gone: no [DONE], no end of the chunked body
        return response

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/", page)
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_holder.append(site._server.sockets[0].getsockname()[1])
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    asyncio.run(serve())


def test_the_page_reports_a_stream_that_breaks(tmp_path) -> None:
    """The broken variant of the test above: the same page against a server that drops the
    stream mid-answer ends in data-state="error" with the reason, never "done"."""
    port, ready, stop = [], threading.Event(), threading.Event()
    thread = threading.Thread(target=_broken_stream_server, args=(port, ready, stop), daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        page = _Page()
        page.feed(render(f"http://127.0.0.1:{port[0]}/?prompt=hello", tmp_path))
        assert page.state == "error" and page.error.startswith("error:"), (page.state, page.error)
    finally:
        stop.set()
        thread.join(10)
