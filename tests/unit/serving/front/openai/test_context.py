"""front.openai.context: the model a request names is served only if public: an unknown one is 404
`model_not_found`, an internal one 403; with the official `openai` client.
"""

from __future__ import annotations

import openai
import pytest


def test_unknown_model_is_404_and_internal_403(client, fake_http):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="specultive", prompt="x", max_tokens=4)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(
            model="draft", messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    assert not fake_http.requests
