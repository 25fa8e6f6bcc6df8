"""A Generation answered in OpenAI's shape: one JSON object, or server-sent event chunks.

Streaming follows the OpenAI API: `data: {chunk}` events (a chat stream opens with the
assistant's role), the last choice chunk carries `finish_reason`, then, with
`stream_options.include_usage`, a chunk with no choices and the usage, then `data: [DONE]`.
The stream starts only once the entry accepted the request and sent its first step, so a refusal
(overloaded, a bad value) is an HTTP status with an OpenAI error object, never a 200. An error
after that (a stage failed, Front.abort_inference) is a last event `data: {"error": {...}}`,
without `[DONE]`, which the official client raises as an error.

Every object carries `speculative`: drafted, verified and accepted tokens and decode steps (the
request's totals; in a stream chunk, those of its step, and `tokens`: each token's text and
whether it was an accepted draft), as TensorRT-LLM's server reports its decoded tokens per step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from avspec.serving.front.inflight import Abortable
from avspec.serving.front.openai.errors import OpenAIError
from avspec.serving.front.openai.generation import Figures, Generation, Step
from avspec.serving.front.openai.response import (
    ChatChoice,
    ChatChunkChoice,
    ChatMessage,
    Completion,
    CompletionChoice,
    Delta,
    Speculative,
    TokenOrigin,
    Usage,
)


@dataclass(frozen=True)
class Shape:
    """What differs between the routes: object names and where the text goes."""

    prefix: str  # of the response id
    object: str  # of a whole response
    chunk_object: str  # of a stream chunk
    chat: bool  # text in `message` / `delta` (chat) or `text` (completions)

    def choice(self, text: str, finish_reason: str | None) -> CompletionChoice | ChatChoice:
        if self.chat:
            message = ChatMessage(role="assistant", content=text)
            return ChatChoice(index=0, message=message, logprobs=None, finish_reason=finish_reason)
        return CompletionChoice(index=0, text=text, logprobs=None, finish_reason=finish_reason)

    def chunk_choice(
        self, delta: Delta, finish_reason: str | None
    ) -> CompletionChoice | ChatChunkChoice:
        if self.chat:
            return ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=finish_reason)
        text = delta.content or ""
        return CompletionChoice(index=0, text=text, logprobs=None, finish_reason=finish_reason)


COMPLETION = Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


class Answer:
    """Answers one generation on one request; `write_timeout_s` bounds every write."""

    def __init__(
        self,
        request: web.BaseRequest,
        shape: Shape,
        model: str,
        generation: Generation,
        identity: str,
        call: Abortable | None,
        write_timeout_s: float,
    ) -> None:
        self.request, self.shape, self.model, self.generation = request, shape, model, generation
        self.identity, self.call, self.write_timeout_s = identity, call, write_timeout_s
        self.id = shape.prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self._stream: web.StreamResponse | None = None

    async def run(self) -> web.StreamResponse:
        try:
            if self.generation.sampling.stream:
                return await self._streamed()
            return await self._whole()
        except OpenAIError as err:
            return await self._fail(err)
        except asyncio.CancelledError:
            if self.call is None or not self.call.resume():
                raise  # the client went away, or the front stops
            assert self.call.message is not None
            return await self._fail(OpenAIError(503, self.call.message, code="aborted"))

    def _object(self, object_name: str, choices: list, **extra: object) -> dict:
        answer = Completion(
            id=self.id,
            object=object_name,  # type: ignore[arg-type]
            created=self.created,
            model=self.model,
            choices=choices,
            **extra,  # type: ignore[arg-type]
        )
        return answer.body()

    def _usage(self) -> Usage:
        return Usage(**self.generation.usage())

    async def _whole(self) -> web.StreamResponse:
        steps = [step async for step in self.generation.steps(self.identity)]
        text = "".join(step.text for step in steps)
        body = self._object(
            self.shape.object,
            [self.shape.choice(text, self.generation.finish_reason)],
            usage=self._usage(),
            speculative=_speculative(self.generation.figures),
        )
        return web.json_response(body)

    async def _streamed(self) -> web.StreamResponse:
        steps = self.generation.steps(self.identity)
        try:
            first = await anext(steps, None)  # a refusal of the entry raises here: a status
            self._stream = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self._stream.prepare(self.request)
            if self.shape.chat:
                await self._chunk(
                    [self.shape.chunk_choice(Delta(role="assistant", content=""), None)]
                )
            if first is not None:
                await self._send_step(first)
            async for step in steps:
                await self._send_step(step)
        finally:
            await steps.aclose()
        await self._chunk([self.shape.chunk_choice(Delta(), self.generation.finish_reason)])
        if self.generation.sampling.include_usage:
            speculative = _speculative(self.generation.figures)
            await self._event(
                self._object(
                    self.shape.chunk_object, [], usage=self._usage(), speculative=speculative
                )
            )
        await self._write(b"data: [DONE]\n\n")
        await self._stream.write_eof()
        return self._stream

    async def _send_step(self, step: Step) -> None:
        tokens = [TokenOrigin(text=piece.text, draft=piece.draft) for piece in step.pieces]
        speculative = _speculative(step.figures, tokens)
        choice = self.shape.chunk_choice(Delta(content=step.text), None)
        await self._chunk([choice], speculative=speculative)

    async def _chunk(self, choices: list, **extra: object) -> None:
        if self.generation.sampling.include_usage:
            extra = {"usage": None, **extra}
        await self._event(self._object(self.shape.chunk_object, choices, **extra))

    async def _event(self, payload: dict) -> None:
        await self._write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    async def _write(self, data: bytes) -> None:
        assert self._stream is not None
        async with asyncio.timeout(self.write_timeout_s):  # a client that stopped reading
            await self._stream.write(data)

    async def _fail(self, error: OpenAIError) -> web.StreamResponse:
        """The error as a status before the stream started, as a last event after."""
        if self._stream is None or not self._stream.prepared:
            return error.response()
        await self._event(error.body())
        await self._stream.write_eof()
        return self._stream


def _speculative(figures: Figures, tokens: list[TokenOrigin] | None = None) -> Speculative:
    if tokens is None:
        return Speculative(**figures.as_dict())  # type: ignore[arg-type]
    return Speculative(**figures.as_dict(), tokens=tokens)
