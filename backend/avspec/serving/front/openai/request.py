# mypy: disable-error-code="valid-type"
"""The bodies of `/v1/completions` and `/v1/chat/completions`, as typed schemas (pydantic).

What is accepted is what the entry model can honour: `max_tokens` (chat also
`max_completion_tokens`), `temperature` (0..2, as OpenAI), `top_p` (0..1], `seed`, `stop` (a
string or up to 4), `n` 1, `stream` with `stream_options.include_usage`. Parameters the entry
cannot honour are refused unless they carry their neutral value (penalties 0, no logprobs, no
logit bias, `best_of` 1, ...), and an unknown field is refused as the OpenAI API refuses it: a
client never gets a silently different answer. The speculative settings of the entry
(`num_draft_tokens`, `adaptive_verification`, `adaptive_drafting`) and vLLM's `ignore_eos` are
accepted as extra fields (the official client's `extra_body`). Validation is strict, as JSON
types are: `1.0` is no `n`, `0` no `stream`. Each field's `description` is the rule a refusal
states (front.openai.validation turns a ValidationError into the 400 naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from avspec.serving.front.openai.validation import validated
from avspec.serving.front.schema import unicode_problem

MAX_STOPS = 4
MAX_MESSAGES = 1024  # a conversation's messages (each one costs the template a loop turn)
INT32_MAX = (1 << 31) - 1
SEED_SPAN = 1 << 64
EXTRAS = ("num_draft_tokens", "adaptive_verification", "adaptive_drafting", "ignore_eos")
ROLES = ("system", "developer", "user", "assistant", "tool")


def _unicode(text: str) -> str:
    problem = unicode_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


Text = Annotated[str, AfterValidator(_unicode)]  # text for the model: no lone surrogate
NonEmpty = Annotated[str, Field(min_length=1)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]


def _only(value: Any) -> Any:
    """A parameter the entry cannot honour, accepted only as this very JSON value: `0.0`,
    `false` and `0` are three different answers."""

    def same(given: Any) -> Any:
        if given != value:
            raise ValueError(f"is not supported by this server (only {value!r})")
        return given

    return Annotated[type(value), AfterValidator(same)]


def _unsupported(value: Any) -> Any:
    return Field(None, description=f"is not supported by this server (only {value!r})")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    RULE: ClassVar[str] = 'must be {"include_usage": a boolean}'

    include_usage: bool = Field(False, description="must be a boolean")


class _Request(BaseModel):
    """What both routes take: the model, sampling, streaming, and the entry's settings."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    model: NonEmpty = Field(description="must be a non-empty string (see GET /v1/models)")
    max_tokens: Count | None = Field(None, description=f"must be an integer in [1, {INT32_MAX}]")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(
        None, description="must be a number in [0, 2]"
    )
    top_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="must be a number in [0, 1]"
    )
    seed: Annotated[int, Field(ge=-(1 << 63), lt=SEED_SPAN)] | None = Field(
        None, description="must be a 64-bit integer"
    )
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOPS)] | None = Field(
        None, description=f"must be a non-empty string or up to {MAX_STOPS} of them"
    )
    n: Annotated[int, Field(ge=1, le=1)] | None = Field(
        None, description="must be the integer 1: this server returns one choice"
    )
    stream: bool | None = Field(None, description="must be a boolean")
    stream_options: StreamOptions | None = Field(
        None, description="is only allowed when stream is true"
    )
    presence_penalty: _only(0) | None = _unsupported(0)
    frequency_penalty: _only(0) | None = _unsupported(0)
    logit_bias: _only({}) | None = _unsupported({})
    logprobs: _only(False) | _only(0) | None = _unsupported(0)
    user: Any = None  # taken as sent and not used, as before
    # the entry's speculative settings (its inputs' types; the entry checks their ranges)
    num_draft_tokens: Annotated[int, Field(ge=-(1 << 31), le=INT32_MAX)] | None = Field(
        None, description=f"must be an integer in [{-(1 << 31)}, {INT32_MAX}]"
    )
    adaptive_verification: bool | None = Field(None, description="must be a boolean")
    adaptive_drafting: bool | None = Field(None, description="must be a boolean")
    ignore_eos: bool | None = Field(None, description="must be a boolean")  # vLLM's name

    @field_validator("top_p")
    @classmethod
    def _top_p_in_float32(cls, top_p: float | None) -> float | None:
        if top_p is not None and not np.float32(top_p) > 0:  # the entry samples in float32
            raise ValueError("must be in (0, 1] (at least about 1.4e-45)")
        return top_p

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true")
        return options

    def sampling(self, max_tokens: int) -> Sampling:
        """How to generate `max_tokens` at most (the route picks it, or its default)."""
        extras = {name: getattr(self, name) for name in EXTRAS if getattr(self, name) is not None}
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            seed=None if self.seed is None else self.seed % SEED_SPAN,
            stop=tuple(dict.fromkeys(stops)),
            stream=bool(self.stream),
            include_usage=self.stream_options is not None and self.stream_options.include_usage,
            extras=extras,
        )


