"""front.openai.context: the model a request names is served only if public: an unknown one is 404
`model_not_found`, an internal one 403; with the official `openai` client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import openai
import pytest

from avspec.serving.front.config import FrontConfig
from avspec.serving.front.openai.context import MAX_WAITING_PER_IDENTITY, Context
from avspec.serving.front.openai.errors import OpenAIError


def test_unknown_model_is_404_and_internal_403(client, fake_http):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="specultive", prompt="x", max_tokens=4)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(
            model="draft", messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    assert not fake_http.requests


def test_prepare_runs_off_the_loop_one_request_of_a_client_at_a_time():
    """Context.prepare: the work runs on the pool (never the event loop's thread); two jobs of
    one identity never overlap while another identity's runs beside them; past
    MAX_WAITING_PER_IDENTITY waiting, 429 at once."""
    context = Context(FrontConfig("127.0.0.1", 0, 0, "127.0.0.1:1", "127.0.0.1:1"), None)
    running: Counter[str] = Counter()
    overlaps, threads = [], set()

    def job(identity: str):
        def work() -> str:
            threads.add(threading.current_thread().name)
            running[identity] += 1
            overlaps.append(running[identity])
            time.sleep(0.05)
            running[identity] -= 1
            return identity

        return work

    async def scenario() -> list:
        loop_thread = threading.current_thread().name
        jobs = [context.prepare(i, job(i)) for i in ("a", "a", "a", "b", "b")]
        done = await asyncio.gather(*jobs)
        flood = [context.prepare("c", lambda: "c") for _ in range(2 + MAX_WAITING_PER_IDENTITY)]
        results = await asyncio.gather(*flood, return_exceptions=True)
        assert loop_thread not in threads
        return [done, results]

    done, results = asyncio.run(scenario())
    context.close()
    assert done == ["a", "a", "a", "b", "b"] and max(overlaps) == 1
    refused = [r for r in results if isinstance(r, OpenAIError)]
    assert len(refused) == 1 and refused[0].status == 429
