"""The OpenAI-compatible routes through the real server, with the official `openai` client.

The session's tiny pair has a byte tokenizer (one token per character of its printable output)
and, for these tests, a ChatML template (helpers.server.CHAT_TEMPLATE). Greedy decoding with
adaptive verification off and 8 drafts per step makes the decode steps (blocks of accepted
drafts plus one target token) repeat from request to request, so stop strings and max_tokens can
be placed across and inside a block that a stream showed.
"""

from __future__ import annotations

import http.client
import json

import openai
import pytest
from helpers.clients import http_generate

from avspec.serving.host.server_process import ServerProcess

MODEL = "speculative"
PROMPT = "def parse(line):\n    "
FIXED = {"temperature": 0.0, "extra_body": {"adaptive_verification": False, "num_draft_tokens": 8}}


@pytest.fixture
def client(server: ServerProcess):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0) as official:
        yield official


# Prompts whose greedy continuation on the tiny pair has blocks of three or more tokens (most
# steps of the tiny pair accept no draft); the first that serves a test is used.
BLOCKY_PROMPTS = ("    ", "The ", "}}}}}}}}", "aaaaaaaaaaaaaaaa", PROMPT)


def blocks(client: openai.OpenAI, prompt: str = PROMPT, max_tokens: int = 48) -> list[str]:
    """The text of each decode step of `prompt`, as the stream's chunks carry them."""
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, **FIXED
    )
    return [chunk.choices[0].text for chunk in stream if chunk.choices and chunk.choices[0].text]


def inside_a_block(client: openai.OpenAI) -> tuple[str, list[str], int, str]:
    """(prompt, its steps, where a stop string starts, the stop string): the stop starts at a
    block's second token, is found there first, and the block goes on past it."""
    for prompt in BLOCKY_PROMPTS:
        steps = blocks(client, prompt)
        text = "".join(steps)
        for i, step in enumerate(steps):
            start = sum(map(len, steps[:i])) + 1
            for length in range(1, len(step) - 1):
                stop = step[1 : 1 + length]
                if i and text.find(stop) == start:
                    return prompt, steps, start, stop
    raise AssertionError("no prompt of BLOCKY_PROMPTS has a block of three tokens")


def test_models(client):
    assert [model.id for model in client.models.list()] == [MODEL]


def test_completion_matches_v2_generate_with_exact_usage(server, client):
    reference = http_generate(server.http_url, text_input=PROMPT, max_tokens=24, temperature=0.0)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **FIXED)
    (choice,) = response.choices
    assert choice.text == reference.text
    assert choice.finish_reason == ("length" if len(choice.text) == 24 else "stop")
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), len(choice.text))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    figures = response.speculative
    assert figures["steps"] >= 1 and figures["verified_tokens"] <= figures["drafted_tokens"]
    assert figures["accepted_tokens"] <= figures["verified_tokens"]


def test_stream_is_the_same_text_in_steps(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, **FIXED)
    steps = blocks(client, max_tokens=32)
    assert "".join(steps) == whole.choices[0].text
    assert len(steps) < len(whole.choices[0].text)  # some steps carried accepted drafts


def test_stop_string_split_across_two_blocks(client):
    steps = blocks(client)
    text = "".join(steps)
    ends = [sum(map(len, steps[: i + 1])) for i in range(len(steps) - 1)]
    # a stop string made of a block's last character and the next block's first, found first there
    cut = next(end for end in ends if text.find(text[end - 1 : end + 1]) == end - 1)
    stop = text[cut - 1 : cut + 1]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=48, stop=stop, **FIXED
    )
    assert response.choices[0].text == text[: cut - 1]
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == cut + 1  # the tokens up to the stop's last one


def test_stop_string_inside_a_block_of_accepted_drafts(client):
    prompt, steps, start, stop = inside_a_block(client)
    text = "".join(steps)
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, stop=[stop, "\x00"], stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}), **FIXED,
        )  # fmt: skip
        if stream:
            chunks = list(response)
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            got, usage = response.choices[0].text, response.usage
        assert got == text[:start], (steps, stop)
        # the tokens up to the stop's last one; the rest of its block is not counted
        assert usage.completion_tokens == start + len(stop)


def test_max_tokens_inside_a_block_counts_exactly(client):
    prompt, steps, start, _ = inside_a_block(client)
    text = "".join(steps)
    max_tokens = start + 1  # two tokens into a block of three or more
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **FIXED)
    assert response.choices[0].text == text[:max_tokens]
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == max_tokens


def test_chat_stream_role_first_usage_last(client):
    messages = [{"role": "user", "content": "Write a loop."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **FIXED)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **FIXED,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    prompt = "<|im_start|>user\nWrite a loop.<|im_end|>\n<|im_start|>assistant\n"
    assert whole.usage.prompt_tokens == len(prompt)  # the template's text, byte tokens


def test_raw_stream_ends_with_done(server):
    host, port = server.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}
    headers = {"Content-Type": "application/json"}
    connection.request("POST", "/v1/completions", json.dumps(body), headers)
    events = [e for e in connection.getresponse().read().split(b"\n\n") if e]
    connection.close()
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events)


def test_errors_are_openai_error_objects(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="specultive", prompt=PROMPT, max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:  # the entry refuses: past max_context
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    assert "max_context" in err.value.body["message"]


def test_one_client_keeps_its_connection(server, client):
    slots = server.front._http._slots  # the front's open connections per address
    before = slots.held("127.0.0.1")
    for _ in range(3):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **FIXED)
    assert slots.held("127.0.0.1") == before + 1
