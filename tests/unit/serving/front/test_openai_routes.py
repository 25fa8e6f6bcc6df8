"""The front's OpenAI-compatible routes with the official `openai` client, against a fake entry.

The fake streams decode steps as the entry does (helpers.front_fakes.blocks: accepted drafts
then one target token per step, one byte-tokenizer token per character), so stop strings can be
placed across and inside blocks. The same routes against the real server:
tests/serving/test_openai.py.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest
from helpers.front_fakes import MAX_BODY, front_config
from helpers.hf_dirs import EOS, byte_tokenizer

from avspec.serving.front import Front
from avspec.serving.server_process import free_port

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL = "speculative"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pair")
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = {"eos_token": EOS, "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def openai_front(fake_http, fake_grpc, tokenizer_dir, state):
    config = front_config(
        fake_http,
        fake_grpc,
        tokenizer_dir=tokenizer_dir,
        internal_models=("draft",),
        ready=lambda: state["ready"],
    )
    with Front(config) as running:
        yield running


def official_client(front: Front) -> openai.OpenAI:
    """The official client on `front`'s /v1 (no retries: each call is one request)."""
    url = f"http://127.0.0.1:{front.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


@pytest.fixture
def client(openai_front):
    with official_client(openai_front) as official:
        yield official


def prompt_tokens(text: str) -> int:
    return len(byte_tokenizer().encode(text).ids)


def test_models_lists_the_public_model(client):
    assert [model.id for model in client.models.list()] == [MODEL]


def test_completion_text_usage_and_speculative_figures(client, fake_http):
    prompt = "blocks:ab,cde,f|"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == ("abcdef", "stop")  # the entry ended: EOS
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens == prompt_tokens(prompt)
    assert response.usage.total_tokens == prompt_tokens(prompt) + 6
    assert response.speculative == {
        "drafted_tokens": 3 + 4 + 2,
        "verified_tokens": 2 + 3 + 1,
        "accepted_tokens": 1 + 2 + 0,
        "steps": 3,
    }
    (seen,) = fake_http.requests
    assert seen.path == "/v2/models/speculative/generate_stream"
    sent = json.loads(seen.body)
    assert sent["avspec-client"] == "127.0.0.1" and sent["stream"] is True  # identity, as /v2
    assert (sent["text_input"], sent["max_tokens"]) == (prompt, 16)


def test_stop_string_split_across_blocks(client):
    response = client.completions.create(
        model=MODEL, prompt="blocks:abX,Ycd,ef|", max_tokens=16, stop=["XY", "zz"]
    )
    assert (response.choices[0].text, response.choices[0].finish_reason) == ("ab", "stop")
    # a, b, X, Y: the block "Ycd" completes the stop with its first token; c and d not counted
    assert response.usage.completion_tokens == 4


def test_stop_string_inside_one_accepted_block(client):
    response = client.completions.create(
        model=MODEL, prompt="blocks:ab,cSTOPde,f|", max_tokens=16, stop="STOP"
    )
    assert response.choices[0].text == "abc"
    assert response.usage.completion_tokens == 2 + 5  # up to the P of STOP, not d and e


def test_stop_is_held_back_while_streaming_and_never_sent(client):
    stream = client.completions.create(
        model=MODEL, prompt="blocks:aS,TO,Pz|", max_tokens=16, stop="STOP", stream=True
    )
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert "".join(texts) == "a" and not any("S" in text for text in texts)


def test_max_tokens_inside_a_block_is_length_with_exact_usage(client):
    response = client.completions.create(model=MODEL, prompt="blocks:ab,cdefg,h|", max_tokens=4)
    assert (response.choices[0].text, response.choices[0].finish_reason) == ("abcd", "length")
    assert response.usage.completion_tokens == 4


def test_chat_uses_the_template_and_streams_role_first(client, fake_http):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "blocks:hel,lo|"},
        ],
        max_completion_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    rendered = json.loads(fake_http.requests[0].body)["text_input"]
    assert rendered == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nblocks:hel,lo|<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # each step's tokens and whether they were accepted drafts, for the playground
    steps = [c.speculative["tokens"] for c in chunks if c.choices and c.choices[0].delta.content]
    assert steps == [
        [{"text": "h", "draft": True}, {"text": "e", "draft": True}, {"text": "l", "draft": False}],
        [{"text": "l", "draft": True}, {"text": "o", "draft": False}],
    ]


def test_stream_ends_with_done_on_the_wire(openai_front):
    connection = http.client.HTTPConnection("127.0.0.1", openai_front.http_port, timeout=10)
    body = {"model": MODEL, "prompt": "blocks:ab|", "stream": True, "max_tokens": 4}
    connection.request("POST", "/v1/completions", json.dumps(body))
    response = connection.getresponse()
    assert response.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in response.read().split(b"\n\n") if line]
    connection.close()
    assert all(event.startswith(b"data: ") for event in events)
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"avspec-client": "someone"}, "avspec-client"),
        ({"num_draft_tokens": "8"}, "num_draft_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_values_are_400_naming_the_field(client, fake_http, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert err.value.body["type"] == "invalid_request_error"
    assert not fake_http.requests


def test_unknown_model_is_404_and_internal_403(client, fake_http):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="specultive", prompt="x", max_tokens=4)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(
            model="draft", messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    assert not fake_http.requests


def test_overloaded_entry_is_503_with_retry_after(client):
    prompt = "error:400:overloaded: 64 requests queued for this client (limit 64); retry later"
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=stream)
        assert err.value.status_code == 503
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.body["message"].startswith("overloaded")


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


def test_restarting_stage_is_503_in_openai_shape(client, state, fake_http):
    state["ready"] = False
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert err.value.status_code == 503 and "restarting" in err.value.body["message"]
    assert err.value.response.headers["retry-after"] == "1"
    assert not fake_http.requests


def test_no_chat_template_is_400(fake_http, fake_grpc, tmp_path):
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    config = front_config(fake_http, fake_grpc, tokenizer_dir=tmp_path)
    with Front(config) as front, official_client(front) as official:
        with pytest.raises(openai.BadRequestError) as err:
            official.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4
            )
        assert err.value.body["code"] == "no_chat_template"
        completion = official.completions.create(model=MODEL, prompt="blocks:a|")
        assert completion.choices[0].text == "a"


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


def test_the_playground_page_is_served_at_the_root(openai_front):
    connection = http.client.HTTPConnection("127.0.0.1", openai_front.http_port, timeout=10)
    connection.request("GET", "/")
    response = connection.getresponse()
    page = response.read()
    connection.close()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/html")
    assert "connect-src 'self'" in response.getheader("Content-Security-Policy")
    assert b"/v1/chat/completions" in page


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
