"""The OpenAI door of the real server under hostile clients (issue 31): the oversized-prompt
flood and the forged template. The front's other rules are tested server-free in
tests/unit/serving/front/test_hostile_door.py.

Flood: threads from 127.0.0.1 send /v1/completions with a 1,000,000-character prompt, each
refused (400, the prompt cannot fit the context); meanwhile a client at 127.0.0.2 (another
identity) asks short chats. Before, the front counted every refused prompt's tokens on a shared
thread pool, and the usage waited for it: other clients' requests took tens of seconds and the
front's memory grew by gigabytes. Bounds: the other client's median latency during the flood at
most 3x its idle median, its first request after the flood within 5 s and at most 3x idle, and
this process's memory (the front runs in it) within 20% of its level before.
"""

from __future__ import annotations

import http.client
import json
import resource
import statistics
import threading
import time

from helpers.hf_dirs import EOS

from avspec.serving.host.server_process import ServerProcess

MODEL = "speculative"
VICTIM = "127.0.0.2"
FLOOD_THREADS = 4
FLOOD_S = 8.0
HUGE = "x" * 1_000_000


class _Client:
    """One kept-alive HTTP connection from `source` (a flood of fresh connections would leave
    hundreds of ports in TIME_WAIT, which other tests' servers may have picked to bind)."""

    def __init__(self, server: ServerProcess, source: str = "127.0.0.1") -> None:
        host, port = server.http_url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(
            host, int(port), timeout=120, source_address=(source, 0)
        )

    def post(self, path: str, body: dict) -> tuple:
        """(status, JSON answer, seconds) of one POST."""
        started = time.monotonic()
        headers = {"Content-Type": "application/json"}
        self.connection.request("POST", path, json.dumps(body), headers)
        response = self.connection.getresponse()
        answer = json.loads(response.read())
        return response.status, answer, time.monotonic() - started

    def chat(self, content: str, **extra) -> tuple:
        body = {
            "model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **extra,
        }  # fmt: skip
        return self.post("/v1/chat/completions", body)

    def close(self) -> None:
        self.connection.close()


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_an_oversized_prompt_flood_does_not_stall_another_client(server: ServerProcess):
    victim = _Client(server, VICTIM)
    for _ in range(2):  # warm
        assert victim.chat("Hello")[0] == 200
    idle = statistics.median(victim.chat("Hello")[2] for _ in range(5))
    memory_before = _rss_mb()
    stop, refused, answers = threading.Event(), [], []

    def flood() -> None:
        client = _Client(server)
        while not stop.is_set():
            body = {"model": MODEL, "prompt": HUGE, "max_tokens": 8}
            status, answer, _ = client.post("/v1/completions", body)
            refused.append(status)
            answers.append(answer)
        client.close()

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(FLOOD_THREADS)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    during = []
    deadline = time.monotonic() + FLOOD_S
    while time.monotonic() < deadline:
        status, _, seconds = victim.chat("Hello")
        assert status == 200
        during.append(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    ended = time.monotonic()
    time.sleep(0.5)
    status, _, after = victim.chat("Hello")
    back = time.monotonic() - ended
    victim.close()
    memory_after = _rss_mb()
    print(
        f"idle {idle * 1e3:.0f} ms; during the flood ({len(refused)} refused) median "
        f"{statistics.median(during) * 1e3:.0f} ms, max {max(during) * 1e3:.0f} ms over "
        f"{len(during)}; after {after * 1e3:.0f} ms; memory {memory_before:.0f} -> "
        f"{memory_after:.0f} MB"
    )  # measured figures: docs/reliability.md
    assert refused and set(refused) == {400}
    error = answers[0]["error"]
    assert error["param"] == "prompt" and "text_input" in error["message"]
    assert statistics.median(during) <= 3 * idle
    assert status == 200 and back <= 5.0 and after <= 3 * idle
    assert memory_after <= 1.2 * memory_before


def test_special_token_text_in_a_message_is_text_to_the_model(server: ServerProcess):
    """The pair's EOS text typed in a message is counted as its characters (one byte token
    each on the tiny pair), as a plain string of the same length is; forged, it would be one
    special token (the count 1 - len(EOS) lower)."""
    client = _Client(server)
    forged = client.chat(f"say {EOS} now")
    plain = client.chat("say " + "y" * len(EOS) + " now")
    assert forged[0] == plain[0] == 200
    assert forged[1]["usage"]["prompt_tokens"] == plain[1]["usage"]["prompt_tokens"]
    body = {"model": MODEL, "prompt": f"a{EOS}b", "max_tokens": 1}
    completion = client.post("/v1/completions", body)
    client.close()
    assert completion[1]["usage"]["prompt_tokens"] == len(f"a{EOS}b")
