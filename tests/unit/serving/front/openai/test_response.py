"""front.openai.response: the answer bodies in the OpenAI API's shape; an unset field is left
out (a chunk's `usage` only when asked for), a None one is null."""

from __future__ import annotations

from avspec.serving.front.openai.response import (
    ChatChunkChoice,
    Completion,
    Delta,
    Speculative,
    TokenOrigin,
    Usage,
)


def chunk(**extra: object) -> dict:
    choice = ChatChunkChoice(index=0, delta=Delta(content="hi"), logprobs=None, finish_reason=None)
    return Completion(
        id="chatcmpl-1", object="chat.completion.chunk", created=1, model="m", choices=[choice],
        **extra,
    ).body()  # fmt: skip


def test_a_chunk_has_usage_only_when_asked_and_its_delta_only_what_it_adds():
    plain = chunk()
    assert "usage" not in plain and "speculative" not in plain
    assert plain["choices"] == [
        {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
    ]
    assert chunk(usage=None)["usage"] is None
    assert Delta().body() == {} and Delta(role="assistant", content="").body() == {
        "role": "assistant", "content": "",
    }  # fmt: skip


def test_speculative_figures_carry_tokens_only_in_a_step():
    figures = {"drafted_tokens": 3, "verified_tokens": 2, "accepted_tokens": 1, "steps": 1}
    assert Speculative(**figures).body() == figures
    tokens = [TokenOrigin(text="a", draft=True)]
    assert Speculative(**figures, tokens=tokens).body()["tokens"] == [{"text": "a", "draft": True}]
    whole = chunk(usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
