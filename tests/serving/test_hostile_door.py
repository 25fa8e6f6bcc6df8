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

from avspec.serving.server_process import ServerProcess

MODEL = "speculative"
VICTIM = "127.0.0.2"
FLOOD_THREADS = 4
FLOOD_S = 8.0
HUGE = "x" * 1_000_000


def _post(server: ServerProcess, path: str, body: dict, source: str = "127.0.0.1") -> tuple:
    """(status, JSON answer, seconds) of one POST from `source`."""
    host, port = server.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(
        host, int(port), timeout=120, source_address=(source, 0)
    )
    started = time.monotonic()
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
        return response.status, answer, time.monotonic() - started
    finally:
        connection.close()


def _chat(server: ServerProcess, content: str, source: str = VICTIM, **extra) -> tuple:
    body = {
        "model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": content}], **extra,
    }  # fmt: skip
    return _post(server, "/v1/chat/completions", body, source)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_an_oversized_prompt_flood_does_not_stall_another_client(server: ServerProcess):
    for _ in range(2):  # warm
        assert _chat(server, "Hello")[0] == 200
    idle = statistics.median(_chat(server, "Hello")[2] for _ in range(5))
    memory_before = _rss_mb()
    stop, refused, answers = threading.Event(), [], []

    def flood() -> None:
        while not stop.is_set():
            body = {"model": MODEL, "prompt": HUGE, "max_tokens": 8}
            status, answer, _ = _post(server, "/v1/completions", body)
            refused.append(status)
            answers.append(answer)

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(FLOOD_THREADS)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    during = []
    deadline = time.monotonic() + FLOOD_S
    while time.monotonic() < deadline:
        status, _, seconds = _chat(server, "Hello")
        assert status == 200
        during.append(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    ended = time.monotonic()
    time.sleep(0.5)
    status, _, after = _chat(server, "Hello")
    back = time.monotonic() - ended
    memory_after = _rss_mb()
    print(
        f"idle {idle * 1e3:.0f} ms; during the flood ({len(refused)} refused) median "
        f"{statistics.median(during) * 1e3:.0f} ms, max {max(during) * 1e3:.0f} ms over "
        f"{len(during)}; after {after * 1e3:.0f} ms; memory {memory_before:.0f} -> "
        f"{memory_after:.0f} MB"
    )  # measured figures: docs/reliability.md
    assert refused and set(refused) == {400}
    assert (
        answers[0]["error"]["param"] == "prompt" and "text_input" in answers[0]["error"]["message"]
    )
    assert statistics.median(during) <= 3 * idle
    assert status == 200 and back <= 5.0 and after <= 3 * idle
    assert memory_after <= 1.2 * memory_before


def test_special_token_text_in_a_message_is_text_to_the_model(server: ServerProcess):
    """The pair's EOS text typed in a message is counted as its characters (one byte token
    each on the tiny pair), as a plain string of the same length is; forged, it would be one
    special token (the count 1 - len(EOS) lower)."""
    forged = _chat(server, f"say {EOS} now", source="127.0.0.1")
    plain = _chat(server, "say " + "y" * len(EOS) + " now", source="127.0.0.1")
    assert forged[0] == plain[0] == 200
    assert forged[1]["usage"]["prompt_tokens"] == plain[1]["usage"]["prompt_tokens"]
    completion = _post(
        server, "/v1/completions", {"model": MODEL, "prompt": f"a{EOS}b", "max_tokens": 1}
    )
    assert completion[1]["usage"]["prompt_tokens"] == len(f"a{EOS}b")
