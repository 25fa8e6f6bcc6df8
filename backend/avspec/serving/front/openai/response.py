"""The bodies the OpenAI routes answer with, as typed schemas (pydantic), in the OpenAI API's shape.

A whole answer (`text_completion`, `chat.completion`), a stream chunk (`*.chunk`: a choice's
`delta` or `text`, or, last, only the usage), the model list, and what the front adds:
`speculative`, the drafted, verified and accepted tokens and decode steps (in a chunk, those of
its step and each token's text and origin). `body` gives the JSON object: a field left unset is
left out (a chunk's `usage` is there, as null, only when the client asked for usage), one set to
None is null.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True)

    def body(self) -> dict[str, Any]:
        """The JSON object: unset fields left out."""
        return self.model_dump(exclude_unset=True)


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenOrigin(_Body):
    """The text of one token, and whether it was an accepted draft."""

    text: str
    draft: bool


class Speculative(_Body):
    drafted_tokens: int
    verified_tokens: int
    accepted_tokens: int
    steps: int
    tokens: list[TokenOrigin] | None = None  # a stream chunk's, token by token


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class ChatMessage(_Body):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Body):
    index: int
    message: ChatMessage
    logprobs: None
    finish_reason: str | None


class Delta(_Body):
    """What a chat chunk adds to the message (the first: the role; the last: nothing)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: str | None


class Completion(_Body):
    """A whole answer, or (`object` ...chunk) one event of a stream."""

    id: str
    object: Literal["text_completion", "chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[CompletionChoice] | list[ChatChoice] | list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: Speculative | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]
