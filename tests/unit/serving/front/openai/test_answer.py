"""front.openai.answer: generations answered in OpenAI's shape, with the official `openai` client
against a fake entry: an event stream ends with `data: [DONE]`; an error after the stream
started (a stage failed, Front.abort_inference) is its last event, before it a status; and a
client keeps one connection for all its requests.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest
from helpers.clients import MODEL


def test_stream_ends_with_done_on_the_wire(openai_front):
    connection = http.client.HTTPConnection("127.0.0.1", openai_front.http_port, timeout=10)
    body = {"model": MODEL, "prompt": "blocks:ab|", "stream": True, "max_tokens": 4}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in response.read().split(b"\n\n") if line]
    connection.close()
    assert all(event.startswith(b"data: ") for event in events)
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "stop"


def test_a_stage_failing_mid_stream_ends_the_stream_with_an_error(client):
    stream = client.completions.create(
        model=MODEL, prompt="blocks:ab,!boom|", max_tokens=8, stream=True
    )
    with pytest.raises(openai.APIError, match="generation failed: boom"):
        for _ in stream:
            pass
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="blocks:ab,!boom|", max_tokens=8)
    assert err.value.status_code == 500


def test_abort_mid_stream_ends_it_with_the_message(openai_front, client, fake_http):
    stream = client.completions.create(
        model=MODEL, prompt="blocks:ab,~|", max_tokens=8, stream=True
    )
    first = next(iter(stream))
    assert first.choices[0].text == "ab"
    aborted = []
    timer = threading.Timer(0.2, lambda: aborted.append(openai_front.abort_inference("lost")))
    timer.start()
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="lost"):
        for _ in stream:
            pass
    timer.join()
    assert time.monotonic() - started < 3 and aborted == [1]
    assert fake_http.disconnected.wait(3)  # the upstream call was closed


def test_one_client_keeps_one_connection(openai_front, client):
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="blocks:a|", max_tokens=2)
    assert openai_front._http._slots.held("127.0.0.1") == 1
