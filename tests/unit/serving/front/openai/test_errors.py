"""front.openai.errors: the entry's errors and the front's own refusals on /v1 are OpenAI error
objects with the status they have on /v2 (503 with Retry-After for an overload, a restarting
stage or Triton unreachable; 413 for a body past the limit); with the official `openai` client.
"""

from __future__ import annotations

import openai
import pytest
from helpers.clients import MODEL
from helpers.front_fakes import MAX_BODY, front_config, official_client

from avspec.serving.front import Front
from avspec.serving.host.server_process import free_port


def test_overloaded_entry_is_503_with_retry_after(client):
    prompt = "error:400:overloaded: 64 requests queued for this client (limit 64); retry later"
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=stream)
        assert err.value.status_code == 503
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.body["message"].startswith("overloaded")


def test_restarting_stage_is_503_in_openai_shape(client, state, fake_http):
    state["ready"] = False
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert err.value.status_code == 503 and "restarting" in err.value.body["message"]
    assert err.value.response.headers["retry-after"] == "1"
    assert not fake_http.requests


def test_front_refusals_on_v1_are_openai_error_objects(fake_http, fake_grpc, tokenizer_dir):
    """Triton unreachable (restarting): 503 with Retry-After; a body past the limit: 413."""
    config = front_config(
        fake_http, fake_grpc, tokenizer_dir=tokenizer_dir, upstream_http=f"127.0.0.1:{free_port()}"
    )
    with Front(config) as front, official_client(front) as official:
        with pytest.raises(openai.InternalServerError) as err:
            official.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and "unreachable" in err.value.body["message"]
        assert err.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.APIStatusError) as err:
            official.completions.create(model=MODEL, prompt="x" * MAX_BODY, max_tokens=2)
        assert err.value.status_code == 413
        assert (
            err.value.body["type"] == "invalid_request_error"
            and "limit" in err.value.body["message"]
        )
