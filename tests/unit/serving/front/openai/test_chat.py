"""front.openai.chat: `POST /v1/chat/completions` renders the messages with the pair's chat
template (a 400 when the pair has none) and streams the assistant's role first, with the official
`openai` client against a fake entry.
"""

from __future__ import annotations

import json

import openai
import pytest
from helpers.clients import MODEL
from helpers.front_fakes import front_config, official_client
from helpers.hf_dirs import EOS, byte_tokenizer

from avspec.serving.front import Front


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
