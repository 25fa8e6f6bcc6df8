"""front.openai.request: a value the entry cannot honour (or a reserved field) is a 400 naming the
field, and nothing is sent upstream; with the official `openai` client.
"""

from __future__ import annotations

import json

import openai
import pytest
from helpers.clients import MODEL

from avspec.serving.front.openai.errors import OpenAIError
from avspec.serving.front.openai.request import parse_chat, parse_completion


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
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_values_are_400_naming_the_field(client, fake_http, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert err.value.body["type"] == "invalid_request_error"
    assert not fake_http.requests


# -- the schemas themselves (front.openai.request, front.openai.validation), server-free ---------


def refusal(parse, body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse(json.dumps(body).encode(), 16)
    assert err.value.status == 400
    return err.value


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"messages": [1]}, "messages[0]", "messages[0] must be an object with role and content"),
        ({"messages": [{"role": "x", "content": "a"}]}, "messages[0].role", "must be one of"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "only an assistant's"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content",
            "must be a string or an array of text parts, got [{'type': 'image'}]",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content", "\\ud800"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
         "stream_options.include_usage must be a boolean, got 1"),
        ({"stream": True, "stream_options": {"x": 1}}, "stream_options", "takes no field 'x'"),
        ({"temperature": float("inf")}, "temperature", "temperature must be a number in [0, 2]"),
        ({"response_format": {"type": "json_object"}}, "response_format", "only {'type': 'text'}"),
        ({"messages": [], "surprise": 1}, "surprise", "unrecognized request argument"),
    ],
)  # fmt: skip
def test_a_chat_refusal_names_the_field_and_its_rule(extra, param, message):
    err = refusal(parse_chat, {**CHAT, **extra})
    assert err.param == param and message in err.message, err.message


def test_neutral_values_only_as_the_same_json_type():
    body = {"model": MODEL, "prompt": "x"}
    neutral = [("presence_penalty", 0), ("logprobs", False), ("logprobs", 0), ("echo", False),
               ("best_of", 1), ("logit_bias", {}), ("suffix", "")]  # fmt: skip
    for name, value in neutral:
        parse_completion(json.dumps({**body, name: value}).encode(), 16)
    for name, value in (("presence_penalty", 0.0), ("logprobs", 0.0), ("best_of", True)):
        assert refusal(parse_completion, {**body, name: value}).param == name


def test_a_valid_chat_becomes_its_sampling_and_template_messages():
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": content, "name": "x"}, {"role": "assistant"}],
        "max_completion_tokens": 5, "max_tokens": 7, "stop": ["s", "s"], "seed": -1,
        "stream": True, "stream_options": {"include_usage": True}, "num_draft_tokens": 3,
        "ignore_eos": True,
    }  # fmt: skip
    request, sampling = parse_chat(json.dumps(body).encode(), 16)
    assert request.template_messages() == [
        {"role": "user", "content": "ab", "name": "x"},
        {"role": "assistant", "content": ""},
    ]
    assert (sampling.max_tokens, sampling.stop, sampling.seed) == (5, ("s",), (1 << 64) - 1)
    assert sampling.stream and sampling.include_usage
    assert sampling.extras == {"num_draft_tokens": 3, "ignore_eos": True}
