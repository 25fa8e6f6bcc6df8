"""front.openai.request: a value the entry cannot honour (or a reserved field) is a 400 naming the
field, and nothing is sent upstream; with the official `openai` client.
"""

from __future__ import annotations

import openai
import pytest
from helpers.clients import MODEL


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
