"""front.schema: the generate body schema (read from the model's config.pbtxt) and the check of
every /generate and /generate_stream body, alone and at the front (400 naming the field, nothing
forwarded).

Before (issue 20, finding 6): a lone surrogate escape in `text_input` got 500 from Triton's
parser; now the front answers 400 naming the field.
"""

from __future__ import annotations

import json

import pytest
from helpers import ROOT
from helpers.front_fakes import post, request

from avspec.serving.front import (
    DEFAULT_GENERATE_SCHEMA,
    InputSpec,
    check_generate_body,
    generate_schema_from_config,
)

GENERATE = "/v2/models/speculative/generate"


def test_default_schema_matches_the_speculative_config():
    text = (ROOT / "model_repository" / "speculative" / "config.pbtxt").read_text()
    assert generate_schema_from_config(text) == dict(DEFAULT_GENERATE_SCHEMA)


def test_schema_from_config_handles_comments_and_nested_blocks():
    text = """
    # input [ { name: "commented" data_type: TYPE_FP32 } ]
    name: "m#1"
    input: [
      { name: "a" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } },
      { name: "b" # trailing comment
        data_type: TYPE_FP32 dims: [ 1 ] optional: true }
    ]
    output [ { name: "c" data_type: TYPE_STRING dims: [ 1 ] } ]
    """
    assert generate_schema_from_config(text) == {
        "a": InputSpec("TYPE_INT64"),
        "b": InputSpec("TYPE_FP32", required=False),
    }


def test_schema_accepts_good_values():
    body = {
        "text_input": "x",
        "max_tokens": 2**31 - 1,
        "temperature": 0,
        "top_p": 0.9,
        "random_seed": 2**64 - 1,
        "stream": False,
    }
    assert check_generate_body(json.dumps(body).encode(), DEFAULT_GENERATE_SCHEMA) == body


def test_schema_refuses_the_identity_field():
    body = json.dumps({"text_input": "x", "max_tokens": 1, "avspec-client": "me"}).encode()
    with pytest.raises(ValueError, match="avspec-client"):
        check_generate_body(body, DEFAULT_GENERATE_SCHEMA)


@pytest.mark.parametrize(
    ("text", "where"),
    [('"\\ud800"', "at character 0"), ('"ab\\udc00"', "at character 2")],
)
def test_schema_refuses_a_lone_surrogate_naming_the_field(text, where):
    body = ('{"text_input": ' + text + ', "max_tokens": 1}').encode()
    with pytest.raises(ValueError, match="'text_input'.*surrogate") as err:
        check_generate_body(body, DEFAULT_GENERATE_SCHEMA)
    assert where in str(err.value)


@pytest.mark.parametrize(
    ("fragment", "field"),
    [
        ('"max_tokens": "8"', "max_tokens"),
        ('"max_tokens": 8, "temperature": "NaN"', "temperature"),
        ('"max_tokens": 8, "temperature": NaN', "temperature"),
        ('"max_tokens": 8, "temperature": -Infinity', "temperature"),
        ('"max_tokens": 8, "temperature": 1e39', "temperature"),
        ('"max_tokens": 8, "random_seed": -1', "random_seed"),
        ('"max_tokens": 8, "stream": "yes"', "stream"),
        ('"max_tokens": 8, "stream": 1', "stream"),
        ('"max_tokens": 4294967300', "max_tokens"),
        ('"max_tokens": true', "max_tokens"),
        ('"max_tokens": 8, "avspec-client": "x"', "avspec-client"),
        ('"temperature": 1.0', "max_tokens"),
    ],
)
def test_bad_generate_body_gets_400_naming_the_field(front, fake_http, fragment, field):
    body = ('{"text_input": "hi", ' + fragment + "}").encode()
    for path in ("/v2/models/speculative/generate", "/v2/models/speculative/generate_stream"):
        status, payload, _ = request(front.http_port, "POST", path, body)
        assert status == 400 and repr(field) in payload["error"], payload
    assert not fake_http.requests


@pytest.mark.parametrize("body", [b"[1]", b"not json", b'{"text_input": "a", "text_input": "b"}'])
def test_generate_body_must_be_one_json_object(front, body):
    status, payload, _ = request(front.http_port, "POST", "/v2/models/speculative/generate", body)
    assert status == 400 and payload["error"]


def test_a_lone_surrogate_is_400_naming_the_field(front, fake_http):
    body = b'{"text_input": "a\\ud800", "max_tokens": 4}'
    head, answer = post(front.http_port, GENERATE, body)
    assert head.startswith(b"HTTP/1.1 400 ")
    assert "'text_input'" in json.loads(answer)["error"] and "surrogate" in answer.decode()
    assert not fake_http.requests
    pair = b'{"text_input": "\\ud83d\\ude00", "max_tokens": 4}'  # a valid pair passes
    assert post(front.http_port, GENERATE, pair)[0].startswith(b"HTTP/1.1 200 ")
