"""The front's generate body schema (front.schema) and its policy helpers (front.policy)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT

from avspec.serving.front import (
    DEFAULT_GENERATE_SCHEMA,
    InputSpec,
    check_generate_body,
    generate_schema_from_config,
)
from avspec.serving.front.policy import grpc_peer_ip, http_identity


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
    ("host", "identity"),
    [
        ("10.0.0.7", "10.0.0.7"),
        ("::ffff:10.0.0.7", "10.0.0.7"),  # a dual-stack listener's view of an IPv4 client
        ("2001:db8::1", "2001:db8::1"),
        ("fe80::1%eth0", "fe80::1%eth0"),
    ],
)
def test_http_identity_is_the_ip(host, identity):
    assert http_identity(host) == identity


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
    ("peer", "ip"),
    [
        ("ipv4:10.0.0.7:51234", "10.0.0.7"),
        ("ipv6:[2001:db8::1]:51234", "2001:db8::1"),
        ("ipv6:%5B::ffff:10.0.0.7%5D:51234", "10.0.0.7"),  # brackets %-encoded, IPv4-mapped
        ("unix:/run/x.sock", "unix:/run/x.sock"),
    ],
)
def test_grpc_peer_ip_drops_the_port(peer, ip):
    assert grpc_peer_ip(peer) == ip