class CompletionRequest(_Request):
    """A `/v1/completions` body: one prompt."""

    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)] = Field(
        description="must be a non-empty string (one prompt per request)"
    )
    echo: _only(False) | None = _unsupported(False)
    suffix: _only("") | None = _unsupported("")
    best_of: _only(1) | None = _unsupported(1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if not (prompt if isinstance(prompt, str) else prompt[0]):
            raise ValueError("must be a non-empty string (one prompt per request)")
        return prompt

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class TextPart(BaseModel):
    """A content part of a message: only text."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    RULE: ClassVar[str] = 'must be a text part {"type": "text", "text": a string}'

    type: Literal["text"] = Field(description='must be "text": only text parts are supported')
    text: Text = Field(description="must be a string")


class Message(BaseModel):
    """A chat message; its other fields go to the chat template as sent."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    RULE: ClassVar[str] = "must be an object with role and content"

    role: Literal[ROLES] = Field(description=f"must be one of {sorted(ROLES)}")
    content: Text | list[TextPart] | None = Field(
        None,
        validate_default=True,
        description="must be a string or an array of text parts",
    )

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(
        cls, content: str | list[TextPart] | None, info: ValidationInfo
    ) -> str | list[TextPart] | None:
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("must be a string (only an assistant's may be null)")
        return content

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template gets it: its content one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or "", **(self.model_extra or {})}


class ChatRequest(_Request):
    """A `/v1/chat/completions` body: a conversation."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] = Field(
        description=f"must be a non-empty array of at most {MAX_MESSAGES} messages"
    )
    max_completion_tokens: Count | None = Field(
        None, description=f"must be an integer in [1, {INT32_MAX}]"
    )
    top_logprobs: _only(0) | None = _unsupported(0)
    response_format: _only({"type": "text"}) | None = _unsupported({"type": "text"})

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]


@dataclass(frozen=True)
class Sampling:
    """How to generate: the entry's inputs, plus what the front applies itself (stop strings,
    streaming and usage)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # already in 0..2^64-1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # the entry's speculative settings


def parse_completion(body: bytes, default_max_tokens: int) -> tuple[CompletionRequest, Sampling]:
    """A `/v1/completions` body and its sampling; OpenAIError 400 naming the wrong field."""
    request = validated(CompletionRequest, body)
    return request, request.sampling(request.max_tokens or default_max_tokens)


def parse_chat(body: bytes, default_max_tokens: int) -> tuple[ChatRequest, Sampling]:
    """A `/v1/chat/completions` body and its sampling; OpenAIError 400 naming the wrong field."""
    request = validated(ChatRequest, body)
    max_tokens = request.max_completion_tokens or request.max_tokens or default_max_tokens
    return request, request.sampling(max_tokens)
